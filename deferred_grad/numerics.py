"""Numerics of the accumulated gradient: finiteness checks and clipping.

What a `nonfinite_policy` then does with a non-finite micro-batch is
decided in `cycle_state` (`should_apply`, `scale`).
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat

tf = compat.import_tensorflow()


def _values(gradient):
  """The dense values of a Tensor or of an IndexedSlices."""
  return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def map_values(gradient, fn):
  """`fn` applied to a Tensor, or to an IndexedSlices' values (same rows)."""
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(fn(gradient.values), gradient.indices,
                            gradient.dense_shape)
  return fn(gradient)


def weigh(gradients, weight):
  """The gradients times `weight` (in their dtype), or as they are."""
  if weight is None:
    return list(gradients)
  return [map_values(g, lambda x: x * tf.cast(weight, x.dtype))
          for g in gradients]


def cast_like(gradients, var_list):
  """Each gradient cast to its variable's dtype (from the accumulator's)."""
  return [map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
          for g, v in zip(gradients, var_list)]


def all_finite(gradients):
  """A boolean scalar: True if no gradient holds a NaN or an inf.

  For an IndexedSlices, its values: the rows it touches.
  """
  return tf.reduce_all(
      [tf.reduce_all(tf.math.is_finite(_values(g))) for g in gradients])


def clip_by_global_norm(gradients, clip_norm):
  """Clips the accumulated gradients to `clip_norm`, by their global norm.

  Under a multi-replica strategy each replica holds its part of the sum;
  the norm is that of the whole sum, so the parts are all-reduced first,
  and each replica hands on 1/replicas of the clipped sum for the wrapped
  optimizer's own all-reduce to add up.

  Args:
    gradients: the accumulated gradients (Tensors or IndexedSlices).
    clip_norm: the largest global norm.

  Returns:
    The clipped gradients.
  """
  replica_context = tf.distribute.get_replica_context()
  replicas = replica_context.num_replicas_in_sync
  if replicas > 1:
    # stop_gradient: a replica context's all_reduce is differentiable, and in
    # graph mode it walks back from its result through every replica's input
    # to the variables; with ref variables (v1 behaviour) it reaches the
    # mirrored components and fails ("Unsuccessful at finding variable").
    # Nothing differentiates an accumulated gradient: the walk ends here.
    gradients = [tf.stop_gradient(tf.convert_to_tensor(g)) for g in gradients]
    gradients = replica_context.all_reduce(tf.distribute.ReduceOp.SUM,
                                           gradients)
  clipped, _ = tf.clip_by_global_norm(gradients, clip_norm)
  if replicas > 1:
    clipped = [g / replicas for g in clipped]
  return clipped
