r"""A tf.compat.v1.estimator.Estimator model_fn with deferred_grad: the
recommended port.

One line of the model_fn changes: the optimizer is wrapped, with
`global_step_counts='updates'`. `global_step` then counts updates, as the
large batch counts its steps: the schedule on `global_step`, `max_steps`,
`steps`, `save_checkpoints_steps` and `save_summary_steps` stay as they were.
The input_fn yields micro-batches (the large batch divided by grad_steps).
Each `train` call stops at a cycle's end. TensorFlow logs "global step ...
has not been increased" now and then: `global_step` holds still within a
cycle. (session_example.py keeps the original's counting, micro-steps.)
The learning rate is written as a summary on apply steps only
(`applies_update`). Needs TensorFlow 2.15, the last release with
tf.estimator (`pip install ".[estimator]"`).

`log_step_count_steps` counts global_step too; a new Estimator on the same
model_dir resumes mid-cycle, ending with exactly the weights of an
uninterrupted run (tested). Checkpoints: the Estimator's
own saver keeps what `RunConfig` says; switching accumulation on or off over
a model_dir is `train(..., hooks=[deferred_grad.ConvertCheckpointHook(
model_dir)])` (see monitored_session_example.py).

With `RunConfig(train_distribute=tf.distribute.MirroredStrategy(...))` each
replica takes its own micro-batch from the input_fn, and Estimator already
scales the loss by 1/replicas for tf.compat.v1.train optimizers, so the
update is the mean over replicas * grad_steps micro-batches. Use
`cross_device_ops=tf.distribute.ReductionToOneDevice()`: on TensorFlow 2.15
this Estimator hangs at step 0 with the default cross-device ops over two
logical CPU devices, with or without this library. Multi-worker
(`train_and_evaluate`) and ps tasks: multi_worker_example.py and
parameter_server_example.py.

  python tools/examples/estimator_example.py --grad_steps=4 --updates=20
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
flags.DEFINE_string('model_dir', None, 'Checkpoint directory (default: new).')

TRUE_W = np.random.RandomState(0).randn(8, 1).astype(np.float32)


def input_fn():
  x = np.random.RandomState(1).randn(100000, 8).astype(np.float32)
  dataset = tf.data.Dataset.from_tensor_slices((x, x.dot(TRUE_W)))
  return dataset.repeat().batch(FLAGS.micro_batch)


def model_fn(features, labels, mode, params):
  w = tf.compat.v1.get_variable('w', [8, 1], initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(features, w) - labels))
  global_step = tf.compat.v1.train.get_global_step()
  learning_rate = tf.compat.v1.train.exponential_decay(
      0.1, global_step, 10, 0.5)  # as the large batch's: updates
  optimizer = deferred_grad.GradientAggregationOptimizer(     # <- wrap
      tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.5),
      grad_steps=params['grad_steps'], global_step_counts='updates')
  train_op = optimizer.minimize(loss, global_step=global_step)
  # A summary only when this micro-step applies the update.
  summary = tf.cond(
      optimizer.applies_update(),
      lambda: tf.compat.v1.summary.scalar('learning_rate', learning_rate,
                                          collections=[]),
      lambda: tf.constant(b''))
  tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SUMMARIES, summary)
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                              train_op=train_op)


def main(argv):
  del argv
  require_estimator()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
  estimator = tf.compat.v1.estimator.Estimator(
      model_fn,
      model_dir=FLAGS.model_dir or tempfile.mkdtemp(),
      params={'grad_steps': FLAGS.grad_steps})
  losses = []
  for _ in range(2):  # train in two calls, as a job that stops and resumes
    estimator.train(input_fn, steps=FLAGS.updates // 2,  # updates
                    hooks=[deferred_grad.PortCheckHook()])
    losses.append(estimator.evaluate(input_fn, steps=1)['loss'])
    print('global_step %d  loss %.5f' %
          (estimator.get_variable_value('global_step'), losses[-1]))
  print('loss went from %.5f to %.5f' % (losses[0], losses[-1]))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
