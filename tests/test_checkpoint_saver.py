"""Checkpoints without the wrapper's state, or written under other settings.

Without the state (written before accumulation was turned on),
`convert_checkpoint` (and `deferred_grad.Saver`, which runs it on restore)
keeps the model and starts the wrapper's state afresh. Under other
settings: a partial cycle's sums mean what the settings they were added
under say.
The contract (README, "Checkpoints"): a setting that the accumulated sums do
not depend on (`aggregation`, `use_tpu`'s counter, `sparse_as_dense`, a
policy's kind) may change at any step; one they depend on may change at a
cycle boundary, and a mid-cycle checkpoint restored under another one fails
the first micro-step with an error naming this train op's settings and the
saved ones (whichever saver restored it: the settings are a variable), or a
`NotFoundError` naming the missing counter (a plain Saver), never a wrong
update.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import training

K = 3
_OPTIMIZER = models.OPTIMIZERS['Momentum']


def _micro_batches(cycles=2, model='mlp'):
  """`cycles` cycles of K micro-batches: a list of input tuples."""
  return list(zip(*models.MODELS[model][0](cycles * K, models.MICRO_BATCH,
                                           seed=11)))


def _trainer(grad_steps=K, **kwargs):
  step_tensor = 'global_step' if not isinstance(grad_steps, int) else 'auto'
  return training.Trainer(_OPTIMIZER, grad_steps, step_tensor=step_tensor,
                          **kwargs)


def _save_after(trainer, micro_batches, path, saver_class):
  with trainer.session() as session:
    for batch in micro_batches:
      trainer.micro_step(session, *batch)
    with trainer.graph.as_default():
      return saver_class().save(session, path)


def _resume(trainer, path, micro_batches, saver_class):
  """Restores `path` into `trainer`, runs `micro_batches`; the weights."""
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    saver_class().restore(session, path)
    for batch in micro_batches:
      trainer.micro_step(session, *batch)
    return session.run(trainer.variables)


def _uninterrupted(trainer, micro_batches):
  with trainer.session() as session:
    for batch in micro_batches:
      trainer.micro_step(session, *batch)
    return session.run(trainer.variables)


def _large_batches(micro_batches, model='mlp'):
  """The bare optimizer on each cycle's K micro-batches as one batch."""
  bare = training.Trainer(_OPTIMIZER, model=model)
  with bare.session() as session:
    for start in range(0, len(micro_batches), K):
      cycle = micro_batches[start:start + K]
      bare.micro_step(session, *[np.concatenate(part) for part in
                                 zip(*cycle)])
    return session.run(bare.variables)


_PLAIN, _OURS = tf.compat.v1.train.Saver, deferred_grad.Saver


# A plain saver: the settings are a variable of the graph.
# (To sparse_as_dense=True from a table's list of rows: test_sparse.py.)
@pytest.mark.parametrize('written, restored', [
    (dict(aggregation='mean'), dict(aggregation='sum')),
    (dict(aggregation='sum'), dict(aggregation='mean')),
    (dict(use_tpu=True), dict(use_tpu=False)),
    (dict(nonfinite_policy='skip_cycle'),
     dict(nonfinite_policy='skip_micro_batch')),
    (dict(model='embedding', sparse_as_dense=True), dict(model='embedding')),
], ids=['mean_to_sum', 'sum_to_mean', 'tpu_to_gpu_path', 'policy_kind',
        'from_sparse_as_dense'])
def test_settings_the_sums_do_not_depend_on_may_change_mid_cycle(
    written, restored, tmp_path):
  """Resumed one micro-step into a cycle, training goes on as if the
  restoring settings had been used from the start."""
  model = restored.get('model', 'mlp')
  batches = _micro_batches(model=model)
  path = _save_after(_trainer(**written), batches[:1],
                     str(tmp_path / 'model'), _PLAIN)
  actual = _resume(_trainer(**restored), path, batches[1:], _PLAIN)
  expected = _uninterrupted(_trainer(**restored), batches)
  training.assert_same_training([actual], [expected])
  # And the large batch's (which a dense Momentum update of a table, the
  # original's sparse_as_dense, is not: it moves untouched rows too).
  if (restored.get('aggregation', 'mean') == 'mean' and
      not restored.get('sparse_as_dense')):
    training.assert_same_training([actual], [_large_batches(batches, model)])


# A constant weight: the weighted mean is the mean (the large batch's), and
# the setting is still recorded.
_WEIGHT = dict(weight_fn=lambda x, y: tf.constant(2.0))

# (written, restored, the keyword named): the partial cycle's sums depend on
# the setting.
_DEPENDENT = [
    (dict(grad_steps=K), dict(grad_steps=2), 'grad_steps'),
    (dict(grad_steps=K, use_tpu=True), dict(grad_steps=4, use_tpu=True),
     'grad_steps'),
    (dict(grad_steps=lambda updates: tf.constant(K, tf.int64)),
     dict(grad_steps=K), 'grad_steps'),
    (_WEIGHT, dict(), 'micro_batch_weight'),
    (dict(nonfinite_policy='skip_micro_batch'), dict(), 'nonfinite_policy'),
]
_DEPENDENT_IDS = ['3_to_2', '3_to_4_tpu_path', 'schedule_to_int',
                  'weights_removed', 'policy_removed']


def _refused(here):
  """What the first micro-step's error says: this train op's settings."""
  return pytest.raises(tf.errors.InvalidArgumentError,
                       match=r'does not continue in this train op \(%s' % here)


_HERE = {'grad_steps': 'grad_steps=%d', 'micro_batch_weight':
         'grad_steps=3, micro_batch_weight=None',
         'nonfinite_policy': "grad_steps=3, micro_batch_weight=None, "
                             "nonfinite_policy=None"}


@pytest.mark.parametrize('saver_class', [_PLAIN, _OURS])
@pytest.mark.parametrize('written, restored, keyword', _DEPENDENT,
                         ids=_DEPENDENT_IDS)
def test_a_partial_cycle_under_other_settings_fails_its_first_micro_step(
    written, restored, keyword, saver_class, tmp_path):
  batches = _micro_batches()
  path = _save_after(_trainer(**written), batches[:1],
                     str(tmp_path / 'model'), saver_class)
  here = _HERE[keyword]
  if keyword == 'grad_steps':
    here %= restored['grad_steps']
  trainer = _trainer(**restored)
  with _refused(here) as raised:
    _resume(trainer, path, batches[1:], saver_class)
  # The saved settings and place: grad_steps (0 a schedule), weighted,
  # policy, one micro-step done.
  saved = [0 if callable(written.get('grad_steps')) else
           written.get('grad_steps', K), int('weight_fn' in written),
           int('nonfinite_policy' in written), 1]
  assert '[%s]' % ' '.join(str(v) for v in saved) in raised.value.message
  # Nothing was written: the weights are the checkpoint's.
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    saver_class().restore(session, path)
    before = session.run(trainer.variables)
    with pytest.raises(tf.errors.InvalidArgumentError):
      trainer.micro_step(session, *batches[1])
    training.assert_same_training([session.run(trainer.variables)], [before],
                                  rtol=0, atol=0)


def test_a_monitored_session_restores_it_and_its_first_run_fails(tmp_path):
  """Restored by the session's own plain saver: the first run fails."""
  checkpoint_dir = str(tmp_path)
  _save_after(_trainer(), _micro_batches()[:1],
              os.path.join(checkpoint_dir, 'model.ckpt'), _PLAIN)
  trainer = _trainer(grad_steps=2)
  with trainer.graph.as_default():
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, save_checkpoint_secs=None,
        save_checkpoint_steps=None, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None) as session:
      with _refused('grad_steps=2'):
        trainer.micro_step(session, *_micro_batches()[1])


@pytest.mark.parametrize('written, restored', [
    case[:2] for case in _DEPENDENT
    if isinstance(case[0].get('grad_steps', K), int)], ids=[
        name for name in _DEPENDENT_IDS if name != 'schedule_to_int'])
def test_at_a_cycle_boundary_every_setting_may_change(written, restored,
                                                      tmp_path):
  """Saved after two cycles (global_step 6, a multiple of 2 and of 3), the
  restored graph goes on with its own settings: its cycles are the large
  batches of its micro-batches."""
  batches = _micro_batches(cycles=4)
  path = _save_after(_trainer(**written), batches[:2 * K],
                     str(tmp_path / 'model'), deferred_grad.Saver)
  actual = _resume(_trainer(**restored), path, batches[2 * K:],
                   deferred_grad.Saver)
  steps = restored.get('grad_steps', K)
  cycles = [batches[:K], batches[K:2 * K]] + [
      batches[start:start + steps]
      for start in range(2 * K, len(batches) - steps + 1, steps)]
  bare = training.Trainer(_OPTIMIZER)
  with bare.session() as session:
    for cycle in cycles:  # an unfinished last cycle applies nothing yet
      bare.micro_step(session, *[np.concatenate(part) for part in zip(*cycle)])
    expected = session.run(bare.variables)
  training.assert_same_training([actual], [expected])


@pytest.mark.parametrize('saved_by', ['the wrapper', 'the bare optimizer'])
def test_a_global_step_mid_way_into_a_new_cycle_is_refused(saved_by,
                                                           tmp_path):
  """Counted on global_step, a restored cycle with no partial sums (another
  grad_steps, or none at all) would apply fewer micro-batches than
  grad_steps: an error, which points to the schedule form, whose counters
  start afresh (and then train like the large batch)."""
  batches = _micro_batches(cycles=3)
  path = str(tmp_path / 'model')
  if saved_by == 'the wrapper':  # on its boundary: global_step 3
    _save_after(_trainer(), batches[:K], path, deferred_grad.Saver)
    restored = 2
  else:  # global_step 4: 4 % 3 == 1
    _save_after(training.Trainer(_OPTIMIZER), batches[:4], path,
                tf.compat.v1.train.Saver)
    restored = K
  with _refused('grad_steps=%d' % restored) as raised:
    _resume(_trainer(restored), path, batches[:1], deferred_grad.Saver)
  assert 'this run at micro-step] [1]' in raised.value.message
  trainer = _trainer(lambda updates: tf.constant(restored, tf.int64))
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    deferred_grad.Saver().restore(session, path)
    start = session.run(trainer.variables)
    for batch in batches[:restored]:
      trainer.micro_step(session, *batch)
    actual = session.run(trainer.variables)
  bare = training.Trainer(_OPTIMIZER)
  with bare.session() as session:
    if saved_by == 'the wrapper':  # the wrapped optimizer's slots go on
      tf.compat.v1.train.Saver().restore(session, path)
    else:
      for name, variable in bare.variables.items():
        variable.load(start[name], session)
      for slot in bare.optimizer.get_slot_names():
        for variable in bare.variables.values():
          v = bare.optimizer.get_slot(variable, slot)
          v.load(tf.train.load_variable(path, v.op.name), session)
    bare.micro_step(session, *[np.concatenate(part) for part in
                               zip(*batches[:restored])])
    expected = session.run(bare.variables)
  training.assert_same_training([actual], [expected])


@pytest.mark.parametrize('restored, missing', [
    (dict(use_tpu=True), 'update_count'),
    (_WEIGHT, 'micro_batch_weights'),
    (dict(nonfinite_policy='skip_cycle'), 'good_micro_batches'),
], ids=['to_tpu_path', 'weights_added', 'policy_added'])
def test_a_setting_that_adds_a_counter_needs_the_conversion(restored,
                                                           missing, tmp_path):
  """A plain Saver's NotFoundError names the counter (the step skipped);
  deferred_grad.Saver converts: the model restores, the wrapper's state
  starts afresh."""
  batches = _micro_batches()
  path = _save_after(_trainer(), batches[:K], str(tmp_path / 'model'),
                     tf.compat.v1.train.Saver)
  with pytest.raises(tf.errors.NotFoundError, match=missing):
    _resume(_trainer(**restored), path, [], tf.compat.v1.train.Saver)
  actual = _resume(_trainer(**restored), path, batches[K:],
                   deferred_grad.Saver)
  training.assert_same_training([actual], [_large_batches(batches)])


def test_a_wider_accumulator_dtype_is_refused_by_the_restore(tmp_path):
  """The accumulators' dtype is in the checkpoint: a restore with another
  fails (TensorFlow's dtype check)."""
  path = _save_after(_trainer(), _micro_batches()[:1],
                     str(tmp_path / 'model'), tf.compat.v1.train.Saver)
  with pytest.raises(tf.errors.InvalidArgumentError):
    _resume(_trainer(accumulator_dtype=tf.float64), path, [],
            tf.compat.v1.train.Saver)


def test_the_settings_are_a_variable_every_saver_saves(tmp_path):
  """One more int64 vector in the file, which graphs without the wrapper
  leave alone: grad_steps, weighted, policy, the micro-steps done."""
  batches = _micro_batches()
  path = _save_after(_trainer(), batches[:1], str(tmp_path / 'model'),
                     deferred_grad.Saver)
  key = 'GradientAggregationOptimizer/deferred_grad_settings'
  np.testing.assert_array_equal(tf.train.load_variable(path, key),
                                [K, 0, 0, 1])
  actual = _resume(_trainer(), path, batches[1:], tf.compat.v1.train.Saver)
  training.assert_same_training([actual], [_large_batches(batches)])


@pytest.mark.parametrize('grad_steps', [K, 2], ids=['same', 'other'])
def test_under_mirrored_strategy_a_restore_resumes_or_fails(grad_steps,
                                                            tmp_path):
  """The settings are read and checked beside per-replica accumulators:
  with the same grad_steps the cycle resumes like the uninterrupted run,
  with another the first micro-step fails."""
  x, y = models.make_data(2 * K, training.REPLICAS * models.MICRO_BATCH)
  uninterrupted = training.MirroredTrainer(_OPTIMIZER, K)
  with tf.compat.v1.Session(graph=uninterrupted.graph) as session:
    session.run(uninterrupted.init_op)
    for step in range(2 * K):
      uninterrupted.micro_step(session, x[step], y[step])
    expected = session.run(uninterrupted.variables)
  first = training.MirroredTrainer(_OPTIMIZER, K)
  with first.graph.as_default(), tf.compat.v1.Session() as session:
    session.run(first.init_op)
    first.micro_step(session, x[0], y[0])
    path = _PLAIN().save(session, str(tmp_path / 'model'))
  second = training.MirroredTrainer(_OPTIMIZER, grad_steps)
  with second.graph.as_default(), tf.compat.v1.Session() as session:
    _PLAIN().restore(session, path)
    if grad_steps != K:
      with _refused('grad_steps=2'):
        second.micro_step(session, x[1], y[1])
      return
    for step in range(1, 2 * K):
      second.micro_step(session, x[step], y[step])
    actual = session.run(second.variables)
  training.assert_same_training([actual], [expected])


def _two_train_ops(second_grad_steps):
  """Two wrappers on one variable: one counts global_step, one its own."""
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    v = tf.compat.v1.get_variable('v', initializer=[1.0, 2.0])
    ops = []
    for grad_steps, loss, step in [(K, tf.reduce_sum(v * v), global_step),
                                   (second_grad_steps, tf.reduce_sum(v),
                                    None)]:
      opt = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1), grad_steps)
      ops.append(opt.minimize(loss, global_step=step))
  return graph, ops


def test_each_train_op_of_a_graph_has_its_settings_checked(tmp_path):
  """Two wrappers' train ops, each one micro-step into its cycle: restored
  as written they resume; the second with another grad_steps fails."""
  graph, ops = _two_train_ops(2)
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(ops)
    path = _PLAIN().save(session, str(tmp_path / 'model'))
  keys = {name for name, _ in tf.train.list_variables(path)}
  assert {'GradientAggregationOptimizer/deferred_grad_settings',
          'GradientAggregationOptimizer_1/deferred_grad_settings'} <= keys
  graph, ops = _two_train_ops(2)
  with graph.as_default(), tf.compat.v1.Session() as session:
    _PLAIN().restore(session, path)
    session.run(ops)
  graph, ops = _two_train_ops(4)
  with graph.as_default(), tf.compat.v1.Session() as session:
    _PLAIN().restore(session, path)
    session.run(ops[0])  # grad_steps 3 as saved
    with _refused('grad_steps=4'):
      session.run(ops[1])


# ------------------------------------------ checkpoints without state --


def _checkpoint_without_wrapper(directory, optimizer='Adam', steps=3):
  """Trains the MLP with the bare optimizer; returns (path, weights).

  `steps` is a multiple of the grad_steps the tests turn on (3): on the GPU
  path the cycle is read from global_step, and a restored global_step that
  is not a multiple of grad_steps starts with a shorter cycle.
  """
  data = models.make_data(steps, models.MICRO_BATCH)
  trainer = training.Trainer(models.OPTIMIZERS[optimizer])
  with trainer.session() as session:
    trainer.run(session, data)
    path = tf.compat.v1.train.Saver().save(session,
                                           os.path.join(directory, 'model'))
    return path, session.run(trainer.variables)


def test_a_skipped_conversion_meets_a_not_found_error(tmp_path):
  """A plain Saver's NotFoundError names an accumulator: the README's sign
  that the checkpoint needs `convert_checkpoint`."""
  path, _ = _checkpoint_without_wrapper(str(tmp_path))
  trainer = training.Trainer(models.OPTIMIZERS['Adam'], 3)
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    with pytest.raises(tf.errors.NotFoundError,
                       match='GradientAccumulator|deferred_grad_settings'):
      tf.compat.v1.train.Saver().restore(session, path)


@pytest.mark.parametrize('optimizer', ['Adam', 'Momentum'])
def test_saver_turns_accumulation_on_for_an_old_checkpoint(optimizer, use_tpu,
                                                           tmp_path):
  """The model (and Adam's beta powers, named cond/ under v1) restore; the
  accumulators start at zero; training goes on like the large batch."""
  path, weights = _checkpoint_without_wrapper(str(tmp_path), optimizer)
  data = models.make_data(models.CYCLES, 3 * models.MICRO_BATCH, seed=5)
  large = training.Trainer(models.OPTIMIZERS[optimizer])
  with large.graph.as_default(), tf.compat.v1.Session() as session:
    tf.compat.v1.train.Saver().restore(session, path)
    expected = large.run(session, data)
  trainer = training.Trainer(models.OPTIMIZERS[optimizer], 3,
                             use_tpu=use_tpu)
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    deferred_grad.Saver().restore(session, path)
    restored = session.run(trainer.variables)
    for name in weights:
      np.testing.assert_array_equal(restored[name], weights[name])
    accumulator = trainer.optimizer.get_slot(trainer.variables['w1'],
                                             'grad_accum')
    assert not np.any(session.run(accumulator))
    actual = trainer.run(session, data)
  training.assert_same_training(actual, expected)


def test_saver_restores_its_own_checkpoints_mid_cycle(tmp_path):
  """With the state present it restores everything, as a plain Saver."""
  trainer = training.Trainer(models.OPTIMIZERS['Adam'], 3)
  x, y = models.make_data(1, models.MICRO_BATCH)
  with trainer.graph.as_default(), tf.compat.v1.Session() as session:
    session.run(trainer.init_op)
    trainer.micro_step(session, x[0], y[0])
    accumulator = trainer.optimizer.get_slot(trainer.variables['w1'],
                                             'grad_accum')
    saved = session.run(accumulator)
    path = deferred_grad.Saver().save(session, str(tmp_path / 'model'))
  second = training.Trainer(models.OPTIMIZERS['Adam'], 3)
  with second.graph.as_default(), tf.compat.v1.Session() as session:
    deferred_grad.Saver().restore(session, path)
    accumulator = second.optimizer.get_slot(second.variables['w1'],
                                            'grad_accum')
    np.testing.assert_array_equal(session.run(accumulator), saved)
    assert np.any(saved)


def test_saver_in_a_monitored_session_scaffold(use_tpu, tmp_path):
  """MonitoredTrainingSession on a checkpoint_dir written without it."""
  checkpoint_dir = str(tmp_path)
  _checkpoint_without_wrapper(checkpoint_dir)
  trainer = training.Trainer(models.OPTIMIZERS['Adam'], 3, use_tpu=use_tpu)
  x, y = models.make_data(6, models.MICRO_BATCH)
  with trainer.graph.as_default():
    scaffold = tf.compat.v1.train.Scaffold(saver=deferred_grad.Saver())
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, scaffold=scaffold,
        save_checkpoint_secs=None, save_checkpoint_steps=None,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=None) as session:
      start = session.run(trainer.global_step)
      for step in range(6):
        trainer.micro_step(session, x[step], y[step])
      assert session.run(trainer.global_step) == start + 6


@pytest.mark.parametrize('saver',
                         [tf.compat.v1.train.Saver, deferred_grad.Saver])
def test_a_path_that_is_no_checkpoint_is_a_value_error(saver, tmp_path):
  # Code that restores or else initializes catches the plain Saver's
  # ValueError; deferred_grad.Saver raised a NotFoundError.
  trainer = _trainer()
  with trainer.graph.as_default():
    made = saver()
    with tf.compat.v1.Session() as session:
      with pytest.raises(ValueError, match='not a valid checkpoint'):
        made.restore(session, str(tmp_path / 'model.ckpt-3'))
