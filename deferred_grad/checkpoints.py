"""Checkpoints: the wrapper's state in them, and their conversion.

The wrapper installs no saver: each front end saves with the saver it would
make without it. The wrapper's state (accumulators, counters, each train
op's settings) is ordinary global variables under stable names, so any
saver saves it and a job resumes mid-cycle.

A checkpoint written under other settings may lack them or name them otherwise:

* accumulation turned on: no accumulators, counters or settings;
* accumulation off, or the other graph behaviour: the wrapped optimizer's
  non-slot variables under another scope (see `scopes`);
* the original's: no settings, and a partitioned table's dense accumulator
  in slices, not a list of rows per part;
* `sparse_as_dense` switched: a list of rows, not a dense accumulator.

`convert_checkpoint`, `ConvertCheckpointHook` and `Saver` convert them.
"""

import os
import re
import shutil
import tempfile
import time

import numpy as np

from deferred_grad import arguments
from deferred_grad import compat
from deferred_grad import registry

tf = compat.import_tensorflow()

# The flags of a train op's settings (`Settings`).
WEIGHTED, COUNTS_UPDATES = 1, 2

# What `convert_checkpoint` leaves out: an object-based checkpoint's graph
# of objects, which names the keys it read from.
_OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'

# Why a global_step moved that only the wrapper moves: the end of the
# message of both checks that can see it (`Settings.check`).
_OWN_INCREMENT = ('the script increments it beside the wrapper, which '
                  'counts it already (remove that increment).')


def register(record, graph):
  """Records a train op's state and settings in `graph`'s registry, once.

  Args:
    record: the train op's `records.Record`: its `state` [(variable, value
      afresh or None)] and `settings` (a `Settings`, or None).
    graph: the graph its variables are in.
  """
  known = registry.of(graph)
  for variable, initial in record.state:
    if all(variable is not listed for listed, _ in known.state):
      known.state.append((variable, initial))
  settings = record.settings
  if settings is not None and all(settings is not s for s in known.settings):
    known.settings.append(settings)


class Settings(object):
  """What a train op's checkpoint says of its partial sums, and its checks.

  The variable `deferred_grad_settings` holds [grad_steps (0: a schedule),
  flags (`WEIGHTED`, `COUNTS_UPDATES`), nonfinite_policy's index, the place
  in the cycle the last micro-step left]. A run whose restored cycle cannot
  continue fails (`check`). Counting updates with a `global_step`,
  `deferred_grad_global_step` holds the value the last micro-step left it
  at, so that a script's own increment fails the next micro-step.

  Args:
    values: [grad_steps or 0, flags, policy index], ints.
    counter: the variable the cycle's place is read from (or None), and its
      modulus (an int grad_steps) or None.
    global_step: the train op's `global_step`, or None.

  Attributes:
    variable: the settings variable.
    values: `values`.
    state: [(variable, value afresh)] of what a checkpoint must hold beside
      the settings.
    step_read: the global_step value a run found, once `check` is built
      counting updates (else None).
  """

  def __init__(self, values, counter, global_step):
    self.values = list(values)
    self.global_step = global_step
    self.step_left = None
    self.state = []
    if values[1] & COUNTS_UPDATES and global_step is not None:
      self.step_left = tf.compat.v1.Variable(
          lambda: tf.constant(-1, tf.int64), name='deferred_grad_global_step',
          trainable=False,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self.state.append((self.step_left, np.array(-1, np.int64)))
    self.variable = tf.compat.v1.Variable(
        lambda: tf.constant(self.values + [0], tf.int64),
        name='deferred_grad_settings', trainable=False,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    # Where a checkpoint without settings (the original's) has its place.
    variable, self.modulo = counter
    self.counter_name = variable.name.split(':')[0]
    self.step_name = (None if global_step is None else
                      global_step.name.split(':')[0])
    self.step_read = None

  def variables(self):
    """The settings variable, and the step left where counting updates."""
    return [v for v in (self.variable, self.step_left) if v is not None]

  def check(self, position):
    """Returns the Asserts that fail a run whose state cannot continue.

    Args:
      position: the run's `cycles.Position`, read under its lock.

    Returns:
      A list of ops.
    """
    checks = [self._continues(position)]
    if self.step_left is not None:
      # The global_step this run found: an int cycle has read it as its
      # updates; a schedule counts its own, so it is read here, a value of
      # its own (a ref variable's read may alias the buffer this run's
      # increment changes in place).
      step_read = self.step_read = (
          position.updates if self.modulo else tf.math.floordiv(
              tf.cast(self.global_step.read_value(), tf.int64), 1))
      left = self.step_left.read_value()
      checks.append(tf.debugging.Assert(
          tf.logical_or(tf.equal(left, -1), tf.equal(left, step_read)), [
              'GradientAggregationOptimizer: %s counts updates '
              '(global_step_counts=updates), and the wrapper alone adds to '
              'it, once per cycle ended; it left' % self.global_step.op.name,
              tf.cast(left, tf.int32), 'and this run found',
              tf.cast(step_read, tf.int32),
              '. Something else moved it: ' + _OWN_INCREMENT]))
    return checks

  def advance(self, position, advanced):
    """Records what this micro-step leaves: the place, and the step.

    Args:
      position: the run's `cycles.Position`.
      advanced: the op that counts the micro-step.

    Returns:
      `advanced` grouped with the settings' writes.
    """
    place = tf.where(position.is_end, tf.constant(0, tf.int64),
                     position.in_cycle + 1)
    advanced = tf.group(advanced, self.variable.assign(
        tf.stack([tf.constant(v, tf.int64) for v in self.values] + [place]),
        read_value=False))
    if self.step_read is not None:  # what the script's next run must find
      advanced = tf.group(advanced, self.step_left.assign(
          self.step_read + tf.cast(position.is_end, tf.int64),
          read_value=False))
    return advanced

  def _continues(self, position):
    """An Assert failing a run whose restored cycle cannot continue: saved
    mid-cycle under other settings, or mid-cycle without partial sums."""
    values = self.values
    # Copied (stacked), as in `cycles.Schedule.read`: a ref variable's read
    # may alias the buffer another run's write changes in place. int32 and
    # strings: an Assert of them needs no cond around it.
    saved = tf.cast(tf.stack(tf.unstack(self.variable.read_value(), 4)),
                    tf.int32)
    place = tf.cast(position.in_cycle, tf.int32)
    # The same grad_steps; weights and a policy kept (the sums do not
    # depend on the policy's kind; counts it lacks would start the cycle
    # afresh); the place it left.
    flags = saved[1]
    kept = [tf.equal(saved[0], values[0]), tf.equal(saved[3], place)]
    if not values[1] & WEIGHTED:
      kept.append(tf.equal(tf.bitwise.bitwise_and(flags, WEIGHTED), 0))
    if not values[2]:
      kept.append(tf.equal(saved[2], 0))
    continues = tf.reduce_all(tf.stack(kept))
    afresh = tf.logical_and(tf.equal(saved[3], 0), tf.equal(place, 0))
    # What global_step counts, at any place (`convert_checkpoint` converts).
    same_count = tf.equal(tf.bitwise.bitwise_and(flags, COUNTS_UPDATES),
                          values[1] & COUNTS_UPDATES)
    policy = arguments.NONFINITE_POLICIES[values[2]]
    here = '%s, %s, nonfinite_policy=%r, global_step_counts=%r' % (
        'grad_steps=%d' % values[0] if values[0] else 'grad_steps a schedule',
        'a micro_batch_weight' if values[1] & WEIGHTED else
        'micro_batch_weight=None', policy,
        'updates' if values[1] & COUNTS_UPDATES else 'micro_steps')
    return tf.debugging.Assert(tf.logical_and(
        same_count, tf.logical_or(continues, afresh)), [
            'GradientAggregationOptimizer: the cycle of the restored '
            'checkpoint does not continue in this train op (%s): its partial '
            'sums would be applied wrongly. It was saved with [grad_steps (0: '
            'a schedule), flags (1: a micro_batch_weight, 2: '
            'global_step_counts=\'updates\'), nonfinite_policy (0: None, 1: '
            'skip_micro_batch, 2: skip_cycle), micro-steps of its cycle '
            'done] =' % here, saved,
            '; here its counter places this run at micro-step', place,
            '. Restore it with the settings it was saved with and change them '
            'after the last micro-step of a cycle; a new int grad_steps needs '
            'a global_step that is a multiple of it (or give grad_steps as '
            'tf.constant(n)); another global_step_counts needs '
            'deferred_grad.convert_checkpoint. Without a restore, something '
            'else moved global_step: ' + _OWN_INCREMENT], summarize=4)


def create_wrapped_slots(opt, var_list, scopes, wrapper):
  """Creates the wrapped optimizer's slots and non-slot variables.

  Records each new non-slot variable's names under other settings, and
  restores into it what an object-based restore of `wrapper` left for it.

  Args:
    opt: the wrapped optimizer.
    var_list: the variables it will update.
    scopes: what `scopes` returned.
    wrapper: the `GradientAggregationOptimizer`.
  """
  # pylint: disable=protected-access
  scope, caller = scopes
  before = set(id(v) for v in opt._non_slot_dict.values())
  with tf.init_scope(), tf.compat.v1.name_scope(scope):
    opt._create_slots(var_list)
  new = [(key, variable) for (key, _), variable in opt._non_slot_dict.items()
         if id(variable) not in before]
  for key, variable in new:
    # Restored (object-based) before it was made.
    wrapper._handle_deferred_dependencies(name=key, trackable=variable)
    name = variable.name.split(":")[0]
    if name.startswith(scope):
      base = name[len(scope):]
      # Without the wrapper; inside its v2 branch; inside its v1 branch.
      names = [n for n in (caller + base, base, caller + 'cond/' + base)
               if n != name]
      registry.of(variable.graph).aliases.append((variable, names))


def scopes(in_cond):
  """Where the wrapped optimizer's non-slot variables go, as in the original.

  Optimizers name them (Adam's `beta1_power`) after the name scope, and the
  original applied inside a `tf.cond`: a v2 branch starts at the root scope,
  a v1 branch is under `<scope>/cond`. Call it outside the wrapper's scope.

  Args:
    in_cond: whether the wrapped optimizer applies inside the cycle's cond.

  Returns:
    (the non-slot variables' scope, the caller's): absolute, '' or ending '/'.
  """
  graph = tf.compat.v1.get_default_graph()
  caller = graph.get_name_scope()
  caller = caller + '/' if caller else ''
  if not in_cond:
    return caller, caller
  if tf.compat.v1.control_flow_v2_enabled():
    return '', caller
  return graph.unique_name('cond', mark_as_used=False) + '/', caller


# ------------------------------------------------ object-based checkpoints --

class ObjectCheckpoints(object):
  """The wrapper's part in object-based checkpoints (a mixin).

  `tf.train.Checkpoint` and Keras's `save_weights` see the wrapped
  optimizer's variables and slots as the wrapper's, so that checkpoints
  restore both ways with a bare optimizer; the wrapper's counters sit beside
  them. The class it mixes into holds the wrapped optimizer as `_opt`.
  """

  def _own_children(self):
    """{name: variable}: this graph's counters of the wrapper's train ops."""
    return {v.op.name: v
            for record in registry.records_of(self, compat.outermost_graph())
            for v in record.counters}

  # pylint: disable=protected-access
  def _trackable_children(self, save_type='checkpoint', **kwargs):
    children = dict(self._opt._trackable_children(save_type, **kwargs))
    children.update(self._own_children())
    return children

  def _lookup_dependency(self, name, cached_dependencies=None):
    found = self._opt._lookup_dependency(name, cached_dependencies)
    return found if found is not None else self._own_children().get(name)

  def _create_or_restore_slot_variable(self, slot_variable_position,
                                       slot_name, variable):
    self._opt._create_or_restore_slot_variable(slot_variable_position,
                                               slot_name, variable)
  # pylint: enable=protected-access

  @tf.autograph.experimental.do_not_convert
  def variables(self):
    """The wrapped optimizer's and the wrapper's variables (this graph's).

    Returns:
      The wrapped optimizer's non-slot variables and each train op's counters
      and tables' lists of rows in this graph, sorted by name.
    """
    own = [v for record in registry.records_of(self, compat.outermost_graph())
           for v in record.variables()]
    return sorted(list(self._opt.variables()) + own, key=lambda v: v.name)


# ------------------------------------------------------------ conversion --

def convert_checkpoint(checkpoint, var_list=None):
  """Makes a checkpoint written under other settings restore in this graph.

  Run it once, after the train ops are built and before the session
  restores, when accumulation, `grad_steps`, `sparse_as_dense` or the graph
  behaviour changed, or to resume the original's checkpoints. Where needed,
  it writes a copy under this graph's names (the wrapper's state afresh
  where any is missing) beside the checkpoint, `<name>.converted-<step>`,
  leaving the checkpoint alone; a directory's copy becomes its latest,
  which `MonitoredTrainingSession`, `Estimator` and `Supervisor` restore.
  A mid-cycle checkpoint under another `grad_steps`, weighting or
  `nonfinite_policy` is copied as it is: its first micro-step then fails.
  In a job of several processes, run it in one (the chief) before the
  others restore: each would write the same copy.

  ```python
  train_op = opt.minimize(loss, global_step=global_step)
  deferred_grad.convert_checkpoint(checkpoint_dir)
  with tf.compat.v1.train.MonitoredTrainingSession(
      checkpoint_dir=checkpoint_dir) as session: ...
  ```

  Args:
    checkpoint: a checkpoint's path prefix, or a directory (its latest).
    var_list: what the restoring saver saves, as given to
      `tf.compat.v1.train.Saver`; None: the graph's global variables.

  Returns:
    The path to restore: the copy's, or `checkpoint`'s own if none was needed.

  Raises:
    ValueError: `checkpoint` names no checkpoint; lacks a variable other
      than the wrapper's state under every name it could have; or counts
      `global_step` the other way and does not end a cycle.
  """
  directory = tf.io.gfile.isdir(checkpoint)
  path = tf.train.latest_checkpoint(checkpoint) if directory else checkpoint
  if path is None or not tf.io.gfile.exists(path + '.index'):
    raise ValueError(
        'convert_checkpoint: %r is neither a checkpoint nor a directory '
        'with one.' % (checkpoint,))
  values = converted_values(path, var_list)
  if values is None:
    return path
  head, _, step = path.rpartition('-')
  output = ('%s.converted-%s' % (head, step) if head and step.isdigit() else
            path + '.converted')
  _write(output, values)
  if directory:
    state = tf.train.get_checkpoint_state(checkpoint)
    paths = [p for p in state.all_model_checkpoint_paths if p != output]
    times = list(state.all_model_checkpoint_timestamps)
    tf.compat.v1.train.update_checkpoint_state(
        checkpoint, output, all_model_checkpoint_paths=paths + [output],
        all_model_checkpoint_timestamps=(
            times + [time.time()] if len(times) == len(paths) else None),
        last_preserved_timestamp=state.last_preserved_timestamp)
  tf.compat.v1.logging.info(
      'deferred_grad: converted %s for this graph into %s.', path, output)
  return output


class ConvertCheckpointHook(tf.compat.v1.train.SessionRunHook):
  """Runs `convert_checkpoint` on a directory before a session restores it.

  For front ends that build the graph themselves (`Estimator`, canned ones
  too, `TPUEstimator`); harmless where nothing needs converting.

  ```python
  estimator.train(input_fn, max_steps=...,
                  hooks=[deferred_grad.ConvertCheckpointHook(model_dir)])
  ```

  Args:
    checkpoint_dir: the directory restored from (an Estimator's `model_dir`).
  """

  def __init__(self, checkpoint_dir):
    self.checkpoint_dir = checkpoint_dir

  def begin(self):
    """Converts the directory's latest checkpoint, if it has one."""
    if tf.train.latest_checkpoint(self.checkpoint_dir) is not None:
      convert_checkpoint(self.checkpoint_dir)


class Saver(tf.compat.v1.train.Saver):
  """A `tf.compat.v1.train.Saver` that converts what it restores.

  ```python
  saver = deferred_grad.Saver()  # after the train ops are built
  saver.restore(session, path)   # written with or without accumulation
  ```

  It takes the plain Saver's arguments; `restore` converts a checkpoint
  written under other settings into a temporary copy first; an object-based
  one (Keras's) restores as with a plain Saver.
  """

  def __init__(self, var_list=None, *args, **kwargs):
    super(Saver, self).__init__(var_list, *args, **kwargs)
    self.restores = var_list

  def restore(self, sess, save_path):
    """Restores `save_path`, converted for this graph where needed.

    Args:
      sess: the session.
      save_path: the checkpoint's path prefix.

    Returns:
      None, as `tf.compat.v1.train.Saver.restore`.

    Raises:
      ValueError: as the plain Saver's `restore`, and `convert_checkpoint`.
    """
    # Not a checkpoint (the plain Saver's ValueError), or an object-based
    # one (the plain Saver maps its keys itself).
    if (save_path is None or not tf.io.gfile.exists(save_path + '.index') or
        _OBJECT_GRAPH_KEY in tf.train.load_checkpoint(
            save_path).get_variable_to_shape_map()):
      return super(Saver, self).restore(sess, save_path)
    values = converted_values(save_path, self.restores)
    if values is None:
      return super(Saver, self).restore(sess, save_path)
    directory = tempfile.mkdtemp(prefix='deferred_grad_converted_')
    try:
      _write(os.path.join(directory, 'converted'), values)
      return super(Saver, self).restore(
          sess, os.path.join(directory, 'converted'))
    finally:
      shutil.rmtree(directory, ignore_errors=True)


def _targets(var_list):
  """[(save key, variable)] of what a saver given `var_list` saves."""
  if var_list is None:
    var_list = tf.compat.v1.global_variables()
  if isinstance(var_list, dict):
    return list(var_list.items())
  targets = []
  for variable in var_list:
    if isinstance(variable, tf.Variable):
      targets.append((_key(variable), variable))
    else:  # a partitioned variable: its parts
      targets.extend((_key(part), part) for part in variable)
  return targets


def _slice(variable):
  """(Whole shape, offset) of a partitioned variable's part, else None."""
  try:
    proto = variable.to_proto()
  except (AttributeError, NotImplementedError, TypeError):
    return None
  if not proto.HasField('save_slice_info_def'):
    return None
  info = proto.save_slice_info_def
  return list(info.full_shape), list(info.var_offset)


def _key(variable):
  """The key a saver saves `variable` under: a part's whole's, else its name
  (not its op's, which under a strategy may be a read)."""
  try:
    proto = variable.to_proto()
  except (AttributeError, NotImplementedError, TypeError):
    proto = None
  if proto is not None and proto.HasField('save_slice_info_def'):
    return proto.save_slice_info_def.full_name
  return variable.name.split(':')[0]


def converted_values(path, var_list=None):
  """{key: value} of the checkpoint at `path` under this graph's names, or
  None where this graph's savers restore it as it is."""
  reader = tf.train.load_checkpoint(path)
  shapes = reader.get_variable_to_shape_map()
  known = registry.of(tf.compat.v1.get_default_graph())
  state = {_key(v): (v, initial) for v, initial in known.state}
  settings = {_key(s.variable): (s.values, (s.counter_name, s.modulo),
                                 s.step_name) for s in known.settings}
  aliases = {_key(v): names for v, names in known.aliases}
  targets = _targets(var_list)
  parts = {}  # {a part's name: (its whole's key, its first row, its rows)}
  for key, variable in targets:
    if _slice(variable) and variable.shape.rank:
      parts[variable.name.split(':')[0]] = (
          key, _slice(variable)[1][0], variable.shape[0])
  changed, missing_state, missing = {}, [], []
  for key, variable in targets:
    if key in settings or key in changed:
      continue  # the settings below, with the rest of the state
    value = _value(key, variable, state.get(key), reader, shapes, aliases,
                   parts)
    if value is None:
      (missing_state if key in state else missing).append(key)
    elif value is not True:
      changed[key] = value
  if missing:
    raise ValueError(
        'convert_checkpoint: %s lacks %s under every name they could have '
        '(only the wrapper\'s own state may be missing): is it a checkpoint '
        'of this model?' % (path, sorted(set(missing))))
  if missing_state:  # partial sums mean nothing without all of their counters
    tf.compat.v1.logging.info(
        'deferred_grad: %s has no (complete) accumulator state: the wrapper\'s '
        'state starts afresh (missing: %s).', path,
        ', '.join(sorted(set(missing_state))))
    for key, (variable, initial) in state.items():
      changed[key] = _afresh(key, variable, initial, shapes)
  present = any(key in shapes for key in state)  # not a bare checkpoint
  for key, (values, (counter, modulo), step) in settings.items():
    saved = reader.get_tensor(key) if key in shapes else None
    # A bare checkpoint's steps were its updates; the original counted
    # micro-steps.
    flags = int(saved[1]) if saved is not None else (
        0 if present else values[1])
    if (flags ^ values[1]) & COUNTS_UPDATES and step in shapes:
      changed[step] = _recounted(path, reader, step, saved, values, modulo)
      changed[key] = np.array(list(values) + [0], np.int64)
      continue
    if saved is not None and not missing_state:
      continue
    place = 0
    if not missing_state and counter in shapes:
      place = int(reader.get_tensor(counter))
      place = place % modulo if modulo else place
    changed[key] = np.array(list(values) + [place], np.int64)
  if not changed:
    return None
  values = {key: reader.get_tensor(key) for key in shapes
            if key != _OBJECT_GRAPH_KEY}
  values.update(changed)
  return values


def _recounted(path, reader, step, saved, values, modulo):
  """`global_step` counted the other way (`global_step_counts`); ValueError
  unless the checkpoint ends a cycle of an int `grad_steps`."""
  value = int(reader.get_tensor(step))
  grad_steps = int(saved[0]) if saved is not None else modulo
  place = int(saved[3]) if saved is not None else value % (modulo or 1)
  to_updates = bool(values[1] & COUNTS_UPDATES)
  was = "'micro_steps'" if to_updates else "'updates'"
  if place or not grad_steps:
    raise ValueError(
        'convert_checkpoint: %s was written with global_step_counts=%s%s; '
        'this graph counts %s. Convert one written at a cycle\'s end under '
        'an int grad_steps.' % (
            path, was, ' at micro-step %d of its cycle' % place if place else
            ' under a grad_steps schedule', "'updates'" if to_updates else
            "'micro_steps'"))
  dtype = reader.get_variable_to_dtype_map()[step].as_numpy_dtype
  return np.array(value // grad_steps if to_updates else value * grad_steps,
                  dtype)


def _value(key, variable, state, reader, shapes, aliases, parts):
  """`variable`'s value (saved as `key`) for the copy: True where the
  checkpoint holds it as it is, None where it lacks it."""
  initial = state[1] if state else None
  if key in shapes:
    static = variable.shape
    if (state and initial is None and static.is_fully_defined() and
        shapes[key] != static.as_list() and len(shapes[key]) == 2):
      # A dense accumulator of a table, the checkpoint's a list of rows.
      return _dense_of_list(reader.get_tensor(key), static.as_list(),
                            variable.dtype.base_dtype.as_numpy_dtype)
    return True
  table, _, slot = key.rpartition('/')
  if state and initial is not None and table in parts:
    # A part's list of rows, from its slice of the original's one dense
    # accumulator of the table (made a list at the next micro-step).
    whole, first, rows = parts[table]
    if whole + '/' + slot in shapes:
      return reader.get_tensor(whole + '/' + slot)[first:first + rows]
  for name in aliases.get(key, ()):
    if name in shapes:
      return reader.get_tensor(name)
  if variable.trainable or state:
    return None
  # Without the wrapper: a non-slot variable of the optimizer it wrapped
  # (`create_wrapped_slots`), named at the root or in its v1 branch.
  scope, _, base = key.rpartition('/')
  pattern = re.compile('^(%s)?(cond(_[0-9]+)?/)?%s$' % (
      re.escape(scope + '/') if scope else '', re.escape(base)))
  found = [name for name in shapes if pattern.match(name)]
  return reader.get_tensor(found[0]) if len(found) == 1 else None


def _afresh(key, variable, initial, shapes):
  """A state variable's value afresh (see `register`)."""
  if initial is not None:
    return initial
  dtype = variable.dtype.base_dtype.as_numpy_dtype
  part = _slice(variable)
  if part:  # a part's slot: the whole's zeros, which the parts slice
    return np.zeros(part[0], dtype)
  if variable.shape.is_fully_defined():
    return np.zeros(variable.shape.as_list(), dtype)
  return np.zeros(shapes[key.rsplit('/', 1)[0]], dtype)  # its variable's


def _dense_of_list(listed, shape, dtype):
  """A dense accumulator of `shape` from a `RowListAccumulator`'s list: row 0
  holds the count n; rows 1 to n an int64 id (first columns), then the row."""
  id_columns = 8 // np.dtype(dtype).itemsize
  listed = np.ascontiguousarray(listed, dtype)
  count = int(listed[0, :id_columns].copy().view(np.int64)[0])
  ids = listed[1:count + 1, :id_columns].copy().view(np.int64).reshape(-1)
  dense = np.zeros(shape, dtype)
  np.add.at(dense, ids, listed[1:count + 1, id_columns:])
  return dense


def _write(prefix, values):
  """Writes `values` ({key: numpy value}) as a checkpoint at `prefix`."""
  keys = sorted(values)
  with tf.Graph().as_default():
    fed = [tf.compat.v1.placeholder(
        tf.string if np.asarray(values[k]).dtype == object else
        tf.as_dtype(np.asarray(values[k]).dtype)) for k in keys]
    save = tf.raw_ops.SaveV2(prefix=prefix, tensor_names=keys,
                             shape_and_slices=[''] * len(keys), tensors=fed)
    with tf.compat.v1.Session() as session:
      session.run(save, dict(zip(fed, [values[k] for k in keys])))
