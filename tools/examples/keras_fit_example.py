r"""Keras 2 `model.fit` in graph mode with deferred_grad: the whole port.

The script before: `model.fit(x, y, batch_size=256)` with
`keras.optimizers.legacy.Adam(1e-2)`, a `LearningRateScheduler` halving the
rate each epoch and a `ModelCheckpoint` each epoch. The port changes:

1. `batch_size` is the micro-batch: `batch_size=256 // grad_steps`.
2. The optimizer, Keras's own, is wrapped for `fit`:
   `deferred_grad.keras_optimizer(keras.optimizers.legacy.Adam(1e-2),
   grad_steps, global_step_counts='updates')`. It is `model.optimizer`:
   `LearningRateScheduler` and `ReduceLROnPlateau` set its rate, which the
   next update uses, and need no edit; with `'updates'`,
   `model.optimizer.iterations` counts updates, as the large batch's does
   (without it, micro-steps). Keras's optimizer counts its own steps
   (Adam's bias correction) in updates either way. Its `clipnorm` is
   refused: pass `clip_norm=` to `keras_optimizer`, which clips the
   cycle's gradient.
3. Batch norm normalizes each micro-batch by its own statistics (ghost
   batch norm) and steps its moving averages once per micro-batch: give it
   `momentum=m ** (1 / grad_steps)` so that they move as the large batch's.
   The normalization itself stays per micro-batch: this example measures
   what that costs (its last line).
4. While porting, `callbacks=[deferred_grad.port_check_callback()]` names a
   fit that ends mid-cycle (`epochs * steps_per_epoch` not a multiple of
   `grad_steps`).

A `tf.compat.v1.train` optimizer still works as before
(`model.compile(optimizer=deferred_grad.GradientAggregationOptimizer(...))`),
but Keras wraps it in its `TFOptimizer`, which has no learning rate for the
callbacks. Under a `tf.distribute` strategy `batch_size` is global, as
always in Keras. Keras 2 is `tf.keras` on TensorFlow 2.15 and the `tf_keras`
package of the same version from 2.16 on. Keras 3 has its own
`gradient_accumulation_steps` (eager mode).

It trains the large batch and the port, without batch norm (they must match
to round-off, tests/test_demo.py) and with it (ghost batch norm: the
difference printed is what the port costs there).

  python tools/examples/keras_fit_example.py --grad_steps=4 --epochs=3
"""

import os
import tempfile

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('batch', 256, 'The large batch (the script\'s).')
flags.DEFINE_integer('epochs', 3, 'Epochs of 8 updates each.')

MOMENTUM = 0.9  # the script's batch norm momentum


def _model(keras, batch_norm, momentum):
  layers = [keras.layers.Dense(16, activation='relu', input_shape=(8,),
                               kernel_initializer=keras.initializers.
                               RandomNormal(seed=1))]
  if batch_norm:
    layers.append(keras.layers.BatchNormalization(momentum=momentum))
  layers.append(keras.layers.Dense(1, kernel_initializer=keras.initializers.
                                   RandomNormal(seed=2)))
  return keras.Sequential(layers)


def _fit(keras, data, port, batch_norm):
  """Fits the script (port=False) or its port; returns the weights, the
  loss per epoch and what `iterations` counted."""
  tf.compat.v1.reset_default_graph()
  keras.backend.clear_session()
  grad_steps = FLAGS.grad_steps if port else 1
  model = _model(keras, batch_norm, MOMENTUM ** (1.0 / grad_steps))  # 3.
  optimizer = keras.optimizers.legacy.Adam(1e-2)
  callbacks = [
      keras.callbacks.LearningRateScheduler(lambda epoch, lr: 1e-2 / 2**epoch),
      keras.callbacks.ModelCheckpoint(
          os.path.join(tempfile.mkdtemp(), 'weights-{epoch}.h5'),
          save_weights_only=True)]
  if port:
    optimizer = deferred_grad.keras_optimizer(                  # 2.
        optimizer, grad_steps, global_step_counts='updates')
    callbacks.append(deferred_grad.port_check_callback())       # 4.
  model.compile(optimizer=optimizer, loss='mse')
  history = model.fit(data[0], data[1], batch_size=FLAGS.batch // grad_steps,
                      epochs=FLAGS.epochs, shuffle=False, verbose=0,  # 1.
                      callbacks=callbacks)
  return (model.get_weights(), history.history['loss'],
          keras.backend.get_value(model.optimizer.iterations))


def _largest_difference(a, b):
  return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12))
             for x, y in zip(a, b))


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  keras = deferred_grad.keras_fit.keras2()
  rng = np.random.RandomState(0)
  x = (rng.randn(8 * FLAGS.batch, 8) * 2 + 1).astype(np.float32)
  data = (x, np.tanh(x.dot(rng.randn(8, 1))).astype(np.float32))
  large, large_losses, large_iterations = _fit(keras, data, False, False)
  port, losses, iterations = _fit(keras, data, True, False)
  for epoch, loss in enumerate(losses):
    print('epoch %d  loss %.5f (large batch %.5f)' % (
        epoch + 1, loss, large_losses[epoch]))
  print('iterations (updates): %d, the large batch\'s %d' % (
      iterations, large_iterations))
  print('loss went from %.5f to %.5f' % (losses[0], losses[-1]))
  print('without batch norm, largest weight difference from the large '
        'batch: %.3g' % _largest_difference(port, large))
  large, _, _ = _fit(keras, data, False, True)
  port, _, _ = _fit(keras, data, True, True)
  print('with batch norm (ghost, each micro-batch normalized by its own '
        'statistics; momentum %.3f): weights %.3g relative off the large '
        'batch' % (MOMENTUM ** (1.0 / FLAGS.grad_steps),
                   _largest_difference(port, large)))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
