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

`worker_local(var_list)` detects this placement and returns a `WorkerLocal`,
which creates the state there as local variables: the counters, and a dense
accumulator as a worker-local variable. A table's accumulator there is a
`row_lists.RowListAccumulator` on the worker's CPU, which holds only the rows
the cycle looked up instead of a table-sized copy per worker.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat

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
      ['GradientAggregationOptimizer: on a parameter-server worker the '
       'accumulators and counters are local variables of the worker (%s '
       'is one): run tf.compat.v1.local_variables_initializer() in this '
       'session besides global_variables_initializer() '
       '(MonitoredTrainingSession and Estimator run both).' %
       first.op.name])]


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

  def variable(self, name, initial_value, dtype, list_of_rows=False):
    """A local, non-trainable variable on the worker.

    Args:
      name: its name (uniquified by the graph).
      initial_value: a callable returning its initial value.
      dtype: its dtype.
      list_of_rows: a `row_lists.RowListAccumulator`'s list: of no static
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
