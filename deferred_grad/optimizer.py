"""Optimizer wrapper for deferred (accumulated) gradient application.

The algorithm reads top to bottom from `apply_gradients`:

1. `_micro_step`: check, weigh, add (the micro-step of each replica);
2. `_end_micro_step`: one decision, a `tf.cond` on the cycle's end (GPU
   path: after a `merge_call`; TPU path: in the replica), then advance;
3. `_apply_step`: sum the cycle's counts over replicas once, decide;
4. `_apply_and_reset`: on each replica, apply the cycle's gradient, reset.

The mechanics are one call away, called with values and returning values:
`accumulators` (the cycle's sums), `cycle` (a micro-step's place in its
cycle; the train op's state), `numerics` (which micro-batches count, by
what factor), `distribute` (where replicas meet), `kernels` (the variables'
handles). Made once per train op: `state` (its variables); beside them
`arguments` (checks), `checkpoints` (names), `placement` (parameter servers).
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import cycle
from deferred_grad import distribute
from deferred_grad import kernels
from deferred_grad import lazy_cond
from deferred_grad import numerics
from deferred_grad import placement
from deferred_grad import state as state_lib

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
  that training matches one batch `grad_steps` times larger. Batch
  statistics stay per micro-batch; `global_step` counts micro-steps (feed
  learning-rate schedules `applied_updates()`).

  Two code paths build the cycle logic, as the original's: the GPU path
  (`use_tpu=False`) decides after a `merge_call`, and each replica's
  wrapped `apply_gradients` all-reduces, so replicas talk only on apply
  steps; the TPU path (`use_tpu=True`) decides in the replica.
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
      grad_steps: micro-steps per update: a positive int, or a schedule (a
        scalar integer tensor, or a callable of the updates applied, an
        int64 tensor, returning one), read on each cycle's first micro-step.
      apply_crs_to_grad: bool; True sums each accumulated gradient over TPU
        cores (`tf.compat.v1.tpu.cross_replica_sum`, TPU only).
      xla_num_partitions: None, or a positive int: annotate accumulator reads
        with an XLA sharding over that many partitions (`sharding`).
      use_tpu: bool; True selects the TPU path described above.
      sparse_as_dense: bool; True densifies `tf.IndexedSlices` (the
        original's), False accumulates and hands on the rows touched.
      nonfinite_policy: for a NaN or inf micro-batch: None (it poisons the
        update, the original's), 'skip_micro_batch' (the mean of the finite
        ones) or 'skip_cycle' (the cycle applies nothing).
      accumulator_dtype: None (the variable's dtype), or a wider float dtype
        such as tf.float32 to sum half-precision gradients in.
      clip_norm: None, or a positive float: the cycle's gradient is clipped
        to this global norm (over all replicas).
      aggregation: 'mean' (the default, the original's) or 'sum': what the
        cycle applies of its micro-batch gradients. See `numerics`.
      micro_batch_weight: None, or a scalar tensor (or a callable, called on
        each replica) weighing the micro-step, e.g. its token count: the
        cycle applies `sum(w_i * g_i) / sum(w_i)` (with 'sum', the numerator).

    Raises:
      TypeError: `opt` is not a `tf.compat.v1.train.Optimizer`, or an argument
        has the wrong type.
      ValueError: an argument has a wrong value.
    """
    arguments.check_optimizer(opt)
    grad_steps = arguments.check_grad_steps(grad_steps)
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
    self._policy = numerics.Policy.checked(nonfinite_policy, aggregation,
                                           micro_batch_weight is not None)
    super(GradientAggregationOptimizer, self).__init__(
        use_locking=False, name='GradientAggregationOptimizer')
    self._opt = opt
    self._grad_steps = grad_steps
    self._states = []  # the `cycle.TrainOpState` of each train op
    self.strategy = tf.distribute.get_strategy()

  @property
  def grad_steps(self):
    """The number of micro-steps per applied update (an int or a schedule)."""
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

    Fetch it with the train op (it is what the run reads before it counts
    the micro-step), or use it in the graph (summaries on apply steps). That
    of the train op built last; with a `nonfinite_policy` a cycle may end
    applying nothing (`skipped_cycles`).

    Raises:
      ValueError: no train op has been built yet.
    """
    return self._last_state().applies_update()

  def micro_step_in_cycle(self):
    """An int64 tensor: this run's place in its cycle (see applies_update)."""
    return self._last_state().micro_step_in_cycle()

  def applied_updates(self):
    """An int64 tensor: the updates the last train op applied before a run.

    For learning-rate schedules, in place of `global_step` (which counts
    micro-steps), through a callable learning rate, called when the train op
    is built: `learning_rate=lambda: schedule(opt.applied_updates())`.

    Raises:
      ValueError: no train op has been built yet, or an int `grad_steps`
        and a train op built without a `global_step`.
    """
    return self._last_state().applied_updates()

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
      grads_and_vars: (gradient, variable) pairs from `compute_gradients`;
        None gradients are skipped, a variable's repeats summed.
      global_step: optional integer `Variable`, which the wrapper increments
        once per call (micro-step).
      name: optional name for the returned op; all ops made here live under
        this name scope (default: the optimizer's name).

    Returns:
      An op that runs one micro-step.

    Raises:
      TypeError, ValueError, RuntimeError: see `check_apply_gradients` and
        `state.count_global_step`.
    """
    replica_context = tf.distribute.get_replica_context()
    present = arguments.check_apply_gradients(
        grads_and_vars, global_step, name, replica_context, self._use_tpu,
        self._apply_crs_to_grad)
    with tf.init_scope():  # checkpoints restore across settings
      checkpoints.register_default_saver(tf.compat.v1.get_default_graph())
    var_list = [v for _, v in present]
    # grad_steps=1: each micro-step is a cycle, applying its own gradients.
    accumulates = not (isinstance(self._grad_steps, int) and
                       self._grad_steps == 1)
    # Where the wrapped optimizer's non-slot variables go, found before the
    # name scope opens: `name` changes op names only.
    wrapped_vars_scope = checkpoints.wrapped_vars_scope(accumulates)
    in_xla = compat.in_xla_context()  # before init_scope, which leaves it
    with tf.compat.v1.name_scope(name, self._name) as scope:
      # Variables on parameter servers: the state is the worker's own.
      local = placement.worker_local(var_list)
      # Sparse or dense is fixed at graph build, from the gradients' types;
      # a cross-replica sum needs the same shape on every core: dense.
      sparse = not (self._sparse_as_dense or self._apply_crs_to_grad)
      with tf.init_scope():
        own_counter = self._use_tpu or global_step is None or (
            local is not None)
        state = state_lib.train_op_state(
            replica_context, self._grad_steps, accumulates, self._policy,
            own_counter, global_step, local,
            numerics.counts_dtype(var_list, self._accumulator_dtype))
        if accumulates:  # each train op its own (`create_slot`)
          accumulators = accumulators_lib.create(
              self._opt, present, sparse, self._accumulator_dtype,
              self._xla_num_partitions, in_xla, local, owner=state)
        else:
          accumulators = accumulators_lib.PassThrough(sparse)
      if not any(state is own for own in self._states):
        self._states.append(state)
        for counter in state.counters():  # restored before it was made
          compat.handle_deferred_dependencies(self, counter.op.name, counter)
      # Runs of one train op from several threads of a session take turns
      # (`cycle.acquire_lock`). Not inside XLA (no mutex compiles), nor where
      # replicas span workers (their collectives already run in lockstep),
      # nor with grad_steps=1, which keeps nothing between runs.
      locked = accumulates and not in_xla and not (
          distribute.in_multi_worker_mode(tf.distribute.get_strategy()))
      initialized = placement.initialized_check(local, state.variables())
      lock, position = state.begin_run(locked, initialized)
      with tf.control_dependencies([lock] if lock is not None else []):
        weight = arguments.weight_tensor(self._micro_batch_weight)
        checks = (initialized + position.checks +
                  arguments.check_weight_value(weight,
                                               self._policy.nonfinite_policy))
        micro_step, part = self._micro_step(
            state, position, var_list, accumulators, [g for g, _ in present],
            weight, checks)
      if self._use_tpu:
        checkpoints.create_wrapped_slots(self._opt, var_list,
                                         wrapped_vars_scope, self)
        return self._end_micro_step(None, [micro_step], part)
    # The original's GPU path: merge_call outside tf.cond.
    return replica_context.merge_call(
        self._end_micro_step_across_replicas,
        args=(micro_step, part, wrapped_vars_scope, scope))

  # -------------------------------------------------------- the algorithm --

  def _micro_step(self, state, position, var_list, accumulators, gradients,
                  weight, checks):
    """1. This replica's micro-step: check, weigh, add.

    `checks` run before anything is added or counted: a micro-step that
    fails one changes nothing. Returns (its op, its `ReplicaPart`: what
    the apply step needs of this replica)."""
    policy = self._policy
    finite = None
    if policy.nonfinite_policy:
      checked = gradients + ([weight] if weight is not None else [])
      finite = numerics.all_finite(checked)
    gradients = numerics.weigh(gradients, weight)
    increments = numerics.increments(policy, finite, weight,
                                     state.counts_dtype)
    divisor = numerics.Divisor(position.length)
    add = lambda: accumulators.add(gradients, divisor)
    with tf.control_dependencies(checks):
      if finite is None:
        added = add()
      else:  # the predicate waits too: a cond's branches wait for it
        added = lazy_cond.cond(tf.identity(finite), add, tf.no_op)
    with tf.control_dependencies([added]):
      counted = state.add_counts(increments)
    # Every micro-step is marked, skipped or not (see SparseAccumulator).
    op = tf.group(added, *(counted + accumulators.mark()))
    # Rows of tables the replicas share a list of: added where they meet.
    shared = accumulators.shared_rows(gradients, divisor, finite)
    return op, cycle.ReplicaPart(state, var_list, accumulators, gradients,
                                 increments, shared)

  def _end_micro_step_across_replicas(self, distribution, micro_step, part,
                                      wrapped_vars_scope, scope):
    """The GPU path's `merge_call`: `_end_micro_step`, cross-replica."""
    first = lambda value: distribute.first_replica(distribution, value)
    wrapped_vars_scope = tuple(first(p) for p in wrapped_vars_scope)
    checkpoints.create_wrapped_slots(self._opt, first(part).var_list,
                                     wrapped_vars_scope, self)
    with tf.compat.v1.name_scope(first(scope)):
      return self._end_micro_step(
          distribution, distribution.experimental_local_results(micro_step),
          part)

  def _end_micro_step(self, distribution, micro_steps, part):
    """2. The decision: the apply step on the cycle's last micro-step.

    `distribution`: the strategy (GPU path) or None (TPU path);
    `micro_steps` the micro-step's ops, one per replica; `part` the
    `ReplicaPart` (PerReplica under a strategy). Returns the micro-step's
    op, which ends by advancing the cycle.
    """
    first = distribute.first_replica(distribution, part)
    state = first.state
    if distribution is not None:  # the replicas' rows of shared tables
      with tf.control_dependencies(micro_steps):
        micro_steps = list(micro_steps) + first.accumulators.append_shared([
            p.shared_rows for p in
            distribution.experimental_local_results(part)])
    position = state.position  # read first, under the run's lock
    # Under a multi-worker strategy, a session begun mid-cycle drops it.
    restart = distribute.mid_cycle_restart()
    marks = [restart.check(position)] if restart is not None else []
    with tf.control_dependencies(list(micro_steps) + marks):
      applied = lazy_cond.cond(
          position.is_end,
          lambda: self._apply_step(distribution, part, position, restart),
          tf.no_op)
    # After the decision: the cycle's read precedes its write.
    with tf.control_dependencies([applied]):
      return state.end_run(state.advance(position))

  def _apply_step(self, distribution, part, position, restart):
    """3. Sum the counts over replicas, decide, apply and reset on each.

    `restart`: a `distribute.MidCycleRestart`, or None.
    """
    policy = self._policy
    state = distribute.first_replica(distribution, part).state
    # `checks`: under a multi-worker schedule, that the lengths agree.
    totals, replicas, checks = distribute.summed_counts(
        policy.counts, distribution, cycle.ReplicaPart.counts_of_cycle, part,
        self._apply_crs_to_grad,
        None if isinstance(self._grad_steps, int) else position.length)
    decision = numerics.should_apply(policy, totals)  # None: always
    fraction = numerics.scale(policy, totals, replicas, position.length)
    apply_now = decision
    if restart is not None:  # multi-worker: False on a cycle begun mid-way
      kept = restart.keeps_cycle(after=checks)
      apply_now = kept if decision is None else tf.logical_and(decision, kept)
    on_each = lambda apply: self._on_each_replica(
        distribution, part, position.length, fraction if apply else None,
        apply)
    if apply_now is None:
      return on_each(True)
    applied = lazy_cond.cond(apply_now, lambda: on_each(True),
                             lambda: on_each(False))
    if not policy.nonfinite_policy:
      return applied
    with tf.control_dependencies([applied]):
      return tf.group(applied, *state.count_skipped(
          numerics.skipped(totals, decision)))

  def _on_each_replica(self, distribution, part, length, fraction, apply):
    if distribution is None:  # the TPU path: this replica
      return self._apply_and_reset(part, length, fraction, apply)
    return distribution.group(distribution.extended.call_for_each_replica(
        lambda p: self._apply_and_reset(p, length, fraction, apply),
        args=(part,)))

  def _apply_and_reset(self, part, length, fraction, apply):
    """4. On one replica: applies the cycle's gradient (if `apply`), resets.

    `fraction` (`numerics.scale`) turns the sum of the cycle's `length`
    micro-steps into the cycle's gradient."""
    read = part.accumulators.read(length, part.gradients)
    done = tf.no_op()
    if apply:
      gradients = read.gradients
      if self._apply_crs_to_grad:
        gradients = [tf.compat.v1.tpu.cross_replica_sum(g) for g in gradients]
      gradients = numerics.apply_scale(gradients, fraction)
      if self._clip_norm is not None:  # the cycle's gradient, complete
        gradients = numerics.clip_by_global_norm(gradients, self._clip_norm,
                                                 read.whole)
      gradients = numerics.cast_like(gradients, part.var_list)
      with kernels.handles_made_here(self._opt, part.var_list):
        done = self._opt.apply_gradients(list(zip(gradients, part.var_list)))
    with tf.control_dependencies([done]):
      resets = part.state.reset_counts()
    return tf.group(part.accumulators.reset(done, read), *resets)

  # ------------------------------------------------ the wrapped optimizer --

  def get_slot(self, var, name):
    """The slot `name` of `var`: the wrapped optimizer's, or an accumulator.

    Args:
      var: a variable passed to `apply_gradients`.
      name: a slot name: the wrapped optimizer's, or `grad_accum` (a second
        train op's accumulator of `var`: `grad_accum_1`, ...).

    Returns:
      The slot variable, or None.
    """
    for state in self._states:  # a table's list of rows (`accumulators`)
      listed = state.lists.get(id(var))
      if listed is not None and accumulators_lib.slot_name_of(listed) == name:
        return listed
    return self._opt.get_slot(var, name)

  def get_slot_names(self, *args, **kwargs):  # with grad_accum
    return self._opt.get_slot_names(*args, **kwargs)

  # ------------------------------- object-based checkpoints (Keras, etc.) --
  # tf.train.Checkpoint and Keras's save_weights save the optimizer as an
  # object: the wrapper shows the wrapped optimizer's non-slot variables and
  # slots as its own (a bare optimizer's checkpoint restores into it, and
  # its checkpoint into a bare optimizer), and its counters beside them.

  def _own_children(self):
    """{name: variable}: this graph's counters of the wrapper's train ops."""
    graph = tf.compat.v1.get_default_graph()
    return {v.op.name: v for state in self._states
            for v in state.counters() if getattr(v, 'graph', None) is graph}

  def _trackable_children(self, save_type='checkpoint', **kwargs):
    children = compat.trackable_children(self._opt, save_type, **kwargs)
    children.update(self._own_children())
    return children

  def _lookup_dependency(self, name, cached_dependencies=None):
    found = compat.lookup_dependency(self._opt, name, cached_dependencies)
    return found if found is not None else self._own_children().get(name)

  def _create_or_restore_slot_variable(self, slot_variable_position,
                                       slot_name, variable):
    compat.create_or_restore_slot_variable(
        self._opt, slot_variable_position, slot_name, variable)

  def variables(self):
    """The wrapped optimizer's and the wrapper's variables (this graph's)."""
    variables = list(self._opt.variables())
    graph = tf.compat.v1.get_default_graph()
    for state in self._states:
      variables.extend(own for own in state.variables()
                       if getattr(own, 'graph', None) is graph)
    return sorted(variables, key=lambda v: v.name)

