"""Porting real TF1 scripts: BERT's create_optimizer, and one contract at
every grad_steps.

The porting guide is the docstring of
tools/examples/bert_porting.py: a BERT-like model with an optimizer written
like BERT's (slots made in apply_gradients, global_step ignored, weight
decay), a warm-up/decay schedule, global-norm clipping and the script's own
step increment. After the porting checklist it trains like the large batch.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import models
import scripts
import training

sys.path.insert(0, os.path.join(scripts.TOOLS, 'examples'))
import bert_porting  # pylint: disable=g-import-not-at-top,wrong-import-position

GRAD_STEPS = 4
MICRO_BATCH = 2
UPDATES = 5
MASKED_COUNTS = (3, 7, 1, 5)  # masked tokens per micro-batch, in turn


def _examples(micro_batches=UPDATES * GRAD_STEPS):
  return bert_porting.make_examples(micro_batches, MICRO_BATCH, MASKED_COUNTS)


def _large_batch(examples, updates=UPDATES):
  return bert_porting.train(examples, GRAD_STEPS * MICRO_BATCH, updates,
                            epsilon=0.0)


@pytest.mark.parametrize('grad_steps', [1, GRAD_STEPS])
def test_ported_script_trains_like_the_large_batch(grad_steps, use_tpu):
  """At grad_steps=1 too: the edits made unconditionally keep the contract.

  BERT's optimizer ignores global_step; the wrapper counts it, so the
  warm-up schedule moves (a global_step left uncounted at grad_steps=1
  would keep it at 0, and the weights would never move).
  """
  examples = bert_porting.make_examples(
      UPDATES * GRAD_STEPS, MICRO_BATCH * GRAD_STEPS // grad_steps,
      MASKED_COUNTS)
  expected, expected_step = bert_porting.train(
      examples, GRAD_STEPS * MICRO_BATCH, UPDATES, epsilon=0.0)
  actual, step = bert_porting.train(
      examples, GRAD_STEPS * MICRO_BATCH // grad_steps, UPDATES * grad_steps,
      grad_steps, use_tpu=use_tpu, epsilon=0.0)
  assert expected_step == UPDATES
  assert step == UPDATES * grad_steps
  training.assert_same_training([actual], [expected])


def _ported(use_tpu, weighted=True, own_increment=False):
  """The ported graph built by hand, to vary one edit at a time.

  Returns:
    (graph, train op, feeds, global step).
  """
  graph = tf.Graph()
  with graph.as_default():
    feeds = tuple(tf.compat.v1.placeholder(dtype, [None, bert_porting.SEQUENCE])
                  for dtype in (tf.int32, tf.int32, tf.float32))
    loss = bert_porting.masked_lm_loss(*feeds, epsilon=0.0)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    learning_rate = bert_porting.learning_rate_schedule(
        deferred_grad.applied_updates(global_step, GRAD_STEPS),
        **bert_porting.SCHEDULE)
    optimizer = deferred_grad.GradientAggregationOptimizer(
        bert_porting.AdamWeightDecayOptimizer(learning_rate), GRAD_STEPS,
        clip_norm=1.0, use_tpu=use_tpu, micro_batch_weight=(
            tf.reduce_sum(feeds[2]) if weighted else None))
    tvars = tf.compat.v1.trainable_variables()
    grads_and_vars = list(zip(tf.gradients(loss, tvars), tvars))
    if own_increment:
      train_op = optimizer.apply_gradients(grads_and_vars)  # no global_step
      with tf.control_dependencies([train_op]):
        train_op = global_step.assign_add(1)  # the script's own, ordered
    else:
      train_op = optimizer.apply_gradients(grads_and_vars, global_step)
  return graph, train_op, feeds, global_step


def _train_ported(examples, **kwargs):
  graph, train_op, feeds, global_step = _ported(**kwargs)
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    for run in range(UPDATES * GRAD_STEPS):
      rows = slice(run * MICRO_BATCH, (run + 1) * MICRO_BATCH)
      session.run(train_op, {feed: part[rows]
                             for feed, part in zip(feeds, examples)})
    assert session.run(global_step) == UPDATES * GRAD_STEPS
    return session.run({v.op.name: v
                        for v in tf.compat.v1.trainable_variables()})


def test_without_token_weights_the_masked_lm_loss_differs(use_tpu):
  """Guards the test above: micro-batches are not averaged with equal weight.

  (Their token counts differ; without weights the trained weights differ
  from the large batch's by about 0.13.)
  """
  examples = _examples()
  expected, _ = _large_batch(examples)
  actual = _train_ported(examples, use_tpu=use_tpu, weighted=False)
  with pytest.raises(AssertionError):
    training.assert_same_training([actual], [expected])


def test_script_that_counts_its_own_steps(use_tpu):
  """global_step=None to the wrapper; the script's increment after its op.

  The increment is ordered after the wrapper's op, so the schedule read on
  an apply step sees the same step as in the large batch: no race.
  """
  examples = _examples()
  expected, _ = _large_batch(examples)
  actual = _train_ported(examples, use_tpu=use_tpu, own_increment=True)
  training.assert_same_training([actual], [expected])


def test_ported_script_resumes_mid_cycle(use_tpu, tmp_path):
  examples = _examples()
  stop = GRAD_STEPS + 2

  def run(graph, train_op, feeds, session, runs):
    for run_index in runs:
      rows = slice(run_index * MICRO_BATCH, (run_index + 1) * MICRO_BATCH)
      session.run(train_op, {feed: part[rows]
                             for feed, part in zip(feeds, examples)})
    with graph.as_default():
      return session.run({v.op.name: v
                          for v in tf.compat.v1.trainable_variables()})

  total = UPDATES * GRAD_STEPS
  graph, train_op, feeds = bert_porting.build(GRAD_STEPS, use_tpu=use_tpu)
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    expected = run(graph, train_op, feeds, session, range(total))
  graph, train_op, feeds = bert_porting.build(GRAD_STEPS, use_tpu=use_tpu)
  path = str(tmp_path / 'model')
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    run(graph, train_op, feeds, session, range(stop))
    tf.compat.v1.train.Saver().save(session, path)
  graph, train_op, feeds = bert_porting.build(GRAD_STEPS, use_tpu=use_tpu)
  with graph.as_default(), tf.compat.v1.Session() as session:
    tf.compat.v1.train.Saver().restore(session, path)
    resumed = run(graph, train_op, feeds, session, range(stop, total))
  training.assert_same_training([resumed], [expected], rtol=0, atol=0)


# ------------------------------------------------- grad_steps=1 contract --


class _IgnoresGlobalStep(tf.compat.v1.train.GradientDescentOptimizer):
  """Like many TF1 optimizers: apply_gradients ignores its global_step."""

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step
    return super(_IgnoresGlobalStep, self).apply_gradients(grads_and_vars,
                                                           name=name)


@pytest.mark.parametrize('grad_steps', [1, 3])
def test_global_step_counted_whatever_the_optimizer_does(grad_steps,
                                                         use_tpu):
  data = models.make_data(2, grad_steps * models.MICRO_BATCH)
  _, step, _ = training.train(lambda step: _IgnoresGlobalStep(0.1), data,
                              grad_steps=grad_steps, use_tpu=use_tpu)
  assert step == 2 * grad_steps


def test_clip_norm_at_grad_steps_one(use_tpu):
  from test_numerics import _clipped_momentum  # pylint: disable=g-import-not-at-top
  from test_numerics import CLIP_NORM  # pylint: disable=g-import-not-at-top
  data = models.make_data(models.CYCLES, models.MICRO_BATCH)
  expected, _, _ = training.train(_clipped_momentum, data)
  actual, _, _ = training.train(models.OPTIMIZERS['Momentum'], data,
                                grad_steps=1, use_tpu=use_tpu,
                                clip_norm=CLIP_NORM)
  training.assert_same_training(actual, expected)


@pytest.mark.parametrize('policy', ['skip_micro_batch', 'skip_cycle'])
def test_nonfinite_policy_at_grad_steps_one(policy, use_tpu):
  """A non-finite micro-batch is skipped and counted; the rest apply."""
  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', initializer=np.zeros(2, np.float32))
    feed = tf.compat.v1.placeholder(tf.float32, [2])
    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), 1,
        use_tpu=use_tpu, nonfinite_policy=policy)
    train_op = optimizer.apply_gradients([(feed, w)], global_step)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for gradient in [[1, 2], [np.nan, 0], [3, -1]]:
        session.run(train_op, {feed: gradient})
      np.testing.assert_array_equal(session.run(w), [-4, -1])
      assert session.run([optimizer.skipped_micro_batches,
                          optimizer.skipped_cycles, global_step]) == [1, 1, 3]


@pytest.mark.parametrize('grad_steps', [1, 3])
def test_a_script_fetching_the_train_op_collection_trains_like_the_large_batch(
    grad_steps, use_tpu, tmp_path):
  """As a bare optimizer's, `minimize` lists its op in TRAIN_OP, and
  nothing made inside its cond (which cannot be fetched): a script that
  writes the meta graph, imports it in a new graph and fetches the train op
  from the collection trains like the large batch."""
  data = models.make_data(models.CYCLES, grad_steps * models.MICRO_BATCH)
  expected, _, _ = training.train(models.OPTIMIZERS['Momentum'], data)
  trainer = training.Trainer(models.OPTIMIZERS['Momentum'], grad_steps,
                             use_tpu=use_tpu)
  listed = trainer.graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)
  assert len(listed) == 1 and listed[0] is trainer.train_op
  with trainer.graph.as_default(), trainer.session() as session:
    path = tf.compat.v1.train.Saver().save(session, str(tmp_path / 'ckpt'))
  names = sorted(trainer.variables)
  inputs = [tensor.name for tensor in trainer.inputs]
  with tf.Graph().as_default():
    saver = tf.compat.v1.train.import_meta_graph(path + '.meta')
    train_op, = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)
    imported = {v.op.name: v for v in tf.compat.v1.global_variables()}
    variables = [imported[name] for name in names]
    with tf.compat.v1.Session() as session:
      saver.restore(session, path)
      actual = []
      for batch in zip(*data):
        for k in range(grad_steps):
          rows = slice(k * models.MICRO_BATCH, (k + 1) * models.MICRO_BATCH)
          session.run(train_op, {name: part[rows]
                                 for name, part in zip(inputs, batch)})
        actual.append(dict(zip(names, session.run(variables))))
  training.assert_same_training(actual, expected)


@pytest.mark.parametrize('per_replica', [False, True],
                         ids=['one_wrapper', 'wrapper_per_replica'])
def test_under_mirrored_strategy_the_train_op_collection_trains_alike(
    per_replica):
  """Under MirroredStrategy the collection holds one op, whose runs train
  like the large batch."""
  data = models.make_data(models.CYCLES,
                          training.REPLICAS * 3 * models.MICRO_BATCH)
  expected, _, _ = training.train(models.OPTIMIZERS['Momentum'], data)
  trainer = training.MirroredTrainer(models.OPTIMIZERS['Momentum'], 3,
                                     wrapper_per_replica=per_replica)
  trainer.train_op, = trainer.graph.get_collection(
      tf.compat.v1.GraphKeys.TRAIN_OP)
  with trainer.session() as session:
    actual = trainer.run(session, data)
  training.assert_same_training(actual, expected)
