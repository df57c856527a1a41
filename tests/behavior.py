"""TensorFlow's graph behaviour for this test process, set once on import.

TensorFlow's behaviour mode is process-wide, so the test runner starts pytest
once per mode: DEFERRED_GRAD_TF_BEHAVIOR=v2 (`disable_eager_execution()`:
resource variables, control flow v2) or v1 (`disable_v2_behavior()`: ref
variables, control flow v1, as legacy scripts run). conftest.py and the
worker scripts import this module before anything builds a graph.
"""

import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf

# Two logical CPUs for MirroredStrategy: must happen before TF sets up devices.
_CPU = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(
    _CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

BEHAVIOR = os.environ.get('DEFERRED_GRAD_TF_BEHAVIOR', 'v2')
if BEHAVIOR == 'v1':
  tf.compat.v1.disable_v2_behavior()
elif BEHAVIOR == 'v2':
  tf.compat.v1.disable_eager_execution()
else:
  raise ValueError('DEFERRED_GRAD_TF_BEHAVIOR must be v1 or v2, got %r' %
                   BEHAVIOR)
