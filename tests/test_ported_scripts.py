"""Three scripts shaped like real TF1 programs, ported with the option.

Each script is written once for the large batch; its port changes only
the import, the wrapper (`global_step_counts='updates'`), the input's batch
(the micro-batch: the script's batch-size setting stays the large batch,
so that what it derives from it is unchanged) and, where the script runs
something after its train op, `once_per_update`. Each port trains on the
same examples as the bare script on the large batch, and the two must end
alike: weights, the optimizer's slots, the learning rate of every update,
the moving average, `global_step`, the checkpoint files kept and the
micro-step where the run stops. Each port runs with
`deferred_grad.PortCheckHook`, which must log nothing on it; with an edit
skipped that the wrapper cannot see, the hook names it.

* BERT's shape (google-research/bert): an Estimator model_fn, BERT's
  AdamWeightDecayOptimizer and warm-up schedule on `global_step`, and the
  script's own `global_step` increment, which the port must remove: kept,
  the next micro-step fails naming it.
* EfficientNet's shape (tensorflow/tpu): a TPUEstimator model_fn, a learning
  rate scaled on the batch with warm-up and decay on `global_step`, RMSProp,
  a moving average of the weights after the train op, `train_steps`.
* TF-Slim's `train_image_classifier` shape: a `Supervisor` loop stopped at
  `number_of_steps`, its decay steps derived from the batch size, saved at
  the end with the Supervisor's saver.
"""

import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import scripts
import training

sys.path.insert(0, os.path.join(scripts.TOOLS, 'examples'))
# pylint: disable=g-import-not-at-top,wrong-import-position
from bert_optimization import AdamWeightDecayOptimizer
from bert_optimization import learning_rate_schedule
# pylint: enable=g-import-not-at-top,wrong-import-position

K, MICRO, UPDATES = 4, 4, 6
LARGE = K * MICRO  # the scripts' batch-size setting
RTOL, ATOL = 1e-5, 1e-6

needs_estimator = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')


def _examples(count=UPDATES * LARGE):
  rng = np.random.RandomState(0)
  x = rng.randn(count, 4).astype(np.float32)
  y = (x.dot(np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)) +
       0.1 * rng.randn(count, 1).astype(np.float32))
  return x, y


def _input_fn(batch=None):
  """The examples in batches of `batch` (None: TPUEstimator's
  `params['batch_size']`, its `train_batch_size`)."""
  def input_fn(params=None):
    return tf.data.Dataset.from_tensor_slices(_examples()).batch(
        batch or params['batch_size'], drop_remainder=True)
  return input_fn


def _dense(x):
  """A dense layer of one unit (tf.compat.v1.layers needs Keras 2)."""
  with tf.compat.v1.variable_scope('dense'):
    zeros = tf.compat.v1.zeros_initializer()
    kernel = tf.compat.v1.get_variable('kernel', [4, 1], initializer=zeros)
    bias = tf.compat.v1.get_variable('bias', [1], initializer=zeros)
  return tf.matmul(x, kernel) + bias


class _Recorder(tf.compat.v1.train.SessionRunHook):
  """Records, after each run, the learning rate the next update reads."""

  def __init__(self):
    self.learning_rate, self.values = None, []

  def begin(self):
    self.learning_rate = tf.compat.v1.get_collection('learning_rate')[0]

  def after_run(self, run_context, run_values):
    self.values.append(run_context.session.run(self.learning_rate))


def _files(directory):
  """The checkpoint files kept, by step."""
  return sorted(f for f in os.listdir(directory) if re.match(
      r'model\.ckpt-\d+\.index$', f))


def _variables(directory, pattern):
  """The model's variables saved (the wrapper's own state left out)."""
  reader = tf.train.load_checkpoint(directory)
  return {name: reader.get_tensor(name)
          for name in reader.get_variable_to_shape_map()
          if re.search(pattern, name) and 'GradientA' not in name}


def _assert_same(port, bare, runs_per_update=K):
  """Ports end as the bare script: everything `_trained` returns."""
  assert port['files'] == bare['files'] and bare['files']
  assert port['global_step'] == bare['global_step'] == UPDATES
  assert len(port['learning_rates']) == runs_per_update * len(
      bare['learning_rates'])
  np.testing.assert_allclose(port['learning_rates'][K - 1::K],
                             bare['learning_rates'], rtol=RTOL)
  assert sorted(port['variables']) == sorted(bare['variables'])
  for name in bare['variables']:
    np.testing.assert_allclose(port['variables'][name],
                               bare['variables'][name], rtol=RTOL, atol=ATOL,
                               err_msg=name)


def _trained(directory, recorder, pattern):
  return {'files': _files(directory),
          'global_step': int(tf.train.load_variable(directory, 'global_step')),
          'learning_rates': np.array(recorder.values),
          'variables': _variables(directory, pattern)}


# ------------------------------------------------------------ BERT-style --

def _bert_model_fn(features, labels, mode, params):
  """BERT's create_optimizer in a model_fn; `port`: the wrapper's K."""
  port, keep_increment = params['port'], params['keep_increment']
  counts = params['counts']
  loss = tf.reduce_mean(tf.square(_dense(features) - labels))
  global_step = tf.compat.v1.train.get_or_create_global_step()
  learning_rate = learning_rate_schedule(global_step, 0.1, UPDATES, 2)
  tf.compat.v1.add_to_collection('learning_rate', learning_rate)
  optimizer = AdamWeightDecayOptimizer(learning_rate)
  if port:
    optimizer = deferred_grad.GradientAggregationOptimizer(
        optimizer, port, global_step_counts=counts)
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients(loss, tvars)
  train_op = optimizer.apply_gradients(zip(grads, tvars),
                                       global_step=global_step)
  if not port or keep_increment:  # BERT's own (ordered: see bert_porting)
    with tf.control_dependencies([train_op]):
      train_op = global_step.assign_add(1)
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                              train_op=train_op)


def _bert(directory, port, keep_increment=False, counts='updates',
          stops=(UPDATES // 2, UPDATES)):
  recorder = _Recorder()
  for max_steps in stops:  # stopped and resumed
    estimator = tf.compat.v1.estimator.Estimator(
        _bert_model_fn, directory, params={'port': port,
                                           'keep_increment': keep_increment,
                                           'counts': counts},
        config=tf.compat.v1.estimator.RunConfig(
            save_checkpoints_steps=2, keep_checkpoint_max=2,
            save_summary_steps=None, log_step_count_steps=None))
    estimator.train(_input_fn(MICRO if port else LARGE), max_steps=max_steps,
                    hooks=[recorder, deferred_grad.PortCheckHook()])
  return _trained(directory, recorder, r'dense/.*(kernel|bias)')


@needs_estimator
def test_a_bert_style_model_fn_trains_as_the_large_batch(tmp_path):
  with training.logged('PortCheckHook') as warned:
    port = _bert(str(tmp_path / 'port'), K)
  assert not warned
  _assert_same(port, _bert(str(tmp_path / 'bare'), None))


@needs_estimator
def test_a_bert_style_model_fn_keeping_its_own_increment_fails_naming_it(
    tmp_path):
  with training.logged('PortCheckHook') as warned, pytest.raises(
      tf.errors.InvalidArgumentError,
      match='the script increments it beside the wrapper'):
    _bert(str(tmp_path / 'port'), K, keep_increment=True)
  assert len(warned) == 1 and 'every micro-step: global_step' in warned[0], warned


@needs_estimator
@pytest.mark.parametrize('counts', ['micro_steps', 'updates'])
def test_a_run_stopped_mid_cycle_is_named_by_the_port_check(tmp_path,
                                                            counts):
  """Counting micro-steps, a `max_steps` not a multiple of K stops mid-cycle;
  the hook names it. Counting updates, `max_steps` stops on an update."""
  stop = UPDATES if counts == 'updates' else K * UPDATES - 2
  with training.logged('PortCheckHook') as warned:
    _bert(str(tmp_path / counts), K, counts=counts, stops=[stop])
  if counts == 'updates':
    assert not warned
  else:
    assert len(warned) == 1, warned
    assert 'accumulated %d of its %d micro-batches' % (K - 2, K) in (
        warned[0])


# ------------------------------------------------ TPUEstimator image-style --

def _image_model_fn(features, labels, mode, params):
  """EfficientNet's training part; `port`: the wrapper's K."""
  port = params['port']
  loss = tf.reduce_mean(tf.square(_dense(features) - labels))
  global_step = tf.compat.v1.train.get_global_step()
  once_per_update = port and not params['skip_once_per_update']
  step = tf.cast(global_step, tf.float32)
  scaled = 0.4 * LARGE / 256.0  # the batch-size setting: the large batch
  learning_rate = tf.where(
      step < 2, scaled * (step + 1) / 2,
      tf.compat.v1.train.exponential_decay(scaled, step, 3, 0.9,
                                           staircase=True))
  tf.compat.v1.add_to_collection('learning_rate', learning_rate)
  optimizer = tf.compat.v1.train.RMSPropOptimizer(
      learning_rate, decay=0.9, momentum=0.9, epsilon=1e-3)
  if port:
    optimizer = deferred_grad.GradientAggregationOptimizer(
        optimizer, port, use_tpu=params['use_tpu'],
        global_step_counts=params['counts'])
  train_op = optimizer.minimize(loss, global_step)
  ema = tf.compat.v1.train.ExponentialMovingAverage(0.9,
                                                    num_updates=global_step)
  ema_vars = tf.compat.v1.trainable_variables()
  if once_per_update:
    train_op = optimizer.once_per_update(train_op,
                                         lambda: ema.apply(ema_vars))
  else:
    with tf.control_dependencies([train_op]):
      train_op = ema.apply(ema_vars)
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(mode, loss=loss,
                                                     train_op=train_op)


def _image(directory, port, iterations_per_loop, use_tpu=False,
           skip_once_per_update=False, counts='updates'):
  recorder = _Recorder()
  tpu = tf.compat.v1.estimator.tpu
  estimator = tpu.TPUEstimator(
      _image_model_fn, use_tpu=False,
      train_batch_size=MICRO if port else LARGE,
      params={'port': port, 'use_tpu': use_tpu,
              'skip_once_per_update': skip_once_per_update,
              'counts': counts},
      config=tpu.RunConfig(
          model_dir=directory, save_checkpoints_steps=2,
          keep_checkpoint_max=3, save_summary_steps=None,
          log_step_count_steps=None,
          tpu_config=tpu.TPUConfig(iterations_per_loop=iterations_per_loop)))
  estimator.train(_input_fn(), max_steps=UPDATES,
                  hooks=[recorder, deferred_grad.PortCheckHook()])
  return _trained(directory, recorder,
                  r'dense/.*(kernel|bias)(/RMSProp.*|/Exponential.*)?$')


@needs_estimator
@pytest.mark.parametrize('iterations_per_loop', [1, K])
def test_a_tpu_estimator_image_model_fn_trains_as_the_large_batch(
    tmp_path, iterations_per_loop, use_tpu):
  with training.logged('PortCheckHook') as warned:
    port = _image(str(tmp_path / 'port'), K, iterations_per_loop, use_tpu)
  assert not warned
  bare = _image(str(tmp_path / 'bare'), None, iterations_per_loop)
  assert any('ExponentialMovingAverage' in n for n in bare['variables'])
  assert any('RMSProp' in n for n in bare['variables'])
  _assert_same(port, bare)


@needs_estimator
def test_a_moving_average_left_after_the_train_op_is_named_by_the_port_check(
    tmp_path, use_tpu):
  with training.logged('PortCheckHook') as warned:
    _image(str(tmp_path / 'port'), K, 1, use_tpu, skip_once_per_update=True)
  assert len(warned) == 1, warned
  assert 'write on every micro-step' in warned[0]
  for name in ('dense/kernel/ExponentialMovingAverage',
               'dense/bias/ExponentialMovingAverage', 'once_per_update'):
    assert name in warned[0], warned


# ------------------------------------------------- TF-Slim Supervisor-style --

def _slim(directory, port, counts='updates'):
  """train_image_classifier's loop: Supervisor, number_of_steps, a decay
  derived from the batch-size setting (`LARGE`)."""
  recorder = _Recorder()
  with tf.Graph().as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x, y = tf.compat.v1.data.make_one_shot_iterator(
        _input_fn(MICRO if port else LARGE)()).get_next()
    loss = tf.reduce_mean(tf.square(_dense(x) - y))
    steps_per_epoch = len(_examples()[0]) // LARGE // 2
    learning_rate = tf.compat.v1.train.exponential_decay(
        0.05, global_step, steps_per_epoch, 0.5, staircase=True)
    tf.compat.v1.add_to_collection('learning_rate', learning_rate)
    optimizer = tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.9)
    if port:
      optimizer = deferred_grad.GradientAggregationOptimizer(
          optimizer, port, global_step_counts=counts)
    train_op = optimizer.minimize(loss, global_step)
    recorder.begin()
    port_check = deferred_grad.PortCheckHook()
    port_check.begin()  # no MonitoredSession: called as the hook would be
    supervisor = tf.compat.v1.train.Supervisor(
        logdir=directory, global_step=global_step, summary_op=None,
        save_model_secs=0, saver=tf.compat.v1.train.Saver(max_to_keep=2))
    with supervisor.managed_session() as session:
      while not supervisor.should_stop():
        session.run(train_op)
        recorder.values.append(session.run(learning_rate))
        if session.run(global_step) >= UPDATES:  # number_of_steps
          supervisor.request_stop()
      supervisor.saver.save(session, supervisor.save_path,
                            global_step=global_step)
      port_check.end(session)
  return _trained(directory, recorder, r'dense/.*(kernel|bias)(/Momentum)?$')


def test_a_slim_style_supervisor_loop_trains_as_the_large_batch(tmp_path):
  with training.logged('PortCheckHook') as warned:
    port = _slim(str(tmp_path / 'port'), K)
  assert not warned
  bare = _slim(str(tmp_path / 'bare'), None)
  assert any('Momentum' in n for n in bare['variables'])
  _assert_same(port, bare)


# ------------------------------------------- the option skipped, warned --

@pytest.mark.parametrize('script', [
    pytest.param('bert', marks=needs_estimator),
    pytest.param('image', marks=needs_estimator), 'slim'])
def test_each_script_ported_without_the_option_is_warned(tmp_path, script):
  """Without `global_step_counts='updates'`, each script's schedule reads a
  `global_step` that counts micro-steps (the wrapper names it: BERT's
  update is a group of assignments, searched too) and its step limit stops
  mid-cycle (the port check names it). Each message names the option."""
  directory = str(tmp_path / script)
  with training.logged('') as logged:
    if script == 'bert':
      _bert(directory, K, counts='micro_steps')
    elif script == 'image':
      _image(directory, K, 1, counts='micro_steps')
    else:
      _slim(directory, K, counts='micro_steps')
  warned = [m for m in logged if any(w in m for w in scripts.PORTING_WARNINGS)]
  assert all("global_step_counts='updates'" in m for m in warned), warned
  assert any('stopped mid-cycle' in m for m in warned), warned
  assert any('which counts micro-steps: a schedule on it' in m
             for m in warned), warned
