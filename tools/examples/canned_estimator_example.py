r"""The canned tf.compat.v1.estimator models with deferred_grad.

Pass the wrapper as the optimizer, an instance or a callable; both of
`DNNLinearCombinedClassifier`'s optimizers here. Three things to know:

* The canned heads SUM the loss over the batch (`loss_reduction=SUM`):
  the large batch's gradient is the sum of the micro-batches' gradients,
  so pass `aggregation='sum'`. The default 'mean' would apply 1/grad_steps
  of it (tested).
* `max_steps` counts micro-steps. `DNNLinearCombinedClassifier` calls
  `minimize` twice without a `global_step` and counts the step itself: each
  wrapper keeps its cycle in a counter of its own, and a learning rate that
  should follow the updates reads
  `deferred_grad.applied_updates(tf.compat.v1.train.get_global_step(), K)`
  in a callable optimizer (called inside the model_fn, where the step is).
* Every variable of a canned model is partitioned (even into one part):
  each partition of a table gets its own list of rows
  (`<table>/part_<n>/GradientAccumulator`), and a job stopped mid-cycle
  resumes exactly. The Estimator saves with its own saver, keeping what
  `RunConfig` asks for; a model_dir trained without accumulation (or
  back) resumes after one step, `train(...,
  hooks=[deferred_grad.ConvertCheckpointHook(model_dir)])`.

It trains the model twice on the same examples: (a) the bare optimizers on
batches of grad_steps * micro_batch, (b) the wrappers on micro-batches, in
two `train` calls that stop and resume mid-cycle; then prints both
evaluations and the largest weight difference. Needs TensorFlow 2.15, the
last release with tf.estimator (`pip install ".[estimator]"`).

  python tools/examples/canned_estimator_example.py --grad_steps=4
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
flags.DEFINE_integer('micro_batch', 16, 'Examples per micro-batch.')
flags.DEFINE_integer('updates', 6, 'Number of updates.')

fc = tf.compat.v1.feature_column
WORDS = ['red', 'green', 'blue', 'black', 'white']


def examples(count):
  rng = np.random.RandomState(0)
  features = {
      'word': np.array([[WORDS[i]] for i in rng.randint(5, size=count)]),
      'id': rng.randint(0, 50, size=[count, 2]).astype(np.int64),
      'x': rng.randn(count, 3).astype(np.float32),
  }
  labels = rng.randint(0, 2, size=[count, 1])
  return features, labels


def input_fn(batch_size, skip=0):
  def make():
    count = FLAGS.updates * FLAGS.grad_steps * FLAGS.micro_batch
    return tf.data.Dataset.from_tensor_slices(examples(count)).batch(
        batch_size).skip(skip)
  return make


def columns():
  word = fc.categorical_column_with_vocabulary_list('word', WORDS)
  ids = fc.categorical_column_with_hash_bucket('id', 64, dtype=tf.int64)
  linear = [word, ids, fc.crossed_column([word, 'id'], 128)]
  dnn = [fc.embedding_column(ids, 4), fc.indicator_column(word),
         fc.numeric_column('x', shape=[3])]
  return linear, dnn


def estimator(model_dir, grad_steps):
  """The canned model; with grad_steps, its optimizers wrapped."""
  def optimizer(make):
    def make_optimizer():
      step = tf.compat.v1.train.get_global_step()
      if grad_steps:  # the schedule follows the updates, not micro-steps
        step = deferred_grad.applied_updates(step, grad_steps)
      learning_rate = tf.compat.v1.train.exponential_decay(0.1, step, 4, 0.5)
      opt = make(learning_rate)
      if grad_steps:
        opt = deferred_grad.GradientAggregationOptimizer(      # <- wrap
            opt, grad_steps, aggregation='sum')                # <- SUM head
      return opt
    return make_optimizer

  linear, dnn = columns()
  return tf.compat.v1.estimator.DNNLinearCombinedClassifier(
      model_dir=model_dir,
      linear_feature_columns=linear,
      linear_optimizer=optimizer(lambda lr: tf.compat.v1.train.FtrlOptimizer(
          lr, l1_regularization_strength=0.001)),
      dnn_feature_columns=dnn, dnn_hidden_units=[8],
      dnn_optimizer=optimizer(tf.compat.v1.train.AdagradOptimizer),
      config=tf.compat.v1.estimator.RunConfig(
          tf_random_seed=1, save_checkpoints_steps=3, save_summary_steps=None,
          log_step_count_steps=None))


def main(argv):
  del argv
  require_estimator()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
  k, micro = FLAGS.grad_steps, FLAGS.micro_batch
  large = estimator(tempfile.mkdtemp(), None)
  large.train(input_fn(k * micro), max_steps=FLAGS.updates)
  model_dir = tempfile.mkdtemp()
  stop = (FLAGS.updates // 2) * k + 1  # one micro-step into a cycle
  estimator(model_dir, k).train(input_fn(micro), max_steps=stop)
  wrapped = estimator(model_dir, k)  # a new job resumes from the checkpoint
  wrapped.train(input_fn(micro, skip=stop), max_steps=FLAGS.updates * k)
  for name, model in (('(a) large batch', large),
                      ('(b) %d x %d micro-batches' % (k, micro), wrapped)):
    metrics = model.evaluate(input_fn(micro))
    print('%s: global_step %d, loss %.5f, accuracy %.3f' % (
        name, metrics['global_step'], metrics['loss'], metrics['accuracy']))
  # Each variable's difference over its largest value: float32 round-off
  # of sums over 3 x 16 examples (the heads sum the loss).
  names = [n for n in large.get_variable_names() if n != 'global_step']
  difference = max(
      np.max(np.abs(large.get_variable_value(n) - wrapped.get_variable_value(
          n))) / max(np.max(np.abs(large.get_variable_value(n))), 1e-3)
      for n in names)
  print('largest weight difference, relative to the largest weight: %.3g' %
        difference)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
