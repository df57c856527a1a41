"""Optimizer wrapper for deferred (accumulated) gradient application.

`apply_gradients` builds one micro-step, read top to bottom:

1. check the arguments; make the train op's record and accumulators once
   for all replicas (`records`, `accumulators`);
2. take the run's lock and read the cycle's `Position` (`records`);
3. on each replica: check (finite?), weigh, add, count;
4. decide in a `tf.cond` on the cycle's end: the GPU path after a
   `merge_call` into the cross-replica context, the TPU path in the replica;
5. apply: sum the counts over replicas once, decide whether the cycle
   applies, then on each replica apply its gradient and reset;
6. advance: count the micro-step, release the lock.

Pure functions of the counts decide what a cycle applies (`_should_apply`,
`_factor`). A micro-batch skipped by `nonfinite_policy` still counts (unlike
in optax's `MultiSteps`): cycles last `grad_steps` runs, as schedules expect.
"""

import collections
import functools

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import records

tf = compat.import_tensorflow()
# Entry points that user code reaches are never converted by AutoGraph (a
# strategy converts the replica function, and with it what it calls): the
# package's Python control flow is graph building, not computation.
_not_converted = tf.autograph.experimental.do_not_convert

# The counts a cycle keeps per replica, by their variables' names.
GOOD, NONFINITE, WEIGHT = ('good_micro_batches', 'nonfinite_micro_batches',
                           'micro_batch_weights')


class Policy(collections.namedtuple(
    'Policy', ['nonfinite_policy', 'aggregation', 'weighted', 'counts'])):
  """The keywords that decide what a cycle applies (plain values).

  `counts` names the per-replica counts a cycle keeps, in vector order.
  """

  @classmethod
  def checked(cls, nonfinite_policy, aggregation, weighted):
    """Returns the `Policy` of the constructor's keywords.

    `weighted`: whether a `micro_batch_weight` was given.

    Raises:
      ValueError: `nonfinite_policy` or `aggregation` is not a valid choice.
    """
    arguments.check_choice(nonfinite_policy, arguments.NONFINITE_POLICIES,
                           'nonfinite_policy')
    arguments.check_choice(aggregation, arguments.AGGREGATIONS, 'aggregation')
    counts = ((GOOD, NONFINITE) if nonfinite_policy else ()) + (
        (WEIGHT,) if weighted else ())
    return cls(nonfinite_policy, aggregation, weighted, counts)


class ReplicaPart(object):
  """One replica's part of one train op: what its apply step needs.

  Not a tuple: `merge_call` would take it apart. `shared_rows`: its
  rows of tables whose list the replicas share, by index.
  """

  def __init__(self, **fields):
    vars(self).update(fields)


class GradientAggregationOptimizer(tf.compat.v1.train.Optimizer):
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
    self._clip_norm = arguments.check_clip_norm(clip_norm)
    self._xla_num_partitions = None if xla_num_partitions is None else (
        arguments.check_positive_int(xla_num_partitions, 'xla_num_partitions'))
    self._micro_batch_weight = arguments.check_micro_batch_weight(
        micro_batch_weight)
    self._policy = Policy.checked(nonfinite_policy, aggregation,
                                  micro_batch_weight is not None)
    arguments.check_name(name)
    self._counts_updates = arguments.check_choice(
        global_step_counts, arguments.GLOBAL_STEP_COUNTS,
        'global_step_counts') == 'updates'
    super().__init__(use_locking=False, name=name)
    # The train ops' `records.Record`s, in the order built.
    self._records = []
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
      return _after_update(train_op, record.updated, fn)

    def across_replicas(distribution, train_op, fn):
      first = distribution.experimental_local_results
      return _after_update(first(train_op)[0], record.updated, first(fn)[0])

    return context.merge_call(across_replicas, args=(train_op, fn))

  def _record(self, train_op, any_graph=False):
    """The record (`records.Record`) of `train_op` in this graph."""
    graph = _outermost_graph()
    built = [record for record in self._records if record.position is not None
             and record.position.in_cycle.graph is graph]
    if any_graph and not built:
      built = self._records
    if not built:
      raise ValueError(
          'No train op has been built with this wrapper in this graph yet: '
          'call minimize or apply_gradients first. (For a learning rate, '
          'pass a callable: it is called as the train op is built.)')
    if train_op is None:
      return built[-1]
    # The op, or a group of it (`tf.group` nests its control inputs; a
    # train op's own inputs are not searched).
    found, seen, pending = [], set(), [getattr(train_op, 'op', train_op)]
    while pending:
      op = pending.pop()
      owners = [record for record in built if op.name in record.op_names]
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
    # The graph's train ops before this one (see `_listed_as_train_op`).
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
    var_list = [v for _, v in present]
    strategy = tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    counts_dtype = _counts_dtype(var_list, self._accumulator_dtype)
    in_xla = compat.in_xla_context()  # before init_scope, which leaves it
    multi_worker = replicas > 1 and compat.in_multi_worker_mode(strategy)
    # Where the wrapped optimizer's non-slot variables go, found before the
    # name scope opens (`name` changes op names only); checkpoints restore
    # across settings (see `checkpoints`).
    scopes = checkpoints.scopes(accumulates)
    with tf.compat.v1.name_scope(name, self._name) as scope:
      # Variables on parameter servers: the state is the worker's own.
      local = distribute.worker_local(var_list)
      build = distribute.Build(compat.replica_index(), replicas, in_xla,
                               multi_worker, local)
      # Sparse or dense is fixed at graph build, from the gradients' types;
      # a cross-replica sum needs the same shape on every core: dense.
      sparse = not (self._sparse_as_dense or self._apply_crs_to_grad)
      with tf.init_scope():
        record = records.of_train_op(
            build, self._grad_steps, self._policy, global_step,
            counts_dtype, self._counts_updates,
            own_counter=self._use_tpu or global_step is None or (
                local is not None) or self._counts_updates)
        if accumulates:  # each train op its own (see `accumulators`)
          accumulators = accumulators_lib.create(
              self._opt, present, record, build, sparse,
              self._accumulator_dtype, self._xla_num_partitions)
        else:
          accumulators = accumulators_lib.PassThrough(sparse)
        checkpoints.register(record)  # what a checkpoint holds of it
      if record not in self._records:  # (a wrapper per replica: each)
        self._records.append(record)
        for counter in record.counters:  # restored (object-based) already
          self._handle_deferred_dependencies(name=counter.op.name,
                                             trackable=counter)

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
        checks = initialized + position.checks
        weight = None
        if self._micro_batch_weight is not None:
          weight = arguments.weight_tensor(self._micro_batch_weight)
          checks += arguments.check_weight_value(
              weight, self._policy.nonfinite_policy)
        gradients = [g for g, _ in present]
        finite = (_all_finite(gradients + [weight])
                  if self._policy.nonfinite_policy else None)
        gradients = _weigh(gradients, weight)
        increments = _increments(self._policy, finite, weight,
                                 record.counts_dtype)
        with tf.control_dependencies(checks):
          if finite is not None:  # a cond's branches wait for its predicate
            finite = tf.identity(finite)
          # (Rows of tables the replicas share a list of: added where they
          # meet, below.)
          added, shared = accumulators.add(gradients, position.length,
                                           finite)
        with tf.control_dependencies([added]):
          micro_step = tf.group(
              added, *(record.add_counts(increments) if increments else []))
        part = ReplicaPart(record=record, var_list=var_list,
                           accumulators=accumulators, increments=increments,
                           shared_rows=shared)

      # 4. The decision: the TPU path in the replica, the GPU path in the
      # cross-replica context (merge_call outside tf.cond).
      if self._use_tpu:
        checkpoints.create_wrapped_slots(self._opt, var_list, scopes, self)
        return _listed_as_train_op(self._end_micro_step(
            None, [micro_step], part, multi_worker), train_ops)
    return _listed_as_train_op(replica_context.merge_call(
        self._end_micro_step_across_replicas,
        args=(micro_step, part, scopes, scope, multi_worker)), train_ops)

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
    # Whether the apply step decides, in a cond of its own, if it applies.
    decides = (self._policy.nonfinite_policy or restart is not None or (
        self._policy.weighted and self._policy.aggregation == 'mean'))
    summaries = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)

    def apply_step():
      op, decision = self._apply_step(distribution, part, restart,
                                      multi_worker)
      if decides or not isinstance(record.position.is_end, bool):  # in a cond
        _check_no_summary_made(summaries)
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
    # Where workers follow one schedule, its length travels with the counts.
    agree = multi_worker and not isinstance(self._grad_steps, int)
    totals, replicas, checks = {}, (distribution.num_replicas_in_sync if
                                    distribution is not None else 1), []
    if self._policy.counts or agree:
      def replica_counts(p):
        counts = p.record.counts_of_cycle(p.increments)
        if agree:
          counts.append(tf.cast(length, counts[0].dtype if counts else
                                tf.float32))
        return tf.stack(counts)
      counts = _on_each_replica(distribution, replica_counts, part)
      counts, replicas, checks = distribute.summed_counts(
          distribution, counts, self._apply_crs_to_grad,
          length if agree else None)
      totals = dict(zip(self._policy.counts, counts))
    decision = _should_apply(self._policy, totals)  # None: always
    factor = _factor(self._policy, totals, replicas, length)
    if restart is not None:  # multi-worker: False on a cycle begun mid-way
      kept = restart.keeps_cycle(after=checks)
      decision = kept if decision is None else tf.logical_and(decision, kept)

    def on_each(apply):
      applied = _on_each_replica(distribution, lambda p: self._apply_and_reset(
          p, length, factor, apply), part)
      return applied if distribution is None else distribution.group(applied)

    if decision is None:
      return on_each(True), None
    applied = compat.cond(decision, lambda: on_each(True),
                          lambda: on_each(False))
    if not self._policy.nonfinite_policy:
      return applied, decision
    with tf.control_dependencies([applied]):
      return tf.group(applied, *record.count_skipped(
          (tf.cast(tf.round(totals[NONFINITE]), tf.int64),
           1 - tf.cast(decision, tf.int64)))), decision

  def _apply_and_reset(self, part, length, factor, apply):
    """Step 5 on one replica: applies the gradient if `apply`; resets."""
    read = part.accumulators.read()
    done = tf.no_op()
    if apply:
      gradients = read.gradients
      if self._apply_crs_to_grad:
        gradients = [tf.compat.v1.tpu.cross_replica_sum(g) for g in gradients]
      gradients = _scaled(gradients, factor)
      if self._clip_norm is not None:  # the cycle's gradient, complete
        gradients = _clip_by_global_norm(gradients, self._clip_norm,
                                         read.whole)
      gradients = [_map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
                   for g, v in zip(gradients, part.var_list)]
      graph = tf.compat.v1.get_default_graph()
      before = {op.name for op in graph.get_operations()}
      done = self._opt.apply_gradients(list(zip(gradients, part.var_list)))
      made = {op.name for op in graph.get_operations()} - before
      records.check_schedule_reads(done, part.record, self._grad_steps, made)
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
    for record in self._records:  # a table's list of rows (`accumulators`)
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

  # ------------------------------- object-based checkpoints (Keras, etc.) --
  # tf.train.Checkpoint and Keras's save_weights see the wrapped optimizer's
  # variables and slots as the wrapper's, so checkpoints restore both ways
  # with a bare optimizer; the wrapper's counters sit beside them.

  def _own_children(self):
    """{name: variable}: this graph's counters of the wrapper's train ops."""
    graph = _outermost_graph()
    return {v.op.name: v for record in self._records
            for v in record.counters if getattr(v, 'graph', None) is graph}

  # pylint: disable=protected-access
  def _trackable_children(self, save_type='checkpoint', **kwargs):
    children = dict(self._opt._trackable_children(save_type, **kwargs))
    children.update(self._own_children())
    return children

  def _lookup_dependency(self, name, cached_dependencies=None):
    found = self._opt._lookup_dependency(name, cached_dependencies)
    return found if found is not None else self._own_children().get(name)

  def _create_or_restore_slot_variable(self, slot_variable_position,
                                       slot_name, variable):
    self._opt._create_or_restore_slot_variable(slot_variable_position,
                                               slot_name, variable)
  # pylint: enable=protected-access

  @_not_converted
  def variables(self):
    """The wrapped optimizer's and the wrapper's variables (this graph's).

    Returns:
      The wrapped optimizer's non-slot variables and each train op's counters
      and tables' lists of rows in this graph, sorted by name.
    """
    graph = _outermost_graph()
    own = [v for record in self._records for v in record.variables()
           if getattr(v, 'graph', None) is graph]
    return sorted(list(self._opt.variables()) + own, key=lambda v: v.name)


def _parts(distribution, part):
  """Each replica's `ReplicaPart` (one without a strategy: the TPU path)."""
  return ([part] if distribution is None else
          distribution.experimental_local_results(part))


def _on_each_replica(distribution, fn, part):
  """`fn(part)`: in this replica (the TPU path), else on each replica."""
  return (fn(part) if distribution is None else
          distribution.extended.call_for_each_replica(fn, args=(part,)))


def _outermost_graph():
  """The default graph, or the outermost graph around a function graph."""
  graph = tf.compat.v1.get_default_graph()
  while getattr(graph, 'outer_graph', None) is not None:
    graph = graph.outer_graph
  return graph


# ---------------------------------------- what a cycle applies (numerics) --

def _counts_dtype(variables, accumulator_dtype):
  """The dtype of a train op's counts: its widest accumulator's, at least
  float32, so that fractional weight sums keep the model's precision."""
  dtypes = [accumulator_dtype or v.dtype.base_dtype for v in variables]
  return max(dtypes + [tf.float32], key=lambda dtype: dtype.size)


def _values(gradient):
  """The dense values of a Tensor or of an IndexedSlices."""
  return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _map_values(gradient, fn):
  """`fn` applied to a Tensor, or to an IndexedSlices' values (same rows)."""
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(fn(gradient.values), gradient.indices,
                            gradient.dense_shape)
  return fn(gradient)


def _all_finite(gradients):
  """A boolean scalar: no gradient holds a NaN or an inf (None skipped)."""
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g)))
                        for g in gradients if g is not None])


def _weigh(gradients, weight):
  """The gradients times `weight` (in their dtype), or as they are."""
  if weight is None:
    return list(gradients)
  return [_map_values(g, lambda x: x * tf.cast(weight, x.dtype))
          for g in gradients]


def _increments(policy, finite, weight, dtype):
  """A micro-step's additions to its replica's counts, in `policy.counts`
  order: finite (1 or 0) and not, then its weight (0 where skipped)."""
  added = []
  if policy.nonfinite_policy:
    good = tf.cast(finite, dtype)
    added += [good, 1 - good]
  if policy.weighted:
    weight = tf.cast(weight, dtype)
    added.append(weight if finite is None else
                 tf.where(finite, weight, tf.zeros_like(weight)))
  return added


def _should_apply(policy, totals):
  """None (the cycle always applies), or a boolean scalar of the summed
  counts (rounded: after a restore they are sums of equal shares)."""
  decisions = []
  if policy.nonfinite_policy == 'skip_micro_batch':
    decisions.append(tf.round(totals[GOOD]) > 0)
  elif policy.nonfinite_policy == 'skip_cycle':
    decisions.append(tf.equal(tf.round(totals[NONFINITE]), 0))
  if policy.weighted and policy.aggregation == 'mean':
    decisions.append(totals[WEIGHT] > 0)
  return functools.reduce(tf.logical_and, decisions) if decisions else None


def _ops_of(fn):
  """`fn()`'s ops in one op (a control flow v1 branch runs only what its
  result depends on); a TypeError where it returned None."""
  made = fn()
  if made is None:
    raise TypeError(
        'once_per_update: fn returned None; return the ops it made (an op, a '
        'tensor or a list), or they do not run under control flow v1.')
  return tf.group(*tf.nest.flatten(made))


def _after_update(train_op, updated, fn):
  """`train_op`, then `fn`'s ops where `updated` (a boolean scalar)."""
  summaries = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
  with tf.control_dependencies([train_op]):
    after = compat.cond(updated, lambda: _ops_of(fn), tf.no_op)
  _check_no_summary_made(summaries, "once_per_update's fn")
  return tf.group(train_op, after)


def _check_no_summary_made(before, maker='The wrapped optimizer'):
  """Raises a ValueError if summaries were made since `before`: inside the
  apply step's cond they can be neither fetched on other runs nor merged."""
  made = [summary.name for summary in tf.compat.v1.get_collection(
      tf.compat.v1.GraphKeys.SUMMARIES) if all(
          summary is not known for known in before)]
  if made:
    raise ValueError(
        '%s made the summaries %s inside the tf.cond run once per update: '
        'they cannot be fetched on other micro-steps nor merged. Make them '
        'outside minimize and once_per_update: of the learning rate before '
        'passing it, or of a variable the update assigns.' % (maker, made))


def _listed_as_train_op(train_op, before):
  """Resets TRAIN_OP to `before` plus `train_op`, returning `train_op`: the
  wrapped optimizer listed its own op there, inside a cond, unfetchable."""
  listed = tf.compat.v1.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
  listed[:] = before + [train_op] * all(op is not train_op for op in before)
  return train_op


def _factor(policy, totals, replicas, length):
  """(numerator, denominator) turning the accumulators (the cycle's sum over
  its `length`) into the cycle's gradient; None for the mean they hold. A
  fraction, so that `_scaled` divides in each gradient's own dtype."""
  if policy.aggregation == 'sum':
    return (length, 1)
  if policy.weighted:
    # Each replica's loss is divided by the replicas: its share of the
    # cycle's weight is the sum over replicas divided by the replicas.
    return (length * replicas, tf.maximum(totals[WEIGHT], 1e-30))
  if policy.nonfinite_policy == 'skip_micro_batch':
    # The mean over the finite micro-batches of every replica.
    return (length * replicas, tf.maximum(totals[GOOD], 1.0))
  return None


def _scaled(gradients, factor):
  """Each gradient times `numerator / denominator`, in its own dtype."""
  if factor is None or all(isinstance(part, int) and part == 1
                           for part in factor):
    return list(gradients)

  def scaled(value):
    numerator, denominator = (tf.cast(part, value.dtype) for part in factor)
    return value * (numerator / denominator)

  return [_map_values(g, scaled) for g in gradients]


def _summed_by_id(gradient):
  """An IndexedSlices with its rows of equal ids added up; a Tensor as is."""
  if not isinstance(gradient, tf.IndexedSlices):
    return gradient
  unique, rows = accumulators_lib.sum_by_id(gradient.indices, gradient.values)
  return tf.IndexedSlices(rows, unique, gradient.dense_shape)


def _clip_by_global_norm(gradients, clip_norm, whole):
  """The gradients clipped by the global norm of their sum over replicas
  (rows of equal ids added first); each replica keeps its share for the
  wrapped optimizer's all-reduce. `whole`: per gradient, whether this
  replica holds all of its sum or none (`accumulators.Read.whole`)."""
  replica_context = tf.distribute.get_replica_context()
  replicas = replica_context.num_replicas_in_sync
  if replicas == 1:
    return tf.clip_by_global_norm([_summed_by_id(g) for g in gradients],
                                  clip_norm)[0]
  # stop_gradient: a replica context's all_reduce is differentiable, and in
  # graph mode it walks back from its result through every replica's input
  # to the variables; with ref variables (v1 behaviour) it reaches the
  # mirrored components and fails ("Unsuccessful at finding variable").
  sum_over_replicas = lambda values: replica_context.all_reduce(
      tf.distribute.ReduceOp.SUM, [_map_values(v, tf.stop_gradient)
                                   for v in values])
  gradients = [_summed_by_id(g) if held else g
               for g, held in zip(gradients, whole)]
  parts = [i for i, held in enumerate(whole) if not held]
  held_whole = [i for i, held in enumerate(whole) if held]
  squares = []
  if parts:  # a table's parts are all-reduced sparse: rows of every replica
    for i, g in zip(parts, sum_over_replicas([gradients[i] for i in parts])):
      gradients[i] = _summed_by_id(g)
    squares.append(tf.square(tf.linalg.global_norm(
        [gradients[i] for i in parts])))
  if held_whole:  # held by one replica: the replicas' squares add up to its
    squares.append(sum_over_replicas([tf.square(tf.linalg.global_norm(
        [gradients[i] for i in held_whole]))])[0])
  clipped, _ = tf.clip_by_global_norm(gradients, clip_norm,
                                      use_norm=tf.sqrt(tf.add_n(squares)))
  return [g if held else _map_values(g, lambda x: x / replicas)
          for g, held in zip(clipped, whole)]
