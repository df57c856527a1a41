"""Where the wrapper's state lives: beside the variables, or on the worker.

By default the accumulators are slots of the wrapped optimizer, placed with
their variables, and the counters are global variables: every saver writes
them, and a job resumes mid-cycle.

Under between-graph replication with parameter servers
(`tf.compat.v1.train.replica_device_setter`, a legacy Estimator with `ps`
tasks in `TF_CONFIG`), the variables live on `ps` tasks and each worker
builds its own graph. State placed with the variables would be shared by
all workers, which then add into one accumulator and count one cycle: micro-
batches lost, applied twice, merged. There each worker keeps its own
accumulators and cycle counter on its own device, as local variables
(`LOCAL_VARIABLES`: not saved by the chief, initialized by
`local_variables_initializer()`, which `MonitoredTrainingSession` and
Estimator run), as TensorFlow's `SyncReplicasOptimizer` keeps its local
step. A worker decides its cycle on its own counter and hands the wrapped
optimizer the mean of its own K micro-batches once per K micro-steps:
asynchronous training, like the bare optimizer's, with K times fewer pushes
to the parameter servers. A restart loses each worker's partial cycle (at
most K - 1 micro-batches per worker), as with `SyncReplicasOptimizer`.

`worker_device(var_list)` detects this placement; `WorkerLocal` creates the
state there, and the accumulators: a dense one as a worker-local variable,
and for a table (sparse gradients) a `RowQueueAccumulator`, which holds only
the rows the cycle looked up instead of a table-sized copy per worker.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import accumulators
from deferred_grad import compat
from deferred_grad import zeros

tf = compat.import_tensorflow()


def _job(device):
  return tf.DeviceSpec.from_string(device or '').job


def worker_device(var_list):
  """The worker's device when `var_list` lives on other jobs, else None.

  Call it where `apply_gradients` builds its ops: their device (set by
  `replica_device_setter`) is the worker's.

  Args:
    var_list: the variables that receive gradients.

  Returns:
    A device string such as '/job:worker/task:1', or None.
  """
  if tf.distribute.has_strategy():
    return None  # tf.distribute strategies place replicas themselves
  variable_jobs = {_job(v.device) for v in var_list} - {None}
  if not variable_jobs:
    return None  # one process: no probe op in the graph
  probe = tf.constant(0, name='placement_probe')
  here = probe.op.device
  job = _job(here)
  if job and variable_jobs - {job}:
    return here
  return None


def worker_local(var_list):
  """A `WorkerLocal` where `var_list` lives on other jobs, else None."""
  device = worker_device(var_list)
  return WorkerLocal(device) if device else None


class WorkerLocal(object):
  """Creates the wrapper's state on the worker, as local variables.

  Args:
    device: the worker's device.
  """

  def __init__(self, device):
    self.device = device

  def variable(self, name, initial_value, dtype):
    """A local, non-trainable variable on the worker.

    Args:
      name: its name (uniquified by the graph).
      initial_value: a callable returning its initial value.
      dtype: its dtype.

    Returns:
      The variable.
    """
    with tf.compat.v1.name_scope(None), tf.device(self.device):
      return tf.compat.v1.Variable(
          initial_value, dtype=dtype, name=name, trainable=False,
          collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

  def accumulator(self, variable, gradient, grad_steps, sparse, dtype):
    """The worker's accumulator for `variable` (see the module docstring)."""
    if sparse and isinstance(gradient, tf.IndexedSlices):
      return RowQueueAccumulator(variable, grad_steps, dtype, self.device)
    shape = variable.shape
    worker_copy = self.variable(
        variable.op.name + '/' + accumulators.SLOT_OP_NAME,
        lambda: zeros.run_time_zeros(shape, dtype), dtype)
    return accumulators.DenseAccumulator(worker_copy, grad_steps)


class RowQueueAccumulator(object):
  """A table's accumulator on a worker, for tables on parameter servers.

  A worker-local copy of a table as large as the table (on every worker) is
  what the dense and sparse kinds would need; this one holds only the rows
  the cycle looked up: each micro-step enqueues its ids and rows (divided by
  `grad_steps`) in a queue on the worker, and the apply step takes them all,
  adds up the rows of equal ids and hands on an `IndexedSlices` over every
  id touched. Memory and time O(rows looked up per cycle); nothing goes to
  the parameter servers before the apply step. The queue is not saved:
  a restarted worker starts a new cycle (see `placement`).

  Args:
    variable: the table (or one partition of it).
    grad_steps: micro-steps per cycle.
    dtype: the accumulator's dtype.
    device: the worker's device.
  """

  def __init__(self, variable, grad_steps, dtype, device):
    self._grad_steps = grad_steps
    self._dtype = dtype
    self._dense_shape = variable.shape
    # On the worker's CPU, also under a GPU worker device: queues have no
    # GPU kernels.
    with tf.device(compat.host_device(device)):
      self._queue = tf.queue.FIFOQueue(
          2**31 - 1, [tf.int64, dtype], shapes=[[], variable.shape[1:]],
          name=variable.op.name.replace('/', '_') + '_accumulated_rows')

  def mark(self):
    return tf.no_op()

  def add(self, gradient):
    """Enqueues the micro-step's rows / grad_steps, with their ids."""
    if not isinstance(gradient, tf.IndexedSlices):
      raise ValueError('a table on a parameter server got a dense gradient '
                       '(%s); expected an IndexedSlices.' % (gradient,))
    return self._queue.enqueue_many([
        tf.cast(tf.reshape(gradient.indices, [-1]), tf.int64),
        tf.cast(gradient.values, self._dtype) / self._grad_steps])

  def read(self):
    """The cycle's rows, those of equal ids added up, as IndexedSlices."""
    ids, rows = self._queue.dequeue_many(self._queue.size())
    unique, positions = tf.unique(ids)
    summed = tf.math.unsorted_segment_sum(rows, positions, tf.size(unique))
    return tf.IndexedSlices(summed, unique,
                            tf.constant(self._dense_shape.as_list(), tf.int64))

  def reset(self, after, gradient):
    """The read emptied the queue: makes sure it ran, also in a cycle
    that applies nothing (a `nonfinite_policy` skipping it)."""
    with tf.control_dependencies([after]):
      return tf.group(after, gradient.indices)

