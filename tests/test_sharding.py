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
_VARIABLE_OPS = ('VarHandleOp', 'VariableV2')


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


def _read_variable(op):
  """Name of the variable whose value `op` reads, through reads/identities."""
  while op.type not in _VARIABLE_OPS:
    op = op.inputs[0].op
  return op.name


def _sharding_ops(graph):
  return [op for op in graph.get_operations() if op.type == 'XlaSharding']


@pytest.mark.parametrize('partitions', [2, PARTITIONS])
def test_accumulator_reads_are_split_by_the_rule(use_tpu, partitions):
  graph = _build(use_tpu, xla_num_partitions=partitions)
  sharded = {}
  for op in _sharding_ops(graph):
    proto = sharding.xla_sharding.xla_data_pb2.OpSharding()
    proto.ParseFromString(op.get_attr('sharding'))
    sharded[_read_variable(op)] = proto
  expected = {
      name + '/GradientAccumulator': (shape, dimension)
      for name, (shape, dimension) in SHAPES.items()
      if dimension is not None
  }
  assert sorted(sharded) == sorted(expected)
  for accumulator, (shape, dimension) in expected.items():
    proto = sharded[accumulator]
    tiles = [1] * len(shape)
    tiles[dimension] = partitions
    assert proto.type == proto.OTHER
    assert list(proto.tile_assignment_dimensions) == tiles
    assert list(proto.tile_assignment_devices) == list(range(partitions))


def test_no_sharding_without_partitions(use_tpu):
  assert not _sharding_ops(_build(use_tpu))


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


@pytest.mark.parametrize('grad_steps', [1, 2])
def test_cross_replica_sum_on_accumulated_gradients(use_tpu, grad_steps):
  graph = tf.Graph()
  with graph.as_default():
    variables = [
        tf.compat.v1.get_variable(name, initializer=np.ones([3], np.float32))
        for name in ['a', 'b', 'c']
    ]
    loss = tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        grad_steps,
        apply_crs_to_grad=True,
        use_tpu=use_tpu)
    optimizer.minimize(loss)
  sums = [op for op, _ in _all_ops(graph) if op == 'CrossReplicaSum']
  assert len(sums) == len(variables)
  without = _build(use_tpu)
  assert 'CrossReplicaSum' not in [op for op, _ in _all_ops(without)]
