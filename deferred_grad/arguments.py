"""Checks of the wrapper's arguments; each error names the argument."""

import numbers

import numpy as np
import six

from deferred_grad import compat

tf = compat.import_tensorflow()


def _require(ok, expected, value, error=TypeError):
  """`value` if `ok`, else raises `error` naming `expected` and `value`."""
  if not ok:
    raise error('%s, got %r of type %s.' % (expected, value,
                                             type(value).__name__))
  return value


def _is_int(value):
  """True for an int (also a numpy integer), False for a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(value, arg_name, expected=None):
  """Returns `value` as an int, or raises naming `arg_name`.

  Args:
    value, arg_name: the argument's value and name.
    expected: the message's text (default: a positive int).

  Raises:
    TypeError: not an int (a bool is refused).
    ValueError: not positive.
  """
  expected = expected or '%s must be a positive int' % arg_name
  _require(_is_int(value), expected, value)
  return int(_require(value >= 1, expected, value, ValueError))


NONFINITE_POLICIES = (None, 'skip_micro_batch', 'skip_cycle')
AGGREGATIONS = ('mean', 'sum')
GLOBAL_STEP_COUNTS = ('micro_steps', 'updates')

_GRAD_STEPS_EXPECTED = (
    'grad_steps must be a positive int, a scalar integer tensor or a callable '
    'of the number of updates applied (an int64 tensor) returning one')


def check_grad_steps(grad_steps):
  """Returns `grad_steps`: an int, or a schedule read once per cycle.

  Args:
    grad_steps: an int, an integer scalar tensor, or a callable.

  Raises:
    TypeError: none of these (a bool, float or string is refused).
    ValueError: below 1, or a tensor that is not a scalar.
  """
  if tf.is_tensor(grad_steps):
    return check_schedule_value(grad_steps, 'a tensor')
  if callable(grad_steps):
    return grad_steps
  return check_positive_int(grad_steps, 'grad_steps', _GRAD_STEPS_EXPECTED)


def check_schedule_value(value, source):
  """Returns a schedule's cycle length as an integer scalar tensor.

  Args:
    value: a tensor, or the number a callable returned.
    source: where it came from, for the message.

  Raises:
    TypeError: not of an integer dtype.
    ValueError: not a scalar, or a constant below 1.
  """
  gave = '%s; %s gave ' % (_GRAD_STEPS_EXPECTED, source)
  if not (tf.is_tensor(value) or _is_int(value)):
    raise TypeError(gave + '%r of type %s.' % (value, type(value).__name__))
  value = tf.convert_to_tensor(value)
  if not value.dtype.is_integer:
    raise TypeError(gave + 'one of dtype %s: %r.' % (value.dtype.name, value))
  if value.shape.rank not in (None, 0):
    raise ValueError(gave + 'one of shape %s: %r.' % (value.shape, value))
  constant = tf.get_static_value(value)
  if constant is not None and constant < 1:
    raise ValueError(gave + '%d.' % constant)
  return value


def check_bool(value, arg_name):
  """Returns `value` if it is a bool, else raises naming `arg_name`.

  Raises:
    TypeError: not a bool (a truthy string such as 'False' is refused).
  """
  return _require(isinstance(value, bool), arg_name + ' must be a bool', value)


# SyncReplicasOptimizer aggregates gradients across workers round by round on
# the chief and drops stale ones: its rounds would not match the cycles.
_SYNC_REPLICAS = (
    'SyncReplicasOptimizer does not compose with '
    'GradientAggregationOptimizer: its rounds would not match the cycles. On '
    'parameter servers each worker accumulates on its own without it '
    '(tools/examples/parameter_server_example.py); for synchronous training '
    'use MultiWorkerMirroredStrategy (tools/examples/multi_worker_example.py).')

# The ops by which SyncReplicasOptimizer hands its wrapped optimizer the
# gradients aggregated across workers.
_AGGREGATED = ('AccumulatorTakeGradient', 'ResourceAccumulatorTakeGradient',
               'SparseAccumulatorTakeGradient')


def check_optimizer(opt):
  """Returns `opt` if it is a `tf.compat.v1.train.Optimizer`, else raises.

  Raises:
    TypeError: not such an optimizer, or a `SyncReplicasOptimizer`.
  """
  if isinstance(opt, tf.compat.v1.train.SyncReplicasOptimizer):
    raise TypeError('opt is a SyncReplicasOptimizer. ' + _SYNC_REPLICAS)
  return _require(isinstance(opt, tf.compat.v1.train.Optimizer),
                  'opt must be a tf.compat.v1.train.Optimizer (e.g. '
                  'tf.compat.v1.train.AdamOptimizer; a Keras 2 legacy '
                  'optimizer for model.fit goes to '
                  'deferred_grad.keras_optimizer)', opt)


def check_accumulator_dtype(dtype):
  """Returns `dtype` (`accumulator_dtype`) as None or a float `tf.DType`.

  Raises:
    TypeError: not a dtype.
    ValueError: not a float dtype.
  """
  if dtype is None:
    return None
  expected = 'accumulator_dtype must be None or a float dtype, e.g. tf.float32'
  try:
    dtype = tf.as_dtype(dtype)
  except TypeError:
    raise TypeError('%s, got %r.' % (expected, dtype))
  return _require(dtype.is_floating, expected, dtype, ValueError)


def check_accumulator_width(dtype, variable):
  """Refuses a `dtype` (`accumulator_dtype`) narrower than `variable`'s.

  Raises:
    ValueError: `dtype` is neither None, the variable's dtype nor wider.
  """
  own = variable.dtype.base_dtype
  if dtype is not None and dtype != own and dtype.size <= own.size:
    raise ValueError(
        'accumulator_dtype=%s cannot hold the gradients of %s, whose dtype is '
        '%s, as precisely: pass None (the variable\'s dtype) or a wider float '
        'dtype (tf.float32 for float16 or bfloat16 variables).' %
        (dtype.name, variable.name, own.name))


def check_clip_norm(clip_norm):
  """Returns `clip_norm`, or None (no clipping) for None or inf.

  Raises:
    TypeError: neither None nor a real number (a bool is refused).
    ValueError: not positive.
  """
  if clip_norm is None:
    return None
  expected = 'clip_norm must be None or a positive number'
  _require(isinstance(clip_norm, numbers.Real) and
           not isinstance(clip_norm, bool), expected, clip_norm)
  _require(clip_norm > 0, expected, clip_norm, ValueError)
  # No norm exceeds inf; tf.clip_by_global_norm would scale by inf * 0: NaN.
  return None if np.isinf(clip_norm) else clip_norm


def check_graph_mode(method):
  """Raises unless in TensorFlow 1 style graph mode, naming `method`.

  Raises:
    RuntimeError: eager execution, or inside a `tf.function`.
  """
  if tf.compat.v1.executing_eagerly_outside_functions():
    keras = compat.keras_major_version()
    alternative = (
        'the Keras 3 optimizers of this TensorFlow offer '
        'gradient_accumulation_steps there' if keras >= 3 else
        'the Keras %d optimizers of TensorFlow %s have no gradient '
        'accumulation: sum the gradients of a tf.GradientTape yourself, or '
        'use TensorFlow 2.16 or later (Keras 3 optimizers take '
        'gradient_accumulation_steps)' % (keras, tf.__version__))
    raise RuntimeError(
        'GradientAggregationOptimizer.%s needs TensorFlow 1 style graph mode: '
        'call tf.compat.v1.disable_eager_execution() (or '
        'disable_v2_behavior()) at program start. Eager execution and '
        'tf.function are not supported; %s.' % (method, alternative))


def check_choice(value, choices, arg_name):
  """Returns `value` if it is one of `choices`, else raises naming `arg_name`.

  Raises:
    ValueError: not one of `choices`.
  """
  allowed = any(value is choice or (value is not None and value == choice)
                for choice in choices)
  return _require(allowed, '%s must be one of %s' % (arg_name, choices),
                  value, ValueError)


def check_micro_batch_weight(micro_batch_weight):
  """Returns `micro_batch_weight`, or raises naming it.

  Raises:
    TypeError: neither None, a tensor nor a callable.
  """
  return _require(
      micro_batch_weight is None or callable(micro_batch_weight) or
      tf.is_tensor(micro_batch_weight),
      'micro_batch_weight must be None, a scalar tensor (e.g. the '
      'micro-batch\'s token count) or a callable returning one',
      micro_batch_weight)


_WEIGHT_EXPECTED = ('micro_batch_weight must be a finite number >= 0 (e.g. '
                    'the token count of the micro-batch)')


def weight_tensor(micro_batch_weight):
  """Returns this micro-step's weight as a float64 scalar, or None.

  A callable is called here, on each replica. Weights unknown at graph build
  are checked at run time, by `check_weight_value`.

  Args:
    micro_batch_weight: None, a tensor, or a callable returning one.

  Raises:
    TypeError: not of an int or float dtype.
    ValueError: not a scalar, or a constant that is negative, NaN or inf.
  """
  if micro_batch_weight is None:
    return None
  weight = tf.convert_to_tensor(micro_batch_weight() if callable(
      micro_batch_weight) else micro_batch_weight)
  if not (weight.dtype.is_floating or weight.dtype.is_integer):
    raise TypeError('%s; got a tensor of dtype %s: %r.' %
                    (_WEIGHT_EXPECTED, weight.dtype.name, weight))
  if weight.shape.rank not in (None, 0):
    raise ValueError('micro_batch_weight must be a scalar, got shape %s.' %
                     (weight.shape,))
  value = tf.get_static_value(weight)
  if value is not None and not (np.isfinite(value) and value >= 0):
    raise ValueError('%s; got %s.' % (_WEIGHT_EXPECTED, value.item()))
  # float64 holds float weights and integer counts below 2**53 exactly.
  return tf.cast(weight, tf.float64)


def check_weight_value(weight, nonfinite_policy):
  """Returns [an op failing the micro-step of an invalid weight], or [].

  Invalid: negative, or NaN or inf without a `nonfinite_policy` (which skips
  those); the cycle would silently apply nothing or NaN.

  Args:
    weight: the micro-step's weight, a float64 scalar, or None.
    nonfinite_policy: the wrapper's keyword.
  """
  if weight is None or compat.in_xla_context():  # XLA drops Asserts
    return []
  finite = tf.math.is_finite(weight)
  valid = tf.logical_and(weight >= 0, finite)
  if nonfinite_policy:  # it skips the micro-batch of a NaN or inf weight
    valid = tf.logical_or(valid, tf.logical_not(finite))
  return [tf.debugging.Assert(
      valid, ['GradientAggregationOptimizer: %s%s; at this micro-step it is' % (
          _WEIGHT_EXPECTED, ' (a NaN or inf one is skipped by the '
          'nonfinite_policy)' if nonfinite_policy else ''), weight])]


def check_apply_gradients(grads_and_vars, global_step, name,
                          replica_context, use_tpu, apply_crs_to_grad,
                          accumulator_dtype=None):
  """Checks `apply_gradients`' arguments.

  Args:
    grads_and_vars, global_step, name: `apply_gradients`' arguments.
    replica_context: the call's replica context (None: cross-replica).
    use_tpu, apply_crs_to_grad, accumulator_dtype: the wrapper's keywords.

  Returns:
    The (gradient, variable) pairs with a gradient, each variable once.

  Raises:
    RuntimeError: eager mode or a `tf.function`; see `check_replicas`.
    NotImplementedError: a gradient's variable is not a `tf.Variable`.
    TypeError: a bad `global_step`, `name`, gradient or gradient dtype.
    ValueError: see `check_replicas`; no gradients, or ones from a
      `SyncReplicasOptimizer`; `apply_crs_to_grad` off TPU; a narrow
      `accumulator_dtype`.
  """
  check_graph_mode('apply_gradients')
  grads_and_vars = tuple(grads_and_vars)
  if not grads_and_vars:
    raise ValueError('No variables provided.')
  _require(global_step is None or isinstance(global_step, tf.Variable),
           'global_step must be None or a tf.Variable', global_step)
  _require(name is None or isinstance(name, six.string_types),
           'name must be None or a string', name)
  present = [_checked_pair(index, g, v)
             for index, (g, v) in enumerate(grads_and_vars) if g is not None]
  if any(getattr(g, 'values', g).op.type in _AGGREGATED for g, _ in present):
    raise ValueError('GradientAggregationOptimizer is wrapped by a '
                     'SyncReplicasOptimizer. ' + _SYNC_REPLICAS)
  if not present:
    raise ValueError('No gradients provided for any variable: %s.' %
                     ([v.name for _, v in grads_and_vars],))
  check_replicas(replica_context, use_tpu)
  if apply_crs_to_grad and not compat.in_xla_context():
    # Built for a CPU or GPU, cross_replica_sum would fail at the first
    # session.run with "No registered 'CrossReplicaSum' OpKernel".
    raise ValueError(
        'apply_crs_to_grad=True calls tf.compat.v1.tpu.cross_replica_sum, '
        'which runs only inside a TPU computation (TPUEstimator(use_tpu=True), '
        'tf.compat.v1.tpu.rewrite), not on a CPU or GPU: pass '
        'apply_crs_to_grad=False (or the use_tpu given to TPUEstimator).')
  for _, variable in present:
    check_accumulator_width(accumulator_dtype, variable)
  return sum_duplicates(present)


def _checked_pair(index, gradient, variable):
  """(`gradient` as a Tensor or IndexedSlices, `variable`), or raises where
  the bare optimizer would: the accumulator's cast would hide a wrong dtype.
  """
  if not isinstance(variable, tf.Variable):
    raise NotImplementedError(
        'grads_and_vars[%d]: apply_gradients updates variables; got %r of '
        'type %s.' % (index, variable, type(variable).__name__))
  try:
    gradient = tf.compat.v1.convert_to_tensor_or_indexed_slices(gradient)
  except (TypeError, ValueError):
    raise TypeError('grads_and_vars[%d]: the gradient of %s must be None or '
                    'convertible to a Tensor or IndexedSlices, got %r.' %
                    (index, variable.name, gradient))
  dtype, own = gradient.dtype.base_dtype.name, variable.dtype.base_dtype.name
  if dtype != own:
    raise TypeError('grads_and_vars[%d]: the gradient of %s has dtype %s; '
                    'expected %s, the variable\'s.' %
                    (index, variable.name, dtype, own))
  return gradient, variable


def sum_duplicates(pairs):
  """Returns `pairs` with each variable once, in first-seen order.

  A variable listed twice (the `compute_gradients` lists of two losses
  joined) gets its gradients' sum, accumulated once.
  """
  summed = {}  # by `variable.ref()`, in the order of first insertion
  for gradient, variable in pairs:
    if variable.ref() in summed:
      gradient = _add(summed[variable.ref()][0], gradient)
    summed[variable.ref()] = (gradient, variable)
  return list(summed.values())


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
    replica_context: the call's replica context (None: cross-replica).
    use_tpu: the wrapper's keyword.
    method: the name of the method called, for the message.

  Raises:
    RuntimeError: the GPU path in a cross-replica context, or the
      multi-worker `ParameterServerStrategy` of `tf.compat.v1.distribute`.
    ValueError: the TPU path under several replicas.
  """
  strategy = tf.distribute.get_strategy()
  parameter_servers = tuple(
      getattr(module, 'ParameterServerStrategy') for module in (
          tf.compat.v1.distribute.experimental, tf.distribute.experimental)
      if hasattr(module, 'ParameterServerStrategy'))
  if isinstance(strategy, parameter_servers) and any(
      tf.DeviceSpec.from_string(device).job not in (None, 'localhost')
      for device in getattr(strategy.extended, 'parameter_devices', ())):
    # It places every variable, the accumulators and counters included, on
    # the ps tasks: all workers would add into one accumulator and count
    # one cycle (see `distribute.worker_local` for the layout that works).
    raise RuntimeError(
        'GradientAggregationOptimizer does not support %s with parameter '
        'servers: use tf.compat.v1.train.replica_device_setter instead, as an '
        'Estimator with ps tasks in TF_CONFIG and no train_distribute does '
        '(tools/examples/parameter_server_example.py).' %
        type(strategy).__name__)
  if use_tpu and strategy.num_replicas_in_sync > 1:
    # The TPU path applies inside its tf.cond, where the wrapped optimizer's
    # merge_call (the strategy's all-reduce) cannot run.
    raise ValueError(
        'use_tpu=True under %s with %d replicas: the TPU path cannot '
        'all-reduce the gradients inside its tf.cond. Use use_tpu=False '
        'under a multi-replica strategy (on TPUs, TPUEstimator(use_tpu=True) '
        'and GradientAggregationOptimizer(use_tpu=True) with no strategy).' %
        (type(strategy).__name__, strategy.num_replicas_in_sync))
  if not use_tpu and replica_context is None:
    raise RuntimeError(
        'GradientAggregationOptimizer.%s (and minimize) must be called in a '
        'replica context: under a tf.distribute strategy, call it inside the '
        'function you pass to strategy.extended.call_for_each_replica (or '
        'strategy.run), not directly under strategy.scope().' % method)


def check_name(name):
  """Returns `name`, the optimizer's, or raises naming it.

  Raises:
    TypeError: not a non-empty string.
  """
  return _require(isinstance(name, six.string_types) and name,
                  'name must be a non-empty string (the name scope of the '
                  'ops apply_gradients makes)', name)
