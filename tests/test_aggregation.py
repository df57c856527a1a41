"""How micro-batches combine: weighted mean (token counts), mean, or sum.

A masked-LM style loss is a mean over a micro-batch's tokens, and micro-
batches hold different numbers of tokens (3, 7, 1 and 5 here): the plain mean
of micro-batch means is not the large batch's token mean; weighting each
micro-batch by its token count is.
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import training
from training import assert_same_training
from training import MirroredTrainer
from training import train

GRAD_STEPS = len(models.TOKEN_COUNTS)
CYCLES = 3
OPTIMIZERS = ['GradientDescent', 'Momentum', 'Adam']


def _token_data(replicas=1):
  return models.make_token_data(
      CYCLES, replicas * GRAD_STEPS * models.MAX_TOKENS)


@pytest.mark.parametrize('model', ['tokens', 'token_embedding'])
@pytest.mark.parametrize('optimizer', OPTIMIZERS)
def test_weighted_by_tokens_is_the_large_batch_token_mean(optimizer, model,
                                                          use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = _token_data()
  expected, _, _ = train(make_optimizer, data, model=model)
  actual, _, _ = train(make_optimizer, data, grad_steps=GRAD_STEPS,
                       model=model, use_tpu=use_tpu,
                       weight_fn=models.token_weight)
  assert_same_training(actual, expected)


def test_unweighted_mean_of_token_means_differs(use_tpu):
  """Guards the test above: without weights the result is another."""
  data = _token_data()
  expected, _, _ = train(models.OPTIMIZERS['Momentum'], data, model='tokens')
  actual, _, _ = train(models.OPTIMIZERS['Momentum'], data,
                       grad_steps=GRAD_STEPS, model='tokens', use_tpu=use_tpu)
  with pytest.raises(AssertionError):
    assert_same_training(actual, expected)


@pytest.mark.parametrize('model', ['tokens', 'token_embedding'])
@pytest.mark.parametrize('optimizer', OPTIMIZERS)
def test_weights_add_up_over_replicas(optimizer, model):
  """Each replica its own micro-batch and token count, MirroredStrategy."""
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = _token_data(training.REPLICAS)
  expected, _, _ = train(make_optimizer, data, model=model)
  trainer = MirroredTrainer(make_optimizer, GRAD_STEPS, model=model,
                            weight_fn=models.token_weight)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
  assert_same_training(actual, expected)


@pytest.mark.parametrize('grad_steps', [1, GRAD_STEPS])
def test_weights_with_a_policy_and_clipping(grad_steps, use_tpu):
  """A skipped micro-batch's tokens do not count; the weighted mean is clipped.

  Weights 3, 7, 1, 5 on gradients g_i, the second one non-finite.
  """
  gradients = np.array([[1., 2.], [np.nan, 0.], [4., -2.], [0.5, 0.5]],
                       np.float32)[:grad_steps]
  weights = np.array([3., 7., 1., 5.], np.float32)[:grad_steps]
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
    feed = tf.compat.v1.placeholder(tf.float32, [2])
    weight = tf.compat.v1.placeholder(tf.float32, [])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), grad_steps,
        use_tpu=use_tpu, nonfinite_policy='skip_micro_batch', clip_norm=1.0,
        micro_batch_weight=weight)
    train_op = optimizer.apply_gradients([(feed, w)])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for g, n in zip(gradients, weights):
        session.run(train_op, {feed: g, weight: n})
      applied = -session.run(w)
  expected = np.zeros(2)
  for start in range(0, len(gradients), grad_steps):
    g = gradients[start:start + grad_steps]
    n = weights[start:start + grad_steps]
    finite = np.all(np.isfinite(g), axis=1)
    if finite.any():
      mean = (n[finite, None] * g[finite]).sum(0) / n[finite].sum()
      expected += mean * min(1.0, 1.0 / np.linalg.norm(mean))
  np.testing.assert_allclose(applied, expected, rtol=1e-6)


def _float64_cycles(gradients, weights, replicas, use_tpu,
                    weight_dtype=tf.float32, momentum=None, **wrapper_kwargs):
  """What SGD(1) through the wrapper applies, in float64, per cycle.

  gradients: [cycles, grad_steps, replicas, 2]; weights: the same without
  the last axis, or None, fed in `weight_dtype`. Replica r's loss is
  sum(w * g) / replicas, as under any strategy, so its gradient is
  g / replicas. With `momentum`, Momentum(1, momentum) in place of SGD.
  """
  cycles, grad_steps = gradients.shape[:2]
  strategy = (tf.distribute.MirroredStrategy(
      ['/cpu:%d' % i for i in range(replicas)]) if replicas > 1 else
              tf.distribute.get_strategy())
  with tf.Graph().as_default(), strategy.scope():
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float64))
    feed = tf.compat.v1.placeholder(tf.float64, [replicas, 2])
    weight_feed = tf.compat.v1.placeholder(weight_dtype, [replicas])

    def replica_id():
      return tf.distribute.get_replica_context().replica_id_in_sync_group

    if weights is not None:
      wrapper_kwargs['micro_batch_weight'] = (
          lambda: tf.gather(weight_feed, replica_id()))
    wrapped = (tf.compat.v1.train.GradientDescentOptimizer(1.0)
               if momentum is None else
               tf.compat.v1.train.MomentumOptimizer(1.0, momentum))
    optimizer = deferred_grad.GradientAggregationOptimizer(
        wrapped, grad_steps, use_tpu=use_tpu, **wrapper_kwargs)

    def replica_step():
      loss = tf.reduce_sum(w * tf.gather(feed, replica_id())) / replicas
      return optimizer.minimize(loss)

    train_op = strategy.group(
        strategy.extended.call_for_each_replica(replica_step))
    applied = []
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for cycle in range(cycles):
        before = session.run(w)
        for step in range(grad_steps):
          feeds = {feed: gradients[cycle, step]}
          if weights is not None:
            feeds[weight_feed] = weights[cycle, step]
          session.run(train_op, feeds)
        applied.append(before - session.run(w))
  return np.array(applied)


# The TPU path runs one replica per TPU core, not under MirroredStrategy.
PATHS_AND_REPLICAS = [(False, 1), (True, 1), (False, 2)]


@pytest.mark.parametrize('use_tpu, replicas', PATHS_AND_REPLICAS)
def test_float64_weighted_cycles_are_the_token_mean(use_tpu, replicas):
  """Every factor is computed in the accumulator's dtype: float64 here.

  Token counts 3, 7, 1 (and 2, 5, 4 on a second replica): the factor
  grad_steps * replicas / sum(w) (3/11, 6/22) is not a float32 number.
  """
  rng = np.random.RandomState(0)
  gradients = rng.randn(2, 3, replicas, 2)
  weights = np.array([[3., 2.], [7., 5.], [1., 4.]], np.float32)[:, :replicas]
  weights = np.stack([weights, weights[::-1]])
  applied = _float64_cycles(gradients, weights, replicas, use_tpu)
  for cycle in range(2):
    n = weights[cycle].astype(np.float64)[..., None]
    expected = (n * gradients[cycle]).sum((0, 1)) / n.sum()
    np.testing.assert_allclose(applied[cycle], expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize('momentum', [None, 0.5], ids=['SGD', 'Momentum'])
@pytest.mark.parametrize('use_tpu, replicas', PATHS_AND_REPLICAS)
def test_float64_fractional_weights_are_the_weighted_mean(use_tpu, replicas,
                                                          momentum):
  """Weights from 0.3 to 3.0, fed in float64: the cycle's weight sum is
  kept in the accumulator's dtype, so float64 holds to 1e-12."""
  rng = np.random.RandomState(2)
  gradients = rng.randn(3, 3, replicas, 2)
  weights = rng.uniform(0.3, 3.0, size=(3, 3, replicas))
  applied = _float64_cycles(gradients, weights, replicas, use_tpu,
                            weight_dtype=tf.float64, momentum=momentum)
  velocity = np.zeros(2)
  for cycle in range(3):
    n = weights[cycle][..., None]
    mean = (n * gradients[cycle]).sum((0, 1)) / n.sum()
    velocity = (momentum or 0.0) * velocity + mean
    np.testing.assert_allclose(applied[cycle], velocity, rtol=1e-12, atol=0)


@pytest.mark.parametrize('use_tpu, replicas, bad', [
    (False, 1, [(0, 1, 0)]),
    (True, 1, [(0, 1, 0)]),
    (False, 2, [(0, 1, 0)]),
    # Fewer finite micro-batches than replicas: the mean is over that one.
    (False, 2, [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 0, 1), (0, 1, 1)]),
])
def test_float64_skip_micro_batch_is_the_mean_of_the_finite_ones(
    use_tpu, replicas, bad):
  """With one bad micro-batch of 3 (of 6) the factor is 3/2 (6/5)."""
  rng = np.random.RandomState(1)
  gradients = rng.randn(2, 3, replicas, 2)
  for cycle, step, replica in bad:
    gradients[cycle, step, replica, 0] = np.nan
  applied = _float64_cycles(gradients, None, replicas, use_tpu,
                            nonfinite_policy='skip_micro_batch')
  for cycle in range(2):
    finite = gradients[cycle].reshape(-1, 2)
    finite = finite[np.all(np.isfinite(finite), axis=1)]
    np.testing.assert_allclose(applied[cycle], finite.mean(0), rtol=1e-12,
                               atol=0)


def test_zero_weight_cycle_applies_nothing(use_tpu):
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.ones(2, np.float32))
    feed = tf.compat.v1.placeholder(tf.float32, [2])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(1.0, 0.9), 2, use_tpu=use_tpu,
        micro_batch_weight=tf.constant(0.0))
    train_op = optimizer.apply_gradients([(feed, w)])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(4):
        session.run(train_op, {feed: [1.0, 2.0]})
      np.testing.assert_array_equal(session.run(w), [1.0, 1.0])


def _scaled_loss(make_optimizer, factor):
  """A factory whose optimizers minimize `factor` times the loss."""
  return models.with_gradient_transform(
      make_optimizer,
      lambda pairs: [(g * factor, v) for g, v in pairs])


@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Momentum'])
def test_sum_is_grad_steps_times_the_mean(optimizer, use_tpu):
  """aggregation='sum' trains as the large batch with the loss times K."""
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = models.make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(_scaled_loss(make_optimizer, GRAD_STEPS), data)
  actual, _, _ = train(make_optimizer, data, grad_steps=GRAD_STEPS,
                       use_tpu=use_tpu, aggregation='sum')
  assert_same_training(actual, expected)


def test_weighted_sum_is_the_token_sum(use_tpu):
  """'sum' with token weights: the gradient of the large batch's token sum."""
  data = _token_data()
  tokens_per_cycle = sum(models.TOKEN_COUNTS)
  expected, _, _ = train(_scaled_loss(models.OPTIMIZERS['GradientDescent'],
                                      tokens_per_cycle), data, model='tokens')
  actual, _, _ = train(models.OPTIMIZERS['GradientDescent'], data,
                       grad_steps=GRAD_STEPS, model='tokens', use_tpu=use_tpu,
                       aggregation='sum', weight_fn=models.token_weight)
  assert_same_training(actual, expected)


def test_sum_with_loss_scaling_outermost():
  """The loss-scale optimizer unscales each micro-batch before the sum."""
  data = models.make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(_scaled_loss(models.OPTIMIZERS['GradientDescent'],
                                      GRAD_STEPS), data)

  def make(step=None):
    del step
    return tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        deferred_grad.GradientAggregationOptimizer(
            models.OPTIMIZERS['GradientDescent'](None), GRAD_STEPS,
            aggregation='sum'), 128.0)

  trainer = training.Trainer(make)
  trainer.micro_steps = GRAD_STEPS
  with trainer.session() as session:
    actual = trainer.run(session, data)
  assert_same_training(actual, expected)
