"""How a cycle's micro-batch gradients combine: mean, sum, or weighted mean.

* `aggregation='mean'` (the default, the original's): the cycle applies the
  mean of its micro-batch gradients, as a mean loss over the large batch.
* `aggregation='sum'`: their sum (Horovod's `average_aggregated_gradients=
  False`, OpenNMT-tf's accumulation, optax's `use_grad_mean=False`).
* `micro_batch_weight` (a scalar per micro-step, e.g. its token count):
  the weighted mean `sum(w_i * g_i) / sum(w_i)` with 'mean', the weighted
  sum `sum(w_i * g_i)` with 'sum'. When each micro-batch's loss is a mean
  over its tokens, the weighted mean is the gradient of the large batch's
  token mean, which the plain mean is not.

Under several replicas each replica's loss is, as usual, divided by the
number of replicas (the optimizer's all-reduce sums), and the weights add up
over replicas too: the cycle's weight is the sum over all replicas and
micro-steps, summed once per apply step.

The accumulators always hold sum(w_i * g_i) / grad_steps (w_i = 1 without
weights), the original's scale, so that its checkpoints restore mid-cycle;
`decide` gives the factor that turns that into the cycle's gradient.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import numerics
from deferred_grad import variables

tf = compat.import_tensorflow()

AGGREGATIONS = ('mean', 'sum')


def check(aggregation, micro_batch_weight):
  """Checks the keywords; returns them.

  Raises:
    ValueError: an unknown `aggregation`.
    TypeError: `micro_batch_weight` is neither None, a tensor nor a callable.
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError('aggregation must be one of %s, got %r.' %
                     (AGGREGATIONS, aggregation))
  if not (micro_batch_weight is None or callable(micro_batch_weight) or
          tf.is_tensor(micro_batch_weight)):
    raise TypeError(
        'micro_batch_weight must be None, a scalar tensor (e.g. the '
        'micro-batch\'s token count) or a callable returning one, got %r of '
        'type %s.' % (micro_batch_weight, type(micro_batch_weight).__name__))
  return aggregation, micro_batch_weight


def weight_tensor(micro_batch_weight):
  """This micro-step's weight as a float32 scalar, or None without weights.

  A callable is called here: in `apply_gradients`, on each replica.

  Raises:
    ValueError: the weight is not a scalar.
  """
  if micro_batch_weight is None:
    return None
  weight = (micro_batch_weight() if callable(micro_batch_weight) else
            micro_batch_weight)
  weight = tf.cast(tf.convert_to_tensor(weight), tf.float32)
  if weight.shape.rank not in (None, 0):
    raise ValueError('micro_batch_weight must be a scalar, got shape %s.' %
                     (weight.shape,))
  return weight


class Aggregation(object):
  """The combination rule of one train op, and its weight variable.

  Args:
    grad_steps: micro-steps per cycle.
    aggregation: 'mean' or 'sum'.
    weighted: whether micro-steps carry a `micro_batch_weight`.
  """

  def __init__(self, grad_steps, aggregation, weighted):
    self._grad_steps = grad_steps
    self._aggregation = aggregation
    self.weighted = weighted
    # Sum of this cycle's weights on each replica (finite micro-batches).
    self.micro_batch_weights = None

  @property
  def has_statistics(self):
    return self.weighted

  def create_variables(self, local=None):
    if self.weighted:
      with distribute.summed_on_save():
        self.micro_batch_weights = variables.own_variable(
            'micro_batch_weights', tf.float32, local=local)

  def weigh(self, gradients, weight):
    """The gradients to add: `weight * gradient`, or as they are."""
    if weight is None:
      return list(gradients)
    return [numerics.map_values(g, lambda x: x * tf.cast(weight, x.dtype))
            for g in gradients]

  def add_weight(self, weight):
    """Ops adding this micro-step's weight to the cycle's (on this replica)."""
    if weight is None:
      return []
    return [compat.local_variable(self.micro_batch_weights).assign_add(
        weight, read_value=False)]

  def statistics(self):
    if not self.weighted:
      return []
    return [compat.local_variable(self.micro_batch_weights).read_value()]

  def decide(self, totals, replicas, good):
    """(apply now?, factor) for the accumulated sum / grad_steps.

    Args:
      totals: `statistics()` summed over replicas.
      replicas: the number of replicas.
      good: None, or the finite micro-batches per replica (a
        'skip_micro_batch' cycle's mean divides by it).

    Returns:
      (None or a boolean scalar, None or a scalar factor).
    """
    if self._aggregation == 'sum':
      return None, (self._grad_steps if self._grad_steps > 1 else None)
    if self.weighted:
      weight, = totals
      # Each replica's loss is divided by the replicas: its share of the
      # cycle's weight is the sum over replicas divided by the replicas.
      return weight > 0, self._grad_steps * replicas / tf.maximum(
          weight, 1e-30)
    if good is not None:
      return None, self._grad_steps / tf.maximum(good, 1.0)
    return None, None

  def reset(self):
    if not self.weighted:
      return []
    return [compat.local_variable(self.micro_batch_weights).assign(
        0.0, read_value=False)]

  def variables(self):
    return [self.micro_batch_weights] if self.weighted else []
