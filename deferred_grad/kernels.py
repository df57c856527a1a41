"""The dense accumulators' in-place kernels (add, read, zero), and handles.

Two costs shape them, each measured with `tools/benchmark`:

* Ops (`--suites=step`). On many small variables a step costs the ops the
  executor schedules (about a microsecond each on a 2-core CPU), not their
  arithmetic. An add is one kernel (`add`); and on a CPU the accumulators'
  handles, and their reads on an apply step, are one op per device
  (`handles`, `read`: TensorFlow's `_VarHandlesOp` and `_ReadVariablesOp`,
  which its TPU variable merger makes), not one per accumulator; so are
  the handles by which the apply branch updates the variables
  (`handles_made_here`), not an argument of the cycle's `If` each.
* Memory (`--suites=memory`). The accumulators are as large as the
  parameters, and so is any buffer made for their zeros. Zeros of a known
  shape are folded into a constant a session keeps for its life
  (`run_time_zeros` makes them at run time), and `assign(zeros)` writes a
  second buffer whose pages the CPU allocator then keeps (`zero` writes
  the variable's own buffer).
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import contextlib

from deferred_grad import compat

tf = compat.import_tensorflow()

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.core.framework import attr_value_pb2
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

# Up to this size a variable is zeroed by assigning it a zeros tensor shared
# by every variable of its shape: one op per variable, and the one shared
# transient is small. Larger ones are zeroed by a scatter, which needs no
# such buffer.
SHARED_ZEROS_MAX_BYTES = 1 << 20


def run_time_zeros(shape, dtype=tf.float32, partition_info=None):
  """Zeros of `shape` that TensorFlow cannot fold into a constant.

  As the accumulators' initial value (the original's zeros slot) a folded
  constant pinned 1x the parameter bytes. A fill value the graph optimizers
  cannot know keeps the zeros a run-time tensor, freed after use.

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


def _attrs(**values):
  """NodeDef attributes from Python values (ints, lists of them)."""
  attrs = {}
  for key, value in values.items():
    if isinstance(value, int):
      attrs[key] = attr_value_pb2.AttrValue(i=value)
    else:
      kind, items = value
      attrs[key] = attr_value_pb2.AttrValue(
          list=attr_value_pb2.AttrValue.ListValue(**{kind: items}))
  return attrs


_LOCAL_GPUS = []


def _cpu_device(variable):
  """The device `variable` is placed on if that is known to be a CPU.

  Returns its device string (maybe '': unplaced, where this process has
  no GPU), or None: placed elsewhere or not known at graph build.
  """
  if compat.is_ref_variable(variable) or compat.in_xla_context():
    return None
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
  if not _LOCAL_GPUS:
    _LOCAL_GPUS.append(bool(tf.config.list_physical_devices('GPU')))
  return None if _LOCAL_GPUS[0] else device


def handles(variables, name='accumulator_handles'):
  """Each variable's resource handle for the kernels here, in one op a device.

  A batched handle finds the variable by name in its device's resource
  manager, as its own `VarHandleOp` does, so a batch must sit on its
  variables' device: only variables known at graph build to be on one CPU
  are batched. The others (on a GPU, or placed at run time where this
  process has a GPU) and variables inside XLA keep their own handle; a ref
  variable (v1 behaviour) has None.

  Args:
    variables: resource or ref variables (a replica's components).
    name: the batched ops' name.

  Returns:
    A list of handles (or None), in the order of `variables`.
  """
  result = [None if compat.is_ref_variable(v) else v.handle
            for v in variables]
  devices = {}
  for index, variable in enumerate(variables):
    device = _cpu_device(variable)
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


@contextlib.contextmanager
def handles_made_here(opt, var_list):
  """In a v2 branch: `opt` updates `var_list` by handles made in the branch.

  A branch function takes each outer tensor its ops read as an argument of
  its `If`, passed on every run, branch taken or not (about 0.25 us each on
  2 cores): the wrapped optimizer's update in the apply branch reads each
  variable's and slot's handle, so every micro-step paid an argument for
  each, and the apply step as many `_Arg` nodes. In this context the
  branch reads the handles `handles` makes in it instead, one op per
  device (where it batches them: variables known at graph build to be on
  one CPU). TensorFlow has no API for it: the branch graph's `capture` is
  overridden for the context's length. Nothing changes outside a control
  flow v2 branch, and under a distribution strategy, whose replicas build
  the branch in turns, each in its own thread, stopping in `merge_call`.

  Args:
    opt: the wrapped optimizer, whose slots (`get_slot`) are also read.
    var_list: the variables it updates (ref variables are skipped).
  """
  graph = tf.compat.v1.get_default_graph()
  capture = getattr(graph, 'capture', None)
  if (not getattr(graph, 'is_control_flow_graph', False) or
      capture is None or compat.in_xla_context() or
      tf.distribute.has_strategy()):
    yield
    return
  slots = (opt.get_slot(v, name) for name in opt.get_slot_names()
           for v in var_list)
  variables = list(var_list) + [slot for slot in slots if slot is not None]
  made = {}  # id(the variable's own handle) -> the handle made here
  batches = set()
  for variable, handle in zip(variables,
                              handles(variables, 'variable_handles')):
    if handle is None or handle.op.type != '_VarHandlesOp':
      continue
    if handle.op not in batches:
      # The first of each batch stays an argument: the If is placed with
      # the resources it takes (see `lazy_cond`), and runs the branch on
      # that device only, where the batch finds its variables.
      batches.add(handle.op)
    else:
      made[id(variable.handle)] = handle

  def capture_here(tensor, name=None, shape=None):
    here = made.get(id(tensor))
    return capture(tensor, name, shape) if here is None else here

  graph.capture = capture_here
  try:
    yield
  finally:
    del graph.capture


def read(variables, variable_handles):
  """The values of `variables`, batched handles' in one op each.

  Args:
    variables: the variables.
    variable_handles: what `handles` returned for them.

  Returns:
    A list of tensors, in the order of `variables`.
  """
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
  return values


def _handle(variable, handle):
  """`handle`, else `variable`'s own (None for a ref variable)."""
  if handle is None and not compat.is_ref_variable(variable):
    return variable.handle
  return handle


def add(variable, value, scale, handle=None):
  """variable += scale * value, in place, in one kernel.

  SGD's kernel with learning rate -scale: no temporary, one op instead of
  two. `handle`: `variable`'s from `handles`, or None for its own.
  """
  alpha = -scale
  handle = _handle(variable, handle)
  if handle is None:
    return tf.raw_ops.ApplyGradientDescent(var=variable, alpha=alpha,
                                           delta=value).op
  return tf.raw_ops.ResourceApplyGradientDescent(var=handle, alpha=alpha,
                                                 delta=value)


def zero(variable, shared_zeros=None, handle=None):
  """Sets every element of `variable` to zero in its own buffer.

  A small variable (at most `SHARED_ZEROS_MAX_BYTES`) is assigned zeros
  from `shared_zeros`, one tensor per shape, dtype and device made once per
  apply step. A larger one gets a scatter of one scalar zero over all of
  its rows: no buffer as large as the variable. (With `assign` of its own
  zeros the wrapper's peak RSS over a bare micro-batch step was 2.47x the
  parameter bytes on the benchmark's MLP, with this 1.14x-1.23x, 1x being
  the accumulators.) A scatter switches a resource variable to copy-on-read
  mode, in which every later dense read copies it; `DisableCopyOnRead`
  switches it back once the scatter is done. Inside XLA, which updates in
  place by itself and has no such modes, and for a variable without rows (a
  scalar, or a rank unknown until run time), a plain assign.

  Args:
    variable: a variable (ref or resource), or a replica's component of one.
    shared_zeros: None, or a dict that the resets of one apply step share.
    handle: `variable`'s from `handles`, or None for its own.

  Returns:
    The op.
  """
  dtype = variable.dtype.base_dtype
  if not variable.shape.rank or compat.in_xla_context():
    return variable.assign(run_time_zeros(tf.shape(variable), dtype),
                           read_value=False)
  shape = variable.shape
  handle = _handle(variable, handle)
  if (shared_zeros is not None and shape.is_fully_defined() and
      shape.num_elements() * dtype.size <= SHARED_ZEROS_MAX_BYTES):
    key = (tuple(shape.as_list()), dtype, variable.device)
    if key not in shared_zeros:
      with tf.control_dependencies(None):  # made once, not after one reset
        shared_zeros[key] = run_time_zeros(shape.as_list(), dtype)
    if handle is None:
      return tf.compat.v1.assign(variable, shared_zeros[key]).op
    return tf.raw_ops.AssignVariableOp(resource=handle,
                                       value=shared_zeros[key])
  zero_value = tf.zeros([], dtype)
  rows = tf.compat.dimension_value(shape[0])
  if rows is None:  # known at run time only: read where the variable is
    rows = compat.variable_shape(variable)[0]
  with tf.device(compat.host_device(variable.device)):
    # On the host, as shapes are, and at run time: a folded constant of row
    # ids would stay for the session's life (8 bytes a row).
    rows = tf.range(tf.compat.v1.placeholder_with_default(
        tf.cast(rows, tf.int64), []))
  if handle is None:
    return tf.compat.v1.scatter_update(variable, rows, zero_value).op
  zeroed = tf.raw_ops.ResourceScatterUpdate(resource=handle, indices=rows,
                                            updates=zero_value)
  with tf.control_dependencies([zeroed]):
    return tf.raw_ops.DisableCopyOnRead(resource=handle)
