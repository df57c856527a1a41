"""Between-graph replication with parameter servers, on 127.0.0.1.

One in-process cluster (3 workers, 2 ps) serves the module; each run builds
its graphs under a scope of its own, so the runs' variables on the ps never
meet. Workers are threads, each with its own graph and session, as
`replica_device_setter` scripts and legacy Estimators run them; every
`session.run` is bounded by `operation_timeout_in_ms`, every thread join by
a timeout, so a hang fails the test.

The model makes every micro-batch's gradient identifiable: micro-batch i
has loss `w[i] + 2 * w2[i]` (a one-hot `c`), and SGD with learning rate 1.
The wrapped optimizer records every gradient it applies in a queue on the
ps. So the test sees each update: it must hold exactly K micro-batches,
K consecutive ones of one worker, each once, with weight 1/K; no micro-batch
may be lost or applied twice; `global_step` must count every micro-step.
"""

import itertools
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import scripts
import training

WORKERS, PS = 3, 2
K = 4
MICRO_BATCHES = 12  # per worker
TIMEOUT_MS = 60000
# Trainings per case and run: races show up only sometimes. The test
# runner trains each cluster case twice, once per TensorFlow version (in
# one behaviour each, see conftest.py); tools/soak raises it.
REPEATS = int(os.environ.get('DEFERRED_GRAD_SOAK_REPEATS', 1))

_runs = itertools.count()


@pytest.fixture(scope='module')
def cluster():
  ports = scripts.free_ports(WORKERS + PS)
  spec = tf.train.ClusterSpec({
      'worker': ['127.0.0.1:%d' % p for p in ports[:WORKERS]],
      'ps': ['127.0.0.1:%d' % p for p in ports[WORKERS:]],
  })
  config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=TIMEOUT_MS)
  workers = [tf.distribute.Server(spec, 'worker', i, config=config)
             for i in range(WORKERS)]
  servers = [tf.distribute.Server(spec, 'ps', i, config=config)
             for i in range(PS)]
  return workers, servers


def _session_config():
  return tf.compat.v1.ConfigProto(operation_timeout_in_ms=TIMEOUT_MS)


class _Recording(tf.compat.v1.train.GradientDescentOptimizer):
  """SGD that also records each gradient of `w` it applies, in a queue."""

  def __init__(self, queue):
    super(_Recording, self).__init__(1.0)
    self._queue = queue

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    grads_and_vars = list(grads_and_vars)
    gradient = [g for g, v in grads_and_vars
                if v.op.name.split('/')[-1] == 'w'][0]
    record = self._queue.enqueue([tf.convert_to_tensor(gradient)])
    with tf.control_dependencies([record]):
      return super(_Recording, self).apply_gradients(grads_and_vars,
                                                     global_step, name)


def _size(workers):
  return workers * MICRO_BATCHES


def identifiable_model(index, size, ps_tasks, use_tpu, table,
                       queue_name='updates', policy=None, poison=-1,
                       weighted=False, grad_steps=K, counts='micro_steps'):
  """The model of the module docstring, built under the caller's devices.

  Args:
    index: the micro-batch's number, an int32 scalar tensor.
    size: micro-batches in all (the length of `w`).
    ps_tasks: the number of ps tasks (the table's partitions).
    use_tpu: the wrapper's keyword.
    table: also look up row `index` of a table partitioned over the ps.
    queue_name: the shared name of the queue of recorded updates.
    policy: the wrapper's `nonfinite_policy`.
    poison: the micro-batch whose gradient is NaN (-1: none).
    weighted: weigh micro-batch i by `_weight(i)` (`micro_batch_weight`).
    grad_steps: the wrapper's (an int or a schedule).
    counts: the wrapper's `global_step_counts`.

  Returns:
    (loss, the wrapper, the queue on ps 0 where each update is recorded).
  """
  zeros = tf.compat.v1.zeros_initializer()
  w = tf.compat.v1.get_variable('w', [size], initializer=zeros)
  w2 = tf.compat.v1.get_variable('w2', [size], initializer=zeros)
  c = tf.one_hot(index, size)
  loss = tf.reduce_sum(w * c) + 2 * tf.reduce_sum(w2 * c)
  if table:
    embeddings = tf.compat.v1.get_variable(
        'table', [size, 2], initializer=zeros,
        partitioner=tf.compat.v1.fixed_size_partitioner(ps_tasks))
    rows = tf.nn.embedding_lookup(embeddings, tf.stack([index, index]))
    loss += tf.reduce_sum(rows * [[1.0, 3.0]])
  loss *= tf.where(tf.equal(index, poison), np.nan, 1.0)
  with tf.device('/job:ps/task:0'):
    queue = tf.queue.FIFOQueue(1000, [tf.float32], shapes=[[size]],
                               shared_name=queue_name, name='updates')
  opt = deferred_grad.GradientAggregationOptimizer(
      _Recording(queue), grad_steps, use_tpu=use_tpu, nonfinite_policy=policy,
      micro_batch_weight=_weight(index) if weighted else None,
      global_step_counts=counts)
  return loss, opt, queue


def _weight(index):
  return tf.cast(index % 3 + 1, tf.float32)  # 1, 2, 3, 1, ...


def _build(run, task, workers, ps_tasks, use_tpu, table, policy=None,
           poison=-1, weighted=False, grad_steps=K, counts='micro_steps'):
  """Builds worker `task`'s graph; returns what the worker and test need."""
  setter = tf.compat.v1.train.replica_device_setter(
      ps_tasks=ps_tasks, worker_device='/job:worker/task:%d' % task)
  with tf.compat.v1.device(setter), \
      tf.compat.v1.variable_scope('run%d' % run) as scope:
    global_step = tf.compat.v1.train.create_global_step()
    index = tf.compat.v1.placeholder(tf.int32, [])
    loss, opt, queue = identifiable_model(index, _size(workers), ps_tasks,
                                          use_tpu, table,
                                          'run%d_updates' % run, policy,
                                          poison, weighted, grad_steps,
                                          counts)
    train_op = opt.minimize(loss, global_step=global_step)
  by_name = {v.op.name[len(scope.name) + 1:]: v
             for v in tf.compat.v1.global_variables()}
  state = [global_step, by_name['w'], by_name['w2']]
  if table:
    state.append(tf.concat([by_name['table/part_%d' % i]
                            for i in range(ps_tasks)], 0))
  return dict(train_op=train_op, index=index, state=state, queue=queue)


class _Sessions(tf.compat.v1.train.SessionRunHook):
  """Counts the sessions a MonitoredTrainingSession creates: more than one
  means it recovered from an error (a preemption, or, on a loaded machine,
  a transient gRPC failure) by creating a new session, a restart."""

  def __init__(self):
    self.created = 0

  def after_create_session(self, session, coord):
    del session, coord
    self.created += 1


class _AbortOnce(tf.compat.v1.train.SessionRunHook):
  """Fails the `at`-th run with AbortedError, as a preempted ps would."""

  def __init__(self, at):
    self._at = at
    self._runs = 0

  def before_run(self, run_context):
    del run_context
    self._runs += 1
    if self._runs == self._at:
      raise tf.errors.AbortedError(None, None, 'injected by the test')


def _train(cluster, workers, ps_tasks, use_tpu, monitored, table=False,
           policy=None, poison=-1, weighted=False, abort_at=None,
           grad_steps=K, counts='micro_steps', port_check=False,
           micro_batches=MICRO_BATCHES):
  """Trains `workers` threads; returns the final state seen from the ps.

  Returns:
    (recorded updates, [global_step, w, w2(, table)], {task: its local
    variables}, {task: its MonitoredTrainingSession's recoveries}).
  """
  worker_servers, _ = cluster
  run = next(_runs)
  initialized = threading.Event()
  errors = []
  local_variables = {}
  sessions = {}

  def work(task):
    try:
      with tf.Graph().as_default():
        built = _build(run, task, workers, ps_tasks, use_tpu, table, policy,
                       poison, weighted, grad_steps, counts)
        local_variables[task] = tf.compat.v1.local_variables()
        target = worker_servers[task].target
        if monitored:
          if task:
            assert initialized.wait(TIMEOUT_MS / 1000)
          sessions[task] = _Sessions()
          hooks = [sessions[task]]
          if abort_at and task == 1:
            hooks.append(_AbortOnce(abort_at))
          if port_check:
            hooks.append(deferred_grad.PortCheckHook())
          session = tf.compat.v1.train.MonitoredTrainingSession(
              master=target, is_chief=task == 0, config=_session_config(),
              hooks=hooks,
              save_checkpoint_secs=None, save_checkpoint_steps=None,
              save_summaries_steps=None, save_summaries_secs=None,
              log_step_count_steps=None)
        else:
          session = tf.compat.v1.Session(target, config=_session_config())
          if task == 0:
            session.run(tf.compat.v1.global_variables_initializer())
          else:
            assert initialized.wait(TIMEOUT_MS / 1000)
          session.run(tf.compat.v1.local_variables_initializer())
        if task == 0:
          initialized.set()
        with session:
          for j in range(micro_batches):
            session.run(built['train_op'],
                        {built['index']: task * MICRO_BATCHES + j})
    except Exception as e:  # pylint: disable=broad-except
      errors.append('worker %d: %s' % (task, e))
      initialized.set()

  threads = [threading.Thread(target=work, args=(t,)) for t in range(workers)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(3 * TIMEOUT_MS / 1000)
  assert not any(thread.is_alive() for thread in threads), 'a worker hung'
  assert not errors, '\n'.join(errors)

  with tf.Graph().as_default():
    built = _build(run, 0, workers, ps_tasks, use_tpu, table)
    with tf.compat.v1.Session(worker_servers[0].target,
                              config=_session_config()) as session:
      queue = built['queue']
      updates = session.run(queue.dequeue_many(session.run(queue.size())))
      state = session.run(built['state'])
  recovered = {task: hook.created - 1 for task, hook in sessions.items()
               if hook.created > 1}
  return updates, state, local_variables, recovered


def _check(updates, state, workers, table=False, skipped_block=None,
           recovered=None, counts='micro_steps'):
  """Checks the recorded updates and the final state.

  Args:
    updates: the gradients the wrapped optimizer applied, in order.
    state: [global_step, w, w2(, table)] at the end.
    workers: how many trained.
    table: whether `state` has the table.
    skipped_block: the first micro-batch of a cycle a policy skipped.
    recovered: {task: recoveries}: a worker whose session was re-created
      (a restart) drops its partial cycle, at most K - 1 micro-batches each
      time, and its cycles then start where it resumed.
    counts: the wrapper's `global_step_counts`: 'updates' counts one per
      update any worker applied.
  """
  recovered = recovered or {}
  size = _size(workers)
  applied = np.zeros(size)
  for update in updates:
    # One worker's K consecutive micro-batches, each 1/K.
    touched = np.flatnonzero(update)
    np.testing.assert_array_equal(update[touched], np.full(len(touched),
                                                           1.0 / K))
    np.testing.assert_array_equal(touched, touched[0] + np.arange(K))
    task = touched[0] // MICRO_BATCHES
    assert touched[-1] // MICRO_BATCHES == task, touched
    if task not in recovered:
      assert touched[0] % K == 0, touched
    applied[touched] += 1
  assert applied.max() <= 1, 'applied twice: %s' % np.flatnonzero(applied > 1)
  expected = np.ones(size)
  if skipped_block is not None:
    expected[skipped_block:skipped_block + K] = 0
  for task in range(workers):
    part = slice(task * MICRO_BATCHES, (task + 1) * MICRO_BATCHES)
    if task in recovered:  # the dropped partial cycles, the last pending
      assert expected[part].sum() - applied[part].sum() <= (
          (K - 1) * (recovered[task] + 1))
    else:  # nothing lost
      np.testing.assert_array_equal(applied[part], expected[part])
  global_step, w, w2 = state[:3]
  if counts == 'updates':
    assert global_step == len(updates)
  else:  # A failed run may have counted its micro-step before the retry.
    assert size <= global_step <= size + sum(recovered.values())
  np.testing.assert_array_equal(w, -applied / K)
  np.testing.assert_array_equal(w2, -2 * applied / K)
  if table:
    np.testing.assert_array_equal(
        state[3], applied[:, None] * [[-2.0 / K, -6.0 / K]])


@pytest.mark.parametrize('monitored', [False, True],
                         ids=['session', 'monitored'])
@pytest.mark.parametrize('ps_tasks', [1, 2])
def test_each_worker_applies_its_own_micro_batches(cluster, use_tpu,
                                                   ps_tasks, monitored):
  for _ in range(REPEATS):
    with training.logged('PortCheckHook') as warned:
      updates, state, local_variables, recovered = _train(
          cluster, 2, ps_tasks, use_tpu, monitored, port_check=monitored)
    _check(updates, state, 2, recovered=recovered)
    assert not warned  # whole cycles, nothing after the train op
  # The state is the worker's own, and not saved by the chief.
  for task, variables in local_variables.items():
    assert variables
    for variable in variables:
      assert variable.device.endswith('/job:worker/task:%d' % task)


def test_the_port_check_names_each_worker_stopped_mid_cycle(cluster,
                                                            use_tpu):
  with training.logged('PortCheckHook') as warned:
    _train(cluster, 2, 1, use_tpu, True, port_check=True,
           micro_batches=K + 1)
  assert len(warned) == 2, warned  # each worker's own cycle
  for message in warned:
    assert 'accumulated 1 of its %d micro-batches' % K in message, warned


def test_a_recovered_session_drops_only_its_partial_cycle(cluster, use_tpu):
  """MonitoredTrainingSession re-creates a session after a preemption error
  (here injected before worker 1's 4th run) and re-runs the failed step;
  local variables start again: the 3 micro-batches of worker 1's partial
  cycle are dropped, its cycles then start at its 4th, nothing else lost or
  doubled, and its last micro-batch waits in the accumulator."""
  updates, state, _, recovered = _train(cluster, 2, 1, use_tpu,
                                        monitored=True, abort_at=4)
  assert recovered == {1: 1}
  _check(updates, state, 2, recovered=recovered)
  starts = sorted(np.flatnonzero(u)[0] for u in updates)
  assert starts == [0, 4, 8, 15, 19], starts


def test_global_step_counts_the_updates_of_every_worker(cluster, use_tpu):
  """global_step_counts='updates': each worker's update adds one, as each
  worker's step of the asynchronous large batch does."""
  for _ in range(REPEATS):
    updates, state, _, _ = _train(cluster, 2, 1, use_tpu, monitored=False,
                                  counts='updates')
    assert len(updates) == _size(2) // K
    _check(updates, state, 2, counts='updates')


def test_three_workers(cluster, use_tpu):
  for _ in range(REPEATS):
    updates, state, _, _ = _train(cluster, 3, 2, use_tpu, monitored=False)
    _check(updates, state, 3)


def test_partitioned_table_without_a_table_copy_per_worker(cluster, use_tpu):
  for _ in range(REPEATS):
    updates, state, local_variables, recovered = _train(
        cluster, 2, 2, use_tpu, monitored=True, table=True)
    _check(updates, state, 2, table=True, recovered=recovered)
  # The table's rows wait in a list on the worker's CPU (one per partition,
  # of no static shape): no table-sized variable.
  for task, variables in local_variables.items():
    lists = [v for v in variables if v.shape.rank is None]
    assert [v.op.name.split('/')[-1] for v in lists] == (
        ['GradientAccumulator'] * 2), [(v.name, v.shape) for v in variables]
    for listed in lists:
      assert listed.device.endswith('/job:worker/task:%d/device:CPU:0' % task)
    assert all(v.shape.num_elements() <= _size(2) for v in variables
               if v.shape.rank is not None), (
                   [(v.name, v.shape) for v in variables])


def test_each_worker_follows_its_own_schedule(cluster, use_tpu):
  """grad_steps a callable of the worker's own updates: 2, 4, 2, 4.

  Each update holds one worker's next block of that many micro-batches,
  each weighted 1/length; the table's rows with them.
  """
  def schedule(updates):
    return 2 + 2 * (updates % 2)

  blocks = [(0, 2), (2, 6), (6, 8), (8, 12)]  # of each worker's 12
  for _ in range(REPEATS):
    updates, state, _, _ = _train(cluster, 2, 2, use_tpu, monitored=False,
                                  table=True, grad_steps=schedule)
    expected = []
    for task in range(2):
      for start, end in blocks:
        update = np.zeros(_size(2))
        offset = task * MICRO_BATCHES
        update[offset + start:offset + end] = 1.0 / (end - start)
        expected.append(update)
    # The workers' updates interleave in any order; each worker's in turn.
    key = lambda u: tuple(np.flatnonzero(u))
    assert sorted(map(key, updates)) == sorted(map(key, expected))
    for task in range(2):
      own = [u for u in updates
             if np.flatnonzero(u)[0] // MICRO_BATCHES == task]
      np.testing.assert_array_equal(own, expected[4 * task:4 * task + 4])
    global_step, w, w2, table = state
    assert global_step == _size(2)
    applied = -np.sum(expected, axis=0)
    np.testing.assert_allclose(w, applied, rtol=1e-6)
    np.testing.assert_allclose(w2, 2 * applied, rtol=1e-6)
    np.testing.assert_allclose(table, applied[:, None] * [[2.0, 6.0]],
                               rtol=1e-6)


@pytest.mark.parametrize('policy', ['skip_cycle', 'skip_micro_batch'])
def test_nonfinite_policy_on_a_worker(cluster, use_tpu, policy):
  # Worker 1's micro-batch 13 (its second cycle's second) is NaN.
  for _ in range(REPEATS):
    updates, state, _, _ = _train(cluster, 2, 2, use_tpu, monitored=False,
                                  table=True, policy=policy, poison=13)
    if policy == 'skip_cycle':
      _check(updates, state, 2, table=True, skipped_block=12)
      continue
    # That cycle applies the mean of its 3 finite micro-batches.
    expected = np.full(_size(2), 1.0 / K)
    expected[12:16] = [1.0 / 3, 0, 1.0 / 3, 1.0 / 3]
    _check_weighted(updates, state, expected)


def _check_weighted(updates, state, expected):
  """Each update is one block of K micro-batches weighted as in `expected`
  (a weight per micro-batch), and so is the final state."""
  size = len(expected)
  assert len(updates) == size // K
  blocks = []
  for update in updates:
    block = np.flatnonzero(update)[0] // K * K
    in_block = (np.arange(size) >= block) & (np.arange(size) < block + K)
    np.testing.assert_allclose(update, np.where(in_block, expected, 0),
                               rtol=1e-6)
    blocks.append(block)
  assert sorted(blocks) == list(range(0, size, K))
  global_step, w, w2, table = state
  assert global_step == size
  np.testing.assert_allclose(w, -expected, rtol=1e-6)
  np.testing.assert_allclose(w2, -2 * expected, rtol=1e-6)
  np.testing.assert_allclose(table, -expected[:, None] * [[2.0, 6.0]],
                             rtol=1e-6)


def test_weighted_micro_batches_on_a_worker(cluster, use_tpu):
  # Each update: the weighted mean of one worker's K micro-batches.
  size = _size(2)
  weights = np.arange(size) % 3 + 1.0
  expected = np.zeros(size)
  for block in range(0, size, K):
    part = weights[block:block + K]
    expected[block:block + K] = part / part.sum()
  for _ in range(REPEATS):
    updates, state, _, _ = _train(cluster, 2, 2, use_tpu, monitored=False,
                                  table=True, weighted=True)
    _check_weighted(updates, state, expected)


TRAFFIC_CYCLES = 12  # traced cycles: the trace misses some steps' transfers


@pytest.mark.parametrize('wrap', [False, True], ids=['bare', 'wrapper'])
def test_accumulate_only_micro_steps_send_nothing_to_the_ps(cluster, wrap):
  worker_servers, _ = cluster
  size = 65536  # floats: 256 KiB
  with tf.Graph().as_default():
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device='/job:worker/task:0')
    with tf.compat.v1.device(setter), \
        tf.compat.v1.variable_scope('run%d' % next(_runs)):
      global_step = tf.compat.v1.train.create_global_step()
      w = tf.compat.v1.get_variable('w', [size],
                                    initializer=tf.compat.v1.ones_initializer())
      loss = tf.reduce_sum(w * w)
      opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
      if wrap:
        opt = deferred_grad.GradientAggregationOptimizer(opt, K)
      train_op = opt.minimize(loss, global_step=global_step)
    with tf.compat.v1.Session(worker_servers[0].target,
                              config=_session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      received = []
      for _ in range(TRAFFIC_CYCLES * K):
        metadata = tf.compat.v1.RunMetadata()
        session.run(train_op, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                    run_metadata=metadata)
        received.append(scripts.bytes_into_ps(metadata))
      final = session.run(w)
  # Each update is w -= 0.1 * 2w; the wrapper's gradient is the same for the
  # K micro-steps of a cycle. Every update was applied, whatever the trace
  # shows below (one missing would be 25% off).
  updates = TRAFFIC_CYCLES if wrap else TRAFFIC_CYCLES * K
  np.testing.assert_allclose(final, np.full(size, 0.8**updates), rtol=1e-6)
  # The trace misses some steps' transfers (0 or 1 bytes shown): on an idle
  # machine 2-6 of 16 bare steps, on one running the suite's other
  # processes up to 9 of 16 (and both apply steps of two cycles once). So
  # the gradient must show on one of the TRAFFIC_CYCLES apply steps (all
  # hidden, at odds of 0.6 each: 0.002) and on an eighth of the bare steps
  # (6 of 48, where about 20 show under load).
  gradient_bytes = size * 4 * 0.75  # the trace rounds 256 KiB to 0.2MB
  sends_gradient = [r >= gradient_bytes for r in received]
  if wrap:
    accumulate_only = [r for i, r in enumerate(received) if i % K != K - 1]
    assert max(accumulate_only) <= 16, received  # a predicate, a step's +1
    assert any(sends_gradient[K - 1::K]), received  # the apply steps
  else:
    assert sum(sends_gradient) >= len(received) // 8, received


@pytest.mark.parametrize('table', [False, True], ids=['dense', 'table'])
def test_a_session_without_the_local_initializer_is_told_to_run_it(
    cluster, use_tpu, table):
  """A raw Session that initializes only the global variables.

  The worker's accumulators and counters are local variables: its first
  micro-step fails, naming local_variables_initializer(), and after running
  it the worker trains.
  """
  workers, _ = cluster
  run = next(_runs)
  with tf.Graph().as_default():
    built = _build(run, 0, 1, PS, use_tpu, table)
    with tf.compat.v1.Session(workers[0].target,
                              config=_session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r'local variables of the worker[\s\S]*run '
                         r'tf.compat.v1.local_variables_initializer\(\)'):
        session.run(built['train_op'], {built['index']: 0})
      session.run(tf.compat.v1.local_variables_initializer())
      for index in range(K):
        session.run(built['train_op'], {built['index']: index})
      step, w, _ = session.run(built['state'][:3])
  assert step == K
  np.testing.assert_allclose(w[:K], -np.ones(K) / K, rtol=1e-6)


@pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')
def test_estimator_with_chief_worker_and_two_ps_processes(tmp_path):
  """train_and_evaluate with TF_CONFIG: chief, worker, 2 ps (processes).

  A dense part and an embedding table partitioned over both ps; Estimator
  builds the graph under replica_device_setter itself.
  """
  tasks = [('chief', 0), ('worker', 0), ('ps', 0), ('ps', 1)]
  cluster = {}
  for (task_type, _), port in zip(tasks, scripts.free_ports(len(tasks))):
    cluster.setdefault(task_type, []).append('127.0.0.1:%d' % port)
  output = str(tmp_path / 'state.npz')
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'ps_estimator_worker.py')
  processes = []
  try:
    for task_type, index in tasks:
      env = dict(os.environ, TF_CONFIG=json.dumps({
          'cluster': cluster, 'task': {'type': task_type, 'index': index}}))
      processes.append(subprocess.Popen(
          [sys.executable, script, output], env=env,
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
          universal_newlines=True))
    for trainer in processes[:2]:  # ps tasks serve until ended
      log = trainer.communicate(timeout=180)[0]
      assert trainer.returncode == 0, log[-3000:]
  finally:
    for process in processes:  # only the processes started here, by PID
      if process.poll() is None:
        process.kill()
        process.wait()
  state = np.load(output)
  _check(state['updates'], [state['global_step'], state['w'], state['w2'],
                            state['table']], 2, table=True)
