"""compat.py: what it finds out about TensorFlow, by public means where one
exists (its private names, `compat.PRIVATE_NAMES`, are tested where they
matter: tests/test_xla.py, tests/test_multi_worker.py, tests/test_costs.py;
and listed whole by tests/test_private_names.py)."""

import numpy as np
import tensorflow as tf

import deferred_grad
from deferred_grad import compat
from deferred_grad import registry


def test_multi_worker_mode_is_read_off_the_cluster_resolver():
  mirrored = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  assert not compat.in_multi_worker_mode(mirrored)
  assert not compat.in_multi_worker_mode(tf.distribute.get_strategy())

  class Clustered(object):
    def __init__(self, spec):
      self.cluster_resolver = tf.distribute.cluster_resolver.\
          SimpleClusterResolver(tf.train.ClusterSpec(spec))

  assert compat.in_multi_worker_mode(Clustered(
      {'worker': ['a:1', 'b:1']}))
  assert compat.in_multi_worker_mode(Clustered(
      {'worker': ['a:1'], 'ps': ['b:1']}))
  assert not compat.in_multi_worker_mode(Clustered({'worker': ['a:1']}))


def test_a_replica_updates_its_own_component():
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  with tf.Graph().as_default(), strategy.scope():
    v = tf.compat.v1.Variable(1.0)
    found = strategy.extended.call_for_each_replica(
        lambda: compat.replica_components([v])[0])
    components = strategy.experimental_local_results(v)
    assert list(strategy.experimental_local_results(found)) == list(
        components)


def test_hooks_read_a_plain_global_step():
  """The read hooks cache is a plain read of the step (multi-worker)."""
  with tf.Graph().as_default() as graph:
    step = tf.compat.v1.train.get_or_create_global_step()
    compat.plain_global_step_read(step)
    compat.plain_global_step_read(step)  # once: the same read
    read = registry.of(graph).plain_read
    assert read is not None and read.op.type == 'Identity'
    assert [op for op in graph.get_operations()
            if op.name.endswith('plain_read')] == [read.op]


def test_object_based_checkpoints_see_the_wrapped_optimizer_s_state():
  with tf.Graph().as_default():
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.AdamOptimizer(0.1), 2)
    w = tf.compat.v1.get_variable('w', initializer=np.ones(2, np.float32))
    optimizer.minimize(
        tf.reduce_sum(w),
        global_step=tf.compat.v1.train.get_or_create_global_step())
    children = optimizer._trackable_children()  # pylint: disable=protected-access
    assert 'beta1_power' in children
