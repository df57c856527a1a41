"""Suite `multiworker`: time per effective batch on two worker processes.

K micro-batches of 32 per worker on 2 worker processes on 127.0.0.1 under
MultiWorkerMirroredStrategy, for K = 1, 4, 16: the wrapper (one all-reduce
per K micro-steps) against the bare optimizer (K steps, K all-reduces); a
1024-4096-4096 MLP, 84 MB of gradients.

Results (two processes on a 2-core machine over loopback gRPC, ms per
effective batch): K=1 bare 358, wrapper 386 (1.08; K = 1 passes through);
K=4 1622 and 809 (0.50); K=16 5917 and 1509 (0.26). The saving grows with K
while communication dominates; between machines it is larger still.

Then a table (--multiworker_table_rows x 64 float32, 256 ids a micro-step,
SGD, K = 4): each worker's median peak RSS over runs with the wrapper (and
--baseline's) against the bare optimizer's, and their difference as a share
of one table (target 10%: a table's accumulator is a list of the rows looked
up on every worker).

Results (2026-12-03, TensorFlow 2.21, 2 cores; `tools/benchmark
--suites=multiworker --multiworker_grad_steps= --multiworker_table_rows=4000000
--baseline=1cd1d54`; a 977 MB table; peak RSS MB of 3 runs, median first):

  worker 0: bare 6546 (6546-6547); wrapper 6564 (6561-6566): +18, 1.8% of
            the table; 1cd1d54 (a table-sized accumulator and a host queue
            of ids) 10612: +4066
  worker 1: bare 3975 (3787-4042); wrapper 4072 (3985-4174): +97, 9.9%;
            1cd1d54 7023 (6747-7576): +3048

The non-chief worker's peak varies by about 250 MB (a quarter of the table)
between runs of one variant; its median difference sits at the target.
"""

import json
import os
import subprocess
import time

from benchmarks import cluster
from benchmarks import common
from benchmarks.sparse import DIM  # the sparse suite's table and lookups
from benchmarks.sparse import IDS_PER_STEP

import peak_memory  # tools/peak_memory.py

FLAGS = common.FLAGS
common.flags.DEFINE_integer(
    'multiworker_table_rows', 1000000,
    'Multiworker suite: rows of the table whose per-worker RSS is measured '
    '(0: none).')
common.flags.DEFINE_integer(
    'multiworker_table_repeats', 3,
    'Multiworker suite: runs of each table variant (a worker\'s median peak '
    'RSS is reported: a non-chief worker\'s varies by up to a table from '
    'run to run).')
common.flags.DEFINE_list(
    'multiworker_grad_steps', ['1', '4', '16'],
    'Multiworker suite: the K of the MLP rows (empty: none).')

WIDTHS = [1024, 4096, 4096]  # 21M parameters: 84 MB all-reduced
MICRO_BATCH = 32
TABLE_GRAD_STEPS = 4


def _table_loss(tf, rows, seed):
  """An embedding table's loss on 256 ids drawn in the graph."""
  table = tf.compat.v1.get_variable(
      'table', [rows, DIM], initializer=tf.compat.v1.zeros_initializer())
  ids = tf.random.uniform([IDS_PER_STEP], 0, rows, tf.int64, seed=seed)
  return tf.reduce_sum(tf.square(tf.nn.embedding_lookup(table, ids) - 1.0))


def child(spec):
  """One worker, 'variant,grad_steps,batches[,table rows]': prints the time
  per batch and the worker's RSS."""
  variant, grad_steps, batches = spec.split(',')[:3]
  grad_steps, batches = int(grad_steps), int(batches)
  rows = int(spec.split(',')[3]) if spec.count(',') == 3 else 0
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
      if rows:
        loss = _table_loss(tf, rows, resolver.task_id + 1)
      else:
        loss, _ = common.mlp_loss(tf, MICRO_BATCH, WIDTHS,
                                  seed=resolver.task_id)
      opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
      if variant != 'bare':  # 'wrapper', or 'baseline' (--baseline's)
        module = common.deferred_grad_modules()[
            'baseline' if variant == 'baseline' else '']
        opt = module.GradientAggregationOptimizer(opt, grad_steps)
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
  print(json.dumps({'seconds_per_effective_batch': common.median(times),
                    'peak_rss_mb': peak_memory.peak_rss_mb(),
                    'rss_mb': peak_memory.current_rss_mb()}))


def _run_workers(spec):
  """Both workers of one configuration: each one's JSON line."""
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
  return [json.loads(o.strip().splitlines()[-1]) for o in outputs]


def _seconds(spec):
  """The slower worker's seconds per effective batch."""
  return max(w['seconds_per_effective_batch'] for w in _run_workers(spec))


def run():
  results = []
  rows = []
  for grad_steps in [int(k) for k in FLAGS.multiworker_grad_steps]:
    measured = {}
    for variant in ['bare', 'wrapper']:
      spec = '%s,%d,%d' % (variant, grad_steps, max(3, 48 // grad_steps))
      measured[variant] = _seconds(spec) * 1e3
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
  table_rows = FLAGS.multiworker_table_rows
  if table_rows:
    workers = {}
    variants = ['bare', 'wrapper']
    if FLAGS.baseline:
      common.deferred_grad_modules()  # unpacks it, for the workers
      variants.append('baseline')
    for variant in variants:
      runs = [_run_workers('%s,%d,%d,%d' % (
          variant, TABLE_GRAD_STEPS, 8, table_rows))
              for _ in range(FLAGS.multiworker_table_repeats)]
      workers[variant] = [
          {'peak_rss_mb': common.median([r[i]['peak_rss_mb'] for r in runs]),
           'runs': [r[i] for r in runs]} for i in range(2)]
    table_mb = table_rows * DIM * 4 / 2.0**20
    lines = []
    for index in range(2):
      bare = workers['bare'][index]['peak_rss_mb']
      for variant in variants[1:]:
        peak = workers[variant][index]['peak_rss_mb']
        lines.append(['%d' % index, variant, '{:,}'.format(table_rows),
                      '%.0f' % table_mb, '%.0f / %.0f' % (peak, bare),
                      '%+.0f (%.1f%% of the table)' % (
                          peak - bare, 100 * (peak - bare) / table_mb)])
    results.append({'table_rows': table_rows, 'workers': workers})
    print('multiworker table: %s' % workers, flush=True)
    table += '\n\n' + common.markdown(
        ['worker', 'variant', 'table rows x 64', 'table (MB)',
         'peak RSS, variant / bare (MB)', 'variant - bare (MB)'], lines)
  return {'multiworker': results}, table
