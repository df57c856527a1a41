"""A train op's cycle: where a micro-step is in it, and the state it keeps.

A cycle is `grad_steps` micro-steps; its last one applies the update. Three
kinds of cycle share one interface (`divisor`, what a micro-step divides
its gradients by as it adds them; `read`, the micro-step's `Position`;
`advance`; `variables`), so that the optimizer never asks which one it has:

* `EveryMicroStep`, for grad_steps=1: each micro-step is a whole cycle.
* `StepCycle`, for an int `grad_steps`: the position is read from a step
  variable, the `global_step` passed to `apply_gradients` (counting
  micro-steps without bound, as in the original) or the wrapper's own
  `update_count` (the TPU path, or no `global_step`), which counts
  micro-steps modulo `grad_steps` (a float32 stops counting at 2**24).
* `Schedule`, for a tensor or callable `grad_steps`: three counters of its
  own hold the position, the length (read from the schedule on the cycle's
  first micro-step, then held) and the updates applied.

`TrainOpState` holds a train op's cycle and the rest of its state as data:
this cycle's counts on each replica (see `numerics`) and the totals of what
a policy skipped; `state` creates it, once for all replicas. `ReplicaPart`
is one replica's part of a train op: the values its apply step needs.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import collections

from deferred_grad import arguments
from deferred_grad import compat

tf = compat.import_tensorflow()

# A micro-step's place in its cycle, read under the train op's lock before
# the micro-step adds or counts anything: `in_cycle` (an int64 scalar, 0 on
# a cycle's first micro-step), `length` (the cycle's grad_steps: an int, or
# a checked int64 scalar under a schedule), `is_end` (True, or a boolean
# scalar: this micro-step applies), `updates` (the updates applied before
# it: an int64 scalar, or None where it cannot be known), `step` (the value
# read of a `StepCycle`'s step, else None) and `checks` (ops failing a
# micro-step whose schedule gave a bad length: every write waits for them).
Position = collections.namedtuple(
    'Position',
    ['in_cycle', 'length', 'is_end', 'updates', 'step', 'checks'])


def acquire_lock():
  """Takes a mutex of its own for the rest of a run; returns its lock.

  Every op made under `tf.control_dependencies([lock])` runs while the run
  holds it, so that runs of one train op from several threads of a session
  (queue runners, Hogwild-style trainers) take turns: each micro-step reads
  its place, adds, applies and counts as one. A run that fails releases
  it. Made on the host CPU (mutexes have no other kernels), on the device's
  task (a parameter-server worker: the worker's own).

  Returns:
    The lock, a variant tensor; hand it to `release_lock` once.
  """
  with tf.device('/device:CPU:0'):
    mutex = tf.raw_ops.MutexV2(name='run_lock')
    return tf.raw_ops.MutexLock(mutex=mutex)


def release_lock(lock, after):
  """The op releasing `lock` (from `acquire_lock`) once `after` has run."""
  with tf.control_dependencies([after]), tf.device('/device:CPU:0'):
    return tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)


def count_on(step):
  """Adds one micro-step to a global step (atomically: workers share it)."""
  if compat.is_ref_variable(step):
    # Locked: workers sharing the step on a parameter server add at once.
    return tf.compat.v1.assign_add(step, 1, use_locking=True).op
  return step.assign_add(1, read_value=False)


class EveryMicroStep(object):
  """The cycle of grad_steps=1: every micro-step ends it; nothing is kept."""

  grad_steps = 1
  counts_global_step = False

  def variables(self):
    return []

  def read(self, global_step=None):
    """The `Position`: always a whole cycle's end."""
    updates = None
    if global_step is not None:  # every micro-step is an update
      updates = tf.cast(global_step.read_value(), tf.int64)
    return Position(in_cycle=tf.constant(0, tf.int64), length=1,
                    is_end=True, updates=updates, step=None, checks=[])

  def advance(self, position):
    del position
    return tf.no_op()


class StepCycle(object):
  """A cycle of an int `grad_steps`, decided on a step variable.

  Args:
    grad_steps: micro-steps per cycle (an int above 1).
    step: the variable the cycle is decided on: `global_step`, or the
      wrapper's own `update_count`.
    counts_global_step: whether `step` is the `global_step` (counted
      without bound; else counted modulo `grad_steps`).
  """

  def __init__(self, grad_steps, step, counts_global_step):
    self.grad_steps = grad_steps
    self.step = step
    self.counts_global_step = counts_global_step

  def variables(self):
    return [] if self.counts_global_step else [self.step]

  def read(self, global_step=None):
    """The `Position` of the next micro-step: its step read, no write.

    Args:
      global_step: the `global_step` the train op counts, or None; where
        the cycle is decided on its own counter, the updates applied are
        taken as `global_step // grad_steps` (`applied_updates`).
    """
    value = self.step.read_value()
    in_cycle = tf.math.floormod(value, self.grad_steps)
    updates = None
    if self.counts_global_step:
      updates = tf.math.floordiv(tf.cast(value, tf.int64), self.grad_steps)
    elif global_step is not None:
      updates = tf.math.floordiv(
          tf.cast(global_step.read_value(), tf.int64), self.grad_steps)
    return Position(
        in_cycle=tf.cast(in_cycle, tf.int64), length=self.grad_steps,
        is_end=tf.equal(in_cycle, self.grad_steps - 1), updates=updates,
        step=value, checks=[])

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

  In checkpoints its counters make a job resume mid-cycle with the length
  the cycle started with, whatever the schedule says by then; a value that
  changes mid-cycle takes effect at the next cycle.

  Args:
    grad_steps: a scalar integer tensor, or a callable of the updates
      applied (an int64 scalar) returning one.
    counters: three int64 variables: the micro-step's place in its cycle,
      the cycle's length, the updates applied.
  """

  counts_global_step = False
  grad_steps = None  # known at run time only

  def __init__(self, grad_steps, counters):
    self._grad_steps = grad_steps
    self.in_cycle, self.length, self.updates = counters

  def variables(self):
    return [self.in_cycle, self.length, self.updates]

  def place(self):
    """The micro-steps of the cycle so far, read when run (int64)."""
    return self.in_cycle.read_value()

  def _next_length(self, updates, in_cycle):
    """The schedule's value for the cycle after `updates` updates.

    Returns:
      (an int64 scalar, [ops that fail the micro-step where the value is not
      a scalar, or is below 1 on a cycle's first micro-step]). Inside XLA,
      which compiles an Assert into nothing, no check: a value below 1
      counts as 1.
    """
    if tf.is_tensor(self._grad_steps):
      value = self._grad_steps
    else:
      value = arguments.check_schedule_value(self._grad_steps(updates),
                                             'the callable')
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

  def read(self, global_step=None):
    """The `Position` of the next micro-step: its counters read, no write."""
    del global_step  # the updates are counted here
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


class TrainOpState(object):
  """One train op's state, shared by the replicas that build it.

  Args and attributes:
    cycle: an `EveryMicroStep`, `StepCycle` or `Schedule`.
    global_step: the `global_step` the train op counts, or None.
    counts: {name: variable} of this cycle's per-replica counts, in the
      order of `numerics.Policy.counts`; None where the micro-step is its
      cycle (its counts are the micro-step's own).
    skipped: (micro-batches, cycles) int64 totals of what a
      `nonfinite_policy` skipped, or (None, None).
    counts_dtype: the dtype of the counts (`numerics.counts_dtype`).

  Attributes:
    position: the `Position` a run of this train op reads first (None
      until `begin_run`): fetched alone it says what the next run will do.
    lock: the lock a run holds (`acquire_lock`), or None.
  """

  def __init__(self, cycle, global_step, counts, skipped,
               counts_dtype=tf.float32):
    self.cycle = cycle
    self.global_step = global_step
    self.counts_dtype = counts_dtype
    self.counts = counts
    self.skipped_micro_batches, self.skipped_cycles = skipped
    self.position = None
    self.lock = None
    self.lists = {}  # id(table) -> its list of rows (`accumulators`)

  def begin_run(self, locked, checks=()):
    """Takes the run's lock (if `locked`) and reads the `Position`, once.

    Under a multi-replica strategy the first replica to build the train op
    makes them; the others share them.

    Args:
      locked: whether runs of this train op take turns (`acquire_lock`).
      checks: ops to run before the position is read (that the worker's
        own counters are initialized, `placement.initialized_check`).

    Returns:
      (the lock or None, the `Position`).
    """
    if self.position is None:
      if locked:
        self.lock = acquire_lock()
      with tf.control_dependencies(([self.lock] if locked else []) +
                                   list(checks)):
        self.position = self.cycle.read(self.global_step)
    return self.lock, self.position

  def end_run(self, op):
    """`op`, or the op that releases the run's lock once `op` has run."""
    if self.lock is None:
      return op
    return release_lock(self.lock, op)

  def add_counts(self, increments):
    """Ops adding a micro-step's `numerics.increments` to the counts."""
    return [compat.local_variable(v).assign_add(count, read_value=False)
            for v, count in zip((self.counts or {}).values(), increments)]

  def counts_of_cycle(self, increments):
    """This replica's counts of the cycle, this micro-step's included.

    Copied: under ref variables (v1 behaviour) a read may alias the
    variable's buffer, which the apply step then resets in place.
    """
    if self.counts is None:
      counts = list(increments)
    else:
      counts = [compat.local_variable(v).read_value()
                for v in self.counts.values()]
    return tf.unstack(tf.stack(counts)) if counts else []

  def reset_counts(self):
    """Ops zeroing this replica's counts for the next cycle."""
    return [compat.local_variable(v).assign(0.0, read_value=False)
            for v in (self.counts or {}).values()]

  def count_skipped(self, skipped):
    """Ops adding (micro-batches, cycles) skipped to the totals."""
    if self.skipped_cycles is None:
      return []
    return [total.assign_add(value, read_value=False) for total, value in
            zip((self.skipped_micro_batches, self.skipped_cycles), skipped)]

  def advance(self, position):
    """Counts the micro-step at `position` in the cycle and `global_step`.

    After every value derived from the position's read: under ref variables
    (v1 behaviour) a read may alias the buffer written here.
    """
    derived = [t for t in (position.in_cycle, position.is_end,
                           position.updates) if tf.is_tensor(t)]
    with tf.control_dependencies(derived):
      advanced = self.cycle.advance(position)
    if self.global_step is None or self.cycle.counts_global_step:
      return advanced
    with tf.control_dependencies([advanced]):  # counted beside the cycle
      return count_on(self.global_step)

  def applies_update(self):
    """True when a run ends a cycle (a boolean tensor; see `Position`)."""
    return tf.convert_to_tensor(self.position.is_end)

  def micro_step_in_cycle(self):
    """A run's place in its cycle, an int64 tensor (see `Position`)."""
    return self.position.in_cycle

  def applied_updates(self):
    """The updates this train op has applied before a run (int64).

    Raises:
      ValueError: an int `grad_steps` without a `global_step`.
    """
    if self.position.updates is None:
      raise ValueError(
          'applied_updates(): with an int grad_steps the updates are counted '
          'by the global_step only, and this train op was built without one. '
          'Pass global_step to minimize (or apply_gradients), or give '
          'grad_steps as a schedule (a tensor or a callable), whose train op '
          'counts its updates itself.')
    return self.position.updates

  def counters(self):
    """The counters: the cycle's, its counts, what a policy skipped."""
    own = self.cycle.variables()
    own += [self.counts[name] for name in sorted(self.counts or {})]
    return own + [v for v in (self.skipped_micro_batches, self.skipped_cycles)
                  if v is not None]

  def variables(self):
    """The train op's variables: its counters and its tables' lists."""
    return self.counters() + list(self.lists.values())


class ReplicaPart(object):
  """One replica's part of one train op: plain values for the apply step.

  Args and attributes:
    state: the train op's `TrainOpState` (shared by the replicas).
    var_list: the variables.
    accumulators: their `accumulators.Accumulators` (or `PassThrough`).
    gradients: the micro-step's weighed gradients.
    increments: the micro-step's counts (`numerics.increments`).
    shared_rows: the micro-step's rows of tables whose list the replicas
      share (`accumulators.Accumulators.shared_rows`), by index.
  """

  def __init__(self, state, var_list, accumulators, gradients, increments,
               shared_rows):
    self.state = state
    self.var_list = list(var_list)
    self.accumulators = accumulators
    self.gradients = gradients
    self.increments = increments
    self.shared_rows = shared_rows

  def counts_of_cycle(self):
    """This replica's counts of the cycle, this micro-step's included."""
    return self.state.counts_of_cycle(self.increments)


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

  With a schedule (`grad_steps` a tensor or a callable) the updates are
  not a function of `global_step`: use the wrapper's
  `GradientAggregationOptimizer.applied_updates()` there.

  Args:
    global_step: the integer step variable (or tensor) passed to
      `apply_gradients`, counting micro-steps.
    grad_steps: the wrapper's `grad_steps`.
    name: optional name for the returned tensor's scope.

  Returns:
    An integer tensor: `global_step // grad_steps`.

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
