r"""Benchmarks of deferred_grad, run on demand (not in CI).

Writes the results as JSON (--output) and Markdown tables (--output with .md).

  tools/benchmark --suites=sparse
  tools/benchmark --suites=step,memory,keras,sparse --output=/tmp/bench.json

Suites:
  step    time of one micro-step through the wrapper (accumulate only)
          against the bare optimizer's step at the same micro-batch, and of
          a whole cycle against grad_steps bare steps; SGD and Adam; a 3x1024
          MLP and a model of 200 64x64 variables. Side by side in one process,
          interleaved rounds, medians.
  memory  peak RSS of effective batch B as one batch (bare optimizer) and as
          K micro-batches (wrapper), and of a bare micro-batch step; each in
          its own process. The wrapper's extra memory over the bare
          micro-batch step is given in parameter bytes.
  keras   the step suite's micro-step comparison for Keras 3's
          `gradient_accumulation_steps` (where tf.keras is Keras 3).
  multiworker  time per effective batch (K micro-batches of 32 per worker) on
          2 worker processes on 127.0.0.1 under MultiWorkerMirroredStrategy,
          for K = 1, 4, 16: the wrapper (one all-reduce per K micro-steps)
          against the bare optimizer (K steps, K all-reduces); a
          1024-4096-4096 MLP, 84 MB of gradients.
  sparse  accumulate-only micro-step for embedding tables of 10k, 100k and 1M
          rows by 64, 256 ids per micro-step: sparse (scatter-add)
          accumulation against the original's dense accumulation and against
          the bare optimizer's step.
"""

import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

import peak_memory  # tools/peak_memory.py, beside this script

FLAGS = flags.FLAGS
flags.DEFINE_list('suites', ['step', 'memory', 'keras', 'sparse',
                             'multiworker'],
                  'Which suites to run.')
flags.DEFINE_string('output', 'benchmark.json',
                    'JSON results; the Markdown tables go beside it (.md).')
flags.DEFINE_integer('rounds', 15, 'Interleaved timing rounds per variant.')
flags.DEFINE_integer('steps_per_round', 10, 'Timed steps per round.')
flags.DEFINE_integer('grad_steps', 8, 'K, micro-batches per update.')
flags.DEFINE_list('table_rows', ['10000', '100000', '1000000'],
                  'Sparse suite: embedding table sizes.')
# Internal: one memory measurement in a child process.
flags.DEFINE_string('memory_child', None, 'Internal.')
flags.DEFINE_bool('keras_child', False, 'Internal.')
flags.DEFINE_string('multiworker_child', None, 'Internal.')


def _tf():
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.compat.v1.disable_eager_execution()
  return tf


def _median(values):
  values = sorted(values)
  middle = len(values) // 2
  if len(values) % 2:
    return values[middle]
  return (values[middle - 1] + values[middle]) / 2


def time_interleaved(variants, rounds=None, steps=None):
  """Median seconds per call of each variant, measured in interleaved rounds.

  Args:
    variants: dict name -> zero-argument callable running one step.
    rounds, steps: rounds, and calls timed per round (default: the flags).

  Returns:
    dict name -> median over rounds of the mean seconds per call.
  """
  rounds = rounds or FLAGS.rounds
  steps = steps or FLAGS.steps_per_round
  for run_step in variants.values():  # warm-up
    for _ in range(steps):
      run_step()
  per_round = {name: [] for name in variants}
  for _ in range(rounds):
    for name, run_step in variants.items():
      start = time.perf_counter()
      for _ in range(steps):
        run_step()
      per_round[name].append((time.perf_counter() - start) / steps)
  return {name: _median(times) for name, times in per_round.items()}


def _markdown(header, rows):
  lines = ['| ' + ' | '.join(header) + ' |',
           '|' + '|'.join('---:' if i else '---' for i in range(len(header)))
           + '|']
  lines += ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in rows]
  return '\n'.join(lines)


# ------------------------------------------------------------------ models --

def mlp_loss(tf, batch, widths, seed=0):
  """A tanh MLP on a fixed random batch; returns (loss, parameter count)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(seed)
  x = tf.constant(rng.randn(batch, widths[0]).astype(np.float32))
  hidden = x
  parameters = 0
  for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
    w = tf.compat.v1.get_variable(
        'w%d' % i, [fan_in, fan_out],
        initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
    b = tf.compat.v1.get_variable('b%d' % i, [fan_out],
                                  initializer=tf.compat.v1.zeros_initializer())
    hidden = tf.tanh(tf.matmul(hidden, w) + b)
    parameters += fan_in * fan_out + fan_out
  return tf.reduce_mean(tf.square(hidden)), parameters


def conv_loss(tf, batch, seed=0):
  """The demo's conv net on a fixed random batch: activation-heavy."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(seed)
  images = tf.constant(rng.randn(batch, 28, 28, 1).astype(np.float32))
  labels = tf.constant(rng.randint(0, 10, size=batch).astype(np.int64))
  init = tf.compat.v1.glorot_uniform_initializer(seed=seed)
  shapes = {'conv1': [5, 5, 1, 32], 'conv2': [3, 3, 32, 32],
            'dense': [7 * 7 * 32, 10]}
  weights = {name: tf.compat.v1.get_variable(name, shape, initializer=init)
             for name, shape in shapes.items()}
  net = tf.nn.relu(tf.nn.conv2d(images, weights['conv1'], 1, 'SAME'))
  net = tf.nn.max_pool2d(net, 2, 2, 'SAME')
  net = tf.nn.relu(tf.nn.conv2d(net, weights['conv2'], 1, 'SAME'))
  net = tf.nn.max_pool2d(net, 2, 2, 'SAME')
  logits = tf.matmul(tf.reshape(net, [-1, 7 * 7 * 32]), weights['dense'])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  return loss, sum(int(np.prod(s)) for s in shapes.values())


# name -> (description, loss builder taking (tf, batch)), and micro-batch.
STEP_MODELS = {
    'mlp': ('3x1024 MLP', lambda tf, b: mlp_loss(tf, b, [1024] * 4), 64),
    'many': ('200 variables of 64x64',
             lambda tf, b: mlp_loss(tf, b, [64] * 201), 64),
}
MEMORY_MODELS = {
    'conv': ('conv net (activation-heavy)', conv_loss, 4096),
    'wide': ('1024-4096-4096-4096 MLP (parameter-heavy)',
             lambda tf, b: mlp_loss(tf, b, [1024, 4096, 4096, 4096]), 4096),
}
OPTIMIZERS = {
    'SGD': lambda tf: tf.compat.v1.train.GradientDescentOptimizer(0.01),
    'Adam': lambda tf: tf.compat.v1.train.AdamOptimizer(0.001),
}


def _training_session(tf, build_loss, batch, optimizer, grad_steps):
  """A session and its train op; grad_steps None means the bare optimizer."""
  import deferred_grad  # pylint: disable=g-import-not-at-top
  graph = tf.Graph()
  with graph.as_default():
    loss, parameters = build_loss(tf, batch)
    opt = OPTIMIZERS[optimizer](tf)
    if grad_steps is not None:
      opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps)
    train_op = opt.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    session = tf.compat.v1.Session(graph=graph)
    session.run(tf.compat.v1.global_variables_initializer())
  return session, train_op, parameters


# -------------------------------------------------------------------- step --

def step_suite():
  tf = _tf()
  grad_steps = FLAGS.grad_steps
  results = []
  rows = []
  for model, (description, build_loss, micro_batch) in STEP_MODELS.items():
    for optimizer in OPTIMIZERS:
      sessions = {
          'bare': _training_session(tf, build_loss, micro_batch, optimizer,
                                    None),
          # So large a grad_steps that every step only accumulates.
          'accumulate': _training_session(tf, build_loss, micro_batch,
                                          optimizer, 10**9),
          'cycle': _training_session(tf, build_loss, micro_batch, optimizer,
                                     grad_steps),
      }
      variants = {name: (lambda s=s, op=op: s.run(op))
                  for name, (s, op, _) in sessions.items()}
      # Whole cycles in every round, for the 'cycle' variant.
      times = time_interleaved(variants, steps=grad_steps)
      for session, _, _ in sessions.values():
        session.close()
      result = {
          'model': description, 'optimizer': optimizer,
          'micro_batch': micro_batch, 'grad_steps': grad_steps,
          'bare_ms': times['bare'] * 1e3,
          'accumulate_ms': times['accumulate'] * 1e3,
          'cycle_ms': times['cycle'] * grad_steps * 1e3,
      }
      result['accumulate_ratio'] = times['accumulate'] / times['bare']
      result['cycle_ratio'] = times['cycle'] / times['bare']
      results.append(result)
      print('step: %s' % result, flush=True)
      rows.append([
          description, optimizer, '%.3f' % result['bare_ms'],
          '%.3f' % result['accumulate_ms'],
          '%.3f' % result['accumulate_ratio'],
          '%.2f' % result['cycle_ms'],
          '%.2f' % (grad_steps * result['bare_ms']),
          '%.3f' % result['cycle_ratio']])
  table = _markdown(
      ['model', 'optimizer', 'bare step (ms)', 'accumulate-only step (ms)',
       'ratio', 'cycle of %d (ms)' % grad_steps,
       '%d bare steps (ms)' % grad_steps, 'ratio'], rows)
  return {'step': results}, table


# ------------------------------------------------------------------ memory --

def _memory_child():
  """Runs one memory configuration; prints its peak RSS as JSON."""
  model, optimizer, batch, grad_steps = FLAGS.memory_child.split(',')
  grad_steps = None if grad_steps == 'none' else int(grad_steps)
  tf = _tf()
  _, build_loss, _ = MEMORY_MODELS[model]
  session, train_op, parameters = _training_session(
      tf, build_loss, int(batch), optimizer, grad_steps)
  for _ in range(grad_steps or 1):  # a cycle of warm-up
    session.run(train_op)
  # A traced cycle: TensorFlow's own allocator peak, beside the process RSS,
  # which also counts what malloc keeps after TensorFlow frees it.
  allocator_peak = 0
  for _ in range(grad_steps or 1):
    metadata = tf.compat.v1.RunMetadata()
    session.run(train_op,
                options=tf.compat.v1.RunOptions(
                    trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                run_metadata=metadata)
    for device in metadata.step_stats.dev_stats:
      for node in device.node_stats:
        for memory in node.memory:
          allocator_peak = max(allocator_peak, memory.peak_bytes,
                               memory.allocator_bytes_in_use)
  print(json.dumps({
      'peak_rss_mb': peak_memory.peak_rss_mb(),
      'allocator_peak_mb': allocator_peak / 2**20,
      'parameter_mb': parameters * 4 / 2**20,
  }))


def _measure_memory(model, optimizer, batch, grad_steps, repeats=2):
  """Least peaks over `repeats` fresh processes."""
  peaks = []
  for _ in range(repeats):
    output = subprocess.run(
        [sys.executable, os.path.abspath(__file__),
         '--memory_child=%s,%s,%d,%s' % (model, optimizer, batch,
                                         grad_steps or 'none')],
        check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
    peaks.append(json.loads(output.strip().splitlines()[-1]))
  return {key: min(p[key] for p in peaks) for key in peaks[0]}


def memory_suite():
  grad_steps = FLAGS.grad_steps
  results = []
  rows = []
  for model, (description, _, batch) in MEMORY_MODELS.items():
    optimizer = 'SGD'
    micro_batch = batch // grad_steps
    large = _measure_memory(model, optimizer, batch, None)
    bare_micro = _measure_memory(model, optimizer, micro_batch, None)
    wrapper = _measure_memory(model, optimizer, micro_batch, grad_steps)
    parameter_mb = large['parameter_mb']
    result = {
        'model': description, 'optimizer': optimizer, 'batch': batch,
        'grad_steps': grad_steps, 'parameter_mb': parameter_mb,
        'large_batch_mb': large['peak_rss_mb'],
        'bare_micro_batch_mb': bare_micro['peak_rss_mb'],
        'wrapper_mb': wrapper['peak_rss_mb'],
    }
    result['wrapper_over_large'] = (result['wrapper_mb'] /
                                    result['large_batch_mb'])
    result['extra_mb'] = (result['wrapper_mb'] -
                          result['bare_micro_batch_mb'])
    result['extra_parameter_bytes'] = result['extra_mb'] / parameter_mb
    for name, measured in [('large_batch', large), ('bare_micro_batch',
                                                    bare_micro),
                           ('wrapper', wrapper)]:
      result[name + '_allocator_mb'] = measured['allocator_peak_mb']
    result['allocator_extra_parameter_bytes'] = (
        (result['wrapper_allocator_mb'] -
         result['bare_micro_batch_allocator_mb']) / parameter_mb)
    results.append(result)
    print('memory: %s' % result, flush=True)
    rows.append([
        description, '%.1f' % parameter_mb,
        '%.0f / %.0f' % (result['large_batch_mb'],
                         result['large_batch_allocator_mb']),
        '%.0f / %.0f' % (result['bare_micro_batch_mb'],
                         result['bare_micro_batch_allocator_mb']),
        '%.0f / %.0f' % (result['wrapper_mb'], result['wrapper_allocator_mb']),
        '%.2fx / %.2fx' % (result['wrapper_over_large'],
                           result['wrapper_allocator_mb'] /
                           result['large_batch_allocator_mb']),
        '%+.0f MB = %.2fx / %.2fx' % (result['extra_mb'],
                                      result['extra_parameter_bytes'],
                                      result['allocator_extra_parameter_bytes'])
    ])
  table = _markdown(
      ['model (SGD, K=%d)' % grad_steps, 'parameters (MB)',
       'one batch of B: RSS / TF (MB)', 'bare, batch B/K: RSS / TF (MB)',
       'wrapper, K x B/K: RSS / TF (MB)', 'wrapper / one batch: RSS / TF',
       'wrapper - bare B/K, in parameter bytes: RSS / TF'], rows)
  return {'memory': results}, table


# ------------------------------------------------------------------- keras --

def _keras_child():
  """Times Keras 3 steps with and without gradient_accumulation_steps."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  keras = tf.keras
  version = getattr(keras, 'version', lambda: keras.__version__)()
  if not version.startswith('3.'):
    print(json.dumps({'skipped': 'tf.keras is Keras %s, not 3' % version}))
    return
  grad_steps = FLAGS.grad_steps
  rng = np.random.RandomState(0)
  x = tf.constant(rng.randn(64, 1024).astype(np.float32))
  results = {'keras': version}
  for optimizer in ['SGD', 'Adam']:
    variants = {}
    for name, steps in [('bare', None), ('accumulating', grad_steps)]:
      model = keras.Sequential(
          [keras.Input([1024])] +
          [keras.layers.Dense(1024, activation='tanh') for _ in range(3)])
      kwargs = {'gradient_accumulation_steps': steps} if steps else {}
      opt = (keras.optimizers.SGD(0.01, **kwargs) if optimizer == 'SGD' else
             keras.optimizers.Adam(0.001, **kwargs))

      @tf.function
      def step(model=model, opt=opt):
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(tf.square(model(x)))
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

      variants[name] = step
    # Whole cycles per round: the mean includes the apply step.
    times = time_interleaved(variants, steps=grad_steps)
    results[optimizer] = {
        'bare_ms': times['bare'] * 1e3,
        'accumulating_ms': times['accumulating'] * 1e3,
        'cycle_ratio': times['accumulating'] / times['bare'],
    }
  print(json.dumps(results))


def keras_suite():
  output = subprocess.run(
      [sys.executable, os.path.abspath(__file__), '--keras_child',
       '--grad_steps=%d' % FLAGS.grad_steps, '--rounds=%d' % FLAGS.rounds],
      check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
  results = json.loads(output.strip().splitlines()[-1])
  print('keras: %s' % results, flush=True)
  if 'skipped' in results:
    return {'keras': results}, results['skipped']
  rows = [['Keras %s, 3x1024 MLP' % results['keras'], optimizer,
           '%.3f' % results[optimizer]['bare_ms'],
           '%.3f' % results[optimizer]['accumulating_ms'],
           '%.3f' % results[optimizer]['cycle_ratio']]
          for optimizer in ['SGD', 'Adam']]
  table = _markdown(['model', 'optimizer', 'bare step (ms)',
                     'gradient_accumulation_steps=%d, per step over whole '
                     'cycles (ms)' % FLAGS.grad_steps, 'ratio'], rows)
  return {'keras': results}, table


# ------------------------------------------------------------- multiworker --

MULTIWORKER_WIDTHS = [1024, 4096, 4096]  # 21M parameters: 84 MB all-reduced
MULTIWORKER_MICRO_BATCH = 32


def _multiworker_child():
  """One worker: times effective batches of K micro-steps; prints JSON."""
  variant, grad_steps, batches = FLAGS.multiworker_child.split(',')
  grad_steps, batches = int(grad_steps), int(batches)
  tf = _tf()
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
      loss, _ = mlp_loss(tf, MULTIWORKER_MICRO_BATCH, MULTIWORKER_WIDTHS,
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
  print(json.dumps({'seconds_per_effective_batch': _median(times)}))


def multiworker_suite():
  """2 workers on 127.0.0.1; every configuration in fresh processes."""
  import socket  # pylint: disable=g-import-not-at-top
  results = []
  rows = []
  for grad_steps in [1, 4, 16]:
    measured = {}
    for variant in ['bare', 'wrapper']:
      sockets = [socket.socket() for _ in range(2)]
      for s in sockets:
        s.bind(('127.0.0.1', 0))
      cluster = {'worker': ['127.0.0.1:%d' % s.getsockname()[1]
                            for s in sockets]}
      for s in sockets:
        s.close()
      processes = [
          subprocess.Popen(
              [sys.executable, os.path.abspath(__file__),
               '--multiworker_child=%s,%d,%d' % (variant, grad_steps,
                                                 max(3, 48 // grad_steps))],
              env=dict(os.environ, TF_CONFIG=json.dumps(
                  {'cluster': cluster,
                   'task': {'type': 'worker', 'index': index}})),
              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
              universal_newlines=True) for index in range(2)]
      try:
        outputs = [p.communicate(timeout=600)[0] for p in processes]
      finally:
        for p in processes:
          if p.poll() is None:
            p.kill()
      seconds = max(json.loads(o.strip().splitlines()[-1])
                    ['seconds_per_effective_batch'] for o in outputs)
      measured[variant] = seconds * 1e3
    result = {'grad_steps': grad_steps, 'bare_ms': measured['bare'],
              'wrapper_ms': measured['wrapper'],
              'ratio': measured['wrapper'] / measured['bare']}
    results.append(result)
    print('multiworker: %s' % result, flush=True)
    rows.append([str(grad_steps), '%.0f' % result['bare_ms'],
                 '%.0f' % result['wrapper_ms'], '%.2f' % result['ratio']])
  table = _markdown(
      ['K', 'bare: K steps, K all-reduces (ms)',
       'wrapper: K micro-steps, 1 all-reduce (ms)', 'ratio'], rows)
  return {'multiworker': results}, table


# ----------------------------------------------------------------- sparse --

def _sparse_session(tf, rows, variant, ids_per_step=256, dim=64):
  """A session and a step function for one sparse-suite variant."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import deferred_grad  # pylint: disable=g-import-not-at-top
  graph = tf.Graph()
  with graph.as_default():
    table = tf.compat.v1.get_variable(
        'table', [rows, dim], initializer=tf.compat.v1.zeros_initializer())
    ids = tf.compat.v1.placeholder(tf.int32, [ids_per_step])
    loss = tf.reduce_sum(tf.square(tf.nn.embedding_lookup(table, ids) - 1.0))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    if variant == 'bare':
      train_op = sgd.minimize(loss, global_step=global_step)
    elif variant == 'sparse':
      # grad_steps so large that every timed step only accumulates.
      train_op = deferred_grad.GradientAggregationOptimizer(
          sgd, grad_steps=10**9).minimize(loss, global_step=global_step)
    elif variant == 'cycle':
      # Whole cycles: the apply step reads the accumulator's non-zero rows.
      train_op = deferred_grad.GradientAggregationOptimizer(
          sgd, grad_steps=FLAGS.grad_steps).minimize(
              loss, global_step=global_step)
    else:  # the original module's dense accumulation of IndexedSlices
      (grad, _), = sgd.compute_gradients(loss, [table])
      accumulator = tf.compat.v1.get_variable(
          'accumulator', [rows, dim],
          initializer=tf.compat.v1.zeros_initializer(), trainable=False)
      scaled = tf.IndexedSlices(grad.values / 10**9, grad.indices,
                                dense_shape=grad.dense_shape)
      accumulate = accumulator.assign(accumulator.read_value() + scaled)
      with tf.control_dependencies([accumulate]):
        train_op = global_step.assign_add(1)
    session = tf.compat.v1.Session(graph=graph)
    session.run(tf.compat.v1.global_variables_initializer())
  rng = np.random.RandomState(0)
  feeds = [rng.randint(0, rows, size=ids_per_step) for _ in range(64)]
  counter = [0]

  def run_step():
    counter[0] += 1
    session.run(train_op, {ids: feeds[counter[0] % len(feeds)]})

  return session, run_step


def sparse_suite():
  tf = _tf()
  rows_list = [int(r) for r in FLAGS.table_rows]
  results = []
  for rows in rows_list:
    sessions = {}
    variants = {}
    for variant in ['sparse', 'cycle', 'dense (original)', 'bare SGD']:
      kind = variant.split()[0]
      sessions[variant], variants[variant] = _sparse_session(tf, rows, kind)
    # Whole cycles in every round, for the 'cycle' variant.
    times = time_interleaved(variants, steps=2 * FLAGS.grad_steps)
    for session in sessions.values():
      session.close()
    results.append({'rows': rows, 'ms': {k: v * 1e3 for k, v in times.items()}})
    print('sparse: %d rows: %s' % (rows, {k: '%.3f ms' % (v * 1e3)
                                          for k, v in times.items()}),
          flush=True)
  smallest = results[0]['ms']['sparse']
  table = _markdown(
      ['table rows x 64', 'sparse accumulate (ms)', 'vs smallest table',
       'whole cycle of %d, per micro-step (ms)' % FLAGS.grad_steps,
       'dense accumulate, original (ms)', 'bare SGD step (ms)',
       'sparse / bare'],
      [['{:,}'.format(r['rows']), '%.3f' % r['ms']['sparse'],
        '%.2fx' % (r['ms']['sparse'] / smallest), '%.3f' % r['ms']['cycle'],
        '%.3f' % r['ms']['dense (original)'], '%.3f' % r['ms']['bare SGD'],
        '%.2fx' % (r['ms']['sparse'] / r['ms']['bare SGD'])]
       for r in results])
  return {'sparse': results}, table


SUITES = {
    'step': step_suite,
    'memory': memory_suite,
    'keras': keras_suite,
    'multiworker': multiworker_suite,
    'sparse': sparse_suite,
}


def main(argv):
  del argv
  if FLAGS.memory_child:
    return _memory_child()
  if FLAGS.keras_child:
    return _keras_child()
  if FLAGS.multiworker_child:
    return _multiworker_child()
  unknown = set(FLAGS.suites) - set(SUITES)
  if unknown:
    sys.exit('unknown --suites %s; known: %s' % (sorted(unknown),
                                                 sorted(SUITES)))
  results = {'machine': _machine()}
  tables = []
  for name in FLAGS.suites:
    data, table = SUITES[name]()
    results.update(data)
    tables.append('### %s\n\n%s\n' % (name, table))
  with open(FLAGS.output, 'w') as f:
    json.dump(results, f, indent=2)
  markdown = os.path.splitext(FLAGS.output)[0] + '.md'
  with open(markdown, 'w') as f:
    f.write('\n'.join(tables))
  print('\n'.join(tables))
  print('wrote %s and %s' % (FLAGS.output, markdown))


def _machine():
  import platform  # pylint: disable=g-import-not-at-top
  tf = _tf()
  return {
      'cpus': os.cpu_count(),
      'python': platform.python_version(),
      'tensorflow': tf.__version__,
      'processor': platform.processor() or platform.machine(),
  }


if __name__ == '__main__':
  app.run(main)
