"""A train op's own variables, created once for all of its replicas.

Each call of `apply_gradients` builds a train op with its own cycle, so it
owns its counters: two wrappers in one graph (a GAN's generator and
discriminator), or one wrapper minimizing two losses, never share one. The
first train op in a graph keeps the original's names (`update_count`), so
that the original's checkpoints restore; later ones get unique names
(`update_count_1`, ...), in the order the graph builds them, as TensorFlow
names ops. They are created outside the caller's variable-scope `reuse`
setting, which would otherwise hand every wrapper the same variable.
`create` returns them as a `cycle.TrainOpState`.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import weakref

from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import cycle
from deferred_grad import distribute
from deferred_grad import numerics

tf = compat.import_tensorflow()

COUNTER_NAME = 'update_count'
SCHEDULE_NAMES = ('micro_step', 'cycle_length', 'applied_updates')

# graph -> [(global step key, whether it accumulates)] of the train ops
# that count it.
_COUNTED_STEPS = weakref.WeakKeyDictionary()
# graph -> ([state of the n-th train op], {replica id: train ops it built}).
_TRAIN_OPS = weakref.WeakKeyDictionary()


def create(grad_steps, accumulates, policy, own_counter, global_step=None,
           local=None, counts_dtype=tf.float32):
  """Creates a train op's state variables. Call under `tf.init_scope()`.

  Args:
    grad_steps: the int, or a schedule (a tensor or a callable).
    accumulates: False for grad_steps=1, where a micro-step is its cycle:
      its counts are tensors of the step (`numerics.increments`), and only
      a policy's totals are variables.
    policy: the `numerics.Policy`.
    own_counter: an int cycle counts in `update_count`, not `global_step`.
    global_step: the global step the train op counts, or None.
    local: None (global variables), or a `placement.WorkerLocal`.
    counts_dtype: the dtype of the cycle's counts (`numerics.counts_dtype`).

  Returns:
    A `cycle.TrainOpState`.

  Raises:
    ValueError: another wrapper train op counts `global_step` (see
      `count_global_step`).
  """
  fixed = isinstance(grad_steps, int)
  if global_step is not None:
    # Under a schedule the train op only counts it (`cycle.Schedule`).
    count_global_step(global_step, fixed and accumulates)
    distribute.plain_global_step_read(global_step)
  skipped = (None, None)
  if policy.nonfinite_policy:
    skipped = tuple(own_counter_variable(name, tf.int64, local)
                    for name in ('skipped_micro_batches', 'skipped_cycles'))
  if not accumulates:
    return cycle.TrainOpState(cycle.EveryMicroStep(), global_step, None,
                              skipped, counts_dtype)
  counts = {}
  with distribute.summed_on_save():  # see there: saved as their sum
    for name in policy.counts:
      counts[name] = own_variable(name, counts_dtype, local=local)
  if not fixed:
    train_op_cycle = cycle.Schedule(grad_steps, [
        own_counter_variable(name, tf.int64, local)
        for name in SCHEDULE_NAMES])
  elif own_counter:
    train_op_cycle = cycle.StepCycle(
        grad_steps, own_counter_variable(COUNTER_NAME, tf.float32, local),
        counts_global_step=False)
  else:
    train_op_cycle = cycle.StepCycle(grad_steps, global_step,
                                     counts_global_step=True)
  if local is None:  # see `checkpoints.Saver`
    checkpoints.record_settings(grad_steps if fixed else None,
                                policy.weighted, policy.nonfinite_policy,
                                numerics.NONFINITE_POLICIES,
                                train_op_cycle.place())
  return cycle.TrainOpState(train_op_cycle, global_step, counts, skipped,
                            counts_dtype)


def train_op_state(replica_context, *args):
  """The state of the train op being built, created once for all replicas.

  Under a multi-replica strategy every replica builds each train op: the
  same wrapper's `apply_gradients` runs once per replica, and an Estimator
  model_fn even makes a wrapper per replica. The n-th train op a replica
  builds in a graph is the n-th of every other replica: the first replica
  to build it creates its state (`create(*args)`), the others share it.
  Call it under `tf.init_scope()`.

  Args:
    replica_context: the current replica context, or None.
    *args: `create`'s arguments.

  Returns:
    A `cycle.TrainOpState`.
  """
  graph = tf.compat.v1.get_default_graph()
  states, calls = _TRAIN_OPS.setdefault(graph, ([], {}))
  replica = 0
  if replica_context is not None:
    replica = int(tf.get_static_value(
        replica_context.replica_id_in_sync_group) or 0)
  index = calls.get(replica, 0)
  calls[replica] = index + 1
  if index == len(states):
    states.append(create(*args))
  return states[index]


def own_variable(name, dtype, initial_value=0,
                 aggregation=tf.VariableAggregation.NONE, local=None):
  """Creates a scalar variable named `name` in the current variable scope.

  Call it under `tf.init_scope()`. The name is made unique in the graph.

  Args:
    name: the base name, e.g. 'update_count'.
    dtype: its dtype.
    initial_value: its initial (and reset) value.
    aggregation: how a multi-replica strategy aggregates writes.
    local: None (a global variable), or a `placement.WorkerLocal`.

  Returns:
    The variable (not trainable).
  """
  scope = tf.compat.v1.get_variable_scope().name
  full_name = scope + '/' + name if scope else name
  if local is not None:
    return local.variable(full_name, lambda: tf.constant(initial_value, dtype),
                          dtype)
  # name_scope(None): the variable scope's name, not the current name
  # scope's, as `tf.compat.v1.get_variable` (the original's) names it; the
  # graph appends _1, _2, ... when the name is taken.
  with tf.compat.v1.name_scope(None):
    variable = tf.compat.v1.Variable(
        lambda: tf.constant(initial_value, dtype), dtype=dtype,
        name=full_name, trainable=False, aggregation=aggregation)
  checkpoints.add_to_state(variable)
  return variable


def own_counter_variable(name, dtype, local=None):
  """A scalar `own_variable` that replicas write once for all (counters)."""
  return own_variable(
      name, dtype, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
      local=local)


def count_global_step(global_step, accumulates):
  """Records that a train op counts `global_step`; refuses a conflict.

  A train op that accumulates (an int grad_steps > 1) decides its cycle on
  the `global_step` it counts, so no other wrapper train op may count the
  same one: each would see only part of the micro-steps (two train ops run
  in turn each see every other one) and apply at the wrong micro-steps.

  Args:
    global_step: the variable passed to `apply_gradients`.
    accumulates: whether this train op decides its cycle on it.

  Raises:
    ValueError: another train op of a wrapper in this graph counts
      `global_step`, and one of the two decides its cycle on it.
  """
  graph = tf.compat.v1.get_default_graph()
  counted = _COUNTED_STEPS.setdefault(graph, [])
  key = getattr(global_step, '_shared_name', None) or global_step.name
  for other_key, other_accumulates in counted:
    if other_key == key and (accumulates or other_accumulates):
      raise ValueError(
          'global_step %s is already counted by another '
          'GradientAggregationOptimizer train op in this graph. A train op '
          'with grad_steps > 1 decides its cycle on the global_step it '
          'counts, so two train ops counting one global_step would apply at '
          'the wrong micro-steps. Pass global_step to one of them only and '
          'global_step=None to the others: each of those counts its cycle in '
          'a variable of its own (update_count_N).' % (global_step.name,))
  counted.append((key, accumulates))
