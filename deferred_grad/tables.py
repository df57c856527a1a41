"""Accumulators for tables: sparse gradients (`tf.IndexedSlices`) by row.

A table's gradient touches the rows a micro-batch looked up, and so does
its accumulator: no micro-step or apply step reads the whole table, and
outside XLA and multi-worker strategies no accumulator is as large as the
table either:

* `RowListAccumulator` (one process, `MirroredStrategy`, parameter-server
  workers): the cycle's rows themselves, each beside its id, so that memory
  follows the rows looked up. In one process and under `MirroredStrategy`
  it is the slot `<table>/GradientAccumulator`, in checkpoints with the
  partial sums; on a parameter-server worker a local variable of the
  worker (see `placement`).
* `SparseAccumulator` (inside XLA, and `MultiWorkerMirroredStrategy`): a
  table-sized slot, as the original's; a queue on the host records which
  rows were touched.

Both have the interface of `accumulators`: `add`, `mark`, `read`, `reset`.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat
from deferred_grad import kernels
from deferred_grad import lazy_cond
from deferred_grad import sharding

tf = compat.import_tensorflow()


def _host_queue(variable, suffix, dtypes, shapes, host):
  """An unbounded FIFO queue on `host`, named after `variable`."""
  with tf.device(host):
    return tf.queue.FIFOQueue(
        2**31 - 1, dtypes, shapes=shapes,
        name=variable.op.name.replace('/', '_') + suffix)


def _ids(gradient):
  """An IndexedSlices' row ids, flat, as int64."""
  return tf.cast(tf.reshape(gradient.indices, [-1]), tf.int64)


def sum_by_id(ids, rows):
  """(unique ids, rows of equal ids added up in their order)."""
  unique, positions = tf.unique(ids)
  return unique, tf.math.unsorted_segment_sum(rows, positions,
                                              tf.size(unique))


def _id_columns(dtype):
  """Columns of `dtype` that hold a row id (8 bytes) in a list of rows."""
  return 8 // dtype.size


def list_columns(variable, dtype):
  """A `RowListAccumulator`'s columns for `variable` in `dtype`, or None.

  None where that kind cannot hold `variable`'s rows: a shape unknown at
  graph build, or a dtype wider than an id (8 bytes).
  """
  if not variable.shape.is_fully_defined() or dtype.size > 8:
    return None
  return _id_columns(dtype) + variable.shape[1:].num_elements()


def empty_list(columns, dtype):
  """A list of no rows, of no static shape: the list grows and shrinks
  (also to a restored dense accumulator's shape), and graph optimizers must
  not fold it."""
  return tf.compat.v1.placeholder_with_default(tf.zeros([0, columns], dtype),
                                               None)


def check_dense(variable):
  """An op that makes sure `variable`, a dense table accumulator, is dense.

  A restore takes any shape into a resource variable (that of a ref
  variable fails on another shape), and a checkpoint written with
  `sparse_as_dense=False` holds a `RowListAccumulator`'s list of rows
  there: an empty one (saved at a cycle's end) becomes zeros; a list of
  rows fails loudly (a dense kernel would add ids and all).

  Returns:
    The op, to run before the accumulator is used.
  """
  if compat.is_ref_variable(variable):
    return tf.no_op()  # a ref variable's restore checks the shape itself
  shape = tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64)
  static = variable.shape.as_list()
  name = variable.op.name.split('/replica_')[0]

  def from_list():
    empty = tf.debugging.assert_equal(
        tf.reduce_prod(shape), tf.constant(0, tf.int64), message=(
            '%s holds a list of the rows looked up, from a checkpoint written '
            'mid-cycle with sparse_as_dense=False; with sparse_as_dense=True '
            '(and inside XLA, and under MultiWorkerMirroredStrategy) a table '
            'is accumulated densely. Resume that checkpoint as it was '
            'written, or from one written at a cycle\'s end.' % name))
    with tf.control_dependencies([empty]):
      # Not `assign`, which checks the shape the restore changed.
      return tf.raw_ops.AssignVariableOp(
          resource=variable.handle, validate_shape=False,
          value=kernels.run_time_zeros(static, variable.dtype.base_dtype))

  is_dense = tf.reduce_all(tf.equal(shape, tf.constant(static, tf.int64)))
  return lazy_cond.cond(is_dense, tf.no_op, from_list)


class RowListAccumulator(object):
  """A table's accumulator in memory proportional to the rows looked up.

  The slot `<table>/GradientAccumulator` is a list of rows of shape
  [rows looked up so far, id columns + row width], each row an int64 id,
  its 8 bytes bitcast into the first columns (`_id_columns`), then that
  row's gradient: ids and rows stay in one variable, under the original's
  name, so that every Saver (also one given
  `tf.compat.v1.global_variables()`) saves the partial sums. Each
  micro-step appends its rows (divided by the divisor): one concat, the
  cost of a micro-step not growing with the table. A list longer than the
  table (a small vocabulary under large batches) is first added up by id,
  so that it never holds more than the table's rows and one micro-step's.
  The apply step hands the list on as an `IndexedSlices`, a row per id
  looked up, repeated ids and all, as the large batch's gradient holds them
  (the wrapped optimizer adds repeats up, as it does for the large batch;
  `numerics.clip_by_global_norm` adds them up for the norm), also a row
  whose sum is exactly zero (a masked padding id); the reset empties it.

  A checkpoint of the original (or of a version before this kind) holds
  the table-sized dense accumulator under the same name: the first
  micro-step after its restore converts it into the list of its non-zero
  rows (a row touched before the save and summing to exactly zero is then
  not handed on, once).

  Under a multi-replica strategy in one process (`MirroredStrategy`) the
  replicas share one list, a plain variable on the first replica's host
  (`distribute.one_variable`): each replica's micro-step only packs its
  rows (`rows`), and where the replicas meet, once per run, they are
  appended in replica order (`append`). The first replica reads the cycle's
  rows and hands them on, the others an empty `IndexedSlices`, and the
  wrapped optimizer's all-reduce adds them up: the sum over replicas, as a
  checkpoint holds it (the same as one process's; either restores into the
  other, also mid-cycle).

  Args:
    slot: the list variable, of unknown static shape (`create_slot`).
    variable: the table (or one partition of it).
    dtype: the accumulator's dtype.
    replica: None with one replica; else this replica's index, among
      replicas that share the list.
  """

  in_place = False  # see `accumulators.Accumulators`

  def __init__(self, slot, variable, dtype, replica=None):
    self.slot = slot
    self.shared = replica is not None
    self._first = not replica  # reads and resets the list
    self._dtype = dtype
    self._dense_shape = variable.shape
    self._id_columns = _id_columns(dtype)
    self._columns = list_columns(variable, dtype)

  def _pack(self, ids, rows):
    ids = tf.reshape(tf.bitcast(ids, self._dtype), [-1, self._id_columns])
    rows = tf.reshape(rows, [-1, self._columns - self._id_columns])
    return tf.concat([ids, rows], 1)

  @property
  def local(self):
    """This replica's component of the slot (the slot itself without one)."""
    return compat.local_variable(self.slot)

  def _rows(self):
    """The list: converted from a dense accumulator a restore put there,
    added up by id where it is longer than the table."""
    value = self.local.read_value()
    shape = tf.shape(value, out_type=tf.int64)
    is_list = tf.logical_and(tf.equal(tf.size(shape), 2),
                             tf.equal(shape[-1], self._columns))
    short = tf.logical_and(
        is_list, shape[0] <= self._dense_shape.as_list()[0])
    listed = lambda: tf.reshape(value, [-1, self._columns])

    def from_dense():
      dense = tf.reshape(value, [-1, self._columns - self._id_columns])
      ids = _nonzero_rows(dense)
      return self._pack(ids, tf.gather(dense, ids))

    def long_or_dense():
      return lazy_cond.cond(is_list, lambda: self._summed(listed()),
                            from_dense)

    return lazy_cond.cond(short, listed, long_or_dense)

  def _summed(self, listed):
    """`listed` with the rows of equal ids added up, in their order."""
    return self._pack(*sum_by_id(*self._unpack(listed)))

  def _assign(self, value):
    local = self.local
    if compat.is_ref_variable(local):
      return tf.compat.v1.assign(local, value, validate_shape=False).op
    return local.assign(value, read_value=False)

  def _unpack(self, listed):
    """(int64 ids, rows as [n, row width]) of a list."""
    ids = listed[:, :self._id_columns]
    ids = tf.bitcast(ids if self._id_columns > 1 else ids[:, 0], tf.int64)
    return ids, listed[:, self._id_columns:]

  def rows(self, gradient, divisor):
    """The rows looked up (/ `divisor`), each beside its id: a list's part."""
    rows = divisor.divide(tf.cast(gradient.values, self._dtype))
    return self._pack(_ids(gradient), rows)

  def add(self, gradient, divisor):
    """Appends the rows looked up (/ `divisor`); shared: see `append`."""
    if self.shared:
      return tf.no_op()
    return self.append([self.rows(gradient, divisor)])

  def append(self, parts):
    """Appends `parts` (from `rows`, in replica order) to the list."""
    with tf.device(self.slot.device):
      return self._assign(tf.concat([self._rows()] + list(parts), 0))

  def mark(self):
    return tf.no_op()

  def read(self, length):
    """The cycle's rows as IndexedSlices."""
    del length  # the list holds the cycle's rows
    if self._first:  # as the large batch's: repeated ids and all
      ids, rows = self._unpack(self._rows())
    else:  # the first replica hands on the shared list's rows
      ids, rows = self._unpack(tf.zeros([0, self._columns], self._dtype))
    rows = tf.reshape(rows, [-1] + self._dense_shape[1:].as_list())
    return tf.IndexedSlices(rows, ids,
                            tf.constant(self._dense_shape.as_list(), tf.int64))

  def reset(self, after, gradient, shared_zeros=None):
    """Empties the list once `after` has run; returns the op."""
    del gradient, shared_zeros
    with tf.control_dependencies([after]):
      if not self._first:
        return tf.no_op()
      return self._assign(empty_list(self._columns, self._dtype))


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
  """

  in_place = False  # see `accumulators.Accumulators`

  def __init__(self, slot, num_partitions=None, in_xla=False):
    self.slot = slot
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
    checks = [] if self._rows is None else [check_dense(self.local)]
    with tf.control_dependencies(checks):
      added = self.local.scatter_add(tf.IndexedSlices(
          divisor.divide(tf.cast(gradient.values, dtype)), gradient.indices))
    if self._rows is None:
      return added
    with tf.device(self._host):
      recorded = self._rows.enqueue_many([_ids(gradient)])
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
      scanned, _ = tf.unique(tf.concat([_nonzero_rows(value), rows], 0))
      return tf.gather(value, scanned), scanned

    values, rows = lazy_cond.cond(complete, from_record, from_scan)
    return tf.IndexedSlices(values, rows,
                            dense_shape=compat.variable_shape(self.local))

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


def _nonzero_rows(value):
  """The int64 indices of `value`'s rows that are not all zero."""
  nonzero = tf.not_equal(value, 0)
  if value.shape.rank > 1:
    nonzero = tf.reduce_any(nonzero, axis=list(range(1, value.shape.rank)))
  return tf.reshape(tf.where(nonzero), [-1])
