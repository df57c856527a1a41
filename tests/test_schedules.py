"""grad_steps schedules: a tensor or a callable, read once per cycle.

The contract: with cycle lengths K_1, K_2, ... the wrapper trains exactly as
the bare optimizer on large batches of K_1, K_2, ... micro-batches (their
mean; their sum with aggregation='sum'; their weighted mean with
micro_batch_weight), whichever value the schedule gives in the middle of a
cycle, also across a checkpoint written mid-cycle and restored under
another schedule. An int keeps the original's graph and checkpoint names.
"""

import numpy as np
import pytest
import tensorflow as tf

import behavior
import deferred_grad
import models
import training

LENGTHS = [2, 2, 4, 4, 8]  # a batch doubling twice
MICRO_BATCH = models.MICRO_BATCH
OPTIMIZERS = {name: models.OPTIMIZERS[name]
              for name in ('GradientDescent', 'Momentum', 'Adam')}


def lengths_of_updates(lengths):
  """A callable schedule: the length of cycle `updates`, then the last."""
  def schedule(updates):
    table = tf.constant(lengths, tf.int64)
    return tf.gather(table, tf.minimum(updates, len(lengths) - 1))
  return schedule


def _data(model, lengths, seed=0, rows=MICRO_BATCH):
  make_data = models.MODELS[model][0]
  return [part[0] for part in make_data(1, sum(lengths) * rows, seed)]


def _cycles(data, lengths, rows=MICRO_BATCH):
  """[(cycle's micro-batches: a list of input lists)] of `lengths`."""
  cycles, start = [], 0
  for length in lengths:
    cycles.append([[part[(start + k) * rows:(start + k + 1) * rows]
                    for part in data] for k in range(length)])
    start += length
  return cycles


def large_batches(make_optimizer, model, data, lengths, rows=MICRO_BATCH,
                  **trainer_kwargs):
  """The bare optimizer, one step per cycle on its micro-batches joined."""
  trainer = training.Trainer(make_optimizer, model=model, **trainer_kwargs)
  snapshots = []
  with trainer.session() as session:
    for cycle in _cycles(data, lengths, rows):
      trainer.micro_step(session, *[np.concatenate(parts)
                                    for parts in zip(*cycle)])
      snapshots.append(session.run(trainer.variables))
  return snapshots


class Scheduled(object):
  """A model trained through the wrapper with a `grad_steps` schedule.

  Args:
    make_optimizer: factory of the wrapped optimizer (see models.OPTIMIZERS).
    kind: 'tensor' (a placeholder the test feeds) or 'callable' (of the
      updates applied, giving LENGTHS).
    model: a key of models.MODELS.
    lengths: the callable's cycle lengths.
    created: None, or a list the wrapper is appended to before the train
      op is built (for a learning rate that reads it).
    weighted: give the wrapper a `micro_batch_weight` the test feeds.
    **wrapper_kwargs: passed to the wrapper.
  """

  def __init__(self, make_optimizer, kind, model='mlp', lengths=LENGTHS,
               created=None, weighted=False, **wrapper_kwargs):
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      _, specs, loss_fn = models.MODELS[model]
      self.inputs = [tf.compat.v1.placeholder(dtype, shape)
                     for dtype, shape in specs]
      loss, self.variables = loss_fn(*self.inputs)
      self.length = tf.compat.v1.placeholder(tf.int32, [])
      self.weight = tf.compat.v1.placeholder_with_default(1.0, [])
      if weighted:
        wrapper_kwargs['micro_batch_weight'] = self.weight
      grad_steps = (self.length if kind == 'tensor' else
                    lengths_of_updates(lengths))
      self.optimizer = deferred_grad.GradientAggregationOptimizer(
          make_optimizer(None), grad_steps, **wrapper_kwargs)
      if created is not None:
        created.append(self.optimizer)
      self.train_op = self.optimizer.minimize(loss,
                                              global_step=self.global_step)
      self.applies = self.optimizer.applies_update()
      self.in_cycle = self.optimizer.micro_step_in_cycle()
      self.updates = self.optimizer.applied_updates()
      self.saver = tf.compat.v1.train.Saver()
      self.init_op = tf.compat.v1.global_variables_initializer()

  def session(self):
    session = tf.compat.v1.Session(graph=self.graph)
    session.run(self.init_op)
    return session

  def micro_step(self, session, inputs, length=0, weight=1.0):
    """Runs one micro-step; returns (applies_update, in cycle, updates)."""
    feed = dict(zip(self.inputs, inputs))
    feed[self.length] = length
    feed[self.weight] = weight
    return session.run([self.train_op, self.applies, self.in_cycle,
                        self.updates], feed)[1:]

  def run(self, session, cycles, lengths=None, mid_cycle=None, done=0,
          weights=None):
    """Runs `cycles`; feeds each cycle's length on its first micro-step.

    Args:
      session: the session.
      cycles: see `_cycles`.
      lengths: the lengths fed (a tensor schedule), one per cycle.
      mid_cycle: None, or the value fed on the other micro-steps (which
        must not matter).
      done: the updates applied before these cycles.
      weights: None, or each micro-step's weight, in order.

    Returns:
      The weights after each cycle.
    """
    snapshots = []
    weights = iter(weights or [])
    for c, cycle in enumerate(cycles):
      for k, inputs in enumerate(cycle):
        fed = (lengths or [0] * len(cycles))[c]
        if k and mid_cycle is not None:
          fed = mid_cycle
        applies, in_cycle, updates = self.micro_step(
            session, inputs, fed, next(weights, 1.0))
        assert (applies, in_cycle, updates) == (
            k == len(cycle) - 1, k, done + c), (c, k)
      snapshots.append(session.run(self.variables))
    return snapshots


@pytest.mark.parametrize('model', ['mlp', 'embedding'])
@pytest.mark.parametrize('optimizer, kind', [
    ('GradientDescent', 'tensor'), ('Momentum', 'callable'),
    ('Adam', 'callable'), ('Adam', 'tensor')])
def test_a_schedule_trains_like_large_batches_of_its_lengths(
    optimizer, kind, model, use_tpu):
  data = _data(model, LENGTHS)
  expected = large_batches(OPTIMIZERS[optimizer], model, data, LENGTHS)
  trainer = Scheduled(OPTIMIZERS[optimizer], kind, model, use_tpu=use_tpu)
  with trainer.session() as session:
    actual = trainer.run(session, _cycles(data, LENGTHS), LENGTHS)
    assert session.run(trainer.global_step) == sum(LENGTHS)
  training.assert_same_training(actual, expected)


def _by_hand(data, lengths, weights, aggregation, policy, clip_norm):
  """SGD(0.1) on the linear model, cycle by cycle, in float64 numpy."""
  w = models.LINEAR_INITIAL.astype(np.float64)
  snapshots, weights = [], iter(weights)
  for cycle in _cycles(data, lengths):
    pairs = [(models.linear_gradient(w, *inputs), next(weights))
             for inputs in cycle]
    finite = [(g, v) for g, v in pairs if np.all(np.isfinite(g))]
    if policy == 'skip_cycle' and len(finite) < len(pairs):
      finite = []
    if finite:
      total = sum(v * g for g, v in finite)
      if aggregation == 'mean':
        total = total / sum(v for _, v in finite)
      if clip_norm is not None:
        total = total * min(1.0, clip_norm / np.linalg.norm(total))
      w = w - 0.1 * total
    snapshots.append({'w': w})
  return snapshots


# Every pair of values of the four keywords in some case (a covering array).
KEYWORD_CASES = [
    ('mean', False, None, None), ('mean', True, 'skip_micro_batch', 0.5),
    ('mean', False, 'skip_cycle', 0.5), ('sum', True, None, 0.5),
    ('sum', False, 'skip_micro_batch', None), ('sum', True, 'skip_cycle', None),
]


@pytest.mark.parametrize('aggregation, weighted, policy, clip_norm',
                         KEYWORD_CASES)
def test_keywords_under_a_schedule(aggregation, weighted, policy, clip_norm,
                                   use_tpu):
  """Weights, a policy (a NaN micro-batch in the fourth cycle, of 4),
  clipping and 'sum' each act on the schedule's cycles as on an int's;
  every pair of their values is tried."""
  lengths = [2, 3, 1, 4]
  data = _data('linear', lengths)
  if policy:
    data[2][(2 + 3 + 1 + 2) * MICRO_BATCH] = np.nan  # its third micro-batch
  weights = ([3.0, 1.0, 2.0, 5.0, 1.0, 4.0, 2.0, 2.0, 1.0, 3.0] if weighted
             else [1.0] * sum(lengths))
  expected = _by_hand(data, lengths, weights, aggregation, policy, clip_norm)
  trainer = Scheduled(models.sgd, 'callable', 'linear', lengths=lengths,
                      weighted=weighted, use_tpu=use_tpu,
                      aggregation=aggregation, nonfinite_policy=policy,
                      clip_norm=clip_norm)
  with trainer.session() as session:
    actual = trainer.run(session, _cycles(data, lengths), weights=weights)
    if policy:
      skipped = session.run([trainer.optimizer.skipped_micro_batches,
                             trainer.optimizer.skipped_cycles])
      assert skipped == [1, 1 if policy == 'skip_cycle' else 0]
  training.assert_same_training(actual, expected)


@pytest.mark.parametrize('model', ['mlp', 'embedding'])
@pytest.mark.parametrize('optimizer', ['Momentum', 'Adam'])
def test_a_schedule_under_mirrored_strategy(optimizer, model):
  """Two replicas, each half of every micro-batch, cycles of LENGTHS."""
  rows = training.REPLICAS * MICRO_BATCH
  data = _data(model, LENGTHS, rows=rows)
  expected = large_batches(OPTIMIZERS[optimizer], model, data, LENGTHS, rows)
  trainer = training.MirroredTrainer(
      OPTIMIZERS[optimizer], lengths_of_updates(LENGTHS), model=model)
  actual = []
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    for cycle in _cycles(data, LENGTHS, rows):
      for inputs in cycle:
        trainer.micro_step(session, *inputs)
      actual.append(session.run(trainer.variables))
    assert session.run(trainer.global_step) == sum(LENGTHS)
  training.assert_same_training(actual, expected)


def test_a_value_changed_mid_cycle_takes_effect_at_the_next_cycle(use_tpu):
  data = _data('mlp', LENGTHS)
  expected = large_batches(models.sgd, 'mlp', data, LENGTHS)
  trainer = Scheduled(models.sgd, 'tensor', use_tpu=use_tpu)
  with trainer.session() as session:
    # Every micro-step but a cycle's first is fed another length: 1 would
    # end the cycle at once, 7 would lengthen it.
    for mid_cycle in (1, 7):
      session.run(trainer.init_op)
      actual = trainer.run(session, _cycles(data, LENGTHS), LENGTHS,
                           mid_cycle=mid_cycle)
      training.assert_same_training(actual, expected)


@pytest.mark.parametrize('model', ['mlp', 'embedding'])
def test_stop_and_resume_mid_cycle_across_a_change_of_grad_steps(
    tmp_path, model, use_tpu):
  """A cycle begun with length 4 ends with length 4 after the restore,
  although the schedule now says 2; the next cycles follow the new one."""
  before, after = [4, 4, 4], [2, 2]
  lengths = before + after
  data = _data(model, lengths)
  expected = large_batches(models.OPTIMIZERS['Adam'], model, data, lengths)
  cycles = _cycles(data, lengths)
  path = str(tmp_path / 'mid_cycle')
  first = Scheduled(models.OPTIMIZERS['Adam'], 'callable', model,
                    lengths=before, use_tpu=use_tpu)
  with first.session() as session:
    actual = first.run(session, cycles[:2])
    for inputs in cycles[2][:1]:  # one micro-step into the third cycle
      first.micro_step(session, inputs)
    first.saver.save(session, path)
  second = Scheduled(models.OPTIMIZERS['Adam'], 'callable', model,
                     lengths=[2], use_tpu=use_tpu)
  with tf.compat.v1.Session(graph=second.graph) as session:
    second.saver.restore(session, path)
    for k, inputs in enumerate(cycles[2][1:]):
      applies, in_cycle, updates = second.micro_step(session, inputs)
      assert (applies, in_cycle, updates) == (k == 2, k + 1, 2)
    actual.append(session.run(second.variables))
    actual += second.run(session, cycles[3:], done=3)
  training.assert_same_training(actual, expected)


def test_an_int_keeps_the_originals_variables():
  """With an int the graph has the original's variables, no schedule's."""
  def names(grad_steps, use_tpu):
    graph = tf.Graph()
    with graph.as_default():
      if grad_steps == 'tensor':
        grad_steps = tf.constant(4)
      x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
      y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
      loss, _ = models.model_loss(x, y)
      deferred_grad.GradientAggregationOptimizer(
          models.sgd(), grad_steps, use_tpu=use_tpu).minimize(
              loss, tf.compat.v1.train.get_or_create_global_step())
      return sorted(v.op.name for v in tf.compat.v1.global_variables())

  weights = ['b1', 'b2', 'w1', 'w2']
  # The settings: every saver saves them (test_checkpoint_saver.py).
  accumulators = [w + '/GradientAccumulator' for w in weights] + [
      'GradientAggregationOptimizer/deferred_grad_settings']
  assert names(4, False) == sorted(weights + accumulators + ['global_step'])
  assert names(4, True) == sorted(weights + accumulators +
                                  ['global_step', 'update_count'])
  assert names('tensor', True) == sorted(
      weights + accumulators +
      ['global_step', 'micro_step', 'cycle_length', 'applied_updates'])


def test_applied_updates_drives_a_learning_rate_schedule(use_tpu):
  """A callable learning rate of `opt.applied_updates()` = the bare
  optimizer's of its global step, cycle by cycle."""
  data = _data('mlp', LENGTHS)

  def bare(step):
    rate = tf.compat.v1.train.exponential_decay(0.1, step, 1, 0.5)
    return tf.compat.v1.train.MomentumOptimizer(rate, 0.9)

  expected = large_batches(bare, 'mlp', data, LENGTHS,
                           step_tensor='global_step')
  created = []  # the wrapper, which the learning rate reads

  def wrapped(step):
    del step
    return tf.compat.v1.train.MomentumOptimizer(
        lambda: tf.compat.v1.train.exponential_decay(
            0.1, created[0].applied_updates(), 1, 0.5), 0.9)

  trainer = Scheduled(wrapped, 'callable', use_tpu=use_tpu, created=created)
  with trainer.session() as session:
    actual = trainer.run(session, _cycles(data, LENGTHS))
  training.assert_same_training(actual, expected)


def test_applied_updates_with_an_int_needs_a_global_step():
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
    loss, _ = models.model_loss(x, y)
    opt = deferred_grad.GradientAggregationOptimizer(models.sgd(), 3)
    with pytest.raises(ValueError, match='No train op'):
      opt.applied_updates()
    opt.minimize(loss)
    with pytest.raises(ValueError, match='global_step'):
      opt.applied_updates()
    step = tf.compat.v1.train.get_or_create_global_step()
    opt.minimize(loss, global_step=step)
    updates = opt.applied_updates()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(step.assign(7))
      assert session.run(updates) == 2


@pytest.mark.skipif(behavior.BEHAVIOR != 'v2',
                    reason='XLA compiles resource variables only (see '
                    'test_xla.py)')
@pytest.mark.parametrize('kwargs', [{}, {'xla_num_partitions': 2}],
                         ids=['dense', 'sharded'])
@pytest.mark.parametrize('model', ['mlp', 'embedding'])
def test_a_schedule_compiled_by_xla(model, kwargs, use_tpu):
  """Every micro-step one XLA computation, as on a TPU."""
  import test_xla  # pylint: disable=g-import-not-at-top
  data = _data(model, LENGTHS)
  expected = large_batches(models.OPTIMIZERS['Adam'], model, data, LENGTHS)
  actual = test_xla._train_compiled(  # pylint: disable=protected-access
      models.OPTIMIZERS['Adam'], None, model, lengths_of_updates(LENGTHS),
      _cycles(data, LENGTHS), use_tpu=use_tpu, **kwargs)
  training.assert_same_training(actual, expected)


def test_an_int_checkpoint_mid_cycle_starts_a_schedule_afresh(tmp_path):
  """From an int's checkpoint (no schedule counters) deferred_grad.Saver
  restores the model and Adam's slots and starts the wrapper's state
  afresh: the partial cycle is dropped, never mixed into the first update."""
  lengths = [4, 4, 4, 4]
  data = _data('mlp', lengths + [2])
  cycles = _cycles(data, lengths + [2])
  path = str(tmp_path / 'int')
  trainer = training.Trainer(models.OPTIMIZERS['Adam'], grad_steps=4,
                             step_tensor=None)
  with trainer.session() as session:
    for cycle in cycles[:2]:
      for inputs in cycle:
        trainer.micro_step(session, *inputs)
    for inputs in cycles[2][:2]:  # half of the third cycle
      trainer.micro_step(session, *inputs)
    with trainer.graph.as_default():
      tf.compat.v1.train.Saver().save(session, path)
  first = Scheduled(models.OPTIMIZERS['Adam'], 'callable', lengths=[4])
  with first.graph.as_default():
    saver = deferred_grad.Saver()
  with tf.compat.v1.Session(graph=first.graph) as session:
    saver.restore(session, path)
    # Cycles of 4 start at the restore: the third cycle's second half and
    # the fourth cycle's first half make one.
    rest = cycles[2][2:] + cycles[3][:2]
    actual = first.run(session, [rest])
  # The bare optimizer: cycles 1 and 2, then the cycle after the restore.
  joined = [np.concatenate(parts) for parts in zip(*rest)]
  bare = training.Trainer(models.OPTIMIZERS['Adam'])
  with bare.session() as session:
    for cycle in cycles[:2]:
      bare.micro_step(session, *[np.concatenate(parts)
                                 for parts in zip(*cycle)])
    bare.micro_step(session, *joined)
    expected = [session.run(bare.variables)]
  training.assert_same_training(actual, expected)


def test_a_variable_the_script_assigns_takes_effect_at_the_next_cycle(
    use_tpu):
  """grad_steps a tf.Variable: set to 3 one micro-step into the second
  cycle (of 2), that cycle keeps 2 and the next ones take 3."""
  lengths = [2, 2, 3, 3]
  data = _data('mlp', lengths)
  expected = large_batches(models.OPTIMIZERS['Momentum'], 'mlp', data,
                           lengths)
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, models.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, models.OUTPUT_DIM])
    loss, variables = models.model_loss(x, y)
    grad_steps = tf.compat.v1.Variable(2, dtype=tf.int64, trainable=False)
    opt = deferred_grad.GradientAggregationOptimizer(
        models.OPTIMIZERS['Momentum'](None), grad_steps, use_tpu=use_tpu)
    train_op = opt.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    applies = opt.applies_update()
    actual = []
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for c, cycle in enumerate(_cycles(data, lengths)):
        for k, (x_value, y_value) in enumerate(cycle):
          if (c, k) == (1, 1):
            session.run(grad_steps.assign(3))
          _, applied = session.run([train_op, applies],
                                   {x: x_value, y: y_value})
          assert applied == (k == len(cycle) - 1), (c, k)
        actual.append(session.run(variables))
  training.assert_same_training(actual, expected)
