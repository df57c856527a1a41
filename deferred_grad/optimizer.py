"""Optimizer wrapper for deferred (accumulated) gradient application."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import six

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import aggregation as aggregation_lib
from deferred_grad import arguments
from deferred_grad import compat
from deferred_grad import cycle as cycle_lib
from deferred_grad import distribute
from deferred_grad import numerics
from deferred_grad import placement
from deferred_grad import steps
from deferred_grad import variables as variables_lib

tf = compat.import_tensorflow()


class GradientAggregationOptimizer(tf.compat.v1.train.Optimizer):
  """Optimizer wrapper that applies the mean gradient of `grad_steps` calls.

  ```python
  opt = tf.compat.v1.train.AdamOptimizer(1e-3)
  opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)
  train_op = opt.minimize(loss, global_step=global_step)
  # Each run of train_op is a micro-step; every 8th also applies the update.
  ```

  Large hardware configurations are in high demand and difficult to come by.
  This wrapper simulates one by accumulating the gradients of `grad_steps`
  micro-batches in a slot per variable and handing their mean to the wrapped
  optimizer once per cycle, so that training matches one batch `grad_steps`
  times larger. A few caveats apply:

  * Batch statistics (e.g. batch norm) stay based on the micro-batch.
  * `global_step` is incremented on every micro-step, by the wrapper, at any
    `grad_steps`. Learning-rate schedules therefore see micro-steps; feed
    them `applied_updates(global_step, grad_steps)` to see updates instead.
  * With `grad_steps=1` nothing is accumulated (no accumulator variables),
    and every other keyword still applies.

  Two code paths build the cycle logic:

  * GPU path (`use_tpu=False`): accumulation runs in the replica context; a
    `merge_call` then decides in an in-graph `tf.cond` on the step counter
    whether this micro-step ends the cycle. If so each replica calls the
    wrapped optimizer's `apply_gradients`, which all-reduces, so replicas talk
    only on apply steps.
  * TPU path (`use_tpu=True`): a scalar counter variable `update_count`
    decides in an in-graph `tf.cond`, without `merge_call`.

  What a micro-step and an apply step do is `cycle.Cycle`; the mechanics are
  one call away, each in the module named for it: `accumulators`,
  `aggregation` (mean, sum, weights), `numerics` (non-finite policies,
  clipping), `steps` (the cycle counter), `variables` (the wrapper's own
  variables) and `distribute` (replicas, multi-worker helpers).
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
    """Constructs the wrapper. The README's "Usage" details every keyword.

    Args:
      opt: the `tf.compat.v1.train.Optimizer` that applies the mean gradient.
      grad_steps: positive int, the number of micro-steps per update.
      apply_crs_to_grad: bool; if True, each accumulated gradient is summed
        across TPU replicas with `tf.compat.v1.tpu.cross_replica_sum` before
        it is applied (TPU only).
      xla_num_partitions: None, or a positive int: annotate accumulator reads
        with an XLA sharding over that many partitions (`sharding`).
      use_tpu: bool; True selects the TPU path described above.
      sparse_as_dense: bool. False (the default) accumulates sparse gradients
        (`tf.IndexedSlices`) row by row and hands the wrapped optimizer an
        `IndexedSlices` over the rows the cycle touched; True densifies
        them, as the original did.
      nonfinite_policy: what a micro-batch with a NaN or inf gradient does:
        None (the original's: it poisons the update), 'skip_micro_batch'
        (the cycle applies the mean of its finite micro-batches) or
        'skip_cycle' (the cycle applies nothing). See `numerics`.
      accumulator_dtype: None (the variable's dtype), or a wider float dtype
        such as tf.float32 to sum half-precision gradients in.
      clip_norm: None, or a positive float: clip the cycle's gradient to this
        global norm (over all replicas) before it is applied.
      aggregation: 'mean' (the default, the original's) or 'sum': what the
        cycle applies of its micro-batch gradients. See `aggregation`.
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
    numerics.policy(nonfinite_policy, grad_steps)  # checks the name
    self._nonfinite_policy = nonfinite_policy
    self._accumulator_dtype = arguments.check_accumulator_dtype(
        accumulator_dtype)
    self._clip_norm = arguments.check_clip_norm(clip_norm)
    if xla_num_partitions is not None:
      xla_num_partitions = arguments.check_positive_int(
          xla_num_partitions, 'xla_num_partitions')
    self._xla_num_partitions = xla_num_partitions
    self._aggregation, self._micro_batch_weight = aggregation_lib.check(
        aggregation, micro_batch_weight)
    super(GradientAggregationOptimizer, self).__init__(
        use_locking=False, name='GradientAggregationOptimizer')
    self._opt = opt
    self._grad_steps = grad_steps
    self._train_ops = []  # the `cycle.TrainOpState` of each train op built
    self.strategy = tf.distribute.get_strategy()

  @property
  def grad_steps(self):
    """The number of micro-steps per applied update."""
    return self._grad_steps

  @property
  def skipped_micro_batches(self):
    """int64 variable: micro-batches a `nonfinite_policy` skipped, or None.

    That of the train op built last; the total over replicas, updated on
    each apply step.
    """
    return self._last_train_op().policy.skipped_micro_batches

  @property
  def skipped_cycles(self):
    """int64 variable: cycles a `nonfinite_policy` applied nothing in."""
    return self._last_train_op().policy.skipped_cycles

  def applies_update(self):
    """A boolean tensor: True when this run of the train op ends a cycle.

    Fetch it with the train op (it is computed from the step the train op
    reads, before it counts the micro-step), or use it in the graph, e.g. to
    write a summary only on apply steps. That of the train op built last.
    With a `nonfinite_policy` a cycle may end without applying anything
    (counted in `skipped_cycles`).

    Raises:
      ValueError: no train op has been built yet.
    """
    return self._last_train_op().applies_update(self._grad_steps)

  def micro_step_in_cycle(self):
    """An int64 tensor: this run's place in its cycle (see applies_update)."""
    return self._last_train_op().micro_step_in_cycle(self._grad_steps)

  def _last_train_op(self):  # the train op built last
    if not self._train_ops:
      raise ValueError('No train op has been built with this '
                       'GradientAggregationOptimizer yet: call minimize or '
                       'apply_gradients first.')
    return self._train_ops[-1]

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
      TypeError: `global_step` is not a `Variable`, or `name` not a string.
      ValueError: `grads_and_vars` is empty, or every gradient is None; or
        `global_step` is counted by another train op of a wrapper in this
        graph; or `apply_crs_to_grad=True` outside a TPU computation; or the
        wrapper is wrapped by a `SyncReplicasOptimizer`.
      RuntimeError: in eager mode or `tf.function`; on the GPU path in a
        cross-replica context; under a multi-worker ParameterServerStrategy.
    """
    arguments.check_graph_mode('apply_gradients')
    grads_and_vars = tuple(grads_and_vars)
    if not grads_and_vars:
      raise ValueError('No variables provided.')
    if global_step is not None and not isinstance(global_step, tf.Variable):
      raise TypeError('global_step must be None or a tf.Variable, got %r.' %
                      (global_step,))
    if name is not None and not isinstance(name, six.string_types):
      raise TypeError('name must be None or a string, got %r.' % (name,))
    present = [(g, v) for g, v in grads_and_vars if g is not None]
    arguments.check_not_synced([g for g, _ in present])
    if not present:
      raise ValueError('No gradients provided for any variable: %s.' %
                       ([v.name for _, v in grads_and_vars],))
    var_list = [v for _, v in present]
    replica_context = tf.distribute.get_replica_context()
    distribute.check_replicas(replica_context, self._use_tpu)
    arguments.check_cross_replica_sum(self._apply_crs_to_grad)

    # Where the wrapped optimizer's non-slot variables go: found before this
    # method opens its own name scope, so that `name` changes op names only.
    wrapped_vars_scope = variables_lib.wrapped_vars_scope(self._grad_steps)
    in_xla = compat.in_xla_context()  # before init_scope, which leaves it
    with tf.compat.v1.name_scope(name, self._name) as scope:
      # Variables on parameter servers: the state is the worker's own.
      worker = placement.worker_device(var_list)
      local = placement.WorkerLocal(worker) if worker else None
      with tf.init_scope():
        # Which accumulators take (and hand on) sparse gradients is fixed
        # when the graph is built, from the gradients' types. A cross-replica
        # sum needs the same shape on every core: dense.
        sparse = not (self._sparse_as_dense or self._apply_crs_to_grad)
        with distribute.summed_on_save():
          accumulators = [
              accumulators_lib.create(
                  self._opt, v, g, self._grad_steps, sparse,
                  self._accumulator_dtype, self._xla_num_partitions, in_xla,
                  local) for g, v in present
          ]
        state = self._train_op_state(replica_context, global_step, local)
      cycle = cycle_lib.Cycle(
          self._opt, self._grad_steps, [g for g, _ in present], var_list,
          accumulators, state,
          aggregation_lib.weight_tensor(self._micro_batch_weight),
          self._clip_norm, self._apply_crs_to_grad)
      accumulate = cycle.micro_step()
      if self._use_tpu:
        variables_lib.create_wrapped_slots(self._opt, var_list,
                                           wrapped_vars_scope)
        return self._apply_on_tpu(accumulate, cycle, global_step)
    # The cycle is decided on the step the train op counts, or on its own.
    step = global_step if state.counter is None else state.counter
    also = global_step if step is not global_step else None
    # The original's GPU path: merge_call outside tf.cond.
    return replica_context.merge_call(
        self._apply_on_cycle_end,
        args=(accumulate, cycle, step, also, wrapped_vars_scope, scope))

  def _train_op_state(self, replica_context, global_step, local):
    """This train op's `cycle.TrainOpState`, made once for all replicas.

    Call under `tf.init_scope()`. See `variables.train_op_state`; `local` is
    a `placement.WorkerLocal` or None.
    """

    def create():
      own_counter = self._grad_steps > 1 and (
          self._use_tpu or global_step is None or local is not None)
      if global_step is not None:
        variables_lib.count_global_step(global_step, self._grad_steps)
        distribute.plain_global_step_read(global_step)
      policy = numerics.policy(self._nonfinite_policy, self._grad_steps)
      policy.create_variables(local)
      aggregation = aggregation_lib.Aggregation(
          self._grad_steps, self._aggregation,
          self._micro_batch_weight is not None)
      aggregation.create_variables(local)
      counter = None
      if own_counter:
        counter = steps.create_counter(local)
      return cycle_lib.TrainOpState(policy, aggregation, counter)

    state = variables_lib.train_op_state(replica_context, create)
    if not any(state is own for own in self._train_ops):
      self._train_ops.append(state)
    return state

  # ---------------------------------------------------------------- paths --

  def _apply_on_cycle_end(self, distribution, accumulate, cycle, step, also,
                          wrapped_vars_scope, scope):
    """GPU path, cross-replica context: apply on the cycle's last step.

    The cycle is decided on `step`; `also` (None, or a global step) counts too.
    """
    # Strings, ops and objects that differ per replica arrive as PerReplica.
    first = lambda value: distribution.experimental_local_results(value)[0]
    wrapped_vars_scope = tuple(first(part) for part in wrapped_vars_scope)
    scope = first(scope)
    accumulate = distribution.experimental_local_results(accumulate)
    # The train op's state and variables are the same on every replica.
    state, var_list = first(cycle).state, first(cycle).var_list
    variables_lib.create_wrapped_slots(self._opt, var_list,
                                       wrapped_vars_scope)
    with tf.compat.v1.name_scope(scope):

      def on_each_replica(apply, scale):
        return distribution.group(distribution.extended.call_for_each_replica(
            lambda c: c.apply_and_reset(apply, scale), args=(cycle,)))

      def apply_and_advance():
        sum_statistics, replicas = first(cycle).over_cores(
            lambda: distribute.sum_over_replicas(
                distribution, lambda c: c.statistics(), cycle),
            distribution.num_replicas_in_sync)
        applied = first(cycle).apply_step(sum_statistics, replicas,
                                          on_each_replica)
        if step is None:
          return applied
        with tf.control_dependencies([applied]):
          return steps.advance(step, state.step_value, self._grad_steps,
                               step is state.counter)

      if self._grad_steps == 1:  # every micro-step applies
        with tf.control_dependencies(accumulate):
          return apply_and_advance()
      with tf.control_dependencies(accumulate):
        state.step_value = distribute.started_on_cycle_boundary(
            step.read_value(), self._grad_steps)
      # Both branches advance the step: its read is ordered before its write.
      done = compat.cond(
          steps.is_cycle_end(state.step_value, self._grad_steps),
          apply_and_advance,
          lambda: steps.advance(step, state.step_value, self._grad_steps,
                                step is state.counter))
      if also is None:
        return done
      with tf.control_dependencies([done]):
        return steps.advance(also, None, self._grad_steps, False)

  def _apply_on_tpu(self, accumulate, cycle, global_step):
    """TPU path: decide on `update_count`, read before it is incremented."""
    state = cycle.state

    def apply_step():
      sum_statistics, cores = cycle.over_cores(cycle.statistics, 1)
      return cycle.apply_step(sum_statistics, cores, cycle.apply_and_reset)

    advances = []
    if state.counter is None:  # grad_steps=1: every micro-step applies
      with tf.control_dependencies([accumulate]):
        applied = apply_step()
    else:
      with tf.control_dependencies([accumulate]):
        state.step_value = state.counter.read_value()
      applied = compat.cond(
          steps.is_cycle_end(state.step_value, self._grad_steps), apply_step,
          tf.no_op)
      # The original incremented the counter beside the tf.cond that read
      # it, with no order between the two: a race under resource variables.
      with tf.control_dependencies([applied]):
        advances.append(steps.advance(state.counter, state.step_value,
                                      self._grad_steps, True))
    if global_step is not None:
      with tf.control_dependencies([applied]):
        advances.append(steps.advance(global_step, None, self._grad_steps,
                                      False))
    return tf.group(applied, *advances)

  # ------------------------------------------------ the wrapped optimizer --

  def get_slot(self, *args, **kwargs):
    """Delegates to the wrapped optimizer, which owns every slot."""
    return self._opt.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):
    """Delegates to the wrapped optimizer; includes `grad_accum`."""
    return self._opt.get_slot_names(*args, **kwargs)

  def variables(self):
    """The wrapped optimizer's variables, plus the wrapper's own counters.

    Returns:
      A list of variables of the current graph, sorted by name.
    """
    variables = list(self._opt.variables())
    graph = tf.compat.v1.get_default_graph()
    for state in self._train_ops:
      variables.extend(own for own in state.variables()
                       if getattr(own, 'graph', None) is graph)
    return sorted(variables, key=lambda v: v.name)
