"""TensorFlow version shims: the supported range and modules that moved."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

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


def keras_major_version():
  """The major version of the Keras `tf.keras` is (2 on TF 2.15, 3 after)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
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


def local_variable(variable):
  """The variable a replica updates: its own component of a mirrored one.

  In a replica context, updates of a `MirroredVariable` whose aggregation is
  NONE (optimizer slots) go to the replica's own component; the raw kernels
  used here need that component itself.
  """
  get_local = getattr(variable, '_get_on_device_or_primary', None)
  return get_local() if get_local is not None else variable


def host_device(device):
  """The CPU of the task that `device` names (a string; '' for no device).

  For what has no GPU kernel (queues of row ids and their bookkeeping), so
  that it also places where soft placement is off.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
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
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if variable.shape.is_fully_defined():
    return tf.constant(variable.shape.as_list(), tf.int64)
  if is_ref_variable(variable):
    return tf.shape(variable, out_type=tf.int64)
  return tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64)


def in_xla_context():
  """True while building inside an XLA computation (a TPU rewrite,
  `xla.compile`), where only XLA-compilable ops may be made.

  Also inside a function graph built within one (a control flow v2 branch),
  whose own graph knows nothing of the XLA context around it.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  graph = tf.compat.v1.get_default_graph()
  while graph is not None:
    context = graph._get_control_flow_context()  # pylint: disable=protected-access
    while context is not None:
      if context.IsXLAContext():
        return True
      context = context.outer_context
    graph = getattr(graph, 'outer_graph', None)
  return False


# Object-based checkpoints (`tf.train.Checkpoint`, Keras's `save_weights`)
# see the wrapper where the bare optimizer would be. TensorFlow's
# `tf.compat.v1.train.Optimizer` keeps its non-slot variables and restores
# its slots through Trackable's extension points, which a wrapper takes on
# by delegating to the optimizer it wraps; without them (a TensorFlow that
# dropped one) the wrapper has no children of its own, as before, and
# object-based checkpoints then miss the wrapped optimizer's state.


def trackable_children(opt, save_type, **kwargs):
  """`opt`'s object-graph children (its non-slot variables), or {}."""
  children = getattr(opt, '_trackable_children', None)
  return dict(children(save_type, **kwargs)) if children else {}


def lookup_dependency(opt, name, cached_dependencies=None):
  """`opt`'s child `name` in the current graph, or None."""
  lookup = getattr(opt, '_lookup_dependency', None)
  return lookup(name, cached_dependencies) if lookup else None


def create_or_restore_slot_variable(opt, position, slot_name, variable):
  """Hands a checkpoint's slot value to `opt`, which restores it into the
  slot now or as the slot is made (`restore_slot_variable`)."""
  restore = getattr(opt, '_create_or_restore_slot_variable', None)
  if restore is not None:
    restore(position, slot_name, variable)


def restore_slot_variable(opt, slot_name, variable, slot):
  """Restores into `slot`, made outside `opt`'s own slot functions, what a
  checkpoint restore handed `opt` for it (`create_or_restore_slot_variable`).
  """
  restore = getattr(opt, '_restore_slot_variable', None)
  if restore is not None:
    restore(slot_name, variable, slot)


def handle_deferred_dependencies(trackable, name, variable):
  """Restores into `variable`, made after a checkpoint restore of
  `trackable`, what the checkpoint holds for `trackable`'s child `name`."""
  handle = getattr(trackable, '_handle_deferred_dependencies', None)
  if handle is not None:
    handle(name=name, trackable=variable)
