"""Bad input fails early, naming the argument and what was expected."""

import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
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

  It used to fail deep in TensorFlow ("DistributedVariable.handle is not
  available outside the replica context").
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
