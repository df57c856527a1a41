"""Non-finite micro-batches, loss scaling, accumulator precision, clipping."""

import os

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import scripts
import training
from models import make_data
from training import assert_same_training
from training import MirroredTrainer
from training import train
from training import Trainer

GRAD_STEPS = 4
LEARNING_RATE = 0.1
# (cycle, micro-step) -> the poison that makes that micro-batch non-finite.
BAD = {(0, 1): np.nan, (1, 0): np.inf, (1, 3): -np.inf,
       (2, 0): np.nan, (2, 1): np.inf, (2, 2): np.nan, (2, 3): np.nan}
CYCLES = 4  # the last one is clean


def _poisoned_data(bad=None, replicas=1):
  """Linear-model data where the micro-batches in `bad` are non-finite.

  Args:
    bad: {(cycle, micro-step, replica): poison}; default BAD on replica 0.
    replicas: each micro-batch is `replicas` parts of MICRO_BATCH rows.
  """
  bad = _bad_on_replica_0() if bad is None else bad
  x, y, poison = models.make_linear_data(
      CYCLES, replicas * GRAD_STEPS * models.MICRO_BATCH)
  for (cycle, step, replica), value in bad.items():
    poison[cycle, (step * replicas + replica) * models.MICRO_BATCH] = value
  return x, y, poison


def _bad_on_replica_0():
  return {(cycle, step, 0): value for (cycle, step), value in BAD.items()}


def _good_gradients(w, x, y, poison, cycle, bad, replicas):
  """The gradients of the cycle's finite parts (a replica's rows of a step)."""
  good = []
  for step in range(GRAD_STEPS):
    for replica in range(replicas):
      start = (step * replicas + replica) * models.MICRO_BATCH
      rows = slice(start, start + models.MICRO_BATCH)
      if (cycle, step, replica) not in bad:
        good.append(models.linear_gradient(w, x[rows], y[rows], poison[rows]))
  return good


def _by_hand(data, policy, bad=None, replicas=1, clip_norm=None):
  """Weights after each cycle, in float64 numpy, for SGD.

  The update is the mean gradient over the cycle's finite parts, as `policy`
  decides, clipped to `clip_norm` (if given) as the large batch's would be.
  """
  bad = _bad_on_replica_0() if bad is None else bad
  w = models.LINEAR_INITIAL.astype(np.float64)
  snapshots = []
  for cycle, (x, y, poison) in enumerate(zip(*data)):
    good = _good_gradients(w, x, y, poison, cycle, bad, replicas)
    if ((policy == 'skip_micro_batch' and good) or
        len(good) == GRAD_STEPS * replicas):
      mean = np.mean(good, axis=0)
      if clip_norm is not None:
        mean *= min(1.0, clip_norm / np.linalg.norm(mean))
      w = w - LEARNING_RATE * mean
    snapshots.append({'w': w})
  return snapshots


def _sgd(step=None):
  del step
  return tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)


@pytest.mark.parametrize('policy, skipped_cycles', [('skip_micro_batch', 1),
                                                    ('skip_cycle', 3)])
def test_policy_matches_hand_computation(policy, skipped_cycles, use_tpu):
  data = _poisoned_data()
  trainer = Trainer(_sgd, GRAD_STEPS, model='linear', use_tpu=use_tpu,
                    nonfinite_policy=policy)
  with trainer.session() as session:
    actual = trainer.run(session, data)
    counts = session.run([trainer.optimizer.skipped_micro_batches,
                          trainer.optimizer.skipped_cycles,
                          trainer.global_step])
  assert_same_training(actual, _by_hand(data, policy))
  assert counts == [len(BAD), skipped_cycles, CYCLES * GRAD_STEPS]


def test_default_policy_is_the_originals(use_tpu):
  """Without a policy one NaN micro-batch poisons the weights, as before."""
  trainer = Trainer(_sgd, GRAD_STEPS, model='linear', use_tpu=use_tpu)
  assert trainer.optimizer.skipped_micro_batches is None
  with trainer.session() as session:
    actual = trainer.run(session, _poisoned_data())
  assert np.all(np.isnan(actual[0]['w']))


def _loss_scale_optimizer(loss_scale):
  def make(step=None):
    del step
    return tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        deferred_grad.GradientAggregationOptimizer(
            _sgd(), GRAD_STEPS), loss_scale)
  return make


def test_loss_scale_outside_without_overflow_matches_large_batch():
  data = models.make_linear_data(models.CYCLES,
                                   GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(_sgd, data, model='linear')
  trainer = Trainer(_loss_scale_optimizer(128.0), model='linear')
  trainer.micro_steps = GRAD_STEPS
  with trainer.session() as session:
    actual = trainer.run(session, data)
  assert_same_training(actual, expected)


def test_loss_scale_outside_skips_an_overflowing_micro_batch():
  """The loss-scale optimizer drops it before the wrapper sees it.

  It is neither accumulated nor counted, and the scale halves: the cycle
  of GRAD_STEPS is completed by the next good micro-batch.
  """
  x, y, poison = models.make_linear_data(1, 5 * models.MICRO_BATCH)
  x, y, poison = [part[0].reshape((5, models.MICRO_BATCH) + part.shape[2:])
                  for part in (x, y, poison)]
  poison[1, 0] = np.inf
  trainer = Trainer(_loss_scale_optimizer('dynamic'), model='linear')
  with trainer.graph.as_default():
    scale, = [v for v in trainer.optimizer.variables()
              if 'current_loss_scale' in v.name]
  with trainer.session() as session:
    initial_scale = session.run(scale)
    steps = []
    for micro_step in range(5):
      trainer.micro_step(session, x[micro_step], y[micro_step],
                         poison[micro_step])
      steps.append(session.run(trainer.global_step))
    w = session.run(trainer.variables['w'])
    assert session.run(scale) == initial_scale / 2
  assert steps == [1, 1, 2, 3, 4]
  expected = models.LINEAR_INITIAL.astype(np.float64)
  gradients = [models.linear_gradient(expected, x[i], y[i], poison[i])
               for i in [0, 2, 3, 4]]
  expected = expected - LEARNING_RATE * np.mean(gradients, axis=0)
  np.testing.assert_allclose(w, expected, rtol=training.RTOL,
                             atol=training.ATOL)


def test_float32_accumulator_for_half_precision_variables(use_tpu):
  """64 small float16 gradients: float32 sums them as float64 would."""
  micro_steps = 64
  rng = np.random.RandomState(0)
  # Gradients of about 1e-3: their means (1.6e-5) are float16 subnormals.
  gradients = (rng.randn(micro_steps, 8) * 1e-3).astype(np.float16)
  exact = gradients.astype(np.float64).sum(axis=0) / micro_steps
  errors = {}
  for dtype in [None, tf.float32]:
    graph = tf.Graph()
    with graph.as_default():
      w = tf.compat.v1.get_variable('w', initializer=np.zeros(8, np.float16))
      feed = tf.compat.v1.placeholder(tf.float16, [8])
      optimizer = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(1.0), micro_steps,
          use_tpu=use_tpu, accumulator_dtype=dtype)
      train_op = optimizer.apply_gradients([(feed, w)])
      accumulator = optimizer.get_slot(w, 'grad_accum')
      assert accumulator.dtype.base_dtype == (dtype or tf.float16)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for gradient in gradients[:-1]:
          session.run(train_op, {feed: gradient})
        accumulated = session.run(accumulator).astype(np.float64)
        session.run(train_op, {feed: gradients[-1]})
        applied = session.run(w)
    last = gradients[-1].astype(np.float64) / micro_steps
    errors[dtype] = np.max(np.abs(accumulated + last - exact) / np.abs(exact))
    if dtype is not None:
      # The float32 mean, rounded once to float16 when applied.
      np.testing.assert_array_equal(applied, (-exact).astype(np.float16))
  assert errors[tf.float32] < 1e-6
  assert errors[None] > 1e-3


CLIP_NORM = 0.05


def _clip_pairs(grads_and_vars):
  grads, variables = zip(*grads_and_vars)
  clipped, _ = tf.clip_by_global_norm(grads, CLIP_NORM)
  return list(zip(clipped, variables))


# Large-batch Momentum that clips the large batch's gradient.
_clipped_momentum = models.with_gradient_transform(
    models.OPTIMIZERS['Momentum'], _clip_pairs)


def test_clip_norm_clips_the_accumulated_gradient(use_tpu):
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(_clipped_momentum, data)
  unclipped, _, _ = train(models.OPTIMIZERS['Momentum'], data)
  actual, _, _ = train(models.OPTIMIZERS['Momentum'], data,
                       grad_steps=GRAD_STEPS, use_tpu=use_tpu,
                       clip_norm=CLIP_NORM)
  assert_same_training(actual, expected)
  with pytest.raises(AssertionError):  # the clip bites
    assert_same_training(actual, unclipped)


@pytest.mark.parametrize('clip_norm', [float('inf'), np.inf])
def test_an_infinite_clip_norm_clips_nothing(clip_norm, use_tpu):
  # tf.clip_by_global_norm(..., inf) scales by inf * 0: NaN weights.
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  unclipped, _, _ = train(models.OPTIMIZERS['Momentum'], data)
  actual, _, _ = train(models.OPTIMIZERS['Momentum'], data,
                       grad_steps=GRAD_STEPS, use_tpu=use_tpu,
                       clip_norm=clip_norm)
  assert_same_training(actual, unclipped)


def test_clip_norm_under_mirrored_strategy_uses_the_global_norm():
  """In both behaviours (under disable_v2_behavior() too)."""
  data = make_data(models.CYCLES,
                   training.REPLICAS * GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(_clipped_momentum, data)
  trainer = MirroredTrainer(models.OPTIMIZERS['Momentum'], GRAD_STEPS,
                            clip_norm=CLIP_NORM)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
  assert_same_training(actual, expected)


# (cycle, micro-step, replica) -> poison: bad parts on one replica only.
BAD_ON_REPLICA_1 = {(0, 2, 1): np.nan, (1, 0, 1): np.inf, (1, 3, 1): np.nan}


def _train_mirrored_linear(data, **wrapper_kwargs):
  """Trains the linear model under MirroredStrategy; returns the trainer too."""
  trainer = MirroredTrainer(_sgd, GRAD_STEPS, model='linear',
                            **wrapper_kwargs)
  session = tf.compat.v1.Session(graph=trainer.graph)
  session.run(trainer.init_op)
  return trainer, session, trainer.run(session, data)


@pytest.mark.parametrize('policy, skipped_cycles', [('skip_micro_batch', 0),
                                                    ('skip_cycle', 2)])
def test_policy_across_replicas(policy, skipped_cycles):
  """A bad micro-batch on replica 1 only, MirroredStrategy on two CPUs.

  skip_micro_batch: the update is the mean over every finite micro-batch of
  every replica; skip_cycle: the cycle applies nothing on any replica. The
  counters hold the totals over replicas, on every replica.
  """
  replicas = training.REPLICAS
  data = _poisoned_data(BAD_ON_REPLICA_1, replicas)
  trainer, session, actual = _train_mirrored_linear(
      data, nonfinite_policy=policy)
  with session:
    skipped, cycles = session.run([
        trainer.strategy.experimental_local_results(v)
        for v in (trainer.optimizer.skipped_micro_batches,
                  trainer.optimizer.skipped_cycles)])
  assert_same_training(actual, _by_hand(data, policy, BAD_ON_REPLICA_1,
                                        replicas))
  assert list(skipped) == [len(BAD_ON_REPLICA_1)] * replicas
  assert list(cycles) == [skipped_cycles] * replicas


@pytest.mark.parametrize('policy', ['skip_micro_batch', 'skip_cycle'])
def test_policy_with_clip_across_replicas(policy):
  replicas = training.REPLICAS
  bad = {(0, 2, 1): np.nan}
  data = _poisoned_data(bad, replicas)
  _, session, actual = _train_mirrored_linear(
      data, nonfinite_policy=policy, clip_norm=CLIP_NORM)
  session.close()
  assert_same_training(
      actual, _by_hand(data, policy, bad, replicas, clip_norm=CLIP_NORM))


def _feed_gradients(gradients, use_tpu, **wrapper_kwargs):
  """Minus w after feeding `gradients` (rows of 2) to SGD(1.0)'s wrapper."""
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
    feed = tf.compat.v1.placeholder(tf.float32, [2])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), len(gradients),
        use_tpu=use_tpu, **wrapper_kwargs)
    train_op = optimizer.apply_gradients([(feed, w)])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for gradient in gradients:
        session.run(train_op, {feed: gradient})
      return -session.run(w)


@pytest.mark.parametrize('clip_norm, expected', [(1.0, [0.6, 0.8]),
                                                 (4.5, [2.7, 3.6]),
                                                 (10.0, [3.0, 4.0])])
def test_skip_micro_batch_then_clip(clip_norm, expected, use_tpu):
  """The mean of the finite micro-batches, then clipped: as the large batch.

  Clipping sum / grad_steps and rescaling afterwards would give
  [0.8, 1.0667] (norm 1.33) for clip_norm=1, and [3, 4] unclipped for 4.5.
  """
  applied = _feed_gradients([[3, 4], [np.nan, 0], [3, 4], [3, 4]], use_tpu,
                            nonfinite_policy='skip_micro_batch',
                            clip_norm=clip_norm)
  np.testing.assert_allclose(applied, expected, rtol=1e-6)
  assert np.linalg.norm(applied) <= clip_norm * (1 + 1e-6)


def test_skip_cycle_with_clip_applies_nothing(use_tpu):
  applied = _feed_gradients([[3, 4], [np.inf, 0], [3, 4]], use_tpu,
                            nonfinite_policy='skip_cycle', clip_norm=1.0)
  np.testing.assert_array_equal(applied, [0, 0])


@pytest.mark.parametrize('policy', ['skip_micro_batch', 'skip_cycle'])
def test_policy_detects_nan_in_sparse_gradients(policy, use_tpu):
  """A NaN in an IndexedSlices' values (an embedding table's gradient)."""
  rows, dim = 6, 2
  ids = [[0, 2], [2, 5], [1, 2], [5, 5]]
  values = np.arange(16, dtype=np.float32).reshape(4, 2, dim) / 10
  values[1, 0, 1] = np.nan  # in the second micro-batch
  with tf.Graph().as_default():
    table = tf.compat.v1.get_variable(
        'table', initializer=np.ones([rows, dim], np.float32))
    ids_feed = tf.compat.v1.placeholder(tf.int32, [2])
    values_feed = tf.compat.v1.placeholder(tf.float32, [2, dim])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), len(ids),
        use_tpu=use_tpu, nonfinite_policy=policy)
    gradient = tf.IndexedSlices(values_feed, ids_feed,
                                tf.constant([rows, dim]))
    train_op = optimizer.apply_gradients([(gradient, table)])
    assert optimizer.get_slot(table, 'grad_accum') is not None
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for step_ids, step_values in zip(ids, values):
        session.run(train_op, {ids_feed: step_ids, values_feed: step_values})
      actual = session.run(table)
      skipped = session.run(optimizer.skipped_micro_batches)
  expected = np.ones([rows, dim])
  if policy == 'skip_micro_batch':
    good = [0, 2, 3]
    for step in good:
      for row, value in zip(ids[step], values[step]):
        expected[row] -= value / len(good)
  np.testing.assert_allclose(actual, expected, rtol=1e-6)
  assert skipped == 1


@scripts.run_once_per_version
@pytest.mark.parametrize('mode', ['eager', 'tf.function'])
def test_eager_and_tf_function_raise_at_the_first_call(mode, tmp_path):
  script = os.path.join(str(tmp_path), 'eager.py')
  call = ('opt.apply_gradients([(tf.ones([2]), v)])' if mode == 'eager' else
          'tf.function(lambda: opt.apply_gradients([(tf.ones([2]), v)]))()')
  with open(script, 'w') as f:
    f.write('\n'.join([
        'import tensorflow as tf, deferred_grad',
        'v = tf.Variable([1.0, 2.0])',
        'opt = deferred_grad.GradientAggregationOptimizer(',
        '    tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)',
        'try:',
        '  ' + call,
        'except Exception as e:  # pylint: disable=broad-except',
        '  print("RAISED %s:" % type(e).__name__, e)',
    ]))
  output = scripts.run_tool(script)
  # (Inside tf.function, autograph prefixes the message with "in user code".)
  assert 'RAISED RuntimeError:' in output, output
  assert ('GradientAggregationOptimizer.apply_gradients needs TensorFlow 1 '
          'style graph mode') in output, output
  # What fits the installed TensorFlow: Keras 3 (2.16+) accumulates itself.
  if deferred_grad.compat.keras_major_version() >= 3:
    assert 'offer gradient_accumulation_steps' in output, output
  else:
    assert 'have no gradient accumulation' in output, output
    assert 'TensorFlow 2.16 or later' in output, output
