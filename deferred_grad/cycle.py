"""One train op's cycle: what a micro-step adds, what the apply step does.

Both code paths of the optimizer build the same two things and differ only
in how they decide that a micro-step ends the cycle and how the replicas
meet:

* `Cycle.micro_step()`: the op that checks the micro-batch (non-finite
  policy), weighs it (`micro_batch_weight`) and adds it to the accumulators.
* `Cycle.apply_step(...)`: on the cycle's last micro-step, sums the cycle's
  statistics over replicas (once), lets the policy and the aggregation
  decide, and has every replica run `apply_and_reset`: read the accumulated
  gradient, sum it over TPU cores (`apply_crs_to_grad`), scale it to the
  cycle's mean, clip it, cast it, hand it to the wrapped optimizer, and
  reset the accumulators and the cycle's counts.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from six.moves import zip

from deferred_grad import accumulators as accumulators_lib
from deferred_grad import compat
from deferred_grad import numerics
from deferred_grad import steps

tf = compat.import_tensorflow()


class TrainOpState(object):
  """What one train op owns, shared by the replicas that build it.

  Attributes:
    policy: its non-finite policy (`numerics`).
    aggregation: its `aggregation.Aggregation`.
    counter: its `update_count`, or None where `global_step` decides.
    step_value: the step read before this run advances it (set by the code
      path), or None with grad_steps=1.
  """

  def __init__(self, policy, aggregation, counter):
    self.policy = policy
    self.aggregation = aggregation
    self.counter = counter
    self.step_value = None

  def variables(self):
    own = [self.counter] if self.counter is not None else []
    return own + self.policy.variables() + self.aggregation.variables()

  def applies_update(self, grad_steps):
    """True when this run ends a cycle (always, with grad_steps=1)."""
    if self.step_value is None:
      return tf.constant(True)
    return steps.is_cycle_end(self.step_value, grad_steps)

  def micro_step_in_cycle(self, grad_steps):
    """This run's place in its cycle, an int64 tensor."""
    if self.step_value is None:
      return tf.constant(0, tf.int64)
    return tf.cast(tf.math.floormod(self.step_value, grad_steps), tf.int64)


class Cycle(object):
  """One replica's part of one train op.

  Args:
    opt: the wrapped optimizer.
    grad_steps: micro-steps per cycle.
    gradients: the micro-step's gradients, in the order of `var_list`.
    var_list: the variables.
    accumulators: their accumulators (`accumulators`).
    state: the train op's `TrainOpState`.
    weight: this micro-step's weight on this replica, or None.
    clip_norm: None or the global norm to clip the cycle's gradient to.
    apply_crs_to_grad: sum the cycle's gradient over TPU cores.
  """

  def __init__(self, opt, grad_steps, gradients, var_list, accumulators,
               state, weight, clip_norm, apply_crs_to_grad):
    self._opt = opt
    self._grad_steps = grad_steps
    self._gradients = list(gradients)
    self.var_list = list(var_list)
    self._accumulators = accumulators
    self.state = state
    self._weight = weight
    self._clip_norm = clip_norm
    self._apply_crs_to_grad = apply_crs_to_grad

  @property
  def has_statistics(self):
    return (self.state.policy.has_statistics or
            self.state.aggregation.has_statistics)

  def micro_step(self):
    """The micro-step's op: check, weigh and add the micro-batch."""
    aggregation = self.state.aggregation
    # Weighed here, outside the policy's tf.cond: with grad_steps=1 the
    # apply step reads these very tensors.
    weighted = aggregation.weigh(self._gradients, self._weight)

    def add():
      adds = [a.add(g) for a, g in zip(self._accumulators, weighted)]
      return tf.group(*(adds + aggregation.add_weight(self._weight)),
                      name='accumulate')

    checked = self._gradients
    if self._weight is not None:
      checked = checked + [self._weight]
    # Every micro-step is marked, skipped or not (see SparseAccumulator).
    marks = [a.mark() for a in self._accumulators]
    return tf.group(self.state.policy.micro_step(checked, add), *marks)

  def statistics(self):
    """This replica's counts of the cycle (float32 scalars), copied.

    Copied: under ref variables (v1 behaviour) a read may alias the
    variable's buffer, which the apply step then resets in place.
    """
    counts = (self.state.policy.statistics() +
              self.state.aggregation.statistics())
    return tf.unstack(tf.stack(counts)) if counts else []

  def over_cores(self, sum_statistics, replicas):
    """With apply_crs_to_grad, the statistics and replicas of all TPU cores.

    Args:
      sum_statistics: returns `statistics()` summed over this strategy's
        replicas.
      replicas: their number.

    Returns:
      (a function summing the statistics, the number of replicas), over
      TPU cores too when the gradients are summed over them.
    """
    if not (self._apply_crs_to_grad and self.has_statistics):
      return sum_statistics, replicas
    crs = tf.compat.v1.tpu.cross_replica_sum
    return (lambda: tf.unstack(crs(tf.stack(sum_statistics()))),
            replicas * crs(tf.constant(1.0)))

  def apply_step(self, sum_statistics, replicas, on_each_replica):
    """The apply step: decide, then each replica applies (or only resets).

    Args:
      sum_statistics: returns `statistics()` summed over replicas (the
        cycle's one exchange between replicas besides the wrapped
        optimizer's own all-reduce).
      replicas: the number of replicas (a number or a scalar tensor).
      on_each_replica: `fn(apply, scale)` building `apply_and_reset` on
        every replica.

    Returns:
      An op.
    """
    policy, aggregation = self.state.policy, self.state.aggregation
    if not self.has_statistics:
      _, scale = aggregation.decide([], replicas, None)
      return on_each_replica(True, scale)
    totals = sum_statistics()
    policy_totals = totals[:len(totals) - len(aggregation.statistics())]
    weight_totals = totals[len(policy_totals):]
    apply_now, good = policy.decide(policy_totals, replicas)
    weights_apply, scale = aggregation.decide(weight_totals, replicas, good)
    if apply_now is None:
      apply_now = weights_apply
    elif weights_apply is not None:
      apply_now = tf.logical_and(apply_now, weights_apply)
    if apply_now is None:
      return on_each_replica(True, scale)
    applied = compat.cond(apply_now, lambda: on_each_replica(True, scale),
                          lambda: on_each_replica(False, None))
    with tf.control_dependencies([applied]):
      return tf.group(applied, *policy.count(policy_totals, apply_now))

  def apply_and_reset(self, apply, scale):
    """On this replica: applies the cycle's gradient (if `apply`), resets.

    Args:
      apply: False to only reset (a cycle that applies nothing).
      scale: None, or the factor from the accumulated sum / grad_steps to
        the cycle's gradient (see `aggregation.Aggregation.decide`).

    Returns:
      An op.
    """
    read = [a.read() for a in self._accumulators]
    if not apply:
      done = tf.no_op()
    else:
      grads = read
      if self._apply_crs_to_grad:
        grads = [tf.compat.v1.tpu.cross_replica_sum(g) for g in grads]
      if scale is not None:
        grads = [numerics.map_values(g, lambda x: x * tf.cast(scale, x.dtype))
                 for g in grads]
      # Clipped once the cycle's gradient is complete, as the large batch's.
      if self._clip_norm is not None:
        grads = numerics.clip_by_global_norm(grads, self._clip_norm)
      grads = [
          numerics.map_values(g, lambda x, v=v: tf.cast(x, v.dtype.base_dtype))
          for g, v in zip(grads, self.var_list)
      ]
      done = self._opt.apply_gradients(list(zip(grads, self.var_list)))
    with tf.control_dependencies([done]):
      resets = self.state.policy.reset() + self.state.aggregation.reset()
    return tf.group(
        *(resets + accumulators_lib.reset_all(self._accumulators, read, done)))
