"""compat.py's public-API fallbacks train as its private names do.

Every private TensorFlow name the package uses sits in compat.py behind a
function with a public-API fallback, which DEFERRED_GRAD_PUBLIC_API_ONLY=1
selects: each test here trains with the fallbacks and without them, and
gets the same numbers, and checks that the fallback ran (no batched handles,
a lowered cond, a mirrored list of a table's rows where replicas shared one
plain variable).
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
from deferred_grad import compat
import models
import test_sparse
import training

GRAD_STEPS = 3


@pytest.fixture(params=[False, True], ids=['private', 'public_only'])
def public_only(request, monkeypatch):
  if request.param:
    monkeypatch.setenv('DEFERRED_GRAD_PUBLIC_API_ONLY', '1')
  else:
    monkeypatch.delenv('DEFERRED_GRAD_PUBLIC_API_ONLY', raising=False)
  return request.param


def _op_types(graph):
  return {op.type for op in graph.get_operations()}


@pytest.mark.parametrize('optimizer', ['Momentum', 'Adam'])
def test_one_process_trains_alike(optimizer, use_tpu, public_only):
  """Batched handles and reads, the unlowered cond and the apply branch's
  own handles, or one handle and read per variable and `tf.cond`."""
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = models.make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = training.train(make_optimizer, data)
  actual, _, graph = training.train(make_optimizer, data,
                                    grad_steps=GRAD_STEPS, use_tpu=use_tpu)
  training.assert_same_training(actual, expected)
  types = _op_types(graph)
  if tf.compat.v1.resource_variables_enabled():  # ref variables: no handles
    assert ('_VarHandlesOp' in types) == (not public_only)
  if tf.compat.v1.control_flow_v2_enabled():
    lowering = [op.get_attr('_lower_using_switch_merge')
                if '_lower_using_switch_merge' in op.node_def.attr else None
                for op in graph.get_operations() if op.type == 'If']
    # tf.cond leaves the attribute unset or (TF 2.15) True: lowered.
    assert [value is False for value in lowering] == [not public_only]


def test_mirrored_strategy_trains_alike(public_only):
  """A replica's own component of a slot (`local_variables`); a table's
  list the replicas share: one variable (a private creator), else a
  mirrored one whose components every micro-step writes alike."""
  make_optimizer = models.OPTIMIZERS['Momentum']
  data = models.make_embedding_data(
      models.CYCLES, training.REPLICAS * GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = training.train(make_optimizer, data, model='embedding')
  trainer = training.MirroredTrainer(make_optimizer, GRAD_STEPS,
                                     model='embedding')
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
  training.assert_same_training(actual, expected)
  accumulator = trainer.optimizer.get_slot(trainer.variables['table'],
                                           'grad_accum')
  # A list of rows, of no static shape, either way.
  assert accumulator.shape.rank is None
  components = trainer.strategy.experimental_local_results(accumulator)
  assert len(components) == (training.REPLICAS if public_only else 1)


def test_a_mirrored_list_resumes_mid_cycle(public_only, tmp_path):
  """The mirrored list (the fallback) saves as one process's list, and a
  restore writes it to every component alike: a job stopped mid-cycle
  resumes exactly, as with the shared plain variable."""
  test_sparse.test_resume_mid_cycle_matches_the_large_batch('mirrored',
                                                            tmp_path)


def test_the_other_fallbacks(public_only):
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  assert not compat.in_multi_worker_mode(strategy)
  assert (compat.one_variable_creator('/cpu:0') is None) == public_only
  with tf.Graph().as_default() as graph:
    step = tf.compat.v1.train.get_or_create_global_step()
    compat.plain_global_step_read(step)
    reads = graph.get_collection(('deferred_grad', 'plain_reads'))
    assert len(reads) == (0 if public_only else 1)
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1), 2)
    w = tf.compat.v1.get_variable('w', initializer=np.ones(2, np.float32))
    optimizer.minimize(tf.reduce_sum(w), global_step=step)
    # Object-based checkpoints see the wrapped Adam's powers as the
    # wrapper's (without the private hooks they miss them: README).
    children = optimizer._trackable_children()  # pylint: disable=protected-access
    assert ('beta1_power' in children) == (not public_only)
