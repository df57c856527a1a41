"""TensorFlow versions, helpers over public APIs, and `PRIVATE_NAMES`.

Where no public API does the job, the package uses a private TensorFlow
name, listed in `PRIVATE_NAMES` with its reason; tests/test_private_names.py
fails on one used and not listed, or listed and no longer used.
"""

import re
import types
import warnings

from deferred_grad import registry

MIN_TF_VERSION = (2, 15)
MAX_TESTED_TF_VERSION = (2, 21)
TESTED_TF_RANGE = '2.15 to 2.21'
_INSTALL_HINT = (
    'Install one with `pip install "deferred_grad[tf]"` (or '
    '`"deferred_grad[tf-cpu]"` for the CPU-only build).')


def import_tensorflow():
  """Imports TensorFlow and checks that its version is supported.

  Returns:
    The `tensorflow` module.

  Raises:
    ImportError: TensorFlow is missing, older than 2.15, or its version
      does not begin with major.minor.
  """
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        'deferred_grad needs TensorFlow %s, but TensorFlow could not be '
        'imported (%s). %s' % (TESTED_TF_RANGE, e, _INSTALL_HINT))
  match = re.match(r'(\d+)\.(\d+)', tensorflow.__version__)
  version = match and (int(match.group(1)), int(match.group(2)))
  if not version or version < MIN_TF_VERSION:
    raise ImportError(
        'deferred_grad needs TensorFlow %s; found TensorFlow %s. %s' %
        (TESTED_TF_RANGE, tensorflow.__version__, _INSTALL_HINT))
  if version > MAX_TESTED_TF_VERSION:
    # Once per process (the default warnings filter shows a location once).
    warnings.warn(
        'deferred_grad is tested with TensorFlow %s; found TensorFlow %s, '
        'newer: it may work, but it has not been tested.' %
        (TESTED_TF_RANGE, tensorflow.__version__), stacklevel=2)
  return tensorflow


tf = import_tensorflow()

# Every private TensorFlow name the package uses, one line each: {name:
# (where, why)}; "the original's" where the original module used it too.
# Private: an attribute beginning with `_` on an object the package did not
# define (or a method of TensorFlow's it overrides), an undocumented
# attribute of TensorFlow's internal classes, a `tensorflow.` import, a raw
# op, and a private string TensorFlow reads. tests/test_private_names.py
# finds each in the syntax tree.
# pylint: disable=line-too-long
PRIVATE_NAMES = types.MappingProxyType({
    # The tf.compat.v1.train.Optimizer subclass API (slots, non-slot variables).
    '_create_slots': ('checkpoints', "the original's: the wrapped optimizer's slots, made outside the apply step's cond"),
    '_zeros_slot': ('accumulators', "the original's: an accumulator of a variable of unknown static shape"),
    '_get_or_make_slot_with_initializer': ('accumulators', 'an accumulator slot in accumulator_dtype, zeros made at run time'),
    '_restore_slot_variable': ('accumulators', "a table's list of rows restored from an object-based checkpoint"),
    '_non_slot_dict': ('checkpoints', "the wrapped optimizer's non-slot variables and keys, for their names under other settings"),
    # Object-based checkpoints: the wrapper shows the wrapped optimizer's state as its own.
    '_handle_deferred_dependencies': ('optimizer, checkpoints', 'a counter or non-slot variable restored before it was made'),
    '_trackable_children': ('checkpoints', "override: the wrapped optimizer's children and the wrapper's counters"),
    '_lookup_dependency': ('checkpoints', 'override: finds them by name'),
    '_create_or_restore_slot_variable': ('checkpoints', "override: slots restore into the wrapped optimizer's"),
    '_track_trackable': ('keras_fit', "the Keras optimizer's state in the Keras adapter's object-based checkpoints"),
    # Graph building.
    '_get_control_flow_context': ('compat', 'in_xla_context: no public test for an XLA computation (no mutex or Assert there)'),
    'IsXLAContext': ('compat', 'in_xla_context: the control flow context that is XLA'),
    'outer_context': ('compat', 'in_xla_context: the contexts around it'),
    'outer_graph': ('compat', 'the graph around a function graph (XLA, a v2 cond branch)'),
    'captures': ('compat, port_checks', "a function graph's captured tensors: a cond's resources, a read through a branch"),
    '_set_attr': ('compat', 'sets `_lower_using_switch_merge`'),
    '_lower_using_switch_merge': ('compat', 'an unlowered If runs only its taken branch: 5-11% faster cycles (CHANGELOG)'),
    'tensorflow.python.training': ('compat', 'GLOBAL_STEP_READ_KEY: a plain global_step read for hooks under MultiWorkerMirroredStrategy'),
    'tensorflow.python.compiler.xla.experimental': ('compat', "the original's XLA sharding helper, where TensorFlow moved it"),
    'tensorflow.compiler.xla.experimental.xla_sharding': ('compat', "the original's import of the same helper"),
    '_CHECKPOINTABLE_OBJECT_GRAPH': ('checkpoints', 'the object graph key, left out of a converted copy'),
    # Raw ops: no public function makes these.
    'Empty': ('accumulators', 'zeros made at run time, not a constant as large as the variable'),
    'VariableShape': ('accumulators', "a resource variable's shape without copying its value"),
    'DisableCopyOnRead': ('accumulators', 'after a scatter reset, reads stop copying the accumulator'),
    'ApplyGradientDescent': ('accumulators', 'a scaled gradient added in place to a ref variable, one kernel'),
    'ResourceApplyGradientDescent': ('accumulators', 'the same for a resource variable'),
    'MutexV2': ('records', "a train op's run lock, held for the whole run (tf.CriticalSection: one function)"),
    'MutexLock': ('records', 'takes the lock before the cycle is read'),
    'ConsumeMutexLock': ('records', 'releases it once the micro-step is counted'),
    'SaveV2': ('checkpoints', 'writes a converted copy from values (a Saver would hold a second copy of each)'),
})
# pylint: enable=line-too-long


def keras_major_version():
  """The major version of the Keras `tf.keras` is (2 on TF 2.15, 3 after)."""
  version = getattr(tf.keras, 'version', None)
  version = version() if callable(version) else getattr(
      tf.keras, '__version__', '2')
  return int(str(version).split('.')[0])


def import_xla_sharding():
  """TensorFlow's `xla_sharding` module: where TensorFlow moved it, else
  where the original module imported it from."""
  try:
    from tensorflow.python.compiler.xla.experimental import xla_sharding  # pylint: disable=g-import-not-at-top
  except ImportError:
    from tensorflow.compiler.xla.experimental.xla_sharding import xla_sharding  # pylint: disable=g-import-not-at-top
  return xla_sharding


def host_device(device):
  """The CPU of the task that `device` names ('' for no device): for what has
  no GPU kernel, so that it places also where soft placement is off."""
  spec = tf.DeviceSpec.from_string(device or '')
  return spec.replace(device_type='CPU', device_index=0).to_string()


def is_ref_variable(variable):
  """True for a reference (TF1, `disable_v2_behavior()`) variable."""
  return variable.dtype != variable.dtype.base_dtype


def cond(pred, true_fn, false_fn):
  """`tf.cond` that runs only the branch taken, on every run.

  A Python bool `pred` builds only its branch. In a session TensorFlow
  lowers an `If` to Switch and Merge ops, which push "dead" tensors through
  every op of the branch not taken: the apply branch, on grad_steps - 1 of
  grad_steps micro-steps. An unlowered `If` (private attribute
  `_lower_using_switch_merge`) runs on its resources' device, so it is
  unlowered only where they share one; where the attribute cannot be set,
  it stays lowered.
  """
  if isinstance(pred, bool):
    return true_fn() if pred else false_fn()
  if (not tf.compat.v1.control_flow_v2_enabled() or in_xla_context() or
      tf.distribute.has_strategy()):
    return tf.cond(pred, true_fn, false_fn)
  graph = tf.compat.v1.get_default_graph()
  before = len(graph.get_operations())
  result = tf.cond(pred, true_fn, false_fn)
  for op in graph.get_operations()[before:]:
    if op.type not in ('If', 'StatelessIf'):
      continue
    devices = set()
    for tensor in op.inputs:
      while tensor.dtype == tf.resource:  # to what a branch captured
        outer = None
        for captured, inner in getattr(tensor.graph, 'captures', ()):
          if inner is tensor:
            outer = captured
        if outer is None:
          devices.add(tensor.op.device)
          break
        tensor = outer
    if len(devices) <= 1:
      try:
        op._set_attr('_lower_using_switch_merge',  # pylint: disable=protected-access
                     tf.compat.v1.AttrValue(b=False))
      except (AttributeError, TypeError, ValueError):
        pass  # a TensorFlow without it: lowered, slower, right
  return result


def outermost_graph():
  """The default graph, or the outermost graph around a function graph."""
  graph = tf.compat.v1.get_default_graph()
  while getattr(graph, 'outer_graph', None) is not None:
    graph = graph.outer_graph
  return graph


def handles(variables):
  """Each variable's resource handle, None for a ref variable (the raw
  kernels on accumulators take one or the other)."""
  return [None if is_ref_variable(v) else v.handle for v in variables]


def replica_index():
  """This replica's index in its sync group (0 outside a replica context)."""
  context = tf.distribute.get_replica_context()
  return 0 if context is None else int(
      tf.get_static_value(context.replica_id_in_sync_group) or 0)


def replica_components(variables):
  """The variables a replica updates: its own components of mirrored ones,
  which the raw kernels used on accumulators need.

  Args:
    variables: variables, distributed or not.

  Returns:
    A list, in the order of `variables`.
  """
  strategy = tf.distribute.get_strategy()
  replica = replica_index()
  # A worker's components are its own replicas': across workers the id in
  # the sync group is worker * replicas per worker + the local index.
  return [components[replica % len(components)] for components in
          (strategy.experimental_local_results(v) for v in variables)]


def in_multi_worker_mode(strategy):
  """True under a strategy whose cluster has several tasks.

  Args:
    strategy: a `tf.distribute.Strategy`.

  Returns:
    A bool.
  """
  resolver = strategy.cluster_resolver
  return resolver is not None and sum(
      len(tasks) for tasks in resolver.cluster_spec().as_dict().values()) > 1


# ------------------------------------------------------- private names --

def in_xla_context():
  """True while building inside an XLA computation (a TPU rewrite,
  `xla.compile`), where only compilable ops may be made, or inside a
  function graph within one, which does not know it. No public API tells.

  Returns:
    A bool.
  """
  graph = tf.compat.v1.get_default_graph()
  while graph is not None:
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    while context is not None:
      if context.IsXLAContext():
        return True
      context = context.outer_context
    graph = getattr(graph, 'outer_graph', None)
  return False


def plain_global_step_read(global_step):
  """Gives hooks a read of `global_step` that needs no other worker.

  Hooks (`StopAtStepHook`, ...) fetch the read that `tf.compat.v1.train`
  caches, `cond(is_initialized, read, initial_value)`. Under
  `MultiWorkerMirroredStrategy` the initial value is broadcast from worker
  0, so each fetch runs a collective, and workers hang once one fetches it
  more often than another. This caches a plain read instead, unless
  TensorFlow moved the cache's key.

  Args:
    global_step: the global step variable given to `apply_gradients`.
  """
  try:
    # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
    from tensorflow.python.training import training_util
    # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
    key = training_util.GLOBAL_STEP_READ_KEY
  except (ImportError, AttributeError):
    return
  graph = tf.compat.v1.get_default_graph()
  cached = graph.get_collection_ref(key)
  known = registry.of(graph)
  if cached and known.plain_read is not None and cached[0] is known.plain_read:
    return
  # An absolute name scope (ending in '/'): the variable's, not the caller's.
  with tf.init_scope(), graph.name_scope(global_step.op.name + '/'):
    read_value = tf.identity(
        replica_components([global_step])[0].read_value(), name='plain_read')
  known.plain_read = read_value
  cached[:] = [read_value]
