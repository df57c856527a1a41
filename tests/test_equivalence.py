"""K micro-batches through the wrapper train exactly like one K-times batch."""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
from models import make_data
from training import assert_same_training
from training import train

GRAD_STEPS = 4


@pytest.mark.parametrize('optimizer', sorted(models.OPTIMIZERS))
def test_matches_large_batch(optimizer, use_tpu):
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, expected_step, _ = train(make_optimizer, data)
  actual, actual_step, _ = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu)
  assert_same_training(actual, expected)
  assert expected_step == models.CYCLES
  assert actual_step == models.CYCLES * GRAD_STEPS


def test_wrong_step_for_adagrad_da_differs():
  """Guards the test above: AdagradDA reading micro-steps trains otherwise."""
  make_optimizer = models.OPTIMIZERS['AdagradDA']
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data)
  actual, _, _ = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, step_tensor='global_step')
  with pytest.raises(AssertionError):
    assert_same_training(actual, expected)


def test_learning_rate_schedule_fed_by_applied_updates(use_tpu):
  def make_optimizer(step):
    learning_rate = tf.compat.v1.train.exponential_decay(
        0.5, step, decay_steps=1, decay_rate=0.5)
    return tf.compat.v1.train.GradientDescentOptimizer(learning_rate)

  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data)
  actual, _, _ = train(
      make_optimizer, data, grad_steps=GRAD_STEPS, use_tpu=use_tpu)
  assert_same_training(actual, expected)
  # The same schedule fed the micro-step count decays K times too fast.
  too_fast, _, _ = train(
      make_optimizer,
      data,
      grad_steps=GRAD_STEPS,
      use_tpu=use_tpu,
      step_tensor='global_step')
  with pytest.raises(AssertionError):
    assert_same_training(too_fast, expected)


def test_applied_updates_values():
  graph = tf.Graph()
  with graph.as_default():
    step = tf.compat.v1.placeholder(tf.int64, [])
    updates = deferred_grad.applied_updates(step, 4)
    with tf.compat.v1.Session() as session:
      got = [session.run(updates, {step: s}) for s in range(10)]
  assert got == [s // 4 for s in range(10)]


def test_without_global_step(use_tpu):
  """The original crashed with global_step=None; it must still cycle."""
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Adam'], data)
  actual, _, _ = train(
      models.OPTIMIZERS['Adam'],
      data,
      grad_steps=GRAD_STEPS,
      use_tpu=use_tpu,
      use_global_step=False,
      step_tensor=None)
  assert_same_training(actual, expected)


def test_none_gradients_are_skipped(use_tpu):
  """The original failed on a variable the loss does not depend on."""
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Momentum'], data,
                         model_kwargs={'with_unused': True})
  actual, _, graph = train(
      models.OPTIMIZERS['Momentum'],
      data,
      grad_steps=GRAD_STEPS,
      use_tpu=use_tpu,
      model_kwargs={'with_unused': True})
  assert_same_training(actual, expected)
  np.testing.assert_array_equal(actual[-1]['unused'], np.ones([2]))
  names = [v.op.name for v in graph.get_collection('variables')]
  assert 'w1/GradientAccumulator' in names
  assert 'unused/GradientAccumulator' not in names


@pytest.mark.parametrize('model, second, optimizer', [
    ('mlp', 'half', 'Adam'), ('mlp', 'l2', 'GradientDescent'),
    ('embedding', 'half', 'GradientDescent'), ('embedding', 'l2', 'Adam')])
def test_a_variable_listed_twice_gets_the_sum_of_its_gradients(
    optimizer, model, second, use_tpu):
  """grads_and_vars of two losses put end to end (one model under two
  losses): the cycle applies the large batch's gradient of their sum, as
  the bare optimizer minimizing the sum. ('l2': a dense gradient beside a
  table's IndexedSlices.)"""
  make_data_fn, input_specs, loss_fn = models.MODELS[model]
  data = make_data_fn(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)

  def run(grad_steps):
    with tf.Graph().as_default():
      global_step = tf.compat.v1.train.get_or_create_global_step()
      inputs = [tf.compat.v1.placeholder(dtype, shape)
                for dtype, shape in input_specs]
      loss, variables = loss_fn(*inputs)
      extra = 0.5 * loss if second == 'half' else 0.01 * tf.add_n(
          [tf.nn.l2_loss(v) for v in variables.values()])
      opt = models.OPTIMIZERS[optimizer](global_step)
      if grad_steps is None:
        train_op = opt.minimize(loss + extra, global_step=global_step)
      else:
        opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps,
                                                         use_tpu=use_tpu)
        pairs = opt.compute_gradients(loss) + opt.compute_gradients(extra)
        train_op = opt.apply_gradients(pairs, global_step=global_step)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for cycle in range(models.CYCLES):
          parts = [np.split(part[cycle], grad_steps or 1) for part in data]
          for micro_batch in zip(*parts):
            session.run(train_op, dict(zip(inputs, micro_batch)))
        return session.run(variables)

  assert_same_training([run(GRAD_STEPS)], [run(None)])


def test_grad_steps_one_is_the_bare_optimizer(use_tpu):
  data = make_data(models.CYCLES, models.MICRO_BATCH)
  expected, expected_step, expected_graph = train(
      models.OPTIMIZERS['Adam'], data)
  actual, actual_step, graph = train(
      models.OPTIMIZERS['Adam'], data, grad_steps=1, use_tpu=use_tpu)
  assert_same_training(actual, expected, rtol=0, atol=0)
  assert actual_step == expected_step
  names = sorted(v.op.name for v in graph.get_collection('variables'))
  assert names == sorted(
      v.op.name for v in expected_graph.get_collection('variables'))


def test_variable_of_unknown_shape(use_tpu):
  """Its accumulator takes TensorFlow's zeros slot, shaped at run time."""
  learning_rate = 0.1
  start = np.array([1.0, -2.0])
  with tf.Graph().as_default():
    v = models.unknown_shape_variable(start)
    assert v.shape.rank is None
    x = tf.compat.v1.placeholder(tf.float32, [2])
    loss = tf.reduce_sum(tf.square(v - x))
    train_op = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        GRAD_STEPS, use_tpu=use_tpu).minimize(loss)
    targets = np.random.RandomState(0).randn(GRAD_STEPS, 2).astype(np.float32)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for target in targets:
        session.run(train_op, {x: target})
      actual = session.run(v)
  # One SGD step on the mean of the micro-batches' gradients 2 (v - x).
  expected = start - learning_rate * np.mean(2 * (start - targets), axis=0)
  np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_accumulators_start_as_run_time_zeros():
  """No accumulator's initial value is a constant the session would keep.

  A session keeps every constant its executors ran; zeros of a known shape
  become one after constant folding, and the original's zeros slots pinned
  1x the parameter bytes that way (tools/benchmark --suites=memory).
  """
  with tf.Graph().as_default():
    loss, model = models.model_loss(
        tf.ones([2, models.INPUT_DIM]), tf.ones([2, models.OUTPUT_DIM]))
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), GRAD_STEPS)
    optimizer.minimize(loss)
    for name, variable in sorted(model.items()):
      initial = optimizer.get_slot(variable, 'grad_accum').initial_value
      assert initial.op.type == 'Fill', name
      assert initial.op.inputs[1].op.type == 'PlaceholderWithDefault', name
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


@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Momentum'])
def test_apply_step_costs_few_ops_per_small_variable(optimizer, use_tpu):
  """On many small variables an apply step's cost is its op count.

  Over a micro-step that only accumulates, the apply step may run, per
  variable: the accumulator's read, the wrapped optimizer's update, one
  zeroing op and the branch's two arguments (accumulator and variable),
  plus a few ops per step.
  """
  variables = 40
  with tf.Graph().as_default():
    ws = [tf.compat.v1.get_variable('w%d' % i, initializer=tf.ones([8, 8]),
                                    use_resource=True)
          for i in range(variables)]
    x = tf.compat.v1.placeholder(tf.float32, [8])
    loss = tf.add_n([tf.reduce_sum(tf.linalg.matvec(w, x)**2) for w in ws])
    wrapper = deferred_grad.GradientAggregationOptimizer(
        models.OPTIMIZERS[optimizer](None), GRAD_STEPS, use_tpu=use_tpu)
    train_op = wrapper.minimize(loss)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      feed = {x: np.ones(8)}
      counts = [_executed_nodes(session, train_op, feed)
                for _ in range(2 * GRAD_STEPS)]
  micro_step, apply_step = counts[0], counts[GRAD_STEPS - 1]
  assert counts[GRAD_STEPS:] == counts[:GRAD_STEPS], counts
  wrapped = 1 if optimizer == 'GradientDescent' else 2  # Momentum: + slot
  limit = variables * (4 + wrapped) + 12
  assert apply_step - micro_step <= limit, (
      'the apply step runs %d ops more than a micro-step on %d variables; '
      'at most %d expected' % (apply_step - micro_step, variables, limit))
