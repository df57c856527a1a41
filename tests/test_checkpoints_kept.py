"""The checkpoints kept are the user's to configure, with the wrapper too.

The wrapper installs no saver: each front end saves with the saver it makes
without the wrapper, from the settings the user gave it. Each test trains
the same model twice, with the bare optimizer and with the wrapper (one
micro-batch a step either way: the files depend on the steps, not on the
numbers), and compares the checkpoint files left on disk and the
directory's `checkpoint` record. The wrapped checkpoints hold the same keys
plus the wrapper's own state.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad

K = 2
STEPS = 8
MICRO = 4

needs_estimator = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')

# RunConfig's checkpoint settings. keep_checkpoint_every_n_hours of a few
# microseconds keeps every checkpoint that max_to_keep would delete.
RUN_CONFIGS = {
    'keep_1': dict(keep_checkpoint_max=1),
    'keep_3': dict(keep_checkpoint_max=3),
    'keep_all': dict(keep_checkpoint_max=None),
    'every_n_hours': dict(keep_checkpoint_max=1,
                          keep_checkpoint_every_n_hours=1e-9),
    'save_secs': dict(save_checkpoints_steps=None,
                      save_checkpoints_secs=3600),
}


def _files(directory):
  """The checkpoint files (and the latest recorded) in `directory`."""
  names = sorted(n for n in os.listdir(directory)
                 if n.startswith('model.ckpt') or n == 'checkpoint')
  state = tf.train.get_checkpoint_state(directory)
  return names, [os.path.basename(p) for p in
                 state.all_model_checkpoint_paths]


def _keys(directory):
  return {k for k, _ in tf.train.list_variables(
      tf.train.latest_checkpoint(directory))}


def _assert_same_files(bare_dir, wrapped_dir):
  """The same files; the wrapped keys are the bare ones, Adam's powers
  under the original's names, and the wrapper's state."""
  assert _files(wrapped_dir) == _files(bare_dir)
  powers = ('beta1_power', 'beta2_power')
  bare, wrapped = _keys(bare_dir), _keys(wrapped_dir)
  assert all(k.endswith(powers) for k in bare - wrapped), bare - wrapped
  assert all(k.endswith(powers + ('/GradientAccumulator',
                                  '/deferred_grad_settings'))
             for k in wrapped - bare), wrapped - bare


def _data():
  rng = np.random.RandomState(0)
  x = rng.randn(STEPS * MICRO, 4).astype(np.float32)
  return x, x.dot(np.linspace(-1, 1, 4).reshape(4, 1)).astype(np.float32)


def _optimizer(wrapped, **kwargs):
  opt = tf.compat.v1.train.AdamOptimizer(0.01)
  return (deferred_grad.GradientAggregationOptimizer(opt, K, **kwargs)
          if wrapped else opt)


# ------------------------------------------------------------- Estimator --

def _input_fn():
  return tf.data.Dataset.from_tensor_slices(_data()).batch(MICRO).repeat()


def _canned_input_fn():
  x, y = _data()
  return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
      MICRO).repeat()


def _model_fn(features, labels, mode, params):
  w = tf.compat.v1.get_variable('w', [4, 1])
  loss = tf.reduce_mean(tf.square(tf.matmul(features, w) - labels))
  train_op = _optimizer(params['wrapped']).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                              train_op=train_op)


def _estimator(kind, model_dir, wrapped, settings):
  config = tf.compat.v1.estimator.RunConfig(
      model_dir=model_dir, tf_random_seed=1, save_summary_steps=None,
      log_step_count_steps=None,
      **dict(dict(save_checkpoints_steps=1), **settings))
  if kind == 'model_fn':
    return tf.compat.v1.estimator.Estimator(
        _model_fn, params=dict(wrapped=wrapped), config=config)
  # A canned head sums the loss over the batch: aggregation='sum'.
  return tf.compat.v1.estimator.DNNRegressor(
      [3], [tf.compat.v1.feature_column.numeric_column('x', [4])],
      optimizer=_optimizer(wrapped, aggregation='sum'), config=config)


@needs_estimator
@pytest.mark.parametrize('settings', sorted(RUN_CONFIGS))
@pytest.mark.parametrize('kind', ['model_fn', 'DNNRegressor'])
def test_an_estimator_keeps_what_run_config_says(kind, settings, tmp_path):
  """Trained in two calls (the second resumes), as jobs are."""
  for wrapped in (False, True):
    model_dir = str(tmp_path / str(wrapped))
    for max_steps in (STEPS // 2, STEPS):
      estimator = _estimator(kind, model_dir, wrapped,
                             RUN_CONFIGS[settings])
      input_fn = _input_fn if kind == 'model_fn' else _canned_input_fn
      estimator.train(input_fn, max_steps=max_steps)
  _assert_same_files(str(tmp_path / 'False'), str(tmp_path / 'True'))
  kept = [n for n in _files(str(tmp_path / 'True'))[0] if n.endswith('.index')]
  if settings == 'keep_1':
    assert kept == ['model.ckpt-%d.index' % STEPS]
  elif settings == 'keep_3':
    assert len(kept) == 3
  elif settings in ('keep_all', 'every_n_hours'):
    assert len(kept) >= STEPS  # more than the 5 of RunConfig's default


# ------------------------------------- MonitoredTrainingSession, Supervisor --

def _graph(wrapped):
  x, y = _data()
  x = tf.constant(x.reshape(STEPS, MICRO, 4))
  y = tf.constant(y.reshape(STEPS, MICRO, 1))
  global_step = tf.compat.v1.train.get_or_create_global_step()
  w = tf.compat.v1.get_variable('w', [4, 1])
  at = tf.math.floormod(global_step, STEPS)
  loss = tf.reduce_mean(tf.square(tf.matmul(x[at], w) - y[at]))
  return _optimizer(wrapped).minimize(loss, global_step=global_step)


@pytest.mark.parametrize('saver', ['default', 'scaffold_keep_2'])
def test_a_monitored_training_session_keeps_what_it_is_told(saver,
                                                            tmp_path):
  for wrapped in (False, True):
    with tf.Graph().as_default():
      train_op = _graph(wrapped)
      scaffold = tf.compat.v1.train.Scaffold(
          saver=tf.compat.v1.train.Saver(max_to_keep=2)
          if saver != 'default' else None)
      with tf.compat.v1.train.MonitoredTrainingSession(
          checkpoint_dir=str(tmp_path / str(wrapped)), scaffold=scaffold,
          save_checkpoint_steps=1, save_checkpoint_secs=None,
          save_summaries_steps=None, save_summaries_secs=None,
          log_step_count_steps=None,
          hooks=[tf.compat.v1.train.StopAtStepHook(last_step=STEPS)]) as sess:
        while not sess.should_stop():
          sess.run(train_op)
  _assert_same_files(str(tmp_path / 'False'), str(tmp_path / 'True'))
  kept = [n for n in _files(str(tmp_path / 'True'))[0] if n.endswith('.index')]
  assert len(kept) == (2 if saver != 'default' else 5)


@pytest.mark.parametrize('saver', ['default', 'keep_2'])
def test_a_supervisor_keeps_what_it_is_told(saver, tmp_path):
  for wrapped in (False, True):
    with tf.Graph().as_default():
      train_op = _graph(wrapped)
      own = {} if saver == 'default' else dict(
          saver=tf.compat.v1.train.Saver(max_to_keep=2))
      supervisor = tf.compat.v1.train.Supervisor(
          logdir=str(tmp_path / str(wrapped)), save_model_secs=0,
          save_summaries_secs=0, **own)
      with supervisor.managed_session() as session:
        for _ in range(STEPS):
          session.run(train_op)
          supervisor.saver.save(session, supervisor.save_path,
                                global_step=supervisor.global_step)
  _assert_same_files(str(tmp_path / 'False'), str(tmp_path / 'True'))
  kept = [n for n in _files(str(tmp_path / 'True'))[0] if n.endswith('.index')]
  assert len(kept) == (2 if saver != 'default' else 5)


def test_the_wrapper_adds_no_saver_to_the_graph():
  with tf.Graph().as_default():
    _graph(True)
    assert not tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SAVERS)
