"""XLA sharding of accumulators, by the original rule for Transformer models."""

from deferred_grad import compat

xla_sharding = compat.import_xla_sharding()


def split_dimension(shape):
  """Returns the dimension to split a tensor of `shape` on, or None.

  Args:
    shape: a `tf.TensorShape` or a list of ints, of known rank.

  Returns:
    1 at rank 3; at rank 2, 1 if fewer rows than columns, else 0; else None.
  """
  dims = list(shape)
  if len(dims) == 3:
    return 1
  if len(dims) == 2:
    rows, columns = dims
    # An unknown size counts as not fewer rows: dimension 0, as the original.
    if rows is not None and columns is not None and rows < columns:
      return 1
    return 0
  return None


def shard(tensor, num_partitions):
  """Annotates `tensor` with its XLA sharding; an identity without XLA.

  Args:
    tensor: a `tf.Tensor`, typically an accumulator's value.
    num_partitions: the number of partitions, or None for no sharding.

  Returns:
    `tensor` itself, or the `XlaSharding` op's output where it is split.
  """
  if num_partitions is None or tensor.shape.rank is None:
    return tensor
  dimension = split_dimension(tensor.shape.as_list())
  if dimension is None:
    return tensor
  return xla_sharding.split(
      tensor, dimension, num_partitions, use_sharding_op=True)
