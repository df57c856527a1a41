"""GPU path under MirroredStrategy over two logical CPU devices."""

import numpy as np
import pytest
import tensorflow as tf

import conftest
from conftest import assert_same_training
from conftest import make_data
from conftest import MirroredTrainer
from conftest import train

REPLICAS = conftest.REPLICAS
GRAD_STEPS = 3


@pytest.mark.parametrize('use_global_step', [True, False])
@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Adam', 'Momentum'])
def test_matches_large_batch_split_across_replicas(optimizer, use_global_step):
  make_optimizer = conftest.OPTIMIZERS[optimizer]
  micro_batch = REPLICAS * conftest.MICRO_BATCH
  data = make_data(conftest.CYCLES, GRAD_STEPS * micro_batch)
  expected, _, _ = train(make_optimizer, data)
  trainer = MirroredTrainer(make_optimizer, GRAD_STEPS, use_global_step)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
    if use_global_step:
      assert session.run(trainer.global_step) == conftest.CYCLES * GRAD_STEPS
  assert_same_training(actual, expected)


def _replica_gradient(x, y):
  """d(loss / REPLICAS)/d(w1) of the bare model on one replica's rows."""
  graph = tf.Graph()
  with graph.as_default():
    loss, variables = conftest.model_loss(tf.constant(x), tf.constant(y))
    gradient, = tf.gradients(loss / REPLICAS, [variables['w1']])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return session.run(gradient)


def test_each_replica_keeps_its_own_accumulator():
  trainer = MirroredTrainer(conftest.OPTIMIZERS['GradientDescent'], GRAD_STEPS)
  x, y = make_data(1, REPLICAS * conftest.MICRO_BATCH)
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
        rtol=conftest.RTOL,
        atol=conftest.ATOL)
  assert not np.allclose(values[0], values[1])
