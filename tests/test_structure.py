"""The inside stays as the README's Development section draws it.

Building a train op enters few of the package's modules, with few switches
from one to another (the algorithm reads top to bottom in optimizer.py,
its mechanics one call away): a dense model, an embedding table, and both
under MirroredStrategy (its replica threads and merge_call traced). No
module keeps mutable state at module level (state lives on the wrapper,
its train ops' records, and one registry per graph). Under a strategy AutoGraph
converts the replica function, but none of the package's. (The private
TensorFlow names: test_private_names.py.)
"""

import ast
import collections
import importlib
import os
import pkgutil
import sys
import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models

_PACKAGE = os.path.dirname(os.path.abspath(deferred_grad.__file__))


def _trace(build):
  """[[(module, function)] per thread] of the package's calls in `build()`,
  and the code names of every frame AutoGraph generated."""
  calls = collections.defaultdict(list)
  generated = []

  def tracer(frame, event, arg):
    del arg
    if event != 'call':
      return None
    module = frame.f_globals.get('__name__', '')
    if module.startswith('deferred_grad'):
      calls[threading.get_ident()].append((module.split('.')[-1],
                                           frame.f_code.co_name))
    elif '__autograph_generated' in frame.f_code.co_filename:
      generated.append(frame.f_code.co_name)
    return None

  threading.settrace(tracer)
  sys.settrace(tracer)
  try:
    build()
  finally:
    sys.settrace(None)
    threading.settrace(None)
  return list(calls.values()), generated


def _dense_loss():
  w = tf.compat.v1.get_variable('w', [4, 3])
  return tf.reduce_sum(w * w)


def _table_loss():
  table = tf.compat.v1.get_variable('table', [10, 3])
  return tf.reduce_sum(tf.nn.embedding_lookup(table, [1, 2, 2]))


def _build(loss_fn, mirrored=False):
  """A build of one train op (an int grad_steps=4, Momentum, global_step
  given) on the loss `loss_fn` makes, under MirroredStrategy over two CPUs
  or none; its apply_gradients alone is traced."""
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 4)
    if not mirrored:
      pairs = opt.compute_gradients(loss_fn())
      return _trace(lambda: opt.apply_gradients(pairs, global_step))
    strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
    with strategy.scope():
      def replica_step():
        return opt.minimize(loss_fn() / 2, global_step=global_step)
      return _trace(lambda: strategy.extended.call_for_each_replica(
          replica_step))


def _switches(calls_per_thread):
  return sum(1 for calls in calls_per_thread
             for a, b in zip(calls, calls[1:]) if a[0] != b[0])


@pytest.mark.parametrize('loss_fn, mirrored', [
    (_dense_loss, False), (_table_loss, False), (_dense_loss, True)],
                         ids=['dense', 'table', 'mirrored'])
def test_a_train_op_is_built_from_the_optimizer(loss_fn, mirrored, capsys):
  """The build starts in `optimizer.apply_gradients`. The module switches
  a build makes are printed to inform a reader (pytest -s), not pinned: a
  count decided nothing here."""
  calls, _ = _build(loss_fn, mirrored)
  modules = collections.Counter(m for thread in calls for m, _ in thread)
  assert ('optimizer', 'apply_gradients') in [c for thread in calls
                                              for c in thread], calls
  with capsys.disabled():
    print('\nbuild trace: %d module switches over %s' % (
        _switches(calls), dict(modules)))


def _package_functions():
  """The names of the functions and methods the package defines."""
  names = set()
  for name in sorted(os.listdir(_PACKAGE)):
    if name.endswith('.py'):
      with open(os.path.join(_PACKAGE, name)) as source:
        tree = ast.parse(source.read())
      names.update(node.name for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef))
  return names


def test_no_package_function_is_converted_under_a_strategy():
  """AutoGraph converts the replica function (its code runs as tf__...):
  what it calls of the package runs as written."""
  _, generated = _build(_dense_loss, mirrored=True)
  assert 'tf__replica_step' in generated, generated  # the trace sees it
  converted = sorted(set(name[len('tf__'):] for name in generated
                         if name.startswith('tf__')) & _package_functions())
  assert not converted, converted


def test_no_package_function_is_converted_in_a_distributed_model_fn(
    tmp_path):
  """An Estimator model_fn under train_distribute, as users write it."""
  if not hasattr(tf.compat.v1, 'estimator'):
    pytest.skip('tf.estimator was removed after TensorFlow 2.15')
  generated = []

  def model_fn(features, labels, mode):
    loss, _ = models.model_loss(features, labels)
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)
    train_op = opt.minimize(loss, tf.compat.v1.train.get_global_step())
    train_op = opt.once_per_update(train_op, tf.no_op)
    tf.compat.v1.summary.scalar('updates', opt.applied_updates())
    return tf.compat.v1.estimator.EstimatorSpec(mode, loss=loss,
                                                train_op=train_op)

  x, y = models.make_data(1, 4 * models.MICRO_BATCH)
  strategy = tf.distribute.MirroredStrategy(
      ['/cpu:0', '/cpu:1'],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  estimator = tf.compat.v1.estimator.Estimator(
      model_fn, config=tf.compat.v1.estimator.RunConfig(
          model_dir=str(tmp_path), train_distribute=strategy,
          save_summary_steps=None, log_step_count_steps=10**6))
  input_fn = lambda: tf.data.Dataset.from_tensor_slices(
      (x[0], y[0])).batch(models.MICRO_BATCH)
  _, generated = _trace(lambda: estimator.train(input_fn, max_steps=2))
  assert 'tf__model_fn' in generated, sorted(set(generated))
  converted = sorted(set(name[len('tf__'):] for name in generated
                         if name.startswith('tf__')) & _package_functions())
  assert not converted, converted
  assert np.isfinite(estimator.get_variable_value('w1')).all()


def test_no_module_keeps_mutable_state():
  mutable = (dict, list, set, collections.deque, weakref.WeakKeyDictionary,
             weakref.WeakValueDictionary, weakref.WeakSet)
  found = []
  for info in pkgutil.iter_modules([_PACKAGE]):
    module = importlib.import_module('deferred_grad.' + info.name)
    found.extend('%s.%s' % (info.name, name)
                 for name, value in vars(module).items()
                 if not name.startswith('__') and isinstance(value, mutable))
  assert not found, found


def test_the_package_keeps_one_registry_per_graph():
  """Two train ops (dense and a table), the counters, once_per_update,
  deferred_grad.applied_updates and the port check: the package's state in
  the graph is one collection, holding one registry."""
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1), 4,
        nonfinite_policy='skip_micro_batch')
    train_op = opt.minimize(_dense_loss(), global_step=global_step)
    other = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)
    other.minimize(_table_loss())
    deferred_grad.applied_updates(global_step, 4)
    opt.once_per_update(train_op, tf.no_op)
    deferred_grad.PortCheckHook().begin()
    # (A graph lists its string keys only: the package's earlier ones.)
    earlier = ['counted_steps', 'applied_updates', 'warned_raw_global_step',
               'train_ops', 'slot_owners', 'state', 'aliases', 'settings',
               'plain_reads']
    assert not [name for name in earlier
                if graph.get_collection(('deferred_grad', name))]
    registry = graph.get_collection(('deferred_grad', 'registry'))
    assert len(registry) == 1, registry
    assert len(registry[0].records) == 2
    assert [r.wrappers for r in registry[0].records] == [[opt], [other]]
