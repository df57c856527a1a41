"""Once per update, as the large batch: moving averages and other ops.

What a model runs beside its train op once per batch (a moving average of
the weights, a weight projection, a counter of its own) runs once per
update with the wrapper: `opt.once_per_update(train_op, fn)`. The oracle is
the large batch: the bare optimizer on batches GRAD_STEPS times larger,
with the same ops after its train op, and numpy's moving average of the
weights it records after each update. The counters (`applied_updates()`,
`applies_update()`, `micro_step_in_cycle()`, `deferred_grad.applied_updates`
made after the train op) have one value in a run wherever they are read.
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import test_numerics
import test_schedules
import training

GRAD_STEPS = 3
CYCLES = 4
DECAY = 0.9  # its warm-up, min(DECAY, (1 + n) / (10 + n)), is short
VARIABLES = ['b1', 'b2', 'w1', 'w2']


def numpy_moving_average(initial, snapshots, decay=DECAY, warm_up=True,
                         updates=None):
  """`ExponentialMovingAverage` of the weights after each update, in numpy.

  Args:
    initial: {name: the weights before training} (the averages' start).
    snapshots: {name: weights} after each update, or None where a cycle
      applied no update (the average then takes no step).
    decay: the average's decay.
    warm_up: decay at update n is min(decay, (1 + n) / (10 + n)).
    updates: the n of each snapshot (default 1, 2, ...).

  Returns:
    {name: average} after each snapshot.
  """
  average = {name: np.asarray(value, np.float64)
             for name, value in initial.items()}
  result = []
  for index, snapshot in enumerate(snapshots):
    n = index + 1 if updates is None else updates[index]
    if snapshot is not None:
      step = min(decay, (1.0 + n) / (10.0 + n)) if warm_up else decay
      average = {name: value - (1 - step) * (value - snapshot[name])
                 for name, value in average.items()}
    result.append(dict(average))
  return result


def averaged(decay=DECAY, warm_up=True, made=None):
  """An `after_minimize` (see training.Trainer) adding a moving average.

  The bare optimizer's as models do it, after the train op with
  `num_updates=global_step`; the wrapper's once per update, with
  `num_updates=opt.applied_updates() + 1`.

  Args:
    decay, warm_up: the average's.
    made: None, or a list each average made is appended to.
  """
  def after_minimize(optimizer, train_op, variables):
    wrapped = isinstance(optimizer, deferred_grad.GradientAggregationOptimizer)
    num_updates = None
    if warm_up:
      num_updates = (optimizer.applied_updates() + 1 if wrapped else
                     tf.compat.v1.train.get_global_step())
    ema = tf.compat.v1.train.ExponentialMovingAverage(decay,
                                                      num_updates=num_updates)
    if made is not None:
      made.append(ema)
    var_list = [variables[name] for name in sorted(variables)]
    if wrapped:
      return optimizer.once_per_update(train_op, lambda: ema.apply(var_list))
    with tf.control_dependencies([train_op]):
      return ema.apply(var_list)
  return after_minimize


def _averages(trainer):
  """{name: the average of the trainer's variable `name`}."""
  with trainer.graph.as_default():
    found = {v.op.name: v for v in tf.compat.v1.global_variables()}
  return {name: found[name + '/ExponentialMovingAverage']
          for name in trainer.variables}


def _train(trainer, data):
  """(initial weights, [(weights, averages) after each micro-step])."""
  averages = _averages(trainer)
  steps = []
  with trainer.session() as session:
    initial = session.run(trainer.variables)
    for batch in zip(*data):
      micro_batch = len(batch[0]) // trainer.micro_steps
      for k in range(trainer.micro_steps):
        rows = slice(k * micro_batch, (k + 1) * micro_batch)
        trainer.micro_step(session, *[part[rows] for part in batch])
        steps.append(session.run((trainer.variables, averages)))
  return initial, steps


def _large_batch(make_optimizer, data, **kwargs):
  """The bare optimizer's weights after each update, and its averages."""
  initial, steps = _train(training.Trainer(
      make_optimizer, after_minimize=averaged(**kwargs)), data)
  return initial, [weights for weights, _ in steps], [a for _, a in steps]


def _assert_averages_step_only_on_updates(steps, grad_steps=GRAD_STEPS):
  previous = None
  for index, (_, averages) in enumerate(steps):
    if previous is not None and index % grad_steps != grad_steps - 1:
      training.assert_same_training([averages], [previous], rtol=0, atol=0)
    previous = averages


@pytest.mark.parametrize('optimizer', ['Momentum', 'Adam'])
@pytest.mark.parametrize('warm_up', [True, False], ids=['warm_up', 'decay'])
def test_moving_average_is_the_large_batch_s(optimizer, warm_up, use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = models.make_data(CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  initial, weights, bare_averages = _large_batch(make_optimizer, data,
                                                 warm_up=warm_up)
  expected = numpy_moving_average(initial, weights, warm_up=warm_up)
  # The reference is right: the bare optimizer's own average is numpy's.
  training.assert_same_training(bare_averages, expected)
  trainer = training.Trainer(make_optimizer, GRAD_STEPS, use_tpu=use_tpu,
                             after_minimize=averaged(warm_up=warm_up))
  _, steps = _train(trainer, data)
  cycle_ends = steps[GRAD_STEPS - 1::GRAD_STEPS]
  training.assert_same_training([w for w, _ in cycle_ends], weights)
  training.assert_same_training([a for _, a in cycle_ends], expected)
  _assert_averages_step_only_on_updates(steps)


def test_an_average_after_the_train_op_alone_steps_every_micro_step():
  """The guard: what models do without the wrapper is K steps per update
  (the comparison above can fail)."""
  data = models.make_data(CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  initial, weights, _ = _large_batch(models.sgd, data)
  expected = numpy_moving_average(initial, weights)

  def every_micro_step(optimizer, train_op, variables):
    ema = tf.compat.v1.train.ExponentialMovingAverage(
        DECAY, num_updates=tf.compat.v1.train.get_global_step())
    with tf.control_dependencies([train_op]):
      return ema.apply([variables[name] for name in sorted(variables)])

  _, steps = _train(training.Trainer(models.sgd, GRAD_STEPS,
                                     after_minimize=every_micro_step), data)
  got = steps[-1][1]
  assert max(np.max(np.abs(got[name] - expected[-1][name]))
             for name in got) > 1e-3


def test_ops_run_after_the_update_and_never_on_accumulate_only_steps(
    use_tpu):
  """A weight projection (a max-norm constraint) and a counter of the
  model's own, as the large batch runs them after each batch."""
  max_norm = 0.6

  def projected(optimizer, train_op, variables):
    with tf.compat.v1.variable_scope('own', use_resource=True):
      counter = tf.compat.v1.get_variable(
          'projections', initializer=tf.constant(0, tf.int64),
          trainable=False)
    var_list = [variables[name] for name in sorted(variables)]

    def project():
      # Reads the updated weights: ordered after the update.
      return [counter.assign_add(1)] + [
          tf.compat.v1.assign(v, tf.clip_by_norm(v, max_norm))
          for v in var_list]

    if isinstance(optimizer, deferred_grad.GradientAggregationOptimizer):
      return optimizer.once_per_update(train_op, project)
    with tf.control_dependencies([train_op]):
      return tf.group(*project())

  data = models.make_data(CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  bare = training.Trainer(models.OPTIMIZERS['Momentum'],
                          after_minimize=projected)
  with bare.session() as session:
    expected = bare.run(session, data)
  trainer = training.Trainer(models.OPTIMIZERS['Momentum'], GRAD_STEPS,
                             use_tpu=use_tpu, after_minimize=projected)
  with trainer.graph.as_default():
    counter, = [v for v in tf.compat.v1.global_variables()
                if v.op.name == 'own/projections']
  with trainer.session() as session:
    actual = []
    for cycle, batch in enumerate(zip(*data)):
      micro_batch = len(batch[0]) // GRAD_STEPS
      for k in range(GRAD_STEPS):
        rows = slice(k * micro_batch, (k + 1) * micro_batch)
        trainer.micro_step(session, *[part[rows] for part in batch])
        assert session.run(counter) == cycle + (k == GRAD_STEPS - 1)
      actual.append(session.run(trainer.variables))
  training.assert_same_training(actual, expected)
  # The projection bound the weights (else the test shows nothing).
  assert any(np.linalg.norm(expected[-1][name]) == pytest.approx(max_norm)
             for name in expected[-1])


def test_a_skipped_cycle_takes_no_average_step(use_tpu):
  """nonfinite_policy='skip_cycle': no update, no average step; the
  average's warm-up counts cycles, as the learning rate does."""
  data = test_numerics._poisoned_data()  # pylint: disable=protected-access
  expected_weights = test_numerics._by_hand(data, 'skip_cycle')  # pylint: disable=protected-access
  trainer = training.Trainer(
      test_numerics._sgd, test_numerics.GRAD_STEPS, model='linear',  # pylint: disable=protected-access
      use_tpu=use_tpu, nonfinite_policy='skip_cycle',
      after_minimize=averaged())
  initial, steps = _train(trainer, data)
  cycle_ends = steps[test_numerics.GRAD_STEPS - 1::test_numerics.GRAD_STEPS]
  training.assert_same_training([w for w, _ in cycle_ends], expected_weights)
  applied = [None if np.array_equal(a['w'], b['w']) else b for a, b in zip(
      [initial] + expected_weights[:-1], expected_weights)]
  assert applied.count(None) == 3  # cycles 0-2 are skipped, 3 applies
  training.assert_same_training(
      [a for _, a in cycle_ends], numpy_moving_average(initial, applied))
  # Nothing at all before the first applied cycle.
  for _, averages in steps[:-1]:
    np.testing.assert_array_equal(averages['w'], initial['w'])


def test_under_a_schedule_grad_steps():
  """Cycles of 2, 3 and 4 micro-steps: the large batches of those sizes."""
  lengths = [2, 3, 4, 4]
  data = test_schedules._data('mlp', lengths)  # pylint: disable=protected-access
  cycles = test_schedules._cycles(data, lengths)  # pylint: disable=protected-access
  bare = training.Trainer(models.OPTIMIZERS['Momentum'],
                          after_minimize=averaged())
  trainer = training.Trainer(
      models.OPTIMIZERS['Momentum'],
      test_schedules.lengths_of_updates(lengths), step_tensor=None,
      after_minimize=averaged())
  averages = _averages(trainer)
  weights, got = [], []
  with bare.session() as session:
    initial = session.run(bare.variables)
    for cycle in cycles:
      bare.micro_step(session, *[np.concatenate(p) for p in zip(*cycle)])
      weights.append(session.run(bare.variables))
  with trainer.session() as session:
    for cycle in cycles:
      before = session.run(averages)
      for k, micro_batch in enumerate(cycle):
        trainer.micro_step(session, *micro_batch)
        if k < len(cycle) - 1:
          training.assert_same_training([session.run(averages)], [before],
                                        rtol=0, atol=0)
      got.append(session.run(averages))
  training.assert_same_training(got, numpy_moving_average(initial, weights))


@pytest.mark.parametrize('per_replica', [False, True],
                         ids=['one_wrapper', 'wrapper_per_replica'])
def test_under_mirrored_strategy(per_replica):
  """The average made in the replica function (an Estimator model_fn under
  train_distribute makes one per replica): each replica's micro-batch half
  of the large batch's."""
  made = []
  data = models.make_data(CYCLES, training.REPLICAS * GRAD_STEPS *
                          models.MICRO_BATCH)
  initial, weights, _ = _large_batch(models.OPTIMIZERS['Momentum'], data)
  expected = numpy_moving_average(initial, weights)
  trainer = training.MirroredTrainer(
      models.OPTIMIZERS['Momentum'], GRAD_STEPS,
      wrapper_per_replica=per_replica, after_minimize=averaged(made=made))
  with trainer.graph.as_default():
    averages = {name: made[0].average(v)
                for name, v in trainer.variables.items()}
  got = []
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    for batch in zip(*data):
      before = session.run(averages)
      trainer.run_cycle(session, *batch)
      got.append(session.run(averages))
      assert any(not np.array_equal(got[-1][n], before[n]) for n in before)
  training.assert_same_training(got, expected)


def _checkpointed(checkpoint_dir, use_tpu, micro_batches, last_step):
  """MonitoredTrainingSession with the wrapper and a moving average, run up
  to `last_step`; checkpoints every 2 micro-steps (mid-cycle too)."""
  made = []
  trainer = training.Trainer(models.OPTIMIZERS['Adam'], GRAD_STEPS,
                             use_tpu=use_tpu,
                             after_minimize=averaged(made=made))
  with trainer.graph.as_default():
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, save_checkpoint_steps=2,
        save_summaries_steps=None, log_step_count_steps=None,
        hooks=[tf.compat.v1.train.StopAtStepHook(last_step=last_step)]) as mts:
      while not mts.should_stop():
        step = mts.run_step_fn(
            lambda step_context: step_context.session.run(
                trainer.global_step))
        mts.run(trainer.train_op, dict(zip(trainer.inputs,
                                           micro_batches[step])))
  return made[0], trainer


def test_resumes_mid_cycle_with_the_average_exact_and_eval_reads_it(
    use_tpu, tmp_path):
  data = models.make_data(CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  micro_batches = [[part[cycle][k * models.MICRO_BATCH:
                                (k + 1) * models.MICRO_BATCH]
                    for part in data]
                   for cycle in range(CYCLES) for k in range(GRAD_STEPS)]
  initial, weights, _ = _large_batch(models.OPTIMIZERS['Adam'], data)
  expected = numpy_moving_average(initial, weights)[-1]
  last_step = CYCLES * GRAD_STEPS
  directory = str(tmp_path / 'resumed')
  stop = GRAD_STEPS + 2  # mid-cycle, after a checkpoint (every 2 steps)
  _checkpointed(directory, use_tpu, micro_batches, stop)
  assert tf.train.load_variable(directory, 'global_step') == stop
  _checkpointed(directory, use_tpu, micro_batches, last_step)
  reader = tf.train.load_checkpoint(directory)
  assert reader.get_tensor('global_step') == last_step
  for name in VARIABLES:
    np.testing.assert_allclose(
        reader.get_tensor(name + '/ExponentialMovingAverage'),
        expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
  # Evaluation as upstream does it: a graph without the wrapper restores
  # the averages into the model's variables by TensorFlow's names.
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
    _, variables = models.model_loss(x, y)
    ema = tf.compat.v1.train.ExponentialMovingAverage(DECAY)
    saver = tf.compat.v1.train.Saver(ema.variables_to_restore())
    with tf.compat.v1.Session() as session:
      saver.restore(session, tf.train.latest_checkpoint(directory))
      training.assert_same_training([session.run(variables)], [expected])


def test_the_averages_names_are_tensorflow_s():
  made = []
  bare = training.Trainer(models.sgd, after_minimize=averaged(made=made))
  wrapped = training.Trainer(models.sgd, GRAD_STEPS,
                             after_minimize=averaged(made=made))
  restored = []
  for trainer, ema in zip((bare, wrapped), made):
    with trainer.graph.as_default():
      assert sorted(v.op.name for v in tf.compat.v1.moving_average_variables(
      )) == VARIABLES
      # Evaluation restores each average into its variable.
      restored.append({key: v.op.name for key, v in
                       ema.variables_to_restore().items()
                       if v.op.name in VARIABLES})
  assert restored[0] == restored[1] == {
      name + '/ExponentialMovingAverage': name for name in VARIABLES}


# ---------------------------------------------------------------- counters --

def _counters_everywhere(trainer):
  """Every way to read the counters in a run, by where they are read."""
  optimizer, train_op = trainer.optimizer, trainer.train_op
  with trainer.graph.as_default():
    counters = (optimizer.applied_updates(), optimizer.applies_update(),
                optimizer.micro_step_in_cycle())
    helper = deferred_grad.applied_updates(trainer.global_step, GRAD_STEPS)
    with tf.control_dependencies([train_op]):  # after the run's update
      in_cond = tf.cond(
          counters[1], lambda: tf.stack([counters[0], counters[2], helper]),
          lambda: tf.stack([counters[0], counters[2], helper]) + 100)
    record = tf.compat.v1.get_variable(
        'record', initializer=tf.constant([-1, -1, -1], tf.int64),
        trainable=False, use_resource=True)
    inside = optimizer.once_per_update(train_op, lambda: record.assign(
        tf.stack([counters[0], counters[2], helper])))
    init = tf.compat.v1.variables_initializer([record])
  return counters, helper, in_cond, record, inside, init


def test_counters_have_one_value_wherever_read_in_a_run(use_tpu):
  """Fetched beside the train op, in a cond after it, in ops run once per
  update, and deferred_grad.applied_updates made after the train op: the
  values before the run, in every one of many runs."""
  trainer = training.Trainer(models.sgd, GRAD_STEPS, use_tpu=use_tpu)
  counters, helper, in_cond, record, inside, init = _counters_everywhere(
      trainer)
  x, y = models.make_data(1, models.MICRO_BATCH)
  feed = dict(zip(trainer.inputs, (x[0], y[0])))
  with trainer.session() as session:
    session.run(init)
    for step in range(60 * GRAD_STEPS):
      updates, applies, place = step // GRAD_STEPS, (
          step % GRAD_STEPS == GRAD_STEPS - 1), step % GRAD_STEPS
      got = session.run([inside, counters, helper, in_cond], feed)[1:]
      assert got[0] == (updates, applies, place), step
      assert got[1] == updates, step
      np.testing.assert_array_equal(
          got[2], [updates, place, updates] if applies else
          [updates + 100, place + 100, updates + 100], err_msg=str(step))
      if applies:  # run inside the update: the values before the run
        np.testing.assert_array_equal(session.run(record),
                                      [updates, place, updates])


def test_counters_in_a_hook_s_fetch(tmp_path):
  """A hook fetching the counters with the train op sees the values before
  the run, as the train op's own apply step does."""
  trainer = training.Trainer(models.sgd, GRAD_STEPS)
  seen = []

  class Counters(tf.compat.v1.train.SessionRunHook):

    def before_run(self, run_context):
      return tf.compat.v1.train.SessionRunArgs([
          trainer.optimizer.applied_updates(),
          trainer.optimizer.applies_update(),
          deferred_grad.applied_updates(trainer.global_step, GRAD_STEPS)])

    def after_run(self, run_context, run_values):
      seen.append(run_values.results)

  x, y = models.make_data(1, models.MICRO_BATCH)
  with trainer.graph.as_default():
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), save_checkpoint_steps=None,
        save_checkpoint_secs=None, save_summaries_steps=None,
        log_step_count_steps=None, hooks=[Counters()]) as session:
      for _ in range(30 * GRAD_STEPS):
        session.run(trainer.train_op, dict(zip(trainer.inputs, (x[0], y[0]))))
  assert seen == [[step // GRAD_STEPS, step % GRAD_STEPS == GRAD_STEPS - 1,
                   step // GRAD_STEPS] for step in range(30 * GRAD_STEPS)]


# ------------------------------------------------------------------ errors --

def test_once_per_update_refuses_what_would_not_run():
  trainer = training.Trainer(models.sgd, GRAD_STEPS)
  optimizer = trainer.optimizer
  with trainer.graph.as_default():
    with pytest.raises(TypeError, match='fn must be a callable'):
      optimizer.once_per_update(trainer.train_op, 'ema')
    with pytest.raises(TypeError, match='fn returned None'):
      optimizer.once_per_update(trainer.train_op, lambda: None)
    with pytest.raises(ValueError, match="once_per_update's fn made the "
                       'summaries'):
      optimizer.once_per_update(trainer.train_op, lambda: tf.compat.v1.summary
                                .scalar('w', tf.reduce_sum(
                                    trainer.variables['w1'])))
    with pytest.raises(ValueError, match='train_op='):
      optimizer.once_per_update(tf.no_op(), tf.no_op)


# -------------------------------------------------------------- batch norm --

BATCH_NORM_MOMENTUM = 0.9


def _batch_norm_means(micro_batches, momentum):
  """The moving mean of a batch norm layer after each cycle of micro-batches
  (each run one micro-batch, in training mode)."""
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2])
    layer = models.keras2().layers.BatchNormalization(momentum=momentum)
    output = layer(x, training=True)
    updates = layer.updates
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      means = []
      for cycle in micro_batches:
        for micro_batch in cycle:
          session.run([output] + updates, {x: micro_batch})
        means.append(session.run(layer.moving_mean))
  return means


def test_batch_norm_momentum_to_the_power_one_over_k_keeps_the_horizon():
  """README's recipe: micro-batches update the moving statistics K times an
  update; momentum ** (1 / K) forgets as fast, in examples, as the large
  batch's momentum does. Each cycle's micro-batches share its mean here,
  so the recipe matches the large batch exactly, and the plain momentum
  forgets K times faster."""
  rng = np.random.RandomState(0)
  cycle_means = rng.uniform(-3, 3, size=(CYCLES, 1, 2))
  cycles = []
  for mean in cycle_means:
    centred = rng.randn(GRAD_STEPS, models.MICRO_BATCH, 2)
    centred -= centred.mean(axis=1, keepdims=True)
    cycles.append(list((centred + mean).astype(np.float32)))
  large = _batch_norm_means([[np.concatenate(c)] for c in cycles],
                            BATCH_NORM_MOMENTUM)
  recipe = _batch_norm_means(cycles, BATCH_NORM_MOMENTUM**(1.0 / GRAD_STEPS))
  plain = _batch_norm_means(cycles, BATCH_NORM_MOMENTUM)
  expected, mean = [], np.zeros(2)
  for cycle_mean in cycle_means[:, 0]:  # numpy: one step per large batch
    mean = BATCH_NORM_MOMENTUM * mean + (1 - BATCH_NORM_MOMENTUM) * cycle_mean
    expected.append(mean)
  np.testing.assert_allclose(large, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(recipe, expected, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(np.array(plain) - expected)) > 0.1

