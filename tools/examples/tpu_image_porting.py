r"""Porting a TPU image model (EfficientNet, MnasNet, ResNet-RS style).

Google's TPU image models train under TPUEstimator with a `model_fn` that
does, besides the model: a learning rate scaled on the batch
(`base_lr * batch / 256`) with a warm-up and an exponential decay on
`global_step`; RMSProp; label smoothing and weight decay; batch norm, its
moving statistics updated through UPDATE_OPS; an exponential moving average
of the weights after the train op, which evaluation and export read
(`ema.variables_to_restore()`); and `host_call` summaries. Six edits port
it to micro-batches (each marked `# N.` below):

With `global_step_counts='updates'` (the README's first edit), global_step
counts updates as the large batch does: edits 3 and 6 go away (the
schedule, `max_steps` and `save_checkpoints_steps` read global_step as
before), and the moving average keeps `num_updates=global_step` inside
`once_per_update` (4.). This guide shows the default, micro-step counting.
tests/test_ported_scripts.py ports a script of this shape with the option.

1. `train_batch_size` is the micro-batch; the learning rate is scaled on
   the large batch, `grad_steps * train_batch_size`.
2. Wrap the optimizer: `deferred_grad.GradientAggregationOptimizer(opt,
   grad_steps)` (with `use_tpu=True`, `apply_crs_to_grad=FLAGS.use_tpu`
   on a TPU, as in tpu_estimator_example.py).
3. The learning rate's warm-up and decay count updates: a callable of
   `opt.applied_updates()` (global_step counts micro-steps).
4. The moving average steps once per update, counted in updates:
   `num_updates=opt.applied_updates() + 1` and `train_op =
   opt.once_per_update(train_op, lambda: ema.apply(ema_vars))` in place of
   `with tf.control_dependencies([train_op]): ema.apply(ema_vars)`.
5. Batch norm's moving statistics are updated on every micro-batch:
   `momentum ** (1 / grad_steps)` keeps their horizon in examples (the
   large batch's momentum forgets as fast per example). Normalization uses
   the micro-batch's statistics: with batch norm in training mode the
   gradients are those of micro-batches of `train_batch_size` (as ghost
   batch norm's), not of the large batch.
6. `max_steps`, `iterations_per_loop`, `save_checkpoints_steps` and the
   host_call's `global_step` count micro-steps: `grad_steps` times the
   large batch's. Summaries of counters read `opt.applied_updates()` (the
   updates before the run, wherever it is read in the run).

This script trains the model both ways under TPUEstimator(use_tpu=False),
as the large batch with the bare optimizer and as `--grad_steps`
micro-batches through the wrapper, and prints their largest differences in
weights and in moving averages, and the evaluation loss of each averaged
model. Batch norm runs in inference mode by default, so that the two are
the same computation to round-off (`--batch_norm_training`: in training
mode, where they differ by point 5). Needs TensorFlow 2.15, the last
release with TPUEstimator.

  python tools/examples/tpu_image_porting.py --grad_steps=4 --updates=6
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
flags.DEFINE_integer('micro_batch', 16, 'train_batch_size: one micro-batch.')
flags.DEFINE_integer('updates', 6, 'Updates to train.')
flags.DEFINE_float('base_learning_rate', 0.016, 'Per 256 examples.')
flags.DEFINE_float('moving_average_decay', 0.9999, 'The weights\' average.')
flags.DEFINE_float('batch_norm_momentum', 0.99, 'The large batch\'s.')
flags.DEFINE_bool('batch_norm_training', False,
                  'Batch norm in training mode (not comparable exactly).')

IMAGE, CLASSES, LABEL_SMOOTHING, WEIGHT_DECAY = 8, 10, 0.1, 1e-5
WARMUP_UPDATES, DECAY_UPDATES, DECAY_RATE = 2, 3, 0.97


def input_fn(params):
  rng = np.random.RandomState(0)
  examples = FLAGS.updates * FLAGS.grad_steps * FLAGS.micro_batch
  images = rng.randn(examples, IMAGE, IMAGE, 3).astype(np.float32)
  labels = rng.randint(0, CLASSES, size=examples).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((images, labels)).batch(
      params['batch_size'], drop_remainder=True)


def learning_rate_on(step, large_batch):
  """Linear warm-up, then exponential decay, scaled on the batch (1.)."""
  step = tf.cast(step, tf.float32)
  scaled = FLAGS.base_learning_rate * large_batch / 256.0
  decayed = tf.compat.v1.train.exponential_decay(
      scaled, step, DECAY_UPDATES, DECAY_RATE, staircase=True)
  return tf.where(step < WARMUP_UPDATES,
                  scaled * (step + 1) / WARMUP_UPDATES, decayed)


def network(images, training, momentum):
  with tf.compat.v1.variable_scope('model'):
    seeded = lambda seed: tf.compat.v1.glorot_uniform_initializer(seed=seed)
    net = tf.compat.v1.layers.conv2d(images, 8, 3, use_bias=False,
                                     kernel_initializer=seeded(1),
                                     name='stem')
    net = tf.compat.v1.layers.batch_normalization(
        net, momentum=momentum, training=training, name='stem_bn')
    net = tf.reduce_mean(tf.nn.relu(net), axis=[1, 2])
    return tf.compat.v1.layers.dense(net, CLASSES,
                                     kernel_initializer=seeded(2), name='head')


def model_fn(features, labels, mode, params):
  grad_steps = params['grad_steps']  # None: the model before porting
  large_batch = params['batch_size'] * (grad_steps or 1)  # 1.
  momentum = FLAGS.batch_norm_momentum ** (1.0 / (grad_steps or 1))  # 5.
  training = mode == tf.estimator.ModeKeys.TRAIN
  logits = network(features, training and FLAGS.batch_norm_training,
                   momentum)
  loss = tf.compat.v1.losses.softmax_cross_entropy(
      tf.one_hot(labels, CLASSES), logits, label_smoothing=LABEL_SMOOTHING)
  loss += WEIGHT_DECAY * tf.add_n([
      tf.nn.l2_loss(v) for v in tf.compat.v1.trainable_variables()
      if 'batch_normalization' not in v.name and '_bn' not in v.name])
  ema_vars = tf.compat.v1.trainable_variables()
  if mode == tf.estimator.ModeKeys.EVAL:  # evaluates the averaged weights
    ema = tf.compat.v1.train.ExponentialMovingAverage(
        FLAGS.moving_average_decay)
    saver = tf.compat.v1.train.Saver(ema.variables_to_restore())
    return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
        mode, loss=loss, scaffold_fn=lambda: tf.compat.v1.train.Scaffold(
            saver=saver))

  global_step = tf.compat.v1.train.get_global_step()
  if grad_steps is None:
    learning_rate = learning_rate_on(global_step, large_batch)
    optimizer = tf.compat.v1.train.RMSPropOptimizer(
        learning_rate, decay=0.9, momentum=0.9, epsilon=1e-3)
  else:
    optimizer = deferred_grad.GradientAggregationOptimizer(  # 2.
        tf.compat.v1.train.RMSPropOptimizer(
            lambda: learning_rate_on(optimizer.applied_updates(),  # 3.
                                     large_batch),
            decay=0.9, momentum=0.9, epsilon=1e-3),
        grad_steps=grad_steps, use_tpu=True)
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = optimizer.minimize(loss, global_step)

  if grad_steps is None:
    ema = tf.compat.v1.train.ExponentialMovingAverage(
        FLAGS.moving_average_decay, num_updates=global_step)
    with tf.control_dependencies([train_op]):
      train_op = ema.apply(ema_vars)
    updates = global_step
  else:
    updates = optimizer.applied_updates() + 1  # 4. (and 6.)
    ema = tf.compat.v1.train.ExponentialMovingAverage(
        FLAGS.moving_average_decay, num_updates=updates)
    train_op = optimizer.once_per_update(train_op,
                                         lambda: ema.apply(ema_vars))
    learning_rate = learning_rate_on(optimizer.applied_updates(),
                                     large_batch)

  def host_call_fn(updates, learning_rate, loss):
    writer = tf.compat.v2.summary.create_file_writer(params['model_dir'])
    with writer.as_default(), tf.compat.v2.summary.record_if(True):
      tf.compat.v2.summary.scalar('learning_rate', learning_rate[0],
                                  step=updates[0])
      tf.compat.v2.summary.scalar('loss', loss[0], step=updates[0])
      return tf.compat.v1.summary.all_v2_summary_ops()

  host_call = (host_call_fn, [tf.reshape(tf.cast(updates, tf.int64), [1]),
                              tf.reshape(learning_rate, [1]),
                              tf.reshape(loss, [1])])
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
      mode, loss=loss, train_op=train_op, host_call=host_call)


def train(grad_steps):
  """Trains the model; returns (weights, averages, eval loss)."""
  steps = FLAGS.updates * (grad_steps or 1)  # 6.
  batch = FLAGS.micro_batch * (FLAGS.grad_steps if grad_steps is None else 1)
  model_dir = tempfile.mkdtemp()
  tpu = tf.compat.v1.estimator.tpu
  estimator = tpu.TPUEstimator(
      model_fn,
      config=tpu.RunConfig(
          model_dir=model_dir, save_summary_steps=None,
          log_step_count_steps=10**6,
          tpu_config=tpu.TPUConfig(iterations_per_loop=grad_steps or 1)),
      train_batch_size=batch, eval_batch_size=FLAGS.micro_batch,
      use_tpu=False,
      params={'grad_steps': grad_steps, 'model_dir': model_dir})
  # Names a moving average left after the train op, or a stop mid-cycle.
  estimator.train(input_fn, max_steps=steps,
                  hooks=[deferred_grad.PortCheckHook()])
  names = [name for name in estimator.get_variable_names()
           if name.startswith('model/') and '/RMSProp' not in name and
           'GradientAccumulator' not in name]
  weights = {n: estimator.get_variable_value(n) for n in names
             if not n.endswith('ExponentialMovingAverage')}
  averages = {n: estimator.get_variable_value(n) for n in names
              if n.endswith('ExponentialMovingAverage')}
  loss = estimator.evaluate(input_fn, steps=1)['loss']
  return weights, averages, loss


def _largest(a, b):
  assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
  return max(float(np.max(np.abs(a[n] - b[n]))) for n in a)


def main(argv):
  del argv
  require_estimator()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  large = train(None)
  micro = train(FLAGS.grad_steps)
  print('large batch of %d: %d updates; %d micro-batches of %d per update: '
        '%d micro-steps' % (FLAGS.grad_steps * FLAGS.micro_batch,
                            FLAGS.updates, FLAGS.grad_steps,
                            FLAGS.micro_batch,
                            FLAGS.updates * FLAGS.grad_steps))
  print('largest weight difference: %.3g' % _largest(large[0], micro[0]))
  print('largest moving average difference: %.3g' %
        _largest(large[1], micro[1]))
  print('eval loss of the averaged weights: large batch %.6f, deferred_grad '
        '%.6f' % (large[2], micro[2]))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
