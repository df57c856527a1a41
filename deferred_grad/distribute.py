"""Distribution helpers: replica checks and multi-worker lockstep."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat

tf = compat.import_tensorflow()

COLLECTIVE_GRAPH_KEY = 20190101


def collective_run_options(graph_key=COLLECTIVE_GRAPH_KEY):
  """`RunOptions` that keep multi-worker collectives in lockstep.

  Under `MultiWorkerMirroredStrategy` in graph mode, a distributed session
  takes collective step ids from a sequence per graph key. Micro-steps that
  only accumulate run no collective, and without a fixed key the workers'
  ids drift apart until the all-reduce of an apply step never matches: a
  hang. Pass these options to every `session.run` of the training loop,
  after running `collective_barrier()` with them once; every worker must
  make the same number of runs.

  Args:
    graph_key: the collective graph key, the same on every worker.

  Returns:
    A `tf.compat.v1.RunOptions`.
  """
  options = tf.compat.v1.RunOptions()
  options.experimental.collective_graph_key = graph_key
  return options


def collective_barrier(strategy=None):
  """A scalar all-reduce across all replicas: the training loop's first run.

  Args:
    strategy: the `MultiWorkerMirroredStrategy` (default: the current one).

  Returns:
    A tensor (the number of replicas) whose run waits for every worker.
  """
  strategy = strategy or tf.distribute.get_strategy()
  ones = strategy.extended.call_for_each_replica(lambda: tf.constant(1.0))
  return strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)


def check_replicas(replica_context, use_tpu, clip_norm, nonfinite_policy,
                   apply_crs_to_grad):
  """Refuses the contexts and replica counts the options cannot serve.

  Args:
    replica_context: `tf.distribute.get_replica_context()` where
      `apply_gradients` was called (None in a cross-replica context).
    use_tpu, clip_norm, nonfinite_policy, apply_crs_to_grad: the wrapper's
      keywords.

  Raises:
    RuntimeError: the GPU path in a cross-replica context.
    ValueError: `clip_norm` on several replicas under control flow v1, or a
      `nonfinite_policy` on several replicas.
  """
  if not use_tpu and replica_context is None:
    raise RuntimeError(
        'GradientAggregationOptimizer.apply_gradients must be called in a '
        'replica context (e.g. inside '
        'strategy.extended.call_for_each_replica), not in a cross-replica '
        'context.')
  replicas = replica_context.num_replicas_in_sync if replica_context else 1
  if (clip_norm is not None and replicas > 1 and
      not tf.compat.v1.control_flow_v2_enabled()):
    # The cross-replica norm needs an all-reduce inside tf.cond, which
    # fails with mirrored ref variables and control flow v1.
    raise ValueError(
        'clip_norm with several replicas needs control flow v2 and '
        'resource variables (tf.compat.v1.disable_eager_execution(), not '
        'disable_v2_behavior()).')
  if nonfinite_policy and (apply_crs_to_grad or replicas > 1):
    # Each replica would skip its own micro-batches, and replicas would
    # disagree on what a cycle's mean is.
    raise ValueError(
        'nonfinite_policy=%r needs a single replica; this apply_gradients '
        'runs on several (a multi-replica strategy or apply_crs_to_grad).'
        % (nonfinite_policy,))
