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
from tensorflow.python.training.saving import saveable_object_util
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

# graph -> the wrapper's state variables (accumulators and counters), and
# graph -> {wrapped optimizer's non-slot variable's name: its name without
# the wrapper}.
_STATE = weakref.WeakKeyDictionary()
_RENAMED = weakref.WeakKeyDictionary()


def add_to_state(variable):
  """Records `variable` as part of the wrapper's state in its graph.

  The state (accumulators and counters) is what a checkpoint written
  without the wrapper lacks; `deferred_grad.Saver` starts it afresh then.
  """
  state = _STATE.setdefault(variable.graph, [])
  if not any(variable is known for known in state):
    state.append(variable)


def state_variables(graph):
  """The wrapper state variables created in `graph` (see `add_to_state`)."""
  return list(_STATE.get(graph, []))


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
  wrapper's state.

  ```python
  saver = deferred_grad.Saver()      # after the wrapper's train op is built
  saver.restore(session, path)       # with or without accumulators in it

  # MonitoredTrainingSession, Estimator: hand it over in a Scaffold.
  scaffold = tf.compat.v1.train.Scaffold(saver=deferred_grad.Saver())
  ```

  It takes the arguments of `tf.compat.v1.train.Saver` and saves exactly
  as it does. On `restore`:

  * a checkpoint with every variable restores as with a plain Saver;
  * a checkpoint without (some of) the wrapper's state, e.g. one written
    before accumulation was turned on: the model and the wrapped optimizer's
    variables are restored, and the wrapper's accumulators and counters are
    initialized (the next micro-step starts a cycle). The wrapped
    optimizer's non-slot variables (Adam's `beta1_power`, ...), which the
    wrapper names `cond/beta1_power` under control flow v1 as the original
    did, are read from their names without the wrapper if need be.

  Build it after the wrapper's train ops, so that it knows their state.
  """

  def build(self):
    super(Saver, self).build()
    self._build_fallbacks()

  def _build_fallbacks(self):
    """Restore-only savers for the model without the wrapper's state."""
    if getattr(self, '_fallbacks', None) is not None:
      return
    graph = tf.compat.v1.get_default_graph()
    all_saveables = self._var_list
    if all_saveables is None:
      all_saveables = tf.compat.v1.global_variables() + graph.get_collection(
          tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS)
    names = saveable_object_util.op_list_to_dict(all_saveables)
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
    """
    if save_path is None:
      return super(Saver, self).restore(sess, save_path)
    self._build_fallbacks()
    keys = {name for name, _ in tf.train.list_variables(save_path)}
    if self._all_names <= keys:
      return super(Saver, self).restore(sess, save_path)
    for var_list, saver in self._fallbacks:
      if set(var_list) <= keys:
        saver.restore(sess, save_path)
        sess.run(self._state_initializer)
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
