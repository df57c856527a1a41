"""Numerics of the accumulated gradient: non-finite policies and clipping.

A non-finite policy decides what a micro-batch whose gradient holds a NaN or
an inf does. It is one object per train op with the same small interface for
every policy, called by the optimizer at two points (as optax keeps
`skip_not_finite` pluggable):

* on every micro-step, `micro_step(gradients, accumulate)`: the op that
  checks the micro-batch and runs `accumulate()` only for a good one;
* on the apply step, `statistics()` (this replica's counts of the cycle,
  which the optimizer sums over the replicas, once per cycle) and then
  `decide(totals)`: whether to apply, and over how many micro-batches the
  mean is; `count(totals, applied)` updates the totals of what was skipped,
  and `reset()` starts the next cycle's counts on each replica.

`policy(name, grad_steps)` returns the object for a `nonfinite_policy`.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import variables

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
  """A boolean scalar: True if no gradient holds a NaN or an inf.

  For an IndexedSlices, its values: the rows it touches.
  """
  return tf.reduce_all(
      [tf.reduce_all(tf.math.is_finite(_values(g))) for g in gradients])


class KeepNonfinite(object):
  """`nonfinite_policy=None`, the original's: accumulate every micro-batch."""

  name = None
  has_statistics = False  # whether the apply step needs `statistics()`
  skipped_micro_batches = None
  skipped_cycles = None

  def create_variables(self, local=None):
    del local

  def micro_step(self, gradients, accumulate):
    del gradients
    return accumulate()

  def statistics(self):
    """This replica's counts of the cycle, to be summed over replicas."""
    return []

  def decide(self, totals, replicas):
    """(apply now?, good micro-batches per replica) from the summed counts.

    None for either means: always / all of them.
    """
    del totals, replicas
    return None, None

  def count(self, totals, applied):
    del totals, applied
    return []

  def reset(self):
    return []

  def variables(self):
    return []


class _SkipNonfinite(KeepNonfinite):
  """Checks every micro-batch, adds only finite ones, and counts them.

  Its variables: on each replica, the current cycle's counts (float32, saved
  as their sum over replicas, see `distribute.summed_on_save`):
    good_micro_batches: finite micro-batches, added to the accumulators;
    nonfinite_micro_batches: skipped ones;
  and the totals (int64, the same on every replica), updated on apply steps:
    skipped_micro_batches: micro-batches skipped, over all replicas;
    skipped_cycles: cycles that applied nothing.

  Args:
    grad_steps: micro-steps per cycle.
  """

  has_statistics = True

  def __init__(self, grad_steps):
    self._grad_steps = grad_steps
    self.good_micro_batches = None

  def create_variables(self, local=None):
    with distribute.summed_on_save():
      self.good_micro_batches = variables.own_variable(
          'good_micro_batches', tf.float32, local=local)
      self.nonfinite_micro_batches = variables.own_variable(
          'nonfinite_micro_batches', tf.float32, local=local)
    total = lambda name: variables.own_variable(  # pylint: disable=g-long-lambda
        name, tf.int64, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        local=local)
    self.skipped_micro_batches = total('skipped_micro_batches')
    self.skipped_cycles = total('skipped_cycles')

  def micro_step(self, gradients, accumulate):
    finite = all_finite(gradients)
    added = compat.cond(finite, accumulate, tf.no_op)
    good = tf.cast(finite, tf.float32)
    with tf.control_dependencies([added]):
      return tf.group(
          compat.local_variable(self.good_micro_batches).assign_add(
              good, read_value=False),
          compat.local_variable(self.nonfinite_micro_batches).assign_add(
              1.0 - good, read_value=False))

  def statistics(self):
    return [compat.local_variable(v).read_value()
            for v in (self.good_micro_batches, self.nonfinite_micro_batches)]

  def count(self, totals, applied):
    _, nonfinite = totals
    return [
        self.skipped_micro_batches.assign_add(
            tf.cast(tf.round(nonfinite), tf.int64), read_value=False),
        self.skipped_cycles.assign_add(
            1 - tf.cast(applied, tf.int64), read_value=False)]

  def reset(self):
    return [compat.local_variable(v).assign(0.0, read_value=False)
            for v in (self.good_micro_batches, self.nonfinite_micro_batches)]

  def variables(self):
    if self.good_micro_batches is None:
      return []
    return [self.good_micro_batches, self.nonfinite_micro_batches,
            self.skipped_micro_batches, self.skipped_cycles]


class SkipMicroBatch(_SkipNonfinite):
  """'skip_micro_batch': the cycle applies the mean of its finite ones."""

  name = 'skip_micro_batch'

  def decide(self, totals, replicas):
    good, _ = totals
    # Rounded: the counts are sums of float32 parts after a restore.
    return tf.round(good) > 0, good / replicas


class SkipCycle(_SkipNonfinite):
  """'skip_cycle': a cycle with a non-finite micro-batch applies nothing."""

  name = 'skip_cycle'

  def decide(self, totals, replicas):
    del replicas
    _, nonfinite = totals
    return tf.equal(tf.round(nonfinite), 0), None


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
