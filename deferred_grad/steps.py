"""Micro-steps and updates: the cycle counter and what reads it.

A cycle is `grad_steps` micro-steps; its last one applies the update. The
position in the cycle is read from a step variable: the `global_step` passed
to `apply_gradients` (counting micro-steps without bound, as in the
original), or the wrapper's own `update_count` (the TPU path, or no
`global_step`), which counts micro-steps modulo `grad_steps`.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import arguments
from deferred_grad import compat
from deferred_grad import variables

tf = compat.import_tensorflow()

COUNTER_NAME = 'update_count'


def create_counter(local=None):
  """Creates the `update_count` variable.

  It counts micro-steps modulo `grad_steps`: an unbounded float32 counter
  (the original's) stops counting at 2**24 micro-steps. Its name, shape and
  dtype are the original's so that its checkpoints restore; a train op
  built after another in the same graph gets `update_count_1`, ... (see
  `variables`).

  Returns:
    The variable.
  """
  return variables.own_variable(
      COUNTER_NAME, tf.float32,
      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA, local=local)


def is_cycle_end(step_value, grad_steps):
  """True when the micro-step counted as `step_value` ends its cycle."""
  return tf.equal(tf.math.floormod(step_value, grad_steps), grad_steps - 1)


def advance(step, step_value, grad_steps, wraps):
  """Counts one micro-step on `step`, whose value was `step_value`.

  Args:
    step: the step variable.
    step_value: its value read before this micro-step (used if `wraps`).
    grad_steps: micro-steps per cycle.
    wraps: True for `update_count`, which wraps around at `grad_steps`; a
      global step counts on (atomically: workers may share it).

  Returns:
    The op.
  """
  if wraps:
    next_value = tf.math.floormod(step_value + 1, grad_steps)
    return step.assign(next_value, read_value=False)
  if compat.is_ref_variable(step):
    # Locked: workers sharing the step on a parameter server add at once.
    return tf.compat.v1.assign_add(step, 1, use_locking=True).op
  return step.assign_add(1, read_value=False)


def applied_updates(global_step, grad_steps, name=None):
  """Returns how many accumulated updates have been applied, as a tensor.

  `GradientAggregationOptimizer` increments `global_step` once per micro-step,
  so a learning-rate schedule or `AdagradDAOptimizer` that reads
  `global_step` would advance `grad_steps` times too fast. Give them this
  tensor instead: read while an update is applied, it equals the `global_step`
  that large-batch training would have at that update.

  ```python
  global_step = tf.compat.v1.train.get_or_create_global_step()
  updates = deferred_grad.applied_updates(global_step, grad_steps=4)
  learning_rate = tf.compat.v1.train.exponential_decay(
      0.1, updates, decay_steps=1000, decay_rate=0.5)
  opt = deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.9), grad_steps=4)
  ```

  Args:
    global_step: the integer step variable (or tensor) passed to
      `apply_gradients`, counting micro-steps.
    grad_steps: the wrapper's `grad_steps`.
    name: optional name for the returned tensor's scope.

  Returns:
    An integer tensor: `global_step // grad_steps`.

  Raises:
    TypeError, ValueError: `grad_steps` is not a positive int.
  """
  grad_steps = arguments.check_positive_int(grad_steps, 'grad_steps')
  with tf.compat.v1.name_scope(name, 'applied_updates', [global_step]):
    return tf.math.floordiv(global_step, grad_steps)
