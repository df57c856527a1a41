"""Gradient accumulators: a train op's sums of the cycle, per replica.

Each variable that receives a gradient gets an accumulator slot holding the
sum of the cycle's micro-batch gradients divided by `grad_steps` (the
original's scale, so that its checkpoints restore mid-cycle); under a
`grad_steps` schedule, by the cycle's length. `create` makes a replica's
`Accumulators`, which the optimizer calls with values:

* `add(gradients, divisor)`: the micro-step's op adding `gradient / divisor`
  to each (a `numerics.Divisor`: grad_steps, or the cycle's length);
* `mark()`: ops run on every micro-step, added or skipped;
* `shared_rows(gradients, divisor, finite)` and `append_shared(rows)`: the
  rows of tables whose list the replicas share, added where they meet;
* `read(length, micro_step)`: the cycle's sums, this micro-step's included,
  for the apply step (`length`: the cycle's micro-steps);
* `reset(after, read)`: empties them for the next cycle, after `after`.

One kind per kind of gradient sits behind it: `DenseAccumulator` (added,
read and zeroed in place, by `kernels`), `ShardedAccumulator` (added
through an XLA sharding annotation), and a table's (sparse gradients) from
`row_lists` or `tables`. With grad_steps=1 nothing accumulates:
`PassThrough` hands the apply step the micro-step's own gradients.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import collections
import itertools
import weakref

from deferred_grad import arguments
from deferred_grad import checkpoints
from deferred_grad import compat
from deferred_grad import distribute
from deferred_grad import kernels
from deferred_grad import row_lists
from deferred_grad import sharding
from deferred_grad import tables

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


def create_slot(opt, variable, dtype, owner=None):
  """Creates (or finds) `variable`'s accumulator slot, owned by `opt`.

  The slot belongs to the wrapped optimizer, as in the original, so that it
  is saved as `<variable name>/GradientAccumulator` (a partition's as its
  slice of `<table>/GradientAccumulator`).

  Args:
    opt: the wrapped `tf.compat.v1.train.Optimizer`.
    variable: the variable whose gradient it accumulates.
    dtype: the accumulator's dtype, or None for the variable's.
    owner: the train op's state: each train op its own slot (`_slot_name`).

  Returns:
    The slot variable.

  Raises:
    ValueError: a `dtype` other than the variable's for a variable of unknown
      static shape.
  """
  # pylint: disable=protected-access
  dtype = dtype or variable.dtype.base_dtype
  slot_name, op_name = _slot_name(opt, variable, owner)
  if variable.shape.is_fully_defined():
    slot = opt._get_or_make_slot_with_initializer(
        variable, kernels.run_time_zeros, variable.shape, dtype, slot_name,
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


def list_of_rows(opt, variable, columns, dtype, owner, device):
  """`variable`'s list of rows for the train op `owner` (made once).

  Not a slot of the wrapped optimizer: a slot of a partition inherits its
  save-slice (a slice of the whole table's shape), which a list of rows
  does not have. Each list is a variable of its own, saved as
  `<variable name>/GradientAccumulator` (`table/part_0/GradientAccumulator`
  for a partition; a second train op's `..._1`), whichever replica or
  wrapper asks first making it with the dtype asked for.

  Args:
    opt: the wrapped optimizer: an object-based checkpoint's restore hands
      it the list's value, as the slot `grad_accum` (`get_slot`).
    variable: the table (or one partition of it).
    columns: the list's width (`row_lists.list_columns`).
    dtype: the accumulator's dtype.
    owner: the train op's `cycle.TrainOpState`, which keeps it.
    device: None (beside the variable), or the device of one variable that
      the replicas share (`distribute.one_variable`).

  Returns:
    The variable, of no static shape.
  """
  key = id(variable)
  if key not in owner.lists:
    placed = (distribute.one_variable(device) if device is not None else
              tf.compat.v1.colocate_with(variable))
    with tf.compat.v1.name_scope(None), placed:
      owner.lists[key] = tf.compat.v1.Variable(
          lambda: row_lists.empty_list(columns, dtype), dtype=dtype,
          name=variable.op.name + '/' + SLOT_OP_NAME, trainable=False,
          validate_shape=False,
          use_resource=not compat.is_ref_variable(variable))
    listed = owner.lists[key]
    checkpoints.add_to_state(listed)
    compat.restore_slot_variable(opt, slot_name_of(listed), variable, listed)
    spec = checkpoints.slice_spec(variable)
    if spec:  # a partition: the original kept slices of one accumulator
      checkpoints.add_source(
          listed, checkpoints.save_name(variable) + '/' +
          listed.op.name.rsplit('/', 1)[-1], spec)
  return owner.lists[key]


def slot_name_of(accumulator):
  """The slot name (`grad_accum`, `grad_accum_1`, ...) of an accumulator."""
  return SLOT_NAME + accumulator.op.name.rsplit(SLOT_OP_NAME, 1)[-1]


class DenseAccumulator(object):
  """Accumulates dense gradients in place, and zeroes them in place.

  Under a multi-replica strategy the slot is a distributed variable; each
  replica adds into, reads and resets its own component (`local`). `add`
  and `reset` take the component's handle from `kernels.handles`.

  Args:
    slot: the accumulator variable.
  """

  in_place = True  # `Accumulators` batches its handle and read (`kernels`)
  shared = False  # each replica its own (see `row_lists`)

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

  def add(self, gradient, divisor, handle=None):
    """accumulator += gradient / divisor, in place, in one kernel."""
    variable = self.local
    checks = []  # a table's (sparse_as_dense): see `row_lists.check_dense`
    if isinstance(gradient, tf.IndexedSlices) and not compat.in_xla_context():
      checks = [row_lists.check_dense(variable)]
    with tf.control_dependencies(checks):
      gradient = self._dense(gradient)
    return kernels.add(variable, gradient,
                       divisor.reciprocal(variable.dtype.base_dtype), handle)

  def read(self, length):
    """The accumulated gradient of the cycle's `length` micro-steps."""
    del length  # the tensor holds it all
    return self.local.read_value()

  def reset(self, after, gradient, shared_zeros=None, handle=None):
    """Zeroes the accumulator in place once `after` has run; returns the op.

    See `kernels.zero`. `Accumulators.reset` runs the resets one after
    another, so that a reset's transients are one variable's.
    """
    del gradient
    with tf.control_dependencies([after]):
      return kernels.zero(self.local, shared_zeros, handle)


class ShardedAccumulator(DenseAccumulator):
  """A dense accumulator whose reads carry the XLA sharding rule.

  Args:
    slot: the accumulator variable.
    num_partitions: `xla_num_partitions`.
  """

  in_place = False

  def __init__(self, slot, num_partitions):
    super(ShardedAccumulator, self).__init__(slot)
    self._num_partitions = num_partitions

  def add(self, gradient, divisor, handle=None):
    """accumulator = sharded(accumulator) + gradient / divisor."""
    del handle
    local = self.local
    current = sharding.shard(local.read_value(), self._num_partitions)
    return local.assign(
        current + divisor.divide(self._dense(gradient)), read_value=False)


# What `read` returns: the cycle's sums; for `reset`, the handles the
# in-place kernels used ({index: handle}); and per sum, whether this replica
# holds all of the sum over replicas or none of it (a table's list that the
# replicas share), for `numerics.clip_by_global_norm`.
Read = collections.namedtuple('Read', ['gradients', 'handles', 'whole'])


class Accumulators(object):
  """A train op's accumulators on one replica, one per variable.

  Args:
    accumulators: the accumulators, in the order of the variables.
  """

  def __init__(self, accumulators):
    self._accumulators = list(accumulators)

  def _handles(self):
    """{index: handle} of the in-place kinds (`kernels.handles`)."""
    indices = [i for i, a in enumerate(self._accumulators) if a.in_place]
    handles = kernels.handles([self._accumulators[i].local for i in indices])
    return dict(zip(indices, handles))

  def add(self, gradients, divisor):
    """An op adding each `gradient / divisor` to its accumulator."""
    handles = self._handles()
    return tf.group(*[
        accumulator.add(gradient, divisor, handles[index])
        if accumulator.in_place else accumulator.add(gradient, divisor)
        for index, (accumulator, gradient) in enumerate(
            zip(self._accumulators, gradients))], name='accumulate')

  def mark(self):
    """Ops to run on every micro-step, added or skipped."""
    return [accumulator.mark() for accumulator in self._accumulators]

  def shared_rows(self, gradients, divisor, finite):
    """{index: rows} for the lists the replicas share (`row_lists`), which
    `add` left out: none where `finite` (None: always) is False."""
    shared = {}
    for index, (accumulator, gradient) in enumerate(
        zip(self._accumulators, gradients)):
      if accumulator.shared:
        rows = accumulator.rows(gradient, divisor)
        if finite is not None:  # a skipped micro-step's: no rows
          rows = rows[:tf.shape(rows)[0] * tf.cast(finite, tf.int32)]
        shared[index] = rows
    return shared

  def append_shared(self, rows_of_replicas):
    """Ops appending each replica's `shared_rows`, in replica order."""
    return [self._accumulators[index].append(
        [rows[index] for rows in rows_of_replicas])
            for index in sorted(rows_of_replicas[0])]

  def read(self, length, micro_step):
    """A `Read`: the cycle's sums (its `length` micro-steps), in order.

    `micro_step`: this micro-step's gradients, which `add` has added.
    """
    del micro_step
    handles = self._handles()
    indices = sorted(handles)
    values = dict(zip(indices, kernels.read(
        [self._accumulators[i].local for i in indices],
        [handles[i] for i in indices])))
    return Read([values[i] if i in values else accumulator.read(length)
                 for i, accumulator in enumerate(self._accumulators)],
                handles, [a.shared for a in self._accumulators])

  def reset(self, after, read):
    """An op emptying each accumulator after `after`, one after another.

    One at a time: a reset's transients (zeros inside XLA, a table's zero
    rows) are then one variable's.

    Args:
      after: the op (the wrapped optimizer's apply) that must run first.
      read: what `read` returned.
    """
    previous = after
    resets = []
    shared_zeros = {}  # small variables' zeros, one per shape (`kernels`)
    for index, (accumulator, gradient) in enumerate(
        zip(self._accumulators, read.gradients)):
      if accumulator.in_place:
        previous = accumulator.reset(previous, gradient, shared_zeros,
                                     read.handles[index])
      else:
        previous = accumulator.reset(previous, gradient, shared_zeros)
      resets.append(previous)
    return tf.group(*resets)


class PassThrough(object):
  """With grad_steps=1: no accumulator; the micro-step is the cycle's sum.

  Args:
    sparse: hand IndexedSlices on as they are (else densified).
  """

  def __init__(self, sparse):
    self._sparse = sparse

  def add(self, gradients, divisor):
    del gradients, divisor
    return tf.no_op()

  def mark(self):
    return []

  def shared_rows(self, *unused):
    return {}

  def append_shared(self, unused):
    return []

  def read(self, length, micro_step):
    del length
    return Read([tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices)
                 and not self._sparse else g for g in micro_step], {},
                [False] * len(micro_step))

  def reset(self, after, read):
    del read
    return after


def _create(opt, variable, gradient, sparse, dtype, num_partitions, in_xla,
            local, owner, replica):
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
    owner: the train op's state (see `create_slot`).
    replica: None, or this replica's index where several share a table's
      `row_lists.RowListAccumulator`.

  Returns:
    A `DenseAccumulator`, `ShardedAccumulator`,
    `row_lists.RowListAccumulator` or `tables.SparseAccumulator`.
  """
  arguments.check_accumulator_width(dtype, variable)
  dtype = dtype or variable.dtype.base_dtype
  table = sparse and isinstance(gradient, tf.IndexedSlices)
  name = variable.op.name + '/' + SLOT_OP_NAME
  columns = row_lists.list_columns(variable, dtype) if table else None
  if local is not None:  # the worker's own, not a slot (see `placement`)
    if columns is not None:
      return row_lists.RowListAccumulator(local.variable(
          name, lambda: row_lists.empty_list(columns, dtype), dtype,
          list_of_rows=True), variable, dtype)
    shape = variable.shape
    return DenseAccumulator(local.variable(
        name, lambda: kernels.run_time_zeros(shape, dtype), dtype))
  # Workers all-reduce a table's rows by gathering slices of one length.
  all_reduced = not in_xla and distribute.in_multi_worker_mode(
      tf.distribute.get_strategy())
  if columns is not None and not (in_xla or all_reduced):
    # Several replicas share one list, where the first one's table is.
    device = None if replica is None else compat.host_device(variable.device)
    listed = list_of_rows(opt, variable, columns, dtype, owner, device)
    return row_lists.RowListAccumulator(listed, variable, dtype, replica)
  slot = create_slot(opt, variable, dtype, owner)
  if table:
    return tables.SparseAccumulator(
        slot, num_partitions, in_xla, all_reduced,
        _cycle_rows(gradient, owner) if all_reduced else None)
  if num_partitions is None:
    return DenseAccumulator(slot)
  return ShardedAccumulator(slot, num_partitions)


def _cycle_rows(gradient, owner):
  """The most rows a cycle of `owner` (a train op's state) looks up with
  `gradient`: micro-steps times ids, where both are known at graph build;
  else None."""
  ids = gradient.indices.shape.num_elements()
  steps = owner.cycle.grad_steps if owner is not None else None
  return ids * steps if ids and steps else None


def create(opt, grads_and_vars, sparse, dtype=None, num_partitions=None,
           in_xla=False, local=None, owner=None):
  """A replica's `Accumulators` for the (gradient, variable) pairs.

  Per replica and saved as their sum under a multi-replica strategy (see
  `distribute.summed_on_save`). Call it under `tf.init_scope()`; the
  arguments are `_create`'s.
  """
  replica = None  # this replica's index, where there are several
  if tf.distribute.get_strategy().num_replicas_in_sync > 1:
    replica = int(tf.get_static_value(
        tf.distribute.get_replica_context().replica_id_in_sync_group))
  with distribute.summed_on_save():
    return Accumulators([
        _create(opt, v, g, sparse, dtype, num_partitions, in_xla, local,
                owner, replica) for g, v in grads_and_vars])
