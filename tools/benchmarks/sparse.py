"""Suite `sparse`: embedding tables of growing size.

Tables of 10k, 1M and 10M rows by 64 (float32; 10M rows is 2.5 GB), 256
looked-up ids per micro-step, SGD, K = --grad_steps. Each (table, variant)
runs in a fresh process, one after another in one run, so that its peak
memory is its own:

  bare      the bare optimizer's sparse step;
  wrapper   whole cycles through the wrapper: the accumulate-only
            micro-steps and the apply step timed apart, and the whole cycle
            per micro-step;
  original  the original module's dense accumulation of the same gradient
            (tables up to 1M rows: at 10M it allocates a 2.5 GB dense
            gradient per micro-step).

Results (TensorFlow 2.21, 2 cores, K = 8; ms; RSS after training = peak):

  rows x 64    accumulate-only  vs 10k  apply  cycle per micro-step  vs 10k  bare   original  RSS wrapper/bare MB
  10,000       0.430            1.00x   1.460  0.584                 1.00x   0.192  0.614     556 / 536
  1,000,000    0.450            1.04x   1.563  0.627                 1.07x   0.255  24.100    1544 / 1036
  10,000,000   0.427            0.99x   1.572  0.577                 0.99x   0.289  not run   10815 / 5670

Targets met: the cycle per micro-step at 10M rows within 1.5x of 10k rows
(0.99x), and the accumulate-only micro-step too; the apply step alone is
1.5 ms at every size (it dedups the recorded ids and touches those rows
only). The accumulator is one more table-sized variable; each table-sized
variable costs about twice its bytes of RSS, the bare run's table as much as
the accumulator (TensorFlow's variable initialization under oneDNN's
allocator, whose pool does not shrink: +508 MB of RSS for one 256 MB
variable alone).
"""

import json
import time

from benchmarks import common

import peak_memory  # tools/peak_memory.py

FLAGS = common.FLAGS
common.flags.DEFINE_list('table_rows', ['10000', '1000000', '10000000'],
                         'Sparse suite: embedding table sizes.')
common.flags.DEFINE_integer('sparse_cycles', 12,
                            'Sparse suite: timed cycles per variant.')

IDS_PER_STEP, DIM = 256, 64
ORIGINAL_MAX_ROWS = 1000000


def _graph(tf, rows, variant, grad_steps):
  """The train op and the ids placeholder of one variant."""
  import deferred_grad  # pylint: disable=g-import-not-at-top
  table = tf.compat.v1.get_variable(
      'table', [rows, DIM], initializer=tf.compat.v1.zeros_initializer())
  ids = tf.compat.v1.placeholder(tf.int32, [IDS_PER_STEP])
  loss = tf.reduce_sum(tf.square(tf.nn.embedding_lookup(table, ids) - 1.0))
  global_step = tf.compat.v1.train.get_or_create_global_step()
  sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
  if variant == 'bare':
    return sgd.minimize(loss, global_step=global_step), ids
  if variant == 'wrapper':
    return deferred_grad.GradientAggregationOptimizer(
        sgd, grad_steps=grad_steps).minimize(loss, global_step=global_step), ids
  # The original module's dense accumulation of IndexedSlices (no apply).
  (grad, _), = sgd.compute_gradients(loss, [table])
  accumulator = tf.compat.v1.get_variable(
      'accumulator', [rows, DIM],
      initializer=tf.compat.v1.zeros_initializer(), trainable=False)
  scaled = tf.IndexedSlices(grad.values / grad_steps, grad.indices,
                            dense_shape=grad.dense_shape)
  accumulate = accumulator.assign(accumulator.read_value() + scaled)
  with tf.control_dependencies([accumulate]):
    return global_step.assign_add(1), ids


def child(spec):
  """Times one 'rows,variant' in this process; prints JSON."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows, variant = spec.split(',')
  rows = int(rows)
  grad_steps = FLAGS.grad_steps
  tf = common.import_tf()
  graph = tf.Graph()
  with graph.as_default():
    train_op, ids = _graph(tf, rows, variant, grad_steps)
    session = tf.compat.v1.Session(graph=graph)
    session.run(tf.compat.v1.global_variables_initializer())
  rng = np.random.RandomState(0)
  feeds = [rng.randint(0, rows, size=IDS_PER_STEP) for _ in range(64)]
  times = []
  for step in range((FLAGS.sparse_cycles + 2) * grad_steps):
    start = time.perf_counter()
    session.run(train_op, {ids: feeds[step % len(feeds)]})
    times.append(time.perf_counter() - start)
  times = times[2 * grad_steps:]  # two cycles of warm-up
  apply_steps = [t for i, t in enumerate(times)
                 if i % grad_steps == grad_steps - 1]
  other_steps = [t for i, t in enumerate(times)
                 if i % grad_steps != grad_steps - 1]
  print(json.dumps({
      'step_ms': common.median(times) * 1e3,
      'accumulate_ms': common.median(other_steps) * 1e3,
      'apply_ms': common.median(apply_steps) * 1e3,
      'cycle_per_step_ms': sum(times) / len(times) * 1e3,
      'peak_rss_mb': peak_memory.peak_rss_mb(),
      # Resident after training: the peak also holds each variable's
      # initial value while the initializers run.
      'rss_mb': peak_memory.current_rss_mb(),
  }))


def run():
  rows_list = [int(r) for r in FLAGS.table_rows]
  results = []
  for rows in rows_list:
    measured = {}
    for variant in ['bare', 'wrapper', 'original']:
      if variant == 'original' and rows > ORIGINAL_MAX_ROWS:
        continue
      measured[variant] = common.run_child(
          'sparse', '%d,%s' % (rows, variant),
          '--grad_steps=%d' % FLAGS.grad_steps,
          '--sparse_cycles=%d' % FLAGS.sparse_cycles)
    results.append({'rows': rows, 'grad_steps': FLAGS.grad_steps,
                    'ms': measured})
    print('sparse: %d rows: %s' % (rows, measured), flush=True)
  smallest = results[0]['ms']['wrapper']
  rows_out = []
  for result in results:
    wrapper, bare = result['ms']['wrapper'], result['ms']['bare']
    original = result['ms'].get('original')
    rows_out.append([
        '{:,}'.format(result['rows']),
        '%.3f' % wrapper['accumulate_ms'],
        '%.2fx' % (wrapper['accumulate_ms'] / smallest['accumulate_ms']),
        '%.3f' % wrapper['apply_ms'],
        '%.3f' % wrapper['cycle_per_step_ms'],
        '%.2fx' % (wrapper['cycle_per_step_ms'] /
                   smallest['cycle_per_step_ms']),
        '%.3f' % bare['step_ms'],
        '%.3f' % original['accumulate_ms'] if original else 'not run',
        '%.0f / %.0f' % (wrapper['rss_mb'], bare['rss_mb']),
        '%.0f / %.0f' % (wrapper['peak_rss_mb'], bare['peak_rss_mb']),
    ])
  table = common.markdown(
      ['table rows x 64', 'accumulate-only step (ms)', 'vs smallest',
       'apply step (ms)', 'whole cycle of %d, per micro-step (ms)' %
       FLAGS.grad_steps, 'vs smallest', 'bare SGD step (ms)',
       'original\'s dense accumulate (ms)',
       'RSS after training, wrapper / bare (MB)',
       'peak RSS, wrapper / bare (MB)'], rows_out)
  return {'sparse': results}, table
