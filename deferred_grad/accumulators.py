"""Gradient accumulators: one kind per kind of gradient.

Each variable that receives a gradient gets an accumulator slot holding the
sum of the cycle's micro-batch gradients divided by `grad_steps` (the
original's scale, so that its checkpoints restore mid-cycle). The kinds
share one small interface:

* `add(gradient)`: a micro-step's op adding `gradient / grad_steps`;
* `mark()`: run on every micro-step, added or skipped;
* `read()`: the cycle's accumulated gradient, for the apply step;
* `reset(after, read)`: empties it for the next cycle, after `after`.

`DenseAccumulator` adds and zeroes in place;
`ShardedAccumulator` reads through an XLA sharding annotation;
`SparseAccumulator` scatter-adds rows and hands on those the cycle touched.
With grad_steps=1 there is none: the optimizer applies the micro-step's
gradients themselves.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import sharding
from deferred_grad import variables
from deferred_grad import zeros

tf = compat.import_tensorflow()

SLOT_NAME = 'grad_accum'
SLOT_OP_NAME = 'GradientAccumulator'


def create_slot(opt, variable, dtype):
  """Creates (or finds) `variable`'s accumulator slot, owned by `opt`.

  The slot belongs to the wrapped optimizer, as in the original, so that it
  is saved as `<variable name>/GradientAccumulator`.

  Args:
    opt: the wrapped `tf.compat.v1.train.Optimizer`.
    variable: the variable whose gradient it accumulates.
    dtype: the accumulator's dtype, or None for the variable's.

  Returns:
    The slot variable.

  Raises:
    ValueError: a `dtype` other than the variable's for a variable of unknown
      static shape.
  """
  # pylint: disable=protected-access
  dtype = dtype or variable.dtype.base_dtype
  if variable.shape.is_fully_defined():
    slot = opt._get_or_make_slot_with_initializer(
        variable, zeros.run_time_zeros, variable.shape, dtype, SLOT_NAME,
        SLOT_OP_NAME)
  elif dtype == variable.dtype.base_dtype:
    # Only a variable's value knows its shape: TensorFlow's zeros slot.
    slot = opt._zeros_slot(variable, SLOT_NAME, SLOT_OP_NAME)
  else:
    raise ValueError(
        'accumulator_dtype=%s needs variables of known shape; %s has shape '
        '%s.' % (dtype.name, variable.name, variable.shape))
  variables.add_to_state(slot)
  return slot


class _Accumulator(object):
  """What the kinds share: the slot, and this replica's part of it.

  Under a multi-replica strategy the slot is a distributed variable; each
  replica adds into, reads and resets its own component (`local`).

  Args:
    slot: the accumulator variable.
    grad_steps: the number of micro-steps per cycle.
  """

  def __init__(self, slot, grad_steps):
    self.slot = slot
    self._grad_steps = grad_steps

  @property
  def local(self):
    """This replica's component of the slot (the slot itself without one)."""
    return compat.local_variable(self.slot)

  def mark(self):
    """Records one micro-step; only the sparse kind keeps a record."""
    return tf.no_op()


class DenseAccumulator(_Accumulator):
  """Accumulates dense gradients in place, and zeroes them in place."""

  def _dense(self, gradient):
    if isinstance(gradient, tf.IndexedSlices):
      gradient = tf.convert_to_tensor(gradient)
    return tf.cast(gradient, self.slot.dtype.base_dtype)

  def add(self, gradient):
    """accumulator += gradient / grad_steps, in place, in one kernel.

    SGD's kernel with learning rate -1/grad_steps: no temporary, one op per
    variable instead of two (`tools/benchmark --suites=step`).
    """
    gradient = self._dense(gradient)
    variable = self.local
    alpha = tf.constant(-1.0 / self._grad_steps,
                        dtype=variable.dtype.base_dtype)
    if compat.is_ref_variable(variable):
      return tf.raw_ops.ApplyGradientDescent(
          var=variable, alpha=alpha, delta=gradient).op
    return tf.raw_ops.ResourceApplyGradientDescent(
        var=variable.handle, alpha=alpha, delta=gradient)

  def read(self):
    """The cycle's accumulated gradient (a Tensor)."""
    return self.local.read_value()

  def reset(self, after, gradient):
    """Zeroes the accumulator in place once `after` has run; returns the op.

    See `zeros.zero_in_place`. `reset_all` runs the resets one after
    another, so that a reset's transients are one variable's.
    """
    del gradient
    with tf.control_dependencies([after]):
      return zeros.zero_in_place(self.local)


class ShardedAccumulator(DenseAccumulator):
  """A dense accumulator whose reads carry the XLA sharding rule.

  Args:
    slot: the accumulator variable.
    grad_steps: the number of micro-steps per cycle.
    num_partitions: `xla_num_partitions`.
  """

  def __init__(self, slot, grad_steps, num_partitions):
    super(ShardedAccumulator, self).__init__(slot, grad_steps)
    self._num_partitions = num_partitions

  def add(self, gradient):
    """accumulator = sharded(accumulator) + gradient / grad_steps."""
    local = self.local
    current = sharding.shard(local.read_value(), self._num_partitions)
    return local.assign(
        current + self._dense(gradient) / self._grad_steps, read_value=False)


class SparseAccumulator(_Accumulator):
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
  markers than `grad_steps` and falls back, once, to a full read: the rows
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
    grad_steps: the number of micro-steps per cycle.
    num_partitions: `xla_num_partitions`, for full reads.
    in_xla: built inside an XLA computation (no queue; a dense hand-off).
  """

  def __init__(self, slot, grad_steps, num_partitions=None, in_xla=False):
    super(SparseAccumulator, self).__init__(slot, grad_steps)
    self._num_partitions = num_partitions
    self._rows = None
    # The record of row ids, and the work on it, stay on the host: queues
    # have no GPU kernels. Only the gathers and scatters touch the device.
    self._host = compat.host_device(self.local.device)
    if not in_xla:
      local = self.local
      with tf.device(self._host):
        self._rows = tf.queue.FIFOQueue(
            2**31 - 1, [tf.int64], shapes=[[]],
            name=local.op.name.replace('/', '_') + '_touched_rows')

  def add(self, gradient):
    """Scatter-adds the rows looked up, and records them.

    The cost does not grow with the table.
    """
    dtype = self.slot.dtype.base_dtype
    added = self.local.scatter_add(
        tf.IndexedSlices(
            tf.cast(gradient.values, dtype) / self._grad_steps,
            gradient.indices))
    if self._rows is None:
      return added
    with tf.device(self._host):
      recorded = self._rows.enqueue_many(
          [tf.cast(tf.reshape(gradient.indices, [-1]), tf.int64)])
    return tf.group(added, recorded)

  def mark(self):
    """Records one micro-step (added or skipped): run it on every one."""
    if self._rows is None:
      return tf.no_op()
    with tf.device(self._host):
      return self._rows.enqueue(tf.constant(-1, tf.int64))

  def read(self):
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
          tf.reduce_sum(tf.cast(tf.logical_not(is_row), tf.int32)),
          self._grad_steps)

    def from_record():
      return tf.gather(self.local, rows), rows

    def from_scan():
      # Also the rows this session recorded: only a row touched before the
      # restore alone and summing to exactly zero is left out, once.
      value = sharding.shard(self.local.read_value(), self._num_partitions)
      scanned, _ = tf.unique(tf.concat([_nonzero_rows(value), rows], 0))
      return tf.gather(value, scanned), scanned

    values, rows = compat.cond(complete, from_record, from_scan)
    return tf.IndexedSlices(values, rows, dense_shape=self._dense_shape())

  def _dense_shape(self):
    """The accumulator's shape, without reading it whole."""
    if self.slot.shape.is_fully_defined():
      return tf.constant(self.slot.shape.as_list(), tf.int64)
    local = self.local
    if compat.is_ref_variable(local):
      return tf.shape(local, out_type=tf.int64)
    return tf.raw_ops.VariableShape(input=local.handle, out_type=tf.int64)

  def reset(self, after, gradient):
    """Zeroes the rows `gradient` (what `read` returned) holds, after `after`.

    Returns:
      The op.
    """
    if not isinstance(gradient, tf.IndexedSlices):  # inside XLA
      return DenseAccumulator.reset(self, after, gradient)
    dtype = self.slot.dtype.base_dtype
    with tf.control_dependencies([after]):
      return self.local.scatter_update(
          tf.IndexedSlices(tf.zeros_like(gradient.values, dtype),
                           gradient.indices))


def _nonzero_rows(value):
  """The int64 indices of `value`'s rows that are not all zero."""
  nonzero = tf.not_equal(value, 0)
  if value.shape.rank > 1:
    nonzero = tf.reduce_any(nonzero, axis=list(range(1, value.shape.rank)))
  return tf.reshape(tf.where(nonzero), [-1])


def create(opt, variable, gradient, grad_steps, sparse, dtype=None,
           num_partitions=None, in_xla=False, local=None):
  """Creates `variable`'s accumulator of the kind its gradient needs.

  Args:
    opt: the wrapped optimizer, which owns the slot.
    variable: the variable.
    gradient: its gradient (a Tensor or an IndexedSlices).
    grad_steps: micro-steps per cycle.
    sparse: accumulate an IndexedSlices gradient row by row.
    dtype: `accumulator_dtype`, or None.
    num_partitions: `xla_num_partitions`, or None.
    in_xla: built inside an XLA computation (see SparseAccumulator).
    local: None, or a `placement.WorkerLocal` (variables on parameter
      servers): the accumulator is then the worker's own, not a slot.

  Returns:
    A `DenseAccumulator`, `ShardedAccumulator` or `SparseAccumulator`.
  """
  if local is not None:
    return local.accumulator(variable, gradient, grad_steps, sparse,
                             dtype or variable.dtype.base_dtype)
  slot = create_slot(opt, variable, dtype)
  if sparse and isinstance(gradient, tf.IndexedSlices):
    return SparseAccumulator(slot, grad_steps, num_partitions, in_xla)
  if num_partitions is None:
    return DenseAccumulator(slot, grad_steps)
  return ShardedAccumulator(slot, grad_steps, num_partitions)


def create_all(opt, grads_and_vars, grad_steps, sparse, dtype=None,
               num_partitions=None, in_xla=False, local=None):
  """`create` for each (gradient, variable) pair; a list.

  Per replica and saved as their sum under a multi-replica strategy (see
  `distribute.summed_on_save`).
  """
  with distribute.summed_on_save():
    return [create(opt, v, g, grad_steps, sparse, dtype, num_partitions,
                   in_xla, local) for g, v in grads_and_vars]


def reset_all(accumulators, gradients, after):
  """Each accumulator's reset after `after`.

  Args:
    accumulators: the accumulators the apply step read.
    gradients: what each one's `read` returned, in the same order.
    after: the op (the wrapped optimizer's apply) that must run first.

  Returns:
    A list of ops.
  """
  previous = after
  resets = []
  for accumulator, gradient in zip(accumulators, gradients):
    # One at a time: a reset's transients (zeros inside XLA, a table's
    # zero rows) are then one variable's.
    previous = accumulator.reset(previous, gradient)
    resets.append(previous)
  return resets
