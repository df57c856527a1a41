"""Turning accumulation on or off, or changing grad_steps, over a checkpoint.

A job trained for a while at one setting goes on from its latest
checkpoint, written at a cycle boundary, at another: bare -> wrapped
(accumulation turned on), wrapped -> bare (off), K -> K', and the other graph
behaviour (v1 <-> v2). After the switch it trains as the bare optimizer does
on the new batch size, continuing from the same state: the weights, the
wrapped optimizer's state (Adam's moments and beta powers, Adagrad's and
FTRL's accumulators) and `global_step`. Each front end with its one
documented step (README "Checkpoints"): a raw Session restoring with
`deferred_grad.Saver` (or `convert_checkpoint` and a plain Saver),
MonitoredTrainingSession and a Supervisor given a plain saver after
`convert_checkpoint(directory)`, Estimators (canned ones too) trained with
`ConvertCheckpointHook`, and Keras 2's `save_weights`/`load_weights`
(nothing).

The reference is one bare job that changes its batch size at the switch: a
bare step on a batch of K micro-batches for each of the wrapper's cycles.
`test_the_reference_tells_a_lost_state_apart` shows it would catch a switch
that lost the optimizer's state.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

if __name__ == '__main__':  # a worker: the other behaviour (see _other)
  os.environ['DEFERRED_GRAD_TF_BEHAVIOR'] = json.loads(sys.argv[1])['behavior']

# pylint: disable=g-import-not-at-top,wrong-import-position
import behavior
import tensorflow as tf

import deferred_grad
import models
import training

MICRO = models.MICRO_BATCH
# (setting before, setting after): None is the bare optimizer on batches of
# MICRO; an int K the wrapper, K micro-batches of MICRO per update. Phase 1
# ends at global_step 6 in every case: a multiple of each K.
SWITCHES = {'on': (None, 3), 'off': (3, None), 'K_to_K': (3, 2)}
UPDATES = {None: 6, 2: 3, 3: 2}  # phase 1's updates, by its setting
LATER_UPDATES = 2
# model -> its optimizer: Adam has non-slot variables, Adagrad slots only
# (on a table: its sparse update).
MODELS = {'mlp': 'Adam', 'embedding': 'Adagrad'}


class _Stream(object):
  """The examples of a model, taken in order."""

  def __init__(self, model, count=200):
    data = models.MODELS[model][0](1, count)
    self._parts = [part[0] for part in data]
    self._at = 0

  def take(self, size):
    self._at += size
    return [part[self._at - size:self._at] for part in self._parts]


def _phase_sizes(before, after):
  """[(setting, updates)] of phase 1 and phase 2."""
  return [(before, UPDATES[before]), (after, LATER_UPDATES)]


def _run(trainer, session, stream, setting, updates):
  for _ in range(updates):
    batch = stream.take((setting or 1) * MICRO)
    if setting is None:
      trainer.micro_step(session, *batch)
    else:
      trainer.run_cycle(session, *batch)


def _trainer(model, setting, scope=None):
  return training.Trainer(models.OPTIMIZERS[MODELS[model]], setting,
                          model=model, scope=scope)


def _reference(model, before, after):
  """One bare job: phase 1's batches, then phase 2's, in one session."""
  trainer = _trainer(model, None)  # (names do not change the numbers)
  stream = _Stream(model)
  with trainer.session() as session:
    for setting, updates in _phase_sizes(before, after):
      for _ in range(updates):
        trainer.micro_step(session, *stream.take((setting or 1) * MICRO))
    return session.run(trainer.variables)


def _first_phase(model, setting, path, scope=None):
  """Trains phase 1 at `setting` from scratch; saves to `path` (a plain
  Saver: every saver saves the wrapper's state)."""
  trainer = _trainer(model, setting, scope)
  stream = _Stream(model)
  with trainer.graph.as_default(), trainer.session() as session:
    _run(trainer, session, stream, setting, UPDATES[setting])
    tf.compat.v1.train.Saver().save(session, path)
    return session.run(trainer.global_step)


def _second_phase(model, before, after, path, scope=None, step='saver'):
  """Restores `path` at setting `after` with the session's step ('saver':
  `deferred_grad.Saver`; 'convert': `convert_checkpoint`, then a plain
  Saver); trains phase 2; the weights."""
  trainer = _trainer(model, after, scope)
  stream = _Stream(model)
  stream.take((before or 1) * MICRO * UPDATES[before])
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    if step == 'saver':
      deferred_grad.Saver().restore(session, path)
    else:
      tf.compat.v1.train.Saver().restore(
          session, deferred_grad.convert_checkpoint(path))
    step = session.run(trainer.global_step)
    _run(trainer, session, stream, after, LATER_UPDATES)
    assert session.run(trainer.global_step) == step + (
        (after or 1) * LATER_UPDATES)
    return step, session.run(trainer.variables)


@pytest.mark.parametrize('step', ['saver', 'convert'])
@pytest.mark.parametrize('model, scope', [('mlp', None), ('mlp', 'dnn/head'),
                                          ('embedding', None)])
@pytest.mark.parametrize('switch', sorted(SWITCHES))
def test_a_session(switch, model, scope, step, tmp_path):
  """Saved by a plain Saver, restored with the step. Under a name scope the
  bare Adam names its powers `dnn/head/beta1_power`, the wrapper as the
  original did."""
  before, after = SWITCHES[switch]
  path = os.path.join(str(tmp_path), 'model')
  step_count = _first_phase(model, before, path, scope=scope)
  restored_step, actual = _second_phase(model, before, after, path,
                                        scope=scope, step=step)
  assert restored_step == step_count == 6
  training.assert_same_training([actual], [_reference(model, before, after)])


def test_the_reference_tells_a_lost_state_apart(tmp_path):
  """The control: a switch that kept the weights but lost Adam's state
  (its moments and powers started afresh) ends far from the reference."""
  before, after = SWITCHES['on']
  path = os.path.join(str(tmp_path), 'model')
  _first_phase('mlp', before, path)
  trainer = _trainer('mlp', after)
  stream = _Stream('mlp')
  stream.take(MICRO * UPDATES[before])
  with trainer.graph.as_default(), trainer.session() as session:
    tf.compat.v1.train.Saver(list(trainer.variables.values())).restore(
        session, path)
    _run(trainer, session, stream, after, LATER_UPDATES)
    actual = session.run(trainer.variables)
  expected = _reference('mlp', before, after)
  assert max(np.max(np.abs(actual[n] - expected[n])) for n in expected) > 1e-3


def test_a_plain_saver_without_the_wrapper_refuses_a_wrapped_name(tmp_path):
  """Why the wrapper's checkpoints carry Adam's powers under their names
  without it: written by a plain Saver (not deferred_grad's), a bare graph's
  plain Saver does not find `beta1_power` under the name it gives it."""
  path = os.path.join(str(tmp_path), 'model')
  trainer = _trainer('mlp', 3)
  with trainer.graph.as_default(), trainer.session() as session:
    tf.compat.v1.train.Saver().save(session, path)
  keys = {name for name, _ in tf.train.list_variables(path)}
  bare = _trainer('mlp', None)
  bare_names = {v.op.name for v in bare.graph.get_collection('variables')}
  if tf.compat.v1.control_flow_v2_enabled():
    assert {'beta1_power', 'beta2_power'} <= keys & bare_names
  else:  # the original's names: in the v1 branch's scope
    assert {'cond/beta1_power', 'cond/beta2_power'} <= keys
    with bare.graph.as_default(), tf.compat.v1.Session() as session:
      with pytest.raises(tf.errors.NotFoundError, match='beta1_power'):
        tf.compat.v1.train.Saver().restore(session, path)


@pytest.mark.parametrize('model', sorted(MODELS))
def test_a_bare_graph_s_deferred_grad_saver_reads_a_plain_saver_s_names(
    model, tmp_path):
  """Written by a plain Saver with the wrapper (the original's names),
  restored by deferred_grad.Saver in a graph without it."""
  before, after = SWITCHES['off']
  path = os.path.join(str(tmp_path), 'model')
  _first_phase(model, before, path)
  trainer = _trainer(model, after)
  stream = _Stream(model)
  stream.take(before * MICRO * UPDATES[before])
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    deferred_grad.Saver().restore(session, path)
    _run(trainer, session, stream, after, LATER_UPDATES)
    actual = session.run(trainer.variables)
  training.assert_same_training([actual], [_reference(model, before, after)])


# ---------------------------------------------- the other graph behaviour --

def _other():
  return 'v1' if behavior.BEHAVIOR == 'v2' else 'v2'


def _first_phase_in_the_other_behaviour(model, setting, path, scope):
  """Phase 1 in a process of the other graph behaviour (this module)."""
  arguments = json.dumps(dict(behavior=_other(), model=model,
                              setting=setting, path=path, scope=scope))
  result = subprocess.run(
      [sys.executable, os.path.abspath(__file__), arguments],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      universal_newlines=True, timeout=300)
  assert result.returncode == 0, result.stdout


@pytest.mark.parametrize('model, scope', [('mlp', 'dnn/head'),
                                          ('embedding', None)])
@pytest.mark.parametrize('settings', [(3, 3), (None, 3), (3, None)],
                         ids=['wrapped', 'on', 'off'])
def test_a_checkpoint_of_the_other_graph_behaviour(settings, model, scope,
                                                   tmp_path):
  """v1 <-> v2: the wrapped Adam's powers are `dnn/head/cond/beta1_power`
  under control flow v1, `beta1_power` under v2 (the original's names)."""
  before, after = settings
  path = os.path.join(str(tmp_path), 'model')
  _first_phase_in_the_other_behaviour(model, before, path, scope)
  _, actual = _second_phase(model, before, after, path, scope=scope)
  training.assert_same_training([actual], [_reference(model, before, after)])


# -------------------------------------------------- MonitoredTrainingSession --

def _monitored(model, setting, checkpoint_dir, skip, updates):
  """Trains `updates` updates under MonitoredTrainingSession (no Scaffold:
  its own plain saver), resuming from `checkpoint_dir` after the step."""
  trainer = _trainer(model, setting, 'head')
  stream = _Stream(model)
  stream.take(skip)
  with trainer.graph.as_default():
    if tf.train.latest_checkpoint(checkpoint_dir):
      deferred_grad.convert_checkpoint(checkpoint_dir)
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, save_checkpoint_steps=1000,
        save_checkpoint_secs=None, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None) as session:
      start = session.run(trainer.global_step)
      _run(trainer, session, stream, setting, updates)
  return start, tf.train.load_checkpoint(checkpoint_dir)


@pytest.mark.parametrize('model', sorted(MODELS))
@pytest.mark.parametrize('switch', sorted(SWITCHES))
def test_a_monitored_training_session(switch, model, tmp_path):
  before, after = SWITCHES[switch]
  checkpoint_dir = str(tmp_path)
  _monitored(model, before, checkpoint_dir, 0, UPDATES[before])
  start, reader = _monitored(model, after, checkpoint_dir,
                             (before or 1) * MICRO * UPDATES[before],
                             LATER_UPDATES)
  assert start == 6
  expected = _reference(model, before, after)
  training.assert_same_training(
      [{name: reader.get_tensor(name) for name in expected}], [expected])


# -------------------------------------------------------------- Estimator --

needs_estimator = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')


def _input_fn(model, skip, setting):
  """Micro-batches (the bare: batches) of MICRO after `skip` examples."""
  def input_fn():
    stream = _Stream(model)
    stream.take(skip)
    examples = stream.take(MICRO * 40)
    return tf.data.Dataset.from_tensor_slices(tuple(examples)).batch(MICRO)
  del setting
  return input_fn


def _model_fn(features, labels, mode, params):
  loss, _ = models.MODELS[params['model']][2](features, labels)
  opt = models.OPTIMIZERS[MODELS[params['model']]](None)
  if params['setting'] is not None:
    opt = deferred_grad.GradientAggregationOptimizer(opt, params['setting'])
  with tf.compat.v1.name_scope('head'):
    train_op = opt.minimize(loss,
                            global_step=tf.compat.v1.train.get_global_step())
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                              train_op=train_op)


# ------------------------------------------------------------- Supervisor --

def _supervised(model, setting, logdir, skip, updates):
  """Trains `updates` updates under a Supervisor given a plain Saver (as
  TF-Slim's trainer gives it), resuming from `logdir` after the step."""
  trainer = _trainer(model, setting)
  stream = _Stream(model)
  stream.take(skip)
  with trainer.graph.as_default():
    if tf.train.latest_checkpoint(logdir):
      deferred_grad.convert_checkpoint(logdir)
    supervisor = tf.compat.v1.train.Supervisor(
        logdir=logdir, saver=tf.compat.v1.train.Saver(), save_model_secs=0,
        save_summaries_secs=0)
    with supervisor.managed_session() as session:
      start = session.run(trainer.global_step)
      _run(trainer, session, stream, setting, updates)
      supervisor.saver.save(session, supervisor.save_path,
                            global_step=trainer.global_step)
  return start, tf.train.load_checkpoint(logdir)


@pytest.mark.parametrize('switch', sorted(SWITCHES))
def test_a_supervisor_given_a_plain_saver(switch, tmp_path):
  before, after = SWITCHES[switch]
  logdir = str(tmp_path)
  _supervised('mlp', before, logdir, 0, UPDATES[before])
  start, reader = _supervised('mlp', after, logdir,
                              (before or 1) * MICRO * UPDATES[before],
                              LATER_UPDATES)
  assert start == 6
  assert reader.get_tensor('global_step') == 6 + (after or 1) * LATER_UPDATES
  expected = _reference('mlp', before, after)
  training.assert_same_training(
      [{name: reader.get_tensor(name) for name in expected}], [expected])


@needs_estimator
@pytest.mark.parametrize('model', sorted(MODELS))
@pytest.mark.parametrize('switch', sorted(SWITCHES))
def test_an_estimator_with_its_model_fn(switch, model, tmp_path):
  """The Estimator's own saver; the step is the hook."""
  before, after = SWITCHES[switch]
  model_dir = str(tmp_path)

  def estimator(setting):
    return tf.compat.v1.estimator.Estimator(
        _model_fn, model_dir, params=dict(model=model, setting=setting),
        config=tf.compat.v1.estimator.RunConfig(save_summary_steps=None,
                                                log_step_count_steps=None))

  estimator(before).train(_input_fn(model, 0, before), max_steps=6)
  skip = (before or 1) * MICRO * UPDATES[before]
  if before is None:  # a bare step per micro-batch: its batches are larger
    skip = MICRO * 6
  trained = estimator(after)
  trained.train(_input_fn(model, skip, after),
                max_steps=6 + (after or 1) * LATER_UPDATES,
                hooks=[deferred_grad.ConvertCheckpointHook(model_dir)])
  expected = _reference_with(model, [(before, UPDATES[before], MICRO),
                                     (after, LATER_UPDATES, MICRO)])
  training.assert_same_training(
      [{name: trained.get_variable_value(name) for name in expected}],
      [expected])


def _reference_with(model, phases):
  """A bare job of [(setting, updates, micro-batch)]: a step per update on
  the setting's micro-batches together (the bare: one micro-batch)."""
  trainer = _trainer(model, None)
  stream = _Stream(model)
  with trainer.session() as session:
    for setting, updates, micro in phases:
      for _ in range(updates):
        trainer.micro_step(session, *stream.take((setting or 1) * micro))
    return session.run(trainer.variables)


# (canned model, optimizer): the heads sum the loss: aggregation='sum'.
CANNED = {
    'DNNRegressor': lambda d, opt: tf.compat.v1.estimator.DNNRegressor(
        [5], [tf.compat.v1.feature_column.numeric_column(
            'x', [models.INPUT_DIM])], d, label_dimension=models.OUTPUT_DIM,
        optimizer=opt, config=tf.compat.v1.estimator.RunConfig(
            tf_random_seed=3, save_summary_steps=None,
            log_step_count_steps=None)),
    'LinearRegressor': lambda d, opt: tf.compat.v1.estimator.LinearRegressor(
        [tf.compat.v1.feature_column.numeric_column('x', [models.INPUT_DIM])],
        d, label_dimension=models.OUTPUT_DIM, optimizer=opt,
        config=tf.compat.v1.estimator.RunConfig(save_summary_steps=None,
                                                log_step_count_steps=None)),
}
CANNED_OPTIMIZERS = {'DNNRegressor': 'Adam', 'LinearRegressor': 'Ftrl'}


def _canned_input_fn(skip, batch):
  def input_fn():
    stream = _Stream('mlp')
    stream.take(skip)
    x, y = stream.take(MICRO * 40)
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(batch)
  return input_fn


@needs_estimator
@pytest.mark.parametrize('canned', sorted(CANNED))
@pytest.mark.parametrize('switch', sorted(SWITCHES))
def test_a_canned_estimator(switch, canned, tmp_path):
  """Adam's powers are `dnn/head/beta1_power` without the wrapper; FTRL
  has slots only. Against the same canned model trained bare, its batch
  changed at the switch."""
  before, after = SWITCHES[switch]

  def optimizer(setting):
    opt = models.OPTIMIZERS[CANNED_OPTIMIZERS[canned]](None)
    if setting is None:
      return opt
    return deferred_grad.GradientAggregationOptimizer(opt, setting,
                                                      aggregation='sum')

  def train(model_dir, setting, skip, batch, max_steps):
    estimator = CANNED[canned](str(model_dir), optimizer(setting))
    estimator.train(_canned_input_fn(skip, batch), max_steps=max_steps,
                    hooks=[deferred_grad.ConvertCheckpointHook(model_dir)])
    return estimator

  train(tmp_path / 'switched', before, 0, MICRO, 6)
  skip = MICRO * 6 if before is None else before * MICRO * UPDATES[before]
  switched = train(tmp_path / 'switched', after, skip, MICRO,
                   6 + (after or 1) * LATER_UPDATES)
  train(tmp_path / 'bare', None, 0, (before or 1) * MICRO, UPDATES[before])
  bare = train(tmp_path / 'bare', None, skip, (after or 1) * MICRO,
               UPDATES[before] + LATER_UPDATES)
  names = [n for n in bare.get_variable_names() if n != 'global_step']
  expected = {n: bare.get_variable_value(n) for n in names}
  # Wrapped, Adam's powers have the original's names (`beta1_power`,
  # `dnn/head/cond/beta1_power`) where the bare has `dnn/head/beta1_power`.
  held = switched.get_variable_names()
  wrapped_name = lambda n: n if n in held else [
      h for h in held if h.split('/')[-1] == n.split('/')[-1] and
      'GradientAccumulator' not in h][0]
  actual = {n: switched.get_variable_value(wrapped_name(n)) for n in names}
  training.assert_same_training([actual], [expected])


# ------------------------------------------------------------------ Keras --

def _keras():
  if tf.__version__.startswith('2.15.'):
    return tf.keras
  return pytest.importorskip('tf_keras')


def _keras_fit(setting, chunks, load=None, save=None, optimizer='Adam',
               embedding=False):
  """A fresh Keras model, fit on each chunk of examples at `setting`."""
  keras = _keras()
  tf.compat.v1.reset_default_graph()
  keras.backend.clear_session()
  if embedding:
    model = keras.Sequential([
        keras.layers.Embedding(models.TABLE_ROWS, models.EMBEDDING_DIM,
                               input_length=models.IDS_PER_EXAMPLE,
                               embeddings_initializer=keras.initializers
                               .RandomNormal(seed=3)),
        keras.layers.Flatten(),
        keras.layers.Dense(models.OUTPUT_DIM,
                           kernel_initializer=keras.initializers.RandomNormal(
                               seed=4))])
  else:
    model = keras.Sequential([
        keras.layers.Dense(5, activation='tanh',
                           input_shape=(models.INPUT_DIM,),
                           kernel_initializer=keras.initializers.RandomNormal(
                               seed=1)),
        keras.layers.Dense(models.OUTPUT_DIM,
                           kernel_initializer=keras.initializers.RandomNormal(
                               seed=2))])
  opt = models.OPTIMIZERS[optimizer](None)
  if setting is not None:
    opt = deferred_grad.GradientAggregationOptimizer(opt, setting)
  model.compile(optimizer=opt, loss='mse')
  if load:
    model.load_weights(load)
  for chunk, batch_size in chunks:
    model.fit(chunk[0], chunk[1], batch_size=batch_size, epochs=1,
              shuffle=False, verbose=0)
  if save:
    model.save_weights(save)
  return model.get_weights(), keras.backend.get_value(
      model.optimizer.iterations)


@pytest.mark.parametrize('embedding', [False, True], ids=['mlp', 'table'])
@pytest.mark.parametrize('switch', sorted(SWITCHES) + ['resume'])
def test_keras_save_weights_and_load_weights(switch, embedding, tmp_path):
  before, after = SWITCHES.get(switch, (3, 3))
  stream = _Stream('embedding' if embedding else 'mlp')
  first = stream.take((before or 1) * MICRO * UPDATES[before])
  second = stream.take((after or 1) * MICRO * LATER_UPDATES)
  optimizer = 'Adagrad' if embedding else 'Adam'
  path = os.path.join(str(tmp_path), 'weights')
  _, step = _keras_fit(before, [(first, MICRO if before else MICRO)],
                       save=path, optimizer=optimizer, embedding=embedding)
  assert step == 6
  actual, step = _keras_fit(after, [(second, MICRO)], load=path,
                            optimizer=optimizer, embedding=embedding)
  assert step == 6 + (after or 1) * LATER_UPDATES
  expected, _ = _keras_fit(None, [(first, (before or 1) * MICRO),
                                  (second, (after or 1) * MICRO)],
                           optimizer=optimizer, embedding=embedding)
  for got, want in zip(actual, expected):
    np.testing.assert_allclose(got, want, rtol=training.RTOL,
                               atol=training.ATOL)


def test_keras_resumes_mid_cycle(tmp_path):
  """Saved one micro-step into a cycle: the accumulators are the wrapper's
  slots in the object graph, restored with the rest."""
  stream = _Stream('mlp')
  first = stream.take(7 * MICRO)  # two cycles of 3 and one micro-step
  second = stream.take(5 * MICRO)
  path = os.path.join(str(tmp_path), 'weights')
  _keras_fit(3, [(first, MICRO)], save=path)
  actual, step = _keras_fit(3, [(second, MICRO)], load=path)
  assert step == 12
  expected, _ = _keras_fit(3, [(first, MICRO), (second, MICRO)])
  for got, want in zip(actual, expected):
    np.testing.assert_array_equal(got, want)


def main(arguments):
  arguments = json.loads(arguments)
  _first_phase(arguments['model'], arguments['setting'], arguments['path'],
               scope=arguments['scope'])


if __name__ == '__main__':
  main(sys.argv[1])
