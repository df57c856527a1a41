"""deferred_grad: gradient accumulation for TensorFlow 1 style graph training.

`GradientAggregationOptimizer` wraps a `tf.compat.v1.train.Optimizer` and
applies the mean gradient of `grad_steps` micro-batches once per cycle, so
that training matches one batch `grad_steps` times larger.
"""

from deferred_grad import compat as _compat

_compat.import_tensorflow()

# pylint: disable=g-import-not-at-top,wrong-import-position
from deferred_grad.checkpoints import ConvertCheckpointHook
from deferred_grad.checkpoints import Saver
from deferred_grad.checkpoints import convert_checkpoint
from deferred_grad.distribute import collective_barrier
from deferred_grad.distribute import collective_run_options
from deferred_grad.keras_fit import keras_optimizer
from deferred_grad.keras_fit import port_check_callback
from deferred_grad.optimizer import GradientAggregationOptimizer
from deferred_grad.port_checks import PortCheckHook
from deferred_grad.records import applied_updates
# pylint: enable=g-import-not-at-top,wrong-import-position

__version__ = '0.1.0'

__all__ = [
    'ConvertCheckpointHook', 'GradientAggregationOptimizer', 'PortCheckHook',
    'Saver', 'applied_updates', 'collective_barrier', 'collective_run_options',
    'convert_checkpoint', 'keras_optimizer', 'port_check_callback'
]
