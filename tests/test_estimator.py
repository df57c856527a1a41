"""Drop-in for Estimator and TPUEstimator (TensorFlow 2.15, the last with them).

Each test trains the same Estimator twice on the same examples in the same
order: with the wrapper on micro-batches of MICRO_BATCH, and with the bare
optimizer on batches GRAD_STEPS (times replicas) larger.
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
from models import make_data

pytestmark = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')

GRAD_STEPS = 3
CYCLES = 3
VARIABLES = ['b1', 'b2', 'w1', 'w2']


def _examples(batches, batch_size):
  x, y = make_data(1, batches * batch_size)
  return x[0], y[0]


def _input_fn(examples, batch_size, skip_batches=0):
  def input_fn(params=None):
    del params
    return tf.data.Dataset.from_tensor_slices(examples).batch(batch_size).skip(
        skip_batches)
  return input_fn


SCHEDULE = (2, 3, 4)  # cycle lengths of the 'schedule' grad_steps


def _schedule(updates):
  return tf.gather(tf.constant(SCHEDULE, tf.int64),
                   tf.minimum(updates, len(SCHEDULE) - 1))


def _train_op(loss, params):
  """The wrapper (if params['grad_steps']) around a Momentum optimizer.

  params['grad_steps'] 'schedule' is `_schedule`.
  """
  optimizer = models.OPTIMIZERS['Momentum'](None)
  grad_steps = params['grad_steps']
  if grad_steps == 'schedule':
    grad_steps = _schedule
  if grad_steps:
    optimizer = deferred_grad.GradientAggregationOptimizer(
        optimizer, grad_steps, use_tpu=params['use_tpu'],
        global_step_counts=params.get('counts', 'micro_steps'))
  return optimizer.minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())


def _model_fn(features, labels, mode, params):
  loss, _ = models.model_loss(features, labels)
  return tf.compat.v1.estimator.EstimatorSpec(
      mode, loss=loss, train_op=_train_op(loss, params))


def _tpu_model_fn(features, labels, mode, params):
  loss, _ = models.model_loss(features, labels)
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
      mode, loss=loss, train_op=_train_op(loss, params))


def _run_config(model_dir, **kwargs):
  return tf.compat.v1.estimator.RunConfig(
      model_dir=model_dir,
      save_summary_steps=None,
      log_step_count_steps=10**6,
      **kwargs)


def _estimator(model_dir, grad_steps, use_tpu=False, counts='micro_steps',
               **config):
  return tf.compat.v1.estimator.Estimator(
      _model_fn,
      config=_run_config(model_dir, **config),
      params={'grad_steps': grad_steps, 'use_tpu': use_tpu, 'counts': counts})


def _weights(estimator):
  return {name: estimator.get_variable_value(name) for name in VARIABLES}


def _large_batch_weights(tmp_path, batch_size):
  examples = _examples(CYCLES, batch_size)
  estimator = _estimator(str(tmp_path / 'large'), None)
  estimator.train(_input_fn(examples, batch_size), max_steps=CYCLES)
  assert estimator.get_variable_value('global_step') == CYCLES
  return _weights(estimator), examples


def test_estimator_matches_large_batch(tmp_path, use_tpu):
  expected, examples = _large_batch_weights(
      tmp_path, GRAD_STEPS * models.MICRO_BATCH)
  estimator = _estimator(str(tmp_path / 'micro'), GRAD_STEPS, use_tpu)
  estimator.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  assert estimator.get_variable_value('global_step') == CYCLES * GRAD_STEPS
  training.assert_same_training([_weights(estimator)], [expected])


def test_tpu_estimator_on_cpu_matches_large_batch(tmp_path, use_tpu):
  expected, examples = _large_batch_weights(
      tmp_path, GRAD_STEPS * models.MICRO_BATCH)
  tpu = tf.compat.v1.estimator.tpu
  estimator = tpu.TPUEstimator(
      _tpu_model_fn,
      config=tpu.RunConfig(
          model_dir=str(tmp_path / 'tpu'),
          save_summary_steps=None,
          log_step_count_steps=10**6,
          tpu_config=tpu.TPUConfig(iterations_per_loop=1)),
      train_batch_size=models.MICRO_BATCH,
      use_tpu=False,
      params={'grad_steps': GRAD_STEPS, 'use_tpu': use_tpu})
  estimator.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  assert estimator.get_variable_value('global_step') == CYCLES * GRAD_STEPS
  training.assert_same_training([_weights(estimator)], [expected])


@pytest.mark.parametrize('counts', ['micro_steps', 'updates'])
def test_estimator_mirrored_strategy_matches_large_batch(tmp_path, counts):
  """Each replica takes its own micro-batch from the dataset.

  Estimator scales the loss by 1/replicas for TF1 optimizers, so the
  all-reduced sum is the mean over all replicas' examples. The default
  cross-device ops hang this Estimator at step 0 even without the wrapper.
  With global_step_counts='updates', max_steps is the large batch's.
  """
  replicas = 2
  expected, examples = _large_batch_weights(
      tmp_path, replicas * GRAD_STEPS * models.MICRO_BATCH)
  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:0', '/cpu:1'],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  estimator = _estimator(
      str(tmp_path / 'mirrored'), GRAD_STEPS, counts=counts,
      train_distribute=strategy)
  steps = CYCLES * (GRAD_STEPS if counts == 'micro_steps' else 1)
  estimator.train(_input_fn(examples, models.MICRO_BATCH), max_steps=steps)
  assert estimator.get_variable_value('global_step') == steps
  training.assert_same_training([_weights(estimator)], [expected])


def _checkpoints_on_disk(model_dir):
  names = tf.io.gfile.listdir(model_dir)
  return sorted(n[:-len('.index')] for n in names if n.endswith('.index'))


def _model_fn_with_saver(features, labels, mode, params, config):
  """`_model_fn`, and README's one line for RunConfig's saver settings: a
  `deferred_grad.Saver` made with them, handed over in the scaffold."""
  spec = _model_fn(features, labels, mode, params)
  saver = deferred_grad.Saver(
      sharded=True, save_relative_paths=True,
      max_to_keep=config.keep_checkpoint_max,
      keep_checkpoint_every_n_hours=config.keep_checkpoint_every_n_hours)
  return spec._replace(scaffold=tf.compat.v1.train.Scaffold(saver=saver))


@pytest.mark.parametrize('keep', [1, 7])
def test_run_config_decides_the_checkpoints_kept(tmp_path, keep):
  """The wrapper installs no saver: the Estimator's own keeps what RunConfig
  asks for, as without the wrapper; a saver the model_fn hands over in its
  scaffold (a `deferred_grad.Saver` made with RunConfig's settings) too."""
  steps = CYCLES * GRAD_STEPS
  examples = _examples(steps, models.MICRO_BATCH)
  kept = {}
  for grad_steps, model_fn in ((None, _model_fn), (GRAD_STEPS, _model_fn),
                               (GRAD_STEPS, _model_fn_with_saver)):
    model_dir = str(tmp_path / str(len(kept)))
    estimator = tf.compat.v1.estimator.Estimator(
        model_fn, params={'grad_steps': grad_steps, 'use_tpu': False},
        config=_run_config(model_dir, save_checkpoints_steps=1,
                           keep_checkpoint_max=keep))
    estimator.train(_input_fn(examples, models.MICRO_BATCH), max_steps=steps)
    kept[len(kept)] = _checkpoints_on_disk(model_dir)
  assert len(kept[0]) == keep
  assert kept[1] == kept[0]
  assert kept[2] == kept[0]


def test_resume_mid_cycle_equals_uninterrupted(tmp_path, use_tpu):
  total = CYCLES * GRAD_STEPS
  stop = GRAD_STEPS + 1  # one micro-step into the second cycle
  examples = _examples(total, models.MICRO_BATCH)
  uninterrupted = _estimator(str(tmp_path / 'whole'), GRAD_STEPS, use_tpu)
  uninterrupted.train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=total)

  model_dir = str(tmp_path / 'resumed')
  first = _estimator(model_dir, GRAD_STEPS, use_tpu)
  first.train(_input_fn(examples, models.MICRO_BATCH), max_steps=stop)
  accumulator = first.get_variable_value('w1/GradientAccumulator')
  assert np.any(accumulator != 0)  # the checkpoint holds half a cycle
  second = _estimator(model_dir, GRAD_STEPS, use_tpu)
  second.train(
      _input_fn(examples, models.MICRO_BATCH, skip_batches=stop),
      max_steps=total)
  assert second.get_variable_value('global_step') == total
  training.assert_same_training([_weights(second)], [_weights(uninterrupted)],
                                rtol=0, atol=0)


def test_a_schedule_resumed_mid_cycle_trains_like_its_large_batches(
    tmp_path, use_tpu):
  """grad_steps a callable of the updates (cycles of 2, 3, 4 micro-batches);
  the job stops one micro-step into the second cycle and a new Estimator
  on the same model_dir finishes it: the large batches of 2, 3 and 4."""
  total = sum(SCHEDULE)
  examples = _examples(total, models.MICRO_BATCH)
  bare = training.Trainer(models.OPTIMIZERS['Momentum'])
  with bare.session() as session:
    start = 0
    for length in SCHEDULE:
      end = start + length * models.MICRO_BATCH
      bare.micro_step(session, examples[0][start:end], examples[1][start:end])
      start = end
    expected = session.run(bare.variables)
  model_dir = str(tmp_path / 'schedule')
  stop = SCHEDULE[0] + 1
  _estimator(model_dir, 'schedule', use_tpu).train(
      _input_fn(examples, models.MICRO_BATCH), max_steps=stop)
  second = _estimator(model_dir, 'schedule', use_tpu)
  second.train(_input_fn(examples, models.MICRO_BATCH, skip_batches=stop),
               max_steps=total)
  assert second.get_variable_value('global_step') == total
  assert second.get_variable_value('applied_updates') == len(SCHEDULE)
  training.assert_same_training([_weights(second)], [expected])


def test_estimator_mirrored_strategy_resumes_mid_cycle(tmp_path):
  """Each replica's partial sum is in the checkpoint (as the sum)."""
  replicas = 2
  total = CYCLES * GRAD_STEPS
  stop = GRAD_STEPS + 1  # one micro-step into the second cycle
  examples = _examples(replicas * total, models.MICRO_BATCH)

  def mirrored(model_dir):
    strategy = tf.distribute.MirroredStrategy(
        ['/cpu:0', '/cpu:1'],
        cross_device_ops=tf.distribute.ReductionToOneDevice())
    return _estimator(model_dir, GRAD_STEPS, train_distribute=strategy)

  uninterrupted = mirrored(str(tmp_path / 'whole'))
  with training.logged('PortCheckHook') as warned:
    uninterrupted.train(_input_fn(examples, models.MICRO_BATCH),
                        max_steps=total, hooks=[deferred_grad.PortCheckHook()])
  assert not warned
  model_dir = str(tmp_path / 'resumed')
  with training.logged('PortCheckHook') as warned:
    mirrored(model_dir).train(_input_fn(examples, models.MICRO_BATCH),
                              max_steps=stop,
                              hooks=[deferred_grad.PortCheckHook()])
  assert len(warned) == 1 and 'accumulated 1 of its %d' % GRAD_STEPS in (
      warned[0]), warned
  second = mirrored(model_dir)
  # Each micro-step takes one micro-batch per replica.
  second.train(_input_fn(examples, models.MICRO_BATCH,
                         skip_batches=replicas * stop), max_steps=total)
  assert second.get_variable_value('global_step') == total
  training.assert_same_training([_weights(second)], [_weights(uninterrupted)])


def test_summary_only_on_apply_steps(tmp_path, use_tpu):
  """A model_fn that writes the learning rate only when an update applies."""

  def model_fn(features, labels, mode):
    loss, _ = models.model_loss(features, labels)
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), GRAD_STEPS,
        use_tpu=use_tpu)
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    summary = tf.cond(
        optimizer.applies_update(),
        lambda: tf.compat.v1.summary.scalar('learning_rate', 0.1,
                                            collections=[]),
        lambda: tf.constant(b''))
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SUMMARIES, summary)
    return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                                train_op=train_op)

  model_dir = str(tmp_path / 'summaries')
  estimator = tf.compat.v1.estimator.Estimator(
      model_fn, config=tf.compat.v1.estimator.RunConfig(
          model_dir=model_dir, save_summary_steps=1,
          log_step_count_steps=10**6))
  examples = _examples(CYCLES * GRAD_STEPS, models.MICRO_BATCH)
  estimator.train(_input_fn(examples, models.MICRO_BATCH),
                  max_steps=CYCLES * GRAD_STEPS)
  # (Under control flow v1 the tag is cond/learning_rate.)
  written = [event.step
             for path in tf.io.gfile.glob(model_dir + '/events.*')
             for event in tf.compat.v1.train.summary_iterator(path)
             for value in event.summary.value
             if value.tag.split('/')[-1] == 'learning_rate']
  assert sorted(written) == [GRAD_STEPS * (c + 1) for c in range(CYCLES)]


def _bert_estimator(model_dir, batch_size, grad_steps, use_tpu=False):
  """TPUEstimator(use_tpu=False) with tools/examples/bert_porting.py's
  create_optimizer: before porting (grad_steps None) or after."""
  sys.path.insert(0, os.path.join(scripts.TOOLS, 'examples'))
  import bert_porting  # pylint: disable=g-import-not-at-top

  def model_fn(features, labels, mode, params):
    del labels, params
    loss = bert_porting.masked_lm_loss(features['ids'], features['labels'],
                                       features['weights'], epsilon=0.0)
    if grad_steps is None:
      train_op = bert_porting.create_optimizer_before(loss,
                                                      **bert_porting.SCHEDULE)
    else:
      train_op = bert_porting.create_optimizer_after(
          loss, grad_steps=grad_steps, use_tpu=use_tpu,
          masked_tokens=tf.reduce_sum(features['weights']),
          **bert_porting.SCHEDULE)
    return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(mode, loss=loss,
                                                       train_op=train_op)

  tpu = tf.compat.v1.estimator.tpu
  return tpu.TPUEstimator(
      model_fn, config=tpu.RunConfig(
          model_dir=model_dir, save_summary_steps=None,
          log_step_count_steps=10**6,
          tpu_config=tpu.TPUConfig(iterations_per_loop=1)),
      train_batch_size=batch_size, use_tpu=False), bert_porting


def _bert_input_fn(examples, skip_batches=0):
  ids, labels, weights = examples

  def input_fn(params):
    return tf.data.Dataset.from_tensor_slices(
        {'ids': ids, 'labels': labels, 'weights': weights}).batch(
            params['batch_size'], drop_remainder=True).skip(skip_batches)
  return input_fn


def test_ported_bert_under_tpu_estimator_resumes_mid_cycle(tmp_path, use_tpu):
  """The porting guide's example as a TPUEstimator model_fn (use_tpu=False):
  like the large batch, and stopped mid-cycle and resumed, like itself."""
  micro_batch, updates = 2, 4
  total = updates * GRAD_STEPS
  stop = GRAD_STEPS + 1
  large, bert_porting = _bert_estimator(str(tmp_path / 'large'),
                                        GRAD_STEPS * micro_batch, None)
  examples = bert_porting.make_examples(total, micro_batch, (3, 7, 1))
  large.train(_bert_input_fn(examples), max_steps=updates)
  whole, _ = _bert_estimator(str(tmp_path / 'whole'), micro_batch,
                             GRAD_STEPS, use_tpu)
  whole.train(_bert_input_fn(examples), max_steps=total)
  model_dir = str(tmp_path / 'resumed')
  _bert_estimator(model_dir, micro_batch, GRAD_STEPS, use_tpu)[0].train(
      _bert_input_fn(examples), max_steps=stop)
  resumed, _ = _bert_estimator(model_dir, micro_batch, GRAD_STEPS, use_tpu)
  resumed.train(_bert_input_fn(examples, skip_batches=stop), max_steps=total)
  names = [name for name in large.get_variable_names()
           if name.startswith('bert/') and '/adam_' not in name]
  weights = lambda estimator: {n: estimator.get_variable_value(n)
                               for n in names}
  assert resumed.get_variable_value('global_step') == total
  training.assert_same_training([weights(resumed)], [weights(whole)],
                                rtol=0, atol=0)
  # Round-off: Adam's update m / sqrt(v) is scale-free, so float32
  # round-off in a near-zero gradient shows up to ~2e-6 (lr 0.05).
  training.assert_same_training([weights(whole)], [weights(large)],
                                atol=1e-5)


# ---------------------------------------- once per update: moving averages --

def _averaged_model_fn(grad_steps, use_tpu=False, tpu_spec=False,
                       host_calls=None):
  """A model_fn with a moving average of the weights after its train op:
  the bare optimizer's as models write it, the wrapper's once per update
  (test_once_per_update.averaged). Evaluation reads the averages, as
  upstream image models do (`ema.variables_to_restore()`). With
  `host_calls`, a TPUEstimatorSpec's host_call appends the counters it is
  handed on each micro-step to that list."""
  import test_once_per_update  # pylint: disable=g-import-not-at-top

  def model_fn(features, labels, mode, params=None):
    del params
    loss, variables = models.model_loss(features, labels)
    if mode == tf.compat.v1.estimator.ModeKeys.EVAL:
      ema = tf.compat.v1.train.ExponentialMovingAverage(
          test_once_per_update.DECAY)
      saver = tf.compat.v1.train.Saver(ema.variables_to_restore())
      return tf.compat.v1.estimator.EstimatorSpec(
          mode, loss=loss, scaffold=tf.compat.v1.train.Scaffold(saver=saver))
    optimizer = models.OPTIMIZERS['Momentum'](None)
    if grad_steps:
      optimizer = deferred_grad.GradientAggregationOptimizer(
          optimizer, grad_steps, use_tpu=use_tpu)
    train_op = optimizer.minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    train_op = test_once_per_update.averaged()(optimizer, train_op, variables)
    if not tpu_spec:
      return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                                  train_op=train_op)
    host_call = None
    if host_calls is not None:
      def record(*counters):
        return tf.compat.v1.py_func(
            lambda *values: host_calls.append(
                [int(v.reshape(-1)[0]) for v in values]) or np.int64(0),
            counters, tf.int64, stateful=True)
      counters = [optimizer.applied_updates(), optimizer.micro_step_in_cycle(),
                  tf.cast(optimizer.applies_update(), tf.int64)]
      host_call = (record, [tf.reshape(c, [1]) for c in counters])
    return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(
        mode, loss=loss, train_op=train_op, host_call=host_call)

  return model_fn


def _expected_averages(examples, replicas=1):
  """numpy's moving average of the large batch's weights after the last
  update, and the eval loss on the first micro-batch with those averages.

  Args:
    examples: the micro-batches in order, a large batch every `replicas *
      GRAD_STEPS`.
    replicas: the replicas that each take a micro-batch per micro-step.
  """
  import test_once_per_update  # pylint: disable=g-import-not-at-top
  bare = training.Trainer(models.OPTIMIZERS['Momentum'])
  rows = replicas * GRAD_STEPS * models.MICRO_BATCH
  with bare.session() as session:
    initial = session.run(bare.variables)
    weights = []
    for cycle in range(CYCLES):
      part = slice(cycle * rows, (cycle + 1) * rows)
      bare.micro_step(session, examples[0][part], examples[1][part])
      weights.append(session.run(bare.variables))
    averages = test_once_per_update.numpy_moving_average(initial, weights)
    session.run([tf.compat.v1.assign(bare.variables[name], value)
                 for name, value in averages[-1].items()])
    loss = session.run(bare.loss, dict(zip(
        bare.inputs, [part[:models.MICRO_BATCH] for part in examples])))
  return averages[-1], loss


def _estimator_averages(estimator):
  return {name: estimator.get_variable_value(name + '/ExponentialMovingAverage')
          for name in VARIABLES}


def test_estimator_moving_average_is_the_large_batch_s(tmp_path, use_tpu):
  """And evaluation that restores the averages into the weights evaluates
  the large batch's averaged model."""
  examples = _examples(CYCLES * GRAD_STEPS, models.MICRO_BATCH)
  expected, eval_loss = _expected_averages(examples)
  for grad_steps, batch in ((None, GRAD_STEPS * models.MICRO_BATCH),
                            (GRAD_STEPS, models.MICRO_BATCH)):
    estimator = tf.compat.v1.estimator.Estimator(
        _averaged_model_fn(grad_steps, use_tpu),
        config=_run_config(str(tmp_path / str(grad_steps))), params={})
    estimator.train(_input_fn(examples, batch),
                    max_steps=CYCLES * GRAD_STEPS // (batch //
                                                      models.MICRO_BATCH))
    training.assert_same_training([_estimator_averages(estimator)],
                                  [expected])
    evaluated = estimator.evaluate(_input_fn(examples, models.MICRO_BATCH),
                                   steps=1)
    np.testing.assert_allclose(evaluated['loss'], eval_loss, rtol=1e-5)


@pytest.mark.parametrize('iterations_per_loop', [1, GRAD_STEPS])
def test_tpu_estimator_moving_average_and_host_call_counters(
    tmp_path, use_tpu, iterations_per_loop):
  """TPUEstimator(use_tpu=False): the average is the large batch's, and the
  host_call is handed the counters' values before each micro-step."""
  examples = _examples(CYCLES * GRAD_STEPS, models.MICRO_BATCH)
  expected, _ = _expected_averages(examples)
  host_calls = []
  tpu = tf.compat.v1.estimator.tpu
  estimator = tpu.TPUEstimator(
      _averaged_model_fn(GRAD_STEPS, use_tpu, tpu_spec=True,
                         host_calls=host_calls),
      config=tpu.RunConfig(
          model_dir=str(tmp_path / 'tpu'), save_summary_steps=None,
          log_step_count_steps=10**6,
          tpu_config=tpu.TPUConfig(iterations_per_loop=iterations_per_loop)),
      train_batch_size=models.MICRO_BATCH, use_tpu=False)
  estimator.train(_input_fn(examples, models.MICRO_BATCH),
                  max_steps=CYCLES * GRAD_STEPS)
  training.assert_same_training([_estimator_averages(estimator)], [expected])
  assert host_calls == [[step // GRAD_STEPS, step % GRAD_STEPS,
                         int(step % GRAD_STEPS == GRAD_STEPS - 1)]
                        for step in range(CYCLES * GRAD_STEPS)]


def test_estimator_under_mirrored_strategy_moving_average(tmp_path):
  """train_distribute: a wrapper and an average per replica (the model_fn
  runs on each), each replica taking its own micro-batch."""
  replicas = 2
  examples = _examples(replicas * CYCLES * GRAD_STEPS, models.MICRO_BATCH)
  expected, _ = _expected_averages(examples, replicas)
  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:0', '/cpu:1'],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  estimator = tf.compat.v1.estimator.Estimator(
      _averaged_model_fn(GRAD_STEPS),
      config=_run_config(str(tmp_path / 'mirrored'),
                         train_distribute=strategy), params={})
  estimator.train(_input_fn(examples, models.MICRO_BATCH),
                  max_steps=CYCLES * GRAD_STEPS)
  training.assert_same_training([_estimator_averages(estimator)], [expected])
