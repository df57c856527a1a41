"""Suite `parameter_servers`: traffic into the ps, per micro-step.

One worker and one ps task, in this process on 127.0.0.1, the model built
under `replica_device_setter` as legacy scripts and Estimators build it: a
256-1024-1024 MLP (1.3M parameters, 5 MB of gradients), SGD. For the bare
optimizer (one update per micro-batch) and the wrapper at K = 4 and 16:
the bytes the ps receives per micro-step (an apply step's over K) and on an
accumulate-only micro-step, from traced runs' RecvTensor records (which
round to two significant digits, and now and then miss one: the largest of
two cycles counts), and the time per micro-step (untraced, median of
rounds).

Results (TensorFlow 2.21): bare, K=1: 5,251,076 bytes into the ps per
micro-step, 27.16 ms; wrapper K=4: 1,312,771 bytes, at most 9 on an
accumulate-only micro-step, 22.68 ms; K=16: 328,193 bytes, 9, 22.50 ms.
The 9 bytes are the cycle predicate and the global step's increment.
"""

from benchmarks import cluster
from benchmarks import common

WIDTHS = [256, 1024, 1024]
MICRO_BATCH = 32


def _measure(tf, servers, variant, grad_steps, scope):
  import deferred_grad  # pylint: disable=g-import-not-at-top
  worker, _ = servers
  with tf.Graph().as_default():
    setter = tf.compat.v1.train.replica_device_setter(
        ps_tasks=1, worker_device='/job:worker/task:0')
    with tf.compat.v1.device(setter), tf.compat.v1.variable_scope(scope):
      global_step = tf.compat.v1.train.create_global_step()
      loss, _ = common.mlp_loss(tf, MICRO_BATCH, WIDTHS)
      opt = tf.compat.v1.train.GradientDescentOptimizer(0.01)
      if variant == 'wrapper':
        opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps)
      train_op = opt.minimize(loss, global_step=global_step)
    with tf.compat.v1.Session(worker.target) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      received = []
      for _ in range(2 * grad_steps):  # two cycles, traced
        metadata = tf.compat.v1.RunMetadata()
        session.run(train_op, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                    run_metadata=metadata)
        received.append(cluster.bytes_into_ps(metadata))
      seconds = common.time_interleaved(
          {'step': lambda: session.run(train_op)})['step']
  # The trace now and then drops a record: the largest of each kind counts.
  apply_steps = received[grad_steps - 1::grad_steps]
  accumulate_only = [r for i, r in enumerate(received)
                     if i % grad_steps != grad_steps - 1]
  return (max(apply_steps) / grad_steps, max(accumulate_only or [None]),
          seconds)


def run():
  tf = common.import_tf()
  ports = cluster.free_ports(2)
  spec = tf.train.ClusterSpec({'worker': ['127.0.0.1:%d' % ports[0]],
                               'ps': ['127.0.0.1:%d' % ports[1]]})
  servers = (tf.distribute.Server(spec, 'worker', 0),
             tf.distribute.Server(spec, 'ps', 0))
  results, rows = [], []
  configurations = [('bare', 1), ('wrapper', 4), ('wrapper', 16)]
  for number, (variant, grad_steps) in enumerate(configurations):
    received, accumulating, seconds = _measure(tf, servers, variant, grad_steps,
                                 'run%d' % number)
    result = {'variant': variant, 'grad_steps': grad_steps,
              'bytes_into_ps_per_micro_step': received,
              'bytes_into_ps_accumulate_only_max': accumulating,
              'ms_per_micro_step': seconds * 1e3}
    results.append(result)
    print('parameter_servers: %s' % result, flush=True)
    rows.append([variant, str(grad_steps), '%.0f' % received,
                 '-' if accumulating is None else '%.0f' % accumulating,
                 '%.2f' % (seconds * 1e3)])
  table = common.markdown(
      ['optimizer', 'K', 'bytes into the ps per micro-step',
       'on an accumulate-only micro-step (max)',
       'ms per micro-step'], rows)
  return {'parameter_servers': results}, table
