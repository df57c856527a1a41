"""A train op's cycle: where a micro-step stands, and how it advances.

A cycle is `grad_steps` micro-steps; the last applies the update. An int
`grad_steps` (`StepCycle`) reads its place from one step variable, as the
original did, so that its checkpoints restore mid-cycle; a schedule
(`Schedule`) keeps three counters: place, length and updates applied.
Each reads a `Position` once, before a micro-step writes anything, and
advances after it.
"""

import collections

from deferred_grad import arguments
from deferred_grad import compat

tf = compat.import_tensorflow()

# The names of a schedule's counters.
SCHEDULE_NAMES = ('micro_step', 'cycle_length', 'applied_updates')


# A micro-step's place in its cycle, read under the run's lock before it
# adds or counts anything: `in_cycle` (int64, 0 on a cycle's first
# micro-step), `length` (an int, or a checked int64 under a schedule),
# `is_end` (True, or a boolean scalar: this micro-step applies), `updates`
# (int64 updates applied before it, or None if unknown), `step` (a
# `StepCycle`'s step as read, else None) and `checks` (ops failing a bad
# schedule length or restored state: every write waits for them).
Position = collections.namedtuple(
    'Position', 'in_cycle length is_end updates step checks')


class StepCycle(object):
  """A cycle of an int `grad_steps`, decided on a step variable.

  Args:
    grad_steps: micro-steps per cycle.
    step: `global_step` or `update_count`; None for grad_steps=1.
    counts_global_step: whether `step` is `global_step`, counted without
      bound (else modulo `grad_steps`: a float32 stops at 2**24).
  """

  def __init__(self, grad_steps, step=None, counts_global_step=False):
    self.grad_steps = grad_steps
    self.step = step
    self.counts_global_step = counts_global_step

  @property
  def counter(self):
    """The variable the cycle's place is read from, or None."""
    return self.step

  def variables(self):
    return [] if self.step is None or self.counts_global_step else [self.step]

  def read(self, global_step=None, counts_updates=False):
    """Returns the `Position` of the next micro-step; reads, never writes.

    Args:
      global_step: the `global_step` the train op counts, or None; the
        updates applied are `global_step // grad_steps`.
      counts_updates: whether `global_step` counts the updates itself.
    """
    value = None if self.step is None else self.step.read_value()
    updates = None
    if self.counts_global_step or global_step is not None:
      counted = value if self.counts_global_step else global_step.read_value()
      # Divided by 1 when counting updates, for a value of its own: a ref
      # variable's read may alias the buffer this run's increment changes.
      updates = tf.math.floordiv(tf.cast(counted, tf.int64),
                                 1 if counts_updates else self.grad_steps)
    if value is None:  # grad_steps=1: every micro-step is an update
      return Position(in_cycle=tf.constant(0, tf.int64), length=1,
                      is_end=True, updates=updates, step=None, checks=[])
    in_cycle = tf.math.floormod(value, self.grad_steps)
    return Position(
        in_cycle=tf.cast(in_cycle, tf.int64), length=self.grad_steps,
        is_end=tf.equal(in_cycle, self.grad_steps - 1), updates=updates,
        step=value, checks=[])

  def advance(self, position):
    """Counts the micro-step at `position` (its read ordered before)."""
    if self.step is None:
      return tf.no_op()
    if self.counts_global_step:  # locked: see `Record.advance`
      return self.step.assign_add(1, use_locking=True, read_value=False)
    next_value = tf.math.floormod(position.step + 1, self.grad_steps)
    return self.step.assign(next_value, read_value=False)


class Schedule(object):
  """The cycle of a schedule: `grad_steps` a tensor or a callable.

  A cycle keeps the length it began with, across checkpoints too.

  Args:
    grad_steps: an integer scalar tensor, or a callable of the updates.
    counters: three int64 variables: place, length, updates applied.
  """

  counts_global_step = False
  grad_steps = None  # known at run time only

  def __init__(self, grad_steps, counters):
    self._grad_steps = grad_steps
    self.in_cycle, self.length, self.updates = counters

  @property
  def counter(self):
    """The variable the cycle's place is read from."""
    return self.in_cycle

  def variables(self):
    return [self.in_cycle, self.length, self.updates]

  def _next_length(self, updates, in_cycle):
    """Returns (the length after `updates` updates, checks that it is a scalar
    and, on a cycle's first micro-step, at least 1; none in XLA: no Asserts).
    """
    value = self._grad_steps
    if not tf.is_tensor(value):
      value = arguments.check_schedule_value(value(updates), 'the callable')
    value = tf.cast(value, tf.int64)
    if compat.in_xla_context() or tf.get_static_value(value) is not None:
      return tf.reshape(value, []), []
    check = tf.debugging.Assert(
        tf.logical_and(
            tf.equal(tf.size(tf.shape(value)), 0),
            tf.logical_or(tf.not_equal(in_cycle, 0),
                          tf.reduce_all(value >= 1))),
        ['GradientAggregationOptimizer: grad_steps (a schedule) must be at '
         'least 1 at every cycle\'s first micro-step, and a scalar; after',
         updates, 'updates it gave', value])
    with tf.control_dependencies([check]):
      return tf.reshape(value, []), [check]

  def read(self, global_step=None, counts_updates=False):
    """Returns the `Position` of the next micro-step; reads, never writes."""
    del global_step, counts_updates  # the updates are counted here
    # Copied (stacked): under ref variables (v1 behaviour) a read may
    # alias the variable's buffer, which `advance` then writes in place.
    in_cycle, held, updates = tf.unstack(tf.stack(
        [v.read_value() for v in self.variables()]))
    value, checks = self._next_length(updates, in_cycle)
    length = tf.where(tf.equal(in_cycle, 0), tf.maximum(value, 1), held)
    return Position(in_cycle=in_cycle, length=length,
                    is_end=in_cycle + 1 >= length, updates=updates, step=None,
                    checks=checks)

  def advance(self, position):
    """Counts the micro-step at `position`: writes all three counters."""
    values = (tf.where(position.is_end, tf.zeros_like(position.in_cycle),
                       position.in_cycle + 1),
              position.length,
              position.updates + tf.cast(position.is_end, tf.int64))
    return tf.group(*[v.assign(value, read_value=False)
                      for v, value in zip(self.variables(), values)])
