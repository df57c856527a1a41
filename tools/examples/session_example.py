r"""A plain tf.compat.v1.Session training script with deferred_grad.

Linear regression on generated data: each session.run is one micro-batch of
--micro_batch examples; every --grad_steps runs apply one update, as if the
batch were grad_steps * micro_batch. The learning-rate schedule is fed the
number of applied updates, not global_step (which counts micro-steps).

  python tools/examples/session_example.py --grad_steps=4 --updates=20
"""

import os

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('micro_batch', 32, 'Examples per micro-batch.')
flags.DEFINE_integer('updates', 20, 'Number of updates.')


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  rng = np.random.RandomState(0)
  true_w = rng.randn(8, 1).astype(np.float32)

  x = tf.compat.v1.placeholder(tf.float32, [None, 8])
  y = tf.compat.v1.placeholder(tf.float32, [None, 1])
  w = tf.compat.v1.get_variable('w', [8, 1], initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))

  global_step = tf.compat.v1.train.get_or_create_global_step()
  updates = deferred_grad.applied_updates(global_step, FLAGS.grad_steps)
  learning_rate = tf.compat.v1.train.exponential_decay(0.1, updates, 10, 0.5)
  optimizer = deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.5),
      grad_steps=FLAGS.grad_steps)
  train_op = optimizer.minimize(loss, global_step=global_step)

  with tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    losses = []
    for update in range(FLAGS.updates):
      micro_losses = []
      for _ in range(FLAGS.grad_steps):
        batch_x = rng.randn(FLAGS.micro_batch, 8).astype(np.float32)
        _, value = session.run([train_op, loss], {x: batch_x,
                                                  y: batch_x.dot(true_w)})
        micro_losses.append(value)
      losses.append(np.mean(micro_losses))
      print('update %d  global_step %d  loss %.5f' %
            (update + 1, session.run(global_step), losses[-1]))
  print('loss went from %.5f to %.5f' % (losses[0], losses[-1]))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  app.run(main)
