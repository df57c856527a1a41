"""Variable and checkpoint names are the original module's."""

import os

import pytest
import tensorflow as tf

import conftest

_MODEL = ['b1', 'b2', 'w1', 'w2']


def _expected_names(use_tpu):
  # The original built the wrapped apply inside a tf.cond: under control flow
  # v1 Adam's non-slot variables land in that cond's name scope.
  non_slot_prefix = '' if tf.compat.v1.control_flow_v2_enabled() else 'cond/'
  names = set(_MODEL) | {'global_step'}
  names |= {non_slot_prefix + 'beta1_power', non_slot_prefix + 'beta2_power'}
  for var in _MODEL:
    names |= {var + '/Adam', var + '/Adam_1', var + '/GradientAccumulator'}
  if use_tpu:
    names.add('update_count')
  return names


@pytest.mark.parametrize('name', [None, 'train'])
def test_checkpoint_keys_are_the_originals(use_tpu, name, tmp_path):
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, conftest.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, conftest.OUTPUT_DIM])
    loss, _ = conftest.model_loss(x, y)
    optimizer = conftest.deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.01), 2, use_tpu=use_tpu)
    grads_and_vars = optimizer.compute_gradients(loss)
    ops_before = set(graph.get_operations())
    train_op = optimizer.apply_gradients(
        grads_and_vars, global_step=global_step, name=name)
    new_ops = [op.name for op in graph.get_operations() if op not in ops_before]
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      path = saver.save(session, os.path.join(str(tmp_path), 'model'))
  keys = {key for key, _ in tf.train.list_variables(path)}
  assert keys == _expected_names(use_tpu)
  # Every op apply_gradients made is in its name scope, but the variables it
  # created (named after variables, as the original's were).
  scope = (name or 'GradientAggregationOptimizer') + '/'
  assert train_op.name.startswith(scope)
  outside = [
      op for op in new_ops if not op.startswith(scope) and
      not any(op == key or op.startswith(key + '/') for key in keys)
  ]
  assert not outside
  trainable = {v.op.name for v in graph.get_collection('trainable_variables')}
  assert trainable == set(_MODEL)
