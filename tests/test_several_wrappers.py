"""Several train ops in one graph: each cycles on its own variables.

A GAN (generator and discriminator optimizers), a multi-task model or
multi-tower code builds two wrappers in one graph, or one wrapper minimizes
two losses. Each train op owns its counters: no collision, no sharing under
`reuse=AUTO_REUSE`, and each applies at its own micro-steps.
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad

LEARNING_RATE = 0.1
MICRO_STEPS = 12


def _linear_graph(grad_steps, use_tpu, reuse, global_step_for=(), **kwargs):
  """Variables a and b, loss x * a + y * b, a wrapper per variable.

  Returns:
    (graph, train op running both, feeds x and y, {name: variable},
    {name: wrapper}).
  """
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [])
    y = tf.compat.v1.placeholder(tf.float32, [])
    variables, wrappers, train_ops = {}, {}, []
    for name, feed in (('a', x), ('b', y)):
      with tf.compat.v1.variable_scope('model', reuse=reuse):
        variable = tf.compat.v1.get_variable(name, initializer=1.0)
        wrapper = deferred_grad.GradientAggregationOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE),
            grad_steps[name], use_tpu=use_tpu, **kwargs)
        train_ops.append(wrapper.minimize(
            feed * variable, var_list=[variable],
            global_step=global_step if name in global_step_for else None))
      variables[name], wrappers[name] = variable, wrapper
    train_op = tf.group(*train_ops)
  return graph, train_op, (x, y), variables, wrappers


def _by_hand(gradients, grad_steps):
  """SGD on the mean of each cycle's gradients, after every micro-step."""
  value, history = 1.0, []
  for step in range(len(gradients)):
    if step % grad_steps == grad_steps - 1:
      value -= LEARNING_RATE * np.mean(
          gradients[step - grad_steps + 1:step + 1])
    history.append(value)
  return np.array(history)


_FEEDS = np.random.RandomState(0).uniform(0.5, 1.5, size=(2, MICRO_STEPS))


@pytest.mark.parametrize('global_step_for', [(), ('a',), ('b',)])
@pytest.mark.parametrize('reuse', [None, tf.compat.v1.AUTO_REUSE])
@pytest.mark.parametrize('policy', [None, 'skip_micro_batch'])
def test_two_wrappers_cycle_on_their_own(use_tpu, reuse, global_step_for,
                                         policy):
  """a with K=2 and b with K=3, run together: each as if alone, every run.

  Under AUTO_REUSE wrappers sharing one update_count would apply at the
  wrong micro-steps (b would never move); without it, a second
  update_count of the same name would raise "Variable update_count already
  exists".
  """
  grad_steps = {'a': 2, 'b': 3}
  graph, train_op, (x, y), variables, _ = _linear_graph(
      grad_steps, use_tpu, reuse, global_step_for, nonfinite_policy=policy)
  expected = {'a': _by_hand(_FEEDS[0], 2), 'b': _by_hand(_FEEDS[1], 3)}
  with graph.as_default(), tf.compat.v1.Session() as session:
    initialize = tf.compat.v1.global_variables_initializer()
    for _ in range(5):  # an unordered read would show in some of the runs
      session.run(initialize)
      history = {'a': [], 'b': []}
      for step in range(MICRO_STEPS):
        session.run(train_op, {x: _FEEDS[0, step], y: _FEEDS[1, step]})
        for name, value in session.run(variables).items():
          history[name].append(value)
      for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-6,
                                   err_msg=name)


def test_first_train_op_keeps_the_original_names(use_tpu):
  graph, _, _, _, wrappers = _linear_graph(
      {'a': 2, 'b': 3}, use_tpu, tf.compat.v1.AUTO_REUSE,
      nonfinite_policy='skip_cycle')
  with graph.as_default():
    names = {name: sorted(v.op.name for v in wrapper.variables()
                          if not v.op.name.endswith(
                              ('/GradientAccumulator', '/deferred_grad_settings')))
             for name, wrapper in wrappers.items()}
    settings = sorted(v.op.name for wrapper in wrappers.values()
                      for v in wrapper.variables()
                      if v.op.name.endswith('/deferred_grad_settings'))
  # As tf.compat.v1.get_variable (the original's) names them in the scope.
  counters = ['model/' + n for n in (
      'good_micro_batches', 'nonfinite_micro_batches', 'skipped_cycles',
      'skipped_micro_batches', 'update_count')]
  assert names['a'] == counters
  assert names['b'] == [n + '_1' for n in counters]
  # Each train op's settings, in its name scope (not the original's).
  assert len(settings) == 2 and settings[0].endswith(
      'GradientAggregationOptimizer/deferred_grad_settings'), settings


def test_one_wrapper_minimizing_two_losses_in_turn(use_tpu):
  """Two train ops of one wrapper, run alternately, each with its cycle."""
  graph = tf.Graph()
  with graph.as_default():
    feed = tf.compat.v1.placeholder(tf.float32, [])
    a = tf.compat.v1.get_variable('a', initializer=1.0)
    b = tf.compat.v1.get_variable('b', initializer=1.0)
    wrapper = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE), 2,
        use_tpu=use_tpu)
    train_a = wrapper.minimize(feed * a, var_list=[a])
    train_b = wrapper.minimize(feed * b, var_list=[b])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for step in range(MICRO_STEPS):
        session.run(train_a, {feed: _FEEDS[0, step]})
        session.run(train_b, {feed: _FEEDS[1, step]})
      values = session.run([a, b])
  np.testing.assert_allclose(values, [_by_hand(_FEEDS[0], 2)[-1],
                                      _by_hand(_FEEDS[1], 2)[-1]], rtol=1e-6)


@pytest.mark.parametrize('trunk', ['dense', 'table'])
@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Momentum'])
def test_two_train_ops_on_a_shared_trunk_each_train_on_their_own_loss(
    optimizer, trunk, use_tpu):
  """A multi-task model: one wrapper, two losses sharing the trunk `w`.

  Each train op has its own accumulator of `w` (the first the original's
  name): each applies the mean of its own micro-batches only, as the bare
  optimizer with one train op per loss on the large batches. The losses
  are linear, so the gradients do not depend on when the other applies.
  As a table, `w`'s rows are looked up (sparse gradients, row accumulators).
  """
  grad_steps, cycles = 3, 4
  rng = np.random.RandomState(0)
  feeds = rng.randn(2, cycles, grad_steps, 2).astype(np.float32)
  make = {
      'GradientDescent': lambda: tf.compat.v1.train.GradientDescentOptimizer(
          LEARNING_RATE),
      'Momentum': lambda: tf.compat.v1.train.MomentumOptimizer(
          LEARNING_RATE, 0.9)}[optimizer]

  def run(wrapped):
    with tf.Graph().as_default():
      global_step = tf.compat.v1.train.get_or_create_global_step()
      x = [tf.compat.v1.placeholder(tf.float32, [2]) for _ in range(2)]
      w = tf.compat.v1.get_variable('w', initializer=[[1.0, -1.0]] * 3)
      heads = [tf.compat.v1.get_variable('head%d' % i, initializer=1.0)
               for i in range(2)]
      # Loss i reads rows i and 2 of the trunk (the dense one: all of it).
      rows = [tf.nn.embedding_lookup(w, [i, 2]) if trunk == 'table' else w
              for i in range(2)]
      losses = [tf.reduce_sum(rows[i] * x[i]) + heads[i] * x[i][0]
                for i in range(2)]
      opt = make()
      if wrapped:
        opt = deferred_grad.GradientAggregationOptimizer(
            opt, grad_steps, use_tpu=use_tpu)
      train_ops = [opt.minimize(losses[0], global_step=global_step),
                   opt.minimize(losses[1])]
      names = sorted(v.op.name for v in tf.compat.v1.global_variables()
                     if 'GradientAccumulator' in v.op.name)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for cycle in range(cycles):
          if wrapped:  # the two train ops in turn, micro-step by micro-step
            for step in range(grad_steps):
              for i in range(2):
                session.run(train_ops[i], {x[i]: feeds[i, cycle, step]})
          else:  # each on its large batch: the mean of its micro-batches
            for i in range(2):
              session.run(train_ops[i], {x[i]: feeds[i, cycle].mean(0)})
        return session.run([w] + heads), names

  actual, names = run(True)
  expected, _ = run(False)
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
  assert 'w/GradientAccumulator' in names, names
  assert 'w/GradientAccumulator_1' in names, names


def test_two_train_ops_counting_one_global_step_raise(use_tpu):
  """Each would see every other micro-step: refused at graph build."""
  with pytest.raises(ValueError, match='already counted by another'):
    _linear_graph({'a': 2, 'b': 2}, use_tpu, None, ('a', 'b'))
