"""deferred_grad.PortCheckHook: the edits a port still needs, named.

What runs after a train op, and where a run stops, are invisible to the
train op; the hook finds them in the whole graph (`begin`) and the cycle's
place after the last run (`end`). Each case here has a control: the same
script correctly ported, on which the hook must log nothing.
"""

import pytest
import tensorflow as tf

import deferred_grad
import models
from training import logged
from training import MirroredTrainer
from training import REPLICAS
from training import Trainer

K = 3
# (replicas, use_tpu): the TPU path runs one replica per wrapper.
WHERE = pytest.mark.parametrize('replicas,use_tpu', [(1, False), (1, True),
                                                     (REPLICAS, False)],
                                ids=['gpu_path', 'tpu_path', 'mirrored'])
SGD = models.OPTIMIZERS['GradientDescent']


def _after(kind):
  """What the script runs after its train op: `Trainer`'s after_minimize."""

  def after_minimize(optimizer, train_op, variables):
    ema = tf.compat.v1.train.ExponentialMovingAverage(0.9)
    weights = [variables[name] for name in sorted(variables)]
    if kind == 'once_per_update':
      return optimizer.once_per_update(train_op, lambda: ema.apply(weights))
    with tf.control_dependencies([train_op]):
      if kind == 'moving_average':  # the large batch's way
        return ema.apply(weights)
      return tf.compat.v1.train.get_global_step().assign_add(1)

  return after_minimize


def _trainer(replicas, **kwargs):
  if replicas == 1:
    return Trainer(SGD, step_tensor=None, **kwargs)
  return MirroredTrainer(SGD, **kwargs)


def _checked(trainer, micro_steps, replicas=1):
  """Runs `micro_steps` micro-steps between the hook's begin and end.

  Returns:
    The hook's warnings.
  """
  x, y = models.make_data(1, replicas * models.MICRO_BATCH)
  with trainer.graph.as_default(), logged('PortCheckHook') as warned:
    hook = deferred_grad.PortCheckHook()
    hook.begin()
    with trainer.session() as session:
      for _ in range(micro_steps):
        trainer.micro_step(session, x[0], y[0])
      hook.end(session)
  return warned


@WHERE
@pytest.mark.parametrize('after', ['once_per_update', 'moving_average',
                                   'increment', 'the_only_increment'])
def test_what_writes_after_the_train_op_every_micro_step_is_named(
    after, replicas, use_tpu):
  """'the_only_increment': the wrapper gets no global_step and the script
  counts it after the train op (as a canned DNNLinearCombined head does)."""
  trainer = _trainer(replicas, grad_steps=K, use_tpu=use_tpu,
                     use_global_step=after != 'the_only_increment',
                     after_minimize=_after(after))
  # A whole cycle; the increment's second micro-step fails (test_counting).
  warned = _checked(trainer, 1 if after == 'increment' else K, replicas)
  if after in ('once_per_update', 'the_only_increment'):
    assert not warned
    return
  writes = [m for m in warned if 'on every micro-step' in m]
  assert len(writes) == 1, warned
  names = (['b1/ExponentialMovingAverage', 'b2/ExponentialMovingAverage']
           if after == 'moving_average' else ['every micro-step: global_step'])
  for name in names + ['once_per_update', 'GradientAggregationOptimizer']:
    assert name in writes[0], writes


@WHERE
@pytest.mark.parametrize('counts', ['micro_steps', 'updates'])
@pytest.mark.parametrize('schedule', [False, True])
def test_a_run_stopped_mid_cycle_is_named_with_what_it_left(
    schedule, counts, replicas, use_tpu):
  grad_steps = (lambda updates: tf.constant(K, tf.int64)) if schedule else K
  kwargs = {'schedule': 'callable'} if schedule and replicas > 1 else {}
  for micro_steps, left in ((K + 1, 1), (2 * K - 1, K - 1), (2 * K, 0)):
    trainer = _trainer(
        replicas, grad_steps=K if kwargs else grad_steps, use_tpu=use_tpu,
        global_step_counts=counts, **kwargs)
    warned = _checked(trainer, micro_steps, replicas)
    if not left:  # stopped on an update: the control
      assert not warned
      continue
    assert len(warned) == 1, warned
    assert 'stopped mid-cycle' in warned[0]
    assert 'accumulated %d of its %d micro-batches' % (left, K) in warned[0]


def test_two_train_ops_are_each_checked():
  """Two wrappers' train ops: each one's place and writes are its own."""
  graph = tf.Graph()
  with graph.as_default():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    a = tf.compat.v1.get_variable('a', [2], initializer=tf.ones_initializer())
    b = tf.compat.v1.get_variable('b', [2], initializer=tf.ones_initializer())
    train_ops = []
    for variable, grad_steps in ((a, 2), (b, 3)):
      opt = deferred_grad.GradientAggregationOptimizer(
          tf.compat.v1.train.GradientDescentOptimizer(0.1), grad_steps)
      train_ops.append(opt.minimize(
          tf.reduce_sum(tf.square(variable)), var_list=[variable],
          global_step=global_step if grad_steps == 2 else None))
    ema = tf.compat.v1.train.ExponentialMovingAverage(0.9)
    with tf.control_dependencies([train_ops[1]]):
      train_ops[1] = ema.apply([b])
    with logged('PortCheckHook') as warned:
      hook = deferred_grad.PortCheckHook()
      hook.begin()
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for _ in range(4):  # a's 2 cycles end; b is 1 into its second
          session.run(train_ops)
        hook.end(session)
  assert len(warned) == 2, warned
  assert 'b/ExponentialMovingAverage' in warned[0]
  assert 'a/' not in warned[0]
  assert 'accumulated 1 of its 3 micro-batches' in warned[1]


def test_in_a_monitored_training_session_at_its_step_limit():
  """The hook's end runs as MonitoredTrainingSession closes: a StopAtStepHook
  limit of micro-steps not a multiple of K stops mid-cycle."""
  x, y = models.make_data(1, models.MICRO_BATCH)
  for last_step, left in ((2 * K + 1, 1), (2 * K, 0)):
    trainer = Trainer(SGD, K, step_tensor=None)
    with trainer.graph.as_default(), logged('PortCheckHook') as warned:
      with tf.compat.v1.train.MonitoredTrainingSession(hooks=[
          tf.compat.v1.train.StopAtStepHook(last_step=last_step),
          deferred_grad.PortCheckHook()]) as session:
        while not session.should_stop():
          session.run(trainer.train_op, dict(zip(trainer.inputs,
                                                 (x[0], y[0]))))
    if left:
      assert len(warned) == 1, warned
      assert 'accumulated %d of its %d' % (left, K) in warned[0], warned
    else:
      assert not warned


# ------------------------------------------------- a clip before the wrapper --

def _clipped_build(clip, kind='global_norm'):
  """Builds a train op on two variables; `clip`: 'script' clips before the
  wrapper (the large batch's script unchanged), 'wrapper' passes clip_norm=
  (the correct port), None clips nothing. Returns the logged warnings."""
  with tf.Graph().as_default(), logged('come out of a clip') as warned:
    w = tf.compat.v1.get_variable('w', [3])
    table = tf.compat.v1.get_variable('table', [5, 2])
    loss = tf.reduce_sum(w * w) + tf.reduce_sum(
        tf.nn.embedding_lookup(table, [1, 3]))
    opt = deferred_grad.GradientAggregationOptimizer(
        SGD(0.1), K, clip_norm=1.0 if clip == 'wrapper' else None)
    grads, variables = zip(*opt.compute_gradients(loss))
    if clip == 'script' and kind == 'global_norm':
      grads, _ = tf.clip_by_global_norm(grads, 1.0)
    elif clip == 'script':
      grads = [tf.clip_by_norm(g, 1.0) for g in grads]
    opt.apply_gradients(zip(grads, variables))
  return warned


@pytest.mark.parametrize('kind', ['global_norm', 'norm'])
def test_a_clip_before_the_wrapper_is_named(kind):
  warned = _clipped_build('script', kind)
  assert len(warned) == 1, warned
  assert 'w, table' in warned[0] and 'clip_norm=' in warned[0], warned
  assert 'clip_by_' in warned[0], warned


@pytest.mark.parametrize('clip', ['wrapper', None])
def test_the_wrapper_s_own_clip_or_none_is_silent(clip):
  assert not _clipped_build(clip)


def test_a_clip_before_the_wrapper_is_named_once_under_replicas():
  with tf.Graph().as_default(), logged('come out of a clip') as warned:
    strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
    with strategy.scope():
      w = tf.compat.v1.get_variable('w', [3])
      opt = deferred_grad.GradientAggregationOptimizer(SGD(0.1), K)

      def step():
        grads, variables = zip(*opt.compute_gradients(tf.reduce_sum(w * w)))
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        return opt.apply_gradients(zip(grads, variables))

      strategy.extended.call_for_each_replica(step)
  assert len(warned) == 1, warned


# ------------------------------------- a moving average beside the train op --

def _averaged(where, behaviour_counts='micro_steps', micro_steps=K):
  """Trains w with a moving average of it (or batch norm's moving mean)
  placed `where`; returns the hook's warnings and every 'deferred_grad:'
  line it logged."""
  with tf.Graph().as_default(), logged('PortCheckHook') as warned, logged(
      'deferred_grad: trained') as trained:
    w = tf.compat.v1.get_variable('w', [3])
    data = tf.constant([1.0, 2.0, 3.0])
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = deferred_grad.GradientAggregationOptimizer(
        SGD(0.1), K, global_step_counts=behaviour_counts)
    ema = tf.compat.v1.train.ExponentialMovingAverage(0.9)
    batch_mean = tf.reduce_mean(data * w)
    if where == 'batch_norm':  # the moving statistic of a batch statistic
      moving_mean = tf.compat.v1.get_variable(
          'bn/moving_mean', [], initializer=tf.zeros_initializer(),
          trainable=False)
      tf.compat.v1.add_to_collection(
          tf.compat.v1.GraphKeys.UPDATE_OPS,
          tf.compat.v1.assign(moving_mean, 0.9 * moving_mean + 0.1 *
                              batch_mean).op)
    if where in ('update_ops', 'batch_norm'):  # TF-Slim's train op
      if where == 'update_ops':
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS,
                                       ema.apply([w]))
      update_ops = tf.compat.v1.get_collection(
          tf.compat.v1.GraphKeys.UPDATE_OPS)
      with tf.control_dependencies(update_ops):
        loss = tf.identity(tf.reduce_sum(tf.square(data * w)))
      grad_updates = opt.minimize(loss, global_step=global_step)
      with tf.control_dependencies([grad_updates]):
        train_op = tf.identity(loss)
    else:
      train_op = opt.minimize(tf.reduce_sum(tf.square(data * w)),
                              global_step=global_step)
      if where == 'grouped':
        train_op = tf.group(train_op, ema.apply([w]))
      elif where == 'once_per_update':
        train_op = opt.once_per_update(train_op, lambda: ema.apply([w]))
    hook = deferred_grad.PortCheckHook()
    hook.begin()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(micro_steps):
        session.run(train_op)
      hook.end(session)
  return warned, trained


@pytest.mark.parametrize('where', ['grouped', 'update_ops'])
def test_a_moving_average_run_with_the_train_op_is_named(where):
  warned, _ = _averaged(where)
  assert len(warned) == 1, warned
  assert 'w/ExponentialMovingAverage' in warned[0], warned
  assert 'once_per_update' in warned[0], warned


@pytest.mark.parametrize('where', ['once_per_update', 'batch_norm', None])
def test_a_moving_average_once_per_update_or_batch_norm_s_is_silent(where):
  warned, _ = _averaged(where)
  assert not warned, warned


def test_what_was_trained_is_said_where_global_step_counts_micro_steps():
  """A step limit in the large batch's steps, counted in micro-steps, stops
  after K times fewer updates: the end says how many."""
  _, trained = _averaged(None, micro_steps=4 * K)
  assert len(trained) == 1, trained
  assert 'trained 4 updates in %d micro-steps' % (4 * K) in trained[0]
  assert "global_step_counts='updates'" in trained[0]
  _, trained = _averaged(None, 'updates', micro_steps=4 * K)
  assert not trained, trained
