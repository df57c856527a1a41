"""TensorFlow versions, and every private TensorFlow name the package uses.

Beside the original's own internals (the wrapped optimizer's slot
functions), TensorFlow's `xla_sharding` and the Saver's `saveable_object`,
the package reads TensorFlow's private names here only, each behind a
function whose public-API fallback gives the same numbers, at some cost:

| function                | private name                        | fallback (public) |
|-------------------------|-------------------------------------|-------------------|
| `handles`, `read`       | `_VarHandlesOp`, `_ReadVariablesOp` | one handle and one read per variable |
| `cond`                  | `If`'s `_lower_using_switch_merge`  | `tf.cond` as TensorFlow lowers it |
| `local_variables`       | `_get_on_device_or_primary`         | `experimental_local_results` |
| `in_multi_worker_mode`  | `extended._in_multi_worker_mode`    | the cluster resolver's tasks |
| `in_xla_context`        | `Graph._get_control_flow_context`   | never inside XLA |
| `one_variable_creator`  | `ref_variable.default_variable_creator` | none: the caller falls back |
| `plain_global_step_read`| `training_util.GLOBAL_STEP_READ_KEY`| the cached read left alone |
| `trackable_*`           | Trackable's extension points        | the wrapper shows no children |

Setting DEFERRED_GRAD_PUBLIC_API_ONLY=1 selects the fallbacks (the tests
run them). The measured gains are in README "Performance".
"""

import os
import re
import warnings

MIN_TF_VERSION = (2, 15)
MAX_TESTED_TF_VERSION = (2, 21)
TESTED_TF_RANGE = '2.15 to 2.21'
_INSTALL_HINT = (
    'Install one with `pip install "deferred_grad[tf]"` (or '
    '`"deferred_grad[tf-cpu]"` for the CPU-only build).')


def _parse_version(version):
  """Returns (major, minor) of a version string such as '2.21.0-rc1'."""
  match = re.match(r'(\d+)\.(\d+)', version)
  if not match:
    raise ImportError(
        'deferred_grad cannot read the installed TensorFlow version %r; it '
        'supports TensorFlow %s.' % (version, TESTED_TF_RANGE))
  return int(match.group(1)), int(match.group(2))


def import_tensorflow():
  """Imports TensorFlow and checks that its version is supported.

  Returns:
    The `tensorflow` module.

  Raises:
    ImportError: TensorFlow is missing or older than 2.15.
  """
  try:
    import tensorflow  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        'deferred_grad needs TensorFlow %s, but TensorFlow could not be '
        'imported (%s). %s' % (TESTED_TF_RANGE, e, _INSTALL_HINT))
  version = _parse_version(tensorflow.__version__)
  if version < MIN_TF_VERSION:
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


def public_api_only():
  """True where DEFERRED_GRAD_PUBLIC_API_ONLY asks for the fallbacks."""
  return os.environ.get('DEFERRED_GRAD_PUBLIC_API_ONLY', '') not in ('', '0')


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

  For what has no GPU kernel (mutexes, a list of rows shared by replicas, bookkeeping), so
  that it also places where soft placement is off.
  """
  spec = tf.DeviceSpec.from_string(device or '')
  return spec.replace(device_type='CPU', device_index=0).to_string()


def is_ref_variable(variable):
  """True for a reference (TF1, `disable_v2_behavior()`) variable."""
  return variable.dtype != variable.dtype.base_dtype


def variable_shape(variable):
  """A variable's shape as an int64 tensor, without reading its value.

  Static where known; else read where the variable is, for ref variables
  (TF1) and resource variables alike.
  """
  if variable.shape.is_fully_defined():
    return tf.constant(variable.shape.as_list(), tf.int64)
  if is_ref_variable(variable):
    return tf.shape(variable, out_type=tf.int64)
  return tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64)


# ------------------------------------------------------- private names --

def in_xla_context():
  """True while building inside an XLA computation (a TPU rewrite,
  `xla.compile`), where only XLA-compilable ops may be made.

  Also inside a function graph built within one (a control flow v2 branch),
  whose own graph knows nothing of the XLA context around it. Fallback:
  False (TensorFlow has no public test for it).

  Returns:
    A bool.
  """
  if public_api_only():
    return False
  graph = tf.compat.v1.get_default_graph()
  while graph is not None:
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    while context is not None:
      if context.IsXLAContext():
        return True
      context = context.outer_context
    graph = getattr(graph, 'outer_graph', None)
  return False


def in_multi_worker_mode(strategy):
  """True under a strategy whose replicas span several worker processes.

  Args:
    strategy: a `tf.distribute.Strategy`.

  Returns:
    A bool. Fallback: whether its cluster resolver names several tasks.
  """
  if not public_api_only():
    in_multi_worker = getattr(strategy.extended, '_in_multi_worker_mode',
                              None)
    if in_multi_worker is not None:
      return bool(in_multi_worker())
  resolver = getattr(strategy, 'cluster_resolver', None)
  if resolver is None:
    return False
  spec = resolver.cluster_spec().as_dict()
  return sum(len(spec.get(job, ())) for job in ('chief', 'worker')) > 1


def local_variables(variables):
  """The variables a replica updates: its own components of mirrored ones.

  In a replica context, updates of a `MirroredVariable` whose aggregation is
  NONE (optimizer slots) go to the replica's own component; the raw kernels
  used here need that component itself.

  Args:
    variables: variables, distributed or not.

  Returns:
    A list, in the order of `variables`.
  """
  if not public_api_only():
    return [getattr(v, '_get_on_device_or_primary', lambda v=v: v)()
            for v in variables]
  strategy = tf.distribute.get_strategy()
  context = tf.distribute.get_replica_context()
  replica = 0 if context is None else int(
      tf.get_static_value(context.replica_id_in_sync_group) or 0)
  # A worker's components are its own replicas': across workers the id in
  # the sync group is worker * replicas per worker + the local index.
  return [components[replica % len(components)] for components in
          (strategy.experimental_local_results(v) for v in variables)]


def _attrs(**values):
  """NodeDef attributes from Python values (ints, lists of them)."""
  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  from tensorflow.core.framework import attr_value_pb2
  # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
  attrs = {}
  for key, value in values.items():
    if isinstance(value, int):
      attrs[key] = attr_value_pb2.AttrValue(i=value)
    else:
      kind, items = value
      attrs[key] = attr_value_pb2.AttrValue(
          list=attr_value_pb2.AttrValue.ListValue(**{kind: items}))
  return attrs


def _has_gpu():
  """Whether this process sees a GPU (the placer may put variables there)."""
  return bool(tf.config.list_physical_devices('GPU'))


def _cpu_device(variable, has_gpu):
  """The device `variable` is placed on if that is known to be a CPU.

  Returns its device string (maybe '': unplaced, where this process has
  no GPU), or None: placed elsewhere or not known at graph build.
  """
  op = variable.handle.op
  if op.type != 'VarHandleOp' or not op.get_attr('shared_name'):
    return None
  # A slot sits with its variable, wherever that one is placed.
  colocated = [op.graph.get_operation_by_name(group[len(b'loc:@'):].decode())
               for group in op.colocation_groups()]
  devices = set(o.device for o in colocated + [op]) - {''}
  if len(devices) > 1:
    return None
  device = devices.pop() if devices else ''
  spec = tf.DeviceSpec.from_string(device)
  if spec.device_type is not None or spec.job is not None:
    return device if spec.device_type == 'CPU' else None
  return None if has_gpu else device


def handles(variables, name='accumulator_handles'):
  """Each variable's resource handle, batched into one op a device.

  On a CPU a step costs about a microsecond an op: the handles of many
  variables in one `_VarHandlesOp` (which TensorFlow's TPU variable merger
  makes) instead of one op each. A batched handle finds its variable by
  name in its device's resource manager, as the variable's own does, so
  only variables known at graph build to be on one CPU are batched; the
  others, and any inside XLA, keep their own. Fallback: each its own.

  Args:
    variables: resource or ref variables (a replica's components).
    name: the batched ops' name.

  Returns:
    A list of handles (None for a ref variable), in the order of
    `variables`.
  """
  result = [None if is_ref_variable(v) else v.handle for v in variables]
  if public_api_only() or in_xla_context():
    return result
  has_gpu = _has_gpu()
  devices = {}
  for index, variable in enumerate(variables):
    device = None if result[index] is None else _cpu_device(variable, has_gpu)
    if device is not None:
      devices.setdefault(device, []).append(index)
  graph = tf.compat.v1.get_default_graph()
  for device, indices in devices.items():
    if len(indices) < 2:
      continue
    batch = [variables[i].handle.op for i in indices]
    # Exactly there: tf.device(None) stops the graph's device functions.
    with tf.device(None), tf.device(device):
      op = graph.create_op(
          '_VarHandlesOp', [], [tf.resource] * len(batch),
          name=name, attrs=_attrs(
              N=len(batch),
              containers=('s', [o.get_attr('container') for o in batch]),
              shared_names=('s', [o.get_attr('shared_name') for o in batch]),
              dtypes=('type', [o.get_attr('dtype').as_datatype_enum
                               for o in batch]),
              shapes=('shape', [tf.TensorShape(o.get_attr('shape')).as_proto()
                                for o in batch])))
    for index, handle in zip(indices, op.outputs):
      result[index] = handle
  return result


def read(variables):
  """The handles (`handles`) and values of `variables`, batched handles'
  values in one op each.

  Args:
    variables: the variables.

  Returns:
    (their handles, their values as tensors), in the order of `variables`.
  """
  variable_handles = handles(variables)
  values = [None] * len(variables)
  batches = {}
  for index, (variable, handle) in enumerate(zip(variables,
                                                 variable_handles)):
    if handle is not None and handle.op.type == '_VarHandlesOp':
      batches.setdefault(handle.op, []).append(index)
    else:
      values[index] = variable.read_value()
  graph = tf.compat.v1.get_default_graph()
  for op, indices in batches.items():
    dtypes = [variables[i].dtype.base_dtype for i in indices]
    with tf.device(None), tf.device(op.device):
      read_op = graph.create_op(
          '_ReadVariablesOp', [variable_handles[i] for i in indices], dtypes,
          name='accumulator_reads', attrs=_attrs(
              N=len(indices),
              dtypes=('type', [d.as_datatype_enum for d in dtypes])))
    for index, value in zip(indices, read_op.outputs):
      value.set_shape(variables[index].shape)
      values[index] = value
  return variable_handles, values


def _source(tensor):
  """The tensor a branch function captured, through nested branches."""
  while True:
    outer = {id(inner): outer for outer, inner in getattr(
        tensor.graph, 'captures', ())}.get(id(tensor))
    if outer is None:
      return tensor
    tensor = outer


def cond(pred, true_fn, false_fn, variables=()):
  """`tf.cond` that runs only the branch taken, on every run.

  A Python bool `pred` (decided at graph build) builds the branch it names
  alone. In a session TensorFlow lowers a control flow v2 `If` to Switch and
  Merge, which push "dead" tensors through every op of the branch not
  taken, on every run: the cycle's apply branch holds a few ops per
  variable and is not taken on grad_steps - 1 of grad_steps micro-steps.
  Unlowered (its `_lower_using_switch_merge` attribute False), the `If`
  runs the branch taken only, as a function. An unlowered `If` is placed
  with all the resources it reads, so this is done only where they are on
  one device (not under MirroredStrategy, nor with variables on parameter
  servers). XLA and control flow v1 ignore it. Fallback: lowered.

  Args:
    pred: a boolean scalar, or a Python bool.
    true_fn, false_fn: the branches.
    variables: variables that `true_fn` reads by their handles (the wrapped
      optimizer's update): it reads them by handles made in the branch
      instead (`_cond_with_own_handles`).

  Returns:
    What `tf.cond` returns.
  """
  if isinstance(pred, bool):
    return true_fn() if pred else false_fn()
  graph = tf.compat.v1.get_default_graph()
  before = len(graph.get_operations())
  result = None
  if variables and not (public_api_only() or in_xla_context() or
                        tf.distribute.has_strategy() or
                        not tf.compat.v1.control_flow_v2_enabled()):
    result = _cond_with_own_handles(pred, true_fn, false_fn, variables)
  if result is None:
    result = tf.cond(pred, true_fn, false_fn)
  if public_api_only():
    return result
  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  from tensorflow.core.framework import attr_value_pb2
  # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
  for op in graph.get_operations()[before:]:
    if op.type not in ('If', 'StatelessIf'):
      continue
    devices = {_source(x).op.device for x in op.inputs
               if x.dtype == tf.resource}
    if len(devices) <= 1:
      op._set_attr('_lower_using_switch_merge',  # pylint: disable=protected-access
                   attr_value_pb2.AttrValue(b=False))
  return result


def _cond_with_own_handles(pred, true_fn, false_fn, variables):
  """`tf.cond` whose true branch reads `variables` by handles it makes.

  A branch function takes each outer tensor its ops read as an argument of
  its `If`, passed on every run, branch taken or not (about 0.25 us each on
  2 cores), and the apply step runs an `_Arg` node for each: the wrapped
  optimizer's update reads a handle per variable and slot. Here the true
  branch's graph (a subclass of TensorFlow's branch graph, built as
  `tf.cond` builds it) hands the update batched handles made in the branch
  (`handles`: one op per device) for the variables' own. The first of each
  batch stays an argument: an unlowered `If` runs its branch on the device
  of the resources it takes. None where TensorFlow's cond internals have
  moved: the caller then uses `tf.cond`.
  """
  try:
    # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
    from tensorflow.python.framework import func_graph as func_graph_module
    from tensorflow.python.ops import cond_v2
    from tensorflow.python.ops import control_flow_util_v2 as util
    # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
    # pylint: disable=protected-access
    build_cond, verify_captures = cond_v2._build_cond, cond_v2.verify_captures
    cond_type = cond_v2._COND
    # pylint: enable=protected-access
    branch_graph, unique_fn_name = util.CondBranchFuncGraph, util.unique_fn_name
    from_py_func = func_graph_module.func_graph_from_py_func
  except (ImportError, AttributeError):
    return None

  class OwnHandles(branch_graph):
    """A branch graph that reads some outer variables by handles of its own."""

    own_handles = {}  # id(an outer handle) -> the handle made in the branch

    def capture(self, tensor, name=None, shape=None):
      inner = self.own_handles.get(id(tensor))
      if inner is not None:
        return inner
      return super(OwnHandles, self).capture(tensor, name, shape)

  def true_branch():
    made, batches = {}, set()
    for variable, handle in zip(variables, handles(variables,
                                                   'variable_handles')):
      if handle is None or handle.op.type != '_VarHandlesOp':
        continue
      if handle.op in batches:
        made[id(variable.handle)] = handle
      else:  # the first of a batch stays an argument (see above)
        batches.add(handle.op)
    tf.compat.v1.get_default_graph().own_handles = made
    return true_fn()

  graph = tf.compat.v1.get_default_graph()
  with tf.compat.v1.name_scope('cond') as scope:
    names = [unique_fn_name(scope, branch) for branch in ('true', 'false')]
    add_control_dependencies = graph._add_control_dependencies  # pylint: disable=protected-access
    pred = tf.convert_to_tensor(pred)
    branches = [
        from_py_func(name, fn, [], {}, func_graph=kind(
            name, collections=graph._collections),  # pylint: disable=protected-access
                     add_control_dependencies=add_control_dependencies,
                     op_return_value=pred)
        for name, fn, kind in zip(names, (true_branch, false_fn),
                                  (OwnHandles, branch_graph))]
    verify_captures(cond_type, branches)
    return build_cond(pred, branches[0], branches[1],
                      branches[0].external_captures,
                      branches[1].external_captures, building_gradient=False,
                      name=scope)


def one_variable_creator(device):
  """A variable creator making one plain variable on `device`, or None.

  Under a multi-replica strategy the strategy's creator makes a variable per
  replica; state that every replica's part meets in (a table's list of
  rows) wants one, which only TensorFlow's default creator makes. None
  where public APIs alone are used: the caller keeps such state otherwise.
  """
  if public_api_only():
    return None
  try:
    # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
    from tensorflow.python.ops import ref_variable
    # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
    default_creator = ref_variable.default_variable_creator
  except (ImportError, AttributeError):
    return None

  def plain(next_creator, **kwargs):
    del next_creator  # the strategy's creator would make one per replica
    kwargs.pop('distribute_strategy', None)
    with tf.device(device):
      return default_creator(None, **kwargs)

  return plain


def plain_global_step_read(global_step):
  """Gives hooks a read of `global_step` that needs no other worker.

  Hooks (`StopAtStepHook`, `CheckpointSaverHook`, ...) fetch the tensor that
  `tf.compat.v1.train` caches for reading the global step:
  `cond(is_initialized, read, initial_value)`. Under
  `MultiWorkerMirroredStrategy` a variable's initial value is broadcast
  from worker 0, upstream of that `cond`, so every fetch of it runs a
  collective: when one worker makes one more such run than another, the
  workers' collectives no longer match and both hang. This caches a plain
  read instead. Fallback: the cached read is left alone (a hook's extra
  read can then hang a multi-worker job until its timeout).

  Args:
    global_step: the global step variable given to `apply_gradients`.
  """
  if public_api_only():
    return
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
  with tf.init_scope(), graph.name_scope(None):
    with graph.name_scope(global_step.op.name + '/'):
      read_value = tf.identity(local_variables([global_step])[0].read_value(),
                               name='plain_read')
  del reads[:], cached[:]
  reads.append(read_value)
  cached.append(read_value)


# Object-based checkpoints (`tf.train.Checkpoint`, Keras's `save_weights`)
# see the wrapper where the bare optimizer would be. TensorFlow's
# `tf.compat.v1.train.Optimizer` keeps its non-slot variables and restores
# its slots through Trackable's extension points, which a wrapper takes on
# by delegating to the optimizer it wraps; without them (public APIs only,
# or a TensorFlow that dropped one) the wrapper has no children of its own,
# and object-based checkpoints then miss the wrapped optimizer's state.


def trackable_children(opt, save_type, **kwargs):
  """`opt`'s object-graph children (its non-slot variables).

  Args:
    opt: the wrapped optimizer.
    save_type: as Trackable's `_trackable_children`.
    **kwargs: its other arguments.

  Returns:
    {name: trackable}; fallback: {} (the wrapper shows no children).
  """
  children = getattr(opt, '_trackable_children', None)
  if children is None or public_api_only():
    return {}
  return dict(children(save_type, **kwargs))


def lookup_dependency(opt, name, cached_dependencies=None):
  """`opt`'s child `name` in the current graph.

  Args:
    opt: the wrapped optimizer.
    name: the child's name in a checkpoint's object graph.
    cached_dependencies: as Trackable's `_lookup_dependency`.

  Returns:
    The trackable, or None (also the fallback).
  """
  lookup = getattr(opt, '_lookup_dependency', None)
  if lookup is None or public_api_only():
    return None
  return lookup(name, cached_dependencies)


def create_or_restore_slot_variable(opt, position, slot_name, variable):
  """Hands a checkpoint's slot value to `opt`, which restores it into the
  slot now or as the slot is made (`restore_slot_variables`).

  Args:
    opt: the wrapped optimizer.
    position: the checkpoint position of the slot's value.
    slot_name: the slot's name.
    variable: the variable the slot belongs to.
  """
  restore = getattr(opt, '_create_or_restore_slot_variable', None)
  if restore is not None and not public_api_only():
    restore(position, slot_name, variable)


def restore_slot_variables(opt, slots):
  """Restores into each slot made outside `opt`'s own slot functions what a
  checkpoint restore handed `opt` for it (`create_or_restore_slot_variable`).

  Args:
    opt: the wrapped optimizer.
    slots: [(slot name, variable, slot)].
  """
  restore = getattr(opt, '_restore_slot_variable', None)
  if restore is None or public_api_only():
    return
  for slot_name, variable, slot in slots:
    restore(slot_name, variable, slot)


def handle_deferred_dependencies(trackable, children):
  """Restores into each child, made after a checkpoint restore of
  `trackable`, what the checkpoint holds for it.

  Args:
    trackable: the wrapper.
    children: [(name, variable)]: its children by their names.
  """
  handle = getattr(trackable, '_handle_deferred_dependencies', None)
  if handle is None or public_api_only():
    return
  for name, variable in children:
    handle(name=name, trackable=variable)
