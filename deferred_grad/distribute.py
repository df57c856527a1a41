"""Where replicas and workers meet: strategies, workers, parameter servers."""

import collections

from deferred_grad import compat

tf = compat.import_tensorflow()

# Where a train op is built, read once by `apply_gradients` and handed to
# the records and accumulators: this replica's index in its sync group (0
# without replicas), the replicas in sync, whether inside an XLA
# computation, whether the replicas span several workers, and the worker's
# `WorkerLocal` on a parameter-server worker (else None).
Build = collections.namedtuple(
    'Build', 'replica replicas in_xla multi_worker local')

COLLECTIVE_GRAPH_KEY = 20190101


def collective_run_options(graph_key=COLLECTIVE_GRAPH_KEY,
                           timeout_seconds=600):
  """`RunOptions` that keep multi-worker collectives in lockstep, bounded.

  In graph mode under `MultiWorkerMirroredStrategy`, each run with a graph
  key takes that key's next collective step id. Run `collective_barrier()`
  once with these options, then pass them to every run of the train op, as
  many on each worker, and to no other run: drifting ids hang the all-reduce.

  Args:
    graph_key: the collective graph key, the same on every worker.
    timeout_seconds: None, or a bound past which a run raises
      `tf.errors.DeadlineExceededError` rather than hang.

  Returns:
    A `tf.compat.v1.RunOptions`.
  """
  options = tf.compat.v1.RunOptions()
  options.experimental.collective_graph_key = graph_key
  if timeout_seconds is not None:
    options.timeout_in_ms = int(timeout_seconds * 1000)
  return options


@tf.autograph.experimental.do_not_convert
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


def summed_on_save(next_creator, **kwargs):
  """A variable creator: per-replica variables, saved as their sum.

  A mirrored accumulator would save replica 0's part only. Not used across
  workers, where a save would be a collective that only the chief runs.
  """
  # Saved as the replicas' sum; a restore gives each replica an equal share.
  kwargs['synchronization'] = tf.VariableSynchronization.ON_READ
  kwargs['aggregation'] = tf.VariableAggregation.SUM
  return next_creator(**kwargs)


def of_fixed_length(gradient, length):
  """`gradient`, an IndexedSlices, padded with zero rows to `length` rows.

  Across workers a gather all-reduces it, and fails ("Shape mismatch in the
  collective instance") once its shape changes. Call in a replica context.
  """
  context = tf.distribute.get_replica_context()
  indices = tf.cast(gradient.indices, tf.int64)
  # Padding repeats the largest id of any replica, so no sum by id changes
  # and no new row is touched (-1: none holds one, and none pads). Each
  # replica puts its largest in its place of a vector the all-reduce fills.
  mine = tf.one_hot(context.replica_id_in_sync_group,
                    context.num_replicas_in_sync, dtype=tf.float64)
  largest = tf.reduce_max(tf.concat([indices, [-1]], 0))
  largest = tf.cast(tf.reduce_max(context.all_reduce(
      tf.distribute.ReduceOp.SUM, mine * tf.cast(largest, tf.float64))),
                    tf.int64)
  # No truncation: only a cycle that MidCycleRestart drops (and never
  # all-reduces) holds more rows.
  padding = tf.maximum(length - tf.size(indices, out_type=tf.int64), 0)
  values = gradient.values
  zeros = tf.zeros(tf.concat([[padding], tf.shape(values, tf.int64)[1:]], 0),
                   values.dtype)
  return tf.IndexedSlices(tf.concat([values, zeros], 0),
                          tf.concat([indices, tf.fill([padding], largest)], 0),
                          gradient.dense_shape)


def summed_counts(distribution, counts, over_tpu_cores, length=None):
  """Sums the cycle's counts over replicas in one all-reduce of a vector.

  Args:
    distribution: the strategy (in its cross-replica context), or None.
    counts: each replica's counts as one vector (PerReplica or a tensor).
    over_tpu_cores: also sum over TPU cores (`apply_crs_to_grad`).
    length: None, or this worker's cycle length, the vector's last entry.

  Returns:
    (the summed counts as a list, the number of replicas, [an op failing
    unless every replica's cycle has this `length`] or []).
  """
  replicas = 1 if distribution is None else distribution.num_replicas_in_sync
  if distribution is not None:  # one all-reduce: one vector
    counts = distribution.reduce(tf.distribute.ReduceOp.SUM, counts,
                                 axis=None)
  counts = tf.unstack(counts)
  checks = []
  if length is not None:  # the sum over replicas of each one's length
    total = counts.pop()
    checks.append(tf.debugging.Assert(
        tf.equal(total, replicas * tf.cast(length, total.dtype)),
        ['GradientAggregationOptimizer: the workers disagree on the cycle\'s '
         'length: grad_steps (a schedule) gave', length, 'here; the sum over',
         replicas, 'replicas is', total, '. Give grad_steps the same value on '
         'every worker: a constant, or a callable of the updates applied '
         '(tools/examples/schedule_example.py).']))
  if over_tpu_cores:
    crs = tf.compat.v1.tpu.cross_replica_sum
    counts = tf.unstack(crs(tf.stack(counts))) if counts else []
    replicas = replicas * crs(tf.constant(1.0))
  return counts, replicas, checks


class MidCycleRestart(object):
  """Drops, on every worker alike, a cycle a session began mid-way.

  A `MultiWorkerMirroredStrategy` checkpoint holds only the saving worker's
  part of a cycle's sum: resuming mid-cycle would apply a wrong update. As
  every worker restores the same one, all drop the same cycle in lockstep.
  """

  def __init__(self):
    # Queues are private to a session: its first run fills `_started`.
    self._started = tf.queue.FIFOQueue(1, [tf.bool], shapes=[[]],
                                       name='session_started')
    self._dropped = tf.queue.FIFOQueue(1, [tf.bool], shapes=[[]],
                                       name='cycle_dropped')

  def check(self, position):
    """Returns an op that warns and marks the cycle if the session began in it.

    Args:
      position: the micro-step's `cycles.Position`.
    """
    first = tf.equal(self._started.size(), 0)
    mid_cycle = tf.logical_and(first, tf.not_equal(position.in_cycle, 0))

    def mark():
      step = [] if position.step is None else ['(step', position.step, ')']
      warn = tf.print(
          'WARNING: GradientAggregationOptimizer: this session started '
          'mid-cycle, at micro-step', position.in_cycle, 'of its cycle', *step,
          'under MultiWorkerMirroredStrategy (a checkpoint written mid-cycle '
          'holds only the saving worker\'s part): every worker drops this '
          'cycle (its apply step only resets) and trains on from the next.')
      with tf.control_dependencies([warn]):
        return self._dropped.enqueue(True)

    marked = tf.cond(mid_cycle, mark, tf.no_op)
    with tf.control_dependencies([marked]):
      # Fills the queue on the session's first run only (0 or 1 elements).
      return self._started.enqueue_many([tf.boolean_mask([True], [first])])

  def keeps_cycle(self, after=()):
    """Returns whether this apply step keeps its cycle, and unmarks it.

    Args:
      after: ops to run first (see `summed_counts`).
    """
    with tf.control_dependencies(after):
      taken = self._dropped.dequeue_many(self._dropped.size())
    return tf.equal(tf.size(taken), 0)


# ------------------------------------------- parameter-server workers --
# Under between-graph replication with parameter servers
# (`replica_device_setter`, an Estimator with `ps` tasks), state placed with
# the variables would be shared: all workers would add into one accumulator
# and count one cycle. So each worker keeps its own, as local variables (not
# saved by the chief; set up by `local_variables_initializer()`), as
# `SyncReplicasOptimizer` keeps its local step. Training stays asynchronous;
# a restart loses each worker's partial cycle.


def initialized_check(local, state_variables):
  """[An op failing while worker-local state is uninitialized], or [].

  Args:
    local: a `WorkerLocal`, or None (nothing to check).
    state_variables: the train op's own variables, created together.
  """
  if local is None or not state_variables:
    return []
  # Else TensorFlow's "uninitialized value" error names none of this.
  first = state_variables[0]
  return [tf.debugging.Assert(
      tf.compat.v1.is_variable_initialized(first),
      ['GradientAggregationOptimizer: on a parameter-server worker, %s and '
       'the other accumulators and counters are local variables of the '
       'worker: run tf.compat.v1.local_variables_initializer() too '
       '(MonitoredTrainingSession and Estimator do).' % first.op.name])]


def worker_local(var_list):
  """Where the wrapper's state goes on a parameter-server worker.

  Call it where `apply_gradients` builds its ops, on the worker's device.

  Args:
    var_list: the variables the train op updates.

  Returns:
    A `WorkerLocal` there where they live on other jobs (the ps), else None.
  """
  if tf.distribute.has_strategy():
    return None  # tf.distribute strategies place replicas themselves
  variable_jobs = {tf.DeviceSpec.from_string(v.device or '').job
                   for v in var_list} - {None}
  if not variable_jobs:
    return None  # one process: no probe op in the graph
  here = tf.constant(0, name='placement_probe').op.device
  job = tf.DeviceSpec.from_string(here or '').job
  return WorkerLocal(here) if job and variable_jobs - {job} else None


class WorkerLocal(object):
  """Creates the wrapper's state on the worker, as local variables.

  Args:
    device: the worker's device.
  """

  def __init__(self, device):
    self.device = device

  def variable(self, name, initial_value, dtype, list_of_rows=False):
    """Returns a local, non-trainable variable on the worker.

    Args:
      name, initial_value, dtype: as for `tf.compat.v1.Variable`.
      list_of_rows: a `RowListAccumulator`'s list: of no static shape, on the
        worker's CPU.
    """
    device = compat.host_device(self.device) if list_of_rows else self.device
    with tf.compat.v1.name_scope(None), tf.device(device):
      return tf.compat.v1.Variable(
          initial_value, dtype=dtype, name=name, trainable=False,
          validate_shape=not list_of_rows,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
