"""XLA sharding of gradient accumulators.

The rule is the original module's, written for Transformer/BERT-like models:
rank-3 tensors are split on dimension 1; rank-2 tensors on dimension 1 when
they have fewer rows than columns, else on dimension 0; tensors of any other
rank are left alone.
"""

from deferred_grad import compat

xla_sharding = compat.import_xla_sharding()


def split_dimension(shape):
  """Returns the dimension the rule splits a tensor of `shape` on, or None.

  Args:
    shape: a `tf.TensorShape` (or a list of ints) of known rank.

  Returns:
    0 or 1, or None when a tensor of this rank is not sharded.
  """
  dims = list(shape)
  if len(dims) == 3:
    return 1
  if len(dims) == 2:
    rows, columns = dims
    # An unknown size compares as "not fewer rows", which keeps the original's
    # choice of dimension 0 for it.
    if rows is not None and columns is not None and rows < columns:
      return 1
    return 0
  return None


def shard(tensor, num_partitions):
  """Annotates `tensor` with the XLA sharding of the rule above.

  On CPU and GPU without XLA the added `XlaSharding` op is an identity.

  Args:
    tensor: a `tf.Tensor`, typically an accumulator's value.
    num_partitions: the number of partitions, or None for no sharding.

  Returns:
    `tensor` itself when `num_partitions` is None or the rank is not sharded,
    else the output of an `XlaSharding` op.
  """
  if num_partitions is None or tensor.shape.rank is None:
    return tensor
  dimension = split_dimension(tensor.shape.as_list())
  if dimension is None:
    return tensor
  return xla_sharding.split(
      tensor, dimension, num_partitions, use_sharding_op=True)
