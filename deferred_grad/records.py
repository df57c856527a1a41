"""A train op's record: its cycle, its counters, and where a run stands.

Each train op keeps one `Record`, shared by the replicas that build it.
A cycle is `grad_steps` micro-steps; the last applies the update. An int
`grad_steps` (`StepCycle`) reads its place from one step variable, as the
original did, so that its checkpoints restore mid-cycle; a schedule
(`Schedule`) keeps three counters: place, length and updates applied.
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
# Graph collections, under tuple keys so that meta graphs do not serialize
# them: [(global step name, whether it decides a cycle)] of the train ops
# that count a global step; [[records of the n-th train op],
# {replica id: train ops it built}].
_COUNTED_STEPS = ('deferred_grad', 'counted_steps')
# The tensors `applied_updates` made: the updates, not the raw global_step;
# the global steps a raw read of was warned about.
_UPDATES_TENSORS = ('deferred_grad', 'applied_updates')
_WARNED = ('deferred_grad', 'warned_raw_global_step')
_TRAIN_OPS = ('deferred_grad', 'train_ops')


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


class Record(object):
  """One train op's record, shared by the replicas that build it.

  Args and attributes:
    cycle: a `StepCycle` or a `Schedule`.
    global_step: the `global_step` the train op counts, or None.
    counts: {name: variable} of the cycle's per-replica counts, in the
      policy's order; None where a micro-step is its own cycle.
    skipped: (micro-batches, cycles) totals a policy skipped, or Nones.
    counts_dtype: the dtype of the counts.
    settings: what `_settings_variable` returns, or None.
    counts_updates: whether `global_step` counts updates, not micro-steps.

  Attributes:
    position: the `Position` a run reads first; None until `begin_run`.
    op_names: the names of the ops that end its runs.
    counters: its variables, but for its tables' lists.
  """

  def __init__(self, cycle, global_step, counts, skipped, counts_dtype,
               settings=None, counts_updates=False, state=(),
               settings_entry=None):
    self.cycle = cycle
    # What a checkpoint must hold, for `checkpoints.register`: [(variable,
    # its value afresh or None)], and the settings' entry.
    self.state, self.settings_entry = list(state), settings_entry
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
    """Locks (if `locked`) and reads the `Position`, once for all replicas.

    Args:
      locked: whether runs of this train op take turns on a mutex.
      checks: ops to run before the read (`distribute.initialized_check`).
      in_xla: whether inside XLA, which drops Asserts (no settings checks).

    Returns:
      (the lock or None, the `Position`).
    """
    if self.position is None:
      if locked:
        # Ops made under a dependency on the lock run while the run holds it,
        # so that runs from several session threads (queue runners,
        # Hogwild-style trainers) take turns, each micro-step reading,
        # adding, applying and counting as one; a failed run releases it. On
        # the CPU, as mutexes have no other kernels, of the device's task (a
        # parameter-server worker's own).
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
            # The global_step this run found: an int cycle has read it as
            # its updates; a schedule counts its own, so read it here, a
            # value of its own (a ref variable's read may alias the
            # buffer this run's increment changes in place).
            self.step_read = (
                self.position.updates if isinstance(self.cycle, StepCycle)
                else tf.math.floordiv(
                    tf.cast(self.global_step.read_value(), tf.int64), 1))
            checks.append(_step_check(self.global_step, self.step_left,
                                      self.step_read))
          self.position = self.position._replace(
              checks=self.position.checks + checks)
    return self.lock, self.position

  def advance(self, position, updated):
    """Counts the micro-step after its work, and releases the run's lock.

    Args:
      position: the `Position` that `begin_run` read.
      updated: a boolean scalar, True where the run applied an update.

    Returns:
      The op that ends the micro-step.
    """
    self.updated = updated
    # After every value derived from the read too: a ref variable's read may
    # alias the buffer written here.
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

  def add_state(self, variables, initial=None):
    """Adds `variables` to the state a checkpoint holds (`initial`: their
    value afresh, or None for zeros)."""
    self.state.extend((variable, initial) for variable in variables)

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

    Args:
      increments: the micro-step's counts (ordered after they are added).

    Returns:
      A list of scalar tensors, in the order of `counts`.
    """
    # Copied (stacked): a ref variable's read may alias the buffer that the
    # apply step resets in place.
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

def of_train_op(build, grad_steps, policy, global_step, counts_dtype,
                counts_updates, own_counter):
  """Returns the record of the train op being built, shared by all replicas.

  The n-th train op each replica builds shares one. Call under init_scope.

  Args:
    build: where it is built (`distribute.Build`).
    grad_steps: an int, or a schedule (a tensor or a callable).
    policy: the wrapper's `optimizer.Policy`.
    global_step: the global step the train op counts, or None.
    counts_dtype: the dtype of the cycle's counts.
    counts_updates: whether `global_step` counts updates.
    own_counter: whether an int cycle counts in `update_count`.

  Returns:
    A `Record`.

  Raises:
    ValueError: two train ops count `global_step`, one deciding its cycle.
  """
  train_ops = tf.compat.v1.get_default_graph().get_collection_ref(_TRAIN_OPS)
  if not train_ops:
    train_ops.append(([], {}))
  records, calls = train_ops[0]
  index = calls.get(build.replica, 0)
  calls[build.replica] = index + 1
  if index == len(records):
    records.append(_create(build, grad_steps, policy, global_step,
                           counts_dtype, counts_updates, own_counter))
  return records[index]


def _create(build, grad_steps, policy, global_step, counts_dtype,
            counts_updates, own_counter):
  """Returns a new `Record` and makes its variables (see `of_train_op`); with
  grad_steps=1, only a policy's totals are variables.
  """
  local = build.local
  fixed = isinstance(grad_steps, int)
  accumulates = not (fixed and grad_steps == 1)
  if global_step is not None:
    # Under a schedule the train op only counts it (`Schedule`).
    _count_global_step(global_step, fixed and accumulates)
    if build.multi_worker:
      compat.plain_global_step_read(global_step)
  skipped = (None, None)
  if policy.nonfinite_policy:
    skipped = tuple(_own_variable(name, tf.int64, local)
                    for name in ('skipped_micro_batches', 'skipped_cycles'))
  cycle, counts = StepCycle(1), None
  if accumulates:
    summed = build.replicas > 1 and not build.multi_worker
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
  settings = entry = None
  state = []
  if local is None:  # (a parameter-server worker drops its partial cycle)
    state = [(v, None) for v in cycle.variables() + list(
        (counts or {}).values()) + [v for v in skipped if v is not None]]
    if accumulates:
      settings, entry = _settings_variable(
          [grad_steps if fixed else 0,
           int(policy.weighted) | (_COUNTS_UPDATES if counts_updates else 0),
           arguments.NONFINITE_POLICIES.index(policy.nonfinite_policy)],
          cycle, global_step)
      if settings[2] is not None:  # afresh: not known
        state.append((settings[2], np.array(-1, np.int64)))
  return Record(cycle, global_step, counts, skipped, counts_dtype, settings,
                counts_updates, state, entry)


def _settings_variable(values, cycle, global_step):
  """Returns ((the settings variable, `values`, the step-left variable or
  None), the settings' entry for `checkpoints.register`).

  `deferred_grad_settings` [grad_steps or 0, flags, policy index, place]
  says what a checkpoint's partial sums mean (`_settings_check`); counting
  updates, `deferred_grad_global_step` holds what the last micro-step left.
  """
  step_left = None
  if values[1] & _COUNTS_UPDATES and global_step is not None:
    step_left = tf.compat.v1.Variable(
        lambda: tf.constant(-1, tf.int64), name='deferred_grad_global_step',
        trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
  variable = tf.compat.v1.Variable(
      lambda: tf.constant(values + [0], tf.int64),
      name='deferred_grad_settings',
      trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
  # Where a checkpoint without settings (the original's) has its place.
  counter = cycle.in_cycle if isinstance(cycle, Schedule) else cycle.step
  entry = (variable, values, (
      counter.name.split(':')[0], cycle.grad_steps or None), (
          None if global_step is None else global_step.name.split(':')[0]))
  return (variable, values, step_left), entry


def _step_check(global_step, step_left, step_read):
  """Returns an Assert failing a run that finds `global_step` moved since the
  last micro-step: counting updates, only the wrapper moves it.
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
  """Returns an Assert failing a run whose restored cycle cannot continue:
  saved mid-cycle under other settings, or mid-cycle without partial sums.
  """
  # Copied (stacked), as in `Schedule.read`: a ref variable's read may alias
  # the buffer another run's write changes in place. int32 and strings: an
  # Assert of them needs no cond around it.
  saved = tf.cast(tf.stack(tf.unstack(variable.read_value(), 4)), tf.int32)
  place = tf.cast(position.in_cycle, tf.int32)
  # The same grad_steps; weights and a policy kept (the sums do not depend
  # on the policy's kind; counts it lacks would start the cycle afresh);
  # the place it left.
  flags = saved[1]
  kept = [tf.equal(saved[0], values[0]), tf.equal(saved[3], place)]
  if not values[1] & _WEIGHTED:
    kept.append(tf.equal(tf.bitwise.bitwise_and(flags, _WEIGHTED), 0))
  if not values[2]:
    kept.append(tf.equal(saved[2], 0))
  continues = tf.reduce_all(tf.stack(kept))
  afresh = tf.logical_and(tf.equal(saved[3], 0), tf.equal(place, 0))
  # What global_step counts, at any place (`convert_checkpoint` converts).
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
  """Returns a new scalar variable, 0 at first, named `name` in the scope;
  `counter`: a strategy keeps the first replica's writes, else each's own.
  """
  scope = tf.compat.v1.get_variable_scope().name
  full_name = scope + '/' + name if scope else name
  initial_value = lambda: tf.constant(0, dtype)
  if local is not None:
    return local.variable(full_name, initial_value, dtype)
  # A Variable, not get_variable: the caller's `reuse` would hand every
  # wrapper the same one. name_scope(None): named in the variable scope, as
  # get_variable (the original's) names it; the graph appends _1, _2, ...
  # when the name is taken, so later train ops get `update_count_1`, ...
  with tf.compat.v1.name_scope(None):
    return tf.compat.v1.Variable(
        initial_value, dtype=dtype, name=full_name, trainable=False,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA if counter
        else tf.VariableAggregation.NONE)


def _count_global_step(global_step, accumulates):
  """Records that a train op counts `global_step`.

  Raises:
    ValueError: another train op counts it and one of the two decides its
      cycle on it: each would see only part of the micro-steps.
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

  The wrapper increments `global_step` once per micro-step, so a schedule
  on it advances `grad_steps` times too fast: give it this tensor instead
  (after a train op counting `global_step`, that op's `applied_updates()`).

  ```python
  global_step = tf.compat.v1.train.get_or_create_global_step()
  updates = deferred_grad.applied_updates(global_step, grad_steps=4)
  learning_rate = tf.compat.v1.train.exponential_decay(
      0.1, updates, decay_steps=1000, decay_rate=0.5)
  opt = deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.9), grad_steps=4)
  ```

  Args:
    global_step: the integer step passed to `apply_gradients`, counting
      micro-steps (counting updates, use `global_step` itself).
    grad_steps: the wrapper's int `grad_steps`.
    name: optional name scope.

  Returns:
    An integer tensor of `global_step`'s dtype: `global_step // grad_steps`.

  Raises:
    TypeError, ValueError: `grad_steps` is a schedule or not a positive int.
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



def check_schedule_reads(op, record, grad_steps, made):
  """Checks what the wrapped optimizer's update `op` reads as its step.

  Counting micro-steps, a raw `global_step` read gets a warning; counting
  updates, an `applied_updates` read is refused.

  Args:
    op: the op the wrapped optimizer's `apply_gradients` returned.
    record: the train op's `Record`.
    grad_steps: the wrapper's `grad_steps`, for the messages.
    made: the names of the ops its `apply_gradients` made.

  Raises:
    ValueError: counting updates, `op` reads `applied_updates`.
  """
  step = record.global_step
  if step is None:
    return
  divided = [t.op.name for t in step.graph.get_collection(_UPDATES_TENSORS)
             if _reads(t.op, {step.op.name}, set(), step.graph)]
  if record.counts_updates:
    found = _reads(op, set(divided), set(), step.graph, made)
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
  found = _reads(op, {step.op.name}, allowed, step.graph, made)
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


def _reads(op, targets, stops, graph, made=()):
  """Returns the name of the op through which `op` reads an op in `targets`,
  or None. Walks inputs back, not past `stops`: into v2 captures and the
  ops grouped by NoOps that are in `made` (an optimizer's groups of its
  updates, BERT's `tf.group(*assignments)` too), not into a v1 cond's
  predicate.
  """
  seen, pending = set(), [op]
  while pending and len(seen) < 100000:
    current = pending.pop()
    captured = {inside.name: outside for outside, inside in
                getattr(current.graph, 'captures', ())}
    inputs = list(current.inputs)
    if current.type in ('Switch', 'RefSwitch'):
      inputs = inputs[:1]  # not the cond's predicate (the cycle's end)
    if current.type == 'NoOp':  # a group of the optimizer's updates, not
      # the orderings a v1 cond or the wrapper gives every op it makes
      grouped = [c for c in current.control_inputs
                 if c.name in made and (c.graph, c.name) not in seen]
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


# The op types that write a variable: assignments, scatters, fused updates.
_WRITES = ('Assign', 'Scatter', 'ResourceScatter', 'Apply', 'ResourceApply',
           'SparseApply', 'ResourceSparseApply')


class PortCheckHook(tf.compat.v1.train.SessionRunHook):
  """Warns of the edits a port may still need that no train op can see.

  The wrapper sees what its train op reads, not what a script builds after
  it nor where the script stops. Add this hook while porting; a correct
  port logs nothing.

  * `begin` names each op ordered after a train op of the wrapper that
    writes a variable on every micro-step: a moving average or projection
    left after the train op (it belongs in `once_per_update`), or the
    script's own `global_step` increment (remove it).
  * `end` names a train op whose run stopped mid-cycle: micro-batches
    accumulated and not applied.

  ```python
  estimator.train(input_fn, max_steps=...,
                  hooks=[deferred_grad.PortCheckHook()])
  ```

  Without a `MonitoredSession` (a `Session` or `Supervisor` loop), call
  `begin()` once the graph is built and `end(session)` after the last run.
  """

  def __init__(self):
    self._places = []

  def begin(self):
    """Warns of writes after a train op; builds the reads `end` runs."""
    graph = tf.compat.v1.get_default_graph()
    train_ops = graph.get_collection(_TRAIN_OPS)
    built = [record for record in (train_ops[0][0] if train_ops else [])
             if record.op_names]
    # Of train ops built in this graph: one inside a function (XLA's) ends
    # in the function's graph, whose names mean nothing here.
    ends = {name: record.op_names[0] for record in built
            if record.position.in_cycle.graph is graph
            for name in record.op_names}
    # A global_step no train op counts is the script's to count (a canned
    # head increments it after its optimizers, as the original asks of a
    # wrapper given no global_step): not a miss.
    global_step = tf.compat.v1.train.get_global_step(graph)
    uncounted = set(_component_names(global_step))
    for record in built:
      uncounted -= set(_component_names(record.global_step))
    found = collections.OrderedDict()
    for op, train_op in _writes_after(graph, ends):
      if _written(op) not in uncounted:
        found.setdefault(train_op, []).append(op)
    for train_op, ops in found.items():
      written = sorted({_written(op) for op in ops})
      tf.compat.v1.logging.warning(
          'deferred_grad.PortCheckHook: %d op(s) run after the train op %s '
          'and write on every micro-step: %s (%s, ...). If the large batch '
          'ran them once per step (a moving average, a projection), build '
          'them in opt.once_per_update(train_op, fn); if one increments '
          'global_step, remove it: the wrapper counts global_step.',
          len(ops), train_op, ', '.join(written[:5]) + (
              ', ...' if len(written) > 5 else ''), ops[0].name)
    self._places = []
    with tf.compat.v1.name_scope('deferred_grad_port_check'):
      for record in built:
        cycle = record.cycle
        if isinstance(cycle, Schedule):
          place = (cycle.in_cycle.read_value(), cycle.length.read_value())
        elif cycle.step is not None:
          place = (tf.math.floormod(tf.cast(cycle.step.read_value(),
                                            tf.int64), cycle.grad_steps),
                   tf.constant(cycle.grad_steps, tf.int64))
        else:  # every micro-step is an update
          continue
        self._places.append((record.op_names[0], place))

  def end(self, session):
    """Warns of each train op that stopped mid-cycle."""
    if not self._places:
      return
    values = session.run([place for _, place in self._places])
    for (train_op, _), (in_cycle, length) in zip(self._places, values):
      if in_cycle:
        tf.compat.v1.logging.warning(
            'deferred_grad.PortCheckHook: training stopped mid-cycle: the '
            'train op %s accumulated %d of its %d micro-batches and applied '
            'none of them. A checkpoint saved now resumes them; to end on an '
            'update, stop at a cycle\'s end (a step limit of N * grad_steps, '
            'or global_step_counts=\'updates\').', train_op, in_cycle, length)


def _component_names(variable):
  """The op names of `variable`'s components (a mirrored variable's, one per
  replica); none for None."""
  if variable is None:
    return []
  strategy = getattr(variable, 'distribute_strategy', None)
  strategy = strategy or tf.distribute.get_strategy()
  return [v.op.name for v in strategy.experimental_local_results(variable)]


def _written(op):
  """The name of the variable that the write `op` writes."""
  source = op.inputs[0].op
  while source.type == 'Identity' and source.inputs:
    source = source.inputs[0].op
  return source.name


def _writes_after(graph, ends):
  """Returns [(op, the train op)] for each op of `graph` that writes a
  variable and runs after an op in `ends` ({name: its train op}), by data or
  control, on every run: not in a v1 cond's branch or loop (fed by a Switch,
  as `once_per_update`'s branch is; a v2 cond is one op).
  """
  after, gated = collections.defaultdict(list), set()
  switches = []
  for op in graph.get_operations():
    for before in [t.op for t in op.inputs] + list(op.control_inputs):
      after[before.name].append(op)
    if op.type in ('Switch', 'RefSwitch'):
      switches.append(op)
  while switches:  # what a Switch's outputs feed, up to a Merge
    for tensor in switches.pop().outputs:
      for op in tensor.consumers():
        if op.name not in gated and op.type not in ('Merge', 'RefMerge'):
          gated.add(op.name)
          switches.append(op)
  found, seen = [], set(ends)
  pending = list(ends.items())
  while pending:
    name, train_op = pending.pop()
    for op in after[name]:
      if op.name not in seen:
        seen.add(op.name)
        pending.append((op.name, train_op))
        if (op.type.startswith(_WRITES) and op.inputs and
            op.name not in gated):
          found.append((op, train_op))
  return found
