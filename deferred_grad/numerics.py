"""What a cycle applies: which micro-batches count, and by what factor.

A micro-step is checked (`all_finite`, with a `nonfinite_policy`),
weighed (`weigh`, with a `micro_batch_weight`) and divided (`Divisor`: by
`grad_steps`, the original's scale), and adds `increments` to
its replica's counts: one small vector per replica, as data. The apply
step sums the counts over replicas once, and two pure functions of that
sum decide, as optax's `skip_not_finite`: `should_apply` (apply now, or
only reset?) and `scale` (the factor that turns the accumulated sum into
the cycle's gradient). The policies differ there by a line each. Then
`clip_by_global_norm` clips the whole cycle's gradient, once.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import collections

from deferred_grad import arguments
from deferred_grad import compat
from deferred_grad import row_lists

tf = compat.import_tensorflow()

NONFINITE_POLICIES = (None, 'skip_micro_batch', 'skip_cycle')
AGGREGATIONS = ('mean', 'sum')
# The counts a cycle keeps per replica (`counts_dtype`), by their variables'
# names.
GOOD, NONFINITE, WEIGHT = ('good_micro_batches', 'nonfinite_micro_batches',
                           'micro_batch_weights')


class Policy(collections.namedtuple(
    'Policy', ['nonfinite_policy', 'aggregation', 'weighted'])):
  """The keywords that decide what a cycle applies (plain values).

  Fields: `nonfinite_policy` (one of NONFINITE_POLICIES), `aggregation`
  (one of AGGREGATIONS), `weighted` (micro-steps carry a weight).
  """

  @classmethod
  def checked(cls, nonfinite_policy, aggregation, weighted):
    """The policy, or a ValueError naming the keyword with a bad value."""
    return cls(
        arguments.check_choice(nonfinite_policy, NONFINITE_POLICIES,
                               'nonfinite_policy'),
        arguments.check_choice(aggregation, AGGREGATIONS, 'aggregation'),
        weighted)

  @property
  def counts(self):
    """The names of the per-replica counts a cycle keeps, in vector order."""
    names = (GOOD, NONFINITE) if self.nonfinite_policy else ()
    return names + ((WEIGHT,) if self.weighted else ())


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


def weigh(gradients, weight):
  """The gradients times `weight` (in their dtype), or as they are."""
  if weight is None:
    return list(gradients)
  return [map_values(g, lambda x: x * tf.cast(weight, x.dtype))
          for g in gradients]


def increments(policy, finite, weight, dtype):
  """What one micro-step adds to its replica's counts (scalars of `dtype`).

  Args:
    policy: the `Policy`.
    finite: None, or a boolean scalar: the micro-batch is finite.
    weight: None, or the micro-step's weight (float64).
    dtype: the counts' dtype (`counts_dtype`).

  Returns:
    A list in the order of `policy.counts`.
  """
  added = []
  if policy.nonfinite_policy:
    good = tf.cast(finite, dtype)
    added += [good, 1 - good]
  if policy.weighted:
    # A skipped micro-batch adds no weight (where: a NaN weight stays out).
    weight = tf.cast(weight, dtype)
    added.append(weight if finite is None else
                 tf.where(finite, weight, tf.zeros_like(weight)))
  return added


def counts_dtype(variables, accumulator_dtype):
  """The dtype a train op keeps its cycle's counts in.

  That of its widest accumulator, at least float32: a weight sum of
  fractional weights (0.3 tokens) in float32 would cost a float64 model
  precision the accumulators keep.

  Args:
    variables: the variables that receive gradients.
    accumulator_dtype: the wrapper's `accumulator_dtype`, or None.
  """
  dtypes = [accumulator_dtype or v.dtype.base_dtype for v in variables]
  return max(dtypes + [tf.float32], key=lambda dtype: dtype.size)


def should_apply(policy, totals):
  """Whether the cycle applies: None (always), or a boolean scalar.

  Args:
    policy: the `Policy`.
    totals: {name: the count summed over replicas}.
  """
  decisions = []
  # Rounded: after a restore the counts are sums of equal shares.
  if policy.nonfinite_policy == 'skip_micro_batch':
    decisions.append(tf.round(totals[GOOD]) > 0)
  elif policy.nonfinite_policy == 'skip_cycle':
    decisions.append(tf.equal(tf.round(totals[NONFINITE]), 0))
  if policy.weighted and policy.aggregation == 'mean':
    decisions.append(totals[WEIGHT] > 0)
  if not decisions:
    return None
  return decisions[0] if len(decisions) == 1 else tf.logical_and(*decisions)


def scale(policy, totals, replicas, length):
  """The factor from the accumulated sum to the cycle's gradient.

  As a fraction (numerator, denominator) of scalars or numbers, which
  `apply_scale` divides in each gradient's own dtype: 4/3 is then exact to
  float64 precision in a float64 model.

  Args:
    policy: the `Policy`.
    totals: {name: the count summed over replicas}.
    replicas: the number of replicas (a number or a float scalar).
    length: the cycle's length (`cycle.Position.length`).

  Returns:
    None (the accumulated sum is the cycle's gradient), or the fraction.
  """
  # The accumulators hold the sum divided by the cycle's length.
  if policy.aggregation == 'sum':
    return (length, 1)
  if policy.weighted:
    # Each replica's loss is divided by the replicas: its share of the
    # cycle's weight is the sum over replicas divided by the replicas.
    return (length * replicas, tf.maximum(totals[WEIGHT], 1e-30))
  if policy.nonfinite_policy == 'skip_micro_batch':
    # The mean over the finite micro-batches of every replica.
    return (length * replicas, tf.maximum(totals[GOOD], 1.0))
  return None


def apply_scale(gradients, fraction):
  """Each gradient times `numerator / denominator`, in its own dtype."""
  if fraction is None or all(
      isinstance(part, int) and part == 1 for part in fraction):
    return list(gradients)

  def scaled(value):
    numerator, denominator = (tf.cast(part, value.dtype) for part in fraction)
    return value * (numerator / denominator)

  return [map_values(g, scaled) for g in gradients]


def skipped(totals, applied):
  """(micro-batches, cycles) the policy skipped in this cycle, int64."""
  return (tf.cast(tf.round(totals[NONFINITE]), tf.int64),
          1 - tf.cast(applied, tf.int64))


def clip_by_global_norm(gradients, clip_norm, whole):
  """Clips the accumulated gradients to `clip_norm`, by their global norm.

  Under a multi-replica strategy each replica holds its part of the sum;
  the norm is that of the whole sum, so the parts are all-reduced first,
  and each replica hands on 1/replicas of the clipped sum for the wrapped
  optimizer's own all-reduce to add up. A table's list that the replicas
  share is held whole by one replica (`whole`): only its squared norm is
  all-reduced, and its rows go on sparse and as they are, never densified
  (table-sized on every replica; a dense update would also move the rows
  the large batch leaves alone).

  A table's gradient (IndexedSlices) holds a row per id looked up, as the
  large batch's: its rows of equal ids are added up first, so that the
  norm is the dense gradient's.

  Args:
    gradients: the accumulated gradients (Tensors or IndexedSlices).
    clip_norm: the largest global norm.
    whole: per gradient, whether this replica holds all of the sum over
      replicas, or none of it (`accumulators.Read.whole`).

  Returns:
    The clipped gradients.
  """
  replica_context = tf.distribute.get_replica_context()
  replicas = replica_context.num_replicas_in_sync
  if replicas == 1:
    return tf.clip_by_global_norm([_summed_by_id(g) for g in gradients],
                                  clip_norm)[0]
  # stop_gradient: a replica context's all_reduce is differentiable, and in
  # graph mode it walks back from its result through every replica's input
  # to the variables; with ref variables (v1 behaviour) it reaches the
  # mirrored components and fails ("Unsuccessful at finding variable").
  # Nothing differentiates an accumulated gradient: the walk ends here.
  sum_over_replicas = lambda values: replica_context.all_reduce(
      tf.distribute.ReduceOp.SUM, [map_values(v, tf.stop_gradient)
                                   for v in values])
  gradients = list(gradients)
  parts = [i for i, held in enumerate(whole) if not held]
  held_whole = [i for i, held in enumerate(whole) if held]
  squares = []
  if parts:  # a table's parts are all-reduced sparse: rows of every replica
    reduced = sum_over_replicas([gradients[i] for i in parts])
    for i, value in zip(parts, reduced):
      gradients[i] = _summed_by_id(value)
    squares.append(tf.square(tf.linalg.global_norm(
        [gradients[i] for i in parts])))
  if held_whole:  # held by one replica: the replicas' squares add up to its
    for i in held_whole:
      gradients[i] = _summed_by_id(gradients[i])
    squares.append(sum_over_replicas([tf.square(tf.linalg.global_norm(
        [gradients[i] for i in held_whole]))])[0])
  clipped, _ = tf.clip_by_global_norm(gradients, clip_norm,
                                      use_norm=tf.sqrt(tf.add_n(squares)))
  return [g if held else map_values(g, lambda x: x / replicas)
          for g, held in zip(clipped, whole)]


def _summed_by_id(gradient):
  """An IndexedSlices with its rows of equal ids added up; a Tensor as is."""
  if not isinstance(gradient, tf.IndexedSlices):
    return gradient
  unique, rows = row_lists.sum_by_id(gradient.indices, gradient.values)
  return tf.IndexedSlices(rows, unique, gradient.dense_shape)


def cast_like(gradients, var_list):
  """Each gradient cast to its variable's dtype (from the accumulator's)."""
  return [map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
          for g, v in zip(gradients, var_list)]


class Divisor(object):
  """What a micro-step divides each gradient by, made once per dtype.

  Args:
    value: `grad_steps` (an int), or the cycle's length under a schedule
      (an int64 scalar, `cycle.Schedule.divisor`).
  """

  def __init__(self, value):
    self.value = value
    self._reciprocals = {}

  def reciprocal(self, dtype):
    """1 / value as a `dtype` scalar: one op for all variables of a dtype."""
    if isinstance(self.value, int):
      return tf.constant(1.0 / self.value, dtype)
    if dtype not in self._reciprocals:
      self._reciprocals[dtype] = tf.math.reciprocal(tf.cast(self.value, dtype))
    return self._reciprocals[dtype]

  def divide(self, tensor):
    """`tensor / value` (divided by an int, as the original did)."""
    if isinstance(self.value, int):
      return tensor / self.value
    return tensor * self.reciprocal(tensor.dtype.base_dtype)
