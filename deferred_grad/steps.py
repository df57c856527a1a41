"""Micro-steps and updates: where a micro-step is in its cycle.

A cycle is `grad_steps` micro-steps; its last one applies the update. Two
kinds of cycle keep the count, with one interface (`divisor`, what a
micro-step divides its gradients by as it adds them; `read`, the
micro-step's `Position` after its accumulation; `advance`; `variables`):

* `StepCycle`, for an int `grad_steps`: the position is read from a step
  variable, the `global_step` passed to `apply_gradients` (counting
  micro-steps without bound, as in the original) or the wrapper's own
  `update_count` (the TPU path, or no `global_step`), which counts
  micro-steps modulo `grad_steps`.
* `Schedule`, for a tensor or callable `grad_steps`: the length changes
  between cycles, so no step places a micro-step in its cycle; three
  variables of its own hold the position, the length and the updates
  applied (saved in checkpoints), and the schedule is read once, on each
  cycle's first micro-step.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import collections

from deferred_grad import arguments
from deferred_grad import compat
from deferred_grad import variables

tf = compat.import_tensorflow()

COUNTER_NAME = 'update_count'
SCHEDULE_NAMES = ('micro_step', 'cycle_length', 'applied_updates')

# A micro-step's place in its cycle, read before it is counted: `in_cycle`
# (an int64 scalar, 0 on a cycle's first micro-step), `length` (the cycle's
# grad_steps: an int, or an int64 scalar under a schedule), `is_end` (a
# boolean scalar: this micro-step applies), `updates` (the updates applied
# before it: an int64 scalar, or None where only `global_step` knows) and
# `step` (the value read of a `StepCycle`'s step, else None).
Position = collections.namedtuple(
    'Position', ['in_cycle', 'length', 'is_end', 'updates', 'step'])


def count_on(step):
  """Adds one micro-step to a global step (atomically: workers share it)."""
  if compat.is_ref_variable(step):
    # Locked: workers sharing the step on a parameter server add at once.
    return tf.compat.v1.assign_add(step, 1, use_locking=True).op
  return step.assign_add(1, read_value=False)


class StepCycle(object):
  """A cycle of an int `grad_steps`, decided on a step variable.

  Args:
    grad_steps: micro-steps per cycle (an int above 1).
    global_step: the `global_step` to decide on, or None: then a new
      `update_count` (the original's name, shape and dtype, so that its
      checkpoints restore; `update_count_1`, ... for later train ops), which
      counts modulo `grad_steps`, since a float32 counter stops counting at
      2**24.
    local: None (global variables), or a `placement.WorkerLocal`.
  """

  def __init__(self, grad_steps, global_step=None, local=None):
    self.grad_steps = grad_steps
    self.counts_global_step = global_step is not None
    self.step = global_step if self.counts_global_step else (
        variables.own_counter(COUNTER_NAME, tf.float32, local))

  def variables(self):
    return [] if self.counts_global_step else [self.step]

  def divisor(self):
    return self.grad_steps

  def read(self, after, check=None):
    """The `Position` of this micro-step, read after the ops `after`.

    Args:
      after: ops to run first (the micro-step's accumulation).
      check: None, or `check(in_cycle, value)` returning `value` checked.
    """
    with tf.control_dependencies(after):
      value = self.step.read_value()
    if check is not None:
      value = check(tf.math.floormod(value, self.grad_steps), value)
    in_cycle = tf.math.floormod(value, self.grad_steps)
    return Position(
        in_cycle=tf.cast(in_cycle, tf.int64), length=self.grad_steps,
        is_end=tf.equal(in_cycle, self.grad_steps - 1), updates=None,
        step=value)

  def place(self):
    """The micro-steps of the cycle so far, read when run (int64)."""
    return tf.cast(tf.math.floormod(self.step.read_value(), self.grad_steps),
                   tf.int64)

  def advance(self, position):
    """Counts the micro-step at `position` (its read ordered before)."""
    if self.counts_global_step:
      return count_on(self.step)
    next_value = tf.math.floormod(position.step + 1, self.grad_steps)
    return self.step.assign(next_value, read_value=False)


class Schedule(object):
  """The cycle of a schedule: `grad_steps` a tensor or a callable.

  Three int64 variables: the micro-step's place in its cycle, the cycle's
  length (read from the schedule on the cycle's first micro-step, then
  held: a value that changes mid-cycle takes effect at the next cycle) and
  the updates applied so far (what a callable schedule is called with). In
  checkpoints they make a job resume mid-cycle with the length the cycle
  started with, whatever the schedule says by then.

  Args:
    grad_steps: a scalar integer tensor, or a callable of the updates
      applied (an int64 scalar) returning one.
    local: None (global variables), or a `placement.WorkerLocal`.
  """

  counts_global_step = False

  def __init__(self, grad_steps, local=None):
    self._grad_steps = grad_steps
    self.in_cycle, self.length, self.updates = (
        variables.own_counter(name, tf.int64, local)
        for name in SCHEDULE_NAMES)

  def variables(self):
    return [self.in_cycle, self.length, self.updates]

  def place(self):
    """The micro-steps of the cycle so far, read when run (int64)."""
    return self.in_cycle.read_value()

  def next_length(self, updates):
    """The schedule's value for the cycle after `updates` updates (int64).

    Raises:
      TypeError, ValueError: see `arguments.check_schedule_value`.
    """
    if tf.is_tensor(self._grad_steps):
      value = self._grad_steps
    else:
      value = arguments.check_schedule_value(self._grad_steps(updates),
                                             'the callable')
    return tf.cast(value, tf.int64)

  def divisor(self):
    """This cycle's length, read before the micro-step adds (int64).

    On a cycle's first micro-step, the schedule's value, checked: a value
    below 1 fails the micro-step before it adds anything (inside XLA,
    which compiles an Assert into nothing, it counts as 1).
    """
    in_cycle, held, updates = (v.read_value() for v in self.variables())
    value = self.next_length(updates)
    if not compat.in_xla_context() and tf.get_static_value(value) is None:
      check = tf.debugging.Assert(
          tf.logical_or(tf.not_equal(in_cycle, 0), value >= 1), [
              'GradientAggregationOptimizer: grad_steps (a schedule) must '
              'be at least 1 at every cycle; after', updates, 'updates it '
              'gave', value])
      with tf.control_dependencies([check]):
        value = tf.identity(value)
    return tf.where(tf.equal(in_cycle, 0), tf.maximum(value, 1), held)

  def read(self, after, check=None):
    """The `Position` of this micro-step, read after the ops `after`.

    Args:
      after: ops to run first (the micro-step's accumulation).
      check: None, or `check(in_cycle, value)` returning `value` checked.
    """
    with tf.control_dependencies(after):
      # Copied (stacked): under ref variables (v1 behaviour) a read may
      # alias the variable's buffer, which `advance` then writes in place.
      in_cycle, held, updates = tf.unstack(tf.stack(
          [v.read_value() for v in self.variables()]))
    if check is not None:
      in_cycle = check(in_cycle, in_cycle)
    length = tf.where(tf.equal(in_cycle, 0),
                      tf.maximum(self.next_length(updates), 1), held)
    return Position(in_cycle=in_cycle, length=length,
                    is_end=in_cycle + 1 >= length, updates=updates, step=None)

  def advance(self, position):
    """Counts the micro-step at `position`: writes all three counters.

    (Only the length changes on a cycle's first micro-step, the place and
    the updates on its last one.)
    """
    values = (tf.where(position.is_end, tf.zeros_like(position.in_cycle),
                       position.in_cycle + 1),
              position.length,
              position.updates + tf.cast(position.is_end, tf.int64))
    return tf.group(*[v.assign(value, read_value=False)
                      for v, value in zip(self.variables(), values)])


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

  With a schedule (`grad_steps` a tensor or a callable) the updates are
  not a function of `global_step`: use the wrapper's
  `GradientAggregationOptimizer.applied_updates()` there.

  Raises:
    TypeError, ValueError: `grad_steps` is not a positive int (a schedule
      included).
  """
  if tf.is_tensor(grad_steps) or callable(grad_steps):
    raise TypeError(
        'deferred_grad.applied_updates(global_step, grad_steps) needs an int '
        'grad_steps, got the schedule %r: under a schedule the updates are '
        'not a function of global_step; use the wrapper\'s '
        'applied_updates() method.' % (grad_steps,))
  grad_steps = arguments.check_positive_int(grad_steps, 'grad_steps')
  with tf.compat.v1.name_scope(name, 'applied_updates', [global_step]):
    return tf.math.floordiv(global_step, grad_steps)
