"""Optimizer wrapper for deferred (accumulated) gradient application.

`apply_gradients` builds one micro-step, read top to bottom:

1. check the arguments (`arguments`, a clip left in the script:
   `port_checks`); make the train op's record once for all replicas
   (`records`, which makes its `cycles` and `checkpoints.Settings`) and this
   replica's accumulators (`accumulators`);
2. take the run's lock and read the cycle's `Position` (`records`);
3. on this replica: check and weigh (`numerics`), add (`accumulators`),
   count (`records`);
4. decide in a `tf.cond` on the cycle's end: the GPU path after a
   `merge_call` into the cross-replica context (the wrapped optimizer's
   slots made there, `checkpoints`), the TPU path in the replica;
5. apply: sum the counts over replicas once where there are any
   (`distribute`), decide whether the cycle applies (`numerics`), then on
   each replica read, scale and clip (`numerics`), apply with the wrapped
   optimizer and reset (`accumulators`);
6. advance: count the micro-step, release the lock (`records`).

The numerics keywords are one value (`numerics.Numerics`), made in the
constructor: the micro-step and the apply step call it and test no keyword.
"""

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import numerics
from deferred_grad import port_checks
from deferred_grad import records
from deferred_grad import registry

tf = compat.import_tensorflow()
# Entry points that user code reaches are never converted by AutoGraph (a
# strategy converts the replica function, and with it what it calls): the
# package's Python control flow is graph building, not computation.
_not_converted = tf.autograph.experimental.do_not_convert


class ReplicaPart(object):
  """One replica's part of one train op: what its apply step needs.

  Not a tuple: `merge_call` would take it apart.

  Args and attributes:
    record: the train op's `records.Record`.
    var_list: the variables it trains.
    accumulators: this replica's `accumulators.Accumulators`.
    increments: this micro-step's additions to the counts.
    shared_rows: its rows of tables whose list the replicas share, by index.
  """

  def __init__(self, record, var_list, accumulators, increments,
               shared_rows):
    self.record = record
    self.var_list = var_list
    self.accumulators = accumulators
    self.increments = increments
    self.shared_rows = shared_rows


class GradientAggregationOptimizer(checkpoints.ObjectCheckpoints,
                                   tf.compat.v1.train.Optimizer):
  """Optimizer wrapper that applies the mean gradient of `grad_steps` calls.

  ```python
  opt = tf.compat.v1.train.AdamOptimizer(1e-3)
  opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)
  train_op = opt.minimize(loss, global_step=global_step)
  # Each run of train_op is a micro-step; every 8th also applies the update.
  ```

  Gradients of `grad_steps` micro-batches accumulate in a slot per variable;
  their mean goes to the wrapped optimizer once per cycle, as for one batch
  `grad_steps` times larger (batch statistics stay per micro-batch). Runs of
  one train op from several threads take turns: each micro-step counts once.
  """

  @_not_converted
  def __init__(self,
               opt,
               grad_steps,
               apply_crs_to_grad=False,
               xla_num_partitions=None,
               use_tpu=False,
               sparse_as_dense=False,
               nonfinite_policy=None,
               accumulator_dtype=None,
               clip_norm=None,
               aggregation='mean',
               micro_batch_weight=None,
               name='GradientAggregationOptimizer',
               global_step_counts='micro_steps'):
    """Constructs the wrapper.

    Args:
      opt: the `tf.compat.v1.train.Optimizer` that applies the mean gradient.
      grad_steps: micro-steps per update: a positive int, or a schedule (a
        scalar integer tensor, or a callable of the int64 updates applied
        returning one), read on each cycle's first micro-step.
      apply_crs_to_grad: bool; sum each accumulated gradient over TPU cores.
      xla_num_partitions: None, or a positive int: shard accumulator reads
        over that many XLA partitions (`sharding`).
      use_tpu: bool; decide the cycle inside the replica (the TPU path).
      sparse_as_dense: bool; densify `tf.IndexedSlices` (else keep the rows).
      nonfinite_policy: for a NaN or inf micro-batch: None (it poisons the
        update), 'skip_micro_batch' (apply the mean of the finite ones) or
        'skip_cycle' (the cycle applies nothing).
      accumulator_dtype: None (the variable's dtype), or a wider float dtype.
      clip_norm: None, or a positive float: clip the cycle's gradient to this
        global norm over all replicas (inf clips nothing).
      aggregation: 'mean' or 'sum' of the micro-batch gradients.
      micro_batch_weight: None, or a scalar tensor (or a callable, called on
        each replica) weighing the micro-step, e.g. its token count: the cycle
        applies `sum(w_i * g_i) / sum(w_i)` (with 'sum', the numerator).
      name: the name scope of the ops `apply_gradients` makes.
      global_step_counts: what `global_step` counts: 'micro_steps' (one per
        run; feed schedules `applied_updates()`) or 'updates' (one per cycle,
        as the large batch counts, so schedules and step limits read it as is).

    Raises:
      TypeError: an argument has the wrong type (e.g. `opt` is not a v1
        `Optimizer`, or is a `SyncReplicasOptimizer`).
      ValueError: an argument is out of range or not one of its choices.
    """
    self._opt = arguments.check_optimizer(opt)
    self._grad_steps = arguments.check_grad_steps(grad_steps)
    self._apply_crs_to_grad = arguments.check_bool(apply_crs_to_grad,
                                                   'apply_crs_to_grad')
    self._use_tpu = arguments.check_bool(use_tpu, 'use_tpu')
    self._sparse_as_dense = arguments.check_bool(sparse_as_dense,
                                                 'sparse_as_dense')
    self._accumulator_dtype = arguments.check_accumulator_dtype(
        accumulator_dtype)
    self._xla_num_partitions = None if xla_num_partitions is None else (
        arguments.check_positive_int(xla_num_partitions, 'xla_num_partitions'))
    # The numerics keywords, made one value once.
    self._numerics = numerics.Numerics(nonfinite_policy, aggregation,
                                       micro_batch_weight, clip_norm)
    self._scope_name = arguments.check_name(name)
    self._counts_updates = arguments.check_choice(
        global_step_counts, arguments.GLOBAL_STEP_COUNTS,
        'global_step_counts') == 'updates'
    super().__init__(use_locking=False, name=name)
    # The record of the train op built last, in any graph (the train ops'
    # records are in their graph's `registry`).
    self._last_record = None
    self.strategy = tf.distribute.get_strategy()

  @property
  def grad_steps(self):
    """The number of micro-steps per applied update (an int or a schedule)."""
    return self._grad_steps

  @property
  def skipped_micro_batches(self):
    """int64 variable: micro-batches a `nonfinite_policy` skipped (or None).

    Of the train op built last (in this graph if any), updated on apply steps.

    Raises:
      ValueError: no train op has been built with this wrapper.
    """
    return self._record(None, any_graph=True).skipped_micro_batches

  @property
  def skipped_cycles(self):
    """int64 variable: cycles that applied nothing, or None (as above).

    Raises:
      ValueError: no train op has been built with this wrapper.
    """
    return self._record(None, any_graph=True).skipped_cycles

  @_not_converted
  def applies_update(self, train_op=None):
    """A boolean tensor: True when a run of the train op ends a cycle.

    It reads the counters before the run counts its micro-step, as do
    `micro_step_in_cycle` and `applied_updates`: fetched with the train op it
    tells that run, fetched alone (a hook) the next.

    Args:
      train_op: the op `minimize` or `apply_gradients` returned (or a group
        of it); None: the train op built last in this graph.

    Returns:
      A boolean scalar tensor.

    Raises:
      ValueError: no train op of this wrapper in this graph matches `train_op`.
    """
    return self._record(train_op).applies_update()

  @_not_converted
  def micro_step_in_cycle(self, train_op=None):
    """An int64 tensor: a run's place in its cycle, 0 on its first.

    Args:
      train_op: as for `applies_update`.

    Returns:
      An int64 scalar tensor, read as `applies_update` is.

    Raises:
      ValueError: as for `applies_update`.
    """
    return self._record(train_op).micro_step_in_cycle()

  @_not_converted
  def applied_updates(self, train_op=None):
    """An int64 tensor: the updates the train op applied before a run.

    For learning-rate schedules, in place of `global_step`, through a
    callable learning rate:
    `MomentumOptimizer(lambda: schedule(opt.applied_updates()), 0.9)`.

    Args:
      train_op: as for `applies_update`.

    Returns:
      An int64 scalar tensor, read as `applies_update` is.

    Raises:
      ValueError: as for `applies_update`; or an int `grad_steps` and a train
        op built without a `global_step`.
    """
    return self._record(train_op).applied_updates()

  @_not_converted
  def once_per_update(self, train_op, fn):
    """Runs `fn`'s ops after the update, only on the runs that apply one.

    For ops a model runs once per batch (a moving average, a pruning mask's
    update), which after the train op alone would run every micro-step. `fn`
    is called once, now, in a `tf.cond`; under a strategy, cross-replica (the
    first replica's `fn`). It reads counters as `applies_update` does.

    ```python
    ema = tf.compat.v1.train.ExponentialMovingAverage(
        0.9999, num_updates=opt.applied_updates() + 1)
    train_op = opt.once_per_update(train_op, lambda: ema.apply(ema_vars))
    ```

    Args:
      train_op: the op `minimize` or `apply_gradients` returned, or a group
        of it (such as another `once_per_update`'s result).
      fn: a callable with no arguments that makes the ops and returns them.

    Returns:
      An op that runs `train_op`, then on update runs `fn`'s ops.

    Raises:
      ValueError: `train_op` is no train op of this wrapper, or `fn` made a
        summary (unfetchable on other runs; summarize a variable `fn` sets).
      TypeError: `fn` is not callable, or returned None.
    """
    if not callable(fn):
      raise TypeError('once_per_update(train_op, fn): fn must be a callable '
                      'that makes the ops and returns them, got %r.' % (fn,))
    record = self._record(train_op)
    context = tf.distribute.get_replica_context()
    if context is None or self._use_tpu:  # here, as the TPU path decides
      return records.after_update(train_op, record.updated, fn)

    def across_replicas(distribution, train_op, fn):
      first = distribution.experimental_local_results
      return records.after_update(first(train_op)[0], record.updated,
                                  first(fn)[0])

    return context.merge_call(across_replicas, args=(train_op, fn))

  def _record(self, train_op, any_graph=False):
    """The record (`records.Record`) of `train_op` in this graph."""
    graph = compat.outermost_graph()
    built = [record for record in registry.records_of(self, graph)
             if record.position is not None and
             record.position.in_cycle.graph is graph]
    if any_graph and not built and self._last_record is not None:
      built = [self._last_record]
    return records.of_op(built, train_op)

  @_not_converted
  def compute_gradients(self, loss, var_list=None, **kwargs):
    """Delegates to the wrapped optimizer's `compute_gradients`.

    Args:
      loss: the micro-batch's loss.
      var_list: the variables, or None for the trainable ones.
      **kwargs: the wrapped optimizer's other arguments.

    Returns:
      The (gradient, variable) pairs, for `apply_gradients`.

    Raises:
      RuntimeError: in eager mode or a `tf.function`; on the GPU path in a
        cross-replica context; under a multi-worker `ParameterServerStrategy`.
      ValueError: the TPU path under several replicas.
    """
    arguments.check_graph_mode('compute_gradients')
    arguments.check_replicas(tf.distribute.get_replica_context(),
                             self._use_tpu, 'compute_gradients')
    return self._opt.compute_gradients(loss, var_list=var_list, **kwargs)

  # -------------------------------------------------------- the algorithm --

  @_not_converted
  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Accumulates a micro-step's gradients; applies their mean every cycle.

    Args:
      grads_and_vars: (gradient, variable) pairs from `compute_gradients`;
        None gradients are skipped, a variable's repeats summed.
      global_step: optional integer `Variable`, incremented once per call, or
        once per cycle with `global_step_counts='updates'`.
      name: optional name of the returned op and scope of the ops made here.

    Returns:
      An op that runs one micro-step.

    Raises:
      RuntimeError: as for `compute_gradients`.
      NotImplementedError: a gradient's variable is not a `tf.Variable`.
      TypeError: an argument, gradient or weight of the wrong type or dtype.
      ValueError: as for `compute_gradients`; no gradients, or gradients of a
        `SyncReplicasOptimizer`; `apply_crs_to_grad` outside TPU; a
        `global_step` shared with a train op that decides its cycle on it; a
        narrow `accumulator_dtype`; an invalid weight or schedule.
    """
    # The graph's train ops before this one (`records.listed_as_train_op`).
    train_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)
    # 1. Checks; the train op's record and accumulators, made once.
    # grad_steps=1: each micro-step is a cycle, applying its own gradients.
    accumulates = not (isinstance(self._grad_steps, int) and
                       self._grad_steps == 1)
    replica_context = tf.distribute.get_replica_context()
    present = arguments.check_apply_gradients(
        grads_and_vars, global_step, name, replica_context, self._use_tpu,
        self._apply_crs_to_grad,
        self._accumulator_dtype if accumulates else None)
    port_checks.check_clipped(present)  # a clip left in the script
    var_list = [v for _, v in present]
    strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    in_xla = compat.in_xla_context()  # before init_scope, which leaves it
    multi_worker = replicas > 1 and compat.in_multi_worker_mode(strategy)
    # Where the wrapped optimizer's non-slot variables go, found before the
    # name scope opens (`name` changes op names only); checkpoints restore
    # across settings (see `checkpoints`).
    # (The apply step is in a cond unless each micro-step is its cycle.)
    scopes = checkpoints.scopes(in_cond=accumulates)
    with tf.compat.v1.name_scope(name, self._scope_name) as scope:
      # Variables on parameter servers: the state is the worker's own.
      local = distribute.worker_local(var_list)
      build = distribute.Build(compat.replica_index(), replicas, in_xla,
                               multi_worker, local)
      # Sparse or dense is fixed at graph build, from the gradients' types;
      # a cross-replica sum needs the same shape on every core: dense.
      sparse = not (self._sparse_as_dense or self._apply_crs_to_grad)
      record, accumulators = self._state_of_train_op(
          build, present, global_step, sparse, accumulates)

      # 2. The run's lock and the cycle's position, first: runs of this
      # train op from several threads take turns (not inside XLA, where no
      # mutex compiles, nor where workers run in lockstep anyway).
      locked = accumulates and not (in_xla or multi_worker)
      initialized = (distribute.initialized_check(local, record.variables())
                     if local is not None else [])
      lock, position = record.begin_run(locked, initialized, in_xla)

      # 3. This replica's micro-step: check, weigh, add, count. A micro-step
      # that fails a check changes nothing: every write waits for them.
      with tf.control_dependencies([lock] if lock is not None else []):
        step = self._numerics.micro_step([g for g, _ in present],
                                         record.counts_dtype)
        with tf.control_dependencies(initialized + position.checks +
                                     step.checks):
          # (Rows of tables the replicas share a list of: added where they
          # meet, below.)
          added, shared = accumulators.add(step.gradients, position.length,
                                           step.finite)
        with tf.control_dependencies([added]):
          micro_step = tf.group(added, *record.add_counts(step.increments))
        part = ReplicaPart(record=record, var_list=var_list,
                           accumulators=accumulators,
                           increments=step.increments, shared_rows=shared)

      # 4. The decision: the TPU path in the replica, the GPU path in the
      # cross-replica context (merge_call outside tf.cond).
      if self._use_tpu:
        checkpoints.create_wrapped_slots(self._opt, var_list, scopes, self)
        return records.listed_as_train_op(self._end_micro_step(
            None, [micro_step], part, multi_worker), train_ops)
    return records.listed_as_train_op(replica_context.merge_call(
        self._end_micro_step_across_replicas,
        args=(micro_step, part, scopes, scope, multi_worker)), train_ops)

  def _state_of_train_op(self, build, present, global_step, sparse,
                         accumulates):
    """Step 1's state: the train op's record, made once for all replicas,
    and this replica's accumulators; returns both."""
    local = build.local
    with tf.init_scope():
      record = records.of_train_op(
          build, [v for _, v in present], self._grad_steps, self._numerics,
          global_step, self._accumulator_dtype, self._counts_updates,
          own_counter=self._use_tpu or global_step is None or (
              local is not None) or self._counts_updates)
      if accumulates:  # each train op its own (see `accumulators`)
        accumulators = accumulators_lib.create(
            self._opt, present, record, build, sparse,
            self._accumulator_dtype, self._xla_num_partitions)
      else:
        accumulators = accumulators_lib.PassThrough(sparse)
      # What a checkpoint holds of it.
      checkpoints.register(record, tf.compat.v1.get_default_graph())
    self._last_record = record
    if all(built is not self for built in record.wrappers):
      record.wrappers.append(self)  # (a wrapper per replica: each)
      for counter in record.counters:  # restored (object-based) already
        self._handle_deferred_dependencies(name=counter.op.name,
                                           trackable=counter)
    return record, accumulators

  def _end_micro_step_across_replicas(self, distribution, micro_step, part,
                                      scopes, scope, multi_worker):
    """The GPU path's `merge_call`: `_end_micro_step`, cross-replica."""
    first = distribution.experimental_local_results
    checkpoints.create_wrapped_slots(self._opt, first(part)[0].var_list,
                                     tuple(first(s)[0] for s in scopes), self)
    with tf.compat.v1.name_scope(first(scope)[0]):
      return self._end_micro_step(distribution, first(micro_step), part,
                                  first(multi_worker)[0])

  def _end_micro_step(self, distribution, micro_steps, part, multi_worker):
    """Steps 4 and 6: the apply step's cond on the cycle's end, then advance;
    returns the micro-step's op. `distribution` is None on the TPU path."""
    parts = _parts(distribution, part)
    record = parts[0].record
    if distribution is not None and parts[0].shared_rows:
      with tf.control_dependencies(micro_steps):  # the replicas' shared rows
        micro_steps = list(micro_steps) + parts[0].accumulators.append_shared(
            [p.shared_rows for p in parts])
    # Under a multi-worker strategy, a session begun mid-cycle drops it.
    restart = distribute.MidCycleRestart() if multi_worker else None
    marks = [restart.check(record.position)] if restart is not None else []
    summaries = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)

    def apply_step():
      op, decision = self._apply_step(distribution, part, restart,
                                      multi_worker)
      if decision is not None or not isinstance(record.position.is_end,
                                                bool):  # in a cond
        records.check_no_summary_made(summaries)
      # Out of the cond: whether this run applied an update (a policy or a
      # dropped cycle may end a cycle applying nothing): `once_per_update`.
      with tf.control_dependencies([op]):
        return tf.identity(True if decision is None else decision,
                           name='updated')

    with tf.control_dependencies(list(micro_steps) + marks):
      updated = compat.cond(record.position.is_end, apply_step,
                            lambda: tf.constant(False))
    return record.advance(record.position, updated)  # 6.

  def _apply_step(self, distribution, part, restart, multi_worker):
    """Step 5: sums the counts over replicas once, decides, applies, resets;
    returns (op, decision), decision None where the cycle always applies."""
    record = _parts(distribution, part)[0].record
    length = record.position.length
    totals, replicas, checks = _summed_counts(
        distribution, part, self._numerics.counts, length,
        self._apply_crs_to_grad,
        # Where workers follow one schedule, its length travels with them.
        agree=multi_worker and not isinstance(self._grad_steps, int))
    decision = self._numerics.decision(totals)  # None: always
    factor = self._numerics.factor(totals, replicas, length)
    if restart is not None:  # multi-worker: False on a cycle begun mid-way
      kept = restart.keeps_cycle(after=checks)
      decision = kept if decision is None else tf.logical_and(decision, kept)

    def on_each(apply):
      applied = _on_each_replica(distribution, lambda p: self._apply_and_reset(
          p, factor, apply), part)
      return applied if distribution is None else distribution.group(applied)

    if decision is None:
      return on_each(True), None
    applied = compat.cond(decision, lambda: on_each(True),
                          lambda: on_each(False))
    with tf.control_dependencies([applied]):
      skipped = self._numerics.skipped(totals, decision)  # None: not counted
      if skipped is None:
        return applied, decision
      return tf.group(applied, *record.count_skipped(skipped)), decision

  def _apply_and_reset(self, part, factor, apply):
    """Step 5 on one replica: applies the gradient if `apply`; resets."""
    read = part.accumulators.read()
    done = tf.no_op()
    if apply:
      gradients = read.gradients
      if self._apply_crs_to_grad:
        gradients = [tf.compat.v1.tpu.cross_replica_sum(g) for g in gradients]
      gradients = self._numerics.cycle_gradients(gradients, factor,
                                                 read.whole, part.var_list)
      graph = tf.compat.v1.get_default_graph()
      first_made = len(graph.get_operations())  # for the port check
      done = self._opt.apply_gradients(list(zip(gradients, part.var_list)))
      port_checks.check_schedule_reads(
          done, part.record, self._grad_steps,
          {op.name for op in graph.get_operations()[first_made:]})
    resets = []
    if part.record.counts:
      with tf.control_dependencies([done]):
        resets = part.record.reset_counts()
    return tf.group(part.accumulators.reset(done), *resets)

  # ------------------------------------------------ the wrapped optimizer --

  @_not_converted
  def get_slot(self, var, name):
    """The slot `name` of `var`: the wrapped optimizer's, or an accumulator.

    Args:
      var: a variable passed to `apply_gradients`.
      name: the wrapped optimizer's slot name, or `grad_accum` (`grad_accum_1`
        for a second train op, ...).

    Returns:
      The slot variable, or None.
    """
    graph = getattr(var, 'graph', None)
    built = registry.records_of(self, graph) if graph is not None else []
    for record in built:  # a table's list of rows (`accumulators`)
      listed = record.lists.get(id(var))
      if listed is not None and accumulators_lib.slot_name_of(listed) == name:
        return listed
    return self._opt.get_slot(var, name)

  @_not_converted
  def get_slot_names(self, *args, **kwargs):
    """The wrapped optimizer's slot names (with `grad_accum`).

    Args:
      *args: the wrapped optimizer's `get_slot_names` arguments.
      **kwargs: its keyword arguments.

    Returns:
      A list of strings.
    """
    return self._opt.get_slot_names(*args, **kwargs)


def _parts(distribution, part):
  """Each replica's `ReplicaPart` (one without a strategy: the TPU path)."""
  return ([part] if distribution is None else
          distribution.experimental_local_results(part))


def _on_each_replica(distribution, fn, part):
  """`fn(part)`: in this replica (the TPU path), else on each replica."""
  return (fn(part) if distribution is None else
          distribution.extended.call_for_each_replica(fn, args=(part,)))


def _summed_counts(distribution, part, names, length, over_tpu_cores,
                   agree):
  """The cycle's counts summed over replicas, in one all-reduce.

  Args:
    distribution: the strategy, or None (the TPU path).
    part: this replica's `ReplicaPart` (per replica under a strategy).
    names: the numerics' count names, in order.
    length: the cycle's length.
    over_tpu_cores: also sum over TPU cores (`apply_crs_to_grad`).
    agree: whether the workers' schedule lengths travel with the counts.

  Returns:
    ({name: summed count}, the replicas in sync, [checks that the workers'
    lengths agree]); without counts to sum, ({}, the replicas, []).
  """
  replicas = 1 if distribution is None else distribution.num_replicas_in_sync
  if not names and not agree:
    return {}, replicas, []

  def replica_counts(p):
    counts = p.record.counts_of_cycle(p.increments)
    if agree:
      counts.append(tf.cast(length, counts[0].dtype if counts else
                            tf.float32))
    return tf.stack(counts)

  counts = _on_each_replica(distribution, replica_counts, part)
  counts, replicas, checks = distribute.summed_counts(
      distribution, counts, over_tpu_cores, length if agree else None)
  return dict(zip(names, counts)), replicas, checks
