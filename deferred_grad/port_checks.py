"""Port checks: what a ported script may still need to change, named.

The wrapper sees what its train op reads, not what a script builds after it
nor where the script stops. At graph build, the wrapped optimizer's update
is searched for a schedule on the raw `global_step`
(`check_schedule_reads`). `PortCheckHook`, added while porting, names at
`begin` what writes on every micro-step after a train op, and at `end` a
run that stopped mid-cycle.
"""

import collections

from deferred_grad import compat
from deferred_grad import cycles
from deferred_grad import registry

tf = compat.import_tensorflow()


# The name scopes of TensorFlow's clipping functions, and the ops a clipped
# gradient may pass through on its way to the wrapper.
_CLIPS = ('clip_by_global_norm', 'clip_by_norm')
_PASSED_THROUGH = ('Identity', 'Cast')


def check_clipped(grads_and_vars):
  """Warns where a gradient handed to the wrapper was clipped already.

  A script's `tf.clip_by_global_norm` (or `clip_by_norm`) before the wrapper
  clips each micro-batch's gradient on its own, where the large batch
  clipped their mean: the wrapper's `clip_norm=` clips the cycle's.

  Args:
    grads_and_vars: the (gradient, variable) pairs given to the wrapper.
  """
  if compat.replica_index():  # once per train op: its first replica
    return
  clipped = []
  for gradient, variable in grads_and_vars:
    op = getattr(gradient, 'values', gradient).op
    for _ in range(4):  # through a cast or an identity or two
      found = [part for part in op.name.split('/')
               if part.startswith(_CLIPS)]
      if found or op.type not in _PASSED_THROUGH or not op.inputs:
        break
      op = op.inputs[0].op
    if found:
      clipped.append((variable.op.name, op.name))
  if clipped:
    tf.compat.v1.logging.warning(
        'GradientAggregationOptimizer: the gradients of %s come out of a clip '
        '(%s): each micro-batch is clipped on its own, where the large batch '
        'clipped their mean. Remove the clip from the script and pass its '
        'norm to the wrapper, clip_norm=..., which clips the cycle\'s '
        'gradient.', ', '.join(name for name, _ in clipped[:3]) + (
            ', ...' if len(clipped) > 3 else ''), clipped[0][1])


def check_schedule_reads(op, record, grad_steps, made):
  """Checks what the wrapped optimizer's update `op` reads as its step.

  Counting micro-steps, a raw `global_step` read gets a warning; counting
  updates, an `applied_updates` read is refused.

  Args:
    op: the op the wrapped optimizer's `apply_gradients` returned.
    record: the train op's `Record`.
    grad_steps: the wrapper's `grad_steps`, for the messages.
    made: the names of the ops its `apply_gradients` made.

  Raises:
    ValueError: counting updates, `op` reads `applied_updates`.
  """
  step = record.global_step
  if step is None:
    return
  known = registry.of(step.graph)
  divided = [t.op.name for t in known.updates_tensors
             if _reads(t.op, {step.op.name}, set(), step.graph)]
  if record.counts_updates:
    found = _reads(op, set(divided), set(), step.graph, made)
    if found is not None:
      raise ValueError(
          'The wrapped optimizer reads deferred_grad.applied_updates(%s, '
          'grad_steps) (%s), which divides global_step by grad_steps; with '
          'global_step_counts=\'updates\' global_step counts the updates '
          'already: give the schedule global_step itself.' %
          (step.op.name, found))
    return
  if step.name in known.warned:
    return
  allowed = set(divided)
  if tf.is_tensor(record.position.updates):
    allowed.add(record.position.updates.op.name)
  found = _reads(op, {step.op.name}, allowed, step.graph, made)
  if found is not None:
    known.warned.add(step.name)
    tf.compat.v1.logging.warning(
        'GradientAggregationOptimizer: the wrapped optimizer reads %s '
        '(through %s), which counts micro-steps: a schedule on it '
        'advances %s times too fast. Pass global_step_counts=\'updates\' '
        'to the wrapper, or give the schedule '
        'deferred_grad.applied_updates(global_step, grad_steps) (or the '
        'wrapper\'s applied_updates()).', step.op.name, found,
        'grad_steps=%d' % grad_steps if isinstance(grad_steps, int)
        else 'grad_steps')


def _reads(op, targets, stops, graph, made=()):
  """Returns the name of the op through which `op` reads an op in `targets`,
  or None. Walks inputs back, not past `stops`: into v2 captures and the
  ops grouped by NoOps that are in `made` (an optimizer's groups of its
  updates, BERT's `tf.group(*assignments)` too), not into a v1 cond's
  predicate.
  """
  seen, pending = set(), [op]
  while pending and len(seen) < 100000:
    current = pending.pop()
    captured = {inside.name: outside for outside, inside in
                getattr(current.graph, 'captures', ())}
    inputs = list(current.inputs)
    if current.type in ('Switch', 'RefSwitch'):
      inputs = inputs[:1]  # not the cond's predicate (the cycle's end)
    if current.type == 'NoOp':  # a group of the optimizer's updates, not
      # the orderings a v1 cond or the wrapper gives every op it makes
      grouped = [c for c in current.control_inputs
                 if c.name in made and (c.graph, c.name) not in seen]
      pending.extend(grouped)
      seen.update((c.graph, c.name) for c in grouped)
    for tensor in inputs:
      tensor = captured.get(tensor.name, tensor)
      if tensor.op.name in targets and tensor.graph is graph:
        return current.name
      if (tensor.graph, tensor.op.name) not in seen and (
          tensor.op.name not in stops):
        seen.add((tensor.graph, tensor.op.name))
        pending.append(tensor.op)
  return None


# The op types that write a variable: assignments, scatters, fused updates.
_WRITES = ('Assign', 'Scatter', 'ResourceScatter', 'Apply', 'ResourceApply',
           'SparseApply', 'ResourceSparseApply')


class PortCheckHook(tf.compat.v1.train.SessionRunHook):
  """Warns of the edits a port may still need that no train op can see.

  The wrapper sees what its train op reads, not what a script builds after
  it nor where the script stops. Add this hook while porting; a correct
  port logs nothing.

  * `begin` names each op ordered after a train op of the wrapper that
    writes a variable on every micro-step: a moving average or projection
    left after the train op (it belongs in `once_per_update`), or the
    script's own `global_step` increment (remove it).
  * `end` names a train op whose run stopped mid-cycle: micro-batches
    accumulated and not applied.

  ```python
  estimator.train(input_fn, max_steps=...,
                  hooks=[deferred_grad.PortCheckHook()])
  ```

  Without a `MonitoredSession` (a `Session` or `Supervisor` loop), call
  `begin()` once the graph is built and `end(session)` after the last run.
  """

  def __init__(self):
    self._places = []

  def begin(self):
    """Warns of writes after a train op; builds the reads `end` runs."""
    graph = tf.compat.v1.get_default_graph()
    built = [record for record in registry.of(graph).records
             if record.op_names]
    # Of train ops built in this graph: one inside a function (XLA's) ends
    # in the function's graph, whose names mean nothing here.
    ends = {name: record.op_names[0] for record in built
            if record.position.in_cycle.graph is graph
            for name in record.op_names}
    # A global_step no train op counts is the script's to count (a canned
    # head increments it after its optimizers, as the original asks of a
    # wrapper given no global_step): not a miss.
    global_step = tf.compat.v1.train.get_global_step(graph)
    uncounted = set(_component_names(global_step))
    for record in built:
      uncounted -= set(_component_names(record.global_step))
    found = collections.OrderedDict()
    for op, train_op in _writes_after(graph, ends):
      if _written(op) not in uncounted:
        found.setdefault(train_op, []).append(op)
    for train_op, ops in found.items():
      written = sorted({_written(op) for op in ops})
      tf.compat.v1.logging.warning(
          'deferred_grad.PortCheckHook: %d op(s) run after the train op %s '
          'and write on every micro-step: %s (%s, ...). If the large batch '
          'ran them once per step (a moving average, a projection), build '
          'them in opt.once_per_update(train_op, fn); if one increments '
          'global_step, remove it: the wrapper counts global_step.',
          len(ops), train_op, ', '.join(written[:5]) + (
              ', ...' if len(written) > 5 else ''), ops[0].name)
    self._places = []
    with tf.compat.v1.name_scope('deferred_grad_port_check'):
      for record in built:
        cycle = record.cycle
        if isinstance(cycle, cycles.Schedule):
          place = (cycle.in_cycle.read_value(), cycle.length.read_value())
        elif cycle.step is not None:
          place = (tf.math.floormod(tf.cast(cycle.step.read_value(),
                                            tf.int64), cycle.grad_steps),
                   tf.constant(cycle.grad_steps, tf.int64))
        else:  # every micro-step is an update
          continue
        self._places.append((record.op_names[0], place))

  def end(self, session):
    """Warns of each train op that stopped mid-cycle."""
    if not self._places:
      return
    values = session.run([place for _, place in self._places])
    for (train_op, _), (in_cycle, length) in zip(self._places, values):
      if in_cycle:
        tf.compat.v1.logging.warning(
            'deferred_grad.PortCheckHook: training stopped mid-cycle: the '
            'train op %s accumulated %d of its %d micro-batches and applied '
            'none of them. A checkpoint saved now resumes them; to end on an '
            'update, stop at a cycle\'s end (a step limit of N * grad_steps, '
            'or global_step_counts=\'updates\').', train_op, in_cycle, length)


def _component_names(variable):
  """The op names of `variable`'s components (a mirrored variable's, one per
  replica); none for None."""
  if variable is None:
    return []
  strategy = getattr(variable, 'distribute_strategy', None)
  strategy = strategy or tf.distribute.get_strategy()
  return [v.op.name for v in strategy.experimental_local_results(variable)]


def _written(op):
  """The name of the variable that the write `op` writes."""
  source = op.inputs[0].op
  while source.type == 'Identity' and source.inputs:
    source = source.inputs[0].op
  return source.name


def _writes_after(graph, ends):
  """Returns [(op, the train op)] for each op of `graph` that writes a
  variable and runs after an op in `ends` ({name: its train op}), by data or
  control, on every run: not in a v1 cond's branch or loop (fed by a Switch,
  as `once_per_update`'s branch is; a v2 cond is one op).
  """
  after, gated = collections.defaultdict(list), set()
  switches = []
  for op in graph.get_operations():
    for before in [t.op for t in op.inputs] + list(op.control_inputs):
      after[before.name].append(op)
    if op.type in ('Switch', 'RefSwitch'):
      switches.append(op)
  while switches:  # what a Switch's outputs feed, up to a Merge
    for tensor in switches.pop().outputs:
      for op in tensor.consumers():
        if op.name not in gated and op.type not in ('Merge', 'RefMerge'):
          gated.add(op.name)
          switches.append(op)
  found, seen = [], set(ends)
  pending = list(ends.items())
  while pending:
    name, train_op = pending.pop()
    for op in after[name]:
      if op.name not in seen:
        seen.add(op.name)
        pending.append((op.name, train_op))
        if (op.type.startswith(_WRITES) and op.inputs and
            op.name not in gated):
          found.append((op, train_op))
  return found
