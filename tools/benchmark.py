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
  sparse  accumulate-only micro-step for embedding tables of 10k, 100k and 1M
          rows by 64, 256 ids per micro-step: sparse (scatter-add)
          accumulation against the original's dense accumulation and against
          the bare optimizer's step.
"""

import json
import os
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list('suites', ['step', 'memory', 'keras', 'sparse'],
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
    'sparse': sparse_suite,
}


def main(argv):
  del argv
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
