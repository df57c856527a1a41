"""A table's accumulator as a list of the rows looked up, beside their ids.

`RowListAccumulator` accumulates a table's sparse gradients
(`tf.IndexedSlices`) in one process, under `MirroredStrategy` and on
parameter-server workers: memory follows the rows a cycle looks up, not the
table (see `tables` for the other kind). Beside it, what knows the list's
layout: its columns (`list_columns`), an empty list (`empty_list`), and
`check_dense`, which finds a list restored into a dense accumulator.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat
from deferred_grad import kernels
from deferred_grad import lazy_cond

tf = compat.import_tensorflow()


def ids_of(gradient):
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
  """A list of no rows (its header: 0 rows) and no room, of no static
  shape: the list grows (also to a restored dense accumulator's shape), and
  graph optimizers must not fold it."""
  return tf.compat.v1.placeholder_with_default(tf.zeros([1, columns], dtype),
                                               None)


def _recorded_length(row, dtype):
  """The int64 that a list's header, `row` (row 0), records in its id
  columns; meaningless for another value, of any shape."""
  id_columns = _id_columns(dtype)
  head = tf.concat([tf.reshape(row, [-1]), tf.zeros([id_columns], dtype)], 0)
  return tf.bitcast(head[:id_columns] if id_columns > 1 else head[0],
                    tf.int64)


def check_dense(variable):
  """An op that makes sure `variable`, a dense table accumulator, is dense.

  A restore takes any shape into a resource variable (that of a ref
  variable fails on another shape), and a checkpoint written with
  `sparse_as_dense=False` holds a `RowListAccumulator`'s list of rows
  there: an empty one (saved at a cycle's end, n = 0) becomes zeros; a
  list of rows fails loudly (a dense kernel would add ids and all).

  Returns:
    The op, to run before the accumulator is used.
  """
  if compat.is_ref_variable(variable):
    return tf.no_op()  # a ref variable's restore checks the shape itself
  shape = tf.raw_ops.VariableShape(input=variable.handle, out_type=tf.int64)
  static = variable.shape.as_list()
  name = variable.op.name.split('/replica_')[0]

  def from_list():
    dtype = variable.dtype.base_dtype
    row = tf.raw_ops.ResourceGather(resource=variable.handle, indices=[0],
                                    dtype=dtype)
    empty = tf.debugging.Assert(tf.logical_and(
        tf.equal(shape[-1], list_columns(variable, dtype) or -1),
        tf.equal(_recorded_length(row, dtype), 0)), [(
            '%s holds a list of the rows looked up, from a checkpoint written '
            'mid-cycle with sparse_as_dense=False; with sparse_as_dense=True '
            '(and inside XLA, and under MultiWorkerMirroredStrategy) a table '
            'is accumulated densely. Resume that checkpoint as it was '
            'written, or from one written at a cycle\'s end.' % name)])
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
  [1 + capacity, id columns + row width]. Row 0 is a header: the number n
  of rows listed, an int64 bitcast into the id columns. Rows 1 to n each
  hold an int64 id, its 8 bytes bitcast into the first columns
  (`_id_columns`), then that row's gradient; the rows after them are free.
  Ids and rows stay in one variable, under the original's name, so that
  every Saver (also one given `tf.compat.v1.global_variables()`) saves the
  partial sums. Each micro-step writes its rows (divided by the divisor)
  and the new header in place, one scatter: its cost follows its own rows,
  not the list's or the table's. Where they do not fit, the list is
  rebuilt with up to twice the room, first added up by id where it is
  longer than the table: it never holds more than the table's rows and one
  micro-step's. The apply step hands the list on as an `IndexedSlices`, a
  row per id looked up, repeated ids and all, as the large batch's gradient
  holds them (the wrapped optimizer adds repeats up, as it does for the
  large batch; `numerics.clip_by_global_norm` adds them up for the norm),
  also a row whose sum is exactly zero (a masked padding id); the reset
  sets n to 0.

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

  @property
  def local(self):
    """This replica's component of the slot (the slot itself without one)."""
    return compat.local_variable(self.slot)

  def _pack(self, ids, rows):
    ids = tf.reshape(tf.bitcast(ids, self._dtype), [-1, self._id_columns])
    rows = tf.reshape(rows, [-1, self._columns - self._id_columns])
    return tf.concat([ids, rows], 1)

  def _unpack(self, listed):
    """(int64 ids, rows as [n, row width]) of listed rows."""
    ids = listed[:, :self._id_columns]
    ids = tf.bitcast(ids if self._id_columns > 1 else ids[:, 0], tf.int64)
    return ids, listed[:, self._id_columns:]

  def _header(self, length):
    """Row 0 of a list of `length` rows."""
    return self._pack(tf.reshape(length, [1]),
                      tf.zeros([1, self._columns - self._id_columns],
                               self._dtype))

  def _gather(self, indices):
    local = self.local
    if compat.is_ref_variable(local):
      # A read made here, in this cond: not the variable's snapshot, which
      # may run before a rebuild in the same run and keep the old buffer.
      return tf.gather(local.read_value(), indices)
    return local.sparse_read(indices)

  def _state(self):
    """(is a list, its length n, its capacity): no read of the whole list.

    Not a list: a dense accumulator that a restore put there (n is then
    meaningless)."""
    local = self.local
    shape = (tf.shape(local.read_value(), out_type=tf.int64)  # see _gather
             if compat.is_ref_variable(local) else compat.variable_shape(local))
    is_list = tf.logical_and(tf.equal(tf.size(shape), 2),
                             tf.equal(shape[-1], self._columns))
    length = _recorded_length(self._gather([0]), self._dtype)
    return is_list, length, shape[0] - 1

  def _listed(self, is_list, length):
    """The listed rows; a restored dense accumulator's non-zero rows."""
    def from_dense():
      dense = tf.reshape(self.local.read_value(),
                         [-1, self._columns - self._id_columns])
      ids = nonzero_rows(dense)
      return self._pack(ids, tf.gather(dense, ids))
    return lazy_cond.cond(
        is_list, lambda: self._gather(tf.range(1, length + 1)), from_dense)

  def _assign(self, value):
    local = self.local
    if compat.is_ref_variable(local):
      return tf.compat.v1.assign(local, value, validate_shape=False).op
    return local.assign(value, read_value=False)

  def _scatter(self, indices, rows):
    """Writes `rows` at `indices`, in place; returns the op."""
    local = self.local
    if compat.is_ref_variable(local):
      return tf.compat.v1.scatter_update(local, indices, rows).op
    return local.scatter_update(tf.IndexedSlices(rows, indices)).op

  def rows(self, gradient, divisor):
    """The rows looked up (/ `divisor`), each beside its id: a list's part."""
    rows = divisor.divide(tf.cast(gradient.values, self._dtype))
    return self._pack(ids_of(gradient), rows)

  def add(self, gradient, divisor):
    """Appends the rows looked up (/ `divisor`); shared: see `append`."""
    if self.shared:
      return tf.no_op()
    return self.append([self.rows(gradient, divisor)])

  def append(self, parts):
    """Appends `parts` (from `rows`, in replica order) to the list."""
    with tf.device(self.slot.device):
      new = tf.concat(list(parts), 0)
      added = tf.shape(new, out_type=tf.int64)[0]
      is_list, length, capacity = self._state()
      fits = tf.logical_and(is_list, tf.logical_and(
          length >= 0, length + added <= capacity))

      def write():
        return self._scatter(
            tf.concat([[0], tf.range(length + 1, length + added + 1)], 0),
            tf.concat([self._header(length + added), new], 0))

      def rebuild():
        listed = self._listed(is_list, length)
        table_rows = self._dense_shape.as_list()[0]
        listed = lazy_cond.cond(
            tf.shape(listed, out_type=tf.int64)[0] <= table_rows,
            lambda: listed, lambda: self._summed(listed))
        listed = tf.concat([listed, new], 0)
        count = tf.shape(listed, out_type=tf.int64)[0]
        room = tf.maximum(count, tf.minimum(2 * count, table_rows + added))
        return self._assign(tf.concat([
            self._header(count), listed,
            tf.zeros(tf.stack([room - count, self._columns]), self._dtype)],
                                      0))

      return lazy_cond.cond(fits, write, rebuild)

  def _summed(self, listed):
    """`listed` with the rows of equal ids added up, in their order."""
    return self._pack(*sum_by_id(*self._unpack(listed)))

  def mark(self):
    return tf.no_op()

  def read(self, length):
    """The cycle's rows as IndexedSlices."""
    del length  # the list holds the cycle's rows
    if self._first:  # as the large batch's: repeated ids and all
      is_list, count, _ = self._state()
      ids, rows = self._unpack(self._listed(is_list, count))
    else:  # the first replica hands on the shared list's rows
      ids, rows = self._unpack(tf.zeros([0, self._columns], self._dtype))
    rows = tf.reshape(rows, [-1] + self._dense_shape[1:].as_list())
    return tf.IndexedSlices(rows, ids,
                            tf.constant(self._dense_shape.as_list(), tf.int64))

  def reset(self, after, gradient, shared_zeros=None):
    """Empties the list once `after` has run (keeping its room); the op."""
    del gradient, shared_zeros
    with tf.control_dependencies([after]):
      if not self._first:
        return tf.no_op()
      is_list, _, _ = self._state()
      return lazy_cond.cond(
          is_list,
          lambda: self._scatter([0], self._header(tf.constant(0, tf.int64))),
          lambda: self._assign(empty_list(self._columns, self._dtype)))


def nonzero_rows(value):
  """The int64 indices of `value`'s rows that are not all zero."""
  nonzero = tf.not_equal(value, 0)
  if value.shape.rank > 1:
    nonzero = tf.reduce_any(nonzero, axis=list(range(1, value.shape.rank)))
  return tf.reshape(tf.where(nonzero), [-1])
