"""Suite `multiworker`: time per effective batch on two worker processes.

K micro-batches of 32 per worker on 2 worker processes on 127.0.0.1 under
MultiWorkerMirroredStrategy, for K = 1, 4, 16: the wrapper (one all-reduce
per K micro-steps) against the bare optimizer (K steps, K all-reduces); a
1024-4096-4096 MLP, 84 MB of gradients.

Results (two processes on a 2-core machine over loopback gRPC, ms per
effective batch): K=1 bare 358, wrapper 386 (1.08; K = 1 passes through);
K=4 1622 and 809 (0.50); K=16 5917 and 1509 (0.26). The saving grows with K
while communication dominates; between machines it is larger still.
"""

import json
import os
import subprocess
import time

from benchmarks import cluster
from benchmarks import common

WIDTHS = [1024, 4096, 4096]  # 21M parameters: 84 MB all-reduced
MICRO_BATCH = 32


def child(spec):
  """One worker, 'variant,grad_steps,batches': prints the time per batch."""
  variant, grad_steps, batches = spec.split(',')
  grad_steps, batches = int(grad_steps), int(batches)
  tf = common.import_tf()
  import deferred_grad  # pylint: disable=g-import-not-at-top
  strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()
  config = tf.compat.v1.ConfigProto()
  strategy.configure(session_config=config)
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  server = tf.distribute.Server(resolver.cluster_spec(), job_name='worker',
                                task_index=resolver.task_id, config=config)
  with tf.Graph().as_default(), strategy.scope():
    global_step = tf.compat.v1.train.get_or_create_global_step()

    def replica_step():
      loss, _ = common.mlp_loss(tf, MICRO_BATCH, WIDTHS,
                                seed=resolver.task_id)
      opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
      if variant == 'wrapper':
        opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps)
      return opt.minimize(loss / strategy.num_replicas_in_sync,
                          global_step=global_step)

    train_op = strategy.group(
        strategy.extended.call_for_each_replica(replica_step))
    barrier = deferred_grad.collective_barrier(strategy)
    options = deferred_grad.collective_run_options()
    session = tf.compat.v1.Session(server.target, config=config)
    session.run(tf.compat.v1.global_variables_initializer())
    session.run(barrier, options=options)
    times = []
    for batch in range(batches + 1):  # the first is warm-up
      start = time.perf_counter()
      for _ in range(grad_steps):
        session.run(train_op, options=options)
      if batch:
        times.append(time.perf_counter() - start)
  print(json.dumps({'seconds_per_effective_batch': common.median(times)}))


def _run_workers(spec):
  """Both workers of one configuration; the slower one's seconds per batch."""
  addresses = {'worker': ['127.0.0.1:%d' % p for p in cluster.free_ports(2)]}
  processes = [
      subprocess.Popen(
          common.child_command('multiworker', spec),
          env=dict(os.environ, TF_CONFIG=json.dumps(
              {'cluster': addresses,
               'task': {'type': 'worker', 'index': index}})),
          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
          universal_newlines=True) for index in range(2)]
  try:
    outputs = [p.communicate(timeout=600)[0] for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
  return max(json.loads(o.strip().splitlines()[-1])
             ['seconds_per_effective_batch'] for o in outputs)


def run():
  results = []
  rows = []
  for grad_steps in [1, 4, 16]:
    measured = {}
    for variant in ['bare', 'wrapper']:
      spec = '%s,%d,%d' % (variant, grad_steps, max(3, 48 // grad_steps))
      measured[variant] = _run_workers(spec) * 1e3
    result = {'grad_steps': grad_steps, 'bare_ms': measured['bare'],
              'wrapper_ms': measured['wrapper'],
              'ratio': measured['wrapper'] / measured['bare']}
    results.append(result)
    print('multiworker: %s' % result, flush=True)
    rows.append([str(grad_steps), '%.0f' % result['bare_ms'],
                 '%.0f' % result['wrapper_ms'], '%.2f' % result['ratio']])
  table = common.markdown(
      ['K', 'bare: K steps, K all-reduces (ms)',
       'wrapper: K micro-steps, 1 all-reduce (ms)', 'ratio'], rows)
  return {'multiworker': results}, table
