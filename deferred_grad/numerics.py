"""The numerics keywords as one value: what a micro-step adds, what a cycle
applies.

`Numerics` is made once, in the wrapper's constructor, from
`nonfinite_policy`, `micro_batch_weight`, `aggregation` and `clip_norm`; the
micro-step and the apply step call its methods and never test a keyword
(as optax turns its options into functions once). With every keyword at
its default it does nothing: the micro-step adds the gradients as they
are, the cycle applies the mean the accumulators hold.

A micro-batch skipped by `nonfinite_policy` still counts (unlike in optax's
`MultiSteps`): cycles last `grad_steps` runs, as schedules expect.
"""

import collections
import functools

from deferred_grad import accumulators
from deferred_grad import arguments
from deferred_grad import compat

tf = compat.import_tensorflow()

# The counts a cycle keeps per replica, by their variables' names.
GOOD, NONFINITE, WEIGHT = ('good_micro_batches', 'nonfinite_micro_batches',
                           'micro_batch_weights')

# What a micro-step adds: its gradients (weighed), its additions to the
# replica's counts (in `Numerics.counts` order), the checks every write waits
# for, and whether it is finite (None where nothing is skipped).
MicroStep = collections.namedtuple(
    'MicroStep', 'gradients increments checks finite')


class Numerics(object):
  """What the numerics keywords make of micro-steps and cycles.

  Args:
    nonfinite_policy: None, 'skip_micro_batch' or 'skip_cycle'.
    aggregation: 'mean' or 'sum'.
    micro_batch_weight: None, a scalar tensor, or a callable returning one.
    clip_norm: None, or a positive float (inf clips nothing).

  Attributes:
    counts: the names of the per-replica counts a cycle keeps, in order.
    nonfinite_policy, aggregation, weighted: the keywords, for the
      settings a checkpoint records.

  Raises:
    TypeError, ValueError: a keyword of the wrong type, or out of range.
  """

  def __init__(self, nonfinite_policy=None, aggregation='mean',
               micro_batch_weight=None, clip_norm=None):
    self.nonfinite_policy = arguments.check_choice(
        nonfinite_policy, arguments.NONFINITE_POLICIES, 'nonfinite_policy')
    self.aggregation = arguments.check_choice(
        aggregation, arguments.AGGREGATIONS, 'aggregation')
    self._weight = arguments.check_micro_batch_weight(micro_batch_weight)
    self._clip_norm = arguments.check_clip_norm(clip_norm)
    self.weighted = micro_batch_weight is not None
    self.counts = ((GOOD, NONFINITE) if nonfinite_policy else ()) + (
        (WEIGHT,) if self.weighted else ())

  # ------------------------------------------------------ a micro-step --

  def micro_step(self, gradients, counts_dtype):
    """Checks and weighs a micro-step's gradients.

    Args:
      gradients: the micro-step's gradients (Tensors or IndexedSlices).
      counts_dtype: the dtype of the train op's counts.

    Returns:
      A `MicroStep`.
    """
    weight = arguments.weight_tensor(self._weight)  # None: unweighted
    checks = (arguments.check_weight_value(weight, self.nonfinite_policy)
              if weight is not None else [])
    finite = (_all_finite(gradients + [weight]) if self.nonfinite_policy
              else None)
    if weight is not None:
      gradients = [map_values(g, lambda x: x * tf.cast(weight, x.dtype))
                   for g in gradients]
    increments = []
    if self.nonfinite_policy:
      good = tf.cast(finite, counts_dtype)
      increments += [good, 1 - good]
    if weight is not None:  # a skipped micro-batch weighs nothing
      weight = tf.cast(weight, counts_dtype)
      increments.append(weight if finite is None else
                        tf.where(finite, weight, tf.zeros_like(weight)))
    return MicroStep(list(gradients), increments, checks, finite)

  # --------------------------------------------------------- a cycle --

  def decision(self, totals):
    """Whether the cycle applies, from its counts summed over replicas.

    Args:
      totals: {name: the count summed over replicas}, of `counts`.

    Returns:
      None (the cycle always applies), or a boolean scalar (rounded counts:
      after a restore they are sums of equal shares).
    """
    decisions = []
    if self.nonfinite_policy == 'skip_micro_batch':
      decisions.append(tf.round(totals[GOOD]) > 0)
    elif self.nonfinite_policy == 'skip_cycle':
      decisions.append(tf.equal(tf.round(totals[NONFINITE]), 0))
    if self.weighted and self.aggregation == 'mean':
      decisions.append(totals[WEIGHT] > 0)
    return functools.reduce(tf.logical_and, decisions) if decisions else None

  def factor(self, totals, replicas, length):
    """(numerator, denominator) that turns the accumulators (the cycle's sum
    over its `length`) into the cycle's gradient; None for the mean they
    hold. A fraction, so that each gradient is scaled in its own dtype.

    Args:
      totals: as for `decision`.
      replicas: the replicas in sync (an int, or a tensor over TPU cores).
      length: the cycle's length.
    """
    if self.aggregation == 'sum':
      return (length, 1)
    if self.weighted:
      # Each replica's loss is divided by the replicas: its share of the
      # cycle's weight is the sum over replicas divided by the replicas.
      return (length * replicas, tf.maximum(totals[WEIGHT], 1e-30))
    if self.nonfinite_policy == 'skip_micro_batch':
      # The mean over the finite micro-batches of every replica.
      return (length * replicas, tf.maximum(totals[GOOD], 1.0))
    return None

  def skipped(self, totals, decision):
    """(micro-batches, cycles) a policy skipped this cycle, or None.

    Args:
      totals: as for `decision`.
      decision: what `decision` returned.
    """
    if not self.nonfinite_policy:
      return None
    return (tf.cast(tf.round(totals[NONFINITE]), tf.int64),
            1 - tf.cast(decision, tf.int64))

  def cycle_gradients(self, gradients, factor, whole, var_list):
    """The gradients the wrapped optimizer applies, on one replica.

    Args:
      gradients: the replica's accumulated sums.
      factor: what `factor` returned.
      whole: per gradient, whether this replica holds all of its sum over
        replicas or none of it (`accumulators.Read.whole`).
      var_list: their variables.

    Returns:
      The gradients scaled by `factor`, then clipped by `clip_norm` (the
      cycle's gradient, complete), each in its variable's dtype.
    """
    gradients = _scaled(gradients, factor)
    if self._clip_norm is not None:
      gradients = _clip_by_global_norm(gradients, self._clip_norm, whole)
    return [map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
            for g, v in zip(gradients, var_list)]


def values_of(gradient):
  """The dense values of a Tensor or of an IndexedSlices."""
  return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def map_values(gradient, fn):
  """`fn` applied to a Tensor, or to an IndexedSlices' values (same rows)."""
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(fn(gradient.values), gradient.indices,
                            gradient.dense_shape)
  return fn(gradient)


def _all_finite(gradients):
  """A boolean scalar: no gradient holds a NaN or an inf (None skipped)."""
  return tf.reduce_all([tf.reduce_all(tf.math.is_finite(values_of(g)))
                        for g in gradients if g is not None])


def _scaled(gradients, factor):
  """Each gradient times `numerator / denominator`, in its own dtype."""
  if factor is None or all(isinstance(part, int) and part == 1
                           for part in factor):
    return list(gradients)

  def scaled(value):
    numerator, denominator = (tf.cast(part, value.dtype) for part in factor)
    return value * (numerator / denominator)

  return [map_values(g, scaled) for g in gradients]


def _summed_by_id(gradient):
  """An IndexedSlices with its rows of equal ids added up; a Tensor as is."""
  if not isinstance(gradient, tf.IndexedSlices):
    return gradient
  unique, rows = accumulators.sum_by_id(gradient.indices, gradient.values)
  return tf.IndexedSlices(rows, unique, gradient.dense_shape)


def _clip_by_global_norm(gradients, clip_norm, whole):
  """The gradients clipped by the global norm of their sum over replicas
  (rows of equal ids added first); each replica keeps its share for the
  wrapped optimizer's all-reduce. `whole`: as for `cycle_gradients`."""
  replica_context = tf.distribute.get_replica_context()
  replicas = replica_context.num_replicas_in_sync
  if replicas == 1:
    return tf.clip_by_global_norm([_summed_by_id(g) for g in gradients],
                                  clip_norm)[0]
  # stop_gradient: a replica context's all_reduce is differentiable, and in
  # graph mode it walks back from its result through every replica's input
  # to the variables; with ref variables (v1 behaviour) it reaches the
  # mirrored components and fails ("Unsuccessful at finding variable").
  sum_over_replicas = lambda values: replica_context.all_reduce(
      tf.distribute.ReduceOp.SUM, [map_values(v, tf.stop_gradient)
                                   for v in values])
  gradients = [_summed_by_id(g) if held else g
               for g, held in zip(gradients, whole)]
  parts = [i for i, held in enumerate(whole) if not held]
  held_whole = [i for i, held in enumerate(whole) if held]
  squares = []
  if parts:  # a table's parts are all-reduced sparse: rows of every replica
    for i, g in zip(parts, sum_over_replicas([gradients[i] for i in parts])):
      gradients[i] = _summed_by_id(g)
    squares.append(tf.square(tf.linalg.global_norm(
        [gradients[i] for i in parts])))
  if held_whole:  # held by one replica: the replicas' squares add up to its
    squares.append(sum_over_replicas([tf.square(tf.linalg.global_norm(
        [gradients[i] for i in held_whole]))])[0])
  clipped, _ = tf.clip_by_global_norm(gradients, clip_norm,
                                      use_norm=tf.sqrt(tf.add_n(squares)))
  return [g if held else map_values(g, lambda x: x / replicas)
          for g, held in zip(clipped, whole)]
