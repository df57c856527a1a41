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


class Trainer(object):
  """Builds the model and its training op in a graph of its own.

  Args:
    make_optimizer: factory taking the step tensor (see OPTIMIZERS).
    grad_steps: None trains with the bare optimizer; else with the wrapper.
    use_global_step: pass a global step to `minimize`.
    step_tensor: what `make_optimizer` receives: 'auto' is the global step for
      the bare optimizer and `applied_updates` for the wrapper; 'global_step'
      is the global step in both cases; None is None.
    with_unused: add a variable without gradient.
    **wrapper_kwargs: passed to `GradientAggregationOptimizer`.
  """

  def __init__(self,
               make_optimizer,
               grad_steps=None,
               use_global_step=True,
               step_tensor='auto',
               with_unused=False,
               **wrapper_kwargs):
    self.micro_steps = 1 if grad_steps is None else grad_steps
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      self.x = tf.compat.v1.placeholder(tf.float32, [None, INPUT_DIM])
      self.y = tf.compat.v1.placeholder(tf.float32, [None, OUTPUT_DIM])
      loss, self.variables = model_loss(self.x, self.y, with_unused)
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

  def micro_step(self, session, x, y):
    session.run(self.train_op, {self.x: x, self.y: y})

  def run_cycle(self, session, x, y):
    """Runs one cycle on a large batch split into `micro_steps` parts."""
    micro_batch = len(x) // self.micro_steps
    for k in range(self.micro_steps):
      rows = slice(k * micro_batch, (k + 1) * micro_batch)
      self.micro_step(session, x[rows], y[rows])

  def run(self, session, data):
    """Trains on every cycle of `data`; returns the weights after each."""
    snapshots = []
    for x, y in zip(*data):
      self.run_cycle(session, x, y)
      snapshots.append(session.run(self.variables))
    return snapshots


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
