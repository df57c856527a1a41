r"""Numerics with deferred_grad: non-finite micro-batches, clipping, loss scale.

Run as a script it trains a linear model in cycles of --grad_steps
micro-batches, one of which has a NaN target, with
`nonfinite_policy='skip_micro_batch'` and `clip_norm=1.0`, and compares it
with the bare optimizer on the large batch of the finite micro-batches,
clipped; then it trains under a loss-scale optimizer (outermost) and
compares with the large batch again.

Non-finite micro-batches: `nonfinite_policy` decides what a micro-batch whose
gradient has a NaN or inf does (checked over all variables at once):

  nonfinite_policy       the bad micro-batch   the cycle
  None (the original's)  accumulated           its update, and the weights, become
                                               NaN/inf
  'skip_micro_batch'     contributes nothing   applies the mean of its finite
                                               micro-batches (nothing if none is)
  'skip_cycle'           contributes nothing   applies nothing; the accumulators
                                               are reset

`global_step` still counts the micro-step. `opt.skipped_micro_batches` and
`opt.skipped_cycles` (int64 variables, created with the policy, saved in
checkpoints) count what was skipped, updated on each apply step. With
several replicas (MirroredStrategy, MultiWorkerMirroredStrategy, TPU cores
with apply_crs_to_grad) the policy decides for all together and the
counters hold the totals over replicas, the same on every replica. The
replicas still talk only on apply steps: each apply step sums the replicas'
counts of the cycle in one all-reduce of two numbers (tested with a bad
micro-batch on one of two replicas, and on one of two worker processes).

Clipping: `tf.clip_by_global_norm` between compute_gradients and
apply_gradients clips each micro-batch, not what large-batch training does.
`clip_norm=c` clips the cycle's gradient to global norm c just before the
wrapped optimizer applies it; with a nonfinite_policy, after it is complete.
Under MirroredStrategy the norm is that of the gradient summed over replicas.

Loss scaling (mixed precision): put
`tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer` outermost,
around the wrapper. It checks every micro-batch: one that overflows is
dropped before the wrapper sees it (not accumulated, not counted by
global_step: the cycle completes with the next good micro-batch) and a
dynamic scale halves; it grows again after its run of good steps, which are
micro-steps. Without overflow, training equals large-batch training (tested
with a fixed scale of 128). The other nesting checks only the accumulated
gradient, once per cycle: an overflow then costs the whole cycle, and with a
nonfinite_policy the scale would never see it. Keras's LossScaleOptimizer
wraps Keras optimizers only; the v1 one is deprecated but present in 2.15
to 2.21.

Accumulator precision: `accumulator_dtype=tf.float32` keeps the accumulators
of float16 or bfloat16 variables in float32 and casts the mean once, when it
is applied (64 float16 gradients of about 1e-3 then sum within 1e-6 of the
float64 sum; a float16 accumulator is off by more than 1e-3). A dtype
narrower than the variable's is refused at graph build. The factors that
turn the sum into the cycle's gradient are computed in each gradient's own
dtype: float64 models match the large batch to 1e-12.

Weighted micro-batches: when each micro-batch's loss is a mean over its
tokens and micro-batches hold different numbers of tokens, give
`micro_batch_weight=` each micro-step's token count (a scalar tensor, or a
callable returning one, called on each replica) and the cycle applies
`sum(w_i g_i) / sum(w_i)`, the large batch's token mean (see
bert_porting.py and mirrored_example.py). A weight is a finite number >= 0:
a negative one fails its micro-step with an InvalidArgumentError naming
micro_batch_weight; so does a NaN or inf one unless a nonfinite_policy
skips it. A weight known at graph build that is bad, or a tensor that is no
number (a string, a bool), is refused there (ValueError, TypeError). A
micro-batch a nonfinite_policy skips does not count; a cycle whose weights
sum to 0 applies nothing. With the loss-scale optimizer outermost, weights
need nothing more (it unscales before the wrapper sees them). Under a
strategy divide each replica's loss by the replicas as usual; the weights
add up over replicas. The accumulators keep their format (the sum divided
by grad_steps); the cycle's weight is the variable `micro_batch_weights`.
Tested with micro-batches of 3, 7, 1 and 5 tokens for SGD, Momentum and
Adam, both paths, dense and sparse, and under MirroredStrategy.

`aggregation='sum'` applies the sum instead of the mean (Horovod's
`average_aggregated_gradients=False`, OpenNMT-tf's): as large-batch training
with the loss multiplied by grad_steps; with weights, `sum(w_i g_i)`, the
gradient of the large batch's token sum. The cross-replica sum of
apply_crs_to_grad is independent of it (it adds over TPU cores), and a
loss-scale optimizer outermost unscales each micro-batch before the sum.

Is this micro-step an update? `opt.applies_update()` is a boolean tensor,
True when this run of the train op ends a cycle, and
`opt.micro_step_in_cycle()` its position (0 to grad_steps - 1): fetched with
the train op they are exact (a separate read of global_step in the same run
is not ordered with the increment). estimator_example.py writes the
learning rate as a summary on apply steps only with them, inside a
`tf.cond(opt.applies_update(), ...)` (tested: one summary per cycle). With a
nonfinite_policy a cycle may end without applying (skipped_cycles counts
those).

Eager mode and tf.function: the wrapper is for TF1-style graphs; called
eagerly or in a tf.function it raises a RuntimeError that says so (from 2.16
on, Keras 3 optimizers have `gradient_accumulation_steps`; TensorFlow
2.15's Keras 2.15 has nothing of the kind).

  python tools/examples/numerics_example.py --grad_steps=4
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('updates', 6, 'Number of updates.')

ROWS, BAD_MICRO_STEP, CLIP_NORM = 8, 5, 1.0


def make_data(grad_steps, updates):
  rng = np.random.RandomState(0)
  x = rng.randn(updates * grad_steps, ROWS, 3).astype(np.float32)
  y = (x.dot([1.0, -2.0, 3.0])[..., None] + 5.0).astype(np.float32)
  y[BAD_MICRO_STEP, 0] = np.nan  # one micro-batch with a NaN target
  return x, y


def build(make_optimizer):
  x = tf.compat.v1.placeholder(tf.float32, [None, 3])
  y = tf.compat.v1.placeholder(tf.float32, [None, 1])
  w = tf.compat.v1.get_variable('w', [3, 1], initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
  global_step = tf.compat.v1.train.get_or_create_global_step()
  optimizer = make_optimizer()
  return x, y, w, optimizer, optimizer.minimize(loss, global_step=global_step)


def wrapped(x_data, y_data, make_optimizer):
  """Micro-batches through `make_optimizer()`; returns (w, optimizer, step)."""
  with tf.Graph().as_default():
    x, y, w, optimizer, train_op = build(make_optimizer)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for xb, yb in zip(x_data, y_data):
        session.run(train_op, {x: xb, y: yb})
      values = {'w': session.run(w),
                'global_step': session.run(
                    tf.compat.v1.train.get_global_step())}
      if hasattr(optimizer, 'skipped_micro_batches'):
        values['skipped'] = session.run(optimizer.skipped_micro_batches)
      return values


def large_batch(x_data, y_data, grad_steps, clip):
  """The bare SGD on each cycle's finite micro-batches, clipped if `clip`."""
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    w = tf.compat.v1.get_variable('w', [3, 1],
                                  initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    grads = tf.gradients(loss, [w])
    if clip:
      grads, _ = tf.clip_by_global_norm(grads, CLIP_NORM)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(
        0.05).apply_gradients(
        [(grads[0], w)])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for start in range(0, len(x_data), grad_steps):
        finite = [i for i in range(start, start + grad_steps)
                  if np.isfinite(y_data[i]).all()]
        session.run(train_op, {x: np.concatenate(x_data[finite]),
                               y: np.concatenate(y_data[finite])})
      return session.run(w)


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  k = FLAGS.grad_steps
  x_data, y_data = make_data(k, FLAGS.updates)
  sgd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05)

  skipped = wrapped(x_data, y_data, lambda: (
      deferred_grad.GradientAggregationOptimizer(
          sgd(), k, nonfinite_policy='skip_micro_batch', clip_norm=CLIP_NORM)))
  expected = large_batch(x_data, y_data, k, clip=True)
  print("nonfinite_policy='skip_micro_batch', clip_norm=%g: skipped %d "
        'micro-batch, global_step %d; largest difference from the large '
        'batch of finite micro-batches, clipped: %.3g' %
        (CLIP_NORM, skipped['skipped'], skipped['global_step'],
         np.abs(skipped['w'] - expected).max()))

  scaled = wrapped(x_data, y_data, lambda: (
      tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
          deferred_grad.GradientAggregationOptimizer(sgd(), k), 'dynamic')))
  # The loss-scale optimizer drops the NaN micro-batch before the wrapper
  # sees it: the cycle then completes with the next micro-batch.
  finite = np.isfinite(y_data).all(axis=(1, 2))
  x_good, y_good = x_data[finite], y_data[finite]
  usable = len(x_good) // k * k
  expected = large_batch(x_good[:usable], y_good[:usable], k, clip=False)
  print('under a dynamic loss scale: global_step %d (the NaN micro-batch '
        'not counted); largest difference from the large batch of the '
        'finite micro-batches: %.3g' %
        (scaled['global_step'], np.abs(scaled['w'] - expected).max()))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
