"""Checkpoint names, and checkpoints written without the wrapper.

The wrapper's state (accumulators, counters) is recorded per graph here
(`add_to_state`), and the wrapped optimizer's slots and non-slot variables
are created where the original created them (`wrapped_vars_scope`,
`create_wrapped_slots`), so that the original's checkpoints restore.

`deferred_grad.Saver` also restores checkpoints written without the wrapper.

Turning accumulation on for a job whose checkpoints were written without it
(or with `grad_steps=1`) meets a checkpoint that lacks the wrapper's state:
the accumulators (`<var>/GradientAccumulator`) and counters. A plain
`tf.compat.v1.train.Saver` then fails with `NotFoundError`. This Saver
restores the model from such a checkpoint and starts the wrapper's state
afresh (zero accumulators, a new cycle); from a checkpoint that has the
state it restores everything, as a plain Saver does.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

import weakref

from deferred_grad import compat

tf = compat.import_tensorflow()

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.training.saving import saveable_object
from tensorflow.python.training.saving import saveable_object_util
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

# graph -> the wrapper's state variables (accumulators and counters), and
# graph -> {wrapped optimizer's non-slot variable's name: its name without
# the wrapper}.
_STATE = weakref.WeakKeyDictionary()
_RENAMED = weakref.WeakKeyDictionary()
# graph -> [(key, settings tensor, its first three values, the policies)]
# of its train ops (see `record_settings`).
_SETTINGS = weakref.WeakKeyDictionary()


def add_to_state(variable):
  """Records `variable` as part of the wrapper's state in its graph.

  The state (accumulators and counters) is what a checkpoint written
  without the wrapper lacks; `deferred_grad.Saver` starts it afresh then.
  """
  state = _STATE.setdefault(variable.graph, [])
  if not any(variable is known for known in state):
    state.append(variable)


def _default_saveables(graph):
  """What a `tf.compat.v1.train.Saver` given no var_list saves."""
  return tf.compat.v1.global_variables() + graph.get_collection(
      tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS)


def state_variables(graph):
  """The wrapper state variables created in `graph` (see `add_to_state`)."""
  return list(_STATE.get(graph, []))


def record_settings(grad_steps, weighted, policy, policies, place):
  """Records a train op's settings, which `Saver` saves and checks.

  A partial cycle's sums mean what the settings they were added under say:
  divided by that `grad_steps`, weighted or not, with a policy's counts or
  not. Restored mid-cycle under other settings, they would be applied as
  the new ones say, and no variable of the graph can tell: so `Saver`
  saves them (an int64 vector, not a variable: a plain Saver neither saves
  nor needs it) and refuses such a restore.

  Args:
    grad_steps: the int `grad_steps`, or None for a schedule.
    weighted: whether micro-steps carry a `micro_batch_weight`.
    policy: the `nonfinite_policy`, one of `policies`.
    policies: the policies, None first.
    place: an int64 scalar tensor, the micro-steps of the cycle so far.
  """
  values = (grad_steps or 0, int(weighted), policies.index(policy))
  # In the train op's name scope: saved as `<scope>/deferred_grad_settings`.
  tensor = tf.stack([tf.constant(v, tf.int64) for v in values] + [place],
                    name='deferred_grad_settings')
  _SETTINGS.setdefault(tensor.graph, []).append(
      (tensor.op.name, tensor, values, policies))


def _describe(index, value, policies):
  """A setting's value as the keyword would be written."""
  if index == 0:
    return 'grad_steps=%d' % value if value else 'grad_steps a schedule'
  if index == 1:
    return 'a micro_batch_weight' if value else 'micro_batch_weight=None'
  return 'nonfinite_policy=%r' % (policies[value],)


class _SavedTensor(saveable_object.SaveableObject):
  """A tensor saved under `name`; restoring it changes nothing."""

  def __init__(self, tensor, name):
    super(_SavedTensor, self).__init__(
        tensor, [saveable_object.SaveSpec(tensor, '', name)], name)

  def restore(self, restored_tensors, restored_shapes):
    del restored_tensors, restored_shapes
    return tf.no_op()


def _check_settings(records, now, save_path, keys, afresh):
  """Raises if the restored state would apply a cycle wrongly.

  Args:
    records: this graph's `_SETTINGS`.
    now: their tensors' values, run after the restore.
    save_path: the checkpoint restored.
    keys: the names in it.
    afresh: whether the wrapper's state was started afresh.

  Raises:
    ValueError: a train op's checkpoint is mid-cycle, and its grad_steps
      differs, or its weights or policy are gone; or the restored
      `global_step` places a train op mid-cycle without its partial sums.
  """
  for (key, _, values, policies), current in zip(records, now):
    saved = None
    if key in keys and not afresh:
      saved = [int(v) for v in tf.train.load_variable(save_path, key)]
    for index in range(3 if saved and saved[3] else 0):
      # Weights or a policy added: their counts are not in the checkpoint,
      # and the Saver has started the cycle afresh.
      if saved[index] != values[index] and (index == 0 or not values[index]):
        raise ValueError(
            'deferred_grad.Saver: checkpoint %s was written at micro-step %d '
            'of a cycle, with %s; this graph\'s train op has %s, which would '
            'apply that partial cycle\'s sums wrongly. Restore it with the '
            'settings it was written with and change them at a cycle '
            'boundary (from a checkpoint written on an apply step)%s.' % (
                save_path, saved[3], _describe(index, saved[index], policies),
                _describe(index, values[index], policies),
                '' if index else '; to change grad_steps at any step, give '
                'it as a tensor (tf.constant(n)): a schedule\'s cycle keeps '
                'the length it began with'))
    place = int(current[3])
    if place and (afresh or (saved and saved[0] != values[0])):
      # An int cycle counted on global_step: no counter to start afresh.
      raise ValueError(
          'deferred_grad.Saver: after restoring %s, global_step places a '
          'train op with grad_steps=%d at micro-step %d of its cycle, but the '
          'checkpoint holds no partial sums for that cycle (%s): it would '
          'apply fewer micro-batches than grad_steps, divided by grad_steps. '
          'Restore a checkpoint whose global_step is a multiple of %d, or '
          'give grad_steps as a tensor (tf.constant(%d)): a schedule counts '
          'its cycle in counters of its own, which start afresh.' % (
              save_path, values[0], place,
              'it has no accumulators for it' if afresh else
              'it was written with %s' % _describe(0, saved[0], policies),
              values[0], values[0]))


def add_renamed(variable, name_without_wrapper):
  """Records that without the wrapper `variable` would be named otherwise."""
  _RENAMED.setdefault(variable.graph, {})[variable.op.name] = (
      name_without_wrapper)


def renamed_variables(graph):
  """{variable name: its name without the wrapper} in `graph`."""
  return dict(_RENAMED.get(graph, {}))


def wrapped_vars_scope(in_cond):
  """Returns where the wrapped optimizer's non-slot variables go.

  The original called the wrapped `apply_gradients` inside a `tf.cond`, and
  optimizers name their non-slot variables (Adam's `beta1_power`, ...) after
  the current name scope. A control flow v2 branch starts at the root scope;
  a v1 branch is under `<current scope>/cond`, uniquified. Without a
  `tf.cond` (grad_steps=1), the bare optimizer's scope, the caller's. Call
  it before opening the wrapper's name scope.

  Args:
    in_cond: whether the wrapped optimizer applies inside the `tf.cond`.

  Returns:
    (absolute scope for them, the caller's absolute scope), each '' or
    ending in '/'.
  """
  graph = tf.compat.v1.get_default_graph()
  caller = graph.get_name_scope()
  caller = caller + '/' if caller else ''
  if not in_cond:
    return caller, caller
  if tf.compat.v1.control_flow_v2_enabled():
    return '', caller
  return graph.unique_name('cond', mark_as_used=False) + '/', caller


def create_wrapped_slots(opt, var_list, scopes):
  """Creates the wrapped optimizer's slots and non-slot variables.

  Where their scope differs from the caller's, records the name each new
  non-slot variable would have without the wrapper (`add_renamed`), for
  `deferred_grad.Saver`.

  Args:
    opt: the wrapped optimizer.
    var_list: the variables it will update.
    scopes: what `wrapped_vars_scope` returned.
  """
  # pylint: disable=protected-access
  scope, caller = scopes
  before = set(id(v) for v in opt._non_slot_dict.values())
  with tf.init_scope(), tf.compat.v1.name_scope(scope):
    opt._create_slots(var_list)
  if scope == caller:
    return
  for variable in opt._non_slot_dict.values():
    name = variable.op.name
    if id(variable) not in before and name.startswith(scope):
      add_renamed(variable, caller + name[len(scope):])


class Saver(tf.compat.v1.train.Saver):
  """A `tf.compat.v1.train.Saver` that also restores checkpoints without the
  wrapper's state, and checks the settings of a partial cycle.

  ```python
  saver = deferred_grad.Saver()      # after the wrapper's train op is built
  saver.restore(session, path)       # with or without accumulators in it

  # MonitoredTrainingSession, Estimator: hand it over in a Scaffold.
  scaffold = tf.compat.v1.train.Scaffold(saver=deferred_grad.Saver())
  ```

  It takes the arguments of `tf.compat.v1.train.Saver` and saves as it does,
  plus each train op's settings (`<its name scope>/deferred_grad_settings`:
  its int `grad_steps`, whether it is weighted, its `nonfinite_policy` and the
  micro-steps of its cycle so far), which other savers ignore. On `restore`:

  * a checkpoint with every variable restores as with a plain Saver; if it
    was written mid-cycle by this Saver with another `grad_steps`, or with a
    `micro_batch_weight` or `nonfinite_policy` this graph lacks, a
    `ValueError` says so (the partial cycle's sums would be applied
    wrongly);
  * a checkpoint without (some of) the wrapper's state, e.g. one written
    before accumulation was turned on: the model and the wrapped optimizer's
    variables are restored, and the wrapper's accumulators and counters are
    initialized: the cycle starts afresh (an int cycle counted on a
    restored `global_step` that is not a multiple of `grad_steps` would
    start part-way, with nothing summed: a `ValueError`). The wrapped
    optimizer's non-slot variables (Adam's `beta1_power`, ...), which the
    wrapper names `cond/beta1_power` under control flow v1 as the original
    did, are read from their names without the wrapper if need be.

  Build it after the wrapper's train ops, so that it knows their state.
  """

  def build(self):
    graph = tf.compat.v1.get_default_graph()
    self._settings = list(_SETTINGS.get(graph, []))
    if self._var_list is None or isinstance(self._var_list, (list, tuple)):
      if self._var_list is None:
        self._var_list = _default_saveables(graph)
      self._var_list = list(self._var_list) + [
          _SavedTensor(tensor, key) for key, tensor, _, _ in self._settings]
    super(Saver, self).build()
    self._build_fallbacks()

  def _build_fallbacks(self):
    """Restore-only savers: all but the settings; the model alone."""
    if getattr(self, '_fallbacks', None) is not None:
      return
    graph = tf.compat.v1.get_default_graph()
    names = saveable_object_util.op_list_to_dict(
        self._var_list if self._var_list is not None else
        _default_saveables(graph))
    settings = getattr(self, '_settings', [])
    self._settings_names = set(key for key, _, _, _ in settings) & set(names)
    names = {name: var for name, var in names.items()
             if name not in self._settings_names}
    state = {}
    for variable in state_variables(graph):
      for name in saveable_object_util.op_list_to_dict([variable]):
        if name in names:
          state[name] = variable
    state_names = set(state)
    renamed = renamed_variables(graph)
    model = {name: var for name, var in names.items()
             if name not in state_names}
    model_renamed = {renamed.get(name, name): var
                     for name, var in model.items()}
    self._state_names = state_names
    self._state_initializer = tf.compat.v1.variables_initializer(
        [state[name] for name in sorted(state)])
    self._without_settings = None
    if self._settings_names and names:  # for checkpoints without them
      self._without_settings = tf.compat.v1.train.Saver(var_list=names)
    self._fallbacks = []
    for var_list in (model, model_renamed):
      if var_list and not any(set(var_list) == set(known)
                              for known, _ in self._fallbacks):
        self._fallbacks.append(
            (var_list, tf.compat.v1.train.Saver(var_list=var_list)))
    self._all_names = set(names)

  def restore(self, sess, save_path):
    """Restores from `save_path`, with or without the wrapper's state.

    Args:
      sess: the session.
      save_path: the checkpoint's path prefix.

    Raises:
      tf.errors.NotFoundError: the checkpoint lacks a model variable (under
        the names with and without the wrapper).
      ValueError: it was written mid-cycle under other settings (see the
        class).
    """
    if save_path is None:
      return super(Saver, self).restore(sess, save_path)
    self._build_fallbacks()
    keys = {name for name, _ in tf.train.list_variables(save_path)}
    if self._all_names <= keys:
      if self._settings_names <= keys:
        result = super(Saver, self).restore(sess, save_path)
      else:  # written by another saver
        result = self._without_settings.restore(sess, save_path)
      self._check_settings(sess, save_path, keys, afresh=False)
      return result
    for var_list, saver in self._fallbacks:
      if set(var_list) <= keys:
        saver.restore(sess, save_path)
        sess.run(self._state_initializer)
        self._check_settings(sess, save_path, keys, afresh=True)
        tf.compat.v1.logging.info(
            'deferred_grad.Saver: %s has no (complete) accumulator state; '
            'restored the model and started the wrapper\'s state afresh '
            '(missing: %s).', save_path,
            ', '.join(sorted(self._state_names - keys)) or 'none')
        return None
    missing = sorted(min((set(var_list) - keys for var_list, _ in
                          self._fallbacks), key=len))
    raise tf.errors.NotFoundError(
        None, None,
        'deferred_grad.Saver: checkpoint %s lacks model variables %s (the '
        'wrapper\'s own state may be missing; these may not).' %
        (save_path, missing))

  def _check_settings(self, sess, save_path, keys, afresh):
    records = getattr(self, '_settings', [])
    now = sess.run([tensor for _, tensor, _, _ in records]) if records else []
    _check_settings(records, now, save_path, keys, afresh)
