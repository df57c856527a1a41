"""Drop-in for Estimator and TPUEstimator (TensorFlow 2.15, the last with them).

Each test trains the same Estimator twice on the same examples in the same
order: with the wrapper on micro-batches of MICRO_BATCH, and with the bare
optimizer on batches GRAD_STEPS (times replicas) larger.
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import training
from models import make_data

pytestmark = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')

GRAD_STEPS = 3
CYCLES = 3
VARIABLES = ['b1', 'b2', 'w1', 'w2']


def _examples(batches, batch_size):
  x, y = make_data(1, batches * batch_size)
  return x[0], y[0]


def _input_fn(examples, batch_size, skip_batches=0):
  def input_fn(params=None):
    del params
    return tf.data.Dataset.from_tensor_slices(examples).batch(batch_size).skip(
        skip_batches)
  return input_fn


def _train_op(loss, params):
  """The wrapper (if params['grad_steps']) around a Momentum optimizer."""
  optimizer = models.OPTIMIZERS['Momentum'](None)
  if params['grad_steps']:
    optimizer = deferred_grad.GradientAggregationOptimizer(
        optimizer, params['grad_steps'], use_tpu=params['use_tpu'])
  return optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())


def _model_fn(features, labels, mode, params):
  loss, _ = models.model_loss(features, labels)
  return tf.compat.v1.estimator.EstimatorSpec(
      mode, loss=loss, train_op=_train_op(loss, params))


def _tpu_model_fn(features, labels, mode, params):
  loss, _ = models.model_loss(features, labels)
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
      mode, loss=loss, train_op=_train_op(loss, params))


def _run_config(model_dir, **kwargs):
  return tf.compat.v1.estimator.RunConfig(
      model_dir=model_dir,
      save_summary_steps=None,
      log_step_count_steps=10**6,
      **kwargs)


def _estimator(model_dir, grad_steps, use_tpu=False, **config):
  return tf.compat.v1.estimator.Estimator(
      _model_fn,
      config=_run_config(model_dir, **config),
      params={'grad_steps': grad_steps, 'use_tpu': use_tpu})


def _weights(estimator):
  return {name: estimator.get_variable_value(name) for name in VARIABLES}


def _large_batch_weights(tmp_path, batch_size):
  examples = _examples(CYCLES, batch_size)
  estimator = _estimator(str(tmp_path / 'large'), None)
  estimator.train(_input_fn(examples, batch_size), max_steps=CYCLES)
  assert estimator.get_variable_value('global_step') == CYCLES
  return _weights(estimator), examples


def test_estimator_matches_large_batch(tmp_path, use_tpu):
  expected, examples = _large_batch_weights(
      tmp_path, GRAD_STEPS * models.MICRO_BATCH)
  estimator = _estimator(str(tmp_path / 'micro'), GRAD_STEPS, use_tpu)
  estimator.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  assert estimator.get_variable_value('global_step') == CYCLES * GRAD_STEPS
  training.assert_same_training([_weights(estimator)], [expected])


def test_tpu_estimator_on_cpu_matches_large_batch(tmp_path, use_tpu):
  expected, examples = _large_batch_weights(
      tmp_path, GRAD_STEPS * models.MICRO_BATCH)
  tpu = tf.compat.v1.estimator.tpu
  estimator = tpu.TPUEstimator(
      _tpu_model_fn,
      config=tpu.RunConfig(
          model_dir=str(tmp_path / 'tpu'),
          save_summary_steps=None,
          log_step_count_steps=10**6,
          tpu_config=tpu.TPUConfig(iterations_per_loop=1)),
      train_batch_size=models.MICRO_BATCH,
      use_tpu=False,
      params={'grad_steps': GRAD_STEPS, 'use_tpu': use_tpu})
  estimator.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  assert estimator.get_variable_value('global_step') == CYCLES * GRAD_STEPS
  training.assert_same_training([_weights(estimator)], [expected])


def test_estimator_mirrored_strategy_matches_large_batch(tmp_path):
  """Each replica takes its own micro-batch from the dataset.

  Estimator scales the loss by 1/replicas for TF1 optimizers, so the
  all-reduced sum is the mean over all replicas' examples. The default
  cross-device ops hang this Estimator at step 0 even without the wrapper.
  """
  replicas = 2
  expected, examples = _large_batch_weights(
      tmp_path, replicas * GRAD_STEPS * models.MICRO_BATCH)
  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:0', '/cpu:1'],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  estimator = _estimator(
      str(tmp_path / 'mirrored'), GRAD_STEPS, train_distribute=strategy)
  estimator.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  assert estimator.get_variable_value('global_step') == CYCLES * GRAD_STEPS
  training.assert_same_training([_weights(estimator)], [expected])


def test_resume_mid_cycle_equals_uninterrupted(tmp_path, use_tpu):
  total = CYCLES * GRAD_STEPS
  stop = GRAD_STEPS + 1  # one micro-step into the second cycle
  examples = _examples(total, models.MICRO_BATCH)
  uninterrupted = _estimator(str(tmp_path / 'whole'), GRAD_STEPS, use_tpu)
  uninterrupted.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=total)

  model_dir = str(tmp_path / 'resumed')
  first = _estimator(model_dir, GRAD_STEPS, use_tpu)
  first.train(_input_fn(examples, models.MICRO_BATCH), max_steps=stop)
  accumulator = first.get_variable_value('w1/GradientAccumulator')
  assert np.any(accumulator != 0)  # the checkpoint holds half a cycle
  second = _estimator(model_dir, GRAD_STEPS, use_tpu)
  second.train(
      _input_fn(examples, models.MICRO_BATCH, skip_batches=stop),
      max_steps=total)
  assert second.get_variable_value('global_step') == total
  training.assert_same_training([_weights(second)], [_weights(uninterrupted)],
                                rtol=0, atol=0)


def test_estimator_mirrored_strategy_resumes_mid_cycle(tmp_path):
  """Each replica's partial sum is in the checkpoint (as the sum)."""
  replicas = 2
  total = CYCLES * GRAD_STEPS
  stop = GRAD_STEPS + 1  # one micro-step into the second cycle
  examples = _examples(replicas * total, models.MICRO_BATCH)

  def mirrored(model_dir):
    strategy = tf.distribute.MirroredStrategy(
        ['/cpu:0', '/cpu:1'],
        cross_device_ops=tf.distribute.ReductionToOneDevice())
    return _estimator(model_dir, GRAD_STEPS, train_distribute=strategy)

  uninterrupted = mirrored(str(tmp_path / 'whole'))
  uninterrupted.train(_input_fn(examples, models.MICRO_BATCH),
                      max_steps=total)
  model_dir = str(tmp_path / 'resumed')
  mirrored(model_dir).train(_input_fn(examples, models.MICRO_BATCH),
                            max_steps=stop)
  second = mirrored(model_dir)
  # Each micro-step takes one micro-batch per replica.
  second.train(_input_fn(examples, models.MICRO_BATCH,
                         skip_batches=replicas * stop), max_steps=total)
  assert second.get_variable_value('global_step') == total
  training.assert_same_training([_weights(second)], [_weights(uninterrupted)])
