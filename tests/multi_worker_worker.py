"""One worker of the multi-worker tests (test_multi_worker.py starts two).

Usage: multi_worker_worker.py OUTPUT.npz MODE DELAY_SECONDS, with TF_CONFIG
set. MODE is 'session' (a raw Session), 'monitored'
(MonitoredTrainingSession, is_chief=True on every worker) or 'estimator'
(Estimator + train_and_evaluate; TF_CONFIG names a chief and a worker); or a
`nonfinite_policy` ('skip_micro_batch', 'skip_cycle'): a raw Session where
worker 1's part of micro-step BAD_STEP has a NaN target; 'extra_read': a raw
Session where worker 0 alone also reads the global step as hooks do, once,
mid-training; 'monitored_stop': MonitoredTrainingSession with a
StopAtStepHook, looping until it stops ('monitored_stop_updates': the same
with global_step_counts='updates', stopped at the updates); 'uneven': worker 0 makes one more
run with the collective options than worker 1 (a mistake: it must fail within
the options' timeout, not hang); 'monitored_resume': MonitoredTrainingSession
stopped at a cycle boundary and started again on the same checkpoint_dir,
which only worker 0 writes; 'monitored_resume_mid': the same stopped
mid-cycle (both workers must drop that cycle, and train on);
'monitored_resume_mid_schedule': the same with grad_steps a schedule;
'schedule': a raw Session with grad_steps a callable of the updates
applied, SCHEDULE (cycles of 2, 3 and 4 micro-steps); 'schedule_disagree':
worker k's grad_steps is tf.constant(2 + k) (a mistake: both must fail
within the options' timeout, not train on); 'embedding': a raw Session
training the embedding model (a table's sparse gradient; the workers touch
different numbers of rows, and so do the cycles) with cycles of
EMBEDDING_GRAD_STEPS micro-batches of a static size; 'embedding_clip': the
same with clip_norm=CLIP_NORM, GRAD_STEPS, and micro-batches of a size
known at run time only. Each worker feeds
its half of every micro-batch and writes its final weights (and, with a raw
Session, the executed collectives per micro-step) to OUTPUT.npz.
"""

import faulthandler
import os
import signal
import sys
import time

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import behavior  # the TF behaviour of the tests, set before any graph
from tensorflow.python.training import training_util  # pylint: disable=g-direct-tensorflow-import
import deferred_grad
import models

WORKERS = 2
GRAD_STEPS = 3
BAD_STEP, BAD_TASK = 4, 1  # the second micro-step of the second cycle
POLICIES = ('skip_micro_batch', 'skip_cycle')
SCHEDULE_LENGTHS = (2, 3, 4)  # CYCLES * GRAD_STEPS micro-steps in all
CLIP_NORM = 0.05  # 'embedding_clip': below the model's gradients' norms
# 'embedding': a cycle looks up fewer rows than the table holds.
EMBEDDING_GRAD_STEPS = 2


def schedule(updates):
  """The 'schedule' mode's grad_steps: the same on every worker."""
  return updates + SCHEDULE_LENGTHS[0]
# Trainings per worker process (tools/soak raises it).
REPEATS = int(os.environ.get('DEFERRED_GRAD_SOAK_REPEATS', 1))


def _micro_batches(task, model='mlp', grad_steps=GRAD_STEPS):
  """This worker's half of every micro-batch: (x, y), one micro-batch per row.

  Worker `task` takes rows [task * MICRO_BATCH, (task + 1) * MICRO_BATCH) of
  each micro-batch of WORKERS * MICRO_BATCH examples, so that the cycle's
  examples are those of one large batch in single-process training.
  """
  x_data, y_data = models.MODELS[model][0](
      models.CYCLES, WORKERS * grad_steps * models.MICRO_BATCH)
  shape = (models.CYCLES * grad_steps, WORKERS, models.MICRO_BATCH, -1)
  return (x_data.reshape(shape)[:, task], y_data.reshape(shape)[:, task])


class _SaveWeightsHook(tf.compat.v1.train.SessionRunHook):
  """Writes the trainable variables to OUTPUT.npz when training ends."""

  def __init__(self, output):
    self._output = output
    self._variables = None

  def begin(self):
    self._variables = {variable.op.name: variable
                       for variable in tf.compat.v1.trainable_variables()}

  def end(self, session):
    np.savez(self._output, collectives=np.zeros([0], np.int64),
             **session.run(self._variables))


class _FinalWeights(tf.compat.v1.train.SessionRunHook):
  """Reads the variables when MonitoredTrainingSession ends (it refuses
  runs once a hook has asked it to stop)."""

  def __init__(self, variables):
    self._variables = variables
    self.weights = None

  def end(self, session):
    self.weights = session.run(self._variables)


def estimator_main(output):
  """Estimator + train_and_evaluate: the chief and the worker both train.

  Estimator all-reduces its loss every step, so no run options are needed.
  """
  strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()

  def input_fn(input_context):
    # The chief's pipeline is 0, the worker's 1.
    return tf.data.Dataset.from_tensor_slices(
        _micro_batches(input_context.input_pipeline_id))

  def model_fn(features, labels, mode):
    loss, _ = models.model_loss(features, labels)
    optimizer = deferred_grad.GradientAggregationOptimizer(
        models.OPTIMIZERS['Momentum'](None), GRAD_STEPS)
    # Estimator scales the loss by 1 / replicas for TF1 optimizers.
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=(
        optimizer.minimize(loss, tf.compat.v1.train.get_global_step())))

  # Under this strategy TensorFlow adds the chief's CheckpointSaverHook only
  # when summaries are saved too (save_summary_steps > 0), and replaces
  # save_checkpoints_secs with steps.
  estimator = tf.estimator.Estimator(model_fn, config=tf.estimator.RunConfig(
      model_dir=os.path.join(os.path.dirname(output), 'model'),
      train_distribute=strategy, save_summary_steps=10**6,
      save_checkpoints_steps=10**6, log_step_count_steps=10**6))
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(input_fn, max_steps=models.CYCLES * GRAD_STEPS,
                             hooks=[_SaveWeightsHook(output)]),
      tf.estimator.EvalSpec(input_fn, steps=1))


def _build(strategy, policy=None, grad_steps=GRAD_STEPS, model='mlp',
           batch=None, **wrapper_kwargs):
  """The model and its train op, under `strategy.scope()` in a new graph.

  `batch`: the micro-batches' size, or None: known at run time only.

  Returns:
    (global_step, x, y, {name: variable}, train_op, the wrapper).
  """
  global_step = tf.compat.v1.train.get_or_create_global_step()
  _, ((x_dtype, x_shape), (y_dtype, y_shape)), loss_fn = models.MODELS[model]
  x = tf.compat.v1.placeholder(x_dtype, [batch] + x_shape[1:])
  y = tf.compat.v1.placeholder(y_dtype, [batch] + y_shape[1:])
  optimizer = deferred_grad.GradientAggregationOptimizer(
      models.OPTIMIZERS['Momentum'](None), grad_steps,
      nonfinite_policy=policy, **wrapper_kwargs)
  variables = {}

  def replica_step():
    loss, model_variables = loss_fn(x, y)
    variables.update(model_variables)
    return optimizer.minimize(loss / WORKERS, global_step=global_step)

  train_op = strategy.group(
      strategy.extended.call_for_each_replica(replica_step))
  return global_step, x, y, variables, train_op, optimizer


def _monitored_resume(strategy, server, config, task, x_data, y_data,
                      checkpoint_dir, stop, grad_steps=GRAD_STEPS,
                      model='mlp'):
  """Two MonitoredTrainingSessions on one checkpoint_dir; returns weights.

  The first stops at step `stop` (StopAtStepHook); only worker 0 saves
  (the others pass no save_checkpoint_* schedule), and both restore.
  """
  for last_step in (stop, len(x_data)):
    if task != 0 and last_step == len(x_data):
      # Restore only once worker 0 has written the checkpoint.
      deadline = time.time() + 60
      while (tf.train.latest_checkpoint(checkpoint_dir) or '').split(
          '-')[-1] != str(stop):
        assert time.time() < deadline, 'no checkpoint from worker 0'
        time.sleep(0.2)
    with tf.Graph().as_default(), strategy.scope():
      global_step, x, y, variables, train_op, _ = _build(
          strategy, grad_steps=grad_steps, model=model)
      barrier = deferred_grad.collective_barrier(strategy)
      options = deferred_grad.collective_run_options()
      # Worker 0 saves (every cycle); the others only restore.
      saving = dict(save_checkpoint_steps=GRAD_STEPS if task == 0 else None)
      final = _FinalWeights(variables)
      with tf.compat.v1.train.MonitoredTrainingSession(
          master=server.target, config=config, is_chief=True,
          checkpoint_dir=checkpoint_dir,
          hooks=[tf.compat.v1.train.StopAtStepHook(last_step=last_step),
                 final],
          save_checkpoint_secs=None, save_summaries_steps=None,
          save_summaries_secs=None, log_step_count_steps=None,
          **saving) as session:
        session.run(barrier, options=options)
        step = session.run(global_step)
        while not session.should_stop():
          session.run(train_op, {x: x_data[step], y: y_data[step]},
                      options=options)
          step += 1
  return final.weights


def main(output, mode, delay):
  time.sleep(delay)
  if mode == 'estimator':
    return estimator_main(output)
  strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()
  config = tf.compat.v1.ConfigProto()
  strategy.configure(session_config=config)
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  task = resolver.task_id
  server = tf.distribute.Server(
      resolver.cluster_spec(), job_name='worker', task_index=task,
      config=config, start=True)
  # A soak repeats the training in this process (fresh graphs and sessions
  # on the same servers); every repeat must end with the same weights.
  repeats = (1 if mode in ('uneven', 'estimator', 'monitored_resume_mid',
                           'monitored_resume_mid_schedule',
                           'monitored_resume_mid_embedding',
                           'schedule_disagree') else REPEATS)
  first = None
  for repeat in range(repeats):
    weights, collectives = _train(strategy, server, config, task, mode,
                                  os.path.join(os.path.dirname(output),
                                               'ckpt%d' % repeat))
    if first is None:
      first = weights, collectives
    else:
      for name, value in first[0].items():
        np.testing.assert_array_equal(weights[name], value,
                                      'repeat %d: %s' % (repeat, name))
  weights, collectives = first
  np.savez(output, collectives=np.array(collectives, np.int64), **weights)


def _train(strategy, server, config, task, mode, checkpoint_dir):
  """Trains once in `mode`; returns (final weights, collectives per step)."""
  model = 'embedding' if 'embedding' in mode else 'mlp'
  grad_steps = {
      'schedule': schedule,
      'schedule_disagree': lambda _: tf.constant(2 + task, tf.int64),
      'embedding': EMBEDDING_GRAD_STEPS,
  }.get(mode, GRAD_STEPS)
  x_data, y_data = _micro_batches(
      task, model, EMBEDDING_GRAD_STEPS if mode == 'embedding' else GRAD_STEPS)
  policy = mode if mode in POLICIES else None
  counts_updates = mode.endswith('_updates')
  if policy and task == BAD_TASK:
    y_data[BAD_STEP, 0, 0] = np.nan
  with tf.Graph().as_default(), strategy.scope():
    global_step, x, y, variables, train_op, optimizer = _build(
        strategy, policy, grad_steps, model,
        models.MICRO_BATCH if mode == 'embedding' else None,
        **({'clip_norm': CLIP_NORM} if mode == 'embedding_clip' else {}),
        **({'global_step_counts': 'updates'} if counts_updates else {}))
    barrier = deferred_grad.collective_barrier(strategy)
    # The first barrier waits for a late worker; 'uneven' bounds the runs
    # after it by 8 s, which its refused run must reach.
    barrier_options = deferred_grad.collective_run_options()
    options = deferred_grad.collective_run_options(
        timeout_seconds=8 if mode in ('uneven', 'schedule_disagree') else 600)

    def feeds():
      for x_value, y_value in zip(x_data, y_data):
        yield {x: x_value, y: y_value}

    collectives = []  # executed Collective* ops per micro-step
    # What hooks fetch to read the step (StopAtStepHook, a chief's logging).
    hook_read = training_util._get_or_create_global_step_read()  # pylint: disable=protected-access
    if mode.startswith('monitored_resume'):
      pass  # graphs of its own, below
    elif mode not in ('monitored', 'monitored_stop', 'monitored_stop_updates'):
      session = tf.compat.v1.Session(server.target, config=config)
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(barrier, options=barrier_options)
      options.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
      for step, feed in enumerate(feeds()):
        if mode == 'extra_read' and step == 6 and task == 0:
          session.run(hook_read)  # worker 0 only, as a hook does: no options
        if mode == 'uneven' and step == 4 and task == 0:
          session.run(barrier, options=options)  # worker 0 only: refused
        metadata = tf.compat.v1.RunMetadata()
        session.run(train_op, feed, options=options, run_metadata=metadata)
        collectives.append(sum(
            1 for device in metadata.step_stats.dev_stats
            for node in device.node_stats
            if node.timeline_label.split(' = ')[-1].startswith('Collective')
            or node.node_name.startswith('Collective')))
      weights = session.run(variables)
      if policy:
        weights['skipped'] = session.run(
            [optimizer.skipped_micro_batches, optimizer.skipped_cycles])
    else:
      final = _FinalWeights(variables)
      hooks = [final]
      if mode.startswith('monitored_stop'):  # at micro-steps, or updates
        hooks.append(tf.compat.v1.train.StopAtStepHook(
            last_step=len(x_data) // (GRAD_STEPS if counts_updates else 1)))
      # Every worker runs the collective initializers: all are chiefs.
      with tf.compat.v1.train.MonitoredTrainingSession(
          master=server.target, config=config, is_chief=True, hooks=hooks,
          save_checkpoint_secs=None, save_summaries_steps=None,
          save_summaries_secs=None, log_step_count_steps=None) as session:
        session.run(barrier, options=options)
        batches = list(feeds())
        if mode.startswith('monitored_stop'):
          step = 0
          while not session.should_stop():
            session.run(train_op, batches[step], options=options)
            step += 1
        else:
          for feed in batches:
            session.run(train_op, feed, options=options)
      weights = final.weights
  if mode.startswith('monitored_resume'):
    # Mid-cycle: one micro-step into the second cycle, which both workers
    # then drop.
    mid_cycle = mode.startswith('monitored_resume_mid')
    stop = GRAD_STEPS + 1 if mid_cycle else 2 * GRAD_STEPS
    grad_steps = GRAD_STEPS
    if mode.endswith('_schedule'):  # the same cycles, counted by a schedule
      grad_steps = lambda _: tf.constant(GRAD_STEPS, tf.int64)
    weights = _monitored_resume(strategy, server, config, task, x_data, y_data,
                                checkpoint_dir, stop, grad_steps, model)
  return weights, collectives


if __name__ == '__main__':
  # The test's watchdog sends SIGUSR1 before killing a worker that hangs:
  # every thread's Python stack goes to the log it shows.
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
