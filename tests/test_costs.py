"""What a step costs: the buffers it keeps and the ops it runs.

The levers of `tools/benchmark --suites=memory,step`, pinned: accumulators
start as run-time zeros and are zeroed in their own buffer (memory); a
micro-step and an apply step run a few ops per variable beyond a bare
step's (time, which on many small variables is the number of ops the
executor schedules).
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models

GRAD_STEPS = 4


def test_accumulators_start_as_run_time_zeros():
  """No accumulator's initial value is a constant the session would keep.

  A session keeps every constant its executors ran; zeros of a known shape
  become one after constant folding (also a fill of a placeholder with a
  default), and the original's zeros slots pinned 1x the parameter bytes
  that way, and copied them into the variables (tools/benchmark
  --suites=memory,scale). The zero-initialised `Empty` op is not folded.
  """
  with tf.Graph().as_default():
    loss, model = models.model_loss(
        tf.ones([2, models.INPUT_DIM]), tf.ones([2, models.OUTPUT_DIM]))
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), GRAD_STEPS)
    optimizer.minimize(loss)
    for name, variable in sorted(model.items()):
      initial = optimizer.get_slot(variable, 'grad_accum').initial_value
      assert initial.op.type == 'Empty' and initial.op.get_attr('init'), name
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for name, variable in model.items():
        accumulator = session.run(optimizer.get_slot(variable, 'grad_accum'))
        assert accumulator.shape == tuple(variable.shape), name
        assert not np.any(accumulator), name


def _buffer_of(session, tensor):
  """(address, bytes allocated) of `tensor`'s buffer in a traced run."""
  metadata = tf.compat.v1.RunMetadata()
  session.run(tensor.op, options=tf.compat.v1.RunOptions(
      trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
  for device in metadata.step_stats.dev_stats:
    for node in device.node_stats:
      if node.node_name == tensor.op.name:
        return (node.output[0].tensor_description.allocation_description.ptr,
                sum(memory.total_bytes for memory in node.memory))
  raise AssertionError('%s did not run' % tensor.op.name)


def test_large_accumulators_are_zeroed_in_their_own_buffer(use_tpu):
  """The apply step zeroes a large accumulator where it is.

  Assigning it its own zeros makes a second buffer as large as the
  accumulator, whose pages the CPU allocator then keeps (+1.5x the
  parameter bytes of peak RSS, tools/benchmark --suites=memory); a scatter
  that left the variable in copy-on-read mode makes every read copy it.
  Either shows as a read whose buffer moves from cycle to cycle. (Resource
  variables: a ref variable's assign copies into its buffer, so only memory
  shows it.) Accumulators up to 1 MiB are zeroed from zeros shared by their
  shape instead (see the op-count test below).
  """
  rows = 640  # 640 x 512 float32: 1.25 MiB
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=tf.ones([rows, 512]),
                                  use_resource=True)
    x = tf.compat.v1.placeholder(tf.float32, [512])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.01), GRAD_STEPS,
        use_tpu=use_tpu)
    train_op = optimizer.minimize(tf.reduce_sum(tf.linalg.matvec(w, x)**2))
    accumulator = optimizer.get_slot(w, 'grad_accum')
    read = tf.identity(accumulator.read_value())
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      buffers = []
      for _ in range(3 * GRAD_STEPS):
        session.run(train_op, {x: np.ones(512)})
        buffers.append(_buffer_of(session, read))
      assert not np.any(session.run(accumulator))
  assert len(set(buffers)) == 1, buffers
  assert buffers[0][1] == 0, buffers  # the read copied nothing


def _executed_nodes(session, op, feed):
  metadata = tf.compat.v1.RunMetadata()
  session.run(op, feed, options=tf.compat.v1.RunOptions(
      trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
  return sum(len(device.node_stats) for device in metadata.step_stats.dev_stats)


def _small_variables(grad_steps, optimizer='GradientDescent', use_tpu=False,
                     count=40):
  """(session, train op, feed): `count` 8x8 resource variables."""
  graph = tf.Graph()
  with graph.as_default():
    ws = [tf.compat.v1.get_variable('w%d' % i, initializer=tf.ones([8, 8]),
                                    use_resource=True)
          for i in range(count)]
    x = tf.compat.v1.placeholder(tf.float32, [8])
    loss = tf.add_n([tf.reduce_sum(tf.linalg.matvec(w, x)**2) for w in ws])
    opt = models.OPTIMIZERS[optimizer](None)
    if grad_steps is not None:
      opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps,
                                                       use_tpu=use_tpu)
    train_op = opt.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    session = tf.compat.v1.Session(graph=graph)
    session.run(tf.compat.v1.global_variables_initializer())
  return session, train_op, {x: np.ones(8)}


def _extra_ops(optimizer, use_tpu, variables):
  """(ops a micro-step runs over a bare step's, ops an apply step runs over
  a micro-step's) on `variables` small variables."""
  session, train_op, feed = _small_variables(None, optimizer, use_tpu,
                                             variables)
  with session:
    bare = _executed_nodes(session, train_op, feed)
  session, train_op, feed = _small_variables(GRAD_STEPS, optimizer, use_tpu,
                                             variables)
  with session:
    counts = [_executed_nodes(session, train_op, feed)
              for _ in range(2 * GRAD_STEPS)]
  assert counts[GRAD_STEPS:] == counts[:GRAD_STEPS], counts
  return counts[0] - bare, counts[GRAD_STEPS - 1] - counts[0]


@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Momentum'])
def test_a_step_s_ops_grow_with_the_variables_as_promised(optimizer,
                                                          use_tpu):
  """On many small variables a step's cost is the ops the executor runs.

  A micro-step runs a bare step's ops plus one per variable: the
  accumulator's handle and add in place of the bare update. Under control
  flow v1 also a Switch for each variable and slot the cycle's tf.cond
  reads (v1 lowers it into Switch and Merge ops, which run on every
  micro-step); a control flow v2 `If` runs as a function, its taken
  branch only (`compat.cond`). An apply step runs, per variable, the
  wrapped optimizer's update, the accumulator's read and one zeroing op,
  and in a function an argument per variable and slot it reads.
  """
  few, many = 4, 40
  (micro_few, apply_few), (micro_many, apply_many) = [
      _extra_ops(optimizer, use_tpu, n) for n in (few, many)]
  slots = {'GradientDescent': 0, 'Momentum': 1}[optimizer]
  if tf.compat.v1.control_flow_v2_enabled():
    micro, apply = 1, 5 + slots
  else:
    micro, apply = 3 + slots, 3
  assert micro_many - micro_few <= micro * (many - few), (
      micro_few, micro_many)
  assert apply_many - apply_few <= apply * (many - few), (apply_few,
                                                           apply_many)


def test_the_cycle_s_if_runs_as_a_function():
  """Unlowered, only the taken branch of the cycle's If runs (where its
  resources share a device; not under a strategy)."""
  with tf.Graph().as_default() as graph:
    w = tf.compat.v1.get_variable('w', [2], use_resource=True)
    deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), GRAD_STEPS
    ).minimize(tf.reduce_sum(w * w))
  lowered = [op.get_attr('_lower_using_switch_merge')
             for op in graph.get_operations() if op.type == 'If']
  if tf.compat.v1.control_flow_v2_enabled():
    assert lowered == [False], lowered
  else:
    assert not lowered  # control flow v1: Switch and Merge
