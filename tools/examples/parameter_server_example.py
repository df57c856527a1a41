r"""Parameter servers with deferred_grad: each worker accumulates its own.

Run as a script it starts one ps and two worker servers on 127.0.0.1 in this
process, trains from two worker threads with MonitoredTrainingSession under
`replica_device_setter` (between-graph replication, one graph per worker),
and prints the shared global_step and the loss.

No new keyword: when the variables live on another job than the ops of
`apply_gradients` (replica_device_setter scripts, Estimators with `ps`
tasks in TF_CONFIG and no train_distribute), each worker keeps its
accumulators and its cycle counter on its own device, as local variables
(LOCAL_VARIABLES, as SyncReplicasOptimizer keeps its local step). A worker
decides its cycle on its own counter and hands the wrapped optimizer the
mean of its own K micro-batches once per K of its micro-steps; the wrapped
optimizer applies it to the ps as it would a bare step's gradient.

- Semantics: asynchronous, like the bare optimizer. Each update is the mean
  of one worker's K consecutive micro-batches, applied when that worker ends
  its cycle; `global_step` is shared and counts every worker's micro-steps
  (an atomic increment). Tested with 2 and 3 workers and 1 and 2 ps, both
  paths, Session and MonitoredTrainingSession: every update holds exactly K
  consecutive micro-batches of one worker, none lost or applied twice
  (tests/test_parameter_servers.py); also with a table partitioned over 2
  ps, a nonfinite_policy skipping one worker's micro-batch or cycle,
  micro_batch_weight (each update the weighted mean of one worker's K), and
  (TensorFlow 2.15) Estimator + train_and_evaluate with chief, worker and
  two ps processes. `tools/soak 10 'each_worker or table or three_workers
  or policy_on or weighted or recovered'` ran each 30 times per
  configuration with no failure.
- SyncReplicasOptimizer does not compose with the wrapper, in either order
  (it aggregates round by round and drops stale gradients, so cycles would
  not hold together): refused at graph build. For synchronous training
  across workers use MultiWorkerMirroredStrategy (multi_worker_example.py).
  `tf.compat.v1.distribute.experimental.ParameterServerStrategy` with ps
  tasks is refused with a RuntimeError: it places every variable, the
  accumulators included, on the ps, shared by all workers.
- Local variables: MonitoredTrainingSession and Estimator initialize them;
  with a raw Session run `tf.compat.v1.local_variables_initializer()` on
  every worker. A session that did not fails at its first micro-step with
  an InvalidArgumentError that says so.
- Checkpoints and restarts: the chief cannot save another worker's
  accumulators. A restart loses that worker's partial cycle (at most K - 1
  micro-batches), as with SyncReplicasOptimizer, and its cycles start where
  it resumed; MonitoredTrainingSession recovering from a preemption is such
  a restart.
- Embedding tables (sparse gradients, also partitioned over several ps): a
  worker keeps no table-sized copy. Each micro-step appends its looked-up
  ids and rows to a list, a local variable on the worker's CPU; the apply
  step hands on an IndexedSlices of the touched rows.

Traffic into the ps (`tools/benchmark --suites=parameter_servers`, 5 MB of
gradients, SGD): the bare optimizer sends 5.25 MB per micro-step; the
wrapper sends 9 bytes on an accumulate-only micro-step (the cycle predicate
and the step's increment) and the gradient once per cycle: 1.31 MB per
micro-step at K=4, 0.33 MB at K=16.

  python tools/examples/parameter_server_example.py --grad_steps=4
"""

import os
import threading

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
from local_cluster import free_addresses
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('updates', 10, 'Updates per worker.')

WORKERS, ROWS = 2, 16
TRUE_W = np.random.RandomState(0).randn(4, 1).astype(np.float32)


def worker(cluster, server, task, results, chief_ready):
  """One worker's graph and training loop, as a worker process would run."""
  rng = np.random.RandomState(task)
  with tf.Graph().as_default():
    with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
        cluster=cluster, worker_device='/job:worker/task:%d' % task)):
      global_step = tf.compat.v1.train.get_or_create_global_step()
      x = tf.compat.v1.placeholder(tf.float32, [None, 4])
      y = tf.compat.v1.placeholder(tf.float32, [None, 1])
      w = tf.compat.v1.get_variable('w', [4, 1],
                                    initializer=tf.zeros_initializer())
      loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
      optimizer = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.AdagradOptimizer(0.5), FLAGS.grad_steps)
      train_op = optimizer.minimize(loss, global_step=global_step)
    last_step = WORKERS * FLAGS.updates * FLAGS.grad_steps
    losses = []
    if task:
      # A non-chief session polls every 30 s until the chief has initialized
      # the variables; in one process we can tell it when instead.
      assert chief_ready.wait(timeout=120), 'the chief did not start'
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target, is_chief=task == 0, log_step_count_steps=None,
        hooks=[tf.compat.v1.train.StopAtStepHook(last_step=last_step)]
    ) as session:
      chief_ready.set()
      while not session.should_stop():
        batch = rng.randn(ROWS, 4).astype(np.float32)
        losses.append(session.run([train_op, loss],
                                  {x: batch, y: batch.dot(TRUE_W)})[1])
    results[task] = losses


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  addresses = free_addresses(1 + WORKERS)
  cluster = tf.train.ClusterSpec({'ps': addresses[:1],
                                  'worker': addresses[1:]})
  tf.distribute.Server(cluster, 'ps', 0)
  servers = [tf.distribute.Server(cluster, 'worker', task)
             for task in range(WORKERS)]
  results = {}
  chief_ready = threading.Event()
  threads = [threading.Thread(target=worker,
                              args=(cluster, servers[task], task, results,
                                    chief_ready))
             for task in range(WORKERS)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=300)
  assert sorted(results) == list(range(WORKERS)), 'a worker did not finish'
  with tf.Graph().as_default(), tf.compat.v1.device(
      tf.compat.v1.train.replica_device_setter(cluster=cluster)):
    step = tf.compat.v1.train.get_or_create_global_step()
    with tf.compat.v1.Session(servers[0].target) as session:
      print('global_step on the ps: %d (every worker\'s micro-steps; the '
          'workers run on asynchronously past last_step by a step or so)' %
          session.run(step))
  first = np.mean([results[t][0] for t in results])
  last = np.mean([np.mean(results[t][-FLAGS.grad_steps:]) for t in results])
  print('loss went from %.5f to %.5f' % (first, last))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
