r"""A plain tf.compat.v1.Session training script with deferred_grad.

Linear regression on generated data: each session.run is one micro-batch of
--micro_batch examples; every --grad_steps runs apply one update, as if the
batch were grad_steps * micro_batch. The learning-rate schedule is fed the
number of applied updates, not global_step (which counts micro-steps).

What the wrapper does, and what a script can count on:

- The mean, not the sum. Each micro-step adds gradient / grad_steps to the
  variable's accumulator (slot `grad_accum`, variable
  `<var>/GradientAccumulator`); the cycle's last micro-step hands the
  accumulated mean to the wrapped optimizer and zeroes the accumulator.
  With a mean loss per micro-batch this is the large batch's mean gradient.
- global_step counts micro-steps, one per `session.run(train_op)`, as in the
  original; so does everything that reads it. Weights change on every
  grad_steps-th micro-step only. Schedules take
  `deferred_grad.applied_updates(global_step, grad_steps)`, as below.
- Batch statistics (batch norm) stay per micro-batch: accumulation changes
  the gradient, not the forward pass.
- One contract at every grad_steps, 1 included. With grad_steps=1 nothing
  is accumulated (no accumulator variable: the cost of a bare step), and
  the rest holds as at grad_steps>1: the wrapper increments global_step
  itself (the wrapped optimizer is called without it, so one that ignores
  its global_step argument, as BERT's does, works the same), and clip_norm,
  nonfinite_policy, micro_batch_weight and apply_crs_to_grad apply.
  Without those keywords it trains exactly as the bare optimizer, with the
  same variable names.
- `global_step=None` works on both paths: the wrapper counts micro-steps in
  its own `update_count` variable.
- None gradients (variables the loss does not depend on) are skipped, as
  tf.compat.v1.train.Optimizer skips them: such variables get no
  accumulator. If every gradient is None, apply_gradients raises a
  ValueError naming the variables.
- `name` is the name scope of every op apply_gradients makes (default
  GradientAggregationOptimizer); it changes no variable's name.
- Several train ops: each call of apply_gradients or minimize cycles on its
  own state (a GAN's two wrappers, a multi-task model's, one wrapper
  minimizing two losses). The first keeps the original's names
  (`update_count`, `v/GradientAccumulator`); later ones get `update_count_1`
  and `v/GradientAccumulator_1` (slot `grad_accum_1`), in the order the
  graph builds them, also under `variable_scope(..., reuse=AUTO_REUSE)`.
  Two train ops on shared variables (a multi-task trunk) each apply the
  mean of their own micro-batches, as the bare optimizer with one train op
  per loss on the large batches. Two train ops with grad_steps > 1 may not
  count the same global_step (each decides its cycle on it): apply_gradients
  raises a ValueError; pass global_step to one of them.
- Methods: compute_gradients, apply_gradients(grads_and_vars,
  global_step=None, name=None), minimize, get_slot, get_slot_names,
  variables; applies_update() and micro_step_in_cycle() (see
  numerics_example.py); attribute `strategy` (tf.distribute.get_strategy()
  at construction).

  python tools/examples/session_example.py --grad_steps=4 --updates=20
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('micro_batch', 32, 'Examples per micro-batch.')
flags.DEFINE_integer('updates', 20, 'Number of updates.')


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  rng = np.random.RandomState(0)
  true_w = rng.randn(8, 1).astype(np.float32)

  x = tf.compat.v1.placeholder(tf.float32, [None, 8])
  y = tf.compat.v1.placeholder(tf.float32, [None, 1])
  w = tf.compat.v1.get_variable('w', [8, 1], initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))

  global_step = tf.compat.v1.train.get_or_create_global_step()
  updates = deferred_grad.applied_updates(global_step, FLAGS.grad_steps)
  learning_rate = tf.compat.v1.train.exponential_decay(0.1, updates, 10, 0.5)
  optimizer = deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.5),
      grad_steps=FLAGS.grad_steps)
  train_op = optimizer.minimize(loss, global_step=global_step)

  with tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    losses = []
    for update in range(FLAGS.updates):
      micro_losses = []
      for _ in range(FLAGS.grad_steps):
        batch_x = rng.randn(FLAGS.micro_batch, 8).astype(np.float32)
        _, value = session.run([train_op, loss], {x: batch_x,
                                                  y: batch_x.dot(true_w)})
        micro_losses.append(value)
      losses.append(np.mean(micro_losses))
      print('update %d  global_step %d  loss %.5f' %
            (update + 1, session.run(global_step), losses[-1]))
  print('loss went from %.5f to %.5f' % (losses[0], losses[-1]))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
