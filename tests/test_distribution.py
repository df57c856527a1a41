"""GPU path under MirroredStrategy over two logical CPU devices."""

import numpy as np
import pytest
import tensorflow as tf

import models
import training
from models import make_data
from training import assert_same_training
from training import MirroredTrainer
from training import train

REPLICAS = training.REPLICAS
GRAD_STEPS = 3


@pytest.mark.parametrize('use_global_step', [True, False])
@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Adam', 'Momentum'])
def test_matches_large_batch_split_across_replicas(optimizer, use_global_step):
  make_optimizer = models.OPTIMIZERS[optimizer]
  micro_batch = REPLICAS * models.MICRO_BATCH
  data = make_data(models.CYCLES, GRAD_STEPS * micro_batch)
  expected, _, _ = train(make_optimizer, data)
  trainer = MirroredTrainer(make_optimizer, GRAD_STEPS, use_global_step)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
    if use_global_step:
      assert session.run(trainer.global_step) == models.CYCLES * GRAD_STEPS
  assert_same_training(actual, expected)


def _replica_gradient(x, y):
  """d(loss / REPLICAS)/d(w1) of the bare model on one replica's rows."""
  graph = tf.Graph()
  with graph.as_default():
    loss, variables = models.model_loss(tf.constant(x), tf.constant(y))
    gradient, = tf.gradients(loss / REPLICAS, [variables['w1']])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(gradient)


def test_each_replica_keeps_its_own_accumulator():
  trainer = MirroredTrainer(models.OPTIMIZERS['GradientDescent'], GRAD_STEPS)
  x, y = make_data(1, REPLICAS * models.MICRO_BATCH)
  x, y = trainer.split(x[0]), trainer.split(y[0])
  with trainer.graph.as_default():
    accumulator = trainer.optimizer.get_slot(trainer.variables['w1'],
                                             'grad_accum')
    components = trainer.strategy.experimental_local_results(accumulator)
  assert [c.device.split('/', 2)[-1] for c in components] == [
      'task:0/device:CPU:%d' % i for i in range(REPLICAS)
  ]
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    session.run(trainer.train_op, dict(zip(trainer.inputs, (x, y))))
    values = session.run(components)
  for replica in range(REPLICAS):
    np.testing.assert_allclose(
        values[replica],
        _replica_gradient(x[replica], y[replica]) / GRAD_STEPS,
        rtol=training.RTOL,
        atol=training.ATOL)
  assert not np.allclose(values[0], values[1])


def _on_two_devices(op):
  if op.type in ('VarHandleOp', 'VariableV2'):
    return '/cpu:1' if op.name.startswith(('w2', 'b2')) else '/cpu:0'
  return ''


def _on_the_second_device(op):
  return '/cpu:1' if op.type in ('VarHandleOp', 'VariableV2') else ''


@pytest.mark.parametrize('placement', [_on_two_devices, _on_the_second_device])
def test_variables_on_other_devices_match_large_batch(placement, use_tpu):
  """As with parameter servers: variables on several devices, or on one
  that is not the first, where the apply branch must find them."""
  make_optimizer = models.OPTIMIZERS['Momentum']
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data)
  actual, _, _ = train(make_optimizer, data, grad_steps=GRAD_STEPS,
                       use_tpu=use_tpu, device=placement)
  assert_same_training(actual, expected)
