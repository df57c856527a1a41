"""XLA sharding of accumulator reads and cross-replica sums (graph checks).

`XlaSharding` runs on CPU as an identity and `CrossReplicaSum` only on a TPU,
so these tests read the graphs the wrapper builds.
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
from models import make_data
from training import assert_same_training
from training import train
from deferred_grad import sharding

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.compiler.xla import xla
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

PARTITIONS = 4
# variable name -> (shape, dimension the rule splits or None)
SHAPES = {
    'scalar': ([], None),
    'vector': ([6], None),
    'wide': ([2, 8], 1),  # fewer rows than columns
    'tall': ([8, 2], 0),
    'square': ([4, 4], 0),
    'cube': ([2, 8, 3], 1),
    'rank4': ([2, 2, 2, 2], None),
}
def _build(use_tpu, **wrapper_kwargs):
  graph = tf.Graph()
  with graph.as_default():
    variables = [
        tf.compat.v1.get_variable(
            name, initializer=np.ones(shape, np.float32))
        for name, (shape, _) in sorted(SHAPES.items())
    ]
    loss = tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        2,
        use_tpu=use_tpu,
        **wrapper_kwargs)
    optimizer.minimize(loss)
  return graph


@pytest.mark.parametrize('partitions', [2, PARTITIONS])
def test_accumulator_reads_are_split_by_the_rule(use_tpu, partitions):
  """Each accumulator's read (when a micro-step adds) is annotated by rank.

  The reads sit in the micro-step's tf.cond, a function under control flow
  v2: every XlaSharding of the graph and its functions is counted.
  """
  graph = _build(use_tpu, xla_num_partitions=partitions)
  tiles = []
  for _, attrs in _all_sharding_nodes(graph):
    proto = sharding.xla_sharding.xla_data_pb2.OpSharding()
    proto.ParseFromString(attrs['sharding'].s)
    assert proto.type == proto.OTHER
    assert list(proto.tile_assignment_devices) == list(range(partitions))
    tiles.append(list(proto.tile_assignment_dimensions))
  expected = []
  for shape, dimension in SHAPES.values():
    if dimension is not None:
      tile = [1] * len(shape)
      tile[dimension] = partitions
      expected.append(tile)
  assert sorted(tiles) == sorted(expected)


def _all_sharding_nodes(graph):
  """(op type, attrs) of every XlaSharding node, in graph and functions."""
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return [(node.op, node.attr) for node in nodes if node.op == 'XlaSharding']


def test_no_sharding_without_partitions(use_tpu):
  assert not _all_sharding_nodes(_build(use_tpu))


def test_split_dimension_rule():
  for shape, dimension in SHAPES.values():
    assert sharding.split_dimension(shape) == dimension
  assert sharding.split_dimension([None, 3]) == 0


def test_sharded_training_matches_large_batch(use_tpu):
  data = make_data(models.CYCLES, 2 * models.MICRO_BATCH)
  expected, _, _ = train(models.OPTIMIZERS['Momentum'], data)
  actual, _, _ = train(
      models.OPTIMIZERS['Momentum'],
      data,
      grad_steps=2,
      use_tpu=use_tpu,
      xla_num_partitions=2)
  assert_same_training(actual, expected)


def _all_ops(graph):
  """(type, input names) of every node, in the graph and its functions.

  Control flow v2 builds `tf.cond` branches as functions.
  """
  graph_def = graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  return [(node.op, list(node.input)) for node in nodes]


def crs_train_op(use_tpu, grad_steps, nonfinite_policy=None):
  """minimize() with apply_crs_to_grad=True; its variables a, b, c."""
  variables = [
      tf.compat.v1.get_variable(name, initializer=np.ones([3], np.float32))
      for name in ['a', 'b', 'c']
  ]
  loss = tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
  return deferred_grad.GradientAggregationOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1), grad_steps,
      apply_crs_to_grad=True, use_tpu=use_tpu,
      nonfinite_policy=nonfinite_policy).minimize(loss)


@pytest.mark.parametrize('policy', [None, 'skip_micro_batch'])
@pytest.mark.parametrize('grad_steps', [1, 2])
def test_cross_replica_sum_on_accumulated_gradients(use_tpu, grad_steps,
                                                    policy):
  """Built in an XLA computation, as a TPU's: one sum per gradient.

  CrossReplicaSum runs only on a TPU (not even under xla.compile on CPU),
  so this reads the graph. With a policy, the cycle's counts are summed
  over cores too, and the number of cores is counted with one.
  """
  graph = tf.Graph()
  with graph.as_default():
    xla.compile(lambda: crs_train_op(use_tpu, grad_steps, policy))
  sums = [op for op, _ in _all_ops(graph) if op == 'CrossReplicaSum']
  assert len(sums) == 3 + (2 if policy else 0)
  without = _build(use_tpu)
  assert 'CrossReplicaSum' not in [op for op, _ in _all_ops(without)]
