r"""Keras 2 `model.fit` in graph mode with deferred_grad.

Compile the model with the wrapper around a `tf.compat.v1.train` optimizer
and give `model.fit` the micro-batch as `batch_size`: every `grad_steps`
batches apply one update, as `model.fit` at `batch_size * grad_steps` with
the bare optimizer would (tested for SGD, Momentum, Adam and RMSProp on both
TensorFlow versions, `tests/test_keras.py`). Keras 2 is `tf.keras` on
TensorFlow 2.15 and the `tf_keras` package, same version as TensorFlow, from
2.16 on (`pip install tf_keras==<your TensorFlow version>`). Keras 3's own
optimizers are refused by the wrapper; in eager mode use Keras 3's
`gradient_accumulation_steps` instead.

What changes in a Keras script:

- `batch_size` is the micro-batch; an epoch of N examples makes
  N / batch_size micro-steps and N / (batch_size * grad_steps) updates. Let
  an epoch hold whole cycles, or cycles run on across epochs (which is fine,
  but an epoch's last update then mixes two epochs' batches).
- Keras calls the wrapped optimizer with `global_step=model.optimizer.
  iterations`, which therefore counts micro-steps (48 after 12 updates of 4).
- Under a `tf.distribute` strategy (`MirroredStrategy`) `batch_size` is
  global, as always in Keras: each replica takes `batch_size / replicas`
  rows per micro-step. Keras then passes the graph's global step instead of
  `iterations` (None unless the script made one), so `iterations` stays 0
  for the bare optimizer as for the wrapper; the training matches the large
  batch all the same (tested).
- Batch normalization normalises each micro-batch by its own statistics and
  updates its moving averages once per micro-batch (tested against numpy).
- An Embedding layer's sparse gradients take the wrapper's table path
  (tested with Adagrad and Adam against the large batch).

  python tools/examples/keras_fit_example.py --grad_steps=4 --epochs=5
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('micro_batch', 32, 'Examples per micro-batch.')
flags.DEFINE_integer('epochs', 5, 'Epochs of 16 updates each.')


def keras_2():
  """Keras 2: tf.keras on TensorFlow 2.15, the tf_keras package after."""
  if tf.__version__.startswith('2.15.'):
    return tf.keras
  import tf_keras  # pylint: disable=g-import-not-at-top
  return tf_keras


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  keras = keras_2()
  rng = np.random.RandomState(0)
  x = rng.randn(16 * FLAGS.grad_steps * FLAGS.micro_batch, 8).astype(
      np.float32)
  y = np.tanh(x.dot(rng.randn(8, 1))).astype(np.float32)

  model = keras.Sequential([
      keras.layers.Dense(16, activation='relu', input_shape=(8,)),
      keras.layers.Dense(1),
  ])
  optimizer = deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.01), grad_steps=FLAGS.grad_steps)
  model.compile(optimizer=optimizer, loss='mse')
  history = model.fit(x, y, batch_size=FLAGS.micro_batch,
                      epochs=FLAGS.epochs, shuffle=False, verbose=0)
  losses = history.history['loss']
  for epoch, loss in enumerate(losses):
    print('epoch %d  loss %.5f' % (epoch + 1, loss))
  print('iterations (micro-steps): %d' %
        keras.backend.get_value(model.optimizer.iterations))
  print('loss went from %.5f to %.5f' % (losses[0], losses[-1]))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
