"""A train op's record: its cycle, its counters, and where a run stands.

Each train op keeps one `Record`, shared by the replicas that build it (the
n-th train op each replica builds shares the n-th record of the graph's
`registry`). `begin_run` takes the run's lock and reads the cycle's
`cycles.Position` once; `advance` counts the micro-step and releases it.
"""

import contextlib

from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import cycles
from deferred_grad import distribute
from deferred_grad import registry

tf = compat.import_tensorflow()


class Record(object):
  """One train op's record, shared by the replicas that build it.

  Args and attributes:
    cycle: a `cycles.StepCycle` or a `cycles.Schedule`.
    global_step: the `global_step` the train op counts, or None.
    counts: {name: variable} of the cycle's per-replica counts, in the
      numerics' order; None where a micro-step is its own cycle.
    skipped: (micro-batches, cycles) totals a policy skipped, or Nones.
    counts_dtype: the dtype of the counts.
    settings: its `checkpoints.Settings`, or None.
    counts_updates: whether `global_step` counts updates, not micro-steps.
    state: [(variable, its value afresh or None)]: what a checkpoint holds.
    variable_names: the op names of the variables it trains (each
      component of a mirrored one), for `port_checks`.

  Attributes:
    position: the `cycles.Position` a run reads first; None until
      `begin_run`.
    updated: a boolean scalar, True where a run applied an update; None
      until `advance`.
    op_names: the names of the ops that end its runs.
    counters: its variables, but for its tables' lists.
    lists: {id(table): its list of rows} (`accumulators`).
    wrappers: the wrappers that built it (one per replica, or one).
  """

  def __init__(self, cycle, global_step, counts, skipped, counts_dtype,
               settings=None, counts_updates=False, state=(),
               variable_names=()):
    self.cycle = cycle
    self.variable_names = frozenset(variable_names)
    self.state = list(state)
    self.global_step = global_step
    self.counts_updates = counts_updates
    self.counts_dtype = counts_dtype
    self.counts = counts
    self.skipped_micro_batches, self.skipped_cycles = skipped
    self.settings = settings
    self.position = self.lock = self.updated = None
    self.op_names, self.lists, self.wrappers = [], {}, []
    self.counters = cycle.variables() + [
        counts[name] for name in sorted(counts or {})] + [
            v for v in skipped if v is not None] + (
                settings.variables() if settings is not None else [])

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
          self.position = self.position._replace(
              checks=self.position.checks + self.settings.check(
                  self.position))
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
    step_read = self.settings.step_read if self.settings is not None else None
    # After every value derived from the read too: a ref variable's read may
    # alias the buffer written here.
    derived = [t for t in (position.in_cycle, position.is_end,
                           position.updates, step_read)
               if tf.is_tensor(t)]
    with tf.control_dependencies([updated] + derived):
      advanced = self.cycle.advance(position)
      if self.settings is not None:  # the settings, and the place after it
        advanced = self.settings.advance(position, advanced)
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


# ------------------------------------------------------------ lookup --

def of_op(records, train_op):
  """The record among `records` whose train op `train_op` is, or groups.

  Args:
    records: the records of a wrapper's train ops in a graph, in order.
    train_op: the op `minimize` or `apply_gradients` returned (or a group
      of it); None: the last.

  Returns:
    A `Record`.

  Raises:
    ValueError: `records` is empty; or `train_op` is none of theirs, or
      groups several.
  """
  if not records:
    raise ValueError(
        'No train op has been built with this wrapper in this graph yet: '
        'call minimize or apply_gradients first. (For a learning rate, '
        'pass a callable: it is called as the train op is built.)')
  if train_op is None:
    return records[-1]
  # The op, or a group of it (`tf.group` nests its control inputs; a
  # train op's own inputs are not searched).
  found, seen, pending = [], set(), [getattr(train_op, 'op', train_op)]
  while pending:
    op = pending.pop()
    owners = [record for record in records if op.name in record.op_names]
    found += [record for record in owners if record not in found]
    if not owners and op.name not in seen:
      seen.add(op.name)
      pending.extend(op.control_inputs)
  if len(found) == 1:
    return found[0]
  raise ValueError(
      'train_op=%r %s: pass the op minimize or apply_gradients returned (or '
      'a group of it).' % (train_op, (
          'groups several train ops of this wrapper' if found else
          'is not a train op of this wrapper in this graph')))


# ------------------------------------------------- ops after the update --

def after_update(train_op, updated, fn):
  """`train_op`, then `fn`'s ops where `updated` (a boolean scalar).

  Raises:
    TypeError: `fn` returned None.
    ValueError: `fn` made a summary.
  """
  summaries = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
  with tf.control_dependencies([train_op]):
    after = compat.cond(updated, lambda: _ops_of(fn), tf.no_op)
  check_no_summary_made(summaries, "once_per_update's fn")
  return tf.group(train_op, after)


def _ops_of(fn):
  """`fn()`'s ops in one op (a control flow v1 branch runs only what its
  result depends on); a TypeError where it returned None."""
  made = fn()
  if made is None:
    raise TypeError(
        'once_per_update: fn returned None; return the ops it made (an op, a '
        'tensor or a list), or they do not run under control flow v1.')
  return tf.group(*tf.nest.flatten(made))


def check_no_summary_made(before, maker='The wrapped optimizer'):
  """Raises a ValueError if summaries were made since `before`: inside the
  apply step's cond they can be neither fetched on other runs nor merged.

  Args:
    before: the graph's summaries before.
    maker: what made them, for the message.
  """
  made = [summary.name for summary in tf.compat.v1.get_collection(
      tf.compat.v1.GraphKeys.SUMMARIES) if all(
          summary is not known for known in before)]
  if made:
    raise ValueError(
        '%s made the summaries %s inside the tf.cond run once per update: '
        'they cannot be fetched on other micro-steps nor merged. Make them '
        'outside minimize and once_per_update: of the learning rate before '
        'passing it, or of a variable the update assigns.' % (maker, made))


def listed_as_train_op(train_op, before):
  """Resets TRAIN_OP to `before` plus `train_op`, returning `train_op`: the
  wrapped optimizer listed its own op there, inside a cond, unfetchable."""
  listed = tf.compat.v1.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
  listed[:] = before + [train_op] * all(op is not train_op for op in before)
  return train_op


# ------------------------------------------------------------- creation --

def of_train_op(build, variables, grad_steps, policy, global_step,
                accumulator_dtype, counts_updates, own_counter):
  """Returns the record of the train op being built, shared by all replicas.

  The n-th train op each replica builds shares one. Call under init_scope.

  Args:
    build: where it is built (`distribute.Build`).
    variables: the variables it trains.
    grad_steps: an int, or a schedule (a tensor or a callable).
    policy: the wrapper's `numerics.Numerics`.
    global_step: the global step the train op counts, or None.
    accumulator_dtype: the wrapper's keyword (the counts are at least as
      wide as the widest accumulator).
    counts_updates: whether `global_step` counts updates.
    own_counter: whether an int cycle counts in `update_count`.

  Returns:
    A `Record`.

  Raises:
    ValueError: two train ops count `global_step`, one deciding its cycle.
  """
  known = registry.of(tf.compat.v1.get_default_graph())
  index = known.built.get(build.replica, 0)
  known.built[build.replica] = index + 1
  if index == len(known.records):
    known.records.append(_create(
        known, build, variables, grad_steps, policy, global_step,
        _counts_dtype(variables, accumulator_dtype), counts_updates,
        own_counter))
  return known.records[index]


def _create(known, build, variables, grad_steps, policy, global_step,
            counts_dtype, counts_updates, own_counter):
  """Returns a new `Record` and makes its variables (see `of_train_op`); with
  grad_steps=1, only a policy's totals are variables.
  """
  local = build.local
  fixed = isinstance(grad_steps, int)
  accumulates = not (fixed and grad_steps == 1)
  if global_step is not None:
    # Under a schedule the train op only counts it (`cycles.Schedule`).
    _count_global_step(known, global_step, fixed and accumulates)
    if build.multi_worker:
      compat.plain_global_step_read(global_step)
  skipped = (None, None)
  if policy.nonfinite_policy:
    skipped = tuple(_own_variable(name, tf.int64, local)
                    for name in ('skipped_micro_batches', 'skipped_cycles'))
  cycle, counts = cycles.StepCycle(1), None
  if accumulates:
    summed = build.replicas > 1 and not build.multi_worker
    with (tf.compat.v1.variable_creator_scope(distribute.summed_on_save)
          if summed else contextlib.nullcontext()):
      # Saved as their sum over replicas.
      counts = {name: _own_variable(name, counts_dtype, local, counter=False)
                for name in policy.counts}
    if not fixed:
      cycle = cycles.Schedule(grad_steps, [
          _own_variable(name, tf.int64, local)
          for name in cycles.SCHEDULE_NAMES])
    elif own_counter:
      cycle = cycles.StepCycle(
          grad_steps, _own_variable('update_count', tf.float32, local))
    else:
      cycle = cycles.StepCycle(grad_steps, global_step,
                               counts_global_step=True)
  settings, state = None, []
  if local is None:  # (a parameter-server worker drops its partial cycle)
    state = [(v, None) for v in cycle.variables() + list(
        (counts or {}).values()) + [v for v in skipped if v is not None]]
    if accumulates:
      flags = (checkpoints.WEIGHTED if policy.weighted else 0) | (
          checkpoints.COUNTS_UPDATES if counts_updates else 0)
      settings = checkpoints.Settings(
          [grad_steps if fixed else 0, flags,
           arguments.NONFINITE_POLICIES.index(policy.nonfinite_policy)],
          (cycle.counter, cycle.grad_steps or None), global_step)
      state += settings.state
  strategy = tf.distribute.get_strategy()
  names = [part.op.name for v in variables
           for part in strategy.experimental_local_results(v)]
  return Record(cycle, global_step, counts, skipped, counts_dtype, settings,
                counts_updates, state, names)


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


def _count_global_step(known, global_step, accumulates):
  """Records in the graph's registry `known` that a train op counts
  `global_step`.

  Raises:
    ValueError: another train op counts it and one of the two decides its
      cycle on it: each would see only part of the micro-steps.
  """
  counted = known.counted_steps
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
    counting = [record for record in registry.of(global_step.graph).records
                if record.position is not None and
                record.cycle.grad_steps == grad_steps and
                getattr(record.global_step, 'name', None) == global_step.name]
    if counting:  # read once per run, before the run counts
      return tf.cast(counting[-1].position.updates,
                     global_step.dtype.base_dtype)
    updates = tf.math.floordiv(global_step, grad_steps)
    registry.of(updates.graph).updates_tensors.append(updates)
    return updates


def _counts_dtype(variables, accumulator_dtype):
  """The dtype of a train op's counts: its widest accumulator's, at least
  float32, so that fractional weight sums keep the model's precision."""
  dtypes = [accumulator_dtype or v.dtype.base_dtype for v in variables]
  return max(dtypes + [tf.float32], key=lambda dtype: dtype.size)
