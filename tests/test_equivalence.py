"""K micro-batches through the wrapper train exactly like one K-times batch."""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
from models import make_data
from training import assert_same_training
from training import train

GRAD_STEPS = 4


@pytest.mark.parametrize('optimizer', sorted(models.OPTIMIZERS))
def test_matches_large_batch(optimizer, use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, expected_step, _ = train(make_optimizer, data)
  actual, actual_step, _ = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu)
  assert_same_training(actual, expected)
  assert expected_step == models.CYCLES
  assert actual_step == models.CYCLES * GRAD_STEPS


def test_wrong_step_for_adagrad_da_differs():
  """Guards the test above: AdagradDA reading micro-steps trains otherwise."""
  make_optimizer = models.OPTIMIZERS['AdagradDA']
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data)
  actual, _, _ = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, step_tensor='global_step')
  with pytest.raises(AssertionError):
    assert_same_training(actual, expected)


def test_learning_rate_schedule_fed_by_applied_updates(use_tpu):
  def make_optimizer(step):
    learning_rate = tf.compat.v1.train.exponential_decay(
        0.5, step, decay_steps=1, decay_rate=0.5)
    return tf.compat.v1.train.GradientDescentOptimizer(learning_rate)

  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data)
  actual, _, _ = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu)
  assert_same_training(actual, expected)
  # The same schedule fed the micro-step count decays K times too fast.
  too_fast, _, _ = train(
      make_optimizer,
      data,
      grad_steps=GRAD_STEPS,
      use_tpu=use_tpu,
      step_tensor='global_step')
  with pytest.raises(AssertionError):
    assert_same_training(too_fast, expected)


def test_applied_updates_values():
  graph = tf.Graph()
  with graph.as_default():
    step = tf.compat.v1.placeholder(tf.int64, [])
    updates = deferred_grad.applied_updates(step, 4)
    with tf.compat.v1.Session() as session:
      got = [session.run(updates, {step: s}) for s in range(10)]
  assert got == [s // 4 for s in range(10)]


def test_without_global_step(use_tpu):
  """The original crashed with global_step=None; it must still cycle."""
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Adam'], data)
  actual, _, _ = train(
      models.OPTIMIZERS['Adam'],
      data,
      grad_steps=GRAD_STEPS,
      use_tpu=use_tpu,
      use_global_step=False,
      step_tensor=None)
  assert_same_training(actual, expected)


def test_none_gradients_are_skipped(use_tpu):
  """The original failed on a variable the loss does not depend on."""
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Momentum'], data,
                         model_kwargs={'with_unused': True})
  actual, _, graph = train(
      models.OPTIMIZERS['Momentum'],
      data,
      grad_steps=GRAD_STEPS,
      use_tpu=use_tpu,
      model_kwargs={'with_unused': True})
  assert_same_training(actual, expected)
  np.testing.assert_array_equal(actual[-1]['unused'], np.ones([2]))
  names = [v.op.name for v in graph.get_collection('variables')]
  assert 'w1/GradientAccumulator' in names
  assert 'unused/GradientAccumulator' not in names


@pytest.mark.parametrize('model, second, optimizer', [
    ('mlp', 'half', 'Adam'), ('mlp', 'l2', 'GradientDescent'),
    ('embedding', 'half', 'GradientDescent'), ('embedding', 'l2', 'Adam')])
def test_a_variable_listed_twice_gets_the_sum_of_its_gradients(
    optimizer, model, second, use_tpu):
  """grads_and_vars of two losses put end to end (one model under two
  losses): the cycle applies the large batch's gradient of their sum, as
  the bare optimizer minimizing the sum. ('l2': a dense gradient beside a
  table's IndexedSlices.)"""
  make_data_fn, input_specs, loss_fn = models.MODELS[model]
  data = make_data_fn(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)

  def run(grad_steps):
    with tf.Graph().as_default():
      global_step = tf.compat.v1.train.get_or_create_global_step()
      inputs = [tf.compat.v1.placeholder(dtype, shape)
                for dtype, shape in input_specs]
      loss, variables = loss_fn(*inputs)
      extra = 0.5 * loss if second == 'half' else 0.01 * tf.add_n(
          [tf.nn.l2_loss(v) for v in variables.values()])
      opt = models.OPTIMIZERS[optimizer](global_step)
      if grad_steps is None:
        train_op = opt.minimize(loss + extra, global_step=global_step)
      else:
        opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps,
                                                         use_tpu=use_tpu)
        pairs = opt.compute_gradients(loss) + opt.compute_gradients(extra)
        train_op = opt.apply_gradients(pairs, global_step=global_step)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for cycle in range(models.CYCLES):
          parts = [np.split(part[cycle], grad_steps or 1) for part in data]
          for micro_batch in zip(*parts):
            session.run(train_op, dict(zip(inputs, micro_batch)))
        return session.run(variables)

  assert_same_training([run(GRAD_STEPS)], [run(None)])


def test_grad_steps_one_is_the_bare_optimizer(use_tpu):
  data = make_data(models.CYCLES, models.MICRO_BATCH)
  expected, expected_step, expected_graph = train(
      models.OPTIMIZERS['Adam'], data)
  actual, actual_step, graph = train(
      models.OPTIMIZERS['Adam'], data, grad_steps=1, use_tpu=use_tpu)
  assert_same_training(actual, expected, rtol=0, atol=0)
  assert actual_step == expected_step
  names = sorted(v.op.name for v in graph.get_collection('variables'))
  assert names == sorted(
      v.op.name for v in expected_graph.get_collection('variables'))


def test_variable_of_unknown_shape(use_tpu):
  """Its accumulator takes TensorFlow's zeros slot, shaped at run time."""
  learning_rate = 0.1
  start = np.array([1.0, -2.0])
  with tf.Graph().as_default():
    v = models.unknown_shape_variable(start)
    assert v.shape.rank is None
    x = tf.compat.v1.placeholder(tf.float32, [2])
    loss = tf.reduce_sum(tf.square(v - x))
    train_op = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        GRAD_STEPS, use_tpu=use_tpu).minimize(loss)
    targets = np.random.RandomState(0).randn(GRAD_STEPS, 2).astype(np.float32)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for target in targets:
        session.run(train_op, {x: target})
      actual = session.run(v)
  # One SGD step on the mean of the micro-batches' gradients 2 (v - x).
  expected = start - learning_rate * np.mean(2 * (start - targets), axis=0)
  np.testing.assert_allclose(actual, expected, rtol=1e-6)
