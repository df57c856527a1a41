"""A train op's cycle state as data, and the decisions made from it.

What a train op keeps besides its accumulators is a few scalars:

* its cycle (`steps`): an int's `update_count` (none where `global_step`
  decides), or a schedule's three counters;
* this cycle's counts on each replica, as one small vector (float32): the
  finite and the non-finite micro-batches (with a `nonfinite_policy`) and
  the sum of their weights (with `micro_batch_weight`);
* the totals of what a policy skipped (int64, the same on every replica).

A micro-step adds `increments(...)` to the counts. The apply step sums the
counts over replicas once, and two pure functions of that sum decide:
`should_apply` (apply now, or only reset?) and `scale` (the factor that
turns the accumulated sum into the cycle's gradient). The non-finite
policies differ only there, by a line each, as optax's `skip_not_finite`.

The accumulators hold sum(w_i * g_i) / grad_steps (w_i = 1 without
weights), the original's scale, so that its checkpoints restore mid-cycle;
under a schedule, divided by the cycle's length.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import steps
from deferred_grad import variables

tf = compat.import_tensorflow()

NONFINITE_POLICIES = (None, 'skip_micro_batch', 'skip_cycle')
AGGREGATIONS = ('mean', 'sum')
GOOD, NONFINITE, WEIGHT = ('good_micro_batches', 'nonfinite_micro_batches',
                           'micro_batch_weights')


class Rules(object):
  """The keywords that decide a cycle: plain values, fixed at construction.

  Args:
    grad_steps: micro-steps per cycle: an int, or a schedule (a tensor or a
      callable, see `steps.Schedule`).
    nonfinite_policy: one of NONFINITE_POLICIES.
    aggregation: one of AGGREGATIONS.
    weighted: whether micro-steps carry a `micro_batch_weight`.

  Attributes:
    grad_steps: the int, or None under a schedule.
    schedule: the schedule, or None for an int.

  Raises:
    ValueError: an unknown `nonfinite_policy` or `aggregation`.
  """

  def __init__(self, grad_steps, nonfinite_policy, aggregation, weighted):
    fixed = isinstance(grad_steps, int)
    self.grad_steps = grad_steps if fixed else None
    self.schedule = None if fixed else grad_steps
    self.nonfinite_policy = arguments.check_choice(
        nonfinite_policy, NONFINITE_POLICIES, 'nonfinite_policy')
    self.aggregation = arguments.check_choice(aggregation, AGGREGATIONS,
                                              'aggregation')
    self.weighted = weighted

  @property
  def accumulates(self):
    """False with grad_steps=1: each micro-step is its own cycle."""
    return self.schedule is not None or self.grad_steps > 1

  @property
  def counts(self):
    """The names of the per-replica counts a cycle keeps, in vector order."""
    names = (GOOD, NONFINITE) if self.nonfinite_policy else ()
    return names + ((WEIGHT,) if self.weighted else ())


class TrainOpState(object):
  """One train op's variables, shared by the replicas that build it.

  Attributes:
    cycle: where a micro-step is in its cycle: a `steps.StepCycle` (an int
      `grad_steps`) or `steps.Schedule`; None with grad_steps=1.
    global_step: the `global_step` the train op counts, or None.
    counts: {name: variable} of this cycle's per-replica counts, in the
      order of `Rules.counts` (empty without accumulation).
    skipped_micro_batches, skipped_cycles: int64 totals, or None without a
      `nonfinite_policy`.
    position: the `steps.Position` this train op's run reads before it
      counts the micro-step (None until read, and with grad_steps=1).
  """

  def __init__(self, cycle, global_step, counts, skipped):
    self.cycle = cycle
    self.global_step = global_step
    self.counts = counts
    self.skipped_micro_batches, self.skipped_cycles = skipped
    self.position = None

  def read_position(self, after, check=None):
    """Reads and keeps the micro-step's `steps.Position`, after `after`.

    `check`: None, or `distribute.MidCycleRestart.check`.
    """
    self.position = self.cycle.read(after, check)
    return self.position

  def divisor(self):
    """What this micro-step divides its gradients by: `steps` `divisor`."""
    return self.cycle.divisor()

  def applies_update(self):
    """True when this run ends a cycle (always, with grad_steps=1)."""
    if self.position is None:
      return tf.constant(True)
    return self.position.is_end

  def micro_step_in_cycle(self):
    """This run's place in its cycle, an int64 tensor."""
    if self.position is None:
      return tf.constant(0, tf.int64)
    return self.position.in_cycle

  def applied_updates(self):
    """The updates this train op has applied before this run (int64).

    Raises:
      ValueError: an int `grad_steps` without a `global_step`.
    """
    if self.position is not None and self.position.updates is not None:
      # Read with the position: a read of its own would race the count.
      return self.position.updates
    if self.global_step is None:
      raise ValueError(
          'applied_updates(): with an int grad_steps the updates are counted '
          'by the global_step only, and this train op was built without one. '
          'Pass global_step to minimize (or apply_gradients), or give '
          'grad_steps as a schedule (a tensor or a callable), whose train op '
          'counts its updates itself.')
    grad_steps = 1 if self.cycle is None else self.cycle.grad_steps
    return tf.math.floordiv(
        tf.cast(self.global_step.read_value(), tf.int64), grad_steps)

  def variables(self):
    own = [] if self.cycle is None else self.cycle.variables()
    own += [self.counts[name] for name in sorted(self.counts)]
    return own + [v for v in (self.skipped_micro_batches, self.skipped_cycles)
                  if v is not None]


def create(rules, own_counter, global_step=None, local=None):
  """Creates a train op's state variables. Call under `tf.init_scope()`.

  Without accumulation (grad_steps=1) a micro-step is its cycle: its counts
  are tensors of the step (see `increments`), and only a policy's totals
  are variables.

  Args:
    rules: the `Rules`.
    own_counter: an int cycle counts in `update_count`, not `global_step`.
    global_step: the global step the train op counts, or None.
    local: None (global variables), or a `placement.WorkerLocal`.

  Returns:
    A `TrainOpState`.

  Raises:
    ValueError: another wrapper train op counts `global_step` (see
      `variables.count_global_step`).
  """
  if global_step is not None:
    # Under a schedule the train op only counts it (`steps.Schedule`).
    variables.count_global_step(
        global_step, rules.accumulates and rules.schedule is None)
    distribute.plain_global_step_read(global_step)
  counts = {}
  if rules.accumulates:
    with distribute.summed_on_save():  # see there: saved as their sum
      for name in rules.counts:
        counts[name] = variables.own_variable(name, tf.float32, local=local)
  skipped = (None, None)
  if rules.nonfinite_policy:
    skipped = tuple(
        variables.own_counter(name, tf.int64, local)
        for name in ('skipped_micro_batches', 'skipped_cycles'))
  cycle = None
  if rules.schedule is not None:
    cycle = steps.Schedule(rules.schedule, local)
  elif rules.accumulates:
    cycle = steps.StepCycle(
        rules.grad_steps, None if own_counter else global_step, local)
  if cycle is not None and local is None:  # see `checkpoints.Saver`
    checkpoints.record_settings(rules.grad_steps, rules.weighted,
                                rules.nonfinite_policy, NONFINITE_POLICIES,
                                cycle.place())
  return TrainOpState(cycle, global_step, counts, skipped)


def train_op_state(rules, replica_context, global_step, local, own_counter):
  """`create`'s state, made once for all replicas (`variables.train_op_state`).

  Call under `tf.init_scope()`; `replica_context` is the current one (or
  None), the other arguments are `create`'s.
  """
  return variables.train_op_state(
      replica_context, lambda: create(rules, own_counter, global_step, local))


def increments(rules, finite, weight):
  """What one micro-step adds to this replica's counts (float32 scalars).

  Args:
    rules: the `Rules`.
    finite: None, or a boolean scalar: the micro-batch is finite.
    weight: None, or the micro-step's weight (float32).

  Returns:
    A list in the order of `rules.counts`.
  """
  added = []
  if rules.nonfinite_policy:
    good = tf.cast(finite, tf.float32)
    added += [good, 1.0 - good]
  if rules.weighted:
    # A skipped micro-batch adds no weight (where: a NaN weight stays out).
    added.append(weight if finite is None else
                 tf.where(finite, weight, tf.zeros_like(weight)))
  return added


def add_counts(state, counts):
  """Ops adding a micro-step's `increments` to this replica's counts."""
  return [compat.local_variable(v).assign_add(count, read_value=False)
          for v, count in zip(state.counts.values(), counts)]


def reset_counts(state):
  """Ops zeroing this replica's counts for the next cycle."""
  return [compat.local_variable(v).assign(0.0, read_value=False)
          for v in state.counts.values()]


def should_apply(rules, totals):
  """Whether the cycle applies: None (always), or a boolean scalar.

  Args:
    rules: the `Rules`.
    totals: {name: the count summed over replicas}.
  """
  decisions = []
  # Rounded: after a restore the counts are sums of float32 shares.
  if rules.nonfinite_policy == 'skip_micro_batch':
    decisions.append(tf.round(totals[GOOD]) > 0)
  elif rules.nonfinite_policy == 'skip_cycle':
    decisions.append(tf.equal(tf.round(totals[NONFINITE]), 0))
  if rules.weighted and rules.aggregation == 'mean':
    decisions.append(totals[WEIGHT] > 0)
  if not decisions:
    return None
  return decisions[0] if len(decisions) == 1 else tf.logical_and(*decisions)


def scale(rules, totals, replicas, length):
  """The factor from the accumulated sum to the cycle's gradient.

  As a fraction (numerator, denominator) of scalars or numbers, which
  `apply_scale` divides in each gradient's own dtype: 4/3 is then exact to
  float64 precision in a float64 model.

  Args:
    rules: the `Rules`.
    totals: {name: the count summed over replicas}.
    replicas: the number of replicas (a number or a float32 scalar).
    length: the cycle's length (`steps.Position.length`).

  Returns:
    None (the accumulated sum is the cycle's gradient), or the fraction.
  """
  # The accumulators hold the sum divided by the cycle's length.
  if rules.aggregation == 'sum':
    return (length, 1)
  if rules.weighted:
    # Each replica's loss is divided by the replicas: its share of the
    # cycle's weight is the sum over replicas divided by the replicas.
    return (length * replicas, tf.maximum(totals[WEIGHT], 1e-30))
  if rules.nonfinite_policy == 'skip_micro_batch':
    # The mean over the finite micro-batches of every replica.
    return (length * replicas, tf.maximum(totals[GOOD], 1.0))
  return None


def apply_scale(value, fraction):
  """`value * numerator / denominator`, computed in `value`'s dtype."""
  if fraction is None or all(
      isinstance(part, int) and part == 1 for part in fraction):
    return value
  numerator, denominator = (tf.cast(part, value.dtype) for part in fraction)
  return value * (numerator / denominator)


def count_skipped(state, totals, applied):
  """Ops adding the cycle's skipped micro-batches and cycle to the totals."""
  if state.skipped_cycles is None:
    return []
  return [
      state.skipped_micro_batches.assign_add(
          tf.cast(tf.round(totals[NONFINITE]), tf.int64), read_value=False),
      state.skipped_cycles.assign_add(
          1 - tf.cast(applied, tf.int64), read_value=False)]


class ReplicaPart(object):
  """One replica's part of one train op: plain values for the apply step.

  Attributes:
    state: the train op's `TrainOpState` (shared by the replicas).
    var_list: the variables.
    accumulators: their accumulators, or None without accumulation.
    gradients, counts: without accumulation, the micro-step's weighed
      gradients and counts (see `keep_micro_step`).
  """

  def __init__(self, state, var_list, accumulators):
    self.state = state
    self.var_list = list(var_list)
    self.accumulators = accumulators
    self.gradients = None
    self.counts = None

  def keep_micro_step(self, gradients, counts, sparse):
    """Keeps the micro-step's gradients (densified unless `sparse`)."""
    self.gradients = [
        tf.convert_to_tensor(g)
        if isinstance(g, tf.IndexedSlices) and not sparse else g
        for g in gradients]
    self.counts = counts


def replica_counts(part):
  """This replica's counts of the cycle (float32 scalars), copied.

  Copied: under ref variables (v1 behaviour) a read may alias the
  variable's buffer, which the apply step then resets in place.
  """
  if part.accumulators is None:
    counts = part.counts
  else:
    counts = [compat.local_variable(v).read_value()
              for v in part.state.counts.values()]
  return tf.unstack(tf.stack(counts)) if counts else []


def summed_counts(rules, distribution, part, over_tpu_cores, length):
  """({name: count summed over replicas (and TPU cores)}, replicas, checks).

  The cycle's one exchange between replicas besides the wrapped
  optimizer's own all-reduce: the counts travel as one small vector. Under
  a schedule whose replicas span several workers, each worker's cycle
  length travels with them: `checks` holds the op that fails where the
  workers disagree (their collectives would no longer match).

  Args:
    rules: the `Rules`.
    distribution: the strategy (in its cross-replica context), or None.
    part: the `ReplicaPart` (PerReplica under a strategy).
    over_tpu_cores: also sum over TPU cores (`apply_crs_to_grad`).
    length: the cycle's length (`steps.Position.length`).
  """
  replicas = 1 if distribution is None else distribution.num_replicas_in_sync
  agree = rules.schedule is not None and distribution is not None and (
      distribute.in_multi_worker_mode(distribution))
  if not (rules.counts or agree):
    return {}, replicas, []
  if distribution is None:
    counts = replica_counts(part)
  else:
    extra = [tf.cast(length, tf.float32)] if agree else []
    counts = distribute.sum_over_replicas(
        distribution, lambda p: replica_counts(p) + extra, part)
  checks = []
  if agree:
    checks.append(distribute.check_agreed(counts.pop(), replicas, length))
  if over_tpu_cores:
    crs = tf.compat.v1.tpu.cross_replica_sum
    counts = tf.unstack(crs(tf.stack(counts)))
    replicas = replicas * crs(tf.constant(1.0))
  return dict(zip(rules.counts, counts)), replicas, checks
