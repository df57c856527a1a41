"""TensorFlow versions, small helpers over public APIs, three private names.

The package builds on TensorFlow's public API: beside the original module's
own internals (the wrapped optimizer's slot and non-slot functions, and the
`Trackable` methods a `tf.compat.v1.train.Optimizer` saves its state
through), the Saver's `saveable_object` and the XLA sharding helper the
original used, it reads three private names, all here. Two because no
public API does what they do and without them a build fails or a job hangs;
one for speed, measured:

* `in_xla_context`: `Graph._get_control_flow_context`. Inside an XLA
  computation (a TPU rewrite, `xla.compile`) only compilable ops may be
  made: no run lock (a mutex), no `Assert`, tables accumulated densely.
* `plain_global_step_read`: `training_util.GLOBAL_STEP_READ_KEY`, the graph
  collection that hooks read the global step from. Under
  `MultiWorkerMirroredStrategy` the read cached there by default runs a
  collective on every fetch, and hooks then hang the workers.
* `cond`: an `If`'s `_lower_using_switch_merge` attribute, set False where
  the `If`'s resources share a device, so that it runs as a function and
  only its taken branch runs. Lowered (TensorFlow's default), a micro-step
  that does not apply pushes dead tensors through the apply branch: 5-11%
  slower cycles on many small variables with Adam and 5-7% on a small
  table, measured side by side (CHANGELOG). Where TensorFlow refuses the
  attribute, the `If` stays lowered: slower, the same numbers.

Each is tested where it matters (tests/test_xla.py, the multi-worker tests,
tests/test_costs.py); tests/test_structure.py keeps other private names out
of the package.
"""

import re
import warnings

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
      does not begin with major.minor (as '2.21.0-rc1' does).
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


def keras_major_version():
  """The major version of the Keras `tf.keras` is (2 on TF 2.15, 3 after)."""
  version = getattr(tf.keras, 'version', None)
  version = version() if callable(version) else getattr(
      tf.keras, '__version__', '2')
  return int(str(version).split('.')[0])


def import_xla_sharding():
  """Returns TensorFlow's `xla_sharding` module wherever this build keeps it.

  The original module imported it from
  `tensorflow.compiler.xla.experimental.xla_sharding`, which TensorFlow later
  moved under `tensorflow.python.compiler`.
  """
  try:
    from tensorflow.python.compiler.xla.experimental import xla_sharding  # pylint: disable=g-import-not-at-top
  except ImportError:
    from tensorflow.compiler.xla.experimental.xla_sharding import xla_sharding  # pylint: disable=g-import-not-at-top
  return xla_sharding


def host_device(device):
  """The CPU of the task that `device` names (a string; '' for no device).

  For what has no GPU kernel (mutexes, a table's list of rows, bookkeeping),
  so that it also places where soft placement is off.
  """
  spec = tf.DeviceSpec.from_string(device or '')
  return spec.replace(device_type='CPU', device_index=0).to_string()


def is_ref_variable(variable):
  """True for a reference (TF1, `disable_v2_behavior()`) variable."""
  return variable.dtype != variable.dtype.base_dtype


def cond(pred, true_fn, false_fn):
  """`tf.cond` that runs only the branch taken, on every run.

  A Python bool `pred` (decided at graph build) builds the branch it names
  alone. In a session TensorFlow lowers a control flow v2 `If` into Switch
  and Merge ops, which push "dead" tensors through every op of the branch
  not taken, on every run: the cycle's apply branch holds a few ops per
  variable and is not taken on grad_steps - 1 of grad_steps micro-steps.
  Unlowered (the private attribute `_lower_using_switch_merge` False), the
  `If` runs the taken branch only, as a function. An unlowered `If` runs
  where its resources are, so only where they share one device (not under
  a strategy). Where the attribute cannot be set, it stays lowered.
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


def handles(variables):
  """Each variable's resource handle, None for a ref variable (the raw
  kernels on accumulators take one or the other)."""
  return [None if is_ref_variable(v) else v.handle for v in variables]


def replica_index():
  """This replica's index in its sync group (0 outside a replica context)."""
  context = tf.distribute.get_replica_context()
  return 0 if context is None else int(
      tf.get_static_value(context.replica_id_in_sync_group) or 0)


def local_variables(variables):
  """The variables a replica updates: its own components of mirrored ones.

  In a replica context, updates of a `MirroredVariable` whose aggregation is
  NONE (optimizer slots) go to the replica's own component; the raw kernels
  used on accumulators need that component itself.

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
  """True under a strategy whose cluster has several tasks (workers, or
  workers and parameter servers).

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
  `xla.compile`), where only XLA-compilable ops may be made.

  Also inside a function graph built within one (a control flow v2 branch),
  whose own graph knows nothing of the XLA context around it. TensorFlow
  has no public test for it (see the module docstring).

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

  Hooks (`StopAtStepHook`, `CheckpointSaverHook`, ...) fetch the tensor that
  `tf.compat.v1.train` caches for reading the global step:
  `cond(is_initialized, read, initial_value)`. Under
  `MultiWorkerMirroredStrategy` a variable's initial value is broadcast
  from worker 0, upstream of that `cond`, so every fetch of it runs a
  collective: when one worker makes one more such run than another, the
  workers' collectives no longer match and both hang. This caches a plain
  read instead. Where a TensorFlow moved the key, the cached read is left
  alone.

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
  reads = graph.get_collection_ref(('deferred_grad', 'plain_reads'))
  if cached and reads and cached[0] is reads[0]:
    return
  # An absolute name scope (ending in '/'): the variable's, not the caller's.
  with tf.init_scope(), graph.name_scope(global_step.op.name + '/'):
    read_value = tf.identity(local_variables([global_step])[0].read_value(),
                             name='plain_read')
  reads[:] = cached[:] = [read_value]
