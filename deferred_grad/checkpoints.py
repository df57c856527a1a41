"""Checkpoint names, and `deferred_grad.Saver`, which resolves them on restore.

The wrapper's own state (accumulators, counters) is recorded in its graph
(`add_to_state`), and the wrapped optimizer's slots and non-slot variables
are created where the original created them (`prepare`,
`create_wrapped_slots`), so that the original's checkpoints restore with a
plain `tf.compat.v1.train.Saver`.

A checkpoint written under other settings may lack some of these names, or
hold them under others:

* accumulation turned on: no accumulators or counters;
* accumulation turned off, or the other graph behaviour: the wrapped
  optimizer's non-slot variables (Adam's `beta1_power`) are named after the
  scope they were made in: the caller's name scope without the wrapper
  (`dnn/head/beta1_power`), the root inside the wrapper's control flow v2
  branch (`beta1_power`), the branch's scope under control flow v1
  (`dnn/head/cond/beta1_power`), as the original named them;
* a partitioned table written by the original: one dense accumulator in
  slices (`<table>/GradientAccumulator`) where this version keeps a list
  of rows per partition (`<table>/part_<n>/GradientAccumulator`).

`Saver` restores each variable from its own name where the checkpoint has
it, else from the first of its other names that it has
(`create_wrapped_slots`, `add_source`), else starts the wrapper's state
afresh; and it writes each renamed variable under its name without the
wrapper too, so that a graph without the wrapper restores its checkpoints
with a plain Saver. The graph's default saver
(`tf.compat.v1.GraphKeys.SAVERS`, which MonitoredTrainingSession and
Estimator use when given none) is one (`prepare`).

The records live in graph collections under tuple keys, as TensorFlow's
variable store does: they are not serialized into meta graphs.
"""

import re

from deferred_grad import compat

tf = compat.import_tensorflow()

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.python.training.saving import saveable_object
from tensorflow.python.training.saving import saveable_object_util
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top

# Graph collections of the records (tuple keys: never serialized).
_STATE = ('deferred_grad', 'state')  # the wrapper's state variables
_ALIASES = ('deferred_grad', 'aliases')  # (variable, bare name, others)
_SOURCES = ('deferred_grad', 'sources')  # (variable, key, slice spec)
_SETTINGS = ('deferred_grad', 'settings')  # `record_settings`' records
_FIXUPS = ('deferred_grad', 'restore_fixups')  # ops run after a restore


def add_to_state(variables):
  """Records `variables` as part of the wrapper's state in their graph.

  The state (accumulators and counters) is what a checkpoint written
  without the wrapper lacks; `Saver` starts it afresh then.

  Args:
    variables: a list of variables of one graph.
  """
  for variable in variables:
    state = variable.graph.get_collection_ref(_STATE)
    if not any(variable is known for known in state):
      state.append(variable)


def add_restore_fixup(op):
  """Records an op that `Saver.restore` runs after every restore.

  For what a checkpoint written under other settings leaves in the wrong
  form (`accumulators.dense_after_restore`): converted once, at restore,
  not checked on every micro-step.

  Args:
    op: the op, or None (nothing to record).
  """
  if op is not None:
    op.graph.add_to_collection(_FIXUPS, op)


def add_source(variable, key, slice_spec):
  """Records that the original's checkpoints hold `variable` as a slice.

  Args:
    variable: a partition's list of rows (`accumulators.list_of_rows`).
    key: the original's key: `<table>/GradientAccumulator` (or `_1`, ...).
    slice_spec: the partition's slice of it, as a Saver writes it.
  """
  variable.graph.add_to_collection(_SOURCES, (variable, key, slice_spec))


def _names(var_list):
  """{save name: variable or slices} of `var_list`, reading nothing."""
  return saveable_object_util.op_list_to_dict(
      list(var_list), convert_variable_to_tensor=False)


def slice_spec(variable):
  """The slice spec under which Savers write a partition (or '' if none)."""
  specs = list(_names([variable]).values())[0]
  if not isinstance(specs, list):  # a partition is a list of slices
    return ''
  return next(saveable_object_util.saveable_objects_for_op(
      specs, variable.op.name)).specs[0].slice_spec


def save_name(variable):
  """The name under which Savers write `variable` (a partition's table's)."""
  return list(_names([variable]))[0]


def _default_saveables(graph):
  """What a `tf.compat.v1.train.Saver` given no var_list saves."""
  return tf.compat.v1.global_variables() + graph.get_collection(
      tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS)


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
  tensor.graph.add_to_collection(_SETTINGS,
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


def prepare(in_cond):
  """Makes a `Saver` the graph's default saver, unless it has one, and
  returns where the wrapped optimizer's non-slot variables go.

  MonitoredTrainingSession (its Scaffold), Estimator and Supervisor save
  with the saver in `tf.compat.v1.GraphKeys.SAVERS`, and make a plain one
  where the collection is empty. This one is made as they would make theirs
  (sharded, relative paths, built when the session is made, the 5 newest
  kept: RunConfig's default). A model_fn is not handed an Estimator's saver
  settings by any public API; one that sets `keep_checkpoint_max` returns
  its own (README "Checkpoints").

  The original called the wrapped `apply_gradients` inside a `tf.cond`, and
  optimizers name their non-slot variables (Adam's `beta1_power`, ...) after
  the current name scope. A control flow v2 branch starts at the root scope;
  a v1 branch is under `<current scope>/cond`, uniquified. Without a
  `tf.cond` (grad_steps=1), the bare optimizer's scope, the caller's. Call
  it before opening the wrapper's name scope.

  Args:
    in_cond: whether the wrapped optimizer applies inside the cycle's
      `tf.cond`, where the original named its non-slot variables.

  Returns:
    (the absolute name scope of the wrapped optimizer's non-slot variables,
    the caller's absolute scope), each '' or ending in '/'.
  """
  with tf.init_scope():  # the graph of the train op
    graph = tf.compat.v1.get_default_graph()
    if not graph.get_collection(tf.compat.v1.GraphKeys.SAVERS):
      graph.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, Saver(
          sharded=True, allow_empty=True, defer_build=True,
          save_relative_paths=True))
  graph = tf.compat.v1.get_default_graph()
  caller = graph.get_name_scope()
  caller = caller + '/' if caller else ''
  if not in_cond:
    return caller, caller
  if tf.compat.v1.control_flow_v2_enabled():
    return '', caller
  return graph.unique_name('cond', mark_as_used=False) + '/', caller


def create_wrapped_slots(opt, var_list, scopes, wrapper):
  """Creates the wrapped optimizer's slots and non-slot variables.

  Records each new non-slot variable's other names, under which a
  checkpoint written without the wrapper or in the other graph behaviour
  holds it (the first, its name without the wrapper, `Saver` also writes
  it under), and restores into it what an object-based checkpoint restore
  of `wrapper` (which shows them as its own) left for it.

  Args:
    opt: the wrapped optimizer.
    var_list: the variables it will update.
    scopes: what `prepare` returned.
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
    name = variable.op.name
    if name.startswith(scope):
      base = name[len(scope):]
      # Without the wrapper; inside its v2 branch; inside its v1 branch.
      bare = caller + base
      names = [n for n in (bare, base, caller + 'cond/' + base) if n != name]
      variable.graph.add_to_collection(_ALIASES, (variable, bare, names))


class _Restore(object):
  """How the fallback restores one saveable: an op fed a source per spec.

  Its `keys` and `slices`, string placeholders, are fed a source per spec
  (two vectors, not one [n, 2] matrix: slicing that would add ops per
  variable to every graph the default saver is built in).

  Args:
    saveable: a `SaveableObject` of the saver's list.
    path: the string placeholder fed the checkpoint's path.
  """

  def __init__(self, saveable, path):
    self.names = [spec.name for spec in saveable.specs]
    self.slices = [spec.slice_spec for spec in saveable.specs]
    self.keys = tf.compat.v1.placeholder(tf.string, [len(self.names)])
    self.slice_specs = tf.compat.v1.placeholder(tf.string, [len(self.names)])
    with tf.device(compat.host_device(saveable.device)):
      tensors = tf.raw_ops.RestoreV2(
          prefix=path, tensor_names=self.keys,
          shape_and_slices=self.slice_specs,
          dtypes=[spec.dtype for spec in saveable.specs])
    with tf.device(saveable.device):
      self.op = saveable.restore(tensors, None)


class Saver(tf.compat.v1.train.Saver):
  """A `tf.compat.v1.train.Saver` that resolves names and settings on restore.

  ```python
  saver = deferred_grad.Saver()      # after the wrapper's train op is built
  saver.restore(session, path)       # written with or without accumulation

  # MonitoredTrainingSession, Estimator: the wrapper makes one the graph's
  # default saver, or hand one over in a Scaffold.
  scaffold = tf.compat.v1.train.Scaffold(saver=deferred_grad.Saver())
  ```

  It takes the arguments of `tf.compat.v1.train.Saver` and saves as it does,
  plus each train op's settings (`<its name scope>/deferred_grad_settings`:
  its int `grad_steps`, whether it is weighted, its `nonfinite_policy` and the
  micro-steps of its cycle so far), and each of the wrapped optimizer's
  non-slot variables also under its name without the wrapper (so that a
  graph without it restores with a plain Saver). On `restore`:

  * a checkpoint with every name restores as with a plain Saver; if it was
    written mid-cycle by this Saver with another `grad_steps`, or with a
    `micro_batch_weight` or `nonfinite_policy` this graph lacks, a
    `ValueError` says so (the partial cycle's sums would be applied
    wrongly);
  * otherwise each variable comes from its own name, or else from another
    name it has under other settings: the wrapped optimizer's non-slot
    variables (Adam's `beta1_power`) from their names without the wrapper
    or in the other graph behaviour; a partitioned table's list of rows
    from the original's dense accumulator. Where any of the wrapper's
    accumulators and counters is missing (accumulation turned on, a
    counter added), they all start afresh: a new cycle (an int cycle
    counted on a restored `global_step` that is not a multiple of
    `grad_steps` would start part-way: a `ValueError`). In a
    graph without the wrapper, a non-trainable variable missing from a
    checkpoint written with it is taken from the one name the wrapper could
    have given it.

  Build it after the wrapper's train ops, so that it knows their state.
  Made with `defer_build=True` (as the wrapper's default saver is), it is
  built when first needed: by `build`, as a Scaffold does, or else when its
  `saver_def` is read or it saves.
  """

  def __init__(self, *args, **kwargs):
    self._built_when_read, self._built_early = False, None
    super(Saver, self).__init__(*args, **kwargs)
    self._graph_made_in = tf.compat.v1.get_default_graph()
    self._built_when_read = self._built_def is None  # defer_build
    self._var_list_given = self._var_list

  # A Supervisor takes the graph's default saver, reads its SaverDef and
  # finalizes the graph, without calling `build` (a Scaffold calls it): the
  # wrapper's default saver, deferred so that it saves the variables made
  # after the train op, is built at that first read, as a plain saver made
  # there would be. An export of the graph's SAVERS collection reads it too,
  # maybe before the model's last variables exist: `build` then builds it
  # again with them.
  @property
  def saver_def(self):
    """The `SaverDef` (see `tf.compat.v1.train.Saver`); builds a deferred
    saver on first read, unless its graph is finalized."""
    self._build_if_deferred()
    return self._built_def

  @saver_def.setter
  def saver_def(self, value):
    self._built_def = value

  def _build_if_deferred(self):
    """Builds a deferred saver not built yet, unless its graph is final,
    and remembers what it saved then (see `build`)."""
    if self._built_when_read and not self._graph_made_in.finalized:
      with self._graph_made_in.as_default():
        self.build()
        self._built_early = set(_names(_default_saveables(self._graph_made_in)))

  def save(self, sess, save_path, *args, **kwargs):
    """As `tf.compat.v1.train.Saver.save`; builds a deferred saver first.

    Args:
      sess, save_path, *args, **kwargs: as `tf.compat.v1.train.Saver.save`.

    Returns:
      The checkpoint's path prefix, or None (as the plain `save`).
    """
    self._build_if_deferred()
    return super(Saver, self).save(sess, save_path, *args, **kwargs)

  def build(self):
    """Builds the save and restore ops (as `tf.compat.v1.train.Saver`'s),
    with the train ops' settings and the wrapped optimizer's variables under
    their names without the wrapper, and (once) the restore ops of each
    other name a variable may have in a checkpoint."""
    self._built_when_read = False  # the base build reads saver_def
    graph = tf.compat.v1.get_default_graph()
    if self._built_early is not None and self._var_list_given is None and (
        set(_names(_default_saveables(graph))) != self._built_early):
      # Built at an early read; the graph has gained variables since.
      # pylint: disable=protected-access,attribute-defined-outside-init
      self._is_built, self._built_def, self._fallback = False, None, None
      self._var_list = None
      # pylint: enable=protected-access,attribute-defined-outside-init
    self._built_early = None
    self._settings = list(graph.get_collection(_SETTINGS))
    self._fixups = list(graph.get_collection(_FIXUPS))
    restored = (_default_saveables(graph) if self._var_list is None else
                self._var_list)
    extras = []  # none for a dict of names: saved and restored as given
    if isinstance(restored, (list, tuple)):
      taken = set(_names(restored))
      extras = [_SavedTensor(tensor, key)
                for key, tensor, _, _ in self._settings]
      for variable, bare, _ in graph.get_collection(_ALIASES):
        if bare not in taken:  # its name without the wrapper
          taken.add(bare)
          extras.append(_SavedTensor(variable.read_value(), bare))
      self._var_list = list(restored) + extras
    self._extra_names = set(extra.name for extra in extras)
    super(Saver, self).build()
    if getattr(self, '_fallback', None) is not None:
      return
    # The restore ops fed their sources, for checkpoints lacking some names.
    if not isinstance(restored, dict):
      restored = saveable_object_util.op_list_to_dict(list(restored))
    self._path = tf.compat.v1.placeholder(tf.string, [])
    self._fallback = [
        _Restore(saveable, self._path) for saveable in
        saveable_object_util.validate_and_slice_inputs(restored)]
    self._initializers = {}  # {save name of a state variable: initializers}
    for variable in graph.get_collection(_STATE):
      self._initializers.setdefault(save_name(variable), []).append(
          variable.initializer)
    self._aliases = {save_name(variable): [(name, '') for name in names]
                     for variable, _, names in graph.get_collection(_ALIASES)}
    for variable, key, spec in graph.get_collection(_SOURCES):
      self._aliases.setdefault(save_name(variable), []).append((key, spec))
    self._trainable = set(_names(tf.compat.v1.trainable_variables()))

  def _sources(self, restore, keys):
    """[(key, slice spec)] per spec of `restore`, or None where missing."""
    if all(name in keys for name in restore.names):
      return list(zip(restore.names, restore.slices))
    if len(restore.names) != 1:
      return None
    name, = restore.names
    for key, spec in self._aliases.get(name, ()):
      if key in keys:
        return [(key, spec)]
    if (name in self._trainable or name in self._initializers or
        restore.slices[0]):
      return None
    # Without the wrapper: a non-slot variable of the optimizer it wrapped
    # (`create_wrapped_slots`), named at the root or in its v1 branch.
    scope, _, base = name.rpartition('/')
    pattern = re.compile('^(%s)?(cond(_[0-9]+)?/)?%s$' % (
        re.escape(scope + '/') if scope else '', re.escape(base)))
    found = [key for key in keys if pattern.match(key) and key != name]
    return [(found[0], '')] if len(found) == 1 else None

  def restore(self, sess, save_path):
    """Restores from `save_path`, resolving names (see the class).

    Args:
      sess: the session.
      save_path: the checkpoint's path prefix.

    Returns:
      None (as `tf.compat.v1.train.Saver.restore`).

    Raises:
      tf.errors.NotFoundError: the checkpoint lacks a variable that is not
        the wrapper's state, under every name it could have.
      ValueError: `save_path` is not a checkpoint (as with a plain Saver);
        or it was written mid-cycle under other settings (see the class).
    """
    if save_path is None:
      return super(Saver, self).restore(sess, save_path)
    if getattr(self, '_fallback', None) is None:
      self.build()
    try:
      keys = {name for name, _ in tf.train.list_variables(save_path)}
    except tf.errors.NotFoundError:
      # As a plain Saver says it (code that restores or else initializes
      # catches this ValueError).
      raise ValueError('The passed save_path is not a valid checkpoint: %s'
                       % (save_path,))
    wanted = set(n for restore in self._fallback for n in restore.names)
    if wanted | self._extra_names <= keys:
      super(Saver, self).restore(sess, save_path)
      self._check_settings(sess, save_path, keys, afresh=False)
      return None
    chosen = [(restore, self._sources(restore, keys))
              for restore in self._fallback]
    state = lambda restore: all(n in self._initializers for n in restore.names)
    # Partial sums mean nothing without all of their counters: where any
    # of the wrapper's state is missing, all of it starts afresh.
    afresh = [name for restore, sources in chosen if sources is None and
              state(restore) for name in restore.names]
    ops, feed, missing = [], {self._path: save_path}, []
    for restore, sources in chosen:
      if afresh and state(restore):
        ops.extend(self._initializers[restore.names[0]])
      elif sources is not None:
        ops.append(restore.op)
        feed[restore.keys], feed[restore.slice_specs] = zip(*sources)
      else:
        missing.extend(restore.names)
    if missing:
      raise tf.errors.NotFoundError(
          None, None, 'deferred_grad.Saver: checkpoint %s lacks %s under '
          'every name they could have (only the wrapper\'s own state may be '
          'missing).' % (save_path, sorted(missing)))
    sess.run(ops, feed)
    self._check_settings(sess, save_path, keys, afresh=bool(afresh))
    if afresh:
      tf.compat.v1.logging.info(
          'deferred_grad.Saver: %s has no (complete) accumulator state; '
          'restored the model and started the wrapper\'s state afresh '
          '(missing: %s).', save_path, ', '.join(sorted(afresh)))
    return None

  def _check_settings(self, sess, save_path, keys, afresh):
    """Converts what the restore left in another form, then raises if the
    restored state would apply a cycle wrongly.

    Args:
      sess: the session.
      save_path: the checkpoint restored.
      keys: the names in it.
      afresh: whether the wrapper's state was started afresh.

    Raises:
      ValueError: a train op's checkpoint is mid-cycle, and its grad_steps
        differs, or its weights or policy are gone; or the restored
        `global_step` places a train op mid-cycle without its partial sums.
    """
    if self._fixups:
      sess.run(self._fixups)
    records = self._settings
    now = sess.run([tensor for _, tensor, _, _ in records]) if records else []
    for (key, _, values, policies), current in zip(records, now):
      saved = None if key not in keys or afresh else [
          int(v) for v in tf.train.load_variable(save_path, key)]
      for index in range(3 if saved and saved[3] else 0):
        # Weights or a policy added: their counts are not in the checkpoint,
        # and the Saver has started the cycle afresh. A schedule's cycle
        # keeps the length it began with: its grad_steps may change at any
        # step.
        if saved[index] != values[index] and (index == 0 or not values[index]):
          # The partial cycle's sums would be applied wrongly.
          raise ValueError(
              'deferred_grad.Saver: checkpoint %s was written at micro-step %d '
              'of a cycle with %s; this graph\'s train op has %s. Restore it '
              'with its settings and change them after an apply step%s.' % (
                  save_path, saved[3], _describe(index, saved[index], policies),
                  _describe(index, values[index], policies),
                  '' if index else '; to change grad_steps at any step, '
                  'give it as a tensor (tf.constant(n))'))
      place = int(current[3])
      if place and (afresh or (saved and saved[0] != values[0])):
        # An int cycle counted on global_step: no counter to start afresh
        # (a schedule counts its cycle in counters of its own); it would
        # apply fewer micro-batches than grad_steps, divided by grad_steps.
        # A tensor grad_steps (a schedule) starts its counters afresh.
        raise ValueError(
            'deferred_grad.Saver: after restoring %s, global_step places a '
            'train op with grad_steps=%d at micro-step %d of its cycle, '
            'without its partial sums (%s). Restore one whose global_step is a '
            'multiple of %d, or give grad_steps as tf.constant(%d).' % (
                save_path, values[0], place,
                'it has no accumulators' if afresh else
                'it was written with %s' % _describe(0, saved[0], policies),
                values[0], values[0]))
