"""Suite `sparse`: embedding tables of growing size.

An accumulate-only micro-step for embedding tables of 10k, 100k and 1M rows
by 64, 256 ids per micro-step: sparse (scatter-add) accumulation against the
original's dense accumulation and against the bare optimizer's step; and a
whole cycle through the wrapper, per micro-step.
"""

from benchmarks import common

FLAGS = common.FLAGS
common.flags.DEFINE_list('table_rows', ['10000', '100000', '1000000'],
                         'Sparse suite: embedding table sizes.')


def _session(tf, rows, variant, ids_per_step=256, dim=64):
  """A session and a step function for one variant."""
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
      # Whole cycles, the apply step included.
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


def run():
  tf = common.import_tf()
  rows_list = [int(r) for r in FLAGS.table_rows]
  results = []
  for rows in rows_list:
    sessions = {}
    variants = {}
    for variant in ['sparse', 'cycle', 'dense (original)', 'bare SGD']:
      kind = variant.split()[0]
      sessions[variant], variants[variant] = _session(tf, rows, kind)
    # Whole cycles in every round, for the 'cycle' variant.
    times = common.time_interleaved(variants, steps=2 * FLAGS.grad_steps)
    for session in sessions.values():
      session.close()
    results.append({'rows': rows, 'ms': {k: v * 1e3 for k, v in times.items()}})
    print('sparse: %d rows: %s' % (rows, {k: '%.3f ms' % (v * 1e3)
                                          for k, v in times.items()}),
          flush=True)
  smallest = results[0]['ms']['sparse']
  table = common.markdown(
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
