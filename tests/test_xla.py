"""Both code paths compiled whole by XLA: the closest CPU gets to a TPU.

With resource variables (`disable_eager_execution()`),
`tensorflow.python.compiler.xla.xla.compile` compiles a whole training step,
as a TPU rewrite does: every op of both paths must be XLA-compilable. Under
`disable_v2_behavior()` XLA refuses ref variables, for the bare optimizer
too (TensorFlow's limit), so these tests run in the v2 pass only.
"""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

import behavior
import deferred_grad
import models
import training
from test_numerics import _clipped_momentum  # pylint: disable=g-bad-import-order
from test_numerics import CLIP_NORM

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.compiler.xla import xla
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

pytestmark = pytest.mark.skipif(
    behavior.BEHAVIOR != 'v2',
    reason='XLA compiles resource variables only: not under '
    'disable_v2_behavior() (for the bare optimizer neither)')

GRAD_STEPS = 3


def _train_compiled(make_optimizer, data, model='mlp', grad_steps=GRAD_STEPS,
                    cycles=None, **wrapper_kwargs):
  """Trains with every micro-step one XLA-compiled computation.

  Args:
    make_optimizer: factory of the wrapped optimizer (see models.OPTIMIZERS).
    data: whole cycles of inputs, split into GRAD_STEPS micro-batches each;
      unused where `cycles` is given.
    model: a key of models.MODELS.
    grad_steps: the wrapper's (an int or a schedule).
    cycles: None, or each cycle's micro-batches (lists of inputs).
    **wrapper_kwargs: passed to the wrapper.

  Returns:
    The weights after each cycle.
  """
  if cycles is None:
    cycles = []
    for batch in zip(*data):
      micro = len(batch[0]) // GRAD_STEPS
      cycles.append([[part[k * micro:(k + 1) * micro] for part in batch]
                     for k in range(GRAD_STEPS)])
  graph = tf.Graph()
  with graph.as_default():
    _, input_specs, loss_fn = models.MODELS[model]
    inputs = [tf.compat.v1.placeholder(dtype, shape)
              for dtype, shape in input_specs]
    global_step = tf.compat.v1.train.get_or_create_global_step()
    variables = {}

    def step(*step_inputs):
      loss, model_variables = loss_fn(*step_inputs)
      variables.update(model_variables)
      optimizer = deferred_grad.GradientAggregationOptimizer(
          make_optimizer(deferred_grad.applied_updates(global_step,
                                                       GRAD_STEPS)),
          grad_steps, **wrapper_kwargs)
      return optimizer.minimize(loss, global_step=global_step)

    compiled = xla.compile(step, inputs=inputs)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      snapshots = []
      for cycle in cycles:
        for micro_batch in cycle:
          session.run(compiled, dict(zip(inputs, micro_batch)))
        snapshots.append(session.run(variables))
      assert session.run(global_step) == sum(len(c) for c in cycles)
  return snapshots


@pytest.mark.parametrize('kwargs', [{}, {'xla_num_partitions': 2},
                                    {'nonfinite_policy': 'skip_micro_batch'},
                                    {'aggregation': 'mean',
                                     'accumulator_dtype': tf.float32}],
                         ids=['dense', 'sharded', 'policy', 'float32'])
@pytest.mark.parametrize('optimizer', ['Adam', 'Momentum'])
def test_compiled_step_matches_large_batch(optimizer, kwargs, use_tpu):
  data = models.make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = training.train(models.OPTIMIZERS[optimizer], data)
  actual = _train_compiled(models.OPTIMIZERS[optimizer], data,
                           use_tpu=use_tpu, **kwargs)
  training.assert_same_training(actual, expected)


def test_compiled_step_with_clipping(use_tpu):
  data = models.make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = training.train(_clipped_momentum, data)
  actual = _train_compiled(models.OPTIMIZERS['Momentum'], data,
                           use_tpu=use_tpu, clip_norm=CLIP_NORM)
  training.assert_same_training(actual, expected)


@pytest.mark.parametrize('optimizer', ['Momentum', 'Adagrad', 'Ftrl'])
def test_compiled_step_with_an_embedding_table(optimizer, use_tpu):
  """Sparse accumulation compiles: micro-steps scatter-add; XLA compiles
  static shapes only, so the apply step hands on the table's accumulator
  densely, as the original did: like the large batch with a dense
  gradient."""
  data = models.make_embedding_data(4, GRAD_STEPS * models.MICRO_BATCH)
  densified = models.with_gradient_transform(
      models.OPTIMIZERS[optimizer],
      lambda pairs: [(tf.convert_to_tensor(g), v) for g, v in pairs])
  expected, _, _ = training.train(densified, data, model='embedding')
  actual = _train_compiled(models.OPTIMIZERS[optimizer], data,
                           model='embedding', use_tpu=use_tpu)
  training.assert_same_training(actual, expected)


_HLO_SCRIPT = '''
import sys
sys.path.insert(0, %r)
import behavior, models, deferred_grad
import numpy as np, tensorflow as tf
from tensorflow.python.compiler.xla import xla
x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
def step(x, y):
  loss, _ = models.model_loss(x, y)
  return deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1), 2,
      use_tpu=%r, xla_num_partitions=2).minimize(loss)
compiled = xla.compile(step, inputs=[x, y])
with tf.compat.v1.Session() as session:
  session.run(tf.compat.v1.global_variables_initializer())
  session.run(compiled, {x: np.ones([3, 4]), y: np.ones([3, 3])})
'''


def test_sharding_annotations_reach_the_compiled_hlo(use_tpu, tmp_path):
  """The accumulators' XlaSharding ops become HLO shardings.

  w1 [4, 5] (fewer rows than columns) is split on dimension 1, w2 [5, 3]
  on dimension 0; the rank-1 biases are not split.
  """
  script = tmp_path / 'step.py'
  script.write_text(_HLO_SCRIPT % (os.path.dirname(os.path.abspath(
      __file__)), use_tpu))
  dump = tmp_path / 'hlo'
  env = dict(os.environ, XLA_FLAGS='--xla_dump_to=%s' % dump,
             DEFERRED_GRAD_TF_BEHAVIOR='v2')
  subprocess.run([sys.executable, str(script)], env=env, check=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                 timeout=300)
  shardings = []
  for path in dump.glob('*before_optimizations.txt'):
    text = path.read_text()
    shardings += [line.split('sharding=')[1].split('}')[0] + '}'
                  for line in text.splitlines() if 'sharding={' in line]
  assert sorted(shardings) == ['{devices=[1,2]0,1}', '{devices=[2,1]0,1}']


def test_the_port_check_names_a_compiled_train_op_stopped_mid_cycle(use_tpu):
  """The hook reads a compiled train op's cycle; whole cycles: silent."""
  x, y = models.make_data(1, models.MICRO_BATCH)
  for micro_steps, left in ((GRAD_STEPS + 1, 1), (2 * GRAD_STEPS, 0)):
    with tf.Graph().as_default(), training.logged('PortCheckHook') as warned:
      _, input_specs, loss_fn = models.MODELS['mlp']
      inputs = [tf.compat.v1.placeholder(dtype, shape)
                for dtype, shape in input_specs]
      global_step = tf.compat.v1.train.get_or_create_global_step()

      def step(*step_inputs):
        loss, _ = loss_fn(*step_inputs)
        return deferred_grad.GradientAggregationOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), GRAD_STEPS,
            use_tpu=use_tpu).minimize(loss, global_step=global_step)

      compiled = xla.compile(step, inputs=inputs)
      hook = deferred_grad.PortCheckHook()
      hook.begin()
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for _ in range(micro_steps):
          session.run(compiled, dict(zip(inputs, (x[0], y[0]))))
        hook.end(session)
    assert len(warned) == bool(left), warned
    if left:
      assert 'accumulated 1 of its %d' % GRAD_STEPS in warned[0], warned
