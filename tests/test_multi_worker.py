"""Two worker processes on 127.0.0.1 under MultiWorkerMirroredStrategy.

Each test starts the workers (tests/multi_worker_worker.py) with TF_CONFIG on
free ports, waits at most WORKER_TIMEOUT seconds and kills what is left, so
a hang fails the test instead of stalling the suite. The workers inherit
DEFERRED_GRAD_TF_BEHAVIOR, so both behaviours are tested.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import models
import multi_worker_worker
import scripts
import training
from models import make_data
from training import assert_same_training
from training import train

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'multi_worker_worker.py')
WORKERS = 2
GRAD_STEPS = 3  # as in multi_worker_worker.py
# A worker pair's whole run, bounded; DEFERRED_GRAD_WORKER_TIMEOUT overrides.
# With DEFERRED_GRAD_SOAK_REPEATS (tools/soak) each worker trains that many
# times over (see multi_worker_worker.py), and the bound grows with it.
WORKER_TIMEOUT = int(os.environ.get('DEFERRED_GRAD_WORKER_TIMEOUT', 120 + 60 *
                                    int(os.environ.get(
                                        'DEFERRED_GRAD_SOAK_REPEATS', 1))))


def _wait_or_dump_stacks(processes, timeout):
  """Each process's output; on a hang, fails with every worker's stacks.

  The watchdog: a worker still running after `timeout` seconds (all
  together) gets SIGUSR1, on which it writes every thread's Python stack to
  its log (see multi_worker_worker.py), and is then killed.
  """
  deadline = time.time() + timeout
  logs = []
  for process in processes:
    try:
      logs.append(process.communicate(
          timeout=max(1, deadline - time.time()))[0])
    except subprocess.TimeoutExpired:
      for hung in processes:
        if hung.poll() is None:
          hung.send_signal(signal.SIGUSR1)
      time.sleep(3)
      stacks = []
      for index, hung in enumerate(processes):
        if hung.poll() is None:
          hung.kill()
        output = hung.communicate()[0] or ''
        stacks.append('--- worker %d (rc %s), last of its log:\n%s' % (
            index, hung.returncode, output[-4000:]))
      raise AssertionError('workers still running after %d s (a hang?):\n%s'
                           % (timeout, '\n'.join(stacks)))
  return logs


def _run_workers(tmp_path, mode, delays, check=True):
  """Runs the workers to the end; returns each one's final weights.

  Estimator needs a chief: its TF_CONFIG names one chief and one worker.
  """
  if mode == 'estimator':
    tasks = [('chief', 0), ('worker', 0)]
  else:
    tasks = [('worker', index) for index in range(WORKERS)]
  cluster = {}
  for (task_type, _), port in zip(tasks, scripts.free_ports(WORKERS)):
    cluster.setdefault(task_type, []).append('127.0.0.1:%d' % port)
  outputs = [os.path.join(str(tmp_path), 'worker%d.npz' % i)
             for i in range(WORKERS)]
  processes = []
  try:
    for (task_type, index), output, delay in zip(tasks, outputs, delays):
      env = dict(os.environ, TF_CONFIG=json.dumps({
          'cluster': cluster, 'task': {'type': task_type, 'index': index}}))
      processes.append(subprocess.Popen(
          [sys.executable, WORKER, output, mode, str(delay)], env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          universal_newlines=True))
    logs = _wait_or_dump_stacks(processes, WORKER_TIMEOUT)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  if not check:
    return [(process.returncode, log) for process, log in zip(processes, logs)]
  for process, log in zip(processes, logs):
    assert process.returncode == 0, log[-3000:]
  return [dict(np.load(output)) for output in outputs]


def _large_batch():
  data = make_data(models.CYCLES, WORKERS * GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Momentum'], data)
  return expected[-1]


def _large_batch_without(bad_step, bad_task, policy):
  """The bare optimizer on each cycle's finite parts, as `policy` would.

  A part is one worker's MICRO_BATCH rows of one micro-step; the bad part is
  left out of its cycle's large batch ('skip_micro_batch'), or its cycle
  is left out ('skip_cycle').
  """
  x, y = make_data(models.CYCLES, WORKERS * GRAD_STEPS * models.MICRO_BATCH)
  rows_per_step = WORKERS * models.MICRO_BATCH
  trainer = training.Trainer(models.OPTIMIZERS['Momentum'])
  with trainer.session() as session:
    for cycle in range(models.CYCLES):
      keep = np.ones(len(x[cycle]), bool)
      if cycle == bad_step // GRAD_STEPS:
        if policy == 'skip_cycle':
          continue
        start = ((bad_step % GRAD_STEPS) * rows_per_step +
                 bad_task * models.MICRO_BATCH)
        keep[start:start + models.MICRO_BATCH] = False
      trainer.micro_step(session, x[cycle][keep], y[cycle][keep])
    return session.run(trainer.variables)


@pytest.mark.parametrize('mode, delays', [
    ('session', [0, 0]),
    ('session', [0, 1]),  # one worker a second late
    ('monitored', [0, 0]),
    # Used to hang: a hook-style read of the step on one worker ran the
    # initial value's broadcast; StopAtStepHook makes such a read.
    ('extra_read', [0, 0]),
    ('monitored_stop', [0, 0]),
    # global_step_counts='updates': StopAtStepHook at the large batch's step
    ('monitored_stop_updates', [0, 0]),
    ('monitored_resume', [0, 0]),  # at a cycle boundary; worker 0 saves
])
def test_workers_train_like_one_large_batch(tmp_path, mode, delays):
  expected = _large_batch()
  for weights in _run_workers(tmp_path, mode, delays):
    counts = weights.pop('collectives')
    assert_same_training([weights], [expected])
    if mode == 'session':
      _assert_collectives_on_apply_steps_only(counts)


def _assert_collectives_on_apply_steps_only(counts):
  """Accumulate-only micro-steps send nothing between workers."""
  assert len(counts) == models.CYCLES * GRAD_STEPS
  apply_steps = np.arange(len(counts)) % GRAD_STEPS == GRAD_STEPS - 1
  assert np.all(counts[~apply_steps] == 0), counts
  # The gradient all-reduce of the model's 4 variables (possibly packed).
  assert np.all(counts[apply_steps] >= 1), counts


def test_workers_follow_one_schedule(tmp_path):
  """grad_steps a callable of the updates: cycles of 2, 3 and 4 micro-steps
  on both workers, each the large batch of its micro-batches; collectives
  on the apply steps only."""
  lengths = multi_worker_worker.SCHEDULE_LENGTHS
  rows = WORKERS * models.MICRO_BATCH  # a micro-step's, both workers'
  x, y = [part.reshape((-1,) + part.shape[2:]) for part in make_data(
      models.CYCLES, WORKERS * GRAD_STEPS * models.MICRO_BATCH)]
  trainer = training.Trainer(models.OPTIMIZERS['Momentum'])
  with trainer.session() as session:
    start = 0
    for length in lengths:
      end = start + length * rows
      trainer.micro_step(session, x[start:end], y[start:end])
      start = end
    expected = session.run(trainer.variables)
  ends = np.cumsum(lengths) - 1
  for weights in _run_workers(tmp_path, 'schedule', [0, 0]):
    counts = weights.pop('collectives')
    apply_steps = np.isin(np.arange(len(counts)), ends)
    assert np.all(counts[~apply_steps] == 0), counts
    assert np.all(counts[apply_steps] >= 1), counts
    assert_same_training([weights], [expected])


def _clipped_by_dense_norm(grads_and_vars):
  """The large batch's gradients clipped as `clip_norm` clips: by the norm
  of the dense gradient (a table's repeated ids added up first), kept
  sparse."""
  grads, variables = zip(*grads_and_vars)
  grads = [tf.IndexedSlices(tf.math.unsorted_segment_sum(
      g.values, positions, tf.size(unique)), unique, g.dense_shape)
           if isinstance(g, tf.IndexedSlices) else g
           for g in grads
           for unique, positions in [tf.unique(g.indices) if isinstance(
               g, tf.IndexedSlices) else (None, None)]]
  clipped, _ = tf.clip_by_global_norm(grads, multi_worker_worker.CLIP_NORM)
  return list(zip(clipped, variables))


def test_a_table_trains_like_one_large_batch_across_workers(tmp_path):
  """A table's sparse gradient (Momentum: a dense one would move untouched
  rows): each apply step all-reduces the cycle's rows, though the workers
  touch different numbers of rows, and so do the cycles. Cycles of 2
  micro-batches of a static size look up fewer rows than the table holds:
  those are handed on."""
  data = models.make_embedding_data(
      models.CYCLES,
      WORKERS * multi_worker_worker.EMBEDDING_GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Momentum'], data,
                         model='embedding')
  for weights in _run_workers(tmp_path, 'embedding', [0, 0]):
    weights.pop('collectives')
    assert_same_training([weights], [expected[-1]])


def test_clip_norm_keeps_a_table_sparse_across_workers(tmp_path):
  """clip_norm with a table: its rows are all-reduced sparse for the norm
  of the workers' sum and go on sparse, as the large batch's (a dense
  gradient would move Momentum's untouched rows)."""
  data = models.make_embedding_data(
      models.CYCLES, WORKERS * GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.with_gradient_transform(
      models.OPTIMIZERS['Momentum'], _clipped_by_dense_norm), data,
                         model='embedding')
  for weights in _run_workers(tmp_path, 'embedding_clip', [0, 0]):
    weights.pop('collectives')
    assert_same_training([weights], [expected[-1]])


@pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')
def test_estimator_train_and_evaluate_trains_like_one_large_batch(tmp_path):
  """Chief and worker; the chief's checkpoint holds the same weights."""
  expected = _large_batch()
  for weights in _run_workers(tmp_path, 'estimator', [0, 0]):
    weights.pop('collectives')
    assert_same_training([weights], [expected])
  checkpoint = tf.train.load_checkpoint(str(tmp_path / 'model'))
  assert checkpoint.get_tensor('global_step') == models.CYCLES * GRAD_STEPS
  assert_same_training(
      [{name: checkpoint.get_tensor(name) for name in expected}], [expected])


@pytest.mark.parametrize('policy, skipped_cycles', [('skip_micro_batch', 0),
                                                    ('skip_cycle', 1)])
def test_policy_across_workers(tmp_path, policy, skipped_cycles):
  """A NaN micro-batch on one worker: both workers skip alike.

  Still no collective on accumulate-only micro-steps: the policy's counts
  travel in one small all-reduce on the apply step.
  """
  expected = _large_batch_without(4, 1, policy)  # as multi_worker_worker.py
  for weights in _run_workers(tmp_path, policy, [0, 0]):
    counts = weights.pop('collectives')
    skipped = list(weights.pop('skipped'))
    assert skipped == [1, skipped_cycles]
    assert_same_training([weights], [expected])
    apply_steps = np.arange(len(counts)) % GRAD_STEPS == GRAD_STEPS - 1
    assert np.all(counts[~apply_steps] == 0), counts


def test_uneven_runs_fail_within_the_timeout_instead_of_hanging(tmp_path):
  """Worker 0 makes one run with the collective options more than worker 1.

  That breaks the rule (the same number of such runs on every worker): the
  options' timeout (8 s here) turns the hang it caused into
  DeadlineExceededError on both workers.
  """
  start = time.time()
  for returncode, log in _run_workers(tmp_path, 'uneven', [0, 0],
                                      check=False):
    assert returncode != 0, log[-3000:]
    assert 'DeadlineExceededError' in log, log[-3000:]
  assert time.time() - start < WORKER_TIMEOUT


def test_workers_with_different_schedules_fail_instead_of_training(tmp_path):
  """Worker k's cycles are 2 + k micro-steps: their apply steps no longer
  meet. Both must fail (the lengths' check, or the options' timeout)."""
  start = time.time()
  for returncode, log in _run_workers(tmp_path, 'schedule_disagree', [0, 0],
                                      check=False):
    assert returncode != 0, log[-3000:]
    assert ('disagree on the cycle' in log or
            'DeadlineExceededError' in log), log[-3000:]
  assert time.time() - start < WORKER_TIMEOUT


@pytest.mark.parametrize('mode', ['monitored_resume_mid',
                                  'monitored_resume_mid_schedule',
                                  'monitored_resume_mid_embedding'])
def test_resume_mid_cycle_drops_that_cycle_on_every_worker(tmp_path, mode):
  """A checkpoint written mid-cycle holds only the saving worker's part.

  Restored one micro-step into the second cycle, both workers warn, drop
  that cycle (the micro-batch before the restart and those after it) and
  train on: the weights are the large batch's of cycles 1 and 3. The same
  with grad_steps a schedule (its counters restored mid-cycle), and with a
  table (each replica's list of rows restored as the chief's, then emptied;
  micro-batches of a size known at run time only: the apply step pads to
  the table's rows).
  """
  model = 'embedding' if mode.endswith('embedding') else 'mlp'
  x, y = models.MODELS[model][0](models.CYCLES,
                                 WORKERS * GRAD_STEPS * models.MICRO_BATCH)
  trainer = training.Trainer(models.OPTIMIZERS['Momentum'], model=model)
  with trainer.session() as session:
    for cycle in (0, 2):
      trainer.micro_step(session, x[cycle], y[cycle])
    expected = session.run(trainer.variables)
  results = _run_workers(tmp_path, mode, [0, 0], check=False)
  for index, (returncode, log) in enumerate(results):
    assert returncode == 0, log[-3000:]
    assert 'this session started mid-cycle, at micro-step 1' in log, (
        log[-3000:])
    weights = dict(np.load(os.path.join(str(tmp_path),
                                        'worker%d.npz' % index)))
    weights.pop('collectives')
    assert_same_training([weights], [expected])
