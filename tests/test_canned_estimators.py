"""The canned `tf.compat.v1.estimator` models (TensorFlow 2.15, the last).

Each is trained twice on the same examples in the same order: with the
wrapper on micro-batches of MICRO_BATCH, GRAD_STEPS micro-steps an update,
and with the bare optimizer on batches GRAD_STEPS times larger. The canned
models put every variable under a partitioner, look their sparse columns up
with `embedding_lookup_sparse`, and sum the loss over the batch
(`loss_reduction=SUM`): `aggregation='sum'` matches that large batch.
`DNNLinearCombinedClassifier` wraps both of its optimizers; its model_fn
calls `minimize` twice without a `global_step` and counts it itself.
"""

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import training

pytestmark = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')

fc = tf.compat.v1.feature_column

GRAD_STEPS = 3
CYCLES = 3
MICRO_BATCH = 4
VOCABULARY = 10
WORDS = ['w%d' % i for i in range(6)]
STOP_STEP = GRAD_STEPS + 1  # one micro-step into the second cycle


def _examples():
  """Ids of 'a' (1 to 3, padded with -1), two numbers, two words."""
  count = CYCLES * GRAD_STEPS * MICRO_BATCH
  rng = np.random.RandomState(0)
  ids = np.full([count, 3], -1, np.int64)
  for row in ids:
    length = rng.randint(1, 4)
    row[:length] = rng.randint(0, VOCABULARY, size=length)
  features = {
      'a': ids,
      'x': rng.randn(count, 2).astype(np.float32),
      'w': np.array([[WORDS[i]] for i in rng.randint(len(WORDS), size=count)]),
      'h': np.array([['h%d' % i] for i in rng.randint(20, size=count)]),
  }
  labels = rng.randint(0, 2, size=[count, 1]).astype(np.float32)
  return features, labels


def _input_fn(batch_size, skip_batches=0):
  def input_fn():
    return tf.data.Dataset.from_tensor_slices(_examples()).batch(
        batch_size).skip(skip_batches)
  return input_fn


def _dnn_columns():
  return [fc.embedding_column(
      fc.categorical_column_with_identity('a', VOCABULARY), 3),
          fc.numeric_column('x', shape=[2])]


def _linear_columns():
  a = fc.categorical_column_with_identity('a', VOCABULARY)
  return [fc.categorical_column_with_vocabulary_list('w', WORDS),
          fc.categorical_column_with_hash_bucket('h', 8),
          fc.crossed_column([a, 'w'], 16),
          fc.numeric_column('x', shape=[2])]


def _ftrl():
  return tf.compat.v1.train.FtrlOptimizer(
      0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.01)


def _adagrad():
  return tf.compat.v1.train.AdagradOptimizer(0.1)


def _optimizer(make, grad_steps, as_callable):
  """The bare optimizer (`grad_steps` None) or the wrapper, or a callable
  making it, as the canned models accept."""
  def make_wrapped():
    if grad_steps is None:
      return make()
    return deferred_grad.GradientAggregationOptimizer(
        make(), grad_steps, aggregation='sum')
  return make_wrapped if as_callable else make_wrapped()


# name -> function(model_dir, config, grad_steps, as_callable) -> estimator
ESTIMATORS = {
    'DNNRegressor': lambda d, c, k, f: tf.compat.v1.estimator.DNNRegressor(
        [4], _dnn_columns(), d, optimizer=_optimizer(_adagrad, k, f),
        config=c),
    'DNNClassifier': lambda d, c, k, f: tf.compat.v1.estimator.DNNClassifier(
        [4], _dnn_columns(), d, optimizer=_optimizer(_adagrad, k, f),
        config=c),
    'LinearRegressor': lambda d, c, k, f:
        tf.compat.v1.estimator.LinearRegressor(
            _linear_columns(), d, optimizer=_optimizer(_ftrl, k, f),
            config=c),
    'LinearClassifier': lambda d, c, k, f:
        tf.compat.v1.estimator.LinearClassifier(
            _linear_columns(), d, optimizer=_optimizer(_ftrl, k, f),
            config=c),
    'DNNLinearCombinedClassifier': lambda d, c, k, f:
        tf.compat.v1.estimator.DNNLinearCombinedClassifier(
            d, linear_feature_columns=_linear_columns(),
            linear_optimizer=_optimizer(_ftrl, k, f),
            dnn_feature_columns=_dnn_columns(),
            dnn_optimizer=_optimizer(_adagrad, k, f), dnn_hidden_units=[4],
            config=c),
}


def _estimator(name, model_dir, grad_steps=None, as_callable=False):
  config = tf.compat.v1.estimator.RunConfig(
      tf_random_seed=7, save_checkpoints_steps=2, save_summary_steps=None,
      log_step_count_steps=None)
  return ESTIMATORS[name](str(model_dir), config, grad_steps, as_callable)


def _model_variables(estimator):
  """Every variable of the bare model's checkpoint but the step: weights and
  the wrapped optimizer's slots."""
  own = ('GradientAccumulator', 'update_count', 'deferred_grad_settings')
  return {name: estimator.get_variable_value(name)
          for name in estimator.get_variable_names()
          if name != 'global_step' and not any(o in name for o in own)}


def _bare(name, model_dir):
  estimator = _estimator(name, model_dir)
  estimator.train(_input_fn(GRAD_STEPS * MICRO_BATCH), max_steps=CYCLES)
  return estimator


def _assert_same(actual, expected, rtol=1e-5, atol=1e-6):
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], rtol=rtol,
                               atol=atol, err_msg=name)


@pytest.mark.parametrize('as_callable', [False, True],
                         ids=['instance', 'callable'])
@pytest.mark.parametrize('name', sorted(ESTIMATORS))
def test_a_canned_estimator_trains_like_the_large_batch(name, as_callable,
                                                        tmp_path):
  expected = _model_variables(_bare(name, tmp_path / 'bare'))
  estimator = _estimator(name, tmp_path / 'wrapped', GRAD_STEPS, as_callable)
  with training.logged('PortCheckHook') as warned:  # a head's train op
    estimator.train(_input_fn(MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS,
                    hooks=[deferred_grad.PortCheckHook()])
  assert not warned
  assert estimator.get_variable_value('global_step') == CYCLES * GRAD_STEPS
  names = estimator.get_variable_names()
  # Every table is partitioned: its list of rows is one per partition.
  assert any('/part_0/GradientAccumulator' in n for n in names), names
  _assert_same(_model_variables(estimator), expected)


@pytest.mark.parametrize('name', ['LinearClassifier',
                                  'DNNLinearCombinedClassifier',
                                  'DNNRegressor'])
def test_a_canned_estimator_resumes_mid_cycle(name, tmp_path):
  """Stopped one micro-step into a cycle (a checkpoint every 2 steps) and
  resumed from it: the uninterrupted wrapper's weights, to the bit."""
  uninterrupted = _estimator(name, tmp_path / 'once', GRAD_STEPS)
  uninterrupted.train(_input_fn(MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  estimator = _estimator(name, tmp_path / 'resumed', GRAD_STEPS)
  estimator.train(_input_fn(MICRO_BATCH), max_steps=STOP_STEP)
  assert estimator.get_variable_value('global_step') == STOP_STEP
  accumulators = [n for n in estimator.get_variable_names()
                  if n.endswith('GradientAccumulator')]
  assert accumulators
  resumed = _estimator(name, tmp_path / 'resumed', GRAD_STEPS)
  resumed.train(_input_fn(MICRO_BATCH, skip_batches=STOP_STEP),
                max_steps=CYCLES * GRAD_STEPS)
  _assert_same(_model_variables(resumed), _model_variables(uninterrupted),
               rtol=0, atol=0)
  expected = _model_variables(_bare(name, tmp_path / 'bare'))
  _assert_same(_model_variables(resumed), expected)


def test_evaluate_and_train_and_evaluate_as_the_bare_model(tmp_path):
  name = 'DNNLinearCombinedClassifier'
  bare = _bare(name, tmp_path / 'bare')
  wrapped = _estimator(name, tmp_path / 'wrapped', GRAD_STEPS)
  tf.compat.v1.estimator.train_and_evaluate(
      wrapped,
      tf.compat.v1.estimator.TrainSpec(_input_fn(MICRO_BATCH),
                                       max_steps=CYCLES * GRAD_STEPS),
      tf.compat.v1.estimator.EvalSpec(_input_fn(MICRO_BATCH), steps=None,
                                      throttle_secs=0))
  _assert_same(_model_variables(wrapped), _model_variables(bare))
  expected = bare.evaluate(_input_fn(MICRO_BATCH))
  metrics = wrapped.evaluate(_input_fn(MICRO_BATCH))
  assert metrics['global_step'] == CYCLES * GRAD_STEPS
  for key in ('loss', 'accuracy', 'auc'):
    np.testing.assert_allclose(metrics[key], expected[key], rtol=1e-4,
                               err_msg=key)


def test_the_default_mean_applies_a_fraction_of_a_summed_loss(tmp_path):
  """Guards the tests above: the canned heads sum the loss over the batch,
  so the default aggregation='mean' applies 1/GRAD_STEPS of the large
  batch's gradient (the README's Estimator guide says so)."""
  name = 'LinearRegressor'
  expected = _model_variables(_bare(name, tmp_path / 'bare'))
  estimator = tf.compat.v1.estimator.LinearRegressor(
      _linear_columns(), str(tmp_path / 'mean'),
      optimizer=deferred_grad.GradientAggregationOptimizer(
          _ftrl(), GRAD_STEPS), config=tf.compat.v1.estimator.RunConfig(
              tf_random_seed=7))
  estimator.train(_input_fn(MICRO_BATCH), max_steps=CYCLES * GRAD_STEPS)
  with pytest.raises(AssertionError):
    _assert_same(_model_variables(estimator), expected)
