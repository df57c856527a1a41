"""Optimizer wrapper for deferred (accumulated) gradient application."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import six
from six.moves import zip

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import arguments
from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import numerics
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
  * `global_step` is incremented on every micro-step. Learning-rate schedules
    therefore see micro-steps; feed them `applied_updates(global_step,
    grad_steps)` to see updates instead.
  * With `grad_steps=1` the wrapper passes gradients straight to the wrapped
    optimizer (and creates no variables of its own).

  Two code paths build the cycle logic:

  * GPU path (`use_tpu=False`): accumulation runs in the replica context; a
    `merge_call` then decides in an in-graph `tf.cond` on the step counter
    whether this micro-step ends the cycle. If so each replica calls the
    wrapped optimizer's `apply_gradients`, which all-reduces, so replicas talk
    only on apply steps.
  * TPU path (`use_tpu=True`): a scalar counter variable `update_count`
    decides in an in-graph `tf.cond`, without `merge_call`.

  The mechanics live one call away, each in the module named for it:
  `accumulators` (dense, sharded and sparse accumulation), `numerics`
  (non-finite policies, clipping), `steps` (the cycle counter) and
  `distribute` (replica checks, multi-worker helpers).
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
               clip_norm=None):
    """Constructs the wrapper.

    Args:
      opt: the `tf.compat.v1.train.Optimizer` that applies the mean gradient.
      grad_steps: positive int, the number of micro-steps per update.
      apply_crs_to_grad: bool; if True, each accumulated gradient is summed
        across TPU replicas with `tf.compat.v1.tpu.cross_replica_sum` before
        it is applied (TPU only).
      xla_num_partitions: None, or a positive int: annotate accumulator reads
        with an XLA sharding over that many partitions (see
        `deferred_grad.sharding`).
      use_tpu: bool; True selects the TPU path described above.
      sparse_as_dense: bool. False (the default) accumulates sparse gradients
        (`tf.IndexedSlices`, e.g. of an embedding lookup) by scatter-adding
        the rows they touch and hands the wrapped optimizer an
        `IndexedSlices` over the rows with a non-zero accumulated gradient,
        so that it applies its own sparse update. True is the original's
        behaviour: sparse gradients are densified into the accumulator on
        every micro-step and applied as dense gradients (to continue an old
        run exactly as the original would have).
      nonfinite_policy: what a micro-batch with a NaN or inf gradient does.
        None (the original's behaviour): it is accumulated like any other and
        poisons the cycle's update. 'skip_micro_batch': it contributes
        nothing, and the cycle applies the mean of the finite micro-batches
        (their sum divided by their count; nothing if there is none).
        'skip_cycle': the cycle it belongs to applies nothing. Skipped
        micro-batches and cycles are counted in the variables
        `skipped_micro_batches` and `skipped_cycles`.
      accumulator_dtype: None (the variable's dtype, the original's), or a
        wider float dtype such as tf.float32 to sum half-precision gradients
        in; the mean is cast back to the variable's dtype when applied.
      clip_norm: None, or a positive float: clip the accumulated mean
        gradient to this global norm (`tf.clip_by_global_norm`) just before
        the wrapped optimizer applies it, as large-batch training would clip
        the large batch's gradient. Under a multi-replica strategy the norm
        is the global one, across replicas.

    Raises:
      TypeError: `opt` is not a `tf.compat.v1.train.Optimizer`, or an argument
        has the wrong type.
      ValueError: `grad_steps` or `xla_num_partitions` is not positive.
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
    super(GradientAggregationOptimizer, self).__init__(
        use_locking=False, name='GradientAggregationOptimizer')
    self._opt = opt
    self._grad_steps = grad_steps
    # (policy, update_count or None) of each train op this wrapper built.
    self._train_ops = []
    self.strategy = tf.distribute.get_strategy()

  @property
  def grad_steps(self):
    """The number of micro-steps per applied update."""
    return self._grad_steps

  @property
  def skipped_micro_batches(self):
    """int64 variable: micro-batches a `nonfinite_policy` skipped, or None.

    That of the train op built last; the sum over replicas, updated on each
    apply step.
    """
    return self._last_policy().skipped_micro_batches

  @property
  def skipped_cycles(self):
    """int64 variable: cycles a `nonfinite_policy` applied nothing in."""
    return self._last_policy().skipped_cycles

  def _last_policy(self):
    if not self._train_ops:
      return numerics.policy(None, self._grad_steps)
    return self._train_ops[-1][0]

  def compute_gradients(self, loss, var_list=None, **kwargs):
    """Delegates to the wrapped optimizer's `compute_gradients`."""
    arguments.check_graph_mode('compute_gradients')
    return self._opt.compute_gradients(loss, var_list=var_list, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Accumulates a micro-step's gradients; applies their mean every cycle.

    Args:
      grads_and_vars: list of (gradient, variable) pairs, as returned by
        `compute_gradients`. Pairs whose gradient is None are skipped.
      global_step: optional integer `Variable`, incremented once per call
        (micro-step). Without it the wrapper counts micro-steps itself.
      name: optional name for the returned op; all ops made here live under
        this name scope (default: the optimizer's name).

    Returns:
      An op that runs one micro-step.

    Raises:
      TypeError: `global_step` is not a `Variable`, or `name` not a string.
      ValueError: `grads_and_vars` is empty, or every gradient is None; or
        `global_step` is counted by another train op of a wrapper in this
        graph.
      RuntimeError: in eager mode or `tf.function`; or, on the GPU path, in a
        cross-replica context.
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
    if self._grad_steps == 1:
      return self._apply_directly(grads_and_vars, global_step, name)

    present = [(g, v) for g, v in grads_and_vars if g is not None]
    if not present:
      raise ValueError('No gradients provided for any variable: %s.' %
                       ([v.name for _, v in grads_and_vars],))
    var_list = [v for _, v in present]
    replica_context = tf.distribute.get_replica_context()
    distribute.check_replicas(replica_context, self._use_tpu)

    # Where the original's tf.cond would have put the wrapped optimizer's
    # non-slot variables (Adam's beta1_power, ...): found before this method
    # opens its own name scope, so that `name` changes op names only.
    wrapped_vars_scope = self._wrapped_vars_scope()
    with tf.init_scope():
      # Which accumulators take (and hand on) sparse gradients is fixed
      # when the graph is built, from the gradients' types. A cross-replica
      # sum needs the same shape on every core: dense.
      sparse = not (self._sparse_as_dense or self._apply_crs_to_grad)
      with distribute.summed_on_save():
        accumulators = [
            accumulators_lib.create(self._opt, v, g, self._grad_steps, sparse,
                                    self._accumulator_dtype,
                                    self._xla_num_partitions)
            for g, v in present
        ]
      policy, counter = self._train_op_state(replica_context, global_step)

    with tf.compat.v1.name_scope(name, self._name) as scope:
      accumulate = policy.micro_step(
          [g for g, _ in present],
          lambda: tf.group(*[a.add(g) for a, (g, _) in zip(accumulators,
                                                           present)],
                           name='accumulate'))
      if self._use_tpu:
        self._create_wrapped_slots(var_list, wrapped_vars_scope)
        return self._apply_on_tpu(accumulate, policy, accumulators, var_list,
                                  counter, global_step)
    step = counter if global_step is None else global_step
    # The original's GPU path: merge_call outside tf.cond.
    return replica_context.merge_call(
        self._apply_on_cycle_end,
        args=(accumulate, policy, accumulators, var_list, step,
              step is counter, wrapped_vars_scope, scope))

  def _train_op_state(self, replica_context, global_step):
    """This train op's (policy, update_count or None), made once.

    Call under `tf.init_scope()`. See `variables.train_op_state`.
    """

    def create():
      if global_step is not None:
        variables_lib.count_global_step(global_step, self._grad_steps)
      policy = numerics.policy(self._nonfinite_policy, self._grad_steps)
      policy.create_variables()
      counter = None
      if self._use_tpu or global_step is None:
        counter = steps.create_counter()
      return policy, counter

    state = variables_lib.train_op_state(replica_context, create)
    if not any(state is own for own in self._train_ops):
      self._train_ops.append(state)
    return state

  # ---------------------------------------------------------------- paths --

  def _apply_on_cycle_end(self, distribution, accumulate, policy,
                          accumulators, var_list, step, wraps,
                          wrapped_vars_scope, scope):
    """GPU path, cross-replica context: apply on the cycle's last step."""
    # Strings and ops that differ per replica arrive as PerReplica values.
    wrapped_vars_scope = distribution.experimental_local_results(
        wrapped_vars_scope)[0]
    scope = distribution.experimental_local_results(scope)[0]
    accumulate = distribution.experimental_local_results(accumulate)
    self._create_wrapped_slots(var_list, wrapped_vars_scope)
    with tf.compat.v1.name_scope(scope):
      with tf.control_dependencies(accumulate):
        step_value = step.read_value()

      def on_each_replica(apply, good):
        return distribution.group(distribution.extended.call_for_each_replica(
            self._apply_and_reset,
            args=(policy, accumulators, var_list, apply, good)))

      def apply_and_advance():
        applied = self._decide_and_apply(
            policy,
            lambda: distribute.sum_over_replicas(distribution,
                                                 policy.statistics),
            distribution.num_replicas_in_sync, on_each_replica)
        with tf.control_dependencies([applied]):
          return steps.advance(step, step_value, self._grad_steps, wraps)

      # Both branches advance the step, so the predicate's read of the step
      # is ordered before its write.
      return compat.cond(
          steps.is_cycle_end(step_value, self._grad_steps), apply_and_advance,
          lambda: steps.advance(step, step_value, self._grad_steps, wraps))

  def _apply_on_tpu(self, accumulate, policy, accumulators, var_list, counter,
                    global_step):
    """TPU path: decide on `update_count`, read before it is incremented."""
    with tf.control_dependencies([accumulate]):
      count = counter.read_value()

    def sum_over_cores():
      statistics = tf.stack(policy.statistics())
      if self._apply_crs_to_grad:
        statistics = tf.compat.v1.tpu.cross_replica_sum(statistics)
      return tf.unstack(statistics)

    cores = 1.0
    if self._apply_crs_to_grad and policy.has_statistics:
      cores = tf.compat.v1.tpu.cross_replica_sum(tf.constant(1.0))
    applied = compat.cond(
        steps.is_cycle_end(count, self._grad_steps),
        lambda: self._decide_and_apply(
            policy, sum_over_cores, cores,
            lambda apply, good: self._apply_and_reset(
                policy, accumulators, var_list, apply, good)),
        tf.no_op)
    # The original incremented the counter beside the tf.cond that read it,
    # with no order between the two: a race under resource variables.
    with tf.control_dependencies([applied]):
      advances = [steps.advance(counter, count, self._grad_steps, True)]
      if global_step is not None:
        advances.append(steps.advance(global_step, None, self._grad_steps,
                                      False))
    return tf.group(*advances)

  def _decide_and_apply(self, policy, sum_statistics, replicas,
                        on_each_replica):
    """The apply step: the policy decides, then each replica applies or not.

    Args:
      policy: the train op's non-finite policy.
      sum_statistics: returns the policy's statistics summed over replicas
        (the cycle's one exchange between replicas beyond the wrapped
        optimizer's own all-reduce).
      replicas: the number of replicas (a number or a scalar tensor).
      on_each_replica: `fn(apply, good)` building, on every replica, the
        apply (or, with `apply` False, only the reset) of the accumulators.

    Returns:
      An op.
    """
    if not policy.has_statistics:
      return on_each_replica(True, None)
    totals = sum_statistics()
    apply_now, good = policy.decide(totals, replicas)
    applied = compat.cond(apply_now, lambda: on_each_replica(True, good),
                          lambda: on_each_replica(False, None))
    with tf.control_dependencies([applied]):
      return tf.group(*policy.count(totals, apply_now))

  def _apply_and_reset(self, policy, accumulators, var_list, apply, good):
    """On one replica: applies the accumulated mean (if `apply`), then resets.

    Args:
      policy: the train op's non-finite policy.
      accumulators: the accumulators, in the order of `var_list`.
      var_list: the variables.
      apply: False to only reset (a cycle the policy skips).
      good: None, or the number of micro-batches per replica that the
        accumulators hold (the mean divides by it instead of grad_steps).

    Returns:
      An op.
    """
    read = [a.read() for a in accumulators]
    if not apply:
      done = tf.no_op()
    else:
      grads = read
      if self._apply_crs_to_grad:
        grads = [tf.compat.v1.tpu.cross_replica_sum(g) for g in grads]
      if good is not None:
        # The accumulators hold sum / grad_steps: the mean over `good`.
        scale = self._grad_steps / tf.maximum(good, 1.0)
        grads = [numerics.map_values(g, lambda x: x * tf.cast(scale, x.dtype))
                 for g in grads]
      # Clipped after the mean is complete: as large-batch training clips.
      if self._clip_norm is not None:
        grads = numerics.clip_by_global_norm(grads, self._clip_norm)
      grads = [
          numerics.map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
          for g, v in zip(grads, var_list)
      ]
      done = self._opt.apply_gradients(list(zip(grads, var_list)))
    with tf.control_dependencies([done]):
      resets = policy.reset()
    return tf.group(
        *(resets + accumulators_lib.reset_all(accumulators, read, done)))

  def _apply_directly(self, grads_and_vars, global_step, name):
    """grad_steps=1: there is nothing to accumulate."""
    if self._apply_crs_to_grad:
      grads_and_vars = [
          (None if g is None else tf.compat.v1.tpu.cross_replica_sum(
              tf.convert_to_tensor(g)), v) for g, v in grads_and_vars
      ]
    return self._opt.apply_gradients(
        grads_and_vars, global_step=global_step, name=name)

  # ------------------------------------------------ the wrapped optimizer --

  def _wrapped_vars_scope(self):
    """Returns the absolute name scope of the wrapped optimizer's variables.

    The original called the wrapped `apply_gradients` inside a `tf.cond`, and
    optimizers name their non-slot variables after the current name scope. A
    control flow v2 branch starts at the root scope; a v1 branch is under
    `<current scope>/cond`, uniquified.
    """
    if tf.compat.v1.control_flow_v2_enabled():
      return ''
    graph = tf.compat.v1.get_default_graph()
    return graph.unique_name('cond', mark_as_used=False) + '/'

  def _create_wrapped_slots(self, var_list, scope):
    with tf.init_scope(), tf.compat.v1.name_scope(scope):
      self._opt._create_slots(var_list)  # pylint: disable=protected-access

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
    for policy, counter in self._train_ops:
      for own in [counter] + policy.variables():
        if own is not None and getattr(own, 'graph', None) is graph:
          variables.append(own)
    return sorted(variables, key=lambda v: v.name)
