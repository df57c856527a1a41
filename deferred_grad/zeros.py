"""Zeros that cost no memory beyond the accumulator they fill.

The accumulators are as large as the parameters, so every buffer made for
their zeros is too. Two ways TensorFlow would make such buffers are avoided
here (each measured with `tools/benchmark --suites=memory`):

* zeros of a known shape are folded into a constant, which a session keeps
  for as long as it lives (`run_time_zeros` makes them at run time);
* `assign(zeros)` writes a second buffer as large as the variable, and on
  CPU the allocator keeps the pages it grew for it, so the process's peak
  memory rises for good at the first apply step (`zero_in_place` writes the
  variable's own buffer).
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat

tf = compat.import_tensorflow()


def run_time_zeros(shape, dtype=tf.float32, partition_info=None):
  """Zeros of `shape` that TensorFlow cannot fold into a constant.

  As the accumulators' initial value (the original's zeros slot) a folded
  constant pinned 1x the parameter bytes. A fill value the graph optimizers
  cannot know keeps the zeros a run-time tensor, freed after use.

  Args:
    shape: the shape, a list or a 1-D integer tensor.
    dtype: the element type.
    partition_info: unused; part of the initializer signature.

  Returns:
    A tensor of zeros.
  """
  del partition_info
  dtype = tf.as_dtype(dtype).base_dtype
  zero = tf.compat.v1.placeholder_with_default(tf.constant(0, dtype), [])
  return tf.fill(shape, zero)


# Up to this size a variable is zeroed by assigning it a zeros tensor shared
# by every variable of its shape: one op per variable (the apply step's cost
# on many small variables is its op count), and the one shared transient is
# small. Larger ones are zeroed by a scatter, which needs no such buffer.
SHARED_ZEROS_MAX_BYTES = 1 << 20


def zero_in_place(variable, shared_zeros=None):
  """Sets every element of `variable` to zero in its own buffer.

  A small variable (at most `SHARED_ZEROS_MAX_BYTES`) is assigned zeros
  from `shared_zeros`, one tensor per shape, dtype and device made once per
  apply step: assign kernels copy a value that has other users into the
  variable's own buffer. A larger one gets a scatter of one scalar zero
  over all of its rows: no buffer as large as the variable. (With `assign`
  of its own zeros the wrapper's peak RSS over a bare micro-batch step was
  2.47x the parameter bytes on the benchmark's MLP, with this 1.14x-1.23x,
  1x being the accumulators.) A scatter switches a resource variable to
  copy-on-read mode, in which every later dense read copies it (the apply
  step's read would then be the same large buffer); `DisableCopyOnRead`
  switches it back once the scatter is done. Inside XLA, which updates in
  place by itself and has no such modes, and for a variable without rows (a
  scalar, or a rank unknown until run time), a plain assign.

  Args:
    variable: a variable (ref or resource), or a replica's component of one.
    shared_zeros: None, or a dict that the resets of one apply step share.

  Returns:
    The op.
  """
  dtype = variable.dtype.base_dtype
  if not variable.shape.rank or compat.in_xla_context():
    return variable.assign(run_time_zeros(tf.shape(variable), dtype),
                           read_value=False)
  shape = variable.shape
  if (shared_zeros is not None and shape.is_fully_defined() and
      shape.num_elements() * dtype.size <= SHARED_ZEROS_MAX_BYTES):
    key = (tuple(shape.as_list()), dtype, variable.device)
    if key not in shared_zeros:
      with tf.control_dependencies(None):  # made once, not after one reset
        shared_zeros[key] = run_time_zeros(shape.as_list(), dtype)
    return variable.assign(shared_zeros[key], read_value=False)
  zero = tf.zeros([], dtype)
  rows = tf.compat.dimension_value(shape[0])
  if rows is None:  # known at run time only: read where the variable is
    rows = compat.variable_shape(variable)[0]
  with tf.device(compat.host_device(variable.device)):
    # On the host, as shapes are, and at run time: a folded constant of row
    # ids would stay for the session's life (8 bytes a row).
    rows = tf.range(tf.compat.v1.placeholder_with_default(
        tf.cast(rows, tf.int64), []))
  if compat.is_ref_variable(variable):
    return tf.compat.v1.scatter_update(variable, rows, zero).op
  zeroed = tf.raw_ops.ResourceScatterUpdate(resource=variable.handle,
                                            indices=rows, updates=zero)
  with tf.control_dependencies([zeroed]):
    return tf.raw_ops.DisableCopyOnRead(resource=variable.handle)
