r"""MirroredStrategy with deferred_grad: several devices, one accumulator each.

Run as a script it trains a small model under `MirroredStrategy` over two
logical CPU devices (on a GPU machine: the GPUs) with token-count weights,
and the same model on one device with the bare optimizer on the large
batch, and prints the largest weight difference (float32 round-off).

The recipe, as below:

- Build the model, the wrapper and the train op in `strategy.scope()`, and
  call `apply_gradients` (or `minimize`) inside
  `strategy.extended.call_for_each_replica`; `compute_gradients` checks it
  and raises a RuntimeError that says where to call it.
- Divide each replica's loss by `strategy.num_replicas_in_sync`, as without
  the wrapper: the wrapped optimizer's all-reduce sums. The update is then
  the mean over replicas * grad_steps micro-batches.
- Each replica keeps its own part of each accumulator (a sync-on-read
  variable) and adds its micro-batches there; the replicas talk only on
  apply steps: K micro-steps, one all-reduce. An embedding table's
  accumulator is one list of the rows looked up, shared by the replicas
  (see embedding_example.py).
- `micro_batch_weight` under replicas: a callable returning the replica's
  own count (it is called on each replica), or a tensor built in the
  replica function; the weights add up over replicas. A nonfinite_policy
  decides for all replicas together (`'skip_micro_batch'` applies the mean
  over every finite micro-batch of every replica; `'skip_cycle'` skips the
  cycle everywhere), summing the replicas' counts in one all-reduce of two
  numbers per apply step. `clip_norm` clips the norm of the gradient summed
  over replicas (one more all-reduce per cycle).

The two code paths: the GPU path (`use_tpu=False`, the default) accumulates
in the replica context, then a `merge_call` decides in one in-graph
`tf.cond` on the step (`global_step`, or `update_count` without one) whether
this micro-step ends the cycle; if it does, every replica calls the wrapped
optimizer's `apply_gradients`, which all-reduces, and zeroes its
accumulator. The TPU path (`use_tpu=True`) counts micro-steps modulo
grad_steps in a float32 variable `update_count` (read before the same run
advances it, so every run gives the same result) and applies inside its
`tf.cond`, where a strategy's all-reduce cannot run: under a strategy of
several replicas it is refused at graph build with a ValueError that says to
use the GPU path.

Estimator with `RunConfig(train_distribute=MirroredStrategy(...))`: each
replica takes its own micro-batch from the input_fn and Estimator already
scales the loss by 1/replicas for tf.compat.v1.train optimizers. On
TensorFlow 2.15 give the strategy `cross_device_ops=
tf.distribute.ReductionToOneDevice()`: with the default cross-device ops over
two logical CPU devices that Estimator hangs at step 0, with or without
this library.

  python tools/examples/mirrored_example.py --grad_steps=4
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

REPLICAS, ROWS, TOKENS = 2, 8, 6


def make_data(micro_steps):
  """[micro-step, replica, rows, tokens] features, targets and a mask."""
  rng = np.random.RandomState(0)
  shape = (micro_steps, REPLICAS, ROWS, TOKENS)
  x = rng.randn(*shape).astype(np.float32)
  mask = (rng.rand(*shape) < 0.6).astype(np.float32)  # 0: padding
  return x, (2.0 * x - 1.0).astype(np.float32), mask


def per_token_loss(w, x, y):
  return tf.square(x * w[0] + w[1] - y)


def large_batch(data, grad_steps):
  """The bare optimizer on one device, a batch of grad_steps*REPLICAS."""
  x, y, mask = [part.reshape((-1, grad_steps * REPLICAS * ROWS, TOKENS))
                for part in data]
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=[0.0, 0.0])
    feeds = [tf.compat.v1.placeholder(tf.float32, [None, TOKENS])
             for _ in range(3)]
    loss = (tf.reduce_sum(per_token_loss(w, *feeds[:2]) * feeds[2]) /
            tf.reduce_sum(feeds[2]))  # the large batch's token mean
    train_op = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for update in range(len(x)):
        session.run(train_op, dict(zip(feeds, (x[update], y[update],
                                               mask[update]))))
      return session.run(w)


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
  k = FLAGS.grad_steps
  data = make_data(FLAGS.updates * k)

  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:%d' % i for i in range(REPLICAS)])
  with strategy.scope():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable('w', initializer=[0.0, 0.0])
    # [replica, rows, tokens]: each replica reads its own slice.
    feeds = [tf.compat.v1.placeholder(tf.float32, [REPLICAS, ROWS, TOKENS])
             for _ in range(3)]

    def replica_inputs():
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      return [tf.gather(feed, replica) for feed in feeds]

    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1), grad_steps=k,
        # Called on each replica: that replica's token count.
        micro_batch_weight=lambda: tf.reduce_sum(replica_inputs()[2]))

    def replica_step():
      x, y, mask = replica_inputs()
      loss = tf.reduce_sum(per_token_loss(w, x, y) * mask) / tf.reduce_sum(
          mask)
      return optimizer.minimize(loss / strategy.num_replicas_in_sync,
                                global_step=global_step)

    train_op = strategy.group(
        strategy.extended.call_for_each_replica(replica_step))

  with tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    for step in range(FLAGS.updates * k):
      session.run(train_op, dict(zip(feeds, (part[step] for part in data))))
    weights = session.run(w)
    steps = session.run(global_step)
  expected = large_batch(data, k)
  print('%d replicas x %d micro-steps per update, global_step %d' %
        (REPLICAS, k, steps))
  print('weights %s; large batch on one device %s' % (weights, expected))
  print('largest weight difference: %.3g' % np.abs(weights - expected).max())


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
