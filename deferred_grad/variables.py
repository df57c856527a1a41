"""The wrapper's own variables (counters): one set per train op.

Each call of `apply_gradients` builds a train op with its own cycle, so it
owns its counters: two wrappers in one graph (a GAN's generator and
discriminator), or one wrapper minimizing two losses, never share one. The
first train op in a graph keeps the original's names (`update_count`), so
that the original's checkpoints restore; later ones get unique names
(`update_count_1`, ...), in the order the graph builds them, as TensorFlow
names ops. They are created outside the caller's variable-scope `reuse`
setting, which would otherwise hand every wrapper the same variable.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import weakref

from deferred_grad import checkpoints
from deferred_grad import compat

tf = compat.import_tensorflow()

# graph -> [(global step key, whether it accumulates)] of the train ops
# that count it.
_COUNTED_STEPS = weakref.WeakKeyDictionary()
# graph -> ([state of the n-th train op], {replica id: train ops it built}).
_TRAIN_OPS = weakref.WeakKeyDictionary()
def train_op_state(replica_context, create):
  """The state of the train op being built, created once for all replicas.

  Under a multi-replica strategy every replica builds each train op: the
  same wrapper's `apply_gradients` runs once per replica, and an Estimator
  model_fn even makes a wrapper per replica. The n-th train op a replica
  builds in a graph is the n-th of every other replica: the first replica
  to build it creates its state with `create()`, the others share it.

  Args:
    replica_context: the current replica context, or None.
    create: returns the new train op's state.

  Returns:
    The state.
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
    states.append(create())
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


def own_counter(name, dtype, local=None):
  """A scalar `own_variable` that replicas write once for all (counters)."""
  return own_variable(
      name, dtype, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
      local=local)


def count_global_step(global_step, accumulates):
  """Records that a train op counts `global_step`; refuses a conflict.

  A train op that accumulates (grad_steps > 1) decides its cycle on the
  `global_step` it counts, so no other wrapper train op may count the same
  one: each would see only part of the micro-steps (two train ops run in
  turn each see every other one) and apply at the wrong micro-steps.

  Args:
    global_step: the variable passed to `apply_gradients`.
    accumulates: whether this train op accumulates (grad_steps > 1).

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
