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
import behavior
import deferred_grad
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


# 2 micro-steps of 9 ids: a list shorter than the table's 24 rows, handed on
# with its repeated ids, as the large batch's; 3: a list longer than the
# table, added up by id on the apply step.
@pytest.mark.parametrize('grad_steps', [2, GRAD_STEPS])
@pytest.mark.parametrize('optimizer', SPARSE_OPTIMIZERS)
def test_matches_large_batch(optimizer, grad_steps, use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = make_embedding_data(CYCLES, grad_steps * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data, model='embedding')
  spied, received = _spy_on_handoff(make_optimizer)
  actual, _, _ = train(
      spied, data, grad_steps=grad_steps, use_tpu=use_tpu, model='embedding')
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


def test_accumulator_holds_only_the_rows_looked_up(use_tpu):
  """The table's accumulator lists the cycle's rows, not the whole table.

  Each micro-step appends its looked-up rows (a dense add kernel would
  write the whole table), and the apply step hands them on and empties the
  list.
  """
  trainer = Trainer(models.OPTIMIZERS['Adagrad'], GRAD_STEPS,
                    use_tpu=use_tpu, model='embedding')
  dense_add_types = ('ResourceApplyGradientDescent', 'ApplyGradientDescent')
  # Every node, in the graph and in the functions of control flow v2's
  # tf.cond branches.
  graph_def = trainer.graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  # One dense add kernel: the projection's (the table has none).
  assert len([n for n in nodes if n.op in dense_add_types]) == 1
  _check_list_of_rows(trainer)


def test_replicas_share_one_list_of_the_rows_looked_up():
  """Under MirroredStrategy the table's accumulator is one list, not a
  table-sized variable per replica: each micro-step appends every
  replica's rows, in replica order (the micro-batch's order here), to the
  mirrored list's first component (what a checkpoint saves); the others
  keep their empty list."""
  trainer = MirroredTrainer(models.OPTIMIZERS['Adagrad'], GRAD_STEPS,
                            model='embedding')
  accumulator = trainer.optimizer.get_slot(trainer.variables['table'],
                                           'grad_accum')
  components = trainer.strategy.experimental_local_results(accumulator)
  assert len(components) == training.REPLICAS
  assert accumulator.shape.rank is None  # a list, of no static shape
  _check_list_of_rows(trainer, components[:1], components[1:])


def _check_list_of_rows(trainer, components=(), untouched=()):
  """Runs a cycle: the list holds the rows looked up and their partial sums
  (against the bare model's gradient); the apply step empties it. Each of
  `components` holds the list alike; each of `untouched` lists no row."""
  accumulator = trainer.optimizer.get_slot(trainer.variables['table'],
                                           'grad_accum')
  bare = Trainer(models.OPTIMIZERS['Adagrad'], model='embedding')
  with bare.graph.as_default():
    gradient = tf.convert_to_tensor(tf.compat.v1.gradients(
        bare.loss, [bare.variables['table']])[0])
    bare_session = bare.session()
  x, y = make_embedding_data(1, GRAD_STEPS * training.REPLICAS *
                             models.MICRO_BATCH)
  micro_batches = [(x[0][rows], y[0][rows]) for rows in (
      slice(k * len(x[0]) // GRAD_STEPS, (k + 1) * len(x[0]) // GRAD_STEPS)
      for k in range(GRAD_STEPS))]
  expected = np.zeros([models.TABLE_ROWS, models.EMBEDDING_DIM], np.float32)
  with trainer.session() as session:
    for step, batch in enumerate(micro_batches[:-1]):
      expected += bare_session.run(
          gradient, dict(zip(bare.inputs, batch))) / GRAD_STEPS
      trainer.micro_step(session, *batch)
      listed = session.run(accumulator)
      for component in session.run(list(components)):
        np.testing.assert_array_equal(component, listed)
      for component in session.run(list(untouched)):
        assert not len(training.listed_rows(component,
                                            [models.EMBEDDING_DIM])[0])
      ids, _ = training.listed_rows(listed, [models.EMBEDDING_DIM])
      looked_up = np.concatenate([b[0].ravel() for b in
                                  micro_batches[:step + 1]])
      assert list(ids) == list(looked_up)
      np.testing.assert_allclose(
          training.dense_accumulator(listed, expected.shape), expected,
          rtol=1e-6, atol=1e-7)
    trainer.micro_step(session, *micro_batches[-1])
    assert not training.listed_rows(session.run(accumulator),
                                    [models.EMBEDDING_DIM])[0].size
  bare_session.close()


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


CLIP_NORM = 0.05


def _clip_pairs(dense_norm):
  """A gradient transform: the large batch's gradient clipped to CLIP_NORM,
  by its dense norm (repeated ids added up first) or, wrongly, counting a
  repeated id's rows apart; kept sparse."""
  def clip(grads_and_vars):
    grads, variables = zip(*grads_and_vars)
    if dense_norm:
      grads = [_summed_by_id(g) for g in grads]
    clipped, _ = tf.clip_by_global_norm(grads, CLIP_NORM)
    return list(zip(clipped, variables))
  return clip


def _summed_by_id(gradient):
  if not isinstance(gradient, tf.IndexedSlices):
    return gradient
  unique, positions = tf.unique(gradient.indices)
  return tf.IndexedSlices(tf.math.unsorted_segment_sum(
      gradient.values, positions, tf.size(unique)), unique,
                          gradient.dense_shape)


def test_clip_norm_takes_a_table_s_dense_norm(use_tpu):
  """The cycle's rows go on with repeated ids (as the large batch's); the
  clip's norm adds them up first, as that of the dense gradient.

  Two micro-steps of 9 ids: a list shorter than the table's 24 rows, which
  is not added up by id before the apply step."""
  make_optimizer = models.OPTIMIZERS['Momentum']
  grad_steps = 2
  data = make_embedding_data(CYCLES, grad_steps * models.MICRO_BATCH)
  results = {}
  for dense_norm in (True, False):
    results[dense_norm], _, _ = train(
        models.with_gradient_transform(make_optimizer,
                                       _clip_pairs(dense_norm)),
        data, model='embedding')
  actual, _, _ = train(make_optimizer, data, grad_steps=grad_steps,
                       use_tpu=use_tpu, model='embedding',
                       clip_norm=CLIP_NORM)
  assert_same_training(actual, results[True])
  with pytest.raises(AssertionError):  # repeated ids make the norms differ
    assert_same_training(actual, results[False])


@pytest.mark.parametrize('grad_steps', [1, GRAD_STEPS])
@pytest.mark.parametrize('optimizer', ['Momentum', 'Ftrl'])
def test_clip_norm_under_mirrored_strategy_keeps_a_table_sparse(optimizer,
                                                                grad_steps):
  """clip_norm under MirroredStrategy: the clipped table gradient goes on
  sparse, as the large batch's (a dense one would move Momentum's and
  Ftrl's untouched rows, and be table-sized on each replica), clipped by
  the global norm of the sum over replicas. With grad_steps=1 each replica
  holds its own rows, which are all-reduced sparse; else the replicas share
  one list, which one replica hands on."""
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = make_embedding_data(
      CYCLES, training.REPLICAS * grad_steps * models.MICRO_BATCH)
  expected, _, _ = train(
      models.with_gradient_transform(make_optimizer, _clip_pairs(True)),
      data, model='embedding')
  spied, received = _spy_on_handoff(make_optimizer)
  trainer = MirroredTrainer(spied, grad_steps, model='embedding',
                            clip_norm=CLIP_NORM)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
  # Each replica's apply, its table's component included.
  assert [{name.split('/')[0]: kind for name, kind in kinds.items()}
          for kinds in received] == [{'table': 'sparse',
                                      'projection': 'dense'}] * 2
  assert_same_training(actual, expected)


@pytest.mark.parametrize('kwargs', [
    {'nonfinite_policy': 'skip_micro_batch'}, {'nonfinite_policy': 'skip_cycle'},
    {'accumulator_dtype': tf.float64}, {'use_global_step': False}])
def test_clip_norm_under_mirrored_strategy_with_other_keywords(kwargs):
  """The shared list's clipped rows with a policy (nothing skipped), a
  float64 accumulator, or the wrapper's own counter: the large batch's."""
  kwargs = dict(kwargs)
  use_global_step = kwargs.pop('use_global_step', True)
  make_optimizer = models.OPTIMIZERS['Momentum']
  data = _data(training.REPLICAS)
  expected, _, _ = train(
      models.with_gradient_transform(make_optimizer, _clip_pairs(True)),
      data, model='embedding')
  trainer = MirroredTrainer(make_optimizer, GRAD_STEPS, use_global_step,
                            model='embedding', clip_norm=CLIP_NORM, **kwargs)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    actual = trainer.run(session, data)
  assert_same_training(actual, expected)


def test_a_replica_s_skipped_micro_batch_adds_no_rows_to_the_shared_list():
  """nonfinite_policy='skip_micro_batch' under MirroredStrategy: a NaN
  target on one replica's part of one micro-step skips that part alone;
  its rows do not reach the shared list, and training matches the large
  batch without that part's examples."""
  make_optimizer = models.OPTIMIZERS['Adagrad']
  part = models.MICRO_BATCH  # one replica's share of a micro-step
  ids, y = _data(training.REPLICAS)
  # Cycle 1, micro-step 1, replica 1.
  bad = slice((training.REPLICAS + 1) * part, (training.REPLICAS + 2) * part)
  y = y.copy()
  y[1, bad] = np.nan
  bare = Trainer(make_optimizer, model='embedding')
  expected = []
  with bare.session() as session:
    for cycle in range(CYCLES):
      keep = np.ones(len(ids[cycle]), bool)
      if cycle == 1:
        keep[bad] = False
      bare.micro_step(session, ids[cycle][keep], y[cycle][keep])
      expected.append(session.run(bare.variables))
  trainer = MirroredTrainer(make_optimizer, GRAD_STEPS, model='embedding',
                            nonfinite_policy='skip_micro_batch')
  accumulator = trainer.optimizer.get_slot(trainer.variables['table'],
                                           'grad_accum')
  actual = []
  with trainer.session() as session:
    for cycle in range(CYCLES):
      for step in range(GRAD_STEPS):
        rows = slice(step * training.REPLICAS * part,
                     (step + 1) * training.REPLICAS * part)
        trainer.micro_step(session, ids[cycle][rows], y[cycle][rows])
        if cycle == 1 and step == 1:
          listed, _ = training.listed_rows(session.run(accumulator),
                                           [models.EMBEDDING_DIM])
          finite = np.concatenate([ids[1][:(training.REPLICAS + 1) * part]])
          assert list(listed) == list(finite.ravel())
      actual.append(session.run(trainer.variables))
    assert session.run(trainer.optimizer.skipped_micro_batches) == 1
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
  # Outside XLA the table's accumulator is a list of the rows looked up
  # (see test_xla for the table's sharded dense read inside XLA).
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
  # projection [4, 3] (micro-step read).
  assert sorted(tiles) == [[partitions, 1]]


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


# --------------------------------------------------------- checkpoints --


def _micro_batches(steps, rows_per_step):
  x, y = make_embedding_data(1, steps * rows_per_step)
  return [(x[0][k * rows_per_step:(k + 1) * rows_per_step],
           y[0][k * rows_per_step:(k + 1) * rows_per_step])
          for k in range(steps)]


def _large_batch(make_optimizer, micro_batches):
  """The bare optimizer's weights after one large batch per cycle."""
  trainer = Trainer(make_optimizer, model='embedding')
  with trainer.session() as session:
    for start in range(0, len(micro_batches), GRAD_STEPS):
      cycle = micro_batches[start:start + GRAD_STEPS]
      trainer.micro_step(session, *[np.concatenate(parts)
                                    for parts in zip(*cycle)])
    return session.run(trainer.variables)


def _save_after(trainer, micro_batches, path):
  """Runs the micro-steps in a fresh session, saves; returns the weights."""
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    session.run(trainer.init_op)
    for batch in micro_batches:
      trainer.micro_step(session, *batch)
    tf.compat.v1.train.Saver().save(session, path)
    return session.run(trainer.variables)


@pytest.mark.parametrize('topology', ['one_process', 'mirrored'])
def test_resume_mid_cycle_matches_the_large_batch(topology, tmp_path):
  """A job stopped mid-cycle resumes from a plain Saver's checkpoint."""
  make_optimizer = models.OPTIMIZERS['Momentum']
  rows = training.REPLICAS * models.MICRO_BATCH
  batches = _micro_batches(CYCLES * GRAD_STEPS, rows)
  expected = _large_batch(make_optimizer, batches)

  def trainer():
    if topology == 'mirrored':
      return MirroredTrainer(make_optimizer, GRAD_STEPS, model='embedding')
    return Trainer(make_optimizer, GRAD_STEPS, model='embedding')

  stop = GRAD_STEPS + 1
  path = str(tmp_path / 'model')
  _save_after(trainer(), batches[:stop], path)
  second = trainer()
  with second.graph.as_default(), tf.compat.v1.Session() as session:
    tf.compat.v1.train.Saver().restore(session, path)
    for batch in batches[stop:]:
      second.micro_step(session, *batch)
    resumed = session.run(second.variables)
  assert_same_training([resumed], [expected])


def test_monitored_training_session_resumes_mid_cycle(tmp_path):
  """Its sharded Saver keeps the list of rows; the resumed job trains
  like the large batch."""
  make_optimizer = models.OPTIMIZERS['Adagrad']
  batches = _micro_batches(CYCLES * GRAD_STEPS, models.MICRO_BATCH)
  expected = _large_batch(make_optimizer, batches)
  checkpoint_dir = str(tmp_path)

  def train_until(last_step):
    trainer = Trainer(make_optimizer, GRAD_STEPS, model='embedding')
    with trainer.graph.as_default():
      hooks = [tf.compat.v1.train.StopAtStepHook(last_step=last_step)]
      with tf.compat.v1.train.MonitoredTrainingSession(
          checkpoint_dir=checkpoint_dir, hooks=hooks,
          save_checkpoint_steps=GRAD_STEPS + 1, save_summaries_steps=None,
          save_summaries_secs=None, log_step_count_steps=None) as session:
        step = session.run(trainer.global_step)
        while not session.should_stop():
          trainer.micro_step(session, *batches[step])
          step += 1
      return step

  assert train_until(GRAD_STEPS + 1) == GRAD_STEPS + 1
  listed = tf.train.load_variable(checkpoint_dir, 'table/GradientAccumulator')
  assert list(training.listed_rows(listed, [models.EMBEDDING_DIM])[0]) == (
      list(batches[GRAD_STEPS][0].ravel()))
  assert train_until(len(batches)) == len(batches)
  resumed = {name: tf.train.load_variable(checkpoint_dir, name)
             for name in expected}
  assert_same_training([resumed], [expected])


def test_a_mid_cycle_checkpoint_restores_without_the_wrapper(tmp_path):
  """For evaluation: the weights restore into a graph of the bare model."""
  make_optimizer = models.OPTIMIZERS['Adagrad']
  path = str(tmp_path / 'model')
  batches = _micro_batches(GRAD_STEPS + 1, models.MICRO_BATCH)
  weights = _save_after(
      Trainer(make_optimizer, GRAD_STEPS, model='embedding'), batches, path)
  bare = Trainer(make_optimizer, model='embedding')
  with bare.graph.as_default(), tf.compat.v1.Session() as session:
    tf.compat.v1.train.Saver().restore(session, path)
    restored = session.run(bare.variables)
  assert_same_training([restored], [weights], rtol=0, atol=0)
  # A weight that moved: the restore did not just find the initial values.
  assert not np.allclose(restored['table'],
                         models._TABLE)  # pylint: disable=protected-access


@pytest.mark.parametrize('steps', [GRAD_STEPS, GRAD_STEPS + 1],
                         ids=['cycle_end', 'mid_cycle'])
def test_a_list_of_rows_converts_into_a_dense_accumulator(steps, tmp_path):
  """sparse_as_dense turned on over a table's list of rows: the conversion
  (deferred_grad.Saver's) adds the list's rows up by id into the dense
  accumulator, so training goes on like the large batch, mid-cycle too.
  Skipped, a plain Saver fails: on the shape (a ref variable) or at the
  first micro-step (a resource variable takes any shape), never a silent
  number."""
  make_optimizer = models.OPTIMIZERS['Momentum']
  path = str(tmp_path / 'model')
  batches = _micro_batches(CYCLES * GRAD_STEPS, models.MICRO_BATCH)
  _save_after(Trainer(make_optimizer, GRAD_STEPS, model='embedding'),
              batches[:steps], path)
  second = Trainer(make_optimizer, GRAD_STEPS, model='embedding',
                   sparse_as_dense=True)
  with second.graph.as_default(), tf.compat.v1.Session() as session:
    if behavior.BEHAVIOR == 'v1':  # a ref variable checks the shape
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match='Assign requires shapes'):
        tf.compat.v1.train.Saver().restore(session, path)
    else:
      tf.compat.v1.train.Saver().restore(session, path)
      with pytest.raises(tf.errors.InvalidArgumentError):
        second.micro_step(session, *batches[steps])
    deferred_grad.Saver().restore(session, path)
    accumulator = session.run(second.optimizer.get_slot(
        second.variables['table'], 'grad_accum'))
    assert accumulator.shape == (models.TABLE_ROWS, models.EMBEDDING_DIM)
    assert np.any(accumulator) == bool(steps % GRAD_STEPS)
    for batch in batches[steps:]:
      second.micro_step(session, *batch)
    resumed = session.run(second.variables)
  # The large batch's dense gradient.
  expected = _large_batch(models.with_gradient_transform(
      make_optimizer,
      lambda pairs: [(tf.convert_to_tensor(g), v) for g, v in pairs]),
                          batches)
  assert_same_training([resumed], [expected])


@pytest.mark.parametrize('saved, restored', [('one_process', 'mirrored'),
                                             ('mirrored', 'one_process')])
def test_a_mid_cycle_list_restores_across_replica_counts(saved, restored,
                                                         tmp_path):
  """One process and MirroredStrategy save a table's partial sums alike:
  a checkpoint of either, written mid-cycle, resumes in the other like the
  large batch."""
  make_optimizer = models.OPTIMIZERS['Adagrad']
  batches = _micro_batches(CYCLES * GRAD_STEPS,
                           training.REPLICAS * models.MICRO_BATCH)
  expected = _large_batch(make_optimizer, batches)

  def trainer(topology):
    if topology == 'mirrored':
      return MirroredTrainer(make_optimizer, GRAD_STEPS, model='embedding')
    return Trainer(make_optimizer, GRAD_STEPS, model='embedding')

  stop = GRAD_STEPS + 2
  path = str(tmp_path / 'model')
  _save_after(trainer(saved), batches[:stop], path)
  listed = tf.train.load_variable(path, 'table/GradientAccumulator')
  assert list(training.listed_rows(listed, [models.EMBEDDING_DIM])[0]) == (
      list(np.concatenate([b[0].ravel() for b in batches[GRAD_STEPS:stop]])))
  second = trainer(restored)
  with second.graph.as_default(), tf.compat.v1.Session() as session:
    tf.compat.v1.train.Saver().restore(session, path)
    for batch in batches[stop:]:
      second.micro_step(session, *batch)
    resumed = session.run(second.variables)
  assert_same_training([resumed], [expected])


@pytest.mark.parametrize('dtype, accumulator_dtype, rows', [
    (tf.float64, None, 5000),
    (tf.float32, None, 2**24 + 3),
    (tf.float16, None, 2**24 + 3),
    (tf.bfloat16, None, 2**24 + 3),
    (tf.float16, tf.float32, 2**24 + 3),
])
def test_ids_survive_every_dtype_of_the_list(dtype, accumulator_dtype, rows,
                                             use_tpu):
  """A row's id shares the list with its gradient, in its dtype's columns:
  ids above what that dtype counts exactly (2**11 for float16, 2**24 for
  float32) come back exactly, and SGD moves exactly the large batch's rows
  by the mean gradient."""
  rng = np.random.RandomState(0)
  ids = [np.array([rows - 1, 5, rows - 2, 5]), np.array([rows - 1, 7]),
         np.array([2**11 + 1, rows - 3, 5])]
  values = [rng.uniform(-1, 1, size=[len(i), 1]) for i in ids]
  with tf.Graph().as_default():
    table = tf.compat.v1.get_variable(
        'table', [rows, 1], dtype, initializer=tf.compat.v1.zeros_initializer())
    step_ids = tf.compat.v1.placeholder(tf.int64, [None])
    step_values = tf.compat.v1.placeholder(dtype, [None, 1])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), len(ids),
        use_tpu=use_tpu, accumulator_dtype=accumulator_dtype)
    train_op = optimizer.apply_gradients([(tf.IndexedSlices(
        step_values, step_ids, tf.constant([rows, 1], tf.int64)), table)])
    accumulator = optimizer.get_slot(table, 'grad_accum')
    touched = sorted(set(np.concatenate(ids)))
    as_float64 = tf.cast(step_values, tf.float64)
    expected = np.zeros([rows, 1])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for step, (step_id, step_value) in enumerate(zip(ids, values)):
        feed = {step_ids: step_id, step_values: step_value}
        # What the wrapper adds up: each micro-step's values in `dtype`.
        np.add.at(expected, step_id,
                  session.run(as_float64, feed) / len(ids))
        session.run(train_op, feed)
        if step < len(ids) - 1:  # the list holds every id looked up so far
          listed = session.run(accumulator)
          assert list(training.listed_rows(listed, [1])[0]) == list(
              np.concatenate(ids[:step + 1]))
      actual = session.run(tf.cast(tf.gather(table, touched), tf.float64))
      moved = session.run(tf.math.count_nonzero(table))
  np.testing.assert_allclose(actual, -expected[touched],
                             rtol=1e-2 if dtype.size == 2 else 1e-6)
  assert moved == len(touched)


@pytest.mark.parametrize('optimizer', ['Adagrad', 'Ftrl'])
def test_a_list_longer_than_the_table_is_added_up(optimizer, use_tpu):
  """Large batches on a small vocabulary: the list stays within the
  table's rows and one micro-step's, and trains like the large batch."""
  rows, per_step, grad_steps = 5, 12, 4
  rng = np.random.RandomState(3)
  ids = rng.randint(0, rows, size=[2 * grad_steps, per_step])
  ids[:, 0] = rows - 1  # looked up on every micro-step
  targets = rng.uniform(-1, 1, size=[2 * grad_steps, per_step, 2])

  def build(grad_steps_or_none):
    graph = tf.Graph()
    with graph.as_default():
      table = tf.compat.v1.get_variable(
          'table', initializer=np.full([rows, 2], 0.5, np.float32))
      step_ids = tf.compat.v1.placeholder(tf.int32, [None])
      step_y = tf.compat.v1.placeholder(tf.float32, [None, 2])
      loss = tf.reduce_mean(tf.square(
          tf.nn.embedding_lookup(table, step_ids) * step_y - 1.0))
      opt = models.OPTIMIZERS[optimizer](None)
      if grad_steps_or_none:
        opt = deferred_grad.GradientAggregationOptimizer(
            opt, grad_steps_or_none, use_tpu=use_tpu)
      train_op = opt.minimize(loss)
      init = tf.compat.v1.global_variables_initializer()
    return graph, table, step_ids, step_y, train_op, init, opt

  graph, table, step_ids, step_y, train_op, init, opt = build(grad_steps)
  accumulator = opt.get_slot(table, 'grad_accum')
  with tf.compat.v1.Session(graph=graph) as session:
    session.run(init)
    for step in range(len(ids)):
      session.run(train_op, {step_ids: ids[step], step_y: targets[step]})
      listed = session.run(accumulator)
      assert len(training.listed_rows(listed, [2])[0]) <= rows + per_step
      assert len(listed) <= 1 + rows + per_step  # the header, the room
    actual = session.run(table)
  graph, table, step_ids, step_y, train_op, init, _ = build(None)
  with tf.compat.v1.Session(graph=graph) as session:
    session.run(init)
    for cycle in range(2):
      part = slice(cycle * grad_steps, (cycle + 1) * grad_steps)
      session.run(train_op, {step_ids: ids[part].ravel(),
                             step_y: targets[part].reshape(-1, 2)})
    expected = session.run(table)
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
