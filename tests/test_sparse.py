"""Embedding tables: sparse accumulation and each optimizer's sparse update.

The embedding model's micro-batches repeat ids, and its cycles touch
shifting sets of rows, so that an optimizer that (wrongly) received a dense
gradient would move, or decay the slots of, rows the large batch leaves
alone.
"""

import numpy as np
import pytest
import tensorflow as tf

import models
import training
from models import make_embedding_data
from training import assert_same_training
from training import MirroredTrainer
from training import train
from training import Trainer
from deferred_grad import sharding

GRAD_STEPS = 3
CYCLES = 4

# Every tf.compat.v1.train optimizer with a sparse update.
SPARSE_OPTIMIZERS = sorted(models.OPTIMIZERS)


def _data(replicas=1):
  return make_embedding_data(CYCLES,
                             replicas * GRAD_STEPS * models.MICRO_BATCH)


def _spy_on_handoff(make_optimizer):
  """(factory, received): received lists the gradient kinds applied."""
  received = []

  def record(grads_and_vars):
    received.append({
        v.op.name: 'sparse' if isinstance(g, tf.IndexedSlices) else 'dense'
        for g, v in grads_and_vars
    })
    return grads_and_vars

  return models.with_gradient_transform(make_optimizer, record), received


@pytest.mark.parametrize('optimizer', SPARSE_OPTIMIZERS)
def test_matches_large_batch(optimizer, use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = _data()
  expected, _, _ = train(make_optimizer, data, model='embedding')
  spied, received = _spy_on_handoff(make_optimizer)
  actual, _, _ = train(
      spied, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu, model='embedding')
  assert received == [{'table': 'sparse', 'projection': 'dense'}]
  assert_same_training(actual, expected)


def test_untouched_rows_do_not_move():
  """Momentum leaves rows without gradient alone; so must the wrapper."""
  x, y = make_embedding_data(1, GRAD_STEPS * models.MICRO_BATCH)
  trainer = Trainer(models.OPTIMIZERS['Momentum'], GRAD_STEPS,
                    model='embedding')
  with trainer.session() as session:
    trainer.run_cycle(session, x[0], y[0])
    # A second cycle on other rows: the first cycle's rows keep momentum in
    # a dense update, and would move again.
    session.run(trainer.variables['table'])
    before = session.run(trainer.variables['table'])
    other_ids = np.full_like(x[0], models.TABLE_ROWS - 1)
    trainer.run_cycle(session, other_ids, y[0])
    after = session.run(trainer.variables['table'])
  moved = np.any(after != before, axis=1)
  assert list(np.flatnonzero(moved)) == [models.TABLE_ROWS - 1]


def test_micro_step_scatters_into_the_accumulator(use_tpu):
  trainer = Trainer(models.OPTIMIZERS['Adagrad'], GRAD_STEPS,
                    use_tpu=use_tpu, model='embedding')
  scatter_types = ('ResourceScatterAdd', 'ScatterAdd')
  dense_add_types = ('ResourceApplyGradientDescent', 'ApplyGradientDescent')
  # Every node, in the graph and in the functions of control flow v2's
  # tf.cond branches.
  graph_def = trainer.graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)

  accumulator = 'table/GradientAccumulator'
  assert [n for n in nodes if n.op in scatter_types and
          n.input[0] == accumulator]
  # One dense add kernel: the projection's (the table has none).
  assert len([n for n in nodes if n.op in dense_add_types]) == 1


def test_sparse_as_dense_is_the_original_dense_handoff(use_tpu):
  """sparse_as_dense=True trains like the large batch with a dense gradient."""
  make_optimizer = models.OPTIMIZERS['Momentum']
  densified = models.with_gradient_transform(
      make_optimizer,
      lambda pairs: [(tf.convert_to_tensor(g), v) for g, v in pairs])

  data = _data()
  dense_large_batch, _, _ = train(densified, data, model='embedding')
  sparse_large_batch, _, _ = train(make_optimizer, data, model='embedding')
  spied, received = _spy_on_handoff(make_optimizer)
  actual, _, _ = train(
      spied, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu,
      model='embedding', sparse_as_dense=True)
  assert received == [{'table': 'dense', 'projection': 'dense'}]
  assert_same_training(actual, dense_large_batch)
  with pytest.raises(AssertionError):
    assert_same_training(actual, sparse_large_batch)


@pytest.mark.parametrize('optimizer', ['Momentum', 'Adagrad', 'Ftrl'])
def test_partitioned_table(optimizer, use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = _data()
  model_kwargs = {'partitions': 3}
  expected, _, _ = train(make_optimizer, data, model='embedding',
                         model_kwargs=model_kwargs)
  actual, _, graph = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu,
      model='embedding', model_kwargs=model_kwargs)
  assert sorted(actual[0]) == [
      'projection', 'table/part_0', 'table/part_1', 'table/part_2']
  names = {v.op.name for v in graph.get_collection('variables')}
  assert {'table/part_%d/GradientAccumulator' % i for i in range(3)} <= names
  assert_same_training(actual, expected)


@pytest.mark.parametrize('use_global_step', [True, False])
@pytest.mark.parametrize('optimizer', ['Momentum', 'RMSPropCentered'])
def test_mirrored_strategy(optimizer, use_global_step):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = _data(training.REPLICAS)
  expected, _, _ = train(make_optimizer, data, model='embedding')
  trainer = MirroredTrainer(make_optimizer, GRAD_STEPS, use_global_step,
                            model='embedding')
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
  assert_same_training(actual, expected)


def test_sharded_table_accumulator(use_tpu):
  partitions = 2
  make_optimizer = models.OPTIMIZERS['Momentum']
  data = _data()
  expected, _, _ = train(make_optimizer, data, model='embedding')
  actual, _, graph = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu,
      model='embedding', xla_num_partitions=partitions)
  assert_same_training(actual, expected)
  # The table accumulator is read once per cycle, on the apply step: that
  # read keeps the rank-2 sharding (rows >= columns: dimension 0).
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  tiles = []
  for node in nodes:
    if node.op == 'XlaSharding':
      proto = sharding.xla_sharding.xla_data_pb2.OpSharding()
      proto.ParseFromString(node.attr['sharding'].s)
      tiles.append(list(proto.tile_assignment_dimensions))
  # projection [4, 3] (micro-step read) and table [24, 4] (apply read).
  assert sorted(tiles) == [[partitions, 1], [partitions, 1]]


def _all_variables(graph, session):
  """Every global variable but the wrapper's own, by name (slots included)."""
  with graph.as_default():
    variables = {v.op.name: v for v in tf.compat.v1.global_variables()
                 if 'GradientAccumulator' not in v.op.name and
                 v.op.name not in ('global_step', 'update_count')}
  return session.run(variables)


def _padded_data():
  return models.make_token_data(CYCLES, len(models.TOKEN_COUNTS) *
                                models.MAX_TOKENS,
                                padding_id=models.PADDING_ID)


@pytest.mark.parametrize('optimizer', ['RMSProp', 'RMSPropMomentum',
                                       'Adadelta', 'Momentum', 'Ftrl',
                                       'ProximalAdagrad',
                                       'ProximalGradientDescent'])
def test_every_touched_row_is_handed_on(optimizer, use_tpu):
  """A padding row's gradient is always exactly zero, but it is looked up.

  The large batch's IndexedSlices holds it, so RMSProp and Adadelta decay
  its slots, Ftrl and the proximal optimizers shrink it: the wrapper must
  hand it on too, also a touched row whose sum is exactly zero.
  Weights and every slot of the wrapped optimizer are compared.
  """
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = _padded_data()
  grad_steps = len(models.TOKEN_COUNTS)
  large = Trainer(make_optimizer, model='token_embedding')
  micro = Trainer(make_optimizer, grad_steps, use_tpu=use_tpu,
                  model='token_embedding', weight_fn=models.token_weight)
  with large.session() as session:
    large.run(session, data)
    expected = _all_variables(large.graph, session)
  with micro.session() as session:
    micro.run(session, data)
    actual = _all_variables(micro.graph, session)
  assert set(expected) <= set(actual)
  assert_same_training([{name: actual[name] for name in expected}],
                       [expected])


def test_resume_mid_cycle_with_a_padding_row_is_exact(use_tpu, tmp_path):
  """A new session mid-cycle hands on the rows it saw and the non-zero ones.

  Every micro-step looks up the padding row, so the resumed cycle still
  hands it on, and the resumed run equals the uninterrupted one exactly.
  """
  x, ids, y, mask = _padded_data()
  grad_steps = len(models.TOKEN_COUNTS)
  batches = [part.reshape((-1, models.MAX_TOKENS) + part.shape[2:])
             for part in (x, ids, y, mask)]
  stop = grad_steps + 1

  def trainer():
    return Trainer(models.OPTIMIZERS['Ftrl'], grad_steps, use_tpu=use_tpu,
                   model='token_embedding', weight_fn=models.token_weight)

  whole = trainer()
  with whole.session() as session:
    for step in range(len(batches[0])):
      whole.micro_step(session, *[b[step] for b in batches])
    expected = session.run(whole.variables)
  first = trainer()
  path = str(tmp_path / 'model')
  with first.session() as session:
    for step in range(stop):
      first.micro_step(session, *[b[step] for b in batches])
    tf.compat.v1.train.Saver(
        tf.compat.v1.global_variables()).save(session, path)
  second = trainer()
  with second.graph.as_default(), tf.compat.v1.Session() as session:
    tf.compat.v1.train.Saver().restore(session, path)
    for step in range(stop, len(batches[0])):
      second.micro_step(session, *[b[step] for b in batches])
    resumed = session.run(second.variables)
  assert_same_training([resumed], [expected], rtol=0, atol=0)
