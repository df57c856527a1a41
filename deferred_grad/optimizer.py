"""Optimizer wrapper for deferred (accumulated) gradient application."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import numbers

import six
from six.moves import zip

from deferred_grad import compat
from deferred_grad import sharding

tf = compat.import_tensorflow()

_ACCUMULATOR_SLOT = 'grad_accum'
_ACCUMULATOR_OP_NAME = 'GradientAccumulator'
_COUNTER_NAME = 'update_count'
NONFINITE_POLICIES = (None, 'skip_micro_batch', 'skip_cycle')


def _run_time_zeros(shape, dtype=tf.float32, partition_info=None):
  """Zeros of `shape` that TensorFlow cannot fold into a constant.

  TensorFlow's graph optimizers fold zeros of a known shape into a constant
  as large as the result, and a session keeps every constant its executors
  ran for as long as it lives. As the accumulators' initial value (the
  original's zeros slot) that pinned 1x the parameter bytes (measured with
  tools/benchmark.py); as the zeros of the apply step it did too. A fill
  value they cannot know keeps the zeros a run-time tensor, freed after use.

  Args:
    shape: the shape, a list or a 1-D integer tensor.
    dtype: the element type.
    partition_info: unused; part of the initializer signature.

  Returns:
    A tensor of zeros.
  """
  del partition_info
  dtype = tf.as_dtype(dtype).base_dtype
  zero = tf.compat.v1.placeholder_with_default(tf.constant(0, dtype), [])
  return tf.fill(shape, zero)


def _unfoldable_zeros(variable):
  """Zeros shaped like `variable`, made when the apply step runs."""
  return _run_time_zeros(tf.shape(variable), variable.dtype)


def _values(gradient):
  """The dense values of a Tensor or of an IndexedSlices."""
  return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _map_values(gradient, fn):
  """`fn` applied to a Tensor, or to an IndexedSlices' values (same rows)."""
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(fn(gradient.values), gradient.indices,
                            gradient.dense_shape)
  return fn(gradient)


def _check_positive_int(value, arg_name):
  """Returns `value` as an int, or raises naming `arg_name`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError('%s must be a positive int, got %r of type %s.' %
                    (arg_name, value, type(value).__name__))
  if value < 1:
    raise ValueError('%s must be a positive int, got %r.' % (arg_name, value))
  return int(value)


def _check_bool(value, arg_name):
  # A string such as 'False' is truthy: refuse it rather than guess.
  if not isinstance(value, bool):
    raise TypeError('%s must be a bool, got %r of type %s.' %
                    (arg_name, value, type(value).__name__))
  return value


def _check_graph_mode(method):
  if tf.compat.v1.executing_eagerly_outside_functions():
    raise RuntimeError(
        'GradientAggregationOptimizer.%s needs TensorFlow 1 style graph mode: '
        'call tf.compat.v1.disable_eager_execution() (or '
        'disable_v2_behavior()) at program start. Eager execution and '
        'tf.function are not supported; Keras 3 optimizers offer '
        'gradient_accumulation_steps there.' % method)


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

  Args:
    global_step: the integer step variable (or tensor) passed to
      `apply_gradients`, counting micro-steps.
    grad_steps: the wrapper's `grad_steps`.
    name: optional name for the returned tensor's scope.

  Returns:
    An integer tensor: `global_step // grad_steps`.

  Raises:
    TypeError, ValueError: `grad_steps` is not a positive int.
  """
  grad_steps = _check_positive_int(grad_steps, 'grad_steps')
  with tf.compat.v1.name_scope(name, 'applied_updates', [global_step]):
    return tf.math.floordiv(global_step, grad_steps)


COLLECTIVE_GRAPH_KEY = 20190101


def collective_run_options(graph_key=COLLECTIVE_GRAPH_KEY):
  """`RunOptions` that keep multi-worker collectives in lockstep.

  Under `MultiWorkerMirroredStrategy` in graph mode, a distributed session
  takes collective step ids from a sequence per graph key. Micro-steps that
  only accumulate run no collective, and without a fixed key the workers'
  ids drift apart until the all-reduce of an apply step never matches: a
  hang. Pass these options to every `session.run` of the training loop,
  after running `collective_barrier()` with them once; every worker must
  make the same number of runs.

  Args:
    graph_key: the collective graph key, the same on every worker.

  Returns:
    A `tf.compat.v1.RunOptions`.
  """
  options = tf.compat.v1.RunOptions()
  options.experimental.collective_graph_key = graph_key
  return options


def collective_barrier(strategy=None):
  """A scalar all-reduce across all replicas: the training loop's first run.

  Args:
    strategy: the `MultiWorkerMirroredStrategy` (default: the current one).

  Returns:
    A tensor (the number of replicas) whose run waits for every worker.
  """
  strategy = strategy or tf.distribute.get_strategy()
  ones = strategy.extended.call_for_each_replica(lambda: tf.constant(1.0))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)


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
    if not isinstance(opt, tf.compat.v1.train.Optimizer):
      raise TypeError(
          'opt must be a tf.compat.v1.train.Optimizer (e.g. '
          'tf.compat.v1.train.AdamOptimizer), got %r of type %s.' %
          (opt, type(opt).__name__))
    grad_steps = _check_positive_int(grad_steps, 'grad_steps')
    apply_crs_to_grad = _check_bool(apply_crs_to_grad, 'apply_crs_to_grad')
    use_tpu = _check_bool(use_tpu, 'use_tpu')
    sparse_as_dense = _check_bool(sparse_as_dense, 'sparse_as_dense')
    if nonfinite_policy not in NONFINITE_POLICIES:
      raise ValueError('nonfinite_policy must be one of %s, got %r.' %
                       (NONFINITE_POLICIES, nonfinite_policy))
    if accumulator_dtype is not None:
      accumulator_dtype = tf.as_dtype(accumulator_dtype)
      if not accumulator_dtype.is_floating:
        raise ValueError('accumulator_dtype must be None or a float dtype, '
                         'got %r.' % (accumulator_dtype,))
    if clip_norm is not None:
      if (isinstance(clip_norm, bool) or
          not isinstance(clip_norm, numbers.Real)):
        raise TypeError('clip_norm must be None or a positive number, got %r '
                        'of type %s.' % (clip_norm, type(clip_norm).__name__))
      if not clip_norm > 0:
        raise ValueError('clip_norm must be None or a positive number, got '
                         '%r.' % (clip_norm,))
    if xla_num_partitions is not None:
      xla_num_partitions = _check_positive_int(xla_num_partitions,
                                               'xla_num_partitions')
    super(GradientAggregationOptimizer, self).__init__(
        use_locking=False, name='GradientAggregationOptimizer')
    self._opt = opt
    self._grad_steps = grad_steps
    self._counter = None
    self._use_tpu = use_tpu
    self._apply_crs_to_grad = apply_crs_to_grad
    self._xla_num_partitions = xla_num_partitions
    self._sparse_as_dense = sparse_as_dense
    self._nonfinite_policy = nonfinite_policy
    self._accumulator_dtype = accumulator_dtype
    self._clip_norm = clip_norm
    self._good_micro_batches = None
    self.skipped_micro_batches = None
    self.skipped_cycles = None
    self.strategy = tf.distribute.get_strategy()

  @property
  def grad_steps(self):
    """The number of micro-steps per applied update."""
    return self._grad_steps

  def _create_slots(self, var_list):
    """Creates one zeros accumulator per variable, owned by the wrapped opt.

    The slot belongs to the wrapped optimizer, as in the original, so that it
    is saved as `<variable name>/GradientAccumulator`.

    Args:
      var_list: the variables that receive gradients.
    """
    for v in var_list:
      dtype = self._accumulator_dtype
      if dtype is None:
        dtype = v.dtype.base_dtype
      if v.shape.is_fully_defined():
        self._opt._get_or_make_slot_with_initializer(  # pylint: disable=protected-access
            v, _run_time_zeros, v.shape, dtype, _ACCUMULATOR_SLOT,
            _ACCUMULATOR_OP_NAME)
      elif dtype == v.dtype.base_dtype:
        # Only a variable's value knows its shape: TensorFlow's zeros slot.
        self._opt._zeros_slot(v, _ACCUMULATOR_SLOT, _ACCUMULATOR_OP_NAME)  # pylint: disable=protected-access
      else:
        raise ValueError(
            'accumulator_dtype=%s needs variables of known shape; %s has '
            'shape %s.' % (dtype.name, v.name, v.shape))
    if self._nonfinite_policy and self._good_micro_batches is None:
      counter = lambda name: tf.compat.v1.get_variable(  # pylint: disable=g-long-lambda
          name, shape=[], dtype=tf.int64,
          initializer=tf.compat.v1.zeros_initializer(), trainable=False)
      # Finite micro-batches in the current cycle; totals of skipped ones.
      self._good_micro_batches = counter('good_micro_batches')
      self.skipped_micro_batches = counter('skipped_micro_batches')
      self.skipped_cycles = counter('skipped_cycles')

  def _get_or_create_counter(self):
    """Returns the `update_count` variable, creating it on first use.

    It counts micro-steps modulo `grad_steps`: an unbounded float32 counter
    (the original's) stops counting at 2**24 micro-steps. Its name, shape and
    dtype are the original's so that its checkpoints restore.
    """
    if self._counter is None:
      self._counter = tf.compat.v1.get_variable(
          _COUNTER_NAME,
          shape=[],
          dtype=tf.float32,
          initializer=tf.compat.v1.zeros_initializer(),
          trainable=False,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    return self._counter

  def compute_gradients(self, loss, var_list=None, **kwargs):
    """Delegates to the wrapped optimizer's `compute_gradients`."""
    _check_graph_mode('compute_gradients')
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
      ValueError: `grads_and_vars` is empty, or every gradient is None; or a
        `nonfinite_policy` on several replicas, or `clip_norm` on several
        replicas under control flow v1.
      RuntimeError: in eager mode or `tf.function`; or, on the GPU path, in a
        cross-replica context.
    """
    _check_graph_mode('apply_gradients')
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
    # Which accumulators take (and hand on) sparse gradients: fixed when the
    # graph is built, from the gradients' types.
    sparse = [self._is_sparse(g) for g, _ in present]
    replica_context = tf.distribute.get_replica_context()
    self._check_replicas(replica_context)

    # Where the original's tf.cond would have put the wrapped optimizer's
    # non-slot variables (Adam's beta1_power, ...): found before this method
    # opens its own name scope, so that `name` changes op names only.
    wrapped_vars_scope = self._wrapped_vars_scope()
    with tf.init_scope():
      self._create_slots(var_list)
      if self._use_tpu or global_step is None:
        self._get_or_create_counter()

    with tf.compat.v1.name_scope(name, self._name) as scope:
      accumulate = self._accumulate(present)
      if self._use_tpu:
        self._create_wrapped_slots(var_list, wrapped_vars_scope)
        return self._apply_on_tpu(accumulate, var_list, sparse, global_step)
    step = self._counter if global_step is None else global_step
    # The original's GPU path: merge_call outside tf.cond.
    return replica_context.merge_call(
        self._apply_on_cycle_end,
        args=(accumulate, var_list, sparse, step, wrapped_vars_scope, scope))

  def _check_replicas(self, replica_context):
    """Refuses the contexts and replica counts the options cannot serve."""
    if not self._use_tpu and replica_context is None:
      raise RuntimeError(
          'GradientAggregationOptimizer.apply_gradients must be called in a '
          'replica context (e.g. inside '
          'strategy.extended.call_for_each_replica), not in a cross-replica '
          'context.')
    replicas = replica_context.num_replicas_in_sync if replica_context else 1
    if (self._clip_norm is not None and replicas > 1 and
        not tf.compat.v1.control_flow_v2_enabled()):
      # The cross-replica norm needs an all-reduce inside tf.cond, which
      # fails with mirrored ref variables and control flow v1.
      raise ValueError(
          'clip_norm with several replicas needs control flow v2 and '
          'resource variables (tf.compat.v1.disable_eager_execution(), not '
          'disable_v2_behavior()).')
    if self._nonfinite_policy and (self._apply_crs_to_grad or replicas > 1):
      # Each replica would skip its own micro-batches, and replicas would
      # disagree on what a cycle's mean is.
      raise ValueError(
          'nonfinite_policy=%r needs a single replica; this apply_gradients '
          'runs on several (a multi-replica strategy or apply_crs_to_grad).'
          % (self._nonfinite_policy,))

  def _apply_directly(self, grads_and_vars, global_step, name):
    """grad_steps=1: there is nothing to accumulate."""
    if self._apply_crs_to_grad:
      grads_and_vars = [
          (None if g is None else tf.compat.v1.tpu.cross_replica_sum(
              tf.convert_to_tensor(g)), v) for g, v in grads_and_vars
      ]
    return self._opt.apply_gradients(
        grads_and_vars, global_step=global_step, name=name)

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

  def _is_sparse(self, gradient):
    # A cross-replica sum needs the same shape on every core: dense.
    return (isinstance(gradient, tf.IndexedSlices) and
            not self._sparse_as_dense and not self._apply_crs_to_grad)

  def _accumulate(self, grads_and_vars):
    """Adds each gradient / grad_steps into its accumulator.

    Returns:
      An op that accumulates and, with a `nonfinite_policy`, first checks
      the micro-batch; it then counts it, and only a finite one is added.
    """
    if not self._nonfinite_policy:
      return self._add_to_accumulators(grads_and_vars)
    finite = tf.reduce_all([
        tf.reduce_all(tf.math.is_finite(_values(g))) for g, _ in grads_and_vars
    ])
    added = self._cond(finite,
                       lambda: self._add_to_accumulators(grads_and_vars),
                       tf.no_op)
    with tf.control_dependencies([added]):
      return tf.group(
          self._good_micro_batches.assign_add(
              tf.cast(finite, tf.int64), read_value=False),
          self.skipped_micro_batches.assign_add(
              1 - tf.cast(finite, tf.int64), read_value=False))

  def _add_to_accumulators(self, grads_and_vars):
    updates = []
    for g, v in grads_and_vars:
      accumulator = self.get_slot(v, _ACCUMULATOR_SLOT)
      dtype = accumulator.dtype.base_dtype
      if self._is_sparse(g):
        # Only the rows looked up: the cost does not grow with the table.
        # Duplicate indices add up, as in the dense gradient.
        updates.append(
            accumulator.scatter_add(
                tf.IndexedSlices(
                    tf.cast(g.values, dtype) / self._grad_steps, g.indices)))
        continue
      if isinstance(g, tf.IndexedSlices):
        g = tf.convert_to_tensor(g)
      g = tf.cast(g, dtype)
      if self._xla_num_partitions is None:
        updates.append(self._add_scaled(accumulator, g))
      else:
        current = sharding.shard(accumulator.read_value(),
                                 self._xla_num_partitions)
        updates.append(
            accumulator.assign(current + g / self._grad_steps,
                               read_value=False))
    return tf.group(*updates, name='accumulate')

  def _add_scaled(self, accumulator, gradient):
    """accumulator += gradient / grad_steps, in place, in one kernel.

    SGD's kernel with learning rate -1/grad_steps does exactly this, without
    the temporary that `assign_add(gradient / grad_steps)` allocates and with
    one op per variable instead of two (measured in tools/benchmark.py).
    """
    variable = compat.local_variable(accumulator)
    alpha = tf.constant(-1.0 / self._grad_steps,
                        dtype=variable.dtype.base_dtype)
    if compat.is_ref_variable(variable):
      return tf.raw_ops.ApplyGradientDescent(
          var=variable, alpha=alpha, delta=gradient).op
    return tf.raw_ops.ResourceApplyGradientDescent(
        var=variable.handle, alpha=alpha, delta=gradient)

  def _is_cycle_end(self, step_value):
    return tf.equal(
        tf.math.floormod(step_value, self._grad_steps), self._grad_steps - 1)

  def _advance(self, step, step_value):
    """Counts one micro-step on `step`, whose value was `step_value`.

    `update_count` wraps around at `grad_steps`; a global step counts on.
    """
    if step is self._counter:
      next_value = tf.math.floormod(step_value + 1, self._grad_steps)
      return step.assign(next_value, read_value=False)
    return step.assign_add(1, read_value=False)

  def _sparse_accumulated(self, accumulator):
    """The accumulated gradient as IndexedSlices over its non-zero rows.

    The rows touched in a cycle are not stored anywhere (the original's
    checkpoints have no place for them): they are the rows whose accumulated
    gradient is not zero. A touched row whose sum is exactly zero in every
    entry is therefore left out.
    """
    value = sharding.shard(accumulator.read_value(), self._xla_num_partitions)
    nonzero = tf.not_equal(value, 0)
    if value.shape.rank > 1:
      nonzero = tf.reduce_any(nonzero, axis=list(range(1, value.shape.rank)))
    rows = tf.reshape(tf.where(nonzero), [-1])
    return tf.IndexedSlices(
        tf.gather(value, rows), rows, dense_shape=tf.shape(value, tf.int64))

  def _apply_and_zero_for_each_replica(self, var_list, sparse):
    """Applies the accumulated gradients, then zeroes the accumulators."""
    accumulators = [self.get_slot(v, _ACCUMULATOR_SLOT) for v in var_list]
    grads = [
        self._sparse_accumulated(a) if is_sparse else a.read_value()
        for a, is_sparse in zip(accumulators, sparse)
    ]
    if self._apply_crs_to_grad:
      grads = [tf.compat.v1.tpu.cross_replica_sum(g) for g in grads]
    if self._clip_norm is not None:
      grads = self._clip(grads)
    grads = [
        _map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
        for g, v in zip(grads, var_list)
    ]
    if self._nonfinite_policy:
      apply_op = self._apply_finite(grads, var_list)
    else:
      apply_op = self._opt.apply_gradients(list(zip(grads, var_list)))
    zeros = []
    if self._nonfinite_policy:
      with tf.control_dependencies([apply_op]):
        zeros.append(self._good_micro_batches.assign(0, read_value=False))
    # One dense accumulator at a time: each one's zeros are allocated after
    # the previous accumulator's old buffer is freed, so the apply step holds
    # at most one variable's worth of new zeros (all at once: 1x the
    # parameter bytes, the peak of the step; tools/benchmark.py).
    previous = apply_op
    for accumulator, grad in zip(accumulators, grads):
      if isinstance(grad, tf.IndexedSlices):
        with tf.control_dependencies([apply_op]):
          zeros.append(accumulator.scatter_update(
              tf.IndexedSlices(tf.zeros_like(grad.values), grad.indices)))
      else:
        with tf.control_dependencies([previous]):
          previous = accumulator.assign(_unfoldable_zeros(accumulator),
                                        read_value=False)
        zeros.append(previous)
    return tf.group(*zeros)

  def _clip(self, grads):
    """Clips the accumulated gradients to `clip_norm`, by their global norm.

    Under a multi-replica strategy each replica holds its part of the sum;
    the norm is that of the whole sum, so the parts are all-reduced first,
    and each replica hands on 1/replicas of the clipped sum for the wrapped
    optimizer's own all-reduce to add up.
    """
    replica_context = tf.distribute.get_replica_context()
    replicas = replica_context.num_replicas_in_sync
    if replicas > 1:
      # identity: reads of ref variables (v1 behaviour) are ref tensors, which
      # all_reduce would take for the variables themselves.
      grads = [tf.identity(tf.convert_to_tensor(g)) for g in grads]
      grads = replica_context.all_reduce(
          tf.distribute.ReduceOp.SUM, grads)
    clipped, _ = tf.clip_by_global_norm(grads, self._clip_norm)
    if replicas > 1:
      clipped = [g / replicas for g in clipped]
    return clipped

  def _apply_finite(self, grads, var_list):
    """Applies the mean of the cycle's finite micro-batches, per the policy."""
    good = self._good_micro_batches.read_value()
    if self._nonfinite_policy == 'skip_micro_batch':
      apply_now = good > 0
      # The accumulators hold sum / grad_steps over the good micro-batches.
      scale = self._grad_steps / tf.maximum(good, 1)
      grads = [_map_values(g, lambda x: x * tf.cast(scale, x.dtype))
               for g in grads]
    else:
      apply_now = tf.equal(good, self._grad_steps)
    return self._cond(
        apply_now,
        lambda: self._opt.apply_gradients(list(zip(grads, var_list))),
        lambda: self.skipped_cycles.assign_add(1, read_value=False))

  def _apply_on_cycle_end(self, distribution, accumulate, var_list, sparse,
                          step, wrapped_vars_scope, scope):
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
      def apply_and_advance():
        applied = distribution.extended.call_for_each_replica(
            self._apply_and_zero_for_each_replica, args=(var_list, sparse))
        with tf.control_dependencies(
            distribution.experimental_local_results(applied)):
          return self._advance(step, step_value)

      # Both branches advance the step, so the predicate's read of the step
      # is ordered before its write.
      return self._cond(
          self._is_cycle_end(step_value), apply_and_advance,
          lambda: self._advance(step, step_value))

  def _cond(self, pred, true_fn, false_fn):
    """`tf.cond` whose v2 `If` op is not lowered to Switch/Merge."""
    graph = tf.compat.v1.get_default_graph()
    ops_before = graph.get_operations()
    result = tf.cond(pred, true_fn, false_fn)
    compat.run_cond_as_function(graph, ops_before)
    return result

  def _apply_on_tpu(self, accumulate, var_list, sparse, global_step):
    """TPU path: decide on `update_count`, read before it is incremented."""
    with tf.control_dependencies([accumulate]):
      count = self._counter.read_value()
    applied = self._cond(
        self._is_cycle_end(count),
        lambda: self._apply_and_zero_for_each_replica(var_list, sparse),
        tf.no_op)
    # The original incremented the counter beside the tf.cond that read it,
    # with no order between the two: a race under resource variables.
    with tf.control_dependencies([applied]):
      advances = [self._advance(self._counter, count)]
      if global_step is not None:
        advances.append(self._advance(global_step, None))
    return tf.group(*advances)

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
    for own in (self._counter, self._good_micro_batches,
                self.skipped_micro_batches, self.skipped_cycles):
      if (own is not None and
          getattr(own, 'graph', None) is tf.compat.v1.get_default_graph()):
        variables.append(own)
    return sorted(variables, key=lambda v: v.name)
