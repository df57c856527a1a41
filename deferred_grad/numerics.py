"""Numerics of the accumulated gradient: non-finite policies and clipping.

A non-finite policy decides what a micro-batch whose gradient holds a NaN or
an inf does. It is one object with the same small interface for every
policy, called by the optimizer at two points (as optax keeps
`skip_not_finite` pluggable):

* `micro_step(gradients, accumulate)`: the micro-step's op; it calls
  `accumulate()` to build the op that adds the micro-batch, and decides
  whether that op runs.
* `apply(gradients, apply_gradients)`: the apply step's op; it may rescale
  the accumulated gradients and decides whether `apply_gradients(gradients)`
  runs.
* `reset(after)`: ops that start the next cycle's bookkeeping.

`policy(name)` returns the object for a `nonfinite_policy` keyword.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat

tf = compat.import_tensorflow()

NONFINITE_POLICIES = (None, 'skip_micro_batch', 'skip_cycle')


def _values(gradient):
  """The dense values of a Tensor or of an IndexedSlices."""
  return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def map_values(gradient, fn):
  """`fn` applied to a Tensor, or to an IndexedSlices' values (same rows)."""
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(fn(gradient.values), gradient.indices,
                            gradient.dense_shape)
  return fn(gradient)


def all_finite(gradients):
  """A boolean scalar: True if no gradient holds a NaN or an inf."""
  return tf.reduce_all(
      [tf.reduce_all(tf.math.is_finite(_values(g))) for g in gradients])


class KeepNonfinite(object):
  """`nonfinite_policy=None`, the original's: accumulate every micro-batch."""

  name = None
  skipped_micro_batches = None
  skipped_cycles = None

  def create_variables(self):
    pass

  def micro_step(self, gradients, accumulate):
    del gradients
    return accumulate()

  def apply(self, gradients, apply_gradients):
    return apply_gradients(gradients)

  def reset(self, after):
    del after
    return []

  def variables(self):
    return []


class _SkipNonfinite(KeepNonfinite):
  """Checks every micro-batch, adds only finite ones, and counts them.

  Its variables (int64 scalars, saved in checkpoints):
    good_micro_batches: finite micro-batches in the current cycle.
    skipped_micro_batches, skipped_cycles: totals of what was skipped.

  Args:
    grad_steps: micro-steps per cycle.
  """

  def __init__(self, grad_steps):
    self._grad_steps = grad_steps
    self.good_micro_batches = None

  def create_variables(self):
    if self.good_micro_batches is not None:
      return
    counter = lambda name: tf.compat.v1.get_variable(  # pylint: disable=g-long-lambda
        name, shape=[], dtype=tf.int64,
        initializer=tf.compat.v1.zeros_initializer(), trainable=False)
    self.good_micro_batches = counter('good_micro_batches')
    self.skipped_micro_batches = counter('skipped_micro_batches')
    self.skipped_cycles = counter('skipped_cycles')

  def micro_step(self, gradients, accumulate):
    finite = all_finite(gradients)
    added = compat.cond(finite, accumulate, tf.no_op)
    with tf.control_dependencies([added]):
      return tf.group(
          self.good_micro_batches.assign_add(
              tf.cast(finite, tf.int64), read_value=False),
          self.skipped_micro_batches.assign_add(
              1 - tf.cast(finite, tf.int64), read_value=False))

  def _decide(self, good, gradients):
    """(apply now?, the gradients to apply) given the cycle's good count."""
    raise NotImplementedError

  def apply(self, gradients, apply_gradients):
    apply_now, gradients = self._decide(self.good_micro_batches.read_value(),
                                        gradients)
    return compat.cond(
        apply_now, lambda: apply_gradients(gradients),
        lambda: self.skipped_cycles.assign_add(1, read_value=False))

  def reset(self, after):
    with tf.control_dependencies([after]):
      return [self.good_micro_batches.assign(0, read_value=False)]

  def variables(self):
    if self.good_micro_batches is None:
      return []
    return [self.good_micro_batches, self.skipped_micro_batches,
            self.skipped_cycles]


class SkipMicroBatch(_SkipNonfinite):
  """'skip_micro_batch': the cycle applies the mean of its finite ones."""

  name = 'skip_micro_batch'

  def _decide(self, good, gradients):
    # The accumulators hold sum / grad_steps over the good micro-batches.
    scale = self._grad_steps / tf.maximum(good, 1)
    gradients = [map_values(g, lambda x: x * tf.cast(scale, x.dtype))
                 for g in gradients]
    return good > 0, gradients


class SkipCycle(_SkipNonfinite):
  """'skip_cycle': a cycle with a non-finite micro-batch applies nothing."""

  name = 'skip_cycle'

  def _decide(self, good, gradients):
    return tf.equal(good, self._grad_steps), gradients


def policy(name, grad_steps):
  """The policy object for a `nonfinite_policy` keyword.

  Args:
    name: one of NONFINITE_POLICIES.
    grad_steps: micro-steps per cycle.

  Returns:
    A policy object (see the module docstring).

  Raises:
    ValueError: an unknown `name`.
  """
  if name not in NONFINITE_POLICIES:
    raise ValueError('nonfinite_policy must be one of %s, got %r.' %
                     (NONFINITE_POLICIES, name))
  if name == 'skip_micro_batch':
    return SkipMicroBatch(grad_steps)
  if name == 'skip_cycle':
    return SkipCycle(grad_steps)
  return KeepNonfinite()


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
    # identity: reads of ref variables (v1 behaviour) are ref tensors, which
    # all_reduce would take for the variables themselves.
    gradients = [tf.identity(tf.convert_to_tensor(g)) for g in gradients]
    gradients = replica_context.all_reduce(tf.distribute.ReduceOp.SUM,
                                           gradients)
  clipped, _ = tf.clip_by_global_norm(gradients, clip_norm)
  if replicas > 1:
    clipped = [g / replicas for g in clipped]
  return clipped
