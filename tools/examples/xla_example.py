r"""XLA and TPUs with deferred_grad: a whole training step compiled.

On a TPU every op of a training step is compiled by XLA. On a CPU,
`tensorflow.python.compiler.xla.xla.compile` compiles a whole step the same
way: run as a script, this compiles each micro-step of the TPU path
(`use_tpu=True`) with `xla_num_partitions=2`, trains, and prints the largest
weight difference from the bare optimizer on the large batch. XLA refuses ref
variables, so this runs under `disable_eager_execution()` (resource
variables), for the bare optimizer as well.

- Both code paths compile (tests/test_xla.py: dense, sharded, with a
  nonfinite_policy, with clip_norm, float32 accumulators, an embedding
  table; each trains like the large batch).
- `xla_num_partitions=N` annotates each accumulator read with
  `xla_sharding.split(..., use_sharding_op=True)`, the original's rule for
  Transformer/BERT-like models: rank-3 accumulators split on dimension 1;
  rank-2 ones on dimension 1 when they have fewer rows than columns, else on
  dimension 0; other ranks are left alone. The annotations reach the
  compiled HLO (`XLA_FLAGS=--xla_dump_to=DIR` shows `sharding={devices=
  [1,2]0,1}` on a [4, 5] accumulator, `[2,1]` on a [5, 3] one). Without XLA
  the XlaSharding op is an identity.
- A table's sparse gradients are scatter-added row by row but handed on
  densely on the apply step inside XLA, as the original did (only static
  shapes compile). A `micro_batch_weight` check compiles to nothing there.
- TPUEstimator: see tpu_estimator_example.py; `apply_crs_to_grad=True` sums
  each accumulated gradient over the TPU cores with `cross_replica_sum`,
  which runs only inside a TPU computation, so tie it to the `use_tpu` given
  to TPUEstimator. Built outside one it raises a ValueError at graph build.
  Combine the cores' gradients one way: a CrossShardOptimizer as the wrapped
  optimizer, or apply_crs_to_grad (a sum: divide the loss by the cores).

What only a real TPU can show: apply_crs_to_grad, the sharded accumulators
actually split over cores, and TPU speed and memory.

  python tools/examples/xla_example.py --grad_steps=4
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf
from tensorflow.python.compiler.xla import xla  # pylint: disable=g-direct-tensorflow-import

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('updates', 10, 'Number of updates.')

ROWS = 8


def model(x, y):
  w1 = tf.compat.v1.get_variable(
      'w1', [6, 10], initializer=tf.compat.v1.random_normal_initializer(
          seed=1))
  w2 = tf.compat.v1.get_variable(
      'w2', [10, 1], initializer=tf.compat.v1.random_normal_initializer(
          seed=2))
  return tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w1)), w2)
                                  - y))


def train(x_data, y_data, grad_steps):
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 6])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    global_step = tf.compat.v1.train.get_or_create_global_step()

    def step(x, y):
      optimizer = tf.compat.v1.train.AdamOptimizer(0.05)
      if grad_steps > 1:
        optimizer = deferred_grad.GradientAggregationOptimizer(
            optimizer, grad_steps, use_tpu=True, xla_num_partitions=2)
      return optimizer.minimize(model(x, y), global_step=global_step)

    compiled = xla.compile(step, inputs=[x, y])  # one XLA computation
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      batch = len(x_data) // (FLAGS.updates * grad_steps)
      for start in range(0, len(x_data), batch):
        session.run(compiled, {x: x_data[start:start + batch],
                               y: y_data[start:start + batch]})
      return session.run(tf.compat.v1.trainable_variables()), session.run(
          global_step)


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  rng = np.random.RandomState(0)
  x = rng.randn(FLAGS.updates * FLAGS.grad_steps * ROWS, 6).astype(np.float32)
  y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
  expected, large_steps = train(x, y, 1)
  actual, steps = train(x, y, FLAGS.grad_steps)
  print('compiled by XLA: large batch global_step %d; %d micro-batches per '
        'update: global_step %d' % (large_steps, FLAGS.grad_steps, steps))
  print('largest weight difference: %.3g' % max(
      np.abs(a - e).max() for a, e in zip(actual, expected)))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
