"""A train op's record: its cycle, its counters, and where a run stands.

Each call of `apply_gradients` builds a train op, and each train op keeps
one `Record`, made once for all the replicas that build it (`of_train_op`):
its cycle, its counters, its run lock and the `Position` a run reads
first. A cycle is `grad_steps` micro-steps; its last one applies the
update. Two kinds of cycle share one interface (`read`, the `Position` of
the next micro-step, a read and no write; `advance`, which counts it;
`variables`), so that the optimizer never asks which one it has:

* `StepCycle`, for an int `grad_steps`: the position is read from a step
  variable, the `global_step` passed to `apply_gradients` (counting
  micro-steps without bound, as in the original) or the wrapper's own
  `update_count` (the TPU path, or no `global_step`), which counts
  micro-steps modulo `grad_steps` (a float32 stops counting at 2**24); with
  grad_steps=1 each micro-step is a whole cycle and nothing is kept.
* `Schedule`, for a tensor or callable `grad_steps`: three counters of its
  own hold the position, the length (read from the schedule on the cycle's
  first micro-step, then held) and the updates applied.

An int is not a constant schedule here (as it is in optax): its state is
the original's, one step variable, so that the original's checkpoints
restore and continue their cycle, and a micro-step writes one counter, not
three.

Beside the cycle, the record holds this cycle's counts on each replica
(weights, finite and non-finite micro-batches, as the wrapper's policy
says) and
the totals of what a `nonfinite_policy` skipped. The first train op in a
graph keeps the original's names (`update_count`), so that the original's
checkpoints restore; later ones get unique names (`update_count_1`, ...) in
the order the graph builds them. They are created outside the caller's
variable-scope `reuse` setting, which would otherwise hand every wrapper
the same variable. The records live in graph collections under tuple keys
(not serialized into meta graphs), as TensorFlow's variable store does.
"""

import collections
import contextlib

import numpy as np

from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import distribute

tf = compat.import_tensorflow()

SCHEDULE_NAMES = ('micro_step', 'cycle_length', 'applied_updates')
_WEIGHTED, _COUNTS_UPDATES = checkpoints.WEIGHTED, checkpoints.COUNTS_UPDATES
# Graph collections: [(global step key, whether it decides a cycle)] of the
# train ops that count a global step; [[records of the n-th train op],
# {replica id: train ops it built}].
_COUNTED_STEPS = ('deferred_grad', 'counted_steps')
# The tensors `applied_updates` made: the updates, not the raw global_step;
# the global steps a raw read of was warned about.
_UPDATES_TENSORS = ('deferred_grad', 'applied_updates')
_WARNED = ('deferred_grad', 'warned_raw_global_step')
_TRAIN_OPS = ('deferred_grad', 'train_ops')


# A micro-step's place in its cycle, read under the train op's lock before
# the micro-step adds or counts anything: `in_cycle` (an int64 scalar, 0 on
# a cycle's first micro-step), `length` (the cycle's grad_steps: an int, or
# a checked int64 scalar under a schedule), `is_end` (True, or a boolean
# scalar: this micro-step applies), `updates` (the updates applied before
# it: an int64 scalar, or None where it cannot be known), `step` (the value
# read of a `StepCycle`'s step, else None) and `checks` (ops failing a
# micro-step whose schedule gave a bad length: every write waits for them).
Position = collections.namedtuple(
    'Position', 'in_cycle length is_end updates step checks')


class StepCycle(object):
  """A cycle of an int `grad_steps`, decided on a step variable.

  Args:
    grad_steps: micro-steps per cycle (an int).
    step: the variable the cycle is decided on: `global_step`, or the
      wrapper's own `update_count`; None for grad_steps=1.
    counts_global_step: whether `step` is the `global_step` (counted
      without bound; else counted modulo `grad_steps`).
  """

  def __init__(self, grad_steps, step=None, counts_global_step=False):
    self.grad_steps = grad_steps
    self.step = step
    self.counts_global_step = counts_global_step

  def variables(self):
    return [] if self.step is None or self.counts_global_step else [self.step]

  def read(self, global_step=None, counts_updates=False):
    """The `Position` of the next micro-step: its step read, no write.

    Args:
      global_step: the `global_step` the train op counts, or None; where
        the cycle is decided on its own counter, the updates applied are
        taken as `global_step // grad_steps` (`applied_updates`), or as
        `global_step` itself where it counts updates.
      counts_updates: whether `global_step` counts updates.
    """
    value = None if self.step is None else self.step.read_value()
    updates = None
    if self.counts_global_step or global_step is not None:
      counted = value if self.counts_global_step else global_step.read_value()
      # Counting updates, global_step is them: divided by 1 all the same, a
      # value of its own (a ref variable's read may alias the buffer this
      # run's increment changes in place).
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

  def _next_length(self, updates, in_cycle):
    """The schedule's value for the cycle after `updates` updates.

    Returns:
      (an int64 scalar, [ops that fail the micro-step where the value is not
      a scalar, or is below 1 on a cycle's first micro-step]). Inside XLA,
      which compiles an Assert into nothing, no check: a value below 1
      counts as 1.
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
    """The `Position` of the next micro-step: its counters read, no write."""
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


class Record(object):
  """One train op's record, shared by the replicas that build it.

  Args and attributes:
    cycle: a `StepCycle` or a `Schedule`.
    global_step: the `global_step` the train op counts, or None.
    counts: {name: variable} of this cycle's per-replica counts, in the
      order the optimizer's policy names them; None where the micro-step is
      its cycle (its counts are the micro-step's own).
    skipped: (micro-batches, cycles) int64 totals of what a
      `nonfinite_policy` skipped, or (None, None).
    counts_dtype: the dtype of the counts.
    settings: (the settings variable, its first three values, the
      variable holding the `global_step` the last micro-step left under
      `global_step_counts='updates'` or None), or None (see
      `_settings_variable`).
    counts_updates: whether `global_step` counts updates (one per cycle
      ended), not micro-steps (`global_step_counts`).

  Attributes:
    position: the `Position` a run of this train op reads first (None
      until `begin_run`): fetched alone it says what the next run will do.
    lock: the lock a run holds, or None.
    updated: a boolean scalar, True where a run applied an update (its
      value exists once the run's apply step has run), or None until the
      train op is built.
    op_names: the names of the ops that end its runs (`minimize` and
      `apply_gradients` return them; one per wrapper under a strategy).
    lists: {id(table): its list of rows} (`accumulators`).
    counters: the counters: the cycle's, its counts, what a policy skipped.
  """

  def __init__(self, cycle, global_step, counts, skipped, counts_dtype,
               settings=None, counts_updates=False):
    self.cycle = cycle
    self.global_step = global_step
    self.counts_updates = counts_updates
    self.counts_dtype = counts_dtype
    self.counts = counts
    self.skipped_micro_batches, self.skipped_cycles = skipped
    self.settings, self.settings_values, self.step_left = (
        settings or (None, None, None))
    self.position = self.lock = self.updated = self.step_read = None
    self.op_names, self.lists = [], {}
    self.counters = cycle.variables() + [
        counts[name] for name in sorted(counts or {})] + [
            v for v in skipped + (self.settings, self.step_left)
            if v is not None]

  def begin_run(self, locked, checks=(), in_xla=False):
    """Takes the run's lock (if `locked`) and reads the `Position`, once.

    Under a multi-replica strategy the first replica to build the train op
    makes them; the others share them. Its checks include that the cycle's
    state continues under this train op's settings (`_settings_check`).

    Args:
      locked: whether runs of this train op take turns (a mutex of its own).
      checks: ops to run before the position is read (that the worker's
        own counters are initialized, `distribute.initialized_check`).
      in_xla: built inside an XLA computation (which compiles an Assert
        into nothing).

    Returns:
      (the lock or None, the `Position`).
    """
    if self.position is None:
      if locked:
        # A mutex of its own, held for the rest of the run: every op made
        # under `tf.control_dependencies([lock])` runs while the run holds
        # it, so that runs of one train op from several threads of a session
        # (queue runners, Hogwild-style trainers) take turns: each
        # micro-step reads its place, adds, applies and counts as one. A run
        # that fails releases it. On the host CPU (mutexes have no other
        # kernels), of the device's task (a parameter-server worker's own).
        with tf.device('/device:CPU:0'):
          self.lock = tf.raw_ops.MutexLock(
              mutex=tf.raw_ops.MutexV2(name='run_lock'))
      with tf.control_dependencies(([self.lock] if locked else []) +
                                   list(checks)):
        self.position = self.cycle.read(self.global_step, self.counts_updates)
        if self.settings is not None and not in_xla:
          checks = [_settings_check(self.settings, self.settings_values,
                                    self.position)]
          if self.step_left is not None:
            # A value of its own (a ref variable's read may alias the
            # buffer this run's increment changes in place).
            self.step_read = tf.math.floordiv(
                tf.cast(self.global_step.read_value(), tf.int64), 1)
            checks.append(_step_check(self.global_step, self.step_left,
                                      self.step_read))
          self.position = self.position._replace(
              checks=self.position.checks + checks)
    return self.lock, self.position

  def advance(self, position, updated):
    """Counts the micro-step at `position` once its work has run; releases
    the run's lock. Records `updated` and the op that ends the run.

    After every value derived from the position's read too: under ref
    variables (v1 behaviour) a read may alias the buffer written here.

    Args:
      position: the `Position` that `begin_run` read.
      updated: a boolean scalar, True where the run applied an update,
        which ends the micro-step's work (adds, apply step).

    Returns:
      The op that ends the micro-step.
    """
    self.updated = updated
    derived = [t for t in (position.in_cycle, position.is_end,
                           position.updates, self.step_read)
               if tf.is_tensor(t)]
    with tf.control_dependencies([updated] + derived):
      advanced = self.cycle.advance(position)
      if self.settings is not None:  # the settings, and the place after it
        place = tf.where(position.is_end, tf.constant(0, tf.int64),
                         position.in_cycle + 1)
        advanced = tf.group(advanced, self.settings.assign(
            tf.stack([tf.constant(v, tf.int64) for v in self.settings_values]
                     + [place]), read_value=False))
      if self.step_read is not None:  # what the script's next run must find
        advanced = tf.group(advanced, self.step_left.assign(
            self.step_read + tf.cast(position.is_end, tf.int64),
            read_value=False))
    if self.global_step is not None and not self.cycle.counts_global_step:
      # Counted beside the cycle (once per micro-step, or per cycle ended);
      # locked, as workers sharing the global step on a parameter server
      # may add at once.
      count = 1
      if self.counts_updates and not isinstance(position.is_end, bool):
        count = tf.cast(position.is_end, self.global_step.dtype.base_dtype)
      with tf.control_dependencies([advanced]):
        advanced = self.global_step.assign_add(count, use_locking=True,
                                               read_value=False)
    if self.lock is not None:
      with tf.control_dependencies([advanced]), tf.device('/device:CPU:0'):
        advanced = tf.raw_ops.ConsumeMutexLock(mutex_lock=self.lock)
    self.op_names.append(advanced.name)
    return advanced

  def add_list(self, table, listed):
    """Records `listed`, the list of rows of `table` (`accumulators`).

    Returns:
      `listed`.
    """
    self.lists[id(table)] = listed
    return listed

  def _local_counts(self):
    """This replica's components of the counts ([] without counts)."""
    return compat.replica_components(list((self.counts or {}).values()))

  def add_counts(self, increments):
    """Adds a micro-step's increments to this replica's counts.

    Args:
      increments: the micro-step's counts, in the order of `counts`.

    Returns:
      A list of ops (none where the micro-step is its cycle).
    """
    return [v.assign_add(count, read_value=False)
            for v, count in zip(self._local_counts(), increments)]

  def counts_of_cycle(self, increments):
    """This replica's counts of the cycle, this micro-step's included.

    Copied: under ref variables (v1 behaviour) a read may alias the
    variable's buffer, which the apply step then resets in place.

    Args:
      increments: the micro-step's counts (ordered after they are added).

    Returns:
      A list of scalar tensors, in the order of `counts`.
    """
    counts = list(increments) if self.counts is None else [
        v.read_value() for v in self._local_counts()]
    return tf.unstack(tf.stack(counts)) if counts else []

  def reset_counts(self):
    """Zeroes this replica's counts for the next cycle.

    Returns:
      A list of ops.
    """
    return [v.assign(0.0, read_value=False) for v in self._local_counts()]

  def count_skipped(self, skipped):
    """Adds what a `nonfinite_policy` skipped to the totals.

    Args:
      skipped: (micro-batches, cycles), int64 scalars.

    Returns:
      A list of ops (none without a policy).
    """
    totals = (self.skipped_micro_batches, self.skipped_cycles)
    return [total.assign_add(value, read_value=False)
            for total, value in zip(totals, skipped) if total is not None]

  def applies_update(self):
    """Whether a run ends a cycle (see `Position`).

    Returns:
      A boolean scalar tensor.
    """
    return tf.convert_to_tensor(self.position.is_end)

  def micro_step_in_cycle(self):
    """A run's place in its cycle, 0 on its first (see `Position`).

    Returns:
      An int64 scalar tensor.
    """
    return self.position.in_cycle

  def applied_updates(self):
    """The updates this train op has applied before a run.

    Returns:
      An int64 scalar tensor.

    Raises:
      ValueError: an int `grad_steps` without a `global_step`.
    """
    if self.position.updates is None:
      # A schedule counts its updates itself.
      raise ValueError(
          'applied_updates(): this train op has an int grad_steps and no '
          'global_step to count its updates: pass global_step to minimize (or '
          'apply_gradients), or give grad_steps as a tensor or a callable.')
    return self.position.updates

  def variables(self):
    """The train op's variables: its counters and its tables' lists.

    Returns:
      A list of variables.
    """
    return self.counters + list(self.lists.values())


# ------------------------------------------------------------- creation --

def of_train_op(replica, grad_steps, policy, own_counter, global_step, local,
                counts_dtype, multi_worker, counts_updates=False):
  """The record of the train op being built, made once for all replicas.

  Under a multi-replica strategy every replica builds each train op: the
  same wrapper's `apply_gradients` runs once per replica, and an Estimator
  model_fn even makes a wrapper per replica. The n-th train op a replica
  builds in a graph is the n-th of every other replica: the first replica
  to build it creates its record and its variables, the others share it.
  Call it under `tf.init_scope()`.

  Args:
    replica: this replica's index in its sync group (0 without replicas).
    grad_steps: the int, or a schedule (a tensor or a callable).
    policy: the wrapper's `optimizer.Policy`.
    own_counter: an int cycle counts in `update_count`, not `global_step`.
    global_step: the global step the train op counts, or None.
    local: None (global variables), or a `distribute.WorkerLocal`.
    counts_dtype: the dtype of the cycle's counts.
    multi_worker: under a multi-worker strategy.
    counts_updates: `global_step` counts updates (`global_step_counts`).

  Returns:
    A `Record`.

  Raises:
    ValueError: another wrapper train op counts the `global_step` this one
      decides its cycle on, or the reverse.
  """
  train_ops = tf.compat.v1.get_default_graph().get_collection_ref(_TRAIN_OPS)
  if not train_ops:
    train_ops.append(([], {}))
  records, calls = train_ops[0]
  index = calls.get(replica, 0)
  calls[replica] = index + 1
  if index == len(records):
    records.append(_create(grad_steps, policy, own_counter, global_step,
                           local, counts_dtype, multi_worker, counts_updates))
  return records[index]


def _create(grad_steps, policy, own_counter, global_step, local, counts_dtype,
            multi_worker, counts_updates):
  """Creates a train op's record and its variables (see `of_train_op`).

  With grad_steps=1 a micro-step is its cycle: its counts are tensors of
  the step, and only a policy's totals are variables.
  """
  fixed = isinstance(grad_steps, int)
  accumulates = not (fixed and grad_steps == 1)
  if global_step is not None:
    # Under a schedule the train op only counts it (`Schedule`).
    _count_global_step(global_step, fixed and accumulates)
    if multi_worker:
      compat.plain_global_step_read(global_step)
  skipped = (None, None)
  if policy.nonfinite_policy:
    skipped = tuple(_own_variable(name, tf.int64, local)
                    for name in ('skipped_micro_batches', 'skipped_cycles'))
  cycle, counts = StepCycle(1), None
  if accumulates:
    summed = tf.distribute.get_strategy().num_replicas_in_sync > 1 and (
        not multi_worker)
    with (tf.compat.v1.variable_creator_scope(distribute.summed_on_save)
          if summed else contextlib.nullcontext()):
      # Saved as their sum over replicas.
      counts = {name: _own_variable(name, counts_dtype, local, counter=False)
                for name in policy.counts}
    if not fixed:
      cycle = Schedule(grad_steps, [_own_variable(name, tf.int64, local)
                                    for name in SCHEDULE_NAMES])
    elif own_counter:
      cycle = StepCycle(grad_steps,
                        _own_variable('update_count', tf.float32, local))
    else:
      cycle = StepCycle(grad_steps, global_step, counts_global_step=True)
  settings = None
  if local is None:  # (a parameter-server worker drops its partial cycle)
    checkpoints.add_to_state(cycle.variables() + list((counts or {}).values())
                             + [v for v in skipped if v is not None])
    if accumulates:
      settings = _settings_variable(
          [grad_steps if fixed else 0,
           int(policy.weighted) | (_COUNTS_UPDATES if counts_updates else 0),
           arguments.NONFINITE_POLICIES.index(policy.nonfinite_policy)],
          cycle, global_step)
  return Record(cycle, global_step, counts, skipped, counts_dtype, settings,
                counts_updates)


def _settings_variable(values, cycle, global_step):
  """A train op's settings variable, in the train op's name scope.

  `<scope>/deferred_grad_settings`, int64 [grad_steps or 0 for a schedule,
  flags (1: weighted, `_COUNTS_UPDATES`: `global_step` counts updates), the
  `nonfinite_policy`'s index, the place in the cycle after the last
  micro-step]: a partial cycle's sums mean what the settings they were
  added under say (divided by that `grad_steps`, weighted or not), and a
  checkpoint holds them beside the sums (`_settings_check`).

  Args:
    values: the first three values.
    cycle: the train op's cycle (`StepCycle` or `Schedule`).
    global_step: the `global_step` it counts, or None.

  Under `global_step_counts='updates'` a second variable,
  `<scope>/deferred_grad_global_step`, holds the `global_step` the last
  micro-step left (-1: not known, afresh): only the wrapper moves it then,
  so a run that finds it moved meets a script's own increment
  (`_step_check`).

  Returns:
    (the variable, `values`, the second variable or None).
  """
  step_left = None
  if values[1] & _COUNTS_UPDATES and global_step is not None:
    step_left = tf.compat.v1.Variable(
        lambda: tf.constant(-1, tf.int64), name='deferred_grad_global_step',
        trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    checkpoints.add_to_state([step_left], np.array(-1, np.int64))
  variable = tf.compat.v1.Variable(
      lambda: tf.constant(values + [0], tf.int64),
      name='deferred_grad_settings',
      trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
  # Where a checkpoint without settings (the original's) has its place.
  counter = cycle.in_cycle if isinstance(cycle, Schedule) else cycle.step
  checkpoints.add_settings(variable, values, (
      counter.name.split(':')[0], cycle.grad_steps or None), (
          None if global_step is None else global_step.name.split(':')[0]))
  return variable, values, step_left


def _step_check(global_step, step_left, step_read):
  """An op that fails a micro-step finding `global_step` moved since the
  wrapper's last micro-step (`global_step_counts='updates'`, where the
  wrapper alone moves it, once per cycle ended).

  Args:
    global_step: the `global_step` variable.
    step_left: the variable holding what the last micro-step left, or -1.
    step_read: `global_step` as this run read it (int64).
  """
  left = step_left.read_value()
  return tf.debugging.Assert(
      tf.logical_or(tf.equal(left, -1), tf.equal(left, step_read)), [
          'GradientAggregationOptimizer: %s counts updates '
          '(global_step_counts=updates), and the wrapper alone adds to '
          'it, once per cycle ended; it left' % global_step.op.name,
          tf.cast(left, tf.int32), 'and this run found', tf.cast(
              step_read, tf.int32),
          '. Something else moved it: the script increments it beside the '
          'wrapper, which counts it already (remove that increment).'])


def _settings_check(variable, values, position):
  """An op that fails a micro-step whose restored cycle does not continue
  here: saved mid-cycle under other settings, or placed mid-cycle by a
  `global_step` without the cycle's partial sums.

  Args:
    variable: the settings variable (`_settings_variable`).
    values: this train op's settings (its first three values).
    position: the micro-step's `Position`.
  """
  # Copied (stacked), as `Schedule.read`'s counters: under ref variables
  # (v1 behaviour) a read may alias the buffer that a run's write changes
  # in place (runs from several threads saw another run's settings). int32
  # and strings: an Assert of them needs no cond around it.
  saved = tf.cast(tf.stack(tf.unstack(variable.read_value(), 4)), tf.int32)
  place = tf.cast(position.in_cycle, tf.int32)
  # The same grad_steps; weights and a policy kept (the sums do not depend
  # on the policy's kind; counts added are missing from the checkpoint,
  # which then starts the cycle afresh); the place it left.
  flags = saved[1]
  kept = [tf.equal(saved[0], values[0]), tf.equal(saved[3], place)]
  if not values[1] & _WEIGHTED:
    kept.append(tf.equal(tf.bitwise.bitwise_and(flags, _WEIGHTED), 0))
  if not values[2]:
    kept.append(tf.equal(saved[2], 0))
  continues = tf.reduce_all(tf.stack(kept))
  afresh = tf.logical_and(tf.equal(saved[3], 0), tf.equal(place, 0))
  # What global_step counts, at any place (`checkpoints.convert_checkpoint`
  # converts it).
  same_count = tf.equal(tf.bitwise.bitwise_and(flags, _COUNTS_UPDATES),
                        values[1] & _COUNTS_UPDATES)
  policy = arguments.NONFINITE_POLICIES[values[2]]
  here = '%s, %s, nonfinite_policy=%r, global_step_counts=%r' % (
      'grad_steps=%d' % values[0] if values[0] else 'grad_steps a schedule',
      'a micro_batch_weight' if values[1] & _WEIGHTED else
      'micro_batch_weight=None', policy,
      'updates' if values[1] & _COUNTS_UPDATES else 'micro_steps')
  return tf.debugging.Assert(tf.logical_and(
      same_count, tf.logical_or(continues, afresh)), [
      'GradientAggregationOptimizer: the cycle of the restored checkpoint '
      'does not continue in this train op (%s): its partial sums would be '
      'applied '
      'wrongly. It was saved with [grad_steps (0: a schedule), flags (1: a '
      'micro_batch_weight, 2: global_step_counts=\'updates\'), '
      'nonfinite_policy (0: None, 1: skip_micro_batch, 2: skip_cycle), '
      'micro-steps of its cycle done] =' % here, saved,
      '; here its counter places this run at micro-step', place,
      '. Restore it with the settings it was saved with and change them after '
      'the last micro-step of a cycle; a new int grad_steps needs a '
      'global_step that is a multiple of it (or give grad_steps as '
      'tf.constant(n)); another global_step_counts needs '
      'deferred_grad.convert_checkpoint. Without a restore, something else '
      'moved global_step: the script increments it beside the wrapper, which '
      'counts it already (remove that increment).'],
                             summarize=4)


def _own_variable(name, dtype, local, counter=True):
  """Creates a scalar variable named `name` in the current variable scope,
  initially 0.

  Call it under `tf.init_scope()`. The name is made unique in the graph.

  Args:
    name: the base name, e.g. 'update_count'.
    dtype: its dtype.
    local: None (a global variable), or a `distribute.WorkerLocal`.
    counter: whether a multi-replica strategy takes the first replica's
      writes (a counter), or aggregates none (a replica's count).

  Returns:
    The variable (not trainable).
  """
  scope = tf.compat.v1.get_variable_scope().name
  full_name = scope + '/' + name if scope else name
  initial_value = lambda: tf.constant(0, dtype)
  if local is not None:
    return local.variable(full_name, initial_value, dtype)
  # name_scope(None): the variable scope's name, not the current name
  # scope's, as `tf.compat.v1.get_variable` (the original's) names it; the
  # graph appends _1, _2, ... when the name is taken.
  with tf.compat.v1.name_scope(None):
    return tf.compat.v1.Variable(
        initial_value, dtype=dtype, name=full_name, trainable=False,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA if counter
        else tf.VariableAggregation.NONE)


def _count_global_step(global_step, accumulates):
  """Records that a train op counts `global_step`; refuses a conflict.

  A train op that accumulates (an int grad_steps > 1) decides its cycle on
  the `global_step` it counts, so no other wrapper train op may count the
  same one: each would see only part of the micro-steps (two train ops run
  in turn each see every other one) and apply at the wrong micro-steps.

  Args:
    global_step: the variable passed to `apply_gradients`.
    accumulates: whether this train op decides its cycle on it.

  Raises:
    ValueError: another train op of a wrapper in this graph counts
      `global_step`, and one of the two decides its cycle on it.
  """
  counted = tf.compat.v1.get_default_graph().get_collection_ref(
      _COUNTED_STEPS)
  for other_key, other_accumulates in counted:
    if other_key == global_step.name and (accumulates or other_accumulates):
      # The others count their cycles in an update_count_N of their own.
      raise ValueError(
          'global_step %s is already counted by another train op of a '
          'GradientAggregationOptimizer in this graph, and one of them decides '
          'its cycle on it (grad_steps > 1): pass it to one of them only and '
          'global_step=None to the others.' % global_step.name)
  counted.append((global_step.name, accumulates))


@tf.autograph.experimental.do_not_convert
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

  Made after a train op that counts `global_step` with this `grad_steps`
  (in a moving average after the train op, a summary, a hook's fetch), it
  is that train op's `applied_updates()`: the updates before the run,
  wherever it is read in the run. Made before one (a learning rate), it is
  `global_step // grad_steps`, a plain read: right where the update reads
  it, but fetched in a run beside the train op it may read `global_step`
  before or after the run's increment (README "Counters").

  With a schedule (`grad_steps` a tensor or a callable) the updates are
  not a function of `global_step`: use the wrapper's
  `GradientAggregationOptimizer.applied_updates()` there. With
  `global_step_counts='updates'`, `global_step` is the updates: a schedule
  reads it directly (a wrapped optimizer reading this tensor is refused).

  Args:
    global_step: the integer step variable (or tensor) passed to
      `apply_gradients`, counting micro-steps.
    grad_steps: the wrapper's `grad_steps`.
    name: optional name for the returned tensor's scope.

  Returns:
    An integer tensor of `global_step`'s dtype: `global_step // grad_steps`.

  Raises:
    TypeError, ValueError: `grad_steps` is not a positive int (a schedule
      included).
  """
  if tf.is_tensor(grad_steps) or callable(grad_steps):
    raise TypeError(
        'deferred_grad.applied_updates() needs an int grad_steps, got the '
        'schedule %r, whose updates are not a function of global_step: use '
        'the wrapper\'s applied_updates() method.' % (grad_steps,))
  grad_steps = arguments.check_positive_int(grad_steps, 'grad_steps')
  with tf.compat.v1.name_scope(name, 'applied_updates', [global_step]):
    train_ops = global_step.graph.get_collection(_TRAIN_OPS)
    counting = [record for record in (train_ops[0][0] if train_ops else [])
                if record.position is not None and
                record.cycle.grad_steps == grad_steps and
                getattr(record.global_step, 'name', None) == global_step.name]
    if counting:  # read once per run, before the run counts
      return tf.cast(counting[-1].position.updates,
                     global_step.dtype.base_dtype)
    updates = tf.math.floordiv(global_step, grad_steps)
    updates.graph.add_to_collection(_UPDATES_TENSORS, updates)
    return updates



def check_schedule_reads(op, record, grad_steps):
  """Checks what the wrapped optimizer's update `op` reads as its step.

  Counting micro-steps, a learning rate (or another hyperparameter) decayed
  on the raw `global_step` advances `grad_steps` times too fast: a warning,
  once per graph and global step, names the fixes. Counting updates
  (`global_step_counts='updates'`), `deferred_grad.applied_updates(
  global_step, grad_steps)` made before the train op divides the updates
  by `grad_steps` again: an error.

  Args:
    op: the op the wrapped optimizer's `apply_gradients` returned.
    record: the train op's `Record`.
    grad_steps: the wrapper's `grad_steps`, for the messages.

  Raises:
    ValueError: counting updates, the update reads
      `deferred_grad.applied_updates` of this `global_step`.
  """
  step = record.global_step
  if step is None:
    return
  divided = [t.op.name for t in step.graph.get_collection(_UPDATES_TENSORS)
             if _reads(t.op, {step.op.name}, set(), step.graph)]
  if record.counts_updates:
    found = _reads(op, set(divided), set(), step.graph)
    if found is not None:
      raise ValueError(
          'The wrapped optimizer reads deferred_grad.applied_updates(%s, '
          'grad_steps) (%s), which divides global_step by grad_steps; with '
          'global_step_counts=\'updates\' global_step counts the updates '
          'already: give the schedule global_step itself.' %
          (step.op.name, found))
    return
  warned = step.graph.get_collection_ref(_WARNED)
  if step.name in warned:
    return
  allowed = set(divided)
  if tf.is_tensor(record.position.updates):
    allowed.add(record.position.updates.op.name)
  found = _reads(op, {step.op.name}, allowed, step.graph)
  if found is not None:
    warned.append(step.name)
    tf.compat.v1.logging.warning(
        'GradientAggregationOptimizer: the wrapped optimizer reads %s '
        '(through %s), which counts micro-steps: a schedule on it '
        'advances %s times too fast. Pass global_step_counts=\'updates\' '
        'to the wrapper, or give the schedule '
        'deferred_grad.applied_updates(global_step, grad_steps) (or the '
        'wrapper\'s applied_updates()).', step.op.name, found,
        'grad_steps=%d' % grad_steps if isinstance(grad_steps, int)
        else 'grad_steps')


def _reads(op, targets, stops, graph):
  """The name of the op through which `op` reads one of the ops named
  `targets` in `graph`, walking its inputs back (from a control flow v2
  branch to what it captured; not into a v1 cond's predicate; through the
  NoOps grouping `op`'s own ops), not past the ops named `stops`; or None.
  """
  seen, pending = set(), [op]
  while pending and len(seen) < 100000:
    current = pending.pop()
    captured = {inside.name: outside for outside, inside in
                getattr(current.graph, 'captures', ())}
    inputs = list(current.inputs)
    if current.type in ('Switch', 'RefSwitch'):
      inputs = inputs[:1]  # not the cond's predicate (the cycle's end)
    if current.type == 'NoOp':  # a group of the optimizer's updates (not
      # the orderings a v1 cond gives every op of its branch)
      grouped = [c for c in current.control_inputs
                 if c.name.startswith(op.name + '/') and
                 (c.graph, c.name) not in seen]
      pending.extend(grouped)
      seen.update((c.graph, c.name) for c in grouped)
    for tensor in inputs:
      tensor = captured.get(tensor.name, tensor)
      if tensor.op.name in targets and tensor.graph is graph:
        return current.name
      if (tensor.graph, tensor.op.name) not in seen and (
          tensor.op.name not in stops):
        seen.add((tensor.graph, tensor.op.name))
        pending.append(tensor.op)
  return None
