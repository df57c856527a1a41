"""When the wrapper applies, what it counts, and that it does so every run."""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import training
from models import make_data
from training import assert_same_training
from training import train
from training import Trainer

GRAD_STEPS = 3


def test_global_step_counts_micro_steps_and_weights_move_on_the_last(use_tpu):
  trainer = Trainer(models.sgd, GRAD_STEPS, use_tpu=use_tpu)
  x, y = make_data(2 * GRAD_STEPS, models.MICRO_BATCH)
  with trainer.session() as session:
    before = session.run(trainer.variables)
    for step in range(2 * GRAD_STEPS):
      trainer.micro_step(session, x[step], y[step])
      after = session.run(trainer.variables)
      assert session.run(trainer.global_step) == step + 1
      if step % GRAD_STEPS == GRAD_STEPS - 1:
        training.assert_weights_moved(before, after)
      else:
        for name in before:
          np.testing.assert_array_equal(after[name], before[name])
      before = after


@pytest.mark.parametrize('optimizer', ['GradientDescent', 'Adam'])
def test_every_run_matches_large_batch(optimizer, use_tpu):
  """The original's TPU path raced on update_count (about 1 run in 5)."""
  make_optimizer = models.OPTIMIZERS[optimizer]
  data = make_data(models.CYCLES, GRAD_STEPS * models.MICRO_BATCH)
  expected, _, _ = train(make_optimizer, data)
  trainer = Trainer(make_optimizer, GRAD_STEPS, use_tpu=use_tpu)
  with trainer.session() as session:
    for _ in range(50):
      session.run(trainer.init_op)
      assert_same_training(trainer.run(session, data), expected)


def test_update_count_wraps_at_grad_steps_and_reads_old_counts():
  trainer = Trainer(models.sgd, GRAD_STEPS, use_tpu=True)
  with trainer.graph.as_default():
    counter, = [
        v for v in tf.compat.v1.global_variables()
        if v.op.name == 'update_count'
    ]
    set_counter = counter.assign(7.0)
  x, y = make_data(1, models.MICRO_BATCH)
  with trainer.session() as session:
    for step in range(2 * GRAD_STEPS + 1):
      trainer.micro_step(session, x[0], y[0])
      assert session.run(counter) == (step + 1) % GRAD_STEPS
    # The original's counter counted on without bound: 7 % 3 == 1.
    session.run(set_counter)
    before = session.run(trainer.variables)
    trainer.micro_step(session, x[0], y[0])
    for name in before:
      np.testing.assert_array_equal(session.run(trainer.variables[name]),
                                    before[name])
    assert session.run(counter) == 2
    trainer.micro_step(session, x[0], y[0])
    training.assert_weights_moved(before, session.run(trainer.variables))
    assert session.run(counter) == 0


def test_optimizer_variables_include_update_count(use_tpu):
  trainer = Trainer(models.OPTIMIZERS['Adam'], GRAD_STEPS, use_tpu=use_tpu)
  with trainer.graph.as_default():
    names = [v.op.name for v in trainer.optimizer.variables()]
  expected = ['beta1_power', 'beta2_power'] + [
      '%s/%s' % (var, slot) for var in ['b1', 'b2', 'w1', 'w2']
      for slot in ['Adam', 'Adam_1', 'GradientAccumulator']
  ]
  if use_tpu:
    expected.append('update_count')
  expected.append('GradientAggregationOptimizer/deferred_grad_settings')
  names = [n.split('/', 1)[1] if n.startswith('cond/') else n for n in names]
  assert sorted(names) == sorted(expected)


@pytest.mark.parametrize('use_global_step', [True, False])
@pytest.mark.parametrize('grad_steps', [1, GRAD_STEPS])
def test_applies_update_and_position_in_cycle(use_tpu, use_global_step,
                                              grad_steps):
  """Fetched with the train op: True exactly on the runs that apply."""
  trainer = Trainer(models.sgd, grad_steps, use_tpu=use_tpu,
                    use_global_step=use_global_step)
  with trainer.graph.as_default():
    applies = trainer.optimizer.applies_update()
    position = trainer.optimizer.micro_step_in_cycle()
  x, y = make_data(3 * grad_steps, models.MICRO_BATCH)
  with trainer.session() as session:
    before = session.run(trainer.variables)
    for step in range(3 * grad_steps):
      _, applied, where = session.run(
          [trainer.train_op, applies, position],
          dict(zip(trainer.inputs, (x[step], y[step]))))
      after = session.run(trainer.variables)
      moved = any(not np.array_equal(before[n], after[n]) for n in before)
      assert applied == moved == (step % grad_steps == grad_steps - 1)
      assert where == step % grad_steps
      before = after


def test_applies_update_needs_a_train_op():
  optimizer = deferred_grad.GradientAggregationOptimizer(models.sgd(), 2)
  with pytest.raises(ValueError, match='No train op has been built'):
    optimizer.applies_update()


def test_summary_written_only_on_apply_steps(use_tpu, tmp_path):
  """The guides' recipe: a summary op under tf.cond(applies_update())."""
  trainer = Trainer(models.sgd, GRAD_STEPS, use_tpu=use_tpu)
  with trainer.graph.as_default():
    learning_rate = tf.constant(0.1)
    summary = tf.cond(
        trainer.optimizer.applies_update(),
        lambda: tf.compat.v1.summary.scalar('learning_rate', learning_rate),
        lambda: tf.constant(b''))
    writer = tf.compat.v1.summary.FileWriter(str(tmp_path))
  x, y = make_data(2 * GRAD_STEPS, models.MICRO_BATCH)
  with trainer.session() as session:
    for step in range(2 * GRAD_STEPS):
      # (Not global_step in the same run: that read is unordered with the
      # train op's increment.)
      _, serialized = session.run(
          [trainer.train_op, summary],
          dict(zip(trainer.inputs, (x[step], y[step]))))
      if serialized:
        writer.add_summary(serialized, step + 1)
    writer.close()
  steps = [event.step for path in tmp_path.iterdir()
           for event in tf.compat.v1.train.summary_iterator(str(path))
           if event.summary.value]
  assert steps == [GRAD_STEPS, 2 * GRAD_STEPS]


def _probed_model(kind, use_tpu):
  """A model whose inputs are placeholders; `kind` names its schedule."""
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [2])
    weight = tf.compat.v1.placeholder(tf.float32, [])
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
    table = tf.compat.v1.get_variable('table', initializer=np.zeros(
        [4, 2], np.float32))
    loss = tf.reduce_sum(w * x) + tf.reduce_sum(
        tf.nn.embedding_lookup(table, [1, 2]) * x)
    grad_steps = {'int': GRAD_STEPS,
                  'tensor': tf.constant(GRAD_STEPS, tf.int64),
                  'callable': lambda updates: GRAD_STEPS}[kind]
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), grad_steps,
        use_tpu=use_tpu, nonfinite_policy='skip_micro_batch',
        micro_batch_weight=weight)
    train_op = optimizer.minimize(loss, global_step=global_step)
    counters = [optimizer.applies_update(), optimizer.micro_step_in_cycle(),
                optimizer.applied_updates()]
  return graph, train_op, counters, {x: [1.0, 2.0], weight: 2.0}


@pytest.mark.parametrize('kind', ['int', 'tensor', 'callable'])
def test_counters_fetched_alone_need_no_feed_and_change_nothing(kind,
                                                                use_tpu):
  """Fetched alone they say what the next run of the train op will do,
  which is what that run says when they are fetched with it."""
  graph, train_op, counters, feed = _probed_model(kind, use_tpu)
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    state = tf.compat.v1.global_variables()
    for step in range(2 * GRAD_STEPS + 1):
      before = session.run(state)
      probed = [session.run(counters) for _ in range(3)]  # no feed
      for value, was in zip(session.run(state), before):
        np.testing.assert_array_equal(value, was)
      assert all(p == probed[0] for p in probed)
      applies, place, updates = probed[0]
      assert applies == (step % GRAD_STEPS == GRAD_STEPS - 1)
      assert place == step % GRAD_STEPS
      assert updates == step // GRAD_STEPS
      fetched = session.run([train_op] + counters, feed)[1:]
      assert fetched == probed[0]


def test_counters_of_the_train_op_asked_for(use_tpu):
  """A wrapper that built two train ops reads each one's counters
  (`train_op=`; a group of it too); by default the one built last."""
  k = 2
  with tf.Graph().as_default():
    a = tf.compat.v1.get_variable('a', [2], initializer=tf.ones_initializer())
    b = tf.compat.v1.get_variable('b', [2], initializer=tf.ones_initializer())
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), k, use_tpu=use_tpu)
    train_a = opt.minimize(tf.reduce_sum(a * a), global_step=global_step)
    train_b = opt.minimize(tf.reduce_sum(b * b))  # its own update_count
    grouped_a = tf.group(train_a, tf.no_op())
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(3):
        session.run(train_a)
      session.run(train_b)
      for op in (train_a, grouped_a):
        assert session.run(opt.micro_step_in_cycle(train_op=op)) == 3 % k
        assert session.run(opt.applies_update(train_op=op)) == (
            3 % k == k - 1)
        assert session.run(opt.applied_updates(train_op=op)) == 3 // k
      assert session.run(opt.micro_step_in_cycle(train_op=train_b)) == 1
      assert session.run(opt.micro_step_in_cycle()) == 1  # train_b's
      assert session.run(opt.applies_update()) == (1 == k - 1)
  with train_b.graph.as_default():  # int grad_steps, no global_step
    with pytest.raises(ValueError, match='global_step'):
      opt.applied_updates(train_op=train_b)
  with train_a.graph.as_default():
    with pytest.raises(ValueError, match='is not a train op'):
      opt.micro_step_in_cycle(train_op=tf.no_op())
    with pytest.raises(ValueError, match='groups several'):
      opt.micro_step_in_cycle(train_op=tf.group(train_a, train_b))
  with tf.Graph().as_default():  # another graph: no train op built there
    with pytest.raises(ValueError, match='minimize or apply_gradients'):
      opt.applies_update()


def test_the_constructor_name_scopes_the_ops_not_the_variables(use_tpu):
  def build(**kwargs):
    graph = tf.Graph()
    with graph.as_default():
      w = tf.compat.v1.get_variable('w', [2])
      global_step = tf.compat.v1.train.get_or_create_global_step()
      opt = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.AdamOptimizer(0.1), 2, use_tpu=use_tpu,
          **kwargs)
      train_op = opt.minimize(tf.reduce_sum(w * w), global_step=global_step)
      names = sorted(v.op.name for v in tf.compat.v1.global_variables())
    return train_op, names, graph

  train_op, names, graph = build(name='my_accumulation')
  default_op, default_names, _ = build()
  # But the train op's settings, in its name scope as its ops.
  assert names == sorted(n.replace('GradientAggregationOptimizer/',
                                   'my_accumulation/') for n in default_names)
  assert train_op.name.startswith('my_accumulation')
  assert default_op.name.startswith('GradientAggregationOptimizer')
  assert not [op.name for op in graph.get_operations()
              if op.name.startswith('GradientAggregationOptimizer')]
