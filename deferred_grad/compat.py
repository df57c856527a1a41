"""TensorFlow version shims: the supported range and modules that moved."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import re

MIN_TF_VERSION = (2, 15)
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
  if _parse_version(tensorflow.__version__) < MIN_TF_VERSION:
    raise ImportError(
        'deferred_grad needs TensorFlow %s; found TensorFlow %s. %s' %
        (TESTED_TF_RANGE, tensorflow.__version__, _INSTALL_HINT))
  return tensorflow


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
