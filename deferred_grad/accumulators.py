"""Gradient accumulators: a train op's sums over a cycle, on one replica.

Each accumulator holds `sum(g) / grad_steps` of the cycle's micro-batches,
the original's scale, so that its checkpoints restore mid-cycle. `create`
makes a replica's `Accumulators`, over a `DenseAccumulator` (a slot updated
in place), a `RowListAccumulator` (a table's rows looked up, each with its
id) or a `PassThrough` (grad_steps=1) per variable. As a step costs the ops
it schedules, an add is one kernel; as accumulators are as large as the
parameters, no buffer as large as them is kept.
"""

import collections
import contextlib
import itertools

import numpy as np

from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import registry
from deferred_grad import sharding

tf = compat.import_tensorflow()

SLOT_NAME = 'grad_accum'
SLOT_OP_NAME = 'GradientAccumulator'
# Up to this size an accumulator is zeroed by assigning it zeros shared by
# every accumulator of its shape: one op each, and the shared transient is
# small. Larger ones are zeroed by a scatter, which needs no such buffer.
SHARED_ZEROS_MAX_BYTES = 1 << 20


def run_time_zeros(shape, dtype=tf.float32, partition_info=None):
  """Zeros of `shape`, made at run time: constant zeros would be kept by the
  session for its life and copied into the variable.

  Args:
    shape: a list or a 1-D integer tensor.
    dtype: the element type.
    partition_info: unused; part of the initializer signature.

  Returns:
    A tensor of zeros.
  """
  del partition_info
  return tf.raw_ops.Empty(shape=shape, dtype=tf.as_dtype(dtype).base_dtype,
                          init=True)


def _zero(variable, handle, shared_zeros, in_xla):
  """An op zeroing `variable` in place (`handle`: None for a ref variable).

  A large one gets a scalar zero scattered over its rows (no buffer as large
  as it), then `DisableCopyOnRead`, as a scatter makes it copy-on-read.
  Inside XLA, which updates in place by itself, an assign."""
  dtype = variable.dtype.base_dtype
  if not variable.shape.rank or in_xla:
    return variable.assign(tf.zeros(tf.shape(variable), dtype),
                           read_value=False)
  shape = variable.shape
  if (shape.is_fully_defined() and
      shape.num_elements() * dtype.size <= SHARED_ZEROS_MAX_BYTES):
    key = (tuple(shape.as_list()), dtype, variable.device)
    if key not in shared_zeros:
      with tf.control_dependencies(None):  # made once, not after one reset
        shared_zeros[key] = run_time_zeros(shape.as_list(), dtype)
    return tf.compat.v1.assign(variable, shared_zeros[key]).op
  rows = tf.compat.dimension_value(shape[0])
  if rows is None:  # known at run time only: read where the variable is
    rows = (tf.shape(variable, out_type=tf.int64) if handle is None else
            tf.raw_ops.VariableShape(input=handle, out_type=tf.int64))[0]
  with tf.device(compat.host_device(variable.device)):
    # On the host, as shapes are, and at run time: a folded constant of row
    # ids would stay for the session's life.
    rows = tf.range(tf.compat.v1.placeholder_with_default(
        tf.cast(rows, tf.int64), []))
  zeroed = tf.compat.v1.scatter_update(variable, rows, tf.zeros([], dtype)).op
  if handle is None:
    return zeroed
  with tf.control_dependencies([zeroed]):
    return tf.raw_ops.DisableCopyOnRead(resource=handle)


def reciprocal(length, dtype):
  """`1 / length` in `dtype` (`length`: an int or an int64 scalar): every
  accumulator adds its gradient times it."""
  if isinstance(length, int):
    return tf.constant(1.0 / length, dtype)
  return tf.math.reciprocal(tf.cast(length, dtype))


class DenseAccumulator(object):
  """Accumulates dense gradients in place, and zeroes them in place.

  Args:
    local: this replica's component of the accumulator (or the variable).
    handle: `local`'s resource handle, None for a ref variable.
    in_xla: whether built inside an XLA computation.
    num_partitions: `xla_num_partitions` (reads are sharded), or None.
    rows: whether gradients are a table's IndexedSlices, inside XLA.
  """

  shared = False  # each replica its own

  def __init__(self, local, handle, in_xla=False, num_partitions=None,
               rows=False):
    self.local = local
    self._handle = handle
    self._in_xla = in_xla
    self._num_partitions = num_partitions
    self._rows = rows

  def add(self, gradient, scale):
    """Returns an op adding `gradient * scale` (`scale`: 1 / the cycle's
    length, in the accumulator's dtype).

    Unsharded, a dense add is one in-place kernel: SGD with rate -`scale`.
    """
    dtype = self.local.dtype.base_dtype
    if self._rows:
      return self.local.scatter_add(tf.IndexedSlices(
          tf.cast(gradient.values, dtype) * scale, gradient.indices)).op
    # (A Tensor converts to itself: no op.)
    value = tf.cast(tf.convert_to_tensor(gradient), dtype)
    if self._num_partitions is not None:
      current = sharding.shard(self.local.read_value(), self._num_partitions)
      return self.local.assign(current + value * scale, read_value=False)
    if self._handle is None:
      return tf.raw_ops.ApplyGradientDescent(var=self.local, alpha=-scale,
                                             delta=value).op
    return tf.raw_ops.ResourceApplyGradientDescent(var=self._handle,
                                                   alpha=-scale, delta=value)

  def read(self):
    """The cycle's sum; a sharded table's carries the rule here, as its
    micro-steps do not read it."""
    value = self.local.read_value()
    if self._rows and self._num_partitions is not None:
      return sharding.shard(value, self._num_partitions)
    return value

  def reset(self, after, shared_zeros):
    """Zeroes the accumulator in place once `after` has run; the op."""
    with tf.control_dependencies([after]):
      return _zero(self.local, self._handle, shared_zeros, self._in_xla)


# ---------------------------------------------------------------- tables --

def sum_by_id(ids, rows):
  """Adds up the rows of equal ids.

  Args:
    ids: an int64 vector.
    rows: a tensor with a row per id.

  Returns:
    (the unique ids in order of first appearance, their summed rows).
  """
  unique, positions = tf.unique(ids)
  return unique, tf.math.unsorted_segment_sum(rows, positions,
                                              tf.size(unique))


def list_columns(variable, dtype):
  """The columns of `variable`'s row list in `dtype`: an int64 id's, then a
  row's; None where the shape is not static or `dtype` is wider than an id."""
  if not variable.shape.is_fully_defined() or dtype.size > 8:
    return None
  return 8 // dtype.size + variable.shape[1:].num_elements()


def empty_list(columns, dtype):
  """A list of no rows (a header of 0), of no static shape: the list grows,
  and graph optimizers must not fold it."""
  return tf.compat.v1.placeholder_with_default(tf.zeros([1, columns], dtype),
                                               None)


def _recorded_length(row, dtype):
  """The int64 length that a list's header `row` records; meaningless for
  another value."""
  columns = 8 // dtype.size  # an int64's
  head = tf.concat([tf.reshape(row, [-1]), tf.zeros([columns], dtype)], 0)
  return tf.bitcast(head[:columns] if columns > 1 else head[0], tf.int64)


class RowListAccumulator(object):
  """A table's accumulator in memory proportional to the rows looked up.

  Used wherever shapes may change between runs. The variable
  `<table>/GradientAccumulator` is [1 + capacity, id columns + row width]:
  row 0 holds the count n, rows 1 to n an int64 id (bitcast) and its row.
  Under the original's name every Saver saves it, and a restored dense
  accumulator becomes its non-zero rows at the next micro-step. A micro-step
  writes with one scatter, or rebuilds the list with up to twice the room.
  `read` hands on every row, repeated ids included. Replicas in one process
  share a mirrored variable's first component (`rows`, then `append`, in
  replica order); across workers each keeps its own, which `read` pads to a
  fixed length for the all-reduce.

  Args:
    variable: the table (or one partition of it).
    dtype: the accumulator's dtype.
    handle: this replica's component's resource handle, None for a ref one.
    listed: the list variable, or this replica's or the first component.
    replica: this replica's index where replicas share the list, else None.
    cycle_rows: across workers, the most rows a cycle looks up, or None.
    across_workers: whether `read` pads to a fixed length.
  """

  def __init__(self, variable, dtype, handle, listed, replica=None,
               cycle_rows=None, across_workers=False):
    self.local = listed
    self.shared = replica is not None
    self._first = not replica  # reads and resets the list
    self._dtype = dtype
    self._dense_shape = variable.shape
    self._id_columns = 8 // dtype.size
    self._columns = list_columns(variable, dtype)
    self._width = self._columns - self._id_columns  # a row's
    self._cycle_rows = cycle_rows
    self._across_workers = across_workers
    self._ref = handle is None

  def _pack(self, ids, rows):
    ids = tf.reshape(tf.bitcast(ids, self._dtype), [-1, self._id_columns])
    rows = tf.reshape(rows, [-1, self._width])
    return tf.concat([ids, rows], 1)

  def _unpack(self, listed):
    """(int64 ids, rows as [n, row width]) of listed rows."""
    ids = listed[:, :self._id_columns]
    ids = tf.bitcast(ids if self._id_columns > 1 else ids[:, 0], tf.int64)
    return ids, listed[:, self._id_columns:]

  def _header(self, length):
    """Row 0 of a list of `length` rows."""
    return self._pack(tf.reshape(length, [1]),
                      tf.zeros([1, self._width], self._dtype))

  def _gather(self, listed, indices):
    if self._ref:
      # A read made here, in this cond: not the variable's snapshot, which
      # may run before a rebuild in the same run and keep the old buffer.
      return tf.gather(listed.read_value(), indices)
    return listed.sparse_read(indices)

  def _state(self, listed):
    """(is a list, its length n, its capacity), without reading the list;
    not a list where a restore put a dense accumulator."""
    if self._ref:  # see _gather
      shape = tf.shape(listed.read_value(), out_type=tf.int64)
    else:
      shape = tf.raw_ops.VariableShape(input=listed.handle, out_type=tf.int64)
    is_list = tf.logical_and(tf.equal(tf.size(shape), 2),
                             tf.equal(shape[-1], self._columns))
    length = _recorded_length(self._gather(listed, [0]), self._dtype)
    return is_list, length, shape[0] - 1

  def _listed(self, listed, is_list, length):
    """The listed rows; a restored dense accumulator's non-zero rows."""
    def from_dense():
      dense = tf.reshape(listed.read_value(), [-1, self._width])
      nonzero = tf.reduce_any(tf.not_equal(dense, 0), axis=[1])
      ids = tf.reshape(tf.where(nonzero), [-1])  # of the non-zero rows
      return self._pack(ids, tf.gather(dense, ids))
    return compat.cond(
        is_list, lambda: self._gather(listed, tf.range(1, length + 1)),
        from_dense)

  def rows(self, gradient, scale):
    """The rows looked up (times `scale`), each beside its id: a list's
    part."""
    rows = tf.cast(gradient.values, self._dtype) * scale
    return self._pack(tf.cast(tf.reshape(gradient.indices, [-1]), tf.int64),
                      rows)

  def add(self, gradient, scale):
    """Appends the rows looked up (times `scale`); shared: see `append`."""
    if self.shared:
      return tf.no_op()
    return self.append([self.rows(gradient, scale)])

  def append(self, parts):
    """Appends `parts` to the list.

    Args:
      parts: packed rows (`rows`), one per replica sharing the list, in order.

    Returns:
      The op.
    """
    listed = self.local
    with tf.device(listed.device):
      new = tf.concat(list(parts), 0)
      added = tf.shape(new, out_type=tf.int64)[0]
      is_list, length, capacity = self._state(listed)
      fits = tf.logical_and(is_list, tf.logical_and(
          length >= 0, length + added <= capacity))

      def write():
        # In place: the new header and the rows after the listed ones.
        return tf.compat.v1.scatter_update(
            listed,
            tf.concat([[0], tf.range(length + 1, length + added + 1)], 0),
            tf.concat([self._header(length + added), new], 0)).op

      def rebuild():
        rows = self._listed(listed, is_list, length)
        table_rows = self._dense_shape.as_list()[0]
        rows = compat.cond(
            tf.shape(rows, out_type=tf.int64)[0] <= table_rows,
            lambda: rows, lambda: self._pack(*sum_by_id(*self._unpack(rows))))
        rows = tf.concat([rows, new], 0)
        count = tf.shape(rows, out_type=tf.int64)[0]
        room = tf.maximum(count, tf.minimum(2 * count, table_rows + added))
        free = tf.zeros(tf.stack([room - count, self._columns]), self._dtype)
        rows = tf.concat([self._header(count), rows, free], 0)
        return tf.compat.v1.assign(listed, rows, validate_shape=False).op

      return compat.cond(fits, write, rebuild)

  def read(self):
    """The cycle's rows as IndexedSlices."""
    dense_shape = tf.constant(self._dense_shape.as_list(), tf.int64)
    if self._first:  # as the large batch's: repeated ids and all
      is_list, count, _ = self._state(self.local)
      ids, rows = self._unpack(self._listed(self.local, is_list, count))
    else:  # the first replica hands on the shared list's rows
      ids, rows = self._unpack(tf.zeros([0, self._columns], self._dtype))
    if self._across_workers:
      size = self._cycle_rows
      if size is None:  # at most a row per id of the table, once added up
        ids, rows = sum_by_id(ids, rows)
        size = self._dense_shape.as_list()[0]
      gradient = distribute.of_fixed_length(
          tf.IndexedSlices(rows, ids, dense_shape), size)
      ids, rows = gradient.indices, gradient.values
    rows = tf.reshape(rows, [-1] + self._dense_shape[1:].as_list())
    return tf.IndexedSlices(rows, ids, dense_shape)

  def reset(self, after, unused_shared_zeros=None):
    """Empties the list once `after` has run, keeping its room; the op."""
    with tf.control_dependencies([after]):
      if not self._first:
        return tf.no_op()
      listed = self.local
      return compat.cond(
          self._state(listed)[0],  # a list (else a restored dense one)
          lambda: tf.compat.v1.scatter_update(
              listed, [0], self._header(tf.constant(0, tf.int64))).op,
          lambda: tf.compat.v1.assign(
              listed, empty_list(self._columns, self._dtype),
              validate_shape=False).op)


# ------------------------------------------------------ one train op's --

# What `read` returns: the cycle's sums, and per sum whether this replica
# holds all of the sum over replicas or none of it (a table's list that the
# replicas share), for clipping by the global norm.
Read = collections.namedtuple('Read', ['gradients', 'whole'])


class Accumulators(object):
  """A train op's accumulators on one replica, one per variable.

  Args:
    accumulators: the accumulators, in the order of the variables.
  """

  def __init__(self, accumulators):
    self._accumulators = list(accumulators)

  def add(self, gradients, length, finite=None):
    """Adds each `gradient / length` to its accumulator.

    Call it under the micro-step's checks: every write waits for them.

    Args:
      gradients: the micro-step's (weighed) gradients, in order.
      length: the cycle's length (an int, or an int64 scalar).
      finite: None, or a boolean scalar: False adds nothing.

    Returns:
      (the op, {index: rows} of the shared lists, for `append_shared`).
    """
    def add_all():
      scales = {}  # 1/length in each dtype: one op for all of a dtype
      added = []
      for accumulator, gradient in zip(self._accumulators, gradients):
        dtype = accumulator.local.dtype.base_dtype
        if dtype not in scales:
          scales[dtype] = reciprocal(length, dtype)
        added.append(accumulator.add(gradient, scales[dtype]))
      return tf.group(*added, name='accumulate')

    if finite is None:
      added = add_all()
    else:  # (an identity: a cond's branches wait for its predicate)
      finite = tf.identity(finite)
      added = compat.cond(finite, add_all, tf.no_op)
    shared = {}  # the shared lists' rows: none where `finite` is False
    for index, (accumulator, gradient) in enumerate(
        zip(self._accumulators, gradients)):
      if accumulator.shared:
        rows = accumulator.rows(gradient, reciprocal(
            length, accumulator.local.dtype.base_dtype))
        if finite is not None:  # a skipped micro-step's: no rows
          rows = rows[:tf.shape(rows)[0] * tf.cast(finite, tf.int32)]
        shared[index] = rows
    return added, shared

  def append_shared(self, rows_of_replicas):
    """Appends each replica's rows of the lists the replicas share.

    Args:
      rows_of_replicas: each replica's `add` result's {index: rows}, in order.

    Returns:
      A list of ops, one per shared list.
    """
    return [self._accumulators[index].append(
        [rows[index] for rows in rows_of_replicas])
            for index in sorted(rows_of_replicas[0])]

  def read(self):
    """Reads the cycle's sums, for the apply step.

    Returns:
      A `Read`, the sums in the order of the variables.
    """
    return Read([a.read() for a in self._accumulators],
                [a.shared for a in self._accumulators])

  def reset(self, after):
    """An op emptying each accumulator in turn after `after`: fewer transients.

    Args:
      after: the op (the wrapped optimizer's apply) that must run first.

    Returns:
      An op.
    """
    resets = [after]
    shared_zeros = {}  # small accumulators' zeros, one per shape
    for accumulator in self._accumulators:
      resets.append(accumulator.reset(resets[-1], shared_zeros))
    return tf.group(*resets[1:])


class PassThrough(object):
  """With grad_steps=1: no accumulator; the micro-step is the cycle's sum.

  Args:
    sparse: hand IndexedSlices on as they are (else densified).
  """

  def __init__(self, sparse):
    self._sparse = sparse
    self._gradients = []

  def add(self, gradients, length, finite=None):
    """Keeps `gradients` for `read`; adds nothing.

    Args:
      gradients: the micro-step's gradients.
      length: unused (1).
      finite: unused: a skipped micro-step's cycle applies nothing.

    Returns:
      (a no-op, {}), as `Accumulators.add`.
    """
    del length, finite
    self._gradients = list(gradients)
    return tf.no_op(), {}

  def read(self):
    """The micro-step's gradients as a `Read`, densified unless `sparse`."""
    gradients = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices)
                 and not self._sparse else g for g in self._gradients]
    return Read(gradients, [False] * len(gradients))

  def reset(self, after):
    """Nothing to reset. Returns: `after`."""
    return after


# -------------------------------------------------------------- creation --

def _slot_name(opt, variable, owner):
  """(slot name, op name, whether to make it) of `owner`'s `variable` slot:
  each train op gets its own, lest an apply get another's micro-batches."""
  owners = registry.of(variable.graph).slot_owners
  for n in itertools.count():
    suffix = '_%d' % n if n else ''
    slot = opt.get_slot(variable, SLOT_NAME + suffix)
    if slot is None or any(s is slot and o is owner for s, o in owners):
      return SLOT_NAME + suffix, SLOT_OP_NAME + suffix, slot is None


def _dense_slot(opt, variable, dtype, owner, local):
  """Creates or finds `variable`'s dense accumulator: a slot of `opt`,
  saved as `<variable>/GradientAccumulator` as in the original, or the
  worker's own variable on a parameter-server worker (`local`).

  Raises:
    ValueError: `dtype` is not the dtype of a variable of unknown shape.
  """
  if local is not None:  # the worker's own, not a slot (`distribute`)
    return local.variable(variable.op.name + '/' + SLOT_OP_NAME,
                          lambda: run_time_zeros(variable.shape, dtype), dtype)
  # pylint: disable=protected-access
  slot_name, op_name, made = _slot_name(opt, variable, owner)
  if variable.shape.is_fully_defined():
    slot = opt._get_or_make_slot_with_initializer(
        variable, run_time_zeros, variable.shape, dtype, slot_name, op_name)
  elif dtype == variable.dtype.base_dtype:
    # Only a variable's value knows its shape: TensorFlow's zeros slot.
    slot = opt._zeros_slot(variable, slot_name, op_name)
  else:
    raise ValueError(
        'accumulator_dtype=%s needs variables of known shape; %s has shape '
        '%s.' % (dtype.name, variable.name, variable.shape))
  if made:  # (under a strategy: by the replica that made it)
    registry.of(slot.graph).slot_owners.append((slot, owner))
    owner.add_state([slot])
  return slot


def _list_of_rows(opt, variable, columns, dtype, owner, local, mirrored):
  """`variable`'s list of rows for the train op `owner`, made once.

  Not a slot: a partition's slot would inherit a save-slice of the table.
  The first caller restores into it what a checkpoint handed `opt`.
  """
  name = variable.op.name + '/' + SLOT_OP_NAME
  if local is not None:  # the worker's own, not saved (`distribute`)
    return local.variable(name, lambda: empty_list(columns, dtype), dtype,
                          list_of_rows=True)
  if id(variable) in owner.lists:
    return owner.lists[id(variable)]
  with contextlib.ExitStack() as stack:
    stack.enter_context(tf.compat.v1.name_scope(None))
    if mirrored:
      # A static initial value: across workers the chief broadcasts it.
      initial = lambda: tf.zeros([1, columns], dtype)
    else:
      stack.enter_context(tf.compat.v1.colocate_with(variable))
      initial = lambda: empty_list(columns, dtype)
    listed = owner.add_list(variable, tf.compat.v1.Variable(
        initial, dtype=dtype, name=name, trainable=False,
        validate_shape=False, shape=tf.TensorShape(None),
        use_resource=not compat.is_ref_variable(variable)))
  owner.add_state(  # afresh: a list of no rows
      [listed], np.zeros([1, columns], dtype.as_numpy_dtype))
  opt._restore_slot_variable(slot_name_of(listed), variable, listed)  # pylint: disable=protected-access
  return listed


def slot_name_of(accumulator):
  """The slot name (`grad_accum`, `grad_accum_1`, ...) of an accumulator.

  Args:
    accumulator: an accumulator variable (`<variable>/GradientAccumulator`).

  Returns:
    A string.
  """
  return SLOT_NAME + accumulator.op.name.rsplit(SLOT_OP_NAME, 1)[-1]


def _cycle_rows(gradient, owner):
  """The most rows a cycle of `owner` looks up with `gradient`, where known
  at graph build; else None."""
  ids = gradient.indices.shape.num_elements()
  steps = owner.cycle.grad_steps
  return ids * steps if ids and steps else None


def create(opt, grads_and_vars, owner, build, sparse, dtype=None,
           num_partitions=None):
  """A replica's `Accumulators` for the (gradient, variable) pairs.

  Call it under `tf.init_scope()`, on each replica. Dense accumulators are
  per replica; replicas in one process share a table's list.

  Args:
    opt: the wrapped optimizer, which owns the slots.
    grads_and_vars: the (gradient, variable) pairs.
    owner: the train op's record (`records.Record`).
    build: where it is built (`distribute.Build`): inside XLA tables are
      accumulated densely; a `WorkerLocal` makes the worker's own variables.
    sparse: accumulate IndexedSlices row by row (else densely).
    dtype: `accumulator_dtype`, or None.
    num_partitions: `xla_num_partitions`, or None.

  Returns:
    An `Accumulators`.

  Raises:
    ValueError: a dtype other than that of a variable of unknown shape, or a
      sparse gradient whose rows cannot be listed, outside XLA.
  """
  in_xla, local, multi_worker = build.in_xla, build.local, build.multi_worker
  replica = build.replica if build.replicas > 1 else None
  mirrored = replica is not None and local is None  # a table's list
  # Lists are not sums over replicas (a mirrored one's components are
  # alike, or each replica's own across workers): only dense ones are.
  summed = replica is not None and not multi_worker
  pairs = []
  for gradient, variable in grads_and_vars:  # checked before making any
    own_dtype = dtype or variable.dtype.base_dtype
    table = sparse and isinstance(gradient, tf.IndexedSlices) and not in_xla
    columns = list_columns(variable, own_dtype) if table else None
    if table and columns is None:
      raise ValueError(
          'A sparse gradient of %s, of shape %s and accumulator dtype %s: '
          'listing its rows needs a static shape and at most 8 bytes a '
          'value. Give the variable a static shape, or sparse_as_dense=True.'
          % (variable.name, variable.shape, own_dtype.name))
    pairs.append((gradient, variable, own_dtype, columns))
  slots = []
  for _, variable, own_dtype, columns in pairs:
    if columns is not None:
      slots.append(_list_of_rows(opt, variable, columns, own_dtype, owner,
                                 local, mirrored))
      continue
    with (tf.compat.v1.variable_creator_scope(distribute.summed_on_save)
          if summed else contextlib.nullcontext()):
      slots.append(_dense_slot(opt, variable, own_dtype, owner, local))
  local_slots = compat.replica_components(slots)
  accumulators = []
  for (gradient, variable, own_dtype, columns), slot, local_slot, handle in (
      zip(pairs, slots, local_slots, compat.handles(local_slots))):
    rows = isinstance(gradient, tf.IndexedSlices)
    if columns is None:
      accumulators.append(DenseAccumulator(
          local_slot, handle, in_xla, num_partitions, rows and in_xla))
    elif not mirrored or multi_worker:  # this replica's own list
      accumulators.append(RowListAccumulator(
          variable, own_dtype, handle, local_slot if mirrored else slot,
          cycle_rows=_cycle_rows(gradient, owner) if multi_worker else None,
          across_workers=mirrored))
    else:  # the replicas share the list: its first component holds it
      first = tf.distribute.get_strategy().experimental_local_results(slot)
      accumulators.append(RowListAccumulator(
          variable, own_dtype, handle, first[0], replica))
  return Accumulators(accumulators)
