r"""A TPUEstimator model_fn with deferred_grad's TPU path (use_tpu=True).

On a TPU, run with --use_tpu and a TPU cluster in the RunConfig, and
combine the cores' gradients either with a CrossShardOptimizer as the wrapped
optimizer or with apply_crs_to_grad=True (a sum: divide the loss by the
number of cores), not both. apply_crs_to_grad follows use_tpu: the
cross-replica sum runs only on a TPU. Without --use_tpu,
TPUEstimator(use_tpu=False) runs the same model_fn on the CPU. Needs
TensorFlow 2.15, the last release with TPUEstimator
(`pip install ".[estimator]"`).

`train_batch_size` is the micro-batch; `max_steps` and
`iterations_per_loop` count micro-steps. A CrossShardOptimizer as the
wrapped optimizer scales the loss by 1/cores and sums on the apply step;
`apply_crs_to_grad=True` sums the accumulated gradients as they are (divide
the loss by the number of cores yourself for a mean). `TPUEstimator(
use_tpu=False)` runs the same model_fn on the CPU (tested with both of the
wrapper's paths). Built outside a TPU computation, `apply_crs_to_grad=True`
raises a ValueError at graph build that says so. XLA and sharding: see
xla_example.py.

  python tools/examples/tpu_estimator_example.py --grad_steps=4 --updates=20
"""

import os
import tempfile

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
from estimator_check import require_estimator
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('micro_batch', 32, 'Examples per micro-batch.')
flags.DEFINE_integer('updates', 20, 'Number of updates.')
flags.DEFINE_bool('use_tpu', False, 'Run on a TPU (needs one in the config).')

TRUE_W = np.random.RandomState(0).randn(8, 1).astype(np.float32)


def input_fn(params):
  x = np.random.RandomState(1).randn(100000, 8).astype(np.float32)
  dataset = tf.data.Dataset.from_tensor_slices((x, x.dot(TRUE_W)))
  return dataset.repeat().batch(params['batch_size'], drop_remainder=True)


def model_fn(features, labels, mode, params):
  w = tf.compat.v1.get_variable('w', [8, 1], initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(features, w) - labels))
  optimizer = deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.AdamOptimizer(0.1),
      grad_steps=params['grad_steps'],
      use_tpu=True,                              # the wrapper's TPU path
      apply_crs_to_grad=params['use_tpu'])       # only on a real TPU
  train_op = optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(mode, loss=loss,
                                                     train_op=train_op)


def main(argv):
  del argv
  require_estimator()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
  tpu = tf.compat.v1.estimator.tpu
  estimator = tpu.TPUEstimator(
      model_fn,
      config=tpu.RunConfig(
          model_dir=tempfile.mkdtemp(),
          tpu_config=tpu.TPUConfig(iterations_per_loop=FLAGS.grad_steps)),
      train_batch_size=FLAGS.micro_batch,
      eval_batch_size=FLAGS.micro_batch,
      use_tpu=FLAGS.use_tpu,
      params={'grad_steps': FLAGS.grad_steps, 'use_tpu': FLAGS.use_tpu})
  losses = []
  for _ in range(2):
    estimator.train(input_fn, steps=FLAGS.updates * FLAGS.grad_steps // 2)
    losses.append(estimator.evaluate(input_fn, steps=1)['loss'])
    print('global_step %d  loss %.5f' %
          (estimator.get_variable_value('global_step'), losses[-1]))
  print('loss went from %.5f to %.5f' % (losses[0], losses[-1]))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
