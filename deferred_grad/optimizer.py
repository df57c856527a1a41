"""Optimizer wrapper for deferred (accumulated) gradient application.

The algorithm reads top to bottom from `apply_gradients`: 1. the micro-step
(`_micro_step`: check, weigh, add); 2. one decision, a `tf.cond` on the
cycle's end (`_cycle_end`: GPU path after a `merge_call`, on the step; TPU
path on `update_count`); 3. on the cycle's last micro-step the apply step
(`_apply_step`: sum the cycle's counts over replicas once, decide, then on
each replica `_apply_and_reset`); 4. advance the step. With grad_steps=1
the micro-step is its own cycle and step 3 reads its gradients.

The mechanics are one call away, called with values: `accumulators`,
`cycle_state` (counters as data, the decisions), `numerics`, `steps`,
`distribute` (replica sums) and `placement` (parameter-server workers).
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import cycle_state
from deferred_grad import distribute
from deferred_grad import lazy_cond
from deferred_grad import numerics
from deferred_grad import placement
from deferred_grad import steps

tf = compat.import_tensorflow()


class GradientAggregationOptimizer(tf.compat.v1.train.Optimizer):
  """Optimizer wrapper that applies the mean gradient of `grad_steps` calls.

  ```python
  opt = tf.compat.v1.train.AdamOptimizer(1e-3)
  opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)
  train_op = opt.minimize(loss, global_step=global_step)
  # Each run of train_op is a micro-step; every 8th also applies the update.
  ```

  It accumulates the gradients of `grad_steps` micro-batches in a slot per
  variable and hands their mean to the wrapped optimizer once per cycle, so
  that training matches one batch `grad_steps` times larger. Caveats:

  * Batch statistics (e.g. batch norm) stay based on the micro-batch.
  * `global_step` counts micro-steps, at any `grad_steps`: feed learning-rate
    schedules `applied_updates(global_step, grad_steps)` to see updates.
  * With `grad_steps=1` nothing is accumulated; every other keyword applies.

  Two code paths build the cycle logic, as the original's: the GPU path
  (`use_tpu=False`) decides after a `merge_call`, and each replica's
  wrapped `apply_gradients` all-reduces, so replicas talk only on apply
  steps; the TPU path (`use_tpu=True`) decides on its `update_count`
  without one. The module docstring walks through both.
  """

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
               micro_batch_weight=None):
    """Constructs the wrapper (the README's keyword table links the guides).

    Args:
      opt: the `tf.compat.v1.train.Optimizer` that applies the mean gradient.
      grad_steps: positive int, the number of micro-steps per update.
      apply_crs_to_grad: bool; if True, each accumulated gradient is summed
        across TPU replicas with `tf.compat.v1.tpu.cross_replica_sum` before
        it is applied (TPU only).
      xla_num_partitions: None, or a positive int: annotate accumulator reads
        with an XLA sharding over that many partitions (`sharding`).
      use_tpu: bool; True selects the TPU path described above.
      sparse_as_dense: bool. False accumulates `tf.IndexedSlices` row by row
        and hands on the rows the cycle touched; True densifies them (the
        original's).
      nonfinite_policy: what a micro-batch with a NaN or inf gradient does:
        None (the original's: it poisons the update), 'skip_micro_batch'
        (the cycle applies the mean of its finite micro-batches) or
        'skip_cycle' (the cycle applies nothing). See `cycle_state`.
      accumulator_dtype: None (the variable's dtype), or a wider float dtype
        such as tf.float32 to sum half-precision gradients in.
      clip_norm: None, or a positive float: the cycle's gradient is clipped
        to this global norm (over all replicas).
      aggregation: 'mean' (the default, the original's) or 'sum': what the
        cycle applies of its micro-batch gradients. See `cycle_state`.
      micro_batch_weight: None, or a scalar tensor (or a callable returning
        one, called in `apply_gradients` on each replica): the micro-step's
        weight, e.g. its token count; the cycle then applies the weighted
        mean `sum(w_i * g_i) / sum(w_i)` (the weighted sum with 'sum').

    Raises:
      TypeError: `opt` is not a `tf.compat.v1.train.Optimizer`, or an argument
        has the wrong type.
      ValueError: an argument has a wrong value.
    """
    arguments.check_optimizer(opt)
    grad_steps = arguments.check_positive_int(grad_steps, 'grad_steps')
    self._apply_crs_to_grad = arguments.check_bool(apply_crs_to_grad,
                                                   'apply_crs_to_grad')
    self._use_tpu = arguments.check_bool(use_tpu, 'use_tpu')
    self._sparse_as_dense = arguments.check_bool(sparse_as_dense,
                                                 'sparse_as_dense')
    self._accumulator_dtype = arguments.check_accumulator_dtype(
        accumulator_dtype)
    self._clip_norm = arguments.check_clip_norm(clip_norm)
    if xla_num_partitions is not None:
      xla_num_partitions = arguments.check_positive_int(
          xla_num_partitions, 'xla_num_partitions')
    self._xla_num_partitions = xla_num_partitions
    self._micro_batch_weight = arguments.check_micro_batch_weight(
        micro_batch_weight)
    self._rules = cycle_state.Rules(grad_steps, nonfinite_policy, aggregation,
                                    micro_batch_weight is not None)
    super(GradientAggregationOptimizer, self).__init__(
        use_locking=False, name='GradientAggregationOptimizer')
    self._opt = opt
    self._grad_steps = grad_steps
    self._states = []  # the `cycle_state.TrainOpState` of each train op
    self.strategy = tf.distribute.get_strategy()

  @property
  def grad_steps(self):
    """The number of micro-steps per applied update."""
    return self._grad_steps

  @property
  def skipped_micro_batches(self):
    """int64 variable: micro-batches a `nonfinite_policy` skipped, or None.

    That of the train op built last, over replicas, on each apply step.
    """
    return self._last_state().skipped_micro_batches

  @property
  def skipped_cycles(self):
    """int64 variable: cycles a `nonfinite_policy` applied nothing in."""
    return self._last_state().skipped_cycles

  def applies_update(self):
    """A boolean tensor: True when this run of the train op ends a cycle.

    Fetch it with the train op (it is the step the train op reads, before
    it counts the micro-step), or use it in the graph, e.g. for summaries on
    apply steps only. That of the train op built last. With a
    `nonfinite_policy` a cycle may end applying nothing (`skipped_cycles`).

    Raises:
      ValueError: no train op has been built yet.
    """
    return self._last_state().applies_update()

  def micro_step_in_cycle(self):
    """An int64 tensor: this run's place in its cycle (see applies_update)."""
    return self._last_state().micro_step_in_cycle()

  def _last_state(self):  # that of the train op built last
    if not self._states:
      raise ValueError('No train op has been built with this wrapper yet: '
                       'call minimize or apply_gradients first.')
    return self._states[-1]

  def compute_gradients(self, loss, var_list=None, **kwargs):
    """Delegates to the wrapped optimizer's `compute_gradients`."""
    arguments.check_graph_mode('compute_gradients')
    distribute.check_replicas(tf.distribute.get_replica_context(),
                              self._use_tpu, 'compute_gradients')
    return self._opt.compute_gradients(loss, var_list=var_list, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Accumulates a micro-step's gradients; applies their mean every cycle.

    Args:
      grads_and_vars: list of (gradient, variable) pairs, as returned by
        `compute_gradients`. Pairs whose gradient is None are skipped.
      global_step: optional integer `Variable`, incremented once per call
        (micro-step) by the wrapper, whatever the wrapped optimizer does with
        one. Without it the wrapper counts micro-steps itself.
      name: optional name for the returned op; all ops made here live under
        this name scope (default: the optimizer's name).

    Returns:
      An op that runs one micro-step.

    Raises:
      TypeError, ValueError, RuntimeError: see
        `arguments.check_apply_gradients`; and ValueError: `global_step` is
        counted by another train op of a wrapper in this graph.
    """
    replica_context = tf.distribute.get_replica_context()
    present = arguments.check_apply_gradients(
        grads_and_vars, global_step, name, replica_context, self._use_tpu,
        self._apply_crs_to_grad)
    var_list = [v for _, v in present]
    # With grad_steps=1 the micro-step is its cycle: nothing accumulates.
    accumulates = self._grad_steps > 1  # decided here, once
    # Where the wrapped optimizer's non-slot variables go: found before this
    # method opens its own name scope, so that `name` changes op names only.
    wrapped_vars_scope = checkpoints.wrapped_vars_scope(accumulates)
    in_xla = compat.in_xla_context()  # before init_scope, which leaves it
    with tf.compat.v1.name_scope(name, self._name) as scope:
      # Variables on parameter servers: the state is the worker's own.
      local = placement.worker_local(var_list)
      # Sparse or dense is fixed at graph build, from the gradients' types;
      # a cross-replica sum needs the same shape on every core: dense.
      sparse = not (self._sparse_as_dense or self._apply_crs_to_grad)
      accumulators = None
      with tf.init_scope():
        state = cycle_state.train_op_state(
            self._rules, replica_context, global_step, local, accumulates,
            own_counter=accumulates and (
                self._use_tpu or global_step is None or local is not None))
        if accumulates:  # each train op its own (see accumulators)
          accumulators = accumulators_lib.create_all(
              self._opt, present, self._grad_steps, sparse,
              self._accumulator_dtype, self._xla_num_partitions, in_xla,
              local, owner=state)
      if not any(state is own for own in self._states):
        self._states.append(state)
      part = cycle_state.ReplicaPart(state, var_list, accumulators)
      weight = arguments.weight_tensor(self._micro_batch_weight)
      accumulate = self._micro_step(
          part, [g for g, _ in present], weight, sparse,
          placement.initialized_check(local, state.variables()) +
          arguments.check_weight_value(weight, self._rules.nonfinite_policy))
      # The cycle is decided on the wrapper's own counter if it has one,
      # else on the global step the train op counts.
      step = global_step if state.counter is None else state.counter
      also = global_step if step is not global_step else None
      if self._use_tpu:
        checkpoints.create_wrapped_slots(self._opt, var_list,
                                           wrapped_vars_scope)
        return self._cycle_end(None, [accumulate], part, step, also)
    # The original's GPU path: merge_call outside tf.cond.
    return replica_context.merge_call(
        self._cycle_end_across_replicas,
        args=(accumulate, part, step, also, wrapped_vars_scope, scope))

  # -------------------------------------------------------- the algorithm --

  def _micro_step(self, part, gradients, weight, sparse, checks):
    """1. This replica's micro-step: check, weigh, add. Returns its op.

    `checks` run before anything is added. Without accumulators, `part`
    keeps the weighed gradients and counts for the apply step.
    """
    rules = self._rules
    finite = None
    if rules.nonfinite_policy:
      checked = gradients + ([weight] if weight is not None else [])
      finite = numerics.all_finite(checked)
    gradients = numerics.weigh(gradients, weight)
    counts = cycle_state.increments(rules, finite, weight)
    if part.accumulators is None:
      part.keep_micro_step(gradients, counts, sparse)
      return tf.group(*checks)  # the apply step runs after it

    def add():
      adds = [a.add(g) for a, g in zip(part.accumulators, gradients)]
      return tf.group(*adds, name='accumulate')

    with tf.control_dependencies(checks):
      added = (add() if finite is None else
               lazy_cond.cond(finite, add, tf.no_op))
    with tf.control_dependencies([added]):
      counted = cycle_state.add_counts(part.state, counts)
    # Every micro-step is marked, skipped or not (see SparseAccumulator).
    marks = [a.mark() for a in part.accumulators]
    return tf.group(added, *(counted + marks))

  def _cycle_end_across_replicas(self, distribution, accumulate, part, step,
                                 also, wrapped_vars_scope, scope):
    """The GPU path's `merge_call`: `_cycle_end` in cross-replica context."""
    first = lambda value: distribute.first_replica(distribution, value)
    wrapped_vars_scope = tuple(first(p) for p in wrapped_vars_scope)
    checkpoints.create_wrapped_slots(self._opt, first(part).var_list,
                                       wrapped_vars_scope)
    with tf.compat.v1.name_scope(first(scope)):
      return self._cycle_end(
          distribution, distribution.experimental_local_results(accumulate),
          part, step, also)

  def _cycle_end(self, distribution, accumulate, part, step, also):
    """2. The decision: the apply step on the cycle's last micro-step.

    Args:
      distribution: the strategy (GPU path), or None (TPU path).
      accumulate: the micro-step's ops, one per replica.
      part: the `cycle_state.ReplicaPart` (PerReplica under a strategy).
      step: the step the cycle is decided on, or None (grad_steps=1).
      also: None, or a global step counted beside `step`.

    Returns:
      The op of one micro-step.
    """
    first = distribute.first_replica(distribution, part)
    state, grad_steps = first.state, self._grad_steps

    def apply_and_advance():
      applied = self._apply_step(distribution, part)
      if step is None:
        return applied
      with tf.control_dependencies([applied]):
        return steps.advance(step, state.step_value, grad_steps,
                             step is state.counter)

    if first.accumulators is None:
      with tf.control_dependencies(accumulate):  # every micro-step applies
        return apply_and_advance()
    step_value = state.read_step(step, accumulate, None if (
        distribution is None) else distribute.started_on_cycle_boundary)
    # Both branches advance the step: its read is ordered before its write.
    done = lazy_cond.cond(
        steps.is_cycle_end(step_value, grad_steps), apply_and_advance,
        lambda: steps.advance(step, step_value, grad_steps,
                              step is state.counter))
    if also is None:
      return done
    with tf.control_dependencies([done]):
      return steps.advance(also, None, grad_steps, False)

  def _apply_step(self, distribution, part):
    """3. Sum the counts over replicas, decide, apply and reset on each."""
    rules = self._rules
    state = distribute.first_replica(distribution, part).state
    totals, replicas = cycle_state.summed_counts(
        rules, distribution, part, self._apply_crs_to_grad)
    fraction = cycle_state.scale(rules, totals, replicas)
    apply_now = cycle_state.should_apply(rules, totals)
    if apply_now is None:
      return self._on_each_replica(distribution, part, True, fraction)
    applied = lazy_cond.cond(
        apply_now,
        lambda: self._on_each_replica(distribution, part, True, fraction),
        lambda: self._on_each_replica(distribution, part, False, None))
    with tf.control_dependencies([applied]):
      return tf.group(applied,
                      *cycle_state.count_skipped(state, totals, apply_now))

  def _on_each_replica(self, distribution, part, apply, fraction):
    if distribution is None:  # the TPU path: this replica
      return self._apply_and_reset(part, apply, fraction)
    return distribution.group(distribution.extended.call_for_each_replica(
        lambda p: self._apply_and_reset(p, apply, fraction), args=(part,)))

  def _apply_and_reset(self, part, apply, fraction):
    """On one replica: applies the cycle's gradient (if `apply`), resets.

    `fraction` (see `cycle_state.scale`) scales the accumulated sum to the
    cycle's gradient; a cycle that applies nothing (`apply` False) resets.
    """
    read = part.gradients if part.accumulators is None else [
        a.read() for a in part.accumulators]
    done = tf.no_op()
    if apply:
      grads = read
      if self._apply_crs_to_grad:
        grads = [tf.compat.v1.tpu.cross_replica_sum(g) for g in grads]
      grads = [numerics.map_values(
          g, lambda x: cycle_state.apply_scale(x, fraction)) for g in grads]
      # Clipped once the cycle's gradient is complete, as the large batch's.
      if self._clip_norm is not None:
        grads = numerics.clip_by_global_norm(grads, self._clip_norm)
      grads = numerics.cast_like(grads, part.var_list)
      done = self._opt.apply_gradients(list(zip(grads, part.var_list)))
    if part.accumulators is None:
      return done
    with tf.control_dependencies([done]):
      resets = cycle_state.reset_counts(part.state)
    return tf.group(*(resets + accumulators_lib.reset_all(
        part.accumulators, read, done)))

  # ------------------------------------------------ the wrapped optimizer --

  def get_slot(self, *args, **kwargs):  # the wrapped optimizer owns them
    return self._opt.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):  # with grad_accum
    return self._opt.get_slot_names(*args, **kwargs)

  def variables(self):
    """The wrapped optimizer's variables and the wrapper's own counters,
    those of the current graph, sorted by name."""
    variables = list(self._opt.variables())
    graph = tf.compat.v1.get_default_graph()
    for state in self._states:
      variables.extend(own for own in state.variables()
                       if getattr(own, 'graph', None) is graph)
    return sorted(variables, key=lambda v: v.name)
