r"""Embedding tables with deferred_grad: a cycle costs the rows it touches.

Run as a script it trains an embedding table of --rows rows (sparse
gradients from `tf.nn.embedding_lookup`) with Adagrad, as micro-batches
through the wrapper and as the large batch with the bare optimizer, and
prints the largest difference between the two tables (round-off).

In one process, under MirroredStrategy and on parameter-server workers the
table's accumulator (`<table>/GradientAccumulator`) is a list of the rows the
cycle looked up, each beside its id: each micro-step appends its rows (one
per looked-up id), and the apply step hands them on, repeated ids and all,
as the large batch's gradient holds them, and empties the list; a list
longer than the table is added up by id first, so that it never holds more
than the table's rows and one micro-step's. No step reads the whole table, and the accumulator's memory
follows the rows looked up (`tools/benchmark --suites=sparse`, README
"Performance"). The wrapped optimizer receives a `tf.IndexedSlices` over
every row the cycle touched, also a row whose gradient summed to exactly
zero (a masked padding id), and applies its own sparse update as it would to
the large batch's gradient: RMSProp and Adadelta decay that row's slots,
Ftrl and the proximal optimizers shrink it, Momentum moves it by its
momentum (tested for each, every slot compared).

- Checkpoints: the list is a variable under the original's name, so every
  Saver saves the partial sums (ids in its first columns, bitcast) and a
  job stopped mid-cycle resumes exactly. The original's checkpoints, which
  hold a table-sized accumulator there, restore too: the first micro-step
  turns it into the list of its non-zero rows.
- Under MirroredStrategy the replicas share one list, a plain variable on
  the first replica's host: where the replicas meet on each micro-step,
  every replica's rows are appended in replica order, and the first replica
  hands the cycle's rows on to the wrapped optimizer's all-reduce. A
  checkpoint of one process restores under MirroredStrategy, and back, also
  mid-cycle. On parameter-server workers the list is a local variable of
  the worker (see parameter_server_example.py). Under
  MultiWorkerMirroredStrategy each replica keeps a list of its own rows;
  the apply step pads them to the most rows a cycle looks up (the workers'
  all-reduce gathers slices of one length) with zero rows at an id some
  worker holds.
- `sparse_as_dense=True` restores the original's behaviour: sparse gradients
  densified into the accumulator every micro-step and handed on dense. With
  `apply_crs_to_grad=True` sparse gradients are always handled densely (a
  cross-replica sum needs the same shape on every core); inside XLA the
  table's accumulator is scatter-added but handed on densely (only static
  shapes compile).
- `clip_norm` clips the norm of the accumulated gradient with repeated ids
  summed, as in the dense gradient (`tf.clip_by_global_norm` on an
  IndexedSlices counts a repeated id's rows separately).
- Partitioned tables (`fixed_size_partitioner`) and several tables work the
  same way, each partition its own list.

  python tools/examples/embedding_example.py --grad_steps=4 --rows=100000
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('updates', 10, 'Number of updates.')
flags.DEFINE_integer('rows', 100000, 'Rows of the embedding table.')

IDS_PER_MICRO_BATCH, WIDTH = 64, 16


def train(ids, targets, batch, grad_steps):
  """Trains the table on `batch` ids per run; returns (table, first, last)."""
  with tf.Graph().as_default():
    id_feed = tf.compat.v1.placeholder(tf.int64, [None])
    target_feed = tf.compat.v1.placeholder(tf.float32, [None, WIDTH])
    table = tf.compat.v1.get_variable(
        'table', [FLAGS.rows, WIDTH],
        initializer=tf.compat.v1.random_normal_initializer(seed=1))
    # A sparse gradient: an IndexedSlices over the looked-up rows.
    rows = tf.nn.embedding_lookup(table, id_feed)
    loss = tf.reduce_mean(tf.square(rows - target_feed))
    optimizer = tf.compat.v1.train.AdagradOptimizer(0.5)
    if grad_steps > 1:
      optimizer = deferred_grad.GradientAggregationOptimizer(optimizer,
                                                             grad_steps)
    train_op = optimizer.minimize(loss)
    losses = []
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for start in range(0, len(ids), batch):
        feed = {id_feed: ids[start:start + batch],
                target_feed: targets[start:start + batch]}
        losses.append(session.run([train_op, loss], feed)[1])
      return session.run(table), losses[0], losses[-1]


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  rng = np.random.RandomState(0)
  total = FLAGS.updates * FLAGS.grad_steps * IDS_PER_MICRO_BATCH
  # Few distinct ids, so that micro-batches repeat rows, as text does.
  ids = rng.randint(0, 20, size=total) * (FLAGS.rows // 20)
  targets = np.sin(ids[:, None] + np.arange(WIDTH)).astype(np.float32)
  expected, _, _ = train(ids, targets,
                         FLAGS.grad_steps * IDS_PER_MICRO_BATCH, 1)
  actual, first, last = train(ids, targets, IDS_PER_MICRO_BATCH,
                              FLAGS.grad_steps)
  print('table of %d x %d, %d ids per micro-batch, %d per update' %
        (FLAGS.rows, WIDTH, IDS_PER_MICRO_BATCH,
         FLAGS.grad_steps * IDS_PER_MICRO_BATCH))
  print('largest difference from the large batch: %.3g' %
        np.abs(actual - expected).max())
  print('loss went from %.5f to %.5f' % (first, last))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
