"""Keras 2 `model.fit` in graph mode: Keras's own optimizers, its end check.

Keras 2 is `tf.keras` on TensorFlow 2.15 and the `tf_keras` package (of the
same version) from 2.16 on. Nothing here imports it until called.

`model.compile` wraps a `tf.compat.v1` optimizer, the wrapper included, in
Keras's `TFOptimizer`, which has no learning rate for Keras's callbacks.
`keras_optimizer` wraps a Keras legacy optimizer instead: `fit` keeps it as
the model's optimizer (`model.optimizer.lr` is the Keras optimizer's), and
the wrapper's core accumulates its gradients and hands their mean to the
Keras optimizer's own `apply_gradients` once per cycle.
"""

from deferred_grad import compat
from deferred_grad import optimizer as optimizer_lib
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


class _KerasUpdate(tf.compat.v1.train.Optimizer):
  """A Keras legacy optimizer seen by the wrapper as the optimizer it wraps:
  its `apply_gradients` applies the cycle's gradient with Keras's own update
  (which makes its slots under `init_scope`, and counts its own
  `iterations`: the updates, as Adam's bias correction expects)."""

  def __init__(self, keras_optimizer):
    super().__init__(use_locking=False, name='KerasUpdate')
    self.keras_optimizer = keras_optimizer

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step, name  # the wrapper counts its own
    return self.keras_optimizer.apply_gradients(list(grads_and_vars))

  def _create_slots(self, var_list):
    del var_list  # Keras makes them in apply_gradients, under init_scope

  def get_slot(self, var, name):
    """The wrapper's slot (an accumulator), else the Keras optimizer's."""
    slot = super().get_slot(var, name)
    if slot is not None:
      return slot
    try:
      return self.keras_optimizer.get_slot(var, name)
    except KeyError:
      return None

  def get_slot_names(self):
    return super().get_slot_names() + self.keras_optimizer.get_slot_names()

  def variables(self):
    """The accumulators and the Keras optimizer's variables."""
    return super().variables() + self.keras_optimizer.variables()


def keras_optimizer(optimizer, grad_steps, **kwargs):
  """Wraps a Keras 2 legacy optimizer for `model.fit` in graph mode.

  ```python
  opt = deferred_grad.keras_optimizer(
      keras.optimizers.legacy.Adam(1e-2), grad_steps=4,
      global_step_counts='updates')
  model.compile(optimizer=opt, loss='mse')
  model.fit(x, y, batch_size=micro_batch, callbacks=[
      keras.callbacks.LearningRateScheduler(schedule)])
  ```

  `fit` keeps it as `model.optimizer`: `LearningRateScheduler` and
  `ReduceLROnPlateau` set the Keras optimizer's learning rate, which the
  next update uses; `model.optimizer.iterations` counts what `global_step`
  counts (micro-steps, or updates with `global_step_counts='updates'`).

  Args:
    optimizer: a `keras.optimizers.legacy.Optimizer` of Keras 2, without
      `clipnorm`, `global_clipnorm` or `clipvalue` (they would clip each
      micro-batch: pass `clip_norm=` here instead).
    grad_steps: as `GradientAggregationOptimizer`'s.
    **kwargs: `GradientAggregationOptimizer`'s other keywords.

  Returns:
    A `keras.optimizers.legacy.Optimizer` of Keras 2.

  Raises:
    TypeError: `optimizer` is not a Keras 2 legacy optimizer.
    ValueError: it clips its gradients itself.
    ImportError: as `keras2`.
  """
  keras = keras2()
  legacy = keras.optimizers.legacy.Optimizer
  if not isinstance(optimizer, legacy):
    raise TypeError(
        'deferred_grad.keras_optimizer(optimizer, ...): optimizer must be a '
        'Keras 2 legacy optimizer (%s.optimizers.legacy.*, e.g. Adam), got %r '
        'of type %s. A tf.compat.v1.train optimizer goes to '
        'GradientAggregationOptimizer.' % (
            keras.__name__, optimizer, type(optimizer).__name__))
  clips = [name for name in ('clipnorm', 'global_clipnorm', 'clipvalue')
           if getattr(optimizer, name, None) is not None]
  if clips:
    raise ValueError(
        'deferred_grad.keras_optimizer: the Keras optimizer has %s=%s, which '
        'would clip each micro-batch on its own; leave it out and pass '
        'clip_norm= to keras_optimizer, which clips the cycle\'s gradient.' %
        (clips[0], getattr(optimizer, clips[0])))
  wrapper = optimizer_lib.GradientAggregationOptimizer(
      _KerasUpdate(optimizer), grad_steps, **kwargs)

  class GradientAggregation(legacy):
    """The wrapper as a Keras 2 optimizer; see `keras_optimizer`."""

    def __init__(self):
      super().__init__(name='GradientAggregation')
      self.keras_optimizer = optimizer
      self.wrapper = wrapper
      self._track_trackable(optimizer, name='optimizer')

    @property
    def learning_rate(self):
      """The Keras optimizer's learning rate (Keras's callbacks set it)."""
      return self.keras_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
      self.keras_optimizer.learning_rate = value

    lr = learning_rate  # Keras's other name for it

    def get_updates(self, loss, params):
      grads = self.keras_optimizer.get_gradients(loss, params)
      train_op = self.wrapper.apply_gradients(list(zip(grads, params)),
                                              global_step=self.iterations)
      # Keras's session initializes the variables of the tf.compat.v1
      # optimizers that `keras.optimizers.get` wrapped in its graph while
      # they live: the wrapper's counters and accumulators with them.
      self.initialized_with = keras.optimizers.get(self.wrapper)
      return [train_op]

    def get_config(self):
      config = super().get_config()
      config.update(grad_steps=(grad_steps if isinstance(grad_steps, int)
                                else None),
                    optimizer=keras.optimizers.serialize(optimizer))
      return config

  return GradientAggregation()
