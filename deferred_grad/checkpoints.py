"""Checkpoints written without the wrapper: `deferred_grad.Saver`.

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

from deferred_grad import compat
from deferred_grad import variables

tf = compat.import_tensorflow()

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.training.saving import saveable_object_util
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top


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
    for variable in variables.state_variables(graph):
      for name in saveable_object_util.op_list_to_dict([variable]):
        if name in names:
          state[name] = variable
    state_names = set(state)
    renamed = variables.renamed_variables(graph)
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
