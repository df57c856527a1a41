"""Suite `keras`: Keras 3's `gradient_accumulation_steps`, for comparison.

The step suite's micro-step comparison on the same 3x1024 MLP, in eager
`tf.function` steps, where `tf.keras` is Keras 3.

Results (TensorFlow 2.21.0, Keras 3.15.1, 2 cores; ratio of the mean step
over whole cycles to a bare step): SGD 12.17 ms bare, 10.86 ms with
gradient_accumulation_steps=8 (0.892); Adam 18.23 ms, 10.66 ms (0.585).
"""

import json
import os

from benchmarks import common

FLAGS = common.FLAGS


def child(spec):
  """Times Keras 3 steps with and without gradient_accumulation_steps."""
  del spec
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keras = tf.keras
  version = getattr(keras, 'version', lambda: keras.__version__)()
  if not version.startswith('3.'):
    print(json.dumps({'skipped': 'tf.keras is Keras %s, not 3' % version}))
    return
  grad_steps = FLAGS.grad_steps
  rng = np.random.RandomState(0)
  x = tf.constant(rng.randn(64, 1024).astype(np.float32))
  results = {'keras': version}
  for optimizer in ['SGD', 'Adam']:
    variants = {}
    for name, steps in [('bare', None), ('accumulating', grad_steps)]:
      model = keras.Sequential(
          [keras.Input([1024])] +
          [keras.layers.Dense(1024, activation='tanh') for _ in range(3)])
      kwargs = {'gradient_accumulation_steps': steps} if steps else {}
      opt = (keras.optimizers.SGD(0.01, **kwargs) if optimizer == 'SGD' else
             keras.optimizers.Adam(0.001, **kwargs))

      @tf.function
      def step(model=model, opt=opt):
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.square(model(x)))
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

      variants[name] = step
    # Whole cycles per round: the mean includes the apply step.
    times = common.time_interleaved(variants, steps=grad_steps)
    results[optimizer] = {
        'bare_ms': times['bare'] * 1e3,
        'accumulating_ms': times['accumulating'] * 1e3,
        'cycle_ratio': times['accumulating'] / times['bare'],
    }
  print(json.dumps(results))


def run():
  results = common.run_child('keras', '', '--grad_steps=%d' % FLAGS.grad_steps,
                             '--rounds=%d' % FLAGS.rounds)
  print('keras: %s' % results, flush=True)
  if 'skipped' in results:
    return {'keras': results}, results['skipped']
  rows = [['Keras %s, 3x1024 MLP' % results['keras'], optimizer,
           '%.3f' % results[optimizer]['bare_ms'],
           '%.3f' % results[optimizer]['accumulating_ms'],
           '%.3f' % results[optimizer]['cycle_ratio']]
          for optimizer in ['SGD', 'Adam']]
  table = common.markdown(['model', 'optimizer', 'bare step (ms)',
                           'gradient_accumulation_steps=%d, per step over '
                           'whole cycles (ms)' % FLAGS.grad_steps, 'ratio'],
                          rows)
  return {'keras': results}, table
