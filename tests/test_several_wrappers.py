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

  Under AUTO_REUSE the wrappers used to share one update_count and apply at
  the wrong micro-steps (b never moved); without it, the second raised
  "Variable update_count already exists".
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
                          if not v.op.name.endswith('/GradientAccumulator'))
             for name, wrapper in wrappers.items()}
  # As tf.compat.v1.get_variable (the original's) names them in the scope.
  counters = ['model/' + n for n in (
      'good_micro_batches', 'nonfinite_micro_batches', 'skipped_cycles',
      'skipped_micro_batches', 'update_count')]
  assert names['a'] == counters
  assert names['b'] == [n + '_1' for n in counters]


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


def test_two_train_ops_counting_one_global_step_raise(use_tpu):
  """Each would see every other micro-step: refused at graph build."""
  with pytest.raises(ValueError, match='already counted by another'):
    _linear_graph({'a': 2, 'b': 2}, use_tpu, None, ('a', 'b'))
