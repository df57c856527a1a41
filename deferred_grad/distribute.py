"""Distribution helpers: replica checks and multi-worker lockstep."""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import contextlib
import weakref

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


def check_replicas(replica_context, use_tpu, method='apply_gradients'):
  """Refuses the contexts the code paths cannot serve.

  Args:
    replica_context: `tf.distribute.get_replica_context()` where `method`
      was called (None in a cross-replica context).
    use_tpu: the wrapper's keyword.
    method: the name of the method called, for the message.

  Raises:
    RuntimeError: the GPU path in a cross-replica context; or the
      multi-worker `ParameterServerStrategy` of `tf.compat.v1.distribute`.
    ValueError: the TPU path under a strategy of several replicas.
  """
  strategy = tf.distribute.get_strategy()
  if ('ParameterServerStrategy' in type(strategy).__name__ and
      in_multi_worker_mode(strategy)):
    # It places every variable, the accumulators and counters included, on
    # the ps tasks: all workers would add into one accumulator and count
    # one cycle (see `placement` for the layout that works).
    raise RuntimeError(
        'GradientAggregationOptimizer does not support %s with parameter '
        'servers: it would place the accumulators on the ps tasks, shared by '
        'every worker, and train wrongly. Build the model under '
        'tf.compat.v1.train.replica_device_setter instead (an Estimator with '
        'ps tasks in TF_CONFIG and no train_distribute does): each worker '
        'then accumulates its own micro-batches '
        '(tools/examples/parameter_server_example.py).' %
        type(strategy).__name__)
  if use_tpu and strategy.num_replicas_in_sync > 1:
    # The TPU path applies inside its tf.cond, where the wrapped optimizer's
    # merge_call (the strategy's all-reduce) cannot run.
    raise ValueError(
        'use_tpu=True under %s with %d replicas: the TPU path applies inside '
        'a tf.cond, where the strategy cannot all-reduce the gradients. '
        'Under a multi-replica tf.distribute strategy use the GPU path, '
        'use_tpu=False (on TPUs, TPUEstimator(use_tpu=True) with '
        'GradientAggregationOptimizer(use_tpu=True) and no strategy).' %
        (type(strategy).__name__, strategy.num_replicas_in_sync))
  if not use_tpu and replica_context is None:
    raise RuntimeError(
        'GradientAggregationOptimizer.%s (and minimize) must be called in a '
        'replica context, not in a cross-replica context: under a '
        'tf.distribute strategy, call it inside the function you pass to '
        'strategy.extended.call_for_each_replica (or strategy.run), not '
        'directly under strategy.scope().' % method)


def in_multi_worker_mode(strategy):
  """True under a strategy whose replicas span several worker processes."""
  in_multi_worker = getattr(strategy.extended, '_in_multi_worker_mode', None)
  return bool(in_multi_worker and in_multi_worker())


@contextlib.contextmanager
def summed_on_save():
  """Per-replica variables created inside are saved as their sum.

  Under a multi-replica strategy each replica adds its own micro-batches into
  its own accumulator, and what the apply step needs is their sum over
  replicas. A mirrored variable would save replica 0's part only, so a job
  stopped mid-cycle would resume with every replica holding replica 0's
  part. Created inside this context, the accumulators (and the per-replica
  counts of a cycle) are sync-on-read variables with SUM aggregation:
  TensorFlow saves the sum over replicas under the variable's usual name,
  and a restore gives each replica an equal share of it, which sums to the
  same. Micro-steps still touch only their replica's own part.

  Where the replicas span several workers, a save would be a collective that
  only the saving worker (the chief) runs: there the variables stay mirrored
  (see tools/examples/multi_worker_example.py).

  Yields:
    Nothing.
  """
  strategy = tf.distribute.get_strategy()
  if (strategy.num_replicas_in_sync == 1 or
      in_multi_worker_mode(strategy)):
    yield
    return

  def on_read_sum(next_creator, **kwargs):
    kwargs['synchronization'] = tf.VariableSynchronization.ON_READ
    kwargs['aggregation'] = tf.VariableAggregation.SUM
    return next_creator(**kwargs)

  with tf.compat.v1.variable_creator_scope(on_read_sum):
    yield


@contextlib.contextmanager
def one_variable(device):
  """Variables created inside are one plain variable on `device`.

  Not one per replica: for state that every replica's part meets in (a
  table's list of rows, `row_lists.RowListAccumulator`), written once per run
  in the cross-replica context and saved as it is. Outside a multi-replica
  strategy this changes nothing.

  Args:
    device: where the variable lives.

  Yields:
    Nothing.
  """
  if tf.distribute.get_strategy().num_replicas_in_sync == 1:
    yield
    return
  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  from tensorflow.python.ops import ref_variable
  # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

  def plain(next_creator, **kwargs):
    del next_creator  # the strategy's creator would make one per replica
    kwargs.pop('distribute_strategy', None)
    with tf.device(device):
      return ref_variable.default_variable_creator(None, **kwargs)

  with tf.compat.v1.variable_creator_scope(plain):
    yield


def first_replica(distribution, value):
  """`value`, or its first replica's where `distribution` is a strategy.

  In a `merge_call`, values that differ per replica arrive as PerReplica;
  the train op's state and variables are the same on every replica.
  """
  if distribution is None:
    return value
  return distribution.experimental_local_results(value)[0]


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


def summed_counts(names, distribution, counts_fn, part, over_tpu_cores,
                  length=None):
  """({name: count summed over replicas (and TPU cores)}, replicas, checks).

  The cycle's one exchange between replicas besides the wrapped
  optimizer's own all-reduce: the counts travel as one small vector.

  Args:
    names: the counts' names, in the order `counts_fn` gives them.
    distribution: the strategy (in its cross-replica context), or None.
    counts_fn: returns a replica's counts (float scalars of one dtype) from
      its `part`.
    part: what each replica built (PerReplica under a strategy).
    over_tpu_cores: also sum over TPU cores (`apply_crs_to_grad`).
    length: under a schedule, the cycle's length. Where the replicas span
      several workers it travels with the counts, and `checks` holds the
      op that fails where the workers disagree (their collectives would no
      longer match).
  """
  replicas = 1 if distribution is None else distribution.num_replicas_in_sync
  agree = length is not None and distribution is not None and (
      in_multi_worker_mode(distribution))
  if not (names or agree):
    return {}, replicas, []
  if distribution is None:
    counts = counts_fn(part)
  else:
    def replica_counts(p):
      counts = counts_fn(p)
      if agree:
        dtype = counts[0].dtype if counts else tf.float32
        counts = counts + [tf.cast(length, dtype)]
      return tf.stack(counts)

    # One all-reduce: the scalars travel as one vector.
    per_replica = distribution.extended.call_for_each_replica(
        replica_counts, args=(part,))
    counts = tf.unstack(distribution.reduce(
        tf.distribute.ReduceOp.SUM, per_replica, axis=None))
  checks = [check_agreed(counts.pop(), replicas, length)] if agree else []
  if over_tpu_cores:
    crs = tf.compat.v1.tpu.cross_replica_sum
    counts = tf.unstack(crs(tf.stack(counts)))
    replicas = replicas * crs(tf.constant(1.0))
  return dict(zip(names, counts)), replicas, checks


def check_agreed(total, replicas, length):
  """An op failing unless every replica's cycle has this `length`.

  Args:
    total: the sum over replicas of each one's length (a float scalar).
    replicas: the number of replicas.
    length: this worker's length (int64).
  """
  return tf.debugging.Assert(
      tf.equal(total, replicas * tf.cast(length, total.dtype)),
      ['GradientAggregationOptimizer: the workers of this '
       'MultiWorkerMirroredStrategy disagree on the cycle\'s length: '
       'grad_steps (a schedule) gave', length, 'here, but the sum over the',
       replicas, 'replicas is', total, '. Give grad_steps a value that is '
       'the same on every worker: a constant, or a callable of the updates '
       'applied (tools/examples/schedule_example.py).'])


# graph -> the plain global-step read that `plain_global_step_read` cached.
_PLAIN_READS = weakref.WeakKeyDictionary()


def plain_global_step_read(global_step):
  """Gives hooks a read of `global_step` that needs no other worker.

  Hooks (`StopAtStepHook`, `CheckpointSaverHook`, ...) and loops fetch the
  tensor that `tf.compat.v1.train` caches for reading the global step:
  `cond(is_initialized, read, initial_value)`. Under
  `MultiWorkerMirroredStrategy` a variable's initial value is broadcast from
  worker 0, and the broadcast sits upstream of that `cond`, so every fetch
  of it runs a collective. When one worker makes one more such run than
  the other (a hook that reads the step just before stopping, a chief that
  logs it), the workers' collectives no longer match: both hang at the next
  all-reduce. Under a multi-worker strategy this caches a plain read
  instead, once the variable exists (the session initializes it before any
  hook runs).

  Args:
    global_step: the global step variable given to `apply_gradients`.
  """
  strategy = tf.distribute.get_strategy()
  if not in_multi_worker_mode(strategy):
    return
  # pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
  from tensorflow.python.training import training_util
  # pylint: enable=g-direct-tensorflow-import,g-import-not-at-top
  graph = tf.compat.v1.get_default_graph()
  cached = graph.get_collection_ref(training_util.GLOBAL_STEP_READ_KEY)
  if cached and cached[0] is _PLAIN_READS.get(graph):
    return
  with tf.init_scope(), graph.name_scope(None):
    with graph.name_scope(global_step.op.name + '/'):
      read = tf.identity(compat.local_variable(global_step).read_value(),
                         name='plain_read')
  _PLAIN_READS[graph] = read
  del cached[:]
  cached.append(read)


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
      position: the micro-step's `cycle.Position`.
    """
    in_cycle = position.in_cycle
    first = tf.equal(self._started.size(), 0)
    mid_cycle = tf.logical_and(first, tf.not_equal(in_cycle, 0))

    def mark():
      step = [] if position.step is None else ['(step', position.step, ')']
      warn = tf.print(*[
          'WARNING: GradientAggregationOptimizer: this session started '
          'mid-cycle, at micro-step', in_cycle, 'of its cycle'] + step + [
          'under MultiWorkerMirroredStrategy, as after '
          'restoring a checkpoint written mid-cycle, which holds only the '
          'saving worker\'s part of the cycle. Every worker drops this '
          'cycle (its apply step only resets) and trains on from the next.'])
      with tf.control_dependencies([warn]):
        return self._dropped.enqueue(True)

    marked = tf.cond(mid_cycle, mark, tf.no_op)
    with tf.control_dependencies([marked]):
      # Fills the queue on the session's first run only (0 or 1 elements).
      return self._started.enqueue_many([tf.boolean_mask([True], [first])])

  def keeps_cycle(self, after=()):
    """On an apply step: False if the cycle is dropped (and unmarks it).

    `after`: ops to run first (see `check_agreed`).
    """
    with tf.control_dependencies(after):
      taken = self._dropped.dequeue_many(self._dropped.size())
    return tf.equal(tf.size(taken), 0)


def mid_cycle_restart():
  """A `MidCycleRestart` where the replicas span several workers, or None."""
  if not in_multi_worker_mode(tf.distribute.get_strategy()):
    return None
  return MidCycleRestart()
