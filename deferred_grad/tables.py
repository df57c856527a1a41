"""Accumulators for tables: sparse gradients (`tf.IndexedSlices`) by row.

A table's gradient touches the rows a micro-batch looked up, and so does
its accumulator: no micro-step or apply step reads the whole table, and
outside XLA and multi-worker strategies no accumulator is as large as the
table either:

* `row_lists.RowListAccumulator` (one process, `MirroredStrategy`,
  parameter-server workers): the cycle's rows themselves, each beside its
  id, so that memory follows the rows looked up. In one process and under
  `MirroredStrategy` it is the slot `<table>/GradientAccumulator`, in
  checkpoints with the partial sums; on a parameter-server worker a local
  variable of the worker (see `placement`).
* `SparseAccumulator` (inside XLA, and `MultiWorkerMirroredStrategy`): a
  table-sized slot, as the original's; a queue on the host records which
  rows were touched. Under `MultiWorkerMirroredStrategy` it hands on as
  many rows on every apply step (`distribute.of_fixed_length`): as many as
  a cycle looks up, or the table holds.

Both have the interface of `accumulators`: `add`, `mark`, `read`, `reset`.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import kernels
from deferred_grad import lazy_cond
from deferred_grad import row_lists
from deferred_grad import sharding

tf = compat.import_tensorflow()


def _host_queue(variable, suffix, dtypes, shapes, host):
  """An unbounded FIFO queue on `host`, named after `variable`."""
  with tf.device(host):
    return tf.queue.FIFOQueue(
        2**31 - 1, dtypes, shapes=shapes,
        name=variable.op.name.replace('/', '_') + suffix)


class SparseAccumulator(object):
  """Accumulates `tf.IndexedSlices` row by row; the cycle costs O(rows touched).

  Each micro-step scatter-adds the rows it looked up (duplicates add up, as
  in the dense gradient) and records their ids in a queue beside the
  accumulator, with one marker per micro-step. The apply step takes the
  recorded ids, removes duplicates, and gathers, hands on and zeroes only
  those rows: no step reads the whole table, and every touched row is handed
  on, also one whose sum is exactly zero (a masked padding id), as in the
  large batch's gradient.

  The queue is neither a variable nor in a checkpoint: the original's
  checkpoints restore, and no initializer is needed. A session that has not
  seen a whole cycle (one restored from a checkpoint mid-cycle) finds fewer
  markers than the cycle's length and falls back, once, to a full read: the rows
  whose accumulated gradient is not zero and those it recorded (a row
  touched only before the restore and summing to exactly zero is then left
  out).

  Inside an XLA computation (a TPU rewrite, `xla.compile`) only static
  shapes compile, and the number of rows a cycle touches is not static:
  there the micro-steps still scatter-add, but the apply step hands on the
  whole accumulator as a dense gradient, as the original (and
  `sparse_as_dense=True`) did.

  Args:
    slot: the accumulator variable.
    num_partitions: `xla_num_partitions`, for full reads.
    in_xla: built inside an XLA computation (no queue; a dense hand-off).
    all_reduced: under `MultiWorkerMirroredStrategy`: hand on rows of one
      length on every apply step, which the workers' gather needs.
    cycle_rows: with `all_reduced`, the most rows a cycle looks up where
      known at graph build (else None: as many as the table holds).
  """

  in_place = False  # see `accumulators.Accumulators`
  shared = False  # each replica its own (see `row_lists`)

  def __init__(self, slot, num_partitions=None, in_xla=False,
               all_reduced=False, cycle_rows=None):
    self.slot = slot
    self._all_reduced = all_reduced
    self._cycle_rows = cycle_rows
    self._num_partitions = num_partitions
    self._rows = None
    # The record of row ids, and the work on it, stay on the host: queues
    # have no GPU kernels. Only the gathers and scatters touch the device.
    self._host = compat.host_device(self.local.device)
    if not in_xla:
      self._rows = _host_queue(self.local, '_touched_rows', [tf.int64], [[]],
                               self._host)

  @property
  def local(self):
    """This replica's component of the slot (the slot itself without one)."""
    return compat.local_variable(self.slot)

  def add(self, gradient, divisor):
    """Scatter-adds the rows looked up (/ `divisor`), and records them.

    The cost does not grow with the table.
    """
    dtype = self.slot.dtype.base_dtype
    # Inside XLA (no queue) no restore can have changed the shape.
    checks = [] if self._rows is None else [row_lists.check_dense(self.local)]
    with tf.control_dependencies(checks):
      added = self.local.scatter_add(tf.IndexedSlices(
          divisor.divide(tf.cast(gradient.values, dtype)), gradient.indices))
    if self._rows is None:
      return added
    with tf.device(self._host):
      recorded = self._rows.enqueue_many([row_lists.ids_of(gradient)])
    return tf.group(added, recorded)

  def mark(self):
    """Records one micro-step (added or skipped): run it on every one."""
    if self._rows is None:
      return tf.no_op()
    with tf.device(self._host):
      return self._rows.enqueue(tf.constant(-1, tf.int64))

  def read(self, length):
    """The accumulated gradient: IndexedSlices over the touched rows.

    (Inside XLA: the dense accumulator.)
    """
    if self._rows is None:
      return sharding.shard(self.local.read_value(), self._num_partitions)
    with tf.device(self._host):
      recorded = self._rows.dequeue_many(self._rows.size())
      is_row = recorded >= 0
      rows, _ = tf.unique(tf.boolean_mask(recorded, is_row))
      complete = tf.greater_equal(
          tf.reduce_sum(tf.cast(tf.logical_not(is_row), tf.int64)),
          tf.cast(length, tf.int64))

    def from_record():
      return tf.gather(self.local, rows), rows

    def from_scan():
      # Also the rows this session recorded: only a row touched before the
      # restore alone and summing to exactly zero is left out, once.
      value = sharding.shard(self.local.read_value(), self._num_partitions)
      scanned, _ = tf.unique(tf.concat([row_lists.nonzero_rows(value), rows], 0))
      return tf.gather(value, scanned), scanned

    values, rows = lazy_cond.cond(complete, from_record, from_scan)
    gradient = tf.IndexedSlices(values, rows,
                                dense_shape=compat.variable_shape(self.local))
    if self._all_reduced:
      # The workers' all-reduces gather slices of one length only: as many
      # as a cycle looks up, or the table holds, whichever is fewer.
      length = tf.cast(gradient.dense_shape[0], tf.int64)
      if self._cycle_rows is not None:
        length = tf.minimum(length, self._cycle_rows)
      return distribute.of_fixed_length(gradient, length)
    return gradient

  def reset(self, after, gradient, shared_zeros=None):
    """Zeroes the rows `gradient` (what `read` returned) holds, after `after`.

    Returns:
      The op.
    """
    with tf.control_dependencies([after]):
      if not isinstance(gradient, tf.IndexedSlices):  # inside XLA
        return kernels.zero(self.local, shared_zeros)
      dtype = self.slot.dtype.base_dtype
      return self.local.scatter_update(
          tf.IndexedSlices(tf.zeros_like(gradient.values, dtype),
                           gradient.indices))
