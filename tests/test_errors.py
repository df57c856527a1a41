"""Bad input fails early, naming the argument and what was expected."""

import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import test_schedules
import test_sharding
import training
from deferred_grad import compat

GradientAggregationOptimizer = deferred_grad.GradientAggregationOptimizer


def _sgd():
  return tf.compat.v1.train.GradientDescentOptimizer(0.1)


@pytest.mark.parametrize('grad_steps, error', [
    (0, ValueError),
    (-2, ValueError),
    (2.5, TypeError),
    (4.0, TypeError),
    (True, TypeError),
    ('4', TypeError),
    (None, TypeError),
])
def test_grad_steps_must_be_a_positive_int(grad_steps, error):
  with pytest.raises(error, match='grad_steps .*%r' % (grad_steps,)):
    GradientAggregationOptimizer(_sgd(), grad_steps)


def test_numpy_int_grad_steps_is_accepted():
  assert GradientAggregationOptimizer(_sgd(), np.int64(3)).grad_steps == 3


@pytest.mark.parametrize('opt', [
    None, 'sgd', tf.keras.optimizers.SGD(0.1)
])
def test_opt_must_be_a_v1_optimizer(opt):
  with pytest.raises(TypeError, match='opt must be a tf.compat.v1.train.Opt'):
    GradientAggregationOptimizer(opt, 2)


@pytest.mark.parametrize('value, error', [(0, ValueError), (2.0, TypeError),
                                          (True, TypeError)])
def test_xla_num_partitions(value, error):
  with pytest.raises(error, match='xla_num_partitions'):
    GradientAggregationOptimizer(_sgd(), 2, xla_num_partitions=value)


@pytest.mark.parametrize('argument',
                         ['apply_crs_to_grad', 'use_tpu', 'sparse_as_dense'])
def test_flags_must_be_bool(argument):
  with pytest.raises(TypeError, match=argument + " must be a bool, got 'False'"):
    GradientAggregationOptimizer(_sgd(), 2, **{argument: 'False'})


def test_applied_updates_checks_grad_steps():
  with pytest.raises(ValueError, match='grad_steps'):
    deferred_grad.applied_updates(tf.constant(3), 0)


def _variables():
  return [
      tf.compat.v1.get_variable(name, initializer=np.ones([2], np.float32))
      for name in ['first', 'second']
  ]


def test_all_none_gradients_name_the_variables(use_tpu):
  with tf.Graph().as_default():
    variables = _variables()
    optimizer = GradientAggregationOptimizer(_sgd(), 2, use_tpu=use_tpu)
    with pytest.raises(ValueError,
                       match=r"No gradients .*'first:0', 'second:0'"):
      optimizer.apply_gradients([(None, v) for v in variables])


def test_empty_grads_and_vars():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='No variables provided'):
      GradientAggregationOptimizer(_sgd(), 2).apply_gradients([])


def test_global_step_must_be_a_variable():
  with tf.Graph().as_default():
    variables = _variables()
    with pytest.raises(TypeError, match='global_step must be None or a tf.Var'):
      GradientAggregationOptimizer(_sgd(), 2).apply_gradients(
          [(tf.ones([2]), v) for v in variables], global_step=tf.constant(0))


def test_name_must_be_a_string():
  with tf.Graph().as_default():
    variables = _variables()
    with pytest.raises(TypeError, match='name must be None or a string'):
      GradientAggregationOptimizer(_sgd(), 2).apply_gradients(
          [(tf.ones([2]), v) for v in variables], name=3)


@pytest.mark.parametrize('gradient', [
    [1.0, -3.0], np.array([1.0, -3.0], np.float32)])
@pytest.mark.parametrize('grad_steps', [1, 3])
def test_a_gradient_given_as_a_list_or_array_trains_as_the_bare(
    gradient, grad_steps, use_tpu):
  # The bare optimizer converts what it is given; so does the wrapper.
  def run(wrap):
    with tf.Graph().as_default():
      variable = tf.compat.v1.get_variable(
          'v', initializer=np.array([1.0, 2.0], np.float32))
      optimizer = _sgd()
      if wrap:
        optimizer = GradientAggregationOptimizer(optimizer, grad_steps,
                                                 use_tpu=use_tpu)
      train_op = optimizer.apply_gradients([(gradient, variable)])
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for _ in range(grad_steps if wrap else 1):
          session.run(train_op)
        return session.run(variable)
  # The same gradient on every micro-batch: the mean is that gradient.
  np.testing.assert_allclose(run(True), run(False), rtol=1e-6)
  np.testing.assert_allclose(run(True), [0.9, 2.3], rtol=1e-6)


@pytest.mark.parametrize('gradient, dtype', [
    (lambda: tf.constant([1.0, 1.0], tf.float64), 'float64'),
    (lambda: tf.constant([1, 1]), 'int32'),
    (lambda: tf.IndexedSlices(tf.constant([1.0], tf.float64),
                              tf.constant([0]), tf.constant([2])),
     'float64'),
])
@pytest.mark.parametrize('grad_steps', [1, 3])
def test_a_gradient_of_another_dtype_than_its_variable_is_refused(
    gradient, dtype, grad_steps, use_tpu):
  # The bare optimizer refuses it (or, on a resource variable, TensorFlow
  # aborts at run time); the wrapper would cast it into its accumulator.
  with tf.Graph().as_default():
    variables = _variables()
    optimizer = GradientAggregationOptimizer(_sgd(), grad_steps,
                                             use_tpu=use_tpu)
    with pytest.raises(TypeError, match=r'grads_and_vars\[1\]: the gradient '
                       'of second:0 has dtype %s; expected float32' % dtype):
      optimizer.apply_gradients([(tf.ones([2]), variables[0]),
                                 (gradient(), variables[1])])


def test_a_gradient_that_is_no_tensor_is_refused():
  with tf.Graph().as_default():
    variables = _variables()
    with pytest.raises(TypeError, match=r'grads_and_vars\[0\]: the gradient '
                       'of first:0 must be None or convertible'):
      GradientAggregationOptimizer(_sgd(), 2).apply_gradients(
          [({'a': 1}, variables[0])])


@pytest.mark.parametrize('grad_steps', [1, 2])
def test_a_tensor_in_place_of_a_variable_cannot_be_updated(grad_steps):
  # As with the bare optimizer: compute_gradients may list a Tensor, but
  # apply_gradients updates variables only.
  with tf.Graph().as_default():
    x = tf.constant(1.0)
    optimizer = GradientAggregationOptimizer(_sgd(), grad_steps)
    grads_and_vars = optimizer.compute_gradients(x * x, [x])
    assert grads_and_vars[0][1] is x
    with tf.compat.v1.Session() as session:
      assert session.run(grads_and_vars[0][0]) == 2.0
    with pytest.raises(NotImplementedError,
                       match=r'grads_and_vars\[0\]: apply_gradients updates '
                       'variables; got <tf.Tensor'):
      optimizer.apply_gradients(grads_and_vars)


def test_gpu_path_refuses_cross_replica_context():
  with tf.Graph().as_default():
    strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
    with strategy.scope():
      variables = _variables()
      optimizer = GradientAggregationOptimizer(_sgd(), 2)
      with pytest.raises(RuntimeError, match='replica context'):
        optimizer.apply_gradients([(tf.ones([2]), v) for v in variables])


@pytest.mark.parametrize('call', ['minimize', 'compute_gradients'])
def test_minimize_outside_the_replica_context_says_where(call):
  """The usual mistake: minimize() directly under strategy.scope().

  Else it fails deep in TensorFlow ("DistributedVariable.handle is not
  available outside the replica context"), which says nothing of where to
  call it.
  """
  with tf.Graph().as_default():
    strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
    with strategy.scope():
      variables = _variables()
      loss = tf.add_n([tf.reduce_sum(v) for v in variables])
      optimizer = GradientAggregationOptimizer(_sgd(), 2)
      with pytest.raises(RuntimeError, match=r'compute_gradients \(and '
                         r'minimize\) must be called in a replica context.*'
                         'call_for_each_replica'):
        getattr(optimizer, call)(loss)


def test_newer_tensorflow_warns_naming_the_tested_range(monkeypatch):
  newer = types.ModuleType('tensorflow')
  newer.__version__ = '2.22.0'
  monkeypatch.setitem(sys.modules, 'tensorflow', newer)
  with pytest.warns(UserWarning, match='tested with TensorFlow 2.15 to 2.21; '
                    'found TensorFlow 2.22.0'):
    assert compat.import_tensorflow() is newer


def test_missing_tensorflow(monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorflow', None)
  with pytest.raises(ImportError, match='needs TensorFlow 2.15 to 2.21'):
    compat.import_tensorflow()


@pytest.mark.parametrize('version', ['2.14.1', '1.15.5'])
def test_old_tensorflow(monkeypatch, version):
  old = types.ModuleType('tensorflow')
  old.__version__ = version
  monkeypatch.setitem(sys.modules, 'tensorflow', old)
  with pytest.raises(ImportError, match='found TensorFlow %s' % version):
    compat.import_tensorflow()


def test_supported_tensorflow_imports():
  assert compat.import_tensorflow() is tf


@pytest.mark.parametrize('kwargs, error, message', [
    ({'nonfinite_policy': 'skip'}, ValueError, 'nonfinite_policy must be one'),
    ({'accumulator_dtype': tf.int32}, ValueError, 'accumulator_dtype must be'),
    ({'accumulator_dtype': 'no_such_dtype'}, TypeError,
     "accumulator_dtype must be None or a float dtype.*'no_such_dtype'"),
    ({'clip_norm': 0}, ValueError, 'clip_norm must be None or a positive'),
    ({'clip_norm': -1.0}, ValueError, 'clip_norm must be None or a positive'),
    ({'clip_norm': '1.0'}, TypeError, 'clip_norm must be None or a positive'),
    ({'clip_norm': True}, TypeError, 'clip_norm must be None or a positive'),
])
def test_numerics_keywords(kwargs, error, message):
  with pytest.raises(error, match=message):
    GradientAggregationOptimizer(_sgd(), 2, **kwargs)


def test_accumulator_dtype_needs_a_known_shape():
  with tf.Graph().as_default():
    v = models.unknown_shape_variable([1.0, 2.0])
    optimizer = GradientAggregationOptimizer(
        _sgd(), 2, accumulator_dtype=tf.float64)
    with pytest.raises(ValueError, match='accumulator_dtype=float64 needs '
                       'variables of known shape'):
      optimizer.minimize(tf.reduce_sum(v))


def test_a_table_of_unknown_shape_is_accumulated_densely_or_not_at_all():
  """A sparse gradient of a variable of unknown shape cannot be listed by
  rows (a list's columns are its row's): a ValueError at graph build names
  it and sparse_as_dense=True, with which it trains as the large batch."""
  start = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
  ids = [0, 2, 0]

  def loss(v):
    return tf.reduce_sum(tf.square(tf.gather(v, ids)))

  with tf.Graph().as_default():
    v = models.unknown_shape_variable(start)
    optimizer = GradientAggregationOptimizer(_sgd(), 2)
    with pytest.raises(ValueError, match=r"of v:0, of shape <unknown>.*"
                       r"Give the variable a static shape, or "
                       r"sparse_as_dense=True"):
      optimizer.minimize(loss(v))
  with tf.Graph().as_default():
    v = models.unknown_shape_variable(start)
    train_op = GradientAggregationOptimizer(
        _sgd(), 2, sparse_as_dense=True).minimize(loss(v))
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(2):
        session.run(train_op)
      actual = session.run(v)
  gradient = np.zeros_like(start)
  for i in ids:
    gradient[i] += 2 * start[i]
  np.testing.assert_allclose(actual, start - 0.1 * gradient, rtol=1e-6)


@pytest.mark.parametrize('kwargs, error, message', [
    ({'aggregation': 'average'}, ValueError, 'aggregation must be one of'),
    ({'micro_batch_weight': 3}, TypeError, 'micro_batch_weight must be None'),
])
def test_aggregation_keywords(kwargs, error, message):
  with pytest.raises(error, match=message):
    GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), 2, **kwargs)


def test_weight_must_be_a_scalar():
  with tf.Graph().as_default():
    v = tf.compat.v1.get_variable('v', initializer=[1.0, 2.0])
    optimizer = GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), 2,
        micro_batch_weight=tf.ones([2]))
    with pytest.raises(ValueError, match='micro_batch_weight must be a scalar'):
      optimizer.minimize(tf.reduce_sum(v))


# --------------------------------------------- what would train silently wrong

@pytest.mark.parametrize('accumulator_dtype, variable_dtype', [
    (tf.float16, tf.float32), (tf.float32, tf.float64),
    (tf.bfloat16, tf.float16), (tf.float16, tf.bfloat16)])
def test_accumulator_narrower_than_the_variable_is_refused(
    accumulator_dtype, variable_dtype, use_tpu):
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', [2], dtype=variable_dtype)
    optimizer = GradientAggregationOptimizer(
        _sgd(), 2, use_tpu=use_tpu, accumulator_dtype=accumulator_dtype)
    with pytest.raises(ValueError, match='accumulator_dtype=%s cannot hold '
                       'the gradients of w.* dtype is %s' % (
                           accumulator_dtype.name, variable_dtype.name)):
      optimizer.minimize(tf.reduce_sum(tf.cast(w, tf.float32)))


@pytest.mark.parametrize('accumulator_dtype, variable_dtype', [
    (tf.float32, tf.float16), (tf.float32, tf.bfloat16),
    (tf.float64, tf.float32), (tf.float32, tf.float32)])
def test_accumulator_as_wide_or_wider_is_accepted(accumulator_dtype,
                                                  variable_dtype):
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', [2], dtype=variable_dtype)
    optimizer = GradientAggregationOptimizer(
        _sgd(), 2, accumulator_dtype=accumulator_dtype)
    optimizer.minimize(tf.reduce_sum(tf.cast(w, tf.float32)))
    assert optimizer.get_slot(w, 'grad_accum').dtype.base_dtype == (
        accumulator_dtype)


def _weighted_run(weights, use_tpu, grad_steps=3, **wrapper_kwargs):
  """Runs SGD(1) on w with gradient [1, 2] and each of `weights` in turn.

  Returns w afterwards.
  """
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
    weight = tf.compat.v1.placeholder(tf.float32, [])
    optimizer = GradientAggregationOptimizer(
        _sgd_with_rate(1.0), grad_steps, use_tpu=use_tpu,
        micro_batch_weight=weight, **wrapper_kwargs)
    train_op = optimizer.minimize(tf.reduce_sum(w * [1.0, 2.0]))
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for value in weights:
        session.run(train_op, {weight: value})
      return session.run(w)


def _sgd_with_rate(rate):
  return tf.compat.v1.train.GradientDescentOptimizer(rate)


@pytest.mark.parametrize('grad_steps', [1, 3])
@pytest.mark.parametrize('bad', [-2.0, np.nan, np.inf, -np.inf])
def test_a_bad_weight_fails_its_micro_step(bad, grad_steps, use_tpu):
  """Negative: the cycle's weights would sum below 0 and apply nothing;
  NaN or inf: the update would be nothing or NaN. Without a policy each
  fails its micro-step, before anything is added, naming the argument."""
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'micro_batch_weight must be a finite number >= 0'
                     r'[\s\S]*at this micro-step it is\] \[%s\]' % (
                         {-2.0: '-2'}.get(bad, bad),)):
    _weighted_run([3.0, bad, 1.0], use_tpu, grad_steps=grad_steps)


@pytest.mark.parametrize('policy', ['skip_micro_batch', 'skip_cycle'])
@pytest.mark.parametrize('bad', [np.nan, np.inf])
def test_a_nonfinite_weight_is_skipped_by_a_policy(policy, bad, use_tpu):
  """With a policy a NaN or inf weight makes its micro-batch non-finite."""
  weights = [3.0, bad, 1.0, 2.0, 2.0, 4.0]
  applied = -_weighted_run(weights, use_tpu, nonfinite_policy=policy)
  gradient = np.array([1.0, 2.0])
  # Cycle 1 without its bad micro-batch (or nothing), cycle 2 whole; each
  # the weighted mean of one gradient: the gradient itself.
  expected = gradient * (2 if policy == 'skip_micro_batch' else 1)
  np.testing.assert_allclose(applied, expected, rtol=1e-6)


def test_a_negative_weight_fails_also_with_a_policy(use_tpu):
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='micro_batch_weight must be a finite number >= 0'):
    _weighted_run([3.0, -1.0, 1.0], use_tpu,
                  nonfinite_policy='skip_micro_batch')


@pytest.mark.parametrize('weight', [-1.0, float('nan'), float('inf')])
def test_a_bad_constant_weight_is_refused_at_graph_build(weight):
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', [2])
    optimizer = GradientAggregationOptimizer(
        _sgd(), 2, micro_batch_weight=tf.constant(weight))
    with pytest.raises(ValueError, match='micro_batch_weight must be a '
                       r'finite number >= 0.*got %s' % weight):
      optimizer.minimize(tf.reduce_sum(w))


@pytest.mark.parametrize('weight', [
    lambda: tf.constant('7'), lambda: tf.constant(True),
    lambda: tf.constant(1 + 2j)])
def test_a_weight_that_is_no_number_is_refused_at_graph_build(weight):
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', [2])
    optimizer = GradientAggregationOptimizer(_sgd(), 2,
                                             micro_batch_weight=weight)
    with pytest.raises(TypeError, match='micro_batch_weight must be a finite '
                       'number >= 0.*got a tensor of dtype'):
      optimizer.minimize(tf.reduce_sum(w))


def test_integer_token_counts_are_weights():
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
    count = tf.compat.v1.placeholder(tf.int64, [])
    optimizer = GradientAggregationOptimizer(_sgd_with_rate(1.0), 2,
                                             micro_batch_weight=count)
    feed = tf.compat.v1.placeholder(tf.float32, [2])
    train_op = optimizer.apply_gradients([(feed, w)])
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(train_op, {feed: [1.0, 0.0], count: 3})
      session.run(train_op, {feed: [0.0, 1.0], count: 1})
      np.testing.assert_allclose(-session.run(w), [0.75, 0.25], rtol=1e-6)


def test_tpu_path_under_a_multi_replica_strategy_is_refused():
  """The TPU path applies inside tf.cond, where merge_call cannot run."""
  with tf.Graph().as_default():
    strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
    with strategy.scope():
      w = tf.compat.v1.get_variable('w', [2])
      optimizer = GradientAggregationOptimizer(_sgd(), 2, use_tpu=True)
      with pytest.raises(ValueError, match='use_tpu=True under '
                         'MirroredStrategy with 2 replicas.*use_tpu=False'):
        strategy.extended.call_for_each_replica(
            lambda: optimizer.minimize(tf.reduce_sum(w)))


# ------------------------------------------- schedules and topologies --


@pytest.mark.parametrize('grad_steps, error, message', [
    (tf.constant(2.0), TypeError, 'dtype float32'),
    (tf.constant([2, 3]), ValueError, 'shape'),
    (tf.constant(0), ValueError, 'gave 0'),
    (lambda updates: 2.0, TypeError, 'the callable gave 2.0'),
    (lambda updates: tf.constant(2.0), TypeError, 'dtype float32'),
    (lambda updates: tf.zeros([2], tf.int64), ValueError, 'shape'),
    (lambda updates: 0, ValueError, 'the callable gave 0'),
])
def test_a_bad_schedule_is_refused_at_graph_build(grad_steps, error, message):
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
    loss, _ = models.model_loss(x, y)
    if tf.is_tensor(grad_steps):  # a tensor of this graph
      grad_steps = tf.constant(tf.get_static_value(grad_steps))
    with pytest.raises(error, match='grad_steps.*' + message):
      deferred_grad.GradientAggregationOptimizer(
          models.sgd(), grad_steps).minimize(loss)


def test_a_schedule_below_one_fails_at_the_cycles_first_micro_step(use_tpu):
  data = test_schedules._data('mlp', [2, 1])  # pylint: disable=protected-access
  trainer = test_schedules.Scheduled(models.sgd, 'tensor', use_tpu=use_tpu)
  cycles = test_schedules._cycles(data, [2, 1])  # pylint: disable=protected-access
  with trainer.session() as session:
    trainer.run(session, cycles[:1], [2])
    before = session.run(trainer.variables)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r'grad_steps \(a schedule\) must be at least 1'):
      trainer.micro_step(session, cycles[1][0], 0)
    after = session.run(trainer.variables)
  training.assert_same_training([after], [before], rtol=0, atol=0)


@pytest.mark.parametrize('grad_steps', [lambda updates: 2, 'tensor'])
def test_the_applied_updates_helper_refuses_a_schedule(grad_steps):
  with tf.Graph().as_default():
    if grad_steps == 'tensor':
      grad_steps = tf.constant(2)
    step = tf.compat.v1.train.get_or_create_global_step()
    with pytest.raises(TypeError, match=r'grad_steps.*applied_updates\(\)'):
      deferred_grad.applied_updates(step, grad_steps)


@pytest.mark.parametrize('grad_steps', [1, 2])
def test_cross_replica_sum_outside_a_tpu_computation_raises(use_tpu,
                                                            grad_steps):
  """It would fail at the first session.run: "No registered
  'CrossReplicaSum' OpKernel for 'CPU' devices"."""
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='apply_crs_to_grad=True .* only '
                       'inside a TPU computation'):
      test_sharding.crs_train_op(use_tpu, grad_steps)


def test_parameter_server_strategy_is_refused_at_graph_build():
  # Its variable placement would share the accumulators among workers.
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
      tf.train.ClusterSpec({'worker': ['127.0.0.1:1', '127.0.0.1:2'],
                            'ps': ['127.0.0.1:3']}),
      task_type='worker', task_id=1)
  strategy = tf.compat.v1.distribute.experimental.ParameterServerStrategy(
      resolver)
  with tf.Graph().as_default(), strategy.scope():
    w = tf.compat.v1.get_variable('w', [3])

    def step():
      opt = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)
      return opt.minimize(tf.reduce_sum(w * w))

    with pytest.raises(RuntimeError, match='replica_device_setter'):
      strategy.extended.call_for_each_replica(step)


def test_sync_replicas_optimizer_is_refused_at_graph_build():
  # In either order: SyncReplicasOptimizer's rounds and stale-gradient drops
  # do not keep cycles of micro-batches together.
  sgd = tf.compat.v1.train.GradientDescentOptimizer(1.0)
  sync = tf.compat.v1.train.SyncReplicasOptimizer(sgd, replicas_to_aggregate=2)
  with pytest.raises(TypeError, match=r'^opt is a SyncReplicasOptimizer\. '
                     'SyncReplicasOptimizer does not compose'):
    deferred_grad.GradientAggregationOptimizer(sync, 2)
  with tf.Graph().as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable('w', [3])
    wrapper = deferred_grad.GradientAggregationOptimizer(sgd, 2)
    outer = tf.compat.v1.train.SyncReplicasOptimizer(wrapper,
                                                     replicas_to_aggregate=2)
    with pytest.raises(ValueError, match=r'wrapped by a SyncReplicasOptimizer'
                       r'\. SyncReplicasOptimizer does not compose'):
      outer.minimize(tf.reduce_sum(w * w), global_step=global_step)


def _scheduled_linear(grad_steps, use_tpu, **kwargs):
  """SGD on w . x, grad_steps a schedule tensor; returns the pieces."""
  global_step = tf.compat.v1.train.get_or_create_global_step()
  x = tf.compat.v1.placeholder(tf.float32, [2])
  w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
  train_op = deferred_grad.GradientAggregationOptimizer(
      _sgd(), grad_steps, use_tpu=use_tpu, **kwargs).minimize(
          tf.reduce_sum(w * x), global_step=global_step)
  return train_op, x


@pytest.mark.parametrize('fed', [[3, 3], [[2]], []])
def test_a_schedule_fed_a_non_scalar_fails_naming_grad_steps(fed, use_tpu):
  """A placeholder of unknown shape: the micro-step fails, nothing moves."""
  with tf.Graph().as_default():
    grad_steps = tf.compat.v1.placeholder(tf.int64, None)
    train_op, x = _scheduled_linear(grad_steps, use_tpu)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(train_op, {grad_steps: 2, x: [1.0, 1.0]})
      before = session.run(tf.compat.v1.global_variables())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r'grad_steps \(a schedule\).*a scalar'):
        session.run(train_op, {grad_steps: np.array(fed, np.int64),
                               x: [1.0, 1.0]})
      after = session.run(tf.compat.v1.global_variables())
  for value, was in zip(after, before):
    np.testing.assert_array_equal(value, was)


@pytest.mark.parametrize('policy', ['skip_micro_batch', 'skip_cycle'])
def test_a_schedule_of_zero_fails_before_a_skipped_micro_batch_counts(
    policy, use_tpu):
  """A variable grad_steps set to 0 before the first micro-step, on a
  micro-batch the policy skips: global_step, the cycle's counters and the
  skip counters stay where they were."""
  with tf.Graph().as_default():
    grad_steps = tf.compat.v1.Variable(3, dtype=tf.int64, name='grad_steps')
    train_op, x = _scheduled_linear(grad_steps, use_tpu,
                                    nonfinite_policy=policy)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(grad_steps.assign(0))
      before = {v.op.name: session.run(v)
                for v in tf.compat.v1.global_variables()}
      assert {'cycle_length', 'applied_updates', 'skipped_cycles',
              'skipped_micro_batches', 'global_step'} <= set(before)
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r'grad_steps \(a schedule\) must be at least 1'):
        session.run(train_op, {x: [np.nan, 1.0]})
      for v in tf.compat.v1.global_variables():
        np.testing.assert_array_equal(session.run(v), before[v.op.name],
                                      err_msg=v.op.name)


def _learning_rate_with_summary():
  rate = tf.constant(0.1)
  tf.compat.v1.summary.scalar('learning_rate', rate)
  return rate


@pytest.mark.parametrize('grad_steps, policy', [
    (3, None), (1, 'skip_cycle')], ids=['a_cycle', 'a_policy'])
def test_a_summary_made_while_applying_fails_naming_it(grad_steps, policy,
                                                       use_tpu):
  """Made inside the apply step's cond (a cycle's end, or a policy's
  decision), a summary could not be fetched or merged: named at graph
  build."""
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.ones(2, np.float32))
    optimizer = GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(
            _learning_rate_with_summary), grad_steps, use_tpu=use_tpu,
        nonfinite_policy=policy)
    with pytest.raises(ValueError, match='summaries .*learning_rate.* '
                       'outside minimize'):
      optimizer.minimize(tf.reduce_sum(w * w))


def test_at_grad_steps_one_a_summary_made_while_applying_is_merged(use_tpu):
  """With grad_steps=1 and no decision the apply step is no cond: the
  summary is merged and holds the rate, and training is the bare
  optimizer's."""
  data = models.make_data(models.CYCLES, models.MICRO_BATCH)
  expected, _, _ = training.train(models.OPTIMIZERS['GradientDescent'], data)
  trainer = training.Trainer(
      lambda step: tf.compat.v1.train.GradientDescentOptimizer(
          _learning_rate_with_summary), 1, use_tpu=use_tpu)
  with trainer.graph.as_default():
    merged = tf.compat.v1.summary.merge_all()
  with trainer.session() as session:
    actual = trainer.run(session, data)
    summary = tf.compat.v1.Summary.FromString(session.run(merged))
  training.assert_same_training(actual, expected)
  assert [v.simple_value for v in summary.value] == [pytest.approx(0.1)]
