"""Keras 2 `model.fit` in graph mode: what it needs beside the wrapper.

Keras 2 is `tf.keras` on TensorFlow 2.15 and the `tf_keras` package (of the
same version) from 2.16 on. Nothing here imports it until called.
"""

from deferred_grad import compat
from deferred_grad import port_checks
from deferred_grad import registry

tf = compat.import_tensorflow()


def keras2():
  """The Keras 2 module: `tf.keras` where it is Keras 2, else `tf_keras`.

  Returns:
    A module.

  Raises:
    ImportError: this TensorFlow's Keras is Keras 3 and tf_keras is missing.
  """
  if compat.keras_major_version() < 3:
    return tf.keras
  try:
    import tf_keras  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        'Keras 2 on TensorFlow %s is the tf_keras package: pip install '
        'tf_keras==%s (%s).' % (tf.__version__, tf.__version__, e))
  return tf_keras


def port_check_callback():
  """A Keras 2 callback that names a `fit` ended mid-cycle.

  `model.fit` takes no `SessionRunHook`; this is `PortCheckHook`'s end check
  for it. At the end of `fit` it warns of each train op that accumulated
  micro-batches and applied none of them (`epochs * steps_per_epoch` not a
  multiple of `grad_steps`). A fit that ends on an update logs nothing.

  ```python
  model.fit(x, y, batch_size=micro_batch, epochs=epochs,
            callbacks=[deferred_grad.port_check_callback()])
  ```

  Returns:
    A `keras.callbacks.Callback` of Keras 2.

  Raises:
    ImportError: as `keras2`.
  """
  keras = keras2()

  class PortCheck(keras.callbacks.Callback):
    """Reads the cycles' counters at the end of `fit`."""

    def on_train_end(self, logs=None):
      del logs
      weights = self.model.weights
      if not weights:
        return
      places = port_checks.cycle_counters(
          registry.of(weights[0].graph).records)
      values = keras.backend.batch_get_value(
          [variable for _, _, counters in places for variable in counters])
      for train_op, cycle, counters in places:
        port_checks.warn_if_mid_cycle(
            train_op, cycle, values[:len(counters)],
            'make epochs * steps_per_epoch a multiple of grad_steps, or fit '
            'on: the next fit resumes the cycle')
        values = values[len(counters):]

  return PortCheck()
