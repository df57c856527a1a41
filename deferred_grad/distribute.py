"""Where replicas and workers meet: strategies, workers, parameter servers.

In one process (a strategy of one replica) nothing here runs. Under a
multi-replica strategy the replicas of a train op meet once per apply step
(`summed_counts`: the cycle's counts in one all-reduce), their accumulators
are saved as their sum (`summed_on_save`), and under
`MultiWorkerMirroredStrategy` the workers keep their collectives in
lockstep (`collective_run_options`, `collective_barrier`), hand on a
table's rows in slices of one length (`of_fixed_length`) and drop a cycle a
session began mid-way (`MidCycleRestart`). On parameter-server workers
(`worker_local`) the state is the worker's own.
"""

from deferred_grad import compat

tf = compat.import_tensorflow()

COLLECTIVE_GRAPH_KEY = 20190101


def collective_run_options(graph_key=COLLECTIVE_GRAPH_KEY,
                           timeout_seconds=600):
  """`RunOptions` that keep multi-worker collectives in lockstep, bounded.

  Under `MultiWorkerMirroredStrategy` in graph mode, a distributed session
  takes collective step ids from a sequence per graph key, one per run made
  with that key. Micro-steps that only accumulate run no collective, and
  without a fixed key the workers' ids drift apart until the all-reduce of
  an apply step never matches: a hang. Pass these options to the runs of
  the train op (after running `collective_barrier()` with them once), the
  same number on every worker, and to no other run: a read or a log with
  them on one worker alone moves its sequence on, and the workers'
  collectives no longer match.

  Args:
    graph_key: the collective graph key, the same on every worker.
    timeout_seconds: None, or a bound on each run: a run that waits longer
      (for a worker that made another number of runs, or died) fails with
      `tf.errors.DeadlineExceededError` instead of hanging.

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
  """A variable creator: per-replica variables saved as their sum.

  Under a multi-replica strategy each replica adds its own micro-batches into
  its own accumulator, and what the apply step needs is their sum over
  replicas. A mirrored variable would save replica 0's part only, so a job
  stopped mid-cycle would resume with every replica holding replica 0's
  part. Created under `tf.compat.v1.variable_creator_scope(summed_on_save)`,
  the accumulators (and the per-replica counts of a cycle) are sync-on-read
  variables with SUM aggregation: TensorFlow saves the sum over replicas
  under the variable's usual name, and a restore gives each replica an
  equal share of it, which sums to the same. Micro-steps still touch only
  their replica's own part.

  Where the replicas span several workers, a save would be a collective that
  only the saving worker (the chief) runs: there the variables stay mirrored
  (see tools/examples/multi_worker_example.py), and this is not used.

  Args:
    next_creator: the next variable creator.
    **kwargs: the variable's arguments.

  Returns:
    The variable.
  """
  kwargs['synchronization'] = tf.VariableSynchronization.ON_READ
  kwargs['aggregation'] = tf.VariableAggregation.SUM
  return next_creator(**kwargs)


def of_fixed_length(gradient, length):
  """`gradient`, an IndexedSlices of at most `length` rows, padded to them.

  (More rows stay as they are: only a cycle that a session begun mid-way
  drops can hold more, and its rows are never all-reduced.)

  Under `MultiWorkerMirroredStrategy` TensorFlow all-reduces an
  IndexedSlices by gathering every replica's; in a session the gather fails
  ("Shape mismatch in the collective instance") once its shape differs
  from the shape of its first run, and the rows a cycle touches differ
  from cycle to cycle. Padding rows repeat an id that some replica holds,
  with zero values: the sum by id is the same, and no row is touched that
  no replica touched. Call it in a replica context.
  """
  context = tf.distribute.get_replica_context()
  indices = tf.cast(gradient.indices, tf.int64)
  # The largest id of any replica (-1: none holds one, and none pads):
  # each replica's in its place of a vector that the all-reduce fills.
  mine = tf.one_hot(context.replica_id_in_sync_group,
                    context.num_replicas_in_sync, dtype=tf.float64)
  largest = tf.reduce_max(tf.concat([indices, [-1]], 0))
  largest = tf.cast(tf.reduce_max(context.all_reduce(
      tf.distribute.ReduceOp.SUM, mine * tf.cast(largest, tf.float64))),
                    tf.int64)
  padding = tf.maximum(length - tf.size(indices, out_type=tf.int64), 0)
  values = gradient.values
  zeros = tf.zeros(tf.concat([[padding], tf.shape(values, tf.int64)[1:]], 0),
                   values.dtype)
  return tf.IndexedSlices(tf.concat([values, zeros], 0),
                          tf.concat([indices, tf.fill([padding], largest)], 0),
                          gradient.dense_shape)


def summed_counts(distribution, counts, over_tpu_cores, length=None):
  """(counts summed over replicas and TPU cores, replicas, checks).

  The cycle's one exchange between replicas besides the wrapped
  optimizer's own all-reduce: the counts travel as one small vector.

  Args:
    distribution: the strategy (in its cross-replica context), or None.
    counts: each replica's counts as one vector (PerReplica under a
      strategy; a tensor without one).
    over_tpu_cores: also sum over TPU cores (`apply_crs_to_grad`).
    length: None, or (where the replicas span several workers, under a
      schedule) this worker's cycle length, which the vector's last entry
      holds: `checks` then holds the op that fails where the workers
      disagree (their collectives would no longer match).

  Returns:
    (a list of the summed counts, the number of replicas (a number, or a
    scalar over TPU cores), [ops to run before applying]: at most an op
    failing unless every replica's cycle has this `length`).
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

  Under `MultiWorkerMirroredStrategy` each worker holds its own part of a
  cycle's sum, and a checkpoint holds the saving worker's part only (a save
  of all parts would be a collective the other workers do not run). A
  session restored from a checkpoint written mid-cycle (time-based saving
  usually writes one) would give every worker that part and apply a wrong
  update. So the first micro-step of each session checks where it is: mid-
  cycle, it logs a warning and marks the cycle, whose apply step then only
  resets; training goes on from the next cycle. Every worker restores the
  same checkpoint, so every worker drops the same cycle and their
  collectives still match. The marks live in queues private to the session,
  which its first run fills.
  """

  def __init__(self):
    self._started = tf.queue.FIFOQueue(1, [tf.bool], shapes=[[]],
                                       name='session_started')
    self._dropped = tf.queue.FIFOQueue(1, [tf.bool], shapes=[[]],
                                       name='cycle_dropped')

  def check(self, position):
    """An op marking a session's first micro-step if it is mid-cycle.

    Args:
      position: the micro-step's `records.Position`.

    Returns:
      An op (a warning printed and the cycle marked as dropped, where it is
      mid-cycle; else nothing).
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
    """On an apply step: whether the cycle is kept (and unmarks it).

    Args:
      after: ops to run first (see `summed_counts`).

    Returns:
      A boolean scalar tensor: False where this session started mid-cycle
      and the cycle is dropped.
    """
    with tf.control_dependencies(after):
      taken = self._dropped.dequeue_many(self._dropped.size())
    return tf.equal(tf.size(taken), 0)


# ------------------------------------------- parameter-server workers --
# Under between-graph replication with parameter servers
# (`tf.compat.v1.train.replica_device_setter`, a legacy Estimator with `ps`
# tasks in `TF_CONFIG`), the variables live on `ps` tasks and each worker
# builds its own graph. State placed with the variables would be shared by
# all workers, which then add into one accumulator and count one cycle. There
# each worker keeps its own accumulators and cycle counter on its own device,
# as local variables (`LOCAL_VARIABLES`: not saved by the chief, initialized
# by `local_variables_initializer()`, which MonitoredTrainingSession and
# Estimator run), as TensorFlow's `SyncReplicasOptimizer` keeps its local
# step. A worker hands the wrapped optimizer the mean of its own K
# micro-batches once per K micro-steps: asynchronous training, like the bare
# optimizer's, with K times fewer pushes to the parameter servers. A restart
# loses each worker's partial cycle (at most K - 1 micro-batches each).


def initialized_check(local, state_variables):
  """[An op failing a micro-step whose worker-local state is uninitialized].

  The worker's accumulators and counters are local variables: a raw
  `Session` that runs only `global_variables_initializer()` would fail at
  the first micro-step with TensorFlow's "Invalid variable reference" or
  "uninitialized value", naming none of this.

  Args:
    local: a `WorkerLocal`, or None (then there is nothing to check).
    state_variables: the train op's own variables, created together.

  Returns:
    A list of at most one op.
  """
  if local is None or not state_variables:
    return []
  first = state_variables[0]
  return [tf.debugging.Assert(
      tf.compat.v1.is_variable_initialized(first),
      ['GradientAggregationOptimizer: on a parameter-server worker, %s and '
       'the other accumulators and counters are local variables of the '
       'worker: run tf.compat.v1.local_variables_initializer() too '
       '(MonitoredTrainingSession and Estimator do).' % first.op.name])]


def worker_local(var_list):
  """Where the wrapper's state goes on a parameter-server worker.

  Call it where `apply_gradients` builds its ops: their device (set by
  `replica_device_setter`) is the worker's.

  Args:
    var_list: the variables the train op updates.

  Returns:
    A `WorkerLocal` on the worker's device (such as '/job:worker/task:1')
    where they live on other jobs (the ps), else None.
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
    """A local, non-trainable variable on the worker.

    Args:
      name: its name (uniquified by the graph).
      initial_value: a callable returning its initial value.
      dtype: its dtype.
      list_of_rows: an `accumulators.RowListAccumulator`'s list: of no static
        shape, on the worker's CPU also under a GPU worker device.

    Returns:
      The variable.
    """
    device = compat.host_device(self.device) if list_of_rows else self.device
    with tf.compat.v1.name_scope(None), tf.device(device):
      return tf.compat.v1.Variable(
          initial_value, dtype=dtype, name=name, trainable=False,
          validate_shape=not list_of_rows,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
