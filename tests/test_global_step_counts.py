"""`global_step_counts='updates'`: global_step counted as the large batch counts it.

A model ported with the option and nothing else (no `applied_updates`, no
step limit multiplied by K) trains as the bare optimizer does on batches K
times larger: a learning rate decayed on the raw `global_step`, a moving
average with `num_updates=global_step`, `StopAtStepHook`, `max_steps` and
`save_checkpoints_steps` all read the updates. Every reference here is that
bare job, run on the same examples.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import scripts
import training

K, MICRO, UPDATES = 4, 8, 6
RTOL, ATOL = 1e-5, 1e-6

needs_estimator = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')


def _data(updates=UPDATES, poison=None):
  rng = np.random.RandomState(0)
  x = rng.randn(updates * K * MICRO, 3).astype(np.float32)
  y = x.dot(np.array([[1.0], [-2.0], [0.5]], np.float32))
  if poison is not None:  # one micro-batch's labels NaN
    y[poison * MICRO:(poison + 1) * MICRO] = np.nan
  return x, y


def _model(x, y, wrapped, **kwargs):
  """A linear model, its learning rate decayed on the raw global_step."""
  w = tf.compat.v1.get_variable('w', [3, 1],
                                initializer=tf.zeros_initializer())
  loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
  global_step = tf.compat.v1.train.get_or_create_global_step()
  learning_rate = tf.compat.v1.train.exponential_decay(
      0.1, global_step, 2, 0.5, staircase=True)
  opt = tf.compat.v1.train.MomentumOptimizer(learning_rate, 0.9)
  if wrapped:
    opt = deferred_grad.GradientAggregationOptimizer(
        opt, kwargs.pop('grad_steps', K), global_step_counts='updates',
        **kwargs)
  return w, global_step, opt, opt.minimize(loss, global_step=global_step)


def _session_run(wrapped, data, steps, use_tpu=False, **kwargs):
  """Trains `steps` runs on consecutive batches (micro-batches wrapped);
  (w, global_step, what each run fetched of `learning_rate`)."""
  x_all, y_all = data
  batch = MICRO if wrapped else K * MICRO
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    if wrapped:
      kwargs['use_tpu'] = use_tpu
    w, global_step, _, train_op = _model(x, y, wrapped, **kwargs)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for i in range(steps):
        rows = slice(i * batch, (i + 1) * batch)
        session.run(train_op, {x: x_all[rows], y: y_all[rows]})
      return session.run([w, global_step])


@pytest.mark.parametrize('grad_steps', ['int', 'schedule'])
def test_a_schedule_on_the_raw_global_step_trains_as_the_large_batch(
    use_tpu, grad_steps):
  data = _data()
  expected, bare_step = _session_run(False, data, UPDATES)
  kwargs = {} if grad_steps == 'int' else dict(
      grad_steps=lambda updates: tf.constant(K, tf.int64))
  actual, step = _session_run(True, data, UPDATES * K, use_tpu, **kwargs)
  assert step == bare_step == UPDATES
  np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def test_mid_cycle_global_step_counts_the_updates_done(use_tpu):
  _, step = _session_run(True, _data(), 2 * K + 3, use_tpu)
  assert step == 2


def test_a_skipped_cycle_counts_as_a_step():
  """A cycle that `nonfinite_policy='skip_cycle'` applies nothing in still
  ends: one step, as the large batch's NaN batch is one step."""
  data = _data(poison=1)  # in the first cycle
  _, step = _session_run(True, data, UPDATES * K,
                         nonfinite_policy='skip_cycle')
  assert step == UPDATES


def test_the_choice_is_checked():
  with pytest.raises(ValueError, match='global_step_counts'):
    deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), K,
        global_step_counts='epochs')


def test_applied_updates_is_global_step(use_tpu):
  x_all, y_all = _data()
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    _, global_step, opt, train_op = _model(x, y, True, use_tpu=use_tpu)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for i in range(2 * K + 1):
        rows = slice(i * MICRO, (i + 1) * MICRO)
        updates, step, _ = session.run(
            [opt.applied_updates(), global_step, train_op],
            {x: x_all[rows], y: y_all[rows]})
        assert updates == i // K
      assert session.run(global_step) == 2


def test_a_moving_average_on_global_step_through_once_per_update():
  """`num_updates=global_step`, as the large batch's script has it."""
  x_all, y_all = _data()
  averages = {}
  for wrapped in (False, True):
    batch = MICRO if wrapped else K * MICRO
    with tf.Graph().as_default():
      x = tf.compat.v1.placeholder(tf.float32, [None, 3])
      y = tf.compat.v1.placeholder(tf.float32, [None, 1])
      w, global_step, opt, train_op = _model(x, y, wrapped)
      ema = tf.compat.v1.train.ExponentialMovingAverage(
          0.9, num_updates=global_step)
      if wrapped:
        train_op = opt.once_per_update(train_op, lambda: ema.apply([w]))
      else:
        with tf.control_dependencies([train_op]):
          train_op = ema.apply([w])
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for i in range(UPDATES * K // (1 if wrapped else K)):
          rows = slice(i * batch, (i + 1) * batch)
          session.run(train_op, {x: x_all[rows], y: y_all[rows]})
        averages[wrapped] = session.run(ema.average(w))
  np.testing.assert_allclose(averages[True], averages[False], rtol=RTOL,
                             atol=ATOL)


# ------------------------------------------------------ front ends --------

def _graph_on_data(wrapped, data):
  """The model fed from `data` by the step: as a MonitoredTrainingSession
  script feeds it (the wrapper: by its micro-step count)."""
  x_all, y_all = data
  batch = MICRO if wrapped else K * MICRO
  x = tf.constant(x_all.reshape(-1, batch, 3))
  y = tf.constant(y_all.reshape(-1, batch, 1))
  runs = tf.compat.v1.get_variable('runs', [], tf.int32,
                                   initializer=tf.zeros_initializer(),
                                   trainable=False)
  with tf.control_dependencies([runs.read_value()]):
    at = tf.identity(runs.read_value())
  w, global_step, _, train_op = _model(x[at], y[at], wrapped)
  with tf.control_dependencies([train_op]):
    train_op = runs.assign_add(1)
  return w, global_step, train_op


def _files(directory):
  return sorted(n for n in os.listdir(directory)
                if n.startswith('model.ckpt') or n == 'checkpoint')


def test_monitored_training_session_stops_and_saves_on_updates(tmp_path):
  """StopAtStepHook(last_step=UPDATES) and save_checkpoint_steps=2 read the
  updates; a job stopped mid-cycle (a StopAtStepHook of a micro-step count
  is not one now: it stops after an update) resumes as the large batch."""
  data = _data()
  results = {}
  for wrapped in (False, True):
    directory = str(tmp_path / str(wrapped))
    for last_step in (UPDATES // 2, UPDATES):
      with tf.Graph().as_default():
        w, global_step, train_op = _graph_on_data(wrapped, data)
        with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=directory, save_checkpoint_steps=2,
            save_checkpoint_secs=None, save_summaries_steps=None,
            save_summaries_secs=None, log_step_count_steps=None,
            hooks=[tf.compat.v1.train.StopAtStepHook(
                last_step=last_step)]) as session:
          while not session.should_stop():
            session.run(train_op)
    results[wrapped] = (_files(directory),
                        tf.train.load_variable(directory, 'w'),
                        tf.train.load_variable(directory, 'global_step'))
  assert results[True][0] == results[False][0]
  assert results[True][2] == results[False][2] == UPDATES
  np.testing.assert_allclose(results[True][1], results[False][1], rtol=RTOL,
                             atol=ATOL)


def _input_fn(wrapped):
  def input_fn():
    x, y = _data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        MICRO if wrapped else K * MICRO)
  return input_fn


def _model_fn(features, labels, mode, params):
  del params
  _, _, _, train_op = _model(features, labels, True)
  loss = tf.constant(0.0)
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                              train_op=train_op)


def _bare_model_fn(features, labels, mode, params):
  del params
  _, _, _, train_op = _model(features, labels, False)
  return tf.compat.v1.estimator.EstimatorSpec(mode, loss=tf.constant(0.0),
                                              train_op=train_op)


@needs_estimator
def test_an_estimator_s_max_steps_and_checkpoints_count_updates(tmp_path):
  results = {}
  for wrapped, model_fn in ((False, _bare_model_fn), (True, _model_fn)):
    directory = str(tmp_path / str(wrapped))
    for max_steps in (UPDATES // 2, UPDATES):
      estimator = tf.compat.v1.estimator.Estimator(
          model_fn, directory, config=tf.compat.v1.estimator.RunConfig(
              save_checkpoints_steps=1, keep_checkpoint_max=None,
              save_summary_steps=None, log_step_count_steps=None))
      estimator.train(_input_fn(wrapped), max_steps=max_steps)
    results[wrapped] = (_files(directory), estimator.get_variable_value('w'),
                        estimator.get_variable_value('global_step'))
  assert results[True][0] == results[False][0]
  assert results[True][2] == results[False][2] == UPDATES
  np.testing.assert_allclose(results[True][1], results[False][1], rtol=RTOL,
                             atol=ATOL)


def test_keras_iterations_count_updates():
  """Keras 2 passes `optimizer.iterations` as the global step."""
  if tf.__version__.startswith('2.15.'):
    keras = tf.keras
  else:
    keras = pytest.importorskip('tf_keras')
  tf.compat.v1.reset_default_graph()
  keras.backend.clear_session()
  model = keras.Sequential([keras.layers.Dense(1, input_shape=(3,))])
  model.compile(optimizer=deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.01), K,
      global_step_counts='updates'), loss='mse')
  x, y = _data()
  model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
  assert keras.backend.get_value(model.optimizer.iterations) == UPDATES


# ----------------------------------------------- switching the counting --

def _save_micro_steps(path, runs):
  """Trains `runs` micro-steps counting micro-steps; saves."""
  x_all, y_all = _data()
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    w = tf.compat.v1.get_variable('w', [3, 1],
                                  initializer=tf.zeros_initializer())
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), K)
    train_op = opt.minimize(
        tf.reduce_mean(tf.square(tf.matmul(x, w) - y)),
        global_step=global_step)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for i in range(runs):
        rows = slice(i * MICRO, (i + 1) * MICRO)
        session.run(train_op, {x: x_all[rows], y: y_all[rows]})
      return tf.compat.v1.train.Saver().save(session, path)


def _restore_updates(path, convert):
  x_all, _ = _data()
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    _, global_step, _, train_op = _model(x, tf.zeros([MICRO, 1]), True)
    with tf.compat.v1.Session() as session:
      if convert:
        path = deferred_grad.convert_checkpoint(path)
      tf.compat.v1.train.Saver().restore(session, path)
      step = session.run(global_step)
      session.run(train_op, {x: x_all[:MICRO]})
      return step


def test_switching_to_updates_converts_global_step(tmp_path):
  path = _save_micro_steps(str(tmp_path / 'model'), 2 * K)
  assert tf.train.load_variable(path, 'global_step') == 2 * K
  assert _restore_updates(path, convert=True) == 2


def test_switching_the_counting_without_the_step_fails_naming_it(tmp_path):
  path = _save_micro_steps(str(tmp_path / 'model'), 2 * K)
  with pytest.raises(tf.errors.NotFoundError,
                     match='update_count|deferred_grad_global_step'):
    _restore_updates(path, convert=False)


def test_switching_the_counting_mid_cycle_is_refused(tmp_path):
  path = _save_micro_steps(str(tmp_path / 'model'), 2 * K + 1)
  with pytest.raises(ValueError, match="global_step_counts='micro_steps' at "
                     'micro-step 1'):
    _restore_updates(path, convert=True)


# ------------------------------------------------ a missed edit, warned --

def _warnings(build):
  """The porting warnings logged while `build()` makes a graph."""
  with training.logged('') as logged, tf.Graph().as_default():
    build()
  return [m for m in logged if any(w in m for w in scripts.PORTING_WARNINGS)]


def _schedule_on(kind, use_tpu, global_step_counts='micro_steps',
                 optimizer=tf.compat.v1.train.AdamOptimizer, grad_steps=K):
  def build():
    w = tf.compat.v1.get_variable('w', [2])
    global_step = tf.compat.v1.train.get_or_create_global_step()
    wrapper = []
    steps = {
        'raw': lambda: global_step,
        'applied_updates': lambda: deferred_grad.applied_updates(
            global_step, K),
        'method': lambda: wrapper[0].applied_updates(),
    }[kind]
    learning_rate = lambda: tf.compat.v1.train.exponential_decay(
        0.1, steps(), 10, 0.5)
    if kind != 'method':
      learning_rate = learning_rate()
    wrapper.append(deferred_grad.GradientAggregationOptimizer(
        optimizer(learning_rate), grad_steps, use_tpu=use_tpu,
        global_step_counts=global_step_counts))
    wrapper[0].minimize(tf.reduce_sum(w * w), global_step=global_step)
  return build


def test_a_schedule_on_the_raw_micro_step_global_step_is_warned(use_tpu):
  warned = _warnings(_schedule_on('raw', use_tpu))
  assert len(warned) == 1, warned
  assert "global_step_counts='updates'" in warned[0]
  assert 'grad_steps=%d times too fast' % K in warned[0]


@pytest.mark.parametrize('kind', ['applied_updates', 'method'])
def test_a_schedule_on_the_updates_is_not_warned(use_tpu, kind):
  assert not _warnings(_schedule_on(kind, use_tpu))


@pytest.mark.parametrize('kind', ['raw', 'applied_updates'])  # no callable
def test_an_update_grouping_its_assignments_is_searched(use_tpu, kind):
  """BERT's optimizer returns tf.group(*assignments), named outside its
  scope: its schedule is found through the group."""
  sys.path.insert(0, os.path.join(scripts.TOOLS, 'examples'))
  from bert_optimization import AdamWeightDecayOptimizer  # pylint: disable=g-import-not-at-top
  warned = _warnings(_schedule_on(kind, use_tpu,
                                  optimizer=AdamWeightDecayOptimizer))
  assert len(warned) == (kind == 'raw'), warned


def test_a_raw_schedule_counting_updates_is_not_warned(use_tpu):
  assert not _warnings(_schedule_on('raw', use_tpu, 'updates'))


def test_a_raw_schedule_with_grad_steps_1_is_not_warned(use_tpu):
  """Each micro-step is an update: the raw global_step counts updates (the
  README's large batch, `build(K * MICRO_BATCH, 1)`, was warned)."""
  assert not _warnings(_schedule_on('raw', use_tpu, grad_steps=1))
  assert _warnings(_schedule_on('raw', use_tpu, grad_steps=2))


def test_applied_updates_counting_updates_is_refused_naming_it(use_tpu):
  """`deferred_grad.applied_updates(global_step, K)`, the micro-step
  counting's fix, left in a port to 'updates': it would divide the updates
  by K again."""
  with pytest.raises(ValueError, match=r'applied_updates\(global_step, '
                     r'grad_steps\).*global_step itself'), \
      tf.Graph().as_default():
    _schedule_on('applied_updates', use_tpu, 'updates')()


def test_the_method_counting_updates_is_not_refused(use_tpu):
  assert not _warnings(_schedule_on('method', use_tpu, 'updates'))


def _momentum_on_global_step(unused_step):
  """Momentum whose learning rate decays on the raw global_step (read where
  the optimizer applies)."""
  return tf.compat.v1.train.MomentumOptimizer(
      lambda: tf.compat.v1.train.exponential_decay(
          0.1, tf.compat.v1.train.get_global_step(), 2, 0.5, staircase=True),
      0.9)


@pytest.mark.parametrize('wrapper_per_replica', [False, True])
def test_under_mirrored_strategy(wrapper_per_replica):
  """Two replicas, each half of a micro-batch: global_step counts updates
  once, not once per replica."""
  x, y = models.make_data(UPDATES * K, training.REPLICAS * MICRO)
  mirrored = training.MirroredTrainer(
      _momentum_on_global_step, K, wrapper_per_replica=wrapper_per_replica,
      global_step_counts='updates')
  with mirrored.graph.as_default(), tf.compat.v1.Session() as session:
    session.run(mirrored.init_op)
    for step in range(UPDATES * K):
      mirrored.micro_step(session, x[step], y[step])
    actual = session.run(mirrored.variables)
    assert session.run(mirrored.global_step) == UPDATES
  bare = training.Trainer(_momentum_on_global_step)
  with bare.session() as session:
    for update in range(UPDATES):
      cycle = slice(update * K, (update + 1) * K)
      bare.micro_step(session, np.concatenate(x[cycle]),
                      np.concatenate(y[cycle]))
    expected = session.run(bare.variables)
  training.assert_same_training([actual], [expected])


@pytest.mark.parametrize('counts, use_tpu, grad_steps', [
    ('micro_steps', False, 'int'), ('updates', False, 'int'),
    ('updates', True, 'int'), ('updates', False, 'schedule'),
    ('updates', True, 'schedule')])
@pytest.mark.parametrize('ordered', [True, False])
def test_a_script_s_own_increment_beside_the_wrapper_s_fails_naming_it(
    counts, use_tpu, grad_steps, ordered):
  """BERT's shape: the script adds 1 to global_step beside a train op that
  counts it already (ordered after it, or grouped unordered as BERT does).
  The next micro-step finds it moved: an error naming the script's
  increment, not a global_step that counts twice or cycles that apply at
  the wrong micro-steps. (Counting micro-steps, only where the cycle is
  decided on global_step: elsewhere the state to see it is not in the
  original's checkpoints; README "What changes in your script".)"""
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', [2])
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        K if grad_steps == 'int' else tf.constant(K), use_tpu=use_tpu,
        global_step_counts=counts).minimize(
            tf.reduce_sum(w * w), global_step=global_step)
    if ordered:
      with tf.control_dependencies([train_op]):
        train_op = tf.group(train_op, global_step.assign_add(1))
    else:
      train_op = tf.group(train_op, global_step.assign(global_step + 1))
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match='the script increments it beside the wrapper'):
        for _ in range(K):
          session.run(train_op)
