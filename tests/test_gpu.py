"""The core cases placed on a device: on the CPU always, on a GPU where seen.

Each test takes `device`: '/CPU:0' runs wherever the suite runs (so each
test is itself checked on every machine), '/GPU:0' runs where TensorFlow
sees a GPU and is skipped with that reason elsewhere (marker `gpu`;
`tools/gpu_check` runs these on a GPU machine). Every model is built under
`tf.device(device)` with soft placement off, so that an op of the wrapper
that has no kernel for the device fails instead of moving to the CPU.
"""

import numpy as np
import pytest
import tensorflow as tf

import models
import training
import deferred_grad

GPUS = tf.config.list_physical_devices('GPU')
NO_GPU = 'needs a GPU visible to TensorFlow (none is: tools/gpu_check)'
GRAD_STEPS = 3


@pytest.fixture(params=[
    '/CPU:0',
    pytest.param('/GPU:0', marks=[pytest.mark.gpu,
                                  pytest.mark.skipif(not GPUS, reason=NO_GPU)])
], ids=['cpu', 'gpu'])
def device(request):
  return request.param


class _HardPlacement(training.Trainer):
  """A Trainer whose sessions do not move ops to another device."""

  def session(self):
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    session = tf.compat.v1.Session(graph=self.graph, config=config)
    session.run(self.init_op)
    return session


def _train(make_optimizer, data, grad_steps=None, **kwargs):
  trainer = _HardPlacement(make_optimizer, grad_steps, **kwargs)
  with trainer.session() as session:
    snapshots = trainer.run(session, data)
  return snapshots, trainer


def _assert_on(variables, device):
  kind = tf.DeviceSpec.from_string(device).device_type
  for variable in variables:
    assert tf.DeviceSpec.from_string(variable.device).device_type == kind, (
        variable.name, variable.device)


def _accumulators(trainer):
  return [trainer.optimizer.get_slot(v, 'grad_accum')
          for v in trainer.variables.values()]


@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Adam'])
def test_dense_accumulation_matches_large_batch(device, use_tpu, optimizer):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = models.make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _ = _train(make_optimizer, data, device=device)
  actual, trainer = _train(make_optimizer, data, GRAD_STEPS, device=device,
                           use_tpu=use_tpu)
  _assert_on(_accumulators(trainer), device)
  training.assert_same_training(actual, expected)


def test_sparse_accumulation_matches_large_batch(device, use_tpu):
  """Scatter-adds into a table's accumulator on the device; the record of
  touched rows stays on the host."""
  make_optimizer = models.OPTIMIZERS['Adagrad']
  data = models.make_embedding_data(models.CYCLES,
                                    GRAD_STEPS * models.MICRO_BATCH)
  expected, _ = _train(make_optimizer, data, model='embedding', device=device)
  actual, trainer = _train(make_optimizer, data, GRAD_STEPS,
                           model='embedding', device=device, use_tpu=use_tpu)
  _assert_on(_accumulators(trainer), device)
  training.assert_same_training(actual, expected)


def _half_precision_gradients(micro_steps):
  """float16 gradients of about 1e-3, and their float64 mean.

  Their means (1.6e-5) are float16 subnormals: a float16 accumulator would
  lose most of them.
  """
  rng = np.random.RandomState(0)
  gradients = (rng.randn(micro_steps, 8) * 1e-3).astype(np.float16)
  return gradients, gradients.astype(np.float64).sum(axis=0) / micro_steps


def _run(train_op, feed, gradients, fetches):
  config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
  with tf.compat.v1.Session(config=config) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    for gradient in gradients:
      session.run(train_op, {feed: gradient})
    return session.run(fetches)


def test_half_precision_variables_with_float32_accumulators(device, use_tpu):
  """float16 variables: the update is the float32 mean of 64 float16
  gradients, rounded once to float16, as numpy computes it."""
  micro_steps = 64
  gradients, exact = _half_precision_gradients(micro_steps)
  with tf.Graph().as_default(), tf.device(device):
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(8, np.float16))
    feed = tf.compat.v1.placeholder(tf.float16, [8])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), micro_steps,
        use_tpu=use_tpu, accumulator_dtype=tf.float32)
    train_op = optimizer.apply_gradients([(feed, w)])
    accumulator = optimizer.get_slot(w, 'grad_accum')
    assert accumulator.dtype.base_dtype == tf.float32
    _assert_on([w, accumulator], device)
    applied, left = _run(train_op, feed, gradients, [w, accumulator])
  np.testing.assert_array_equal(applied, (-exact).astype(np.float16))
  np.testing.assert_array_equal(left, np.zeros(8, np.float32))


@pytest.mark.parametrize('loss_scale', [128.0, 'dynamic'])
def test_float16_compute_under_a_loss_scale_optimizer(device, use_tpu,
                                                      loss_scale):
  """Mixed precision: float32 variables, float16 compute, the loss-scale
  optimizer around the wrapper; the update is the mean of the unscaled
  float16 gradients."""
  micro_steps = 64
  gradients, exact = _half_precision_gradients(micro_steps)
  with tf.Graph().as_default(), tf.device(device):
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(8, np.float32))
    feed = tf.compat.v1.placeholder(tf.float16, [8])
    wrapper = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), micro_steps,
        use_tpu=use_tpu)
    optimizer = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        wrapper, loss_scale)
    # d/dw of sum(w * g), computed in float16, is g (scaled and unscaled by
    # a power of two: exact).
    loss = tf.cast(tf.reduce_sum(tf.cast(w, tf.float16) * feed), tf.float32)
    train_op = optimizer.minimize(loss, var_list=[w])
    accumulator = wrapper.get_slot(w, 'grad_accum')
    _assert_on([w, accumulator], device)
    applied, left = _run(train_op, feed, gradients, [w, accumulator])
  np.testing.assert_allclose(applied, -exact, rtol=1e-6, atol=1e-9)
  np.testing.assert_array_equal(left, np.zeros(8, np.float32))
