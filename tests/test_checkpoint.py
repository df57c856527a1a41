"""Checkpoints: the original's names, resuming mid-cycle, restoring its files."""

import os

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import training
from training import Trainer

_MODEL = ['b1', 'b2', 'w1', 'w2']


def _expected_names(use_tpu, name=None, settings=True):
  # The original built the wrapped apply inside a tf.cond: under control flow
  # v1 Adam's non-slot variables land in that cond's name scope.
  non_slot_prefix = '' if tf.compat.v1.control_flow_v2_enabled() else 'cond/'
  names = set(_MODEL) | {'global_step'}
  if settings:  # the train op's, in its name scope (not the original's)
    names.add((name or 'GradientAggregationOptimizer') +
              '/deferred_grad_settings')
  names |= {non_slot_prefix + 'beta1_power', non_slot_prefix + 'beta2_power'}
  for var in _MODEL:
    names |= {var + '/Adam', var + '/Adam_1', var + '/GradientAccumulator'}
  if use_tpu:
    names.add('update_count')
  return names


@pytest.mark.parametrize('name', [None, 'train'])
def test_checkpoint_keys_are_the_originals(use_tpu, name, tmp_path):
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
    loss, _ = models.model_loss(x, y)
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.01), 2, use_tpu=use_tpu)
    grads_and_vars = optimizer.compute_gradients(loss)
    ops_before = set(graph.get_operations())
    train_op = optimizer.apply_gradients(
        grads_and_vars, global_step=global_step, name=name)
    new_ops = [op.name for op in graph.get_operations() if op not in ops_before]
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      path = saver.save(session, os.path.join(str(tmp_path), 'model'))
  keys = {key for key, _ in tf.train.list_variables(path)}
  assert keys == _expected_names(use_tpu, name)
  # Every op apply_gradients made is in its name scope, but the variables it
  # created (named after variables, as the original's were).
  scope = (name or 'GradientAggregationOptimizer') + '/'
  assert train_op.name.startswith(scope)
  outside = [
      op for op in new_ops if not op.startswith(scope) and
      not any(op == key or op.startswith(key + '/') for key in keys)
  ]
  assert not outside
  trainable = {v.op.name for v in graph.get_collection('trainable_variables')}
  assert trainable == set(_MODEL)


GRAD_STEPS = 3
TOTAL_STEPS = 4 * GRAD_STEPS
STOP_STEP = 2 * GRAD_STEPS + 1  # one micro-step into the third cycle


# model -> the optimizer its checkpoint tests use. Momentum's sparse update
# leaves untouched rows alone, so the rows a restored accumulator says were
# touched decide the result.
_OPTIMIZER_FOR = {'mlp': 'Adam', 'embedding': 'Momentum'}


def _micro_batches(model='mlp'):
  return models.MODELS[model][0](TOTAL_STEPS, models.MICRO_BATCH)


def _trainer(use_tpu, model='mlp'):
  return Trainer(models.OPTIMIZERS[_OPTIMIZER_FOR[model]], GRAD_STEPS,
                 use_tpu=use_tpu, model=model)


def _uninterrupted(use_tpu, stop_step=None, model='mlp'):
  """Weights after TOTAL_STEPS micro-steps; also every variable at stop_step."""
  trainer = _trainer(use_tpu, model)
  batches = _micro_batches(model)
  state = None
  with trainer.graph.as_default(), trainer.session() as session:
    for step in range(TOTAL_STEPS):
      if step == stop_step:
        state = {
            v.op.name: session.run(v)
            for v in tf.compat.v1.global_variables()
        }
      trainer.micro_step(session, *[part[step] for part in batches])
    return session.run(trainer.variables), state


def _train_monitored(trainer, checkpoint_dir, last_step, batches=None,
                     scaffold=None):
  """Trains with MonitoredTrainingSession up to last_step, saving as it goes
  (with `scaffold`'s saver where given)."""
  batches = _micro_batches() if batches is None else batches
  with trainer.graph.as_default():
    hooks = [
        tf.compat.v1.train.StopAtStepHook(last_step=last_step),
        tf.compat.v1.train.CheckpointSaverHook(checkpoint_dir, save_steps=2,
                                               scaffold=scaffold),
    ]
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir,
        scaffold=scaffold,
        hooks=hooks,
        save_checkpoint_secs=None,
        save_checkpoint_steps=None,
        save_summaries_steps=None,
        save_summaries_secs=None,
        log_step_count_steps=None) as session:
      step = session.run(trainer.global_step)
      while not session.should_stop():
        trainer.micro_step(session, *[part[step] for part in batches])
        step += 1
  return step


def test_monitored_session_resumes_mid_cycle(use_tpu, tmp_path):
  expected, _ = _uninterrupted(use_tpu)
  checkpoint_dir = str(tmp_path)
  first = _trainer(use_tpu)
  assert _train_monitored(first, checkpoint_dir, STOP_STEP) == STOP_STEP
  saved = tf.train.load_variable(checkpoint_dir, 'w1/GradientAccumulator')
  assert np.any(saved != 0)  # the checkpoint holds a partial cycle
  second = _trainer(use_tpu)
  assert _train_monitored(second, checkpoint_dir, TOTAL_STEPS) == TOTAL_STEPS
  resumed = {
      name: tf.train.load_variable(checkpoint_dir, name) for name in expected
  }
  training.assert_same_training([resumed], [expected], rtol=0, atol=0)


def _train_supervised(trainer, logdir, first_step, last_step, batches):
  """Trains under a Supervisor (restoring logdir's newest checkpoint) from
  first_step to last_step, then saves with the Supervisor's saver."""
  with trainer.graph.as_default():
    supervisor = tf.compat.v1.train.Supervisor(
        logdir=logdir, save_model_secs=0, save_summaries_secs=0)
    with supervisor.managed_session() as session:
      assert session.run(trainer.global_step) == first_step
      for step in range(first_step, last_step):
        trainer.micro_step(session, *[part[step] for part in batches])
      supervisor.saver.save(session, supervisor.save_path,
                            global_step=trainer.global_step)


@pytest.mark.parametrize('model', ['mlp', 'embedding'])
def test_supervisor_resumes_mid_cycle(use_tpu, model, tmp_path):
  # A Supervisor saves with the graph's default saver, reading its SaverDef
  # and finalizing the graph without building it; the wrapper's default
  # saver failed there ("build() should be called before save").
  expected, _ = _uninterrupted(use_tpu, model=model)
  batches = _micro_batches(model)
  logdir = str(tmp_path)
  _train_supervised(_trainer(use_tpu, model), logdir, 0, STOP_STEP, batches)
  latest = tf.train.latest_checkpoint(logdir)
  dense = {'mlp': 'w1', 'embedding': 'projection'}[model]
  saved = tf.train.load_variable(latest, dense + '/GradientAccumulator')
  assert np.any(saved != 0)  # the checkpoint holds a partial cycle
  second = _trainer(use_tpu, model)
  _train_supervised(second, logdir, STOP_STEP, TOTAL_STEPS, batches)
  latest = tf.train.latest_checkpoint(logdir)
  resumed = {name: tf.train.load_variable(latest, name) for name in expected}
  training.assert_same_training([resumed], [expected], rtol=0, atol=0)


def test_default_saver_saves_variables_made_after_an_early_export(tmp_path):
  # Exporting the graph (its SAVERS collection) before the model is complete
  # must not build the default saver: variables made later are saved too.
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=[1.0, 2.0])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.5), 2)
    train_op = optimizer.minimize(
        tf.reduce_sum(w * w),
        global_step=tf.compat.v1.train.get_or_create_global_step())
    tf.compat.v1.train.export_meta_graph(str(tmp_path / 'early.meta'))
    later = tf.compat.v1.get_variable('later', initializer=[7.0])
    set_later = later.assign([3.0])
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), save_checkpoint_steps=1,
        save_summaries_steps=None, save_summaries_secs=None) as session:
      session.run(set_later)
      for _ in range(2):
        session.run(train_op)
  latest = tf.train.latest_checkpoint(str(tmp_path))
  np.testing.assert_array_equal(tf.train.load_variable(latest, 'later'), [3.0])
  # One applied cycle of the mean of two equal gradients 2w: w - 0.5 * 2w.
  np.testing.assert_allclose(tf.train.load_variable(latest, 'w'), [0.0, 0.0])


def _train_with_own_saver(trainer, checkpoint_dir, last_step, batches,
                          in_scaffold):
  """`_train_monitored` with the script's own Saver (keeping 1) added to the
  SAVERS collection after minimize, as much TF1 code does, and handed over
  in a Scaffold if `in_scaffold`."""
  with trainer.graph.as_default():
    saver = tf.compat.v1.train.Saver(max_to_keep=1)
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, saver)
    scaffold = tf.compat.v1.train.Scaffold(saver=saver if in_scaffold
                                           else None)
  return _train_monitored(trainer, checkpoint_dir, last_step, batches,
                          scaffold=scaffold)


def test_own_saver_in_a_scaffold_is_used_and_resumes_mid_cycle(use_tpu,
                                                             tmp_path):
  expected, _ = _uninterrupted(use_tpu)
  batches = _micro_batches()
  checkpoint_dir = str(tmp_path)
  _train_with_own_saver(_trainer(use_tpu), checkpoint_dir, STOP_STEP,
                        batches, in_scaffold=True)
  _train_with_own_saver(_trainer(use_tpu), checkpoint_dir, TOTAL_STEPS,
                        batches, in_scaffold=True)
  kept = [name for name in os.listdir(checkpoint_dir)
          if name.endswith('.index')]
  assert kept == ['model.ckpt-%d.index' % TOTAL_STEPS]  # its max_to_keep
  resumed = {name: tf.train.load_variable(checkpoint_dir, name)
             for name in expected}
  training.assert_same_training([resumed], [expected], rtol=0, atol=0)


def test_own_saver_only_in_the_collection_is_used(tmp_path):
  """The wrapper adds no saver to the SAVERS collection: the script's own,
  put there after minimize as much TF1 code does, is the Scaffold's, and
  keeps what it was told to (1)."""
  checkpoint_dir = str(tmp_path)
  _train_with_own_saver(_trainer(False), checkpoint_dir, 4, _micro_batches(),
                        in_scaffold=False)
  kept = [name for name in os.listdir(checkpoint_dir)
          if name.endswith('.index')]
  assert kept == ['model.ckpt-4.index']


@pytest.mark.parametrize('model', ['mlp', 'embedding'])
def test_restores_a_checkpoint_written_under_the_original_names(
    use_tpu, model, tmp_path):
  """A separate graph writes plain variables under the original's names.

  For the embedding model, the rows touched before the checkpoint are known
  only from the restored accumulator.
  """
  expected, state = _uninterrupted(use_tpu, STOP_STEP, model)
  del state['GradientAggregationOptimizer/deferred_grad_settings']
  if model == 'mlp':
    assert set(state) == _expected_names(use_tpu, settings=False)
  else:
    names = {'global_step', 'table', 'projection', 'table/Momentum',
             'projection/Momentum', 'table/GradientAccumulator',
             'projection/GradientAccumulator'}
    assert set(state) == names | ({'update_count'} if use_tpu else set())
    # This version saves the rows looked up; the original saved the
    # table-sized accumulator, which is what is written below.
    listed = state['table/GradientAccumulator']
    looked_up = _micro_batches(model)[0][STOP_STEP - 1]
    assert len(training.listed_rows(listed, [models.EMBEDDING_DIM])[0]) == (
        looked_up.size)
    state['table/GradientAccumulator'] = training.dense_accumulator(
        listed, state['table'].shape)
    touched = np.any(state['table/GradientAccumulator'] != 0, axis=1)
    assert 0 < touched.sum() < models.TABLE_ROWS
  if use_tpu:
    # The original counted micro-steps without wrapping at grad_steps.
    assert state['update_count'] == STOP_STEP % GRAD_STEPS
    state['update_count'] = np.float32(STOP_STEP)
  path = os.path.join(str(tmp_path), 'original')
  with tf.Graph().as_default():
    written = {name: tf.Variable(value, name=name)
               for name, value in state.items()}
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      tf.compat.v1.train.Saver(written).save(session, path)

  trainer = _trainer(use_tpu, model)
  batches = _micro_batches(model)
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    # It has no settings: the one step (README "Checkpoints") writes them,
    # with the place its counter says, and the rest as it is.
    with pytest.raises(tf.errors.NotFoundError, match='settings'):
      tf.compat.v1.train.Saver().restore(session, path)
    converted = deferred_grad.convert_checkpoint(path)
    assert converted == path + '.converted'
    tf.compat.v1.train.Saver().restore(session, converted)
    for step in range(STOP_STEP, TOTAL_STEPS):
      trainer.micro_step(session, *[part[step] for part in batches])
    resumed = session.run(trainer.variables)
  training.assert_same_training([resumed], [expected], rtol=0, atol=0)


def _replica_batches():
  """Micro-batches of REPLICAS * MICRO_BATCH rows: each replica its half."""
  return models.make_data(TOTAL_STEPS,
                          training.REPLICAS * models.MICRO_BATCH)


def _mirrored(optimizer='Momentum'):
  return training.MirroredTrainer(models.OPTIMIZERS[optimizer], GRAD_STEPS)


def _run_mirrored(trainer, session, batches, steps):
  for step in steps:
    trainer.micro_step(session, *[part[step] for part in batches])


@pytest.mark.parametrize('loop', ['session', 'monitored'])
def test_mirrored_strategy_resumes_mid_cycle(loop, tmp_path):
  """Each replica's partial sum survives a save and restore mid-cycle.

  The checkpoint holds the sum over replicas under the original's key (a
  mirrored slot would save replica 0's part only, and a resumed job would
  end 0.035 away from the uninterrupted one).
  """
  batches = _replica_batches()
  uninterrupted = _mirrored()
  with tf.compat.v1.Session(graph=uninterrupted.graph) as session:
    session.run(uninterrupted.init_op)
    _run_mirrored(uninterrupted, session, batches, range(TOTAL_STEPS))
    expected = session.run(uninterrupted.variables)

  first = _mirrored()
  checkpoint_dir = str(tmp_path)
  with first.graph.as_default():
    accumulator = first.optimizer.get_slot(first.variables['w1'],
                                           'grad_accum')
    parts = first.strategy.experimental_local_results(accumulator)
  if loop == 'session':
    with first.graph.as_default(), tf.compat.v1.Session() as session:
      session.run(first.init_op)
      _run_mirrored(first, session, batches, range(STOP_STEP))
      at_save = session.run(parts)
      tf.compat.v1.train.Saver().save(session, checkpoint_dir + '/model')
  else:
    assert _train_monitored(first, checkpoint_dir, STOP_STEP,
                            batches) == STOP_STEP
    at_save = [tf.train.load_variable(checkpoint_dir,
                                      'w1/GradientAccumulator')]
  saved = tf.train.load_variable(checkpoint_dir, 'w1/GradientAccumulator')
  np.testing.assert_allclose(saved, np.sum(at_save, axis=0), rtol=1e-6)
  if loop == 'session':
    assert not np.allclose(at_save[0], at_save[1])  # two different parts

  second = _mirrored()
  if loop == 'session':
    with second.graph.as_default(), tf.compat.v1.Session() as session:
      tf.compat.v1.train.Saver().restore(
          session, tf.train.latest_checkpoint(checkpoint_dir))
      _run_mirrored(second, session, batches, range(STOP_STEP, TOTAL_STEPS))
      resumed = session.run(second.variables)
  else:
    assert _train_monitored(second, checkpoint_dir, TOTAL_STEPS,
                            batches) == TOTAL_STEPS
    resumed = {name: tf.train.load_variable(checkpoint_dir, name)
               for name in expected}
  # Round-off only: the restored sum is split between the replicas.
  training.assert_same_training([resumed], [expected])


# ------------------------------------ accumulation on an old checkpoint --


def test_checkpoint_with_accumulators_restores_without_the_wrapper(tmp_path):
  """Back: an evaluation or export graph restores the model from it."""
  trainer = training.Trainer(models.OPTIMIZERS['Adam'], 3)
  data = models.make_data(2, 3 * models.MICRO_BATCH)
  with trainer.session() as session:
    trainer.run(session, data)
    path = tf.compat.v1.train.Saver().save(session, str(tmp_path / 'model'))
    expected = session.run(trainer.variables)
  with tf.Graph().as_default():
    _, variables = models.model_loss(
        tf.zeros([1, models.INPUT_DIM]), tf.zeros([1, models.OUTPUT_DIM]))
    with tf.compat.v1.Session() as session:
      tf.compat.v1.train.Saver(variables).restore(session, path)
      actual = session.run(variables)
  training.assert_same_training([actual], [expected], rtol=0, atol=0)
