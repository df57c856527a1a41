r"""A growing batch: grad_steps as a schedule of the updates applied.

"Don't decay the learning rate, increase the batch size" (Smith et al.,
ICLR 2018) and the batch-size warm-up of large language models grow the
batch during a run. Here the micro-batch stays --micro_batch examples and
the number of micro-batches per update grows: 1, then 2, then 4 (with the
default 256 examples: batches of 256, 512 and 1024), every --updates_per
updates. Run as a script it trains a softmax regression that way through
the wrapper, and the same model with the bare optimizer on the large
batches the schedule makes, and prints the largest difference between the
two (round-off).

    grad_steps = lambda updates: tf.gather([1, 2, 4], tf.minimum(
        updates // updates_per, 2))
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(1e-2), grad_steps)

What a script can count on:

- `grad_steps` is an int (a fixed cycle, the original's format), a scalar
  integer tensor (a placeholder fed each run, a variable), or a callable
  called with the number of updates applied so far (an int64 tensor),
  returning one, as optax's `MultiSteps(every_k_schedule=...)`.
- Each cycle's length is read once, on its first micro-step, and holds to
  its end: a value that changes mid-cycle takes effect at the next cycle.
  The cycle applies the mean of its micro-batch gradients (the sum with
  aggregation='sum', the weighted mean with micro_batch_weight), so training
  equals the bare optimizer on large batches of those sizes. A value below
  1 fails that micro-step, which then adds nothing, with an error naming
  grad_steps; a float or a non-scalar is refused at graph build.
- The wrapper keeps its own counters, saved in checkpoints: `micro_step`,
  `cycle_length` and `applied_updates` (int64; later train ops `_1`, ...).
  A job stopped mid-cycle resumes that cycle with the length it began
  with, even if the schedule says otherwise by then; the next cycles follow
  the schedule. `global_step` still counts micro-steps.
- `opt.applied_updates()` is the update count (an int64 tensor) for
  learning-rate schedules: give the wrapped optimizer a callable learning
  rate, which it calls when the train op is built, as below. Fetched with
  the train op it is the count before that run, as `applies_update()` is
  that run's decision. It counts ended cycles, also those a
  nonfinite_policy skipped, as `global_step // K` does for an int
  (`deferred_grad.applied_updates(global_step, K)`, which holds for an int
  only).
- Replicas and workers must agree on every cycle's length, since they meet
  on apply steps only. Under MirroredStrategy the schedule is read once for
  all replicas. Under MultiWorkerMirroredStrategy read it the same on every
  worker: a constant, a callable of the updates applied (the same on every
  worker), or a placeholder every worker feeds alike; not a variable one
  worker assigns. Where the workers' lengths differ, the apply step fails
  with an error naming grad_steps (or the collective options' timeout
  ends the run, when their apply steps no longer meet). Parameter-server
  workers each run their own cycles and read their own lengths.
- Everything else is as with an int: both code paths, XLA, sparse tables,
  nonfinite_policy, clip_norm, micro_batch_weight (tests/test_schedules.py).
- With an int, grad_steps is not saved: changing it between runs is exact
  at a cycle boundary only. To change it across a restart, give it as a
  tensor (e.g. `tf.constant(k)`), whose cycles are recorded.

  python tools/examples/schedule_example.py --micro_batch=256 --updates_per=5
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('micro_batch', 256, 'Examples per micro-batch.')
flags.DEFINE_integer('updates_per', 5, 'Updates at each batch size.')
GROWTH = (1, 2, 4)  # micro-batches per update, in turn
FEATURES, CLASSES = 16, 4


def _model():
  """Softmax regression; returns (inputs, labels, loss, weights)."""
  x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
  labels = tf.compat.v1.placeholder(tf.int32, [None])
  w = tf.compat.v1.get_variable('w', [FEATURES, CLASSES],
                                initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=tf.matmul(x, w)))
  return x, labels, loss, w


def _learning_rate(updates):
  return tf.compat.v1.train.exponential_decay(0.05, updates, 10, 0.5)


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  rng = np.random.RandomState(0)
  lengths = [k for k in GROWTH for _ in range(FLAGS.updates_per)]
  steps = sum(lengths)
  true_w = rng.randn(FEATURES, CLASSES)
  data_x = rng.randn(steps * FLAGS.micro_batch, FEATURES).astype(np.float32)
  data_y = np.argmax(data_x.dot(true_w) + rng.randn(len(data_x), CLASSES),
                     axis=1).astype(np.int32)
  starts = np.cumsum([0] + lengths) * FLAGS.micro_batch

  # The wrapper: one micro-batch per run; grad_steps grows with the updates.
  with tf.Graph().as_default():
    x, labels, loss, w = _model()
    global_step = tf.compat.v1.train.get_or_create_global_step()
    growth = tf.constant(GROWTH, tf.int64)
    # The learning rate is a callable, called as minimize builds the train
    # op: `opt` is the wrapper by then.
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(
            lambda: _learning_rate(opt.applied_updates())),
        grad_steps=lambda updates: tf.gather(growth, tf.minimum(
            updates // FLAGS.updates_per, len(GROWTH) - 1)))
    train_op = opt.minimize(loss, global_step=global_step)
    applies, updates = opt.applies_update(), opt.applied_updates()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      first_loss = session.run(loss, {x: data_x, labels: data_y})
      for step in range(steps):
        rows = slice(step * FLAGS.micro_batch, (step + 1) * FLAGS.micro_batch)
        _, applied, done = session.run(
            [train_op, applies, updates], {x: data_x[rows],
                                           labels: data_y[rows]})
        if applied:
          print('update %2d: batch %5d  global_step %3d' % (
              done + 1, lengths[done] * FLAGS.micro_batch, step + 1))
      last_loss = session.run(loss, {x: data_x, labels: data_y})
      wrapped = session.run(w)

  # The bare optimizer on the same large batches.
  with tf.Graph().as_default():
    x, labels, loss, w = _model()
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(
        _learning_rate(global_step)).minimize(loss, global_step=global_step)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for start, end in zip(starts[:-1], starts[1:]):
        session.run(train_op, {x: data_x[start:end],
                               labels: data_y[start:end]})
      bare = session.run(w)

  print('loss went from %.5f to %.5f' % (first_loss, last_loss))
  print('largest difference from the large batches: %.3g' %
        np.max(np.abs(wrapped - bare)))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
