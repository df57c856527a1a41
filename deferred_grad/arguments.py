"""Checks of the wrapper's arguments: each error names the argument and value."""

import numbers

import numpy as np
import six

from deferred_grad import compat

tf = compat.import_tensorflow()


def check_positive_int(value, arg_name):
  """Returns `value` as an int, or raises naming `arg_name`.

  Args:
    value: the argument's value.
    arg_name: its name, for the message.

  Returns:
    `value` as an int.

  Raises:
    TypeError: not an int (a bool, a float and a string are refused).
    ValueError: not positive.
  """
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError('%s must be a positive int, got %r of type %s.' %
                    (arg_name, value, type(value).__name__))
  if value < 1:
    raise ValueError('%s must be a positive int, got %r.' % (arg_name, value))
  return int(value)


NONFINITE_POLICIES = (None, 'skip_micro_batch', 'skip_cycle')
AGGREGATIONS = ('mean', 'sum')

_GRAD_STEPS_EXPECTED = (
    'grad_steps must be a positive int, a scalar integer tensor or a callable '
    'of the number of updates applied (an int64 tensor) returning one')


def check_grad_steps(grad_steps):
  """Returns `grad_steps` as an int, or as a schedule (a tensor or callable).

  An int (also a numpy integer) keeps the original's fixed cycle; a tensor
  or a callable is a schedule, read once per cycle (see `records.Schedule`).

  Args:
    grad_steps: the constructor's argument.

  Returns:
    An int, an int64 scalar tensor or the callable.

  Raises:
    TypeError: neither an int, an integer tensor nor a callable (a bool, a
      float and a string are refused).
    ValueError: a non-positive int, a tensor that is not a scalar, or a
      constant tensor below 1.
  """
  if callable(grad_steps) and not tf.is_tensor(grad_steps):
    return grad_steps
  if tf.is_tensor(grad_steps):
    return check_schedule_value(grad_steps, 'a tensor')
  if isinstance(grad_steps, bool) or not isinstance(grad_steps,
                                                    numbers.Integral):
    raise TypeError('%s; got %r of type %s.' % (
        _GRAD_STEPS_EXPECTED, grad_steps, type(grad_steps).__name__))
  return check_positive_int(grad_steps, 'grad_steps')


def check_schedule_value(value, source):
  """Returns a cycle length of a `grad_steps` schedule as an int64 scalar.

  Args:
    value: what the schedule gave (a tensor, or a number from a callable).
    source: how the value was made, for messages ('a tensor', 'the callable').

  Returns:
    The value as an integer tensor.

  Raises:
    TypeError: not of an integer dtype.
    ValueError: not a scalar, or a constant below 1.
  """
  if isinstance(value, bool) or not (
      tf.is_tensor(value) or isinstance(value, numbers.Integral)):
    raise TypeError('%s; %s gave %r of type %s.' % (
        _GRAD_STEPS_EXPECTED, source, value, type(value).__name__))
  value = tf.convert_to_tensor(value)
  if not value.dtype.is_integer:
    raise TypeError('%s; %s gave a tensor of dtype %s: %r.' % (
        _GRAD_STEPS_EXPECTED, source, value.dtype.name, value))
  if value.shape.rank not in (None, 0):
    raise ValueError('%s; %s gave one of shape %s: %r.' % (
        _GRAD_STEPS_EXPECTED, source, value.shape, value))
  constant = tf.get_static_value(value)
  if constant is not None and constant < 1:
    raise ValueError('%s; %s gave %d.' % (_GRAD_STEPS_EXPECTED, source,
                                           constant))
  return value


def check_bool(value, arg_name):
  """Returns `value`, or raises a TypeError naming `arg_name`.

  Args:
    value: the argument's value.
    arg_name: its name, for the message.

  Returns:
    `value`.

  Raises:
    TypeError: `value` is not a bool.
  """
  # A string such as 'False' is truthy: refuse it rather than guess.
  if not isinstance(value, bool):
    raise TypeError('%s must be a bool, got %r of type %s.' %
                    (arg_name, value, type(value).__name__))
  return value


_SYNC_REPLICAS = (
    'SyncReplicasOptimizer does not compose with GradientAggregationOptimizer: '
    'it aggregates gradients across workers round by round on the chief and '
    'drops stale ones, so cycles of micro-batches would not match. On '
    'parameter servers each worker already accumulates its own micro-batches '
    '(tools/examples/parameter_server_example.py); for synchronous training '
    'across workers use MultiWorkerMirroredStrategy '
    '(tools/examples/multi_worker_example.py).')


def check_optimizer(opt):
  """Raises a TypeError unless `opt` is a `tf.compat.v1.train.Optimizer`.

  `SyncReplicasOptimizer` is refused too (see `check_not_synced`).

  Args:
    opt: the constructor's `opt`.

  Returns:
    `opt`.

  Raises:
    TypeError: `opt` is not a `tf.compat.v1.train.Optimizer`, or is a
      `SyncReplicasOptimizer`.
  """
  if not isinstance(opt, tf.compat.v1.train.Optimizer):
    raise TypeError(
        'opt must be a tf.compat.v1.train.Optimizer (e.g. '
        'tf.compat.v1.train.AdamOptimizer), got %r of type %s.' %
        (opt, type(opt).__name__))
  if isinstance(opt, tf.compat.v1.train.SyncReplicasOptimizer):
    raise TypeError('opt is a ' + _SYNC_REPLICAS)
  return opt


# The ops by which SyncReplicasOptimizer hands its wrapped optimizer the
# gradients aggregated across workers.
_AGGREGATED = ('AccumulatorTakeGradient', 'ResourceAccumulatorTakeGradient',
               'SparseAccumulatorTakeGradient')


def check_not_synced(gradients):
  """Raises a ValueError if `gradients` come from a SyncReplicasOptimizer.

  Args:
    gradients: the gradients given to `apply_gradients` (None skipped).
  """
  for gradient in gradients:
    tensor = getattr(gradient, 'values', gradient)
    if tensor is not None and tensor.op.type in _AGGREGATED:
      raise ValueError('GradientAggregationOptimizer is wrapped by a ' +
                       _SYNC_REPLICAS)


def check_accumulator_dtype(dtype):
  """Returns None or a float `tf.DType`, or raises naming the argument.

  Args:
    dtype: `accumulator_dtype`: None, or anything `tf.as_dtype` takes.

  Returns:
    None, or a float `tf.DType`.

  Raises:
    TypeError: not a dtype.
    ValueError: not a float dtype.
  """
  if dtype is None:
    return None
  try:
    dtype = tf.as_dtype(dtype)
  except TypeError:
    raise TypeError('accumulator_dtype must be None or a float dtype such '
                    'as tf.float32, got %r.' % (dtype,))
  if not dtype.is_floating:
    raise ValueError('accumulator_dtype must be None or a float dtype, '
                     'got %r.' % (dtype,))
  return dtype


def check_accumulator_width(dtype, variable):
  """Refuses an `accumulator_dtype` narrower than `variable`'s dtype.

  Args:
    dtype: the `accumulator_dtype` (a float `tf.DType`), or None.
    variable: a variable that gets an accumulator.

  Raises:
    ValueError: `dtype` is neither the variable's dtype nor wider.
  """
  own = variable.dtype.base_dtype
  if dtype is None or dtype == own or dtype.size > own.size:
    return
  raise ValueError(
      'accumulator_dtype=%s cannot hold the gradients of %s, whose dtype is '
      '%s: the sum would be kept in less precision than the variable. Pass '
      'None (the variable\'s dtype) or a wider float dtype, e.g. '
      'tf.float32 for float16 or bfloat16 variables.' %
      (dtype.name, variable.name, own.name))


def check_clip_norm(clip_norm):
  """Returns None or a positive number, or raises naming the argument.

  Args:
    clip_norm: the constructor's `clip_norm`.

  Returns:
    `clip_norm`, or None for an infinite one.

  Raises:
    TypeError: neither None nor a real number (a bool is refused).
    ValueError: not positive.
  """
  if clip_norm is None:
    return None
  if isinstance(clip_norm, bool) or not isinstance(clip_norm, numbers.Real):
    raise TypeError('clip_norm must be None or a positive number, got %r '
                    'of type %s.' % (clip_norm, type(clip_norm).__name__))
  if not clip_norm > 0:
    raise ValueError('clip_norm must be None or a positive number, got '
                     '%r.' % (clip_norm,))
  if np.isinf(clip_norm):
    # No norm exceeds it: no clipping (tf.clip_by_global_norm would scale
    # by inf * 0, NaN, and train every weight to NaN).
    return None
  return clip_norm


def check_graph_mode(method):
  """Raises a RuntimeError in eager mode or inside a `tf.function`.

  Args:
    method: the name of the method called, for the message.

  Raises:
    RuntimeError: eager execution, or inside a `tf.function`.
  """
  if tf.compat.v1.executing_eagerly_outside_functions():
    if compat.keras_major_version() >= 3:
      alternative = ('the Keras 3 optimizers of this TensorFlow offer '
                     'gradient_accumulation_steps there')
    else:
      alternative = (
          'the Keras %d optimizers of this TensorFlow (%s) have no gradient '
          'accumulation: add up the gradients of a tf.GradientTape '
          'yourself, or use TensorFlow 2.16 or later, whose Keras 3 '
          'optimizers take gradient_accumulation_steps' %
          (compat.keras_major_version(), tf.__version__))
    raise RuntimeError(
        'GradientAggregationOptimizer.%s needs TensorFlow 1 style graph mode: '
        'call tf.compat.v1.disable_eager_execution() (or '
        'disable_v2_behavior()) at program start. Eager execution and '
        'tf.function are not supported; %s.' % (method, alternative))


def check_cross_replica_sum(apply_crs_to_grad):
  """Refuses apply_crs_to_grad=True outside a TPU computation.

  `tf.compat.v1.tpu.cross_replica_sum` runs only inside a TPU computation
  (TPUEstimator(use_tpu=True), `tf.compat.v1.tpu.rewrite`); built for a CPU
  or GPU it fails at the first `session.run` with "No registered
  'CrossReplicaSum' OpKernel".

  Raises:
    ValueError: apply_crs_to_grad=True outside an XLA (TPU) computation.
  """
  if apply_crs_to_grad and not compat.in_xla_context():
    raise ValueError(
        'apply_crs_to_grad=True sums the accumulated gradients over TPU '
        'cores with tf.compat.v1.tpu.cross_replica_sum, which runs only '
        'inside a TPU computation (TPUEstimator(use_tpu=True), '
        'tf.compat.v1.tpu.rewrite); this train op is built outside one, for '
        'a CPU or GPU. Pass apply_crs_to_grad=False there, e.g. '
        'apply_crs_to_grad=use_tpu with the use_tpu you give TPUEstimator.')


def check_choice(value, choices, arg_name):
  """Returns `value` if it is one of `choices`, or raises naming `arg_name`.

  Args:
    value: the argument's value.
    choices: the values allowed.
    arg_name: its name, for the message.

  Returns:
    `value`.

  Raises:
    ValueError: `value` is not one of `choices`.
  """
  if not any(value is choice or (value is not None and value == choice)
             for choice in choices):
    raise ValueError('%s must be one of %s, got %r.' %
                     (arg_name, choices, value))
  return value


def check_micro_batch_weight(micro_batch_weight):
  """Returns `micro_batch_weight`, or raises a TypeError naming it.

  Args:
    micro_batch_weight: the constructor's argument.

  Returns:
    `micro_batch_weight`.

  Raises:
    TypeError: neither None, a tensor nor a callable.
  """
  if not (micro_batch_weight is None or callable(micro_batch_weight) or
          tf.is_tensor(micro_batch_weight)):
    raise TypeError(
        'micro_batch_weight must be None, a scalar tensor (e.g. the '
        'micro-batch\'s token count) or a callable returning one, got %r of '
        'type %s.' % (micro_batch_weight, type(micro_batch_weight).__name__))
  return micro_batch_weight


_WEIGHT_EXPECTED = ('micro_batch_weight must be a finite number >= 0 (e.g. '
                    'the token count of the micro-batch)')


def weight_tensor(micro_batch_weight):
  """This micro-step's weight as a float64 scalar, or None without weights.

  float64 holds every float weight and every integer count below 2**53
  exactly: the gradients and the cycle's counts take it in their dtypes.

  A callable is called here: in `apply_gradients`, on each replica. A value
  known at graph build is checked here; others at run time, by
  `check_weight_value`.

  Args:
    micro_batch_weight: None, a tensor, or a callable returning one.

  Returns:
    A float64 scalar tensor, or None.

  Raises:
    TypeError: the weight is not of a real number dtype (int or float).
    ValueError: the weight is not a scalar, or a constant that is negative,
      NaN or inf.
  """
  if micro_batch_weight is None:
    return None
  weight = (micro_batch_weight() if callable(micro_batch_weight) else
            micro_batch_weight)
  weight = tf.convert_to_tensor(weight)
  if not (weight.dtype.is_floating or weight.dtype.is_integer):
    raise TypeError('%s; got a tensor of dtype %s: %r.' %
                    (_WEIGHT_EXPECTED, weight.dtype.name, weight))
  if weight.shape.rank not in (None, 0):
    raise ValueError('micro_batch_weight must be a scalar, got shape %s.' %
                     (weight.shape,))
  value = tf.get_static_value(weight)
  if value is not None and not (np.isfinite(value) and value >= 0):
    raise ValueError('%s; got %s.' % (_WEIGHT_EXPECTED, value.item()))
  return tf.cast(weight, tf.float64)


def check_weight_value(weight, nonfinite_policy):
  """[An op failing the micro-step whose weight is negative], or [].

  Not finite too, without a `nonfinite_policy` (which skips such a
  micro-batch as non-finite).

  A negative token count, a NaN or an inf weight would otherwise make the
  cycle apply nothing or NaN without a word. Outside XLA only: an XLA
  computation (a TPU) compiles an Assert into nothing.

  Args:
    weight: the micro-step's weight, a float64 scalar, or None.
    nonfinite_policy: the wrapper's keyword.

  Returns:
    A list of at most one op (none without a weight, or inside XLA).
  """
  if weight is None or compat.in_xla_context():
    return []
  valid = weight >= 0
  if nonfinite_policy:
    valid = tf.logical_or(valid, tf.logical_not(tf.math.is_finite(weight)))
  else:
    valid = tf.logical_and(valid, tf.math.is_finite(weight))
  return [tf.debugging.Assert(
      valid, ['GradientAggregationOptimizer: %s%s; at this micro-step it is' % (
          _WEIGHT_EXPECTED, ' (a NaN or inf one is skipped by the '
          'nonfinite_policy)' if nonfinite_policy else ''), weight])]


def check_apply_gradients(grads_and_vars, global_step, name,
                          replica_context, use_tpu, apply_crs_to_grad,
                          accumulator_dtype=None):
  """Checks `apply_gradients`' arguments; returns the pairs with a gradient,
  each variable once (`sum_duplicates`).

  Args:
    grads_and_vars, global_step, name: `apply_gradients`' arguments.
    replica_context: where it was called (None: a cross-replica context).
    use_tpu, apply_crs_to_grad: the wrapper's keywords.
    accumulator_dtype: the wrapper's, where the train op accumulates.

  Returns:
    A list of (gradient, variable) pairs.

  Raises:
    RuntimeError: in eager mode or inside a `tf.function`; on the GPU path
      in a cross-replica context; under a multi-worker
      ParameterServerStrategy (see `check_replicas`).
    NotImplementedError: a pair with a gradient holds no `tf.Variable`.
    TypeError: `global_step` is not a `Variable`, or `name` not a string; a
      gradient is not convertible to a Tensor or IndexedSlices, or its dtype
      is not its variable's.
    ValueError: no pairs, or every gradient is None; or the gradients come
      from a `SyncReplicasOptimizer`; or `apply_crs_to_grad=True` outside a
      TPU computation; or `accumulator_dtype` is narrower than a
      variable's dtype.
  """
  check_graph_mode('apply_gradients')
  grads_and_vars = tuple(grads_and_vars)
  if not grads_and_vars:
    raise ValueError('No variables provided.')
  if global_step is not None and not isinstance(global_step, tf.Variable):
    raise TypeError('global_step must be None or a tf.Variable, got %r.' %
                    (global_step,))
  if name is not None and not isinstance(name, six.string_types):
    raise TypeError('name must be None or a string, got %r.' % (name,))
  present = [_checked_pair(index, g, v)
             for index, (g, v) in enumerate(grads_and_vars) if g is not None]
  check_not_synced([g for g, _ in present])
  if not present:
    raise ValueError('No gradients provided for any variable: %s.' %
                     ([v.name for _, v in grads_and_vars],))
  check_replicas(replica_context, use_tpu)
  check_cross_replica_sum(apply_crs_to_grad)
  present = sum_duplicates(present)
  for _, variable in present:
    check_accumulator_width(accumulator_dtype, variable)
  return present


def _checked_pair(index, gradient, variable):
  """(`gradient` as a Tensor or IndexedSlices, `variable`), or raises.

  The bare optimizer takes anything convertible (a list, a numpy array, a
  variable) and refuses a gradient of another dtype than its variable's;
  the wrapper would otherwise cast it into the accumulator and train.

  Args:
    index: the pair's place in `grads_and_vars`, for the message.
    gradient: its gradient, not None.
    variable: its variable.

  Returns:
    A (gradient, variable) pair.

  Raises:
    NotImplementedError: `variable` is not a `tf.Variable` (a Tensor, as
      `compute_gradients` may list, cannot be updated).
    TypeError: `gradient` is not convertible to a Tensor or IndexedSlices,
      or its dtype is not the variable's.
  """
  if not isinstance(variable, tf.Variable):
    raise NotImplementedError(
        'grads_and_vars[%d]: apply_gradients updates variables; got %r of '
        'type %s, which cannot be updated.' %
        (index, variable, type(variable).__name__))
  try:
    gradient = tf.compat.v1.convert_to_tensor_or_indexed_slices(gradient)
  except (TypeError, ValueError):
    raise TypeError(
        'grads_and_vars[%d]: the gradient of %s must be None or convertible '
        'to a Tensor or IndexedSlices, got %r.' %
        (index, variable.name, gradient))
  if gradient.dtype.base_dtype != variable.dtype.base_dtype:
    raise TypeError(
        'grads_and_vars[%d]: the gradient of %s has dtype %s; expected %s, '
        'the variable\'s.' % (index, variable.name,
                              gradient.dtype.base_dtype.name,
                              variable.dtype.base_dtype.name))
  return gradient, variable


def sum_duplicates(pairs):
  """The (gradient, variable) pairs with each variable once.

  A variable listed twice (the `compute_gradients` lists of two losses put
  end to end) gets the sum of its gradients: the gradient of the sum of
  the losses, which the cycle then accumulates once. Accumulated twice in
  one slot, each pair's apply would hand on both.

  Args:
    pairs: (gradient, variable) pairs, gradients not None.

  Returns:
    A list of (gradient, variable) pairs, each variable once, in the order
    of its first pair.
  """
  summed = []
  for gradient, variable in pairs:
    for index, (other, known) in enumerate(summed):
      if known is variable:
        summed[index] = (_add(other, gradient), variable)
        break
    else:
      summed.append((gradient, variable))
  return summed


def _add(a, b):
  """a + b for Tensors and IndexedSlices (an IndexedSlices if both are)."""
  if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
    ids = [tf.cast(part.indices, tf.int64) for part in (a, b)]
    return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                            tf.concat(ids, 0), a.dense_shape)
  return tf.add(*[tf.convert_to_tensor(part) for part in (a, b)])


def check_replicas(replica_context, use_tpu, method='apply_gradients'):
  """Refuses the contexts the code paths cannot serve.

  Args:
    replica_context: `tf.distribute.get_replica_context()` where `method`
      was called (None in a cross-replica context).
    use_tpu: the wrapper's keyword.
    method: the name of the method called, for the message.

  Raises:
    RuntimeError: the GPU path in a cross-replica context; or the
      multi-worker `ParameterServerStrategy` of `tf.compat.v1.distribute`.
    ValueError: the TPU path under a strategy of several replicas.
  """
  strategy = tf.distribute.get_strategy()
  if 'ParameterServerStrategy' in type(strategy).__name__ and any(
      tf.DeviceSpec.from_string(device).job not in (None, 'localhost')
      for device in getattr(strategy.extended, 'parameter_devices', ())):
    # It places every variable, the accumulators and counters included, on
    # the ps tasks: all workers would add into one accumulator and count
    # one cycle (see `distribute.worker_local` for the layout that works).
    raise RuntimeError(
        'GradientAggregationOptimizer does not support %s with parameter '
        'servers: it would place the accumulators on the ps tasks, shared by '
        'every worker, and train wrongly. Build the model under '
        'tf.compat.v1.train.replica_device_setter instead (an Estimator with '
        'ps tasks in TF_CONFIG and no train_distribute does): each worker '
        'then accumulates its own micro-batches '
        '(tools/examples/parameter_server_example.py).' %
        type(strategy).__name__)
  if use_tpu and strategy.num_replicas_in_sync > 1:
    # The TPU path applies inside its tf.cond, where the wrapped optimizer's
    # merge_call (the strategy's all-reduce) cannot run.
    raise ValueError(
        'use_tpu=True under %s with %d replicas: the TPU path applies inside '
        'a tf.cond, where the strategy cannot all-reduce the gradients. '
        'Under a multi-replica tf.distribute strategy use the GPU path, '
        'use_tpu=False (on TPUs, TPUEstimator(use_tpu=True) with '
        'GradientAggregationOptimizer(use_tpu=True) and no strategy).' %
        (type(strategy).__name__, strategy.num_replicas_in_sync))
  if not use_tpu and replica_context is None:
    raise RuntimeError(
        'GradientAggregationOptimizer.%s (and minimize) must be called in a '
        'replica context, not in a cross-replica context: under a '
        'tf.distribute strategy, call it inside the function you pass to '
        'strategy.extended.call_for_each_replica (or strategy.run), not '
        'directly under strategy.scope().' % method)


def check_name(name):
  """Returns `name`, the optimizer's, or raises a TypeError naming it.

  Args:
    name: the constructor's `name`.

  Returns:
    `name`.

  Raises:
    TypeError: not a non-empty string.
  """
  if not isinstance(name, six.string_types) or not name:
    raise TypeError('name must be a non-empty string (the name scope of the '
                    'ops apply_gradients makes), got %r.' % (name,))
  return name
