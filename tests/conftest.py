"""Shared set-up and helpers for the deferred_grad tests.

TensorFlow's behaviour mode is process-wide, so the test runner starts pytest
once per mode: DEFERRED_GRAD_TF_BEHAVIOR=v2 (`disable_eager_execution()`:
resource variables, control flow v2) or v1 (`disable_v2_behavior()`: ref
variables, control flow v1, as legacy scripts run).
"""

import os
import re
import subprocess
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import pytest
import tensorflow as tf

# Two logical CPUs for MirroredStrategy: must happen before TF sets up devices.
_CPU = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(
    _CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

BEHAVIOR = os.environ.get('DEFERRED_GRAD_TF_BEHAVIOR', 'v2')
if BEHAVIOR == 'v1':
  tf.compat.v1.disable_v2_behavior()
elif BEHAVIOR == 'v2':
  tf.compat.v1.disable_eager_execution()
else:
  raise ValueError('DEFERRED_GRAD_TF_BEHAVIOR must be v1 or v2, got %r' %
                   BEHAVIOR)

import deferred_grad
# pylint: enable=g-import-not-at-top,wrong-import-position

INPUT_DIM, HIDDEN_DIM, OUTPUT_DIM = 4, 5, 3
MICRO_BATCH = 3
CYCLES = 3
# Errors of float32 round-off between summing micro-batch means and taking
# one large-batch mean; measured differences are below 1e-6.
RTOL, ATOL = 1e-5, 1e-6

_l1_l2 = dict(l1_regularization_strength=0.001, l2_regularization_strength=0.01)

# Every tf.compat.v1.train optimizer that takes dense gradients. Each factory
# receives the step tensor that step-dependent optimizers read: the global
# step for large-batch training, `applied_updates` for the wrapper.
OPTIMIZERS = {
    'GradientDescent':
        lambda step: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    'Momentum':
        lambda step: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    'Nesterov':
        lambda step: tf.compat.v1.train.MomentumOptimizer(
            0.1, 0.9, use_nesterov=True),
    'Adam':
        lambda step: tf.compat.v1.train.AdamOptimizer(0.01),
    'Adagrad':
        lambda step: tf.compat.v1.train.AdagradOptimizer(0.1),
    'AdagradDA':
        lambda step: tf.compat.v1.train.AdagradDAOptimizer(
            0.1, global_step=step, **_l1_l2),
    'RMSProp':
        lambda step: tf.compat.v1.train.RMSPropOptimizer(0.01),
    'RMSPropMomentum':
        lambda step: tf.compat.v1.train.RMSPropOptimizer(0.01, momentum=0.9),
    'RMSPropCentered':
        lambda step: tf.compat.v1.train.RMSPropOptimizer(
            0.01, momentum=0.5, centered=True),
    'Adadelta':
        lambda step: tf.compat.v1.train.AdadeltaOptimizer(1.0),
    'Ftrl':
        lambda step: tf.compat.v1.train.FtrlOptimizer(0.1, **_l1_l2),
    'ProximalGradientDescent':
        lambda step: tf.compat.v1.train.ProximalGradientDescentOptimizer(
            0.1, **_l1_l2),
    'ProximalAdagrad':
        lambda step: tf.compat.v1.train.ProximalAdagradOptimizer(
            0.1, **_l1_l2),
}


def with_gradient_transform(make_optimizer, transform):
  """An optimizer factory whose optimizers transform what they apply.

  Args:
    make_optimizer: factory taking the step tensor (see OPTIMIZERS).
    transform: function of the list of (gradient, variable) pairs that
      `apply_gradients` receives; returns the pairs to apply.

  Returns:
    A factory like `make_optimizer`.
  """
  def make(step):
    optimizer = make_optimizer(step)
    apply_gradients = optimizer.apply_gradients

    def apply_transformed(grads_and_vars, *args, **kwargs):
      return apply_gradients(transform(list(grads_and_vars)), *args, **kwargs)

    optimizer.apply_gradients = apply_transformed
    return optimizer
  return make


def sgd(step=None):
  del step
  return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def make_data(cycles, batch, seed=0):
  """Fresh inputs and targets for each cycle: [cycles, batch, dim] arrays."""
  rng = np.random.RandomState(seed)
  x = rng.randn(cycles, batch, INPUT_DIM).astype(np.float32)
  y = rng.randn(cycles, batch, OUTPUT_DIM).astype(np.float32)
  return x, y


_INITIAL = {
    name: np.random.RandomState(100 + i).uniform(
        -0.5, 0.5, size=shape).astype(np.float32)
    for i, (name, shape) in enumerate([
        ('w1', [INPUT_DIM, HIDDEN_DIM]),
        ('b1', [HIDDEN_DIM]),
        ('w2', [HIDDEN_DIM, OUTPUT_DIM]),
        ('b2', [OUTPUT_DIM]),
    ])
}


def unknown_shape_variable(value):
  """A float32 variable whose static shape is unknown, in either behaviour."""
  return tf.compat.v1.Variable(np.array(value, np.float32),
                               shape=tf.TensorShape(None), validate_shape=False,
                               name='v')


def model_loss(x, y, with_unused=False):
  """A small tanh MLP with a mean squared error; returns (loss, variables).

  Args:
    x, y: input and target tensors.
    with_unused: also create a trainable variable the loss ignores (its
      gradient is None).
  """
  variables = {
      name: tf.compat.v1.get_variable(name, initializer=value)
      for name, value in sorted(_INITIAL.items())
  }
  if with_unused:
    variables['unused'] = tf.compat.v1.get_variable(
        'unused', initializer=np.ones([2], np.float32))
  hidden = tf.tanh(tf.matmul(x, variables['w1']) + variables['b1'])
  prediction = tf.matmul(hidden, variables['w2']) + variables['b2']
  return tf.reduce_mean(tf.square(prediction - y)), variables


TABLE_ROWS, EMBEDDING_DIM, IDS_PER_EXAMPLE = 24, 4, 3
_TABLE = np.random.RandomState(7).uniform(
    -0.5, 0.5, size=[TABLE_ROWS, EMBEDDING_DIM]).astype(np.float32)
_PROJECTION = np.random.RandomState(8).uniform(
    -0.5, 0.5, size=[EMBEDDING_DIM, OUTPUT_DIM]).astype(np.float32)


def make_embedding_data(cycles, batch, seed=0):
  """Ids and targets per cycle; each cycle looks up a shifted window of rows.

  Ids repeat within a micro-batch, and every cycle leaves some rows of the
  previous one alone and touches some new ones.
  """
  rng = np.random.RandomState(seed)
  window = TABLE_ROWS // 2
  ids = np.stack([
      rng.randint(0, window, size=(batch, IDS_PER_EXAMPLE)) +
      (cycle * window // 2) % (TABLE_ROWS - window) for cycle in range(cycles)
  ]).astype(np.int32)
  y = rng.randn(cycles, batch, OUTPUT_DIM).astype(np.float32)
  return ids, y


def _table_initializer(shape, dtype=tf.float32, partition_info=None):
  """The fixed table, or the rows of it that one partition holds."""
  del dtype
  offset = partition_info.single_offset(shape) if partition_info else 0
  return tf.constant(_TABLE[offset:offset + shape[0]])


def embedding_loss(ids, y, partitions=None):
  """Mean of looked-up rows, projected; returns (loss, variables).

  The table's gradient is a `tf.IndexedSlices`, the projection's is dense.

  Args:
    ids: int32 [batch, IDS_PER_EXAMPLE]; y: float32 [batch, OUTPUT_DIM].
    partitions: split the table into this many variables.
  """
  table = tf.compat.v1.get_variable(
      'table', [TABLE_ROWS, EMBEDDING_DIM],
      initializer=_table_initializer,
      partitioner=(tf.compat.v1.fixed_size_partitioner(partitions)
                   if partitions else None))
  projection = tf.compat.v1.get_variable('projection', initializer=_PROJECTION)
  looked_up = tf.nn.embedding_lookup(table, ids)
  prediction = tf.matmul(tf.reduce_mean(looked_up, axis=1), projection)
  tables = list(table) if partitions else [table]
  variables = {v.name.rsplit(':', 1)[0]: v for v in tables + [projection]}
  return tf.reduce_mean(tf.square(prediction - y)), variables


LINEAR_DIM = 3
LINEAR_INITIAL = np.array([[0.5], [-0.25], [1.0]], np.float32)


def make_linear_data(cycles, batch, seed=0):
  """Inputs, targets and a per-example 'poison' (0: clean) for each cycle."""
  rng = np.random.RandomState(seed)
  x = rng.randn(cycles, batch, LINEAR_DIM).astype(np.float32)
  y = rng.randn(cycles, batch, 1).astype(np.float32)
  return x, y, np.zeros([cycles, batch], np.float32)


def linear_loss(x, y, poison):
  """mean((x w - y)^2) + mean(poison) * sum(w); returns (loss, variables).

  Its gradient, 2/n x^T (x w - y) + mean(poison), is easy in numpy; a NaN or
  inf poison makes it non-finite.
  """
  w = tf.compat.v1.get_variable('w', initializer=LINEAR_INITIAL)
  loss = (tf.reduce_mean(tf.square(tf.matmul(x, w) - y)) +
          tf.reduce_mean(poison) * tf.reduce_sum(w))
  return loss, {'w': w}


def linear_gradient(w, x, y, poison):
  """The gradient of linear_loss, in float64 numpy."""
  x, y = x.astype(np.float64), y.astype(np.float64)
  return 2.0 / len(x) * x.T.dot(x.dot(w) - y) + np.mean(poison)


# name -> (make_data, input dtypes and shapes, loss function)
MODELS = {
    'mlp': (make_data, [(tf.float32, [None, INPUT_DIM]),
                        (tf.float32, [None, OUTPUT_DIM])], model_loss),
    'embedding': (make_embedding_data,
                  [(tf.int32, [None, IDS_PER_EXAMPLE]),
                   (tf.float32, [None, OUTPUT_DIM])], embedding_loss),
    'linear': (make_linear_data,
               [(tf.float32, [None, LINEAR_DIM]), (tf.float32, [None, 1]),
                (tf.float32, [None])], linear_loss),
}


class Trainer(object):
  """Builds the model and its training op in a graph of its own.

  Args:
    make_optimizer: factory taking the step tensor (see OPTIMIZERS).
    grad_steps: None trains with the bare optimizer; else with the wrapper.
    use_global_step: pass a global step to `minimize`.
    step_tensor: what `make_optimizer` receives: 'auto' is the global step for
      the bare optimizer and `applied_updates` for the wrapper; 'global_step'
      is the global step in both cases; None is None.
    model: a key of MODELS.
    model_kwargs: passed to the model's loss function (e.g. with_unused for
      the MLP, partitions for the embedding model).
    device: device (or device function) to build the graph under.
    **wrapper_kwargs: passed to `GradientAggregationOptimizer`.
  """

  def __init__(self,
               make_optimizer,
               grad_steps=None,
               use_global_step=True,
               step_tensor='auto',
               model='mlp',
               model_kwargs=None,
               device=None,
               **wrapper_kwargs):
    self.micro_steps = 1 if grad_steps is None else grad_steps
    self.graph = tf.Graph()
    with self.graph.as_default(), self.graph.device(device):
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      _, input_specs, loss_fn = MODELS[model]
      self.inputs = [
          tf.compat.v1.placeholder(dtype, shape)
          for dtype, shape in input_specs
      ]
      loss, self.variables = loss_fn(*self.inputs, **(model_kwargs or {}))
      if step_tensor == 'auto' and grad_steps is not None:
        step_tensor = deferred_grad.applied_updates(self.global_step,
                                                    grad_steps)
      elif step_tensor in ('auto', 'global_step'):
        step_tensor = self.global_step
      self.optimizer = make_optimizer(step_tensor)
      if grad_steps is not None:
        self.optimizer = deferred_grad.GradientAggregationOptimizer(
            self.optimizer, grad_steps, **wrapper_kwargs)
      self.train_op = self.optimizer.minimize(
          loss, global_step=self.global_step if use_global_step else None)
      self.init_op = tf.compat.v1.global_variables_initializer()

  def session(self):
    session = tf.compat.v1.Session(graph=self.graph)
    session.run(self.init_op)
    return session

  def micro_step(self, session, *batch):
    session.run(self.train_op, dict(zip(self.inputs, batch)))

  def run_cycle(self, session, *batch):
    """Runs one cycle on a large batch split into `micro_steps` parts."""
    micro_batch = len(batch[0]) // self.micro_steps
    for k in range(self.micro_steps):
      rows = slice(k * micro_batch, (k + 1) * micro_batch)
      self.micro_step(session, *[part[rows] for part in batch])

  def run(self, session, data):
    """Trains on every cycle of `data`; returns the weights after each."""
    snapshots = []
    for batch in zip(*data):
      self.run_cycle(session, *batch)
      snapshots.append(session.run(self.variables))
    return snapshots


REPLICAS = 2


class MirroredTrainer(Trainer):
  """The wrapper under MirroredStrategy over two logical CPU devices.

  Each micro-batch is split between the replicas; each replica's loss is its
  mean divided by the replica count, so that the optimizer's all-reduce (a
  sum) gives the mean over the whole micro-batch.
  """

  def __init__(self, make_optimizer, grad_steps, use_global_step=True,
               model='mlp', model_kwargs=None, **wrapper_kwargs):
    # pylint: disable=super-init-not-called
    self.micro_steps = grad_steps
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.strategy = tf.distribute.MirroredStrategy(
          ['/cpu:%d' % i for i in range(REPLICAS)])
      _, input_specs, loss_fn = MODELS[model]
      with self.strategy.scope():
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        # [replica, rows, ...]: replica r reads its own slice.
        self.inputs = [
            tf.compat.v1.placeholder(dtype, [REPLICAS] + shape)
            for dtype, shape in input_specs
        ]
        self.optimizer = deferred_grad.GradientAggregationOptimizer(
            make_optimizer(None), grad_steps, **wrapper_kwargs)
        self.variables = {}

        def replica_step():
          replica = tf.distribute.get_replica_context().replica_id_in_sync_group
          loss, variables = loss_fn(
              *[tf.gather(part, replica) for part in self.inputs],
              **(model_kwargs or {}))
          self.variables.update(variables)
          return self.optimizer.minimize(
              loss / REPLICAS,
              global_step=self.global_step if use_global_step else None)

        self.train_op = self.strategy.group(
            self.strategy.extended.call_for_each_replica(replica_step))
      self.init_op = tf.compat.v1.global_variables_initializer()

  def split(self, batch):
    return batch.reshape((REPLICAS, -1) + batch.shape[1:])

  def micro_step(self, session, *batch):
    super(MirroredTrainer, self).micro_step(
        session, *[self.split(part) for part in batch])


def train(make_optimizer, data, grad_steps=None, **kwargs):
  """Trains a fresh model on `data` (see `Trainer` for the arguments).

  Returns:
    (snapshots, final global step, graph): one dict of variable name -> value
    per cycle.
  """
  trainer = Trainer(make_optimizer, grad_steps, **kwargs)
  with trainer.session() as session:
    snapshots = trainer.run(session, data)
    final_step = session.run(trainer.global_step)
  return snapshots, final_step, trainer.graph


def assert_same_training(actual, expected, rtol=RTOL, atol=ATOL):
  """Asserts two lists of per-cycle weight snapshots are equal."""
  assert len(actual) == len(expected)
  for cycle, (got, want) in enumerate(zip(actual, expected)):
    assert sorted(got) == sorted(want)
    for name in want:
      np.testing.assert_allclose(
          got[name], want[name], rtol=rtol, atol=atol,
          err_msg='variable %s after cycle %d' % (name, cycle))


def assert_weights_moved(before, after):
  assert any(not np.array_equal(before[n], after[n]) for n in before)


@pytest.fixture(params=[False, True], ids=['gpu_path', 'tpu_path'])
def use_tpu(request):
  return request.param


TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                     'tools')

# Scripts under tools/ set their own TensorFlow behaviour: run them once per
# TensorFlow version, in the v2 pass of the test runner.
run_once_per_version = pytest.mark.skipif(
    BEHAVIOR != 'v2',
    reason='runs a tools/ script, which sets its own TF behaviour: once per '
    'TensorFlow version, in the v2 pass')


def run_tool(script, *args):
  """Runs a Python script under tools/; returns its combined output.

  Fails the test if the script exits non-zero.
  """
  result = subprocess.run(
      [sys.executable, os.path.join(TOOLS, script)] + list(args),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      universal_newlines=True,
      timeout=300)
  assert result.returncode == 0, result.stdout
  return result.stdout


def loss_decrease(output):
  """(first, last) from an example's 'loss went from A to B' line."""
  match = re.search(r'loss went from ([\d.]+) to ([\d.]+)', output)
  assert match, output
  return float(match.group(1)), float(match.group(2))


def pytest_report_header(config):
  del config
  return 'TensorFlow %s, %s behaviour, deferred_grad from %s' % (
      tf.__version__, BEHAVIOR, os.path.dirname(deferred_grad.__file__))
