"""Checkpoints: the wrapper's state in them, and the one step of a switch.

The wrapper installs no saver. Every front end saves with the saver it
would make without the wrapper (an `Estimator`'s from its `RunConfig`, a
`Scaffold`'s, a `Supervisor`'s, the user's own), so the checkpoints kept
are the user's to configure. The wrapper's state (accumulators, counters,
each train op's settings) is made of ordinary global variables under
stable names, so any saver saves it and a job resumes mid-cycle with
nothing to do.

A checkpoint written under other settings may lack some of these names, or
hold them under others:

* accumulation turned on: no accumulators, counters or settings;
* accumulation turned off, or the other graph behaviour: the wrapped
  optimizer's non-slot variables (Adam's `beta1_power`) are named after the
  scope they were made in: the caller's name scope without the wrapper
  (`dnn/head/beta1_power`), the root inside the wrapper's control flow v2
  branch (`beta1_power`), the branch's scope under control flow v1
  (`dnn/head/cond/beta1_power`), as the original named them;
* the original's: no settings, and a partitioned table's one dense
  accumulator in slices (`<table>/GradientAccumulator`) where this version
  keeps a list of rows per partition (`<table>/part_<n>/GradientAccumulator`);
* `sparse_as_dense` switched: a table's list of rows where a dense
  accumulator is now kept.

`convert_checkpoint`, run once in the graph that will restore, writes such
a checkpoint under this graph's names with TensorFlow's public reader and
`SaveV2`: each variable from its own name or else from another name it had
(`create_wrapped_slots` records them), and, where any of the wrapper's
state is missing, all of it afresh. `ConvertCheckpointHook` does the same
from an `Estimator`'s `train`, and `Saver` on every restore.

A train op's settings (`<its name scope>/deferred_grad_settings`: its int
`grad_steps` or 0 for a schedule, whether it is weighted, its
`nonfinite_policy` and its place in the cycle) are a variable that each
micro-step checks and writes (`records`): a checkpoint written mid-cycle
under other settings fails the first micro-step after its restore, naming
them, whichever saver restored it.

The records live in graph collections under tuple keys, as TensorFlow's
variable store does: they are not serialized into meta graphs.
"""

import os
import re
import shutil
import tempfile
import time

import numpy as np

from deferred_grad import compat

tf = compat.import_tensorflow()

# Graph collections of the records (tuple keys: never serialized).
_STATE = ('deferred_grad', 'state')  # (variable, its value afresh or None)
_ALIASES = ('deferred_grad', 'aliases')  # (variable, its other names)
_SETTINGS = ('deferred_grad', 'settings')  # (variable, settings, place)

# The flags of a train op's settings (`records._settings_variable`).
WEIGHTED, COUNTS_UPDATES = 1, 2

# What `convert_checkpoint` leaves out: an object-based checkpoint's graph
# of objects, which names the keys it read from.
_OBJECT_GRAPH_KEY = '_CHECKPOINTABLE_OBJECT_GRAPH'


def add_to_state(variables, initial=None):
  """Records `variables` as part of the wrapper's state in their graph.

  The state (accumulators and counters) is what a checkpoint written
  without the wrapper lacks; `convert_checkpoint` writes it afresh then.

  Args:
    variables: a list of variables of one graph.
    initial: their value afresh, a numpy array, or None: zeros of the
      variable's shape (of its table's, where that is not static).
  """
  for variable in variables:
    state = variable.graph.get_collection_ref(_STATE)
    if not any(variable is known for known, _ in state):
      state.append((variable, initial))


def add_settings(variable, settings, place, global_step):
  """Records a train op's settings variable (see the module docstring).

  Args:
    variable: the int64 vector [grad_steps or 0, flags, policy, place].
    settings: its first three values in this graph.
    place: (the name of the counter the cycle's place is read from, the
      int it counts modulo, or None), for a checkpoint without settings.
    global_step: the name of the `global_step` the train op counts, or None.
  """
  variable.graph.add_to_collection(
      _SETTINGS, (variable, settings, place, global_step))


def create_wrapped_slots(opt, var_list, scopes, wrapper):
  """Creates the wrapped optimizer's slots and non-slot variables.

  Records each new non-slot variable's other names, under which a
  checkpoint written without the wrapper or in the other graph behaviour
  holds it, and restores into it what an object-based checkpoint restore
  of `wrapper` (which shows them as its own) left for it.

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
      variable.graph.add_to_collection(_ALIASES, (variable, names))


def scopes(in_cond):
  """Where the wrapped optimizer's non-slot variables go, as the original
  put them.

  The original called the wrapped `apply_gradients` inside a `tf.cond`, and
  optimizers name their non-slot variables (Adam's `beta1_power`, ...) after
  the current name scope. A control flow v2 branch starts at the root scope;
  a v1 branch is under `<current scope>/cond`, uniquified. Without a
  `tf.cond` (grad_steps=1), the bare optimizer's scope, the caller's. Call
  it before opening the wrapper's name scope.

  Args:
    in_cond: whether the wrapped optimizer applies inside the cycle's
      `tf.cond`.

  Returns:
    (the absolute name scope of the wrapped optimizer's non-slot variables,
    the caller's absolute scope), each '' or ending in '/'.
  """
  graph = tf.compat.v1.get_default_graph()
  caller = graph.get_name_scope()
  caller = caller + '/' if caller else ''
  if not in_cond:
    return caller, caller
  if tf.compat.v1.control_flow_v2_enabled():
    return '', caller
  return graph.unique_name('cond', mark_as_used=False) + '/', caller


# ------------------------------------------------------------ conversion --

def convert_checkpoint(checkpoint, var_list=None):
  """Makes a checkpoint written under other settings restore in this graph.

  Switching accumulation on or off, `grad_steps`, `sparse_as_dense` or the
  graph behaviour over a checkpoint (or resuming one of the original's)
  changes the names the graph saves and restores (README "Checkpoints").
  Run this once, after the train ops are built and before the session
  restores: it reads the checkpoint with TensorFlow's public reader and, if
  this graph's savers would not restore it as it is, writes a copy under
  this graph's names beside it, `<name>.converted-<step>`:

  * each variable from its own name, or else from a name it had under
    other settings (the wrapped optimizer's non-slot variables, a
    partition's slice of the original's dense table accumulator), a list of
    rows made dense where a dense accumulator is kept now;
  * where any of the wrapper's accumulators and counters is missing
    (accumulation turned on), all of them afresh: a new cycle.

  The checkpoint itself is left as it is. Given a directory, the copy
  becomes its latest checkpoint (recorded in its `checkpoint` file beside
  the others), which `MonitoredTrainingSession`, `Estimator` and
  `Supervisor` restore.

  ```python
  train_op = opt.minimize(loss, global_step=global_step)
  deferred_grad.convert_checkpoint(checkpoint_dir)
  with tf.compat.v1.train.MonitoredTrainingSession(
      checkpoint_dir=checkpoint_dir) as session: ...
  ```

  A checkpoint written mid-cycle under another `grad_steps`, weighting or
  `nonfinite_policy` is copied as it is: the first micro-step after its
  restore fails, naming the setting (its partial sums would be applied
  wrongly).

  Args:
    checkpoint: a checkpoint's path prefix, or a directory (its latest).
    var_list: what the saver that will restore it saves, as given to
      `tf.compat.v1.train.Saver` (a list of variables or a dict of names);
      None: the graph's global variables, as a saver given none.

  Returns:
    The path of a checkpoint this graph restores: `checkpoint`'s own where
    nothing needed converting, else the copy's.

  Raises:
    ValueError: `checkpoint` names no checkpoint; or it lacks a variable
      that is not the wrapper's state under every name it could have.
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

  For front ends that build the graph themselves, an `Estimator` (canned
  ones too) and `TPUEstimator`; harmless where nothing needs converting, so
  it may stay.

  ```python
  estimator.train(input_fn, max_steps=...,
                  hooks=[deferred_grad.ConvertCheckpointHook(model_dir)])
  ```

  Args:
    checkpoint_dir: the directory the session restores from (an
      Estimator's `model_dir`).
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

  It saves as `tf.compat.v1.train.Saver` does, with the same arguments. On
  `restore`, a checkpoint written under other settings is converted first
  (`convert_checkpoint`, into a temporary directory, removed after); an
  object-based one (Keras's) restores as with a plain Saver.
  """

  def __init__(self, var_list=None, *args, **kwargs):
    super(Saver, self).__init__(var_list, *args, **kwargs)
    self.restores = var_list

  def restore(self, sess, save_path):
    """Restores `save_path`, converted for this graph where it needs it.

    Args:
      sess: the session.
      save_path: the checkpoint's path prefix.

    Returns:
      None (as `tf.compat.v1.train.Saver.restore`).

    Raises:
      ValueError: as `tf.compat.v1.train.Saver.restore` and
        `convert_checkpoint`.
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
  """A part of a partitioned variable's (its whole's shape, its offset),
  else None."""
  try:
    proto = variable.to_proto()
  except (AttributeError, NotImplementedError, TypeError):
    return None
  if not proto.HasField('save_slice_info_def'):
    return None
  info = proto.save_slice_info_def
  return list(info.full_shape), list(info.var_offset)


def _key(variable):
  """The key a saver saves `variable` under: a part's, its whole's (a slice
  of it); else its name (not its op's: a strategy's variable's op may be a
  read)."""
  try:
    proto = variable.to_proto()
  except (AttributeError, NotImplementedError, TypeError):
    proto = None
  if proto is not None and proto.HasField('save_slice_info_def'):
    return proto.save_slice_info_def.full_name
  return variable.name.split(':')[0]


def converted_values(path, var_list=None):
  """{key: value} of the checkpoint at `path` under this graph's names, or
  None where this graph's savers restore it as it is (see
  `convert_checkpoint`)."""
  reader = tf.train.load_checkpoint(path)
  shapes = reader.get_variable_to_shape_map()
  graph = tf.compat.v1.get_default_graph()
  state = {_key(v): (v, initial) for v, initial in graph.get_collection(_STATE)}
  settings = {_key(v): (values, place, step)
              for v, values, place, step in graph.get_collection(_SETTINGS)}
  aliases = {_key(v): names for v, names in graph.get_collection(_ALIASES)}
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
  """`global_step` counted the other way (`global_step_counts`), at the
  cycle boundary where the checkpoint was written.

  Raises:
    ValueError: the checkpoint was written mid-cycle, or under a schedule
      whose micro-steps per update are not known.
  """
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
  """The value of `variable` (saved as `key`) for the converted checkpoint:
  True where the checkpoint holds it as it is, None where it lacks it.
  `state`: its `add_to_state` record, or None for a variable of the model;
  `parts`: {a part's name: (its whole's key, its first row, its rows)}."""
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
  """A state variable's value afresh (see `add_to_state`)."""
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
  """A dense accumulator of `shape` holding a list of rows' sums: row 0 the
  number n of rows listed, rows 1 to n an int64 id in the first columns
  (its bytes), then the row (`accumulators.RowListAccumulator`)."""
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
