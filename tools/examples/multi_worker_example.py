r"""MultiWorkerMirroredStrategy with deferred_grad: workers in lockstep.

Run as a script it starts two worker processes on 127.0.0.1 (itself, with
--task=0 and --task=1 and a TF_CONFIG each), each training its half of
every micro-batch with a raw Session, waits for both (bounded by
--timeout), and prints how far each worker's weights are from one process
training the large batch with the bare optimizer.

Under MultiWorkerMirroredStrategy (collective all-reduce between worker
processes, graph mode) the GPU path all-reduces only on apply steps: K
micro-steps cost one all-reduce instead of K. Micro-steps that run no
collective let the workers' collective step ids drift apart, and the next
apply step's all-reduce could hang; two helpers keep the workers in
lockstep, as `worker()` below does: `deferred_grad.collective_barrier(
strategy)` (run once, first) and `deferred_grad.collective_run_options()`
(given to every run of the train op; one graph key, each run bounded by
600 s, `timeout_seconds=` changes it). Without the options the first apply
step fails with `InternalError: Failed to get CollectiveExecutor` under
disable_eager_execution(); without the barrier runs hung at the first
apply step.

The rules, each with what breaking it does:

- The runs of the train op (and the barrier) take the options, the same
  number on every worker. A worker that made one such run more or fewer
  waits at the next apply step: both fail with `DeadlineExceededError:
  Operation timed out` when the options' bound runs out, instead of hanging.
- Other runs (reading global_step or anything else for logging, evaluation)
  take no options; they may differ between workers. With the options each
  such run moves that worker's collective step ids on, and the next apply
  step times out as above. (Hooks are safe: the wrapper caches a plain read
  of the global step under a multi-worker strategy, where TensorFlow's
  cached read ran a collective broadcast on every fetch.)
- MonitoredTrainingSession: `is_chief=True` on every worker (each runs the
  collective initializers), the same barrier and options for the train op;
  hooks such as StopAtStepHook are fine. With is_chief=False a worker waits
  for variables no one initializes.
- One checkpoint_dir for all workers is fine, but only one worker writes
  it: give the others `save_checkpoint_steps=None, save_checkpoint_secs=None`.
  Two workers writing one directory race on its temporary files.
- Checkpoints: each worker holds its own partial sum mid-cycle and the
  chief saves only its own, so a mid-cycle checkpoint (time-based saving
  usually writes one) cannot resume that cycle exactly. A session that
  starts mid-cycle logs `WARNING: GradientAggregationOptimizer: this
  session started mid-cycle, at micro-step ...`, and every worker drops
  that cycle alike (the micro-batches before the restart and after it, up
  to the cycle's end: its apply step only resets); training goes on from
  the next cycle. At a cycle boundary (`save_checkpoint(s)_steps` and
  max_steps / last_step multiples of grad_steps) resume is exact.
- A `grad_steps` schedule (tools/examples/schedule_example.py) must give
  the same length on every worker: a constant or a callable of the updates
  applied does. Workers whose cycles differ fail at their apply steps.
- Divide each replica's loss by `strategy.num_replicas_in_sync`: the
  all-reduce sums.

Estimator with `train_and_evaluate` (TensorFlow 2.15) needs neither helper:
it all-reduces its loss every step, which keeps the workers in lockstep.
Give TF_CONFIG a chief and worker tasks, the model_fn the plain wrapper (its
loss not divided by the replicas: Estimator scales tf.compat.v1.train
optimizers), `RunConfig(train_distribute=tf.compat.v1.distribute.
experimental.MultiWorkerMirroredStrategy(), model_dir=<the same on every
task>)`, and `save_summary_steps` > 0: under this strategy TensorFlow adds
the chief's CheckpointSaverHook only when summaries are saved too, so with
`save_summary_steps=None` the job writes no checkpoint (it also replaces
save_checkpoints_secs with 1000 steps). Each worker's input_fn yields its
own micro-batches (it may take an input_context and shard by
`input_context.input_pipeline_id`).

Accumulate-only micro-steps run no collective (tested: executed
Collective* ops per micro-step, from a full trace, are 0 on them). Tested
with two worker processes, both behaviours (tests/test_multi_worker.py:
raw Session, a worker starting late, MonitoredTrainingSession, a hook-style
read on one worker, StopAtStepHook, stop and resume, a nonfinite_policy,
Estimator + train_and_evaluate); every worker pair runs under a watchdog
that prints both workers' Python stacks on a hang. `tools/soak 50
workers_train_like` trained each recipe 50 times per configuration (both
TensorFlow versions, both behaviours): 1200 trainings, every one equal to
the large batch, no failure, no hang, 23 minutes on 2 cores.
`tools/benchmark --suites=multiworker` times an effective batch on 2
workers: at K=4 the wrapper takes 0.50x and at K=16 0.26x the time of K
bare steps with K all-reduces (84 MB of gradients over loopback).

  python tools/examples/multi_worker_example.py --grad_steps=4
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import flags
import numpy as np
import tensorflow as tf

import deferred_grad
from local_cluster import free_addresses
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('updates', 5, 'Number of updates.')
flags.DEFINE_integer('task', None, 'Set in the worker processes only.')
flags.DEFINE_string('output', None, 'A worker writes its weights here.')
flags.DEFINE_integer('timeout', 300, 'Seconds the workers may take.')

WORKERS, ROWS = 2, 8
TRUE_W = np.random.RandomState(0).randn(4, 1).astype(np.float32)


def micro_batches(micro_steps):
  """[micro-step, worker, rows, ...]: the same data in every process."""
  x = np.random.RandomState(1).randn(micro_steps, WORKERS, ROWS, 4).astype(
      np.float32)
  return x, x.dot(TRUE_W).astype(np.float32)


def model(x, y):
  w = tf.compat.v1.get_variable('w', [4, 1],
                                initializer=tf.zeros_initializer())
  return w, tf.reduce_mean(tf.square(tf.matmul(x, w) - y))


def worker(task):
  """One worker: its half of every micro-batch, in lockstep with the other."""
  strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()
  config = tf.compat.v1.ConfigProto()
  strategy.configure(session_config=config)  # reads TF_CONFIG
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  server = tf.distribute.Server(resolver.cluster_spec(), job_name='worker',
                                task_index=task, config=config)
  x_data, y_data = micro_batches(FLAGS.updates * FLAGS.grad_steps)
  with strategy.scope():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), FLAGS.grad_steps)
    weights = []

    def replica_step():
      w, loss = model(x, y)
      weights.append(w)
      return optimizer.minimize(loss / strategy.num_replicas_in_sync,
                                global_step=global_step)

    train_op = strategy.group(
        strategy.extended.call_for_each_replica(replica_step))
    barrier = deferred_grad.collective_barrier(strategy)
  options = deferred_grad.collective_run_options()
  with tf.compat.v1.Session(server.target, config=config) as session:
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(barrier, options=options)  # first: a collective
    for step in range(len(x_data)):  # the same count on every worker
      session.run(train_op, {x: x_data[step, task], y: y_data[step, task]},
                  options=options)
    np.save(FLAGS.output, session.run(weights[0]))


def large_batch():
  """One process, the bare optimizer, batches of grad_steps * WORKERS."""
  x_data, y_data = micro_batches(FLAGS.updates * FLAGS.grad_steps)
  batch = FLAGS.grad_steps * WORKERS * ROWS
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    w, loss = model(x, y)
    train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for xb, yb in zip(x_data.reshape(-1, batch, 4),
                        y_data.reshape(-1, batch, 1)):
        session.run(train_op, {x: xb, y: yb})
      return session.run(w)


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  if FLAGS.task is not None:
    return worker(FLAGS.task)
  cluster = {'worker': free_addresses(WORKERS)}
  directory = tempfile.mkdtemp()
  outputs = [os.path.join(directory, 'worker%d.npy' % t)
             for t in range(WORKERS)]
  processes = []
  for task in range(WORKERS):
    env = dict(os.environ, TF_CONFIG=json.dumps(
        {'cluster': cluster, 'task': {'type': 'worker', 'index': task}}))
    processes.append(subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--task=%d' % task,
         '--output=' + outputs[task], '--grad_steps=%d' % FLAGS.grad_steps,
         '--updates=%d' % FLAGS.updates], env=env))
  try:
    codes = [p.wait(timeout=FLAGS.timeout) for p in processes]
  finally:
    for p in processes:  # only the processes started here, by PID
      if p.poll() is None:
        p.kill()
  if any(codes):
    sys.exit('a worker failed: exit codes %s' % codes)
  expected = large_batch()
  for task, output in enumerate(outputs):
    print('worker %d: largest weight difference from the large batch: %.3g'
          % (task, np.abs(np.load(output) - expected).max()))


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
