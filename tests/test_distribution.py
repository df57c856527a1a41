"""GPU path under MirroredStrategy over two logical CPU devices."""

import numpy as np
import pytest
import tensorflow as tf

import conftest
from conftest import assert_same_training
from conftest import make_data
from conftest import train

REPLICAS = 2
GRAD_STEPS = 3
DEVICES = ['/cpu:0', '/cpu:1']


class MirroredTrainer(object):
  """The model trained by the wrapper, one call per replica per micro-step.

  Each replica's loss is its mean divided by the replica count, so that the
  optimizer's all-reduce (a sum) gives the mean over the global batch.
  """

  def __init__(self, make_optimizer, use_global_step=True):
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.strategy = tf.distribute.MirroredStrategy(DEVICES)
      with self.strategy.scope():
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        # [replica, rows, dim]: replica r reads its own slice.
        self.x = tf.compat.v1.placeholder(
            tf.float32, [REPLICAS, None, conftest.INPUT_DIM])
        self.y = tf.compat.v1.placeholder(
            tf.float32, [REPLICAS, None, conftest.OUTPUT_DIM])
        self.optimizer = conftest.deferred_grad.GradientAggregationOptimizer(
            make_optimizer(None), GRAD_STEPS)
        self.variables = {}

        def replica_step():
          replica = tf.distribute.get_replica_context().replica_id_in_sync_group
          loss, variables = conftest.model_loss(
              tf.gather(self.x, replica), tf.gather(self.y, replica))
          self.variables.update(variables)
          return self.optimizer.minimize(
              loss / REPLICAS,
              global_step=self.global_step if use_global_step else None)

        self.train_op = self.strategy.group(
            self.strategy.extended.call_for_each_replica(replica_step))
      self.init_op = tf.compat.v1.global_variables_initializer()

  def split(self, batch):
    return batch.reshape((REPLICAS, -1) + batch.shape[1:])

  def micro_step(self, session, x, y):
    session.run(self.train_op, {self.x: self.split(x), self.y: self.split(y)})


@pytest.mark.parametrize('use_global_step', [True, False])
@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Adam', 'Momentum'])
def test_matches_large_batch_split_across_replicas(optimizer, use_global_step):
  make_optimizer = conftest.OPTIMIZERS[optimizer]
  micro_batch = REPLICAS * conftest.MICRO_BATCH
  data = make_data(conftest.CYCLES, GRAD_STEPS * micro_batch)
  expected, _, _ = train(make_optimizer, data)
  trainer = MirroredTrainer(make_optimizer, use_global_step)
  actual = []
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    for x, y in zip(*data):
      for k in range(GRAD_STEPS):
        rows = slice(k * micro_batch, (k + 1) * micro_batch)
        trainer.micro_step(session, x[rows], y[rows])
      actual.append(session.run(trainer.variables))
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
  trainer = MirroredTrainer(conftest.OPTIMIZERS['GradientDescent'])
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
    session.run(trainer.train_op, {trainer.x: x, trainer.y: y})
    values = session.run(components)
  for replica in range(REPLICAS):
    np.testing.assert_allclose(
        values[replica],
        _replica_gradient(x[replica], y[replica]) / GRAD_STEPS,
        rtol=conftest.RTOL,
        atol=conftest.ATOL)
  assert not np.allclose(values[0], values[1])
