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
  if step.name in known.warned or grad_steps == 1:
    return  # (with grad_steps=1, each micro-step is an update)
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

  The wrapper sees what its train op reads, not what a script builds around
  it nor where the script stops. Add this hook while porting; a correct
  port that counts updates (`global_step_counts='updates'`) logs nothing.

  * `begin` names each op that writes a variable on every micro-step and is
    ordered after a train op of the wrapper: a moving average or projection
    left after the train op (it belongs in `once_per_update`), or the
    script's own `global_step` increment (remove it). It also names a
    moving average of the wrapped variables run with the train op some other
    way: grouped beside it, or among its inputs (TF-Slim's `UPDATE_OPS`).
    Batch norm's moving statistics stay per micro-step, and unnamed.
  * `end` names a train op whose run stopped mid-cycle (micro-batches
    accumulated and not applied), and, where `global_step` counts
    micro-steps, what was trained: the updates applied in how many
    micro-steps (a step limit in the large batch's steps shows as K times
    fewer updates).

  ```python
  estimator.train(input_fn, max_steps=...,
                  hooks=[deferred_grad.PortCheckHook()])
  ```

  Without a `MonitoredSession` (a `Session` or `Supervisor` loop), call
  `begin()` once the graph is built and `end(session)` after the last run.
  """

  def __init__(self):
    self._places = []
    self._counted = []

  def begin(self):
    """Warns of writes run with a train op; builds the reads `end` runs."""
    graph = tf.compat.v1.get_default_graph()
    built = [record for record in registry.of(graph).records
             if record.op_names]
    # Of train ops built in this graph: one inside a function (XLA's) ends
    # in the function's graph, whose names mean nothing here.
    here = [record for record in built
            if record.position.in_cycle.graph is graph]
    ends = {name: record.op_names[0] for record in here
            for name in record.op_names}
    after, beside = _writes_with(graph, ends)
    # A global_step no train op counts is the script's to count (a canned
    # head increments it after its optimizers, as the original asks of a
    # wrapper given no global_step): not a miss.
    global_step = tf.compat.v1.train.get_global_step(graph)
    uncounted = set(_component_names(global_step))
    for record in built:
      uncounted -= set(_component_names(record.global_step))
    found = collections.OrderedDict()
    for op, train_op in after:
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
          len(ops), train_op, _listed(written), ops[0].name)
    averages = collections.OrderedDict()
    trained = {record.op_names[0]: record.variable_names for record in here}
    for op, train_op in beside:
      if (_is_moving_average(op) and
          _written(op).rpartition('/')[0] in trained[train_op]):
        averages.setdefault(train_op, []).append(_written(op))
    for train_op, written in averages.items():
      tf.compat.v1.logging.warning(
          'deferred_grad.PortCheckHook: a moving average of the variables '
          'the train op %s trains runs with it on every micro-step, grouped '
          'beside it or among its inputs (UPDATE_OPS): %s. The large batch '
          'ran it once per step: build it in opt.once_per_update(train_op, '
          'fn) instead.', train_op, _listed(sorted(set(written))))
    self._places = cycle_counters(built)
    self._counted = []
    with tf.compat.v1.name_scope('deferred_grad_port_check'):
      for record in built:
        if (_cycle_counters(record.cycle) and
            record.global_step is not None and not record.counts_updates):
          self._counted.append((record.op_names[0], (
              record.global_step.read_value(), _updates(record.cycle,
                                                        record.global_step))))

  def end(self, session):
    """Warns of each train op that stopped mid-cycle; says what was trained
    where `global_step` counts micro-steps."""
    if not self._places:
      return
    places, counted = session.run([[c for _, _, c in self._places],
                                   [count for _, count in self._counted]])
    for (train_op, cycle, _), values in zip(self._places, places):
      warn_if_mid_cycle(train_op, cycle, values, _STOP_AT_A_CYCLE_S_END)
    for (train_op, _), (micro_steps, updates) in zip(self._counted, counted):
      # What was trained, not a miss: a line of its own kind.
      tf.compat.v1.logging.warning(
          'deferred_grad: trained %d updates in %d micro-steps (the train op '
          '%s); global_step counts micro-steps (%d). A step limit or schedule '
          'in the large batch\'s steps gives grad_steps times fewer updates '
          'here: pass global_step_counts=\'updates\' to the wrapper (or '
          'multiply the limits by grad_steps).',
          updates, micro_steps, train_op, micro_steps)


_STOP_AT_A_CYCLE_S_END = (
    'to end on an update, stop at a cycle\'s end (a step limit of N * '
    'grad_steps, or global_step_counts=\'updates\')')


def cycle_counters(records):
  """[(train op name, cycle, its counter variables)] of the records whose
  cycles span several micro-steps, for `warn_if_mid_cycle`."""
  return [(record.op_names[0], record.cycle, _cycle_counters(record.cycle))
          for record in records
          if record.op_names and _cycle_counters(record.cycle)]


def warn_if_mid_cycle(train_op, cycle, values, fix):
  """Warns if the counters' `values` place a train op mid-cycle.

  Args:
    train_op: the train op's name.
    cycle: its `cycles.StepCycle` or `cycles.Schedule`.
    values: its counters' values (`cycle_counters`), after the last run.
    fix: what to do, for the message.
  """
  if isinstance(cycle, cycles.Schedule):
    in_cycle, length = int(values[0]), int(values[1])
  else:
    in_cycle, length = int(values[0]) % cycle.grad_steps, cycle.grad_steps
  if in_cycle:
    tf.compat.v1.logging.warning(
        'deferred_grad.PortCheckHook: training stopped mid-cycle: the train '
        'op %s accumulated %d of its %d micro-batches and applied none of '
        'them. A checkpoint saved now resumes them; %s.', train_op, in_cycle,
        length, fix)


def _cycle_counters(cycle):
  """The variables a cycle's place is read from (none without cycles)."""
  if isinstance(cycle, cycles.Schedule):
    return [cycle.in_cycle, cycle.length]
  return [] if cycle.step is None else [cycle.step]


def _updates(cycle, global_step):
  """The updates applied, read, where `global_step` counts micro-steps."""
  if isinstance(cycle, cycles.Schedule):
    return cycle.updates.read_value()
  return tf.math.floordiv(tf.cast(global_step.read_value(), tf.int64),
                          cycle.grad_steps)


def _listed(names):
  """The first five of `names`, joined for a message."""
  return ', '.join(names[:5]) + (', ...' if len(names) > 5 else '')


def _is_moving_average(op):
  """Whether the write `op` is an `assign_moving_average`'s (what
  `ExponentialMovingAverage.apply` makes)."""
  return any(part.startswith('AssignMovingAvg')
             for part in op.name.split('/'))


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


def _writes_with(graph, ends):
  """Finds the writes that run whenever a train op runs.

  Args:
    graph: the graph.
    ends: {the name of an op that ends a train op's run: its train op}.

  Returns:
    ([(op, train op)] of the ops that write a variable and run after an op
    in `ends`, by data or control; [(op, train op)] of those that run in
    the same run some other way: an input of the train op (TF-Slim's
    UPDATE_OPS), or grouped beside it with what runs after it). Only ops on
    every run: not in a v1 cond's branch or loop (fed by a Switch, as
    `once_per_update`'s branch is; a v2 cond is one op).
  """
  after, gated = collections.defaultdict(list), set()
  switches = []
  for op in graph.get_operations():
    for before in _inputs(op):
      after[before.name].append(op)
    if op.type in ('Switch', 'RefSwitch'):
      switches.append(op)
  while switches:  # what a Switch's outputs feed, up to a Merge
    for tensor in switches.pop().outputs:
      for op in tensor.consumers():
        if op.name not in gated and op.type not in ('Merge', 'RefMerge'):
          gated.add(op.name)
          switches.append(op)
  writes = lambda op: (op.type.startswith(_WRITES) and op.inputs and
                       op.name not in gated)
  later, seen = [], dict(ends)
  pending = list(ends.items())
  while pending:  # forward: what runs after the train op
    name, train_op = pending.pop()
    for op in after[name]:
      if op.name not in seen:
        seen[op.name] = train_op
        pending.append((op.name, train_op))
        later.append((op, train_op))
  by_name = {op.name: op for op in graph.get_operations()}
  beside, known = [], set(seen)
  pending = [(by_name[name], train_op) for name, train_op in seen.items()
             if name in by_name]
  while pending:  # backward: what those need, in the same run
    op, train_op = pending.pop()
    for before in _inputs(op):
      if before.name not in known and before.name not in gated:
        known.add(before.name)
        pending.append((before, train_op))
        beside.append((before, train_op))
  return ([(op, t) for op, t in later if writes(op)],
          [(op, t) for op, t in beside if writes(op)])


def _inputs(op):
  """The ops `op` waits for: its inputs' and its control inputs."""
  return [t.op for t in op.inputs] + list(op.control_inputs)
