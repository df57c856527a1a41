"""Gradient accumulators: one kind per kind of gradient.

Each variable that receives a gradient gets an accumulator slot holding the
sum of the cycle's micro-batch gradients divided by `grad_steps` (the
original's scale, so that its checkpoints restore mid-cycle); under a
`grad_steps` schedule, by the cycle's length. The kinds
share one small interface:

* `add(gradient, divisor)`: a micro-step's op adding `gradient / divisor`
  (a `Divisor`: grad_steps, or the cycle's length under a schedule);
* `mark()`: run on every micro-step, added or skipped;
* `read(length)`: the cycle's accumulated gradient, for the apply step
  (`length`: the cycle's micro-steps, an int or an int64 scalar);
* `reset(after, read)`: empties it for the next cycle, after `after`.

`DenseAccumulator` adds and zeroes in place;
`ShardedAccumulator` reads through an XLA sharding annotation;
a table's (sparse gradients) is in `tables`.
With grad_steps=1 there is none: the optimizer applies the micro-step's
gradients themselves.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import itertools
import weakref

from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import sharding
from deferred_grad import tables
from deferred_grad import zeros

tf = compat.import_tensorflow()

SLOT_NAME = 'grad_accum'
SLOT_OP_NAME = 'GradientAccumulator'


# graph -> {id(slot): the train op (its state) that accumulates into it}.
_OWNERS = weakref.WeakKeyDictionary()


def _slot_name(opt, variable, owner):
  """(slot name, op name) of `owner`'s accumulator of `variable`.

  The first train op to accumulate `variable` through `opt` gets the
  original's names; another train op of the same wrapped optimizer on the
  same variable (a shared trunk under two losses) gets its own slot,
  `grad_accum_1` saved as `<variable>/GradientAccumulator_1`, and so on:
  adding both train ops' micro-batches into one slot would hand each apply
  the other's micro-batches too. The replicas of one train op share it.
  """
  owners = _OWNERS.setdefault(tf.compat.v1.get_default_graph(), {})
  for n in itertools.count():
    suffix = '_%d' % n if n else ''
    slot = opt.get_slot(variable, SLOT_NAME + suffix)
    if slot is None or owners.get(id(slot)) is owner:
      return SLOT_NAME + suffix, SLOT_OP_NAME + suffix


def create_slot(opt, variable, dtype, owner=None, columns=None):
  """Creates (or finds) `variable`'s accumulator slot, owned by `opt`.

  The slot belongs to the wrapped optimizer, as in the original, so that it
  is saved as `<variable name>/GradientAccumulator`.

  Args:
    opt: the wrapped `tf.compat.v1.train.Optimizer`.
    variable: the variable whose gradient it accumulates.
    dtype: the accumulator's dtype, or None for the variable's.
    owner: the train op's state: each train op its own slot (`_slot_name`).
    columns: None for a slot shaped like `variable`; else the width of a
      list of rows (`tables.RowListAccumulator`), empty at first.

  Returns:
    The slot variable.

  Raises:
    ValueError: a `dtype` other than the variable's for a variable of unknown
      static shape.
  """
  # pylint: disable=protected-access
  dtype = dtype or variable.dtype.base_dtype
  slot_name, op_name = _slot_name(opt, variable, owner)
  if columns is not None:
    # No static shape: the list grows and shrinks (also to a restored
    # dense accumulator's shape), and graph optimizers must not fold it.
    empty = tf.compat.v1.placeholder_with_default(
        tf.zeros([0, columns], dtype), None)
    slot = opt._get_or_make_slot(variable, empty, slot_name, op_name)
  elif variable.shape.is_fully_defined():
    slot = opt._get_or_make_slot_with_initializer(
        variable, zeros.run_time_zeros, variable.shape, dtype, slot_name,
        op_name)
  elif dtype == variable.dtype.base_dtype:
    # Only a variable's value knows its shape: TensorFlow's zeros slot.
    slot = opt._zeros_slot(variable, slot_name, op_name)
  else:
    raise ValueError(
        'accumulator_dtype=%s needs variables of known shape; %s has shape '
        '%s.' % (dtype.name, variable.name, variable.shape))
  checkpoints.add_to_state(slot)
  _OWNERS[tf.compat.v1.get_default_graph()][id(slot)] = owner
  return slot


class Divisor(object):
  """What a micro-step divides each gradient by, made once per dtype.

  Args:
    value: `grad_steps` (an int), or the cycle's length under a schedule
      (an int64 scalar, `steps.Schedule.divisor`).
  """

  def __init__(self, value):
    self.value = value
    self._reciprocals = {}

  def reciprocal(self, dtype):
    """1 / value as a `dtype` scalar: one op for all variables of a dtype."""
    if isinstance(self.value, int):
      return tf.constant(1.0 / self.value, dtype)
    if dtype not in self._reciprocals:
      self._reciprocals[dtype] = tf.math.reciprocal(tf.cast(self.value, dtype))
    return self._reciprocals[dtype]

  def divide(self, tensor):
    """`tensor / value` (divided by an int, as the original did)."""
    if isinstance(self.value, int):
      return tensor / self.value
    return tensor * self.reciprocal(tensor.dtype.base_dtype)


class DenseAccumulator(object):
  """Accumulates dense gradients in place, and zeroes them in place.

  Under a multi-replica strategy the slot is a distributed variable; each
  replica adds into, reads and resets its own component (`local`).

  Args:
    slot: the accumulator variable.
  """

  def __init__(self, slot):
    self.slot = slot

  @property
  def local(self):
    """This replica's component of the slot (the slot itself without one)."""
    return compat.local_variable(self.slot)

  def mark(self):
    """Records one micro-step; only a table's accumulator keeps a record."""
    return tf.no_op()

  def _dense(self, gradient):
    if isinstance(gradient, tf.IndexedSlices):
      gradient = tf.convert_to_tensor(gradient)
    return tf.cast(gradient, self.slot.dtype.base_dtype)

  def add(self, gradient, divisor):
    """accumulator += gradient / divisor, in place, in one kernel.

    SGD's kernel with learning rate -1/divisor: no temporary, one op per
    variable instead of two (`tools/benchmark --suites=step`).
    """
    variable = self.local
    checks = []  # a table's (sparse_as_dense): see `tables.check_dense`
    if isinstance(gradient, tf.IndexedSlices) and not compat.in_xla_context():
      checks = [tables.check_dense(variable)]
    with tf.control_dependencies(checks):
      gradient = self._dense(gradient)
    alpha = -divisor.reciprocal(variable.dtype.base_dtype)
    if compat.is_ref_variable(variable):
      return tf.raw_ops.ApplyGradientDescent(
          var=variable, alpha=alpha, delta=gradient).op
    return tf.raw_ops.ResourceApplyGradientDescent(
        var=variable.handle, alpha=alpha, delta=gradient)

  def read(self, length):
    """The accumulated gradient of the cycle's `length` micro-steps."""
    del length  # the tensor holds it all
    return self.local.read_value()

  def reset(self, after, gradient, shared_zeros=None):
    """Zeroes the accumulator in place once `after` has run; returns the op.

    See `zeros.zero_in_place`. `reset_all` runs the resets one after
    another, so that a reset's transients are one variable's.
    """
    del gradient
    with tf.control_dependencies([after]):
      return zeros.zero_in_place(self.local, shared_zeros)


class ShardedAccumulator(DenseAccumulator):
  """A dense accumulator whose reads carry the XLA sharding rule.

  Args:
    slot: the accumulator variable.
    num_partitions: `xla_num_partitions`.
  """

  def __init__(self, slot, num_partitions):
    super(ShardedAccumulator, self).__init__(slot)
    self._num_partitions = num_partitions

  def add(self, gradient, divisor):
    """accumulator = sharded(accumulator) + gradient / divisor."""
    local = self.local
    current = sharding.shard(local.read_value(), self._num_partitions)
    return local.assign(
        current + divisor.divide(self._dense(gradient)), read_value=False)


def create(opt, variable, gradient, sparse, dtype=None,
           num_partitions=None, in_xla=False, local=None, owner=None,
           replicas=1):
  """Creates `variable`'s accumulator of the kind its gradient needs.

  Args:
    opt: the wrapped optimizer, which owns the slot.
    variable: the variable.
    gradient: its gradient (a Tensor or an IndexedSlices).
    sparse: accumulate an IndexedSlices gradient row by row.
    dtype: `accumulator_dtype`, or None.
    num_partitions: `xla_num_partitions`, or None.
    in_xla: built inside an XLA computation (see `tables`).
    local: None, or a `placement.WorkerLocal` (variables on parameter
      servers): the accumulator is then the worker's own, not a slot.
    replicas: the replicas in sync: with one, a table's accumulator is a
      `tables.RowListAccumulator`.
    owner: the train op's state (see `create_slot`).

  Returns:
    A `DenseAccumulator`, `ShardedAccumulator`, or one of `tables`'
    `RowListAccumulator`, `SparseAccumulator`, `RowQueueAccumulator`.
  """
  arguments.check_accumulator_width(dtype, variable)
  dtype = dtype or variable.dtype.base_dtype
  table = sparse and isinstance(gradient, tf.IndexedSlices)
  if local is not None:  # the worker's own, not a slot (see `placement`)
    if table:
      return tables.RowQueueAccumulator(variable, dtype,
                                        local.device)
    shape = variable.shape
    return DenseAccumulator(local.variable(
        variable.op.name + '/' + SLOT_OP_NAME,
        lambda: zeros.run_time_zeros(shape, dtype), dtype))
  if table and replicas == 1 and not in_xla:
    id_columns = tables.id_columns(variable, dtype)
    if id_columns is not None:
      slot = create_slot(opt, variable, dtype, owner,
                         columns=id_columns + tables.row_width(variable))
      return tables.RowListAccumulator(slot, variable, dtype)
  slot = create_slot(opt, variable, dtype, owner)
  if table:
    return tables.SparseAccumulator(slot, num_partitions, in_xla)
  if num_partitions is None:
    return DenseAccumulator(slot)
  return ShardedAccumulator(slot, num_partitions)


def create_all(opt, grads_and_vars, sparse, dtype=None,
               num_partitions=None, in_xla=False, local=None, owner=None):
  """`create` for each (gradient, variable) pair; a list.

  Per replica and saved as their sum under a multi-replica strategy (see
  `distribute.summed_on_save`).
  """
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  with distribute.summed_on_save():
    return [create(opt, v, g, sparse, dtype, num_partitions,
                   in_xla, local, owner, replicas) for g, v in grads_and_vars]


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
  shared_zeros = {}  # small variables' zeros, one per shape (see `zeros`)
  for accumulator, gradient in zip(accumulators, gradients):
    # One at a time: a reset's transients (zeros inside XLA, a table's
    # zero rows) are then one variable's.
    previous = accumulator.reset(previous, gradient, shared_zeros)
    resets.append(previous)
  return resets
