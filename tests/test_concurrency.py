"""One train op run from several threads of one session.

TF1 queue-runner and Hogwild-style trainers call `session.run(train_op)`
from many threads at once. Each run is one micro-step: every micro-batch
counts once, and every cycle applies exactly the micro-batches it counted
(runs take turns on the train op's lock; they still compute their
gradients side by side). Races show up only sometimes, so each test runs
several trials of thousands of runs.
"""

import threading

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import training

GRAD_STEPS = 3
THREADS = 8
TRIALS = 3
ROWS, WIDTH = 5, 2
LOOKED_UP = [1, 3]
# Exact in float32, as the optimizers hold their hyperparameters.
MOMENTUM, LEARNING_RATE, ADAGRAD_RATE = 0.5, 2.0**-7, 0.125


def _run_in_threads(session, fetches, feeds_of, runs, threads=THREADS):
  """Runs `fetches` `runs` times in each of `threads` threads.

  Returns:
    Per thread, the list of (feed values, fetched values) of its runs.
  """
  results = [[] for _ in range(threads)]
  errors = []

  def work(index):
    try:
      rng = np.random.RandomState(index)
      for _ in range(runs):
        feed = feeds_of(rng)
        results[index].append((feed, session.run(fetches, feed)))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
  for worker in workers:
    worker.start()
  for worker in workers:
    worker.join(timeout=300)
  assert not any(worker.is_alive() for worker in workers)
  assert not errors, errors[0]
  return results


def _constant_model(use_tpu, strategy=None):
  """loss = sum(w * c) + sum(table[ids] * r): each micro-step's gradient is
  the same, so after N micro-steps SGD(1) has moved w by -c * (N // K)."""
  c = np.arange(1.0, 5.0, dtype=np.float32)
  r = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
  graph = tf.Graph()
  with graph.as_default():
    with (strategy or tf.distribute.get_strategy()).scope():
      global_step = tf.compat.v1.train.get_or_create_global_step()
      w = tf.compat.v1.get_variable('w', initializer=np.zeros(4, np.float32))
      table = tf.compat.v1.get_variable(
          'table', initializer=np.zeros([ROWS, WIDTH], np.float32))
      optimizer = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(1.0), GRAD_STEPS,
          use_tpu=use_tpu)

      def step():
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        loss = (tf.reduce_sum(w * c) + tf.reduce_sum(
            tf.nn.embedding_lookup(table, LOOKED_UP) * r)) / replicas
        return optimizer.minimize(loss, global_step=global_step)

      if strategy is None:
        train_op = step()
      else:
        train_op = strategy.group(
            strategy.extended.call_for_each_replica(step))
  return graph, train_op, (global_step, w, table), (c, r)


def _train_constant(use_tpu, runs, threads, strategy=None):
  graph, train_op, variables, _ = _constant_model(use_tpu, strategy)
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    if threads == 1:
      for _ in range(runs):
        session.run(train_op)
    else:
      _run_in_threads(session, train_op, lambda rng: None, runs, threads)
    return session.run(variables)


@pytest.mark.parametrize('trial', range(TRIALS))
def test_every_micro_batch_counts_once(use_tpu, trial):
  """8 threads x 250 runs: global_step and the weights of 2000 micro-steps,
  exactly as 2000 runs in turn leave them (SGD with constant gradients)."""
  del trial
  runs = 250
  step, w, table = _train_constant(use_tpu, runs, THREADS)
  expected_step, expected_w, expected_table = _train_constant(
      use_tpu, runs * THREADS, 1)
  assert step == expected_step == runs * THREADS
  np.testing.assert_array_equal(w, expected_w)
  np.testing.assert_array_equal(table, expected_table)
  _, _, _, (c, r) = _constant_model(use_tpu)
  updates = runs * THREADS // GRAD_STEPS
  np.testing.assert_allclose(w, -c * updates, rtol=1e-5)
  np.testing.assert_allclose(table[LOOKED_UP], -r * updates, rtol=1e-5)


def test_replicas_of_a_mirrored_strategy_take_turns_as_one():
  """Under MirroredStrategy one run holds every replica's micro-step."""
  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:%d' % i for i in range(training.REPLICAS)])
  runs, threads = 60, 4
  step, w, table = _train_constant(False, runs, threads, strategy)
  expected = _train_constant(False, runs * threads, 1, strategy)
  assert step == expected[0] == runs * threads
  np.testing.assert_array_equal(w, expected[1])
  np.testing.assert_array_equal(table, expected[2])


def _fed_model(use_tpu, schedule):
  """Momentum on a dense w, Adagrad on a table's rows, gradients fed; two
  train ops run together, each counting its own step."""
  graph = tf.Graph()
  with graph.as_default():
    steps = [tf.compat.v1.Variable(0, dtype=tf.int64, name='step_%d' % i)
             for i in range(2)]
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(WIDTH, np.float64))
    table = tf.compat.v1.get_variable(
        'table', initializer=np.ones([ROWS, WIDTH], np.float64))
    g = tf.compat.v1.placeholder(tf.float64, [WIDTH])
    r = tf.compat.v1.placeholder(tf.float64, [len(LOOKED_UP), WIDTH])
    grad_steps = (tf.constant(GRAD_STEPS, tf.int64) if schedule else
                  GRAD_STEPS)
    dense = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM),
        grad_steps, use_tpu=use_tpu)
    sparse = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdagradOptimizer(ADAGRAD_RATE), grad_steps,
        use_tpu=use_tpu)
    rows = tf.gather(table, LOOKED_UP)  # an IndexedSlices gradient
    train_op = tf.group(
        dense.minimize(tf.reduce_sum(w * g), global_step=steps[0]),
        sparse.minimize(tf.reduce_sum(rows * r), global_step=steps[1]))
    fetches = [train_op] + [[opt.applied_updates(), opt.micro_step_in_cycle()]
                            for opt in (dense, sparse)]
  return graph, fetches, (g, r), [w, table] + steps


@pytest.mark.parametrize('schedule', [False, True], ids=['int', 'schedule'])
def test_every_cycle_applies_exactly_its_own_micro_batches(use_tpu, schedule):
  """Random gradients, fed: each run says which cycle and place it took;
  Momentum (dense) and Adagrad (a table's rows), applied to the mean of
  each cycle's micro-batches in the order of the cycles, give the weights.
  """
  graph, fetches, (g, r), variables = _fed_model(use_tpu, schedule)
  runs = 150
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    results = _run_in_threads(
        session, fetches,
        lambda rng: {g: rng.randn(WIDTH), r: rng.randn(len(LOOKED_UP), WIDTH)},
        runs)
    w, table, dense_step, sparse_step = session.run(variables)
  cycles = runs * THREADS // GRAD_STEPS
  assert dense_step == sparse_step == runs * THREADS
  dense = np.zeros([cycles, GRAD_STEPS, WIDTH])
  sparse = np.zeros([cycles, GRAD_STEPS, len(LOOKED_UP), WIDTH])
  seen = np.zeros([2, cycles, GRAD_STEPS], int)
  for thread in results:
    for feed, (_, (cycle, place), (sparse_cycle, sparse_place)) in thread:
      dense[cycle, place] = feed[g]
      sparse[sparse_cycle, sparse_place] = feed[r]
      seen[0, cycle, place] += 1
      seen[1, sparse_cycle, sparse_place] += 1
  np.testing.assert_array_equal(seen, 1)  # each place of each cycle once
  velocity = np.zeros(WIDTH)
  expected_w = np.zeros(WIDTH)
  accumulator = np.full([ROWS, WIDTH], np.float32(0.1), np.float64)  # initial
  expected_table = np.ones([ROWS, WIDTH])
  for cycle in range(cycles):
    velocity = MOMENTUM * velocity + dense[cycle].mean(0)
    expected_w -= LEARNING_RATE * velocity
    mean = sparse[cycle].mean(0)
    accumulator[LOOKED_UP] += mean**2
    expected_table[LOOKED_UP] -= ADAGRAD_RATE * mean / np.sqrt(
        accumulator[LOOKED_UP])
  np.testing.assert_allclose(w, expected_w, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(table, expected_table, rtol=1e-9, atol=1e-12)
