"""Keras 2 `model.fit` in graph mode with the wrapper as the optimizer.

`model.compile(optimizer=<a tf.compat.v1.train.Optimizer>)` wraps it in
Keras's TFOptimizer, which calls `apply_gradients(..., global_step=iterations)`
once per batch: `model.fit` at batch B with the wrapper then trains as
`model.fit` at batch K*B with the bare optimizer, and `iterations` counts
micro-steps. Under a tf.distribute strategy Keras passes the graph's global
step instead (`tf.compat.v1.train.get_global_step()`, None unless the script
made one) and leaves `iterations` at 0, for the bare optimizer as for the
wrapper.

Keras 2 is `tf.keras` on TensorFlow 2.15 and the `tf_keras` package (same
version as TensorFlow) from 2.16 on; tools/test installs it.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import behavior  # pylint: disable=unused-import
import deferred_grad
import models
import training

keras = models.keras2()

GRAD_STEPS, MICRO_BATCH, CYCLES_PER_EPOCH, EPOCHS = 4, 8, 3, 2
INPUT_DIM, OUTPUT_DIM = 5, 2

OPTIMIZERS = {
    'GradientDescent': lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    'Momentum': lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    'Adam': lambda: tf.compat.v1.train.AdamOptimizer(0.01),
    'RMSProp': lambda: tf.compat.v1.train.RMSPropOptimizer(0.01),
}


def _data(replicas=1):
  rng = np.random.RandomState(0)
  n = GRAD_STEPS * MICRO_BATCH * replicas * CYCLES_PER_EPOCH
  return (rng.randn(n, INPUT_DIM).astype(np.float32),
          rng.randn(n, OUTPUT_DIM).astype(np.float32))


def _mlp():
  return keras.Sequential([
      keras.layers.Dense(4, activation='tanh', input_shape=(INPUT_DIM,),
                         kernel_initializer=keras.initializers.RandomNormal(
                             seed=1)),
      keras.layers.Dense(OUTPUT_DIM,
                         kernel_initializer=keras.initializers.RandomNormal(
                             seed=2)),
  ])


def _fit(make_optimizer, batch_size, data, strategy=None, make_model=_mlp,
         epochs=EPOCHS):
  """Trains a fresh model with `model.fit`.

  Returns:
    (weights before, weights after, the optimizer's `iterations`).
  """
  tf.compat.v1.reset_default_graph()
  keras.backend.clear_session()
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = make_model()
    model.compile(optimizer=make_optimizer(), loss='mse')
  before = model.get_weights()
  model.fit(data[0], data[1], batch_size=batch_size, epochs=epochs,
            shuffle=False, verbose=0)
  iterations = keras.backend.get_value(model.optimizer.iterations)
  return before, model.get_weights(), iterations


def _wrapped(make_optimizer, use_tpu=False):
  return lambda: deferred_grad.GradientAggregationOptimizer(
      make_optimizer(), GRAD_STEPS, use_tpu=use_tpu)


def _assert_same_weights(actual, expected, rtol=1e-5, atol=1e-6):
  assert len(actual) == len(expected)
  for i, (a, e) in enumerate(zip(actual, expected)):
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol,
                               err_msg='weight %d' % i)


def _assert_moved(before, after):
  moved = max(np.abs(a - b).max() for a, b in zip(after, before))
  assert moved > 1e-3, 'training moved the weights by only %g' % moved


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_fit_at_the_micro_batch_matches_fit_at_the_large_batch(name, use_tpu):
  data = _data()
  before, expected, large_iterations = _fit(
      OPTIMIZERS[name], GRAD_STEPS * MICRO_BATCH, data)
  before_w, actual, iterations = _fit(
      _wrapped(OPTIMIZERS[name], use_tpu), MICRO_BATCH, data)
  _assert_same_weights(before_w, before, rtol=0, atol=0)
  _assert_moved(before, expected)
  _assert_same_weights(actual, expected)
  # Keras passes `iterations` as the global step: it counts micro-steps.
  assert large_iterations == EPOCHS * CYCLES_PER_EPOCH
  assert iterations == GRAD_STEPS * large_iterations


@pytest.mark.parametrize('name', ['GradientDescent', 'Adam'])
def test_fit_under_mirrored_strategy_matches_the_large_batch(name):
  # batch_size is global under a strategy: each of the 2 replicas gets
  # MICRO_BATCH rows per micro-step; a cycle is GRAD_STEPS * 2 * MICRO_BATCH.
  replicas = 2
  data = _data(replicas)
  _, expected, _ = _fit(OPTIMIZERS[name],
                        GRAD_STEPS * replicas * MICRO_BATCH, data)
  strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
  before, actual, iterations = _fit(_wrapped(OPTIMIZERS[name]),
                                    replicas * MICRO_BATCH, data, strategy)
  _assert_moved(before, expected)
  _assert_same_weights(actual, expected)
  assert iterations == 0  # see the module docstring


def _batch_norm_model():
  return keras.Sequential([
      keras.layers.BatchNormalization(input_shape=(INPUT_DIM,), momentum=0.9,
                                      epsilon=1e-3),
      keras.layers.Dense(OUTPUT_DIM,
                         kernel_initializer=keras.initializers.RandomNormal(
                             seed=2)),
  ])


def _batch_norm_cycle_in_numpy(weights, x, y, learning_rate):
  """One SGD cycle of BatchNormalization -> Dense with mse, in numpy.

  Each micro-batch is normalised by its own statistics (batch norm stays per
  micro-batch); the cycle applies the mean of the micro-batches' gradients,
  and the moving averages update once per micro-batch.
  """
  gamma, beta, moving_mean, moving_var, kernel, bias = [
      w.astype(np.float64) for w in weights]
  grads = [np.zeros_like(v) for v in (gamma, beta, kernel, bias)]
  for xb, yb in zip(np.split(x, GRAD_STEPS), np.split(y, GRAD_STEPS)):
    mean, var = xb.mean(0), xb.var(0)
    xhat = (xb - mean) / np.sqrt(var + 1e-3)
    pred = (xhat * gamma + beta).dot(kernel) + bias
    d_pred = 2.0 * (pred - yb) / pred.size
    d_bn = d_pred.dot(kernel.T)
    for g, d in zip(grads, ((d_bn * xhat).sum(0), d_bn.sum(0),
                            (xhat * gamma + beta).T.dot(d_pred),
                            d_pred.sum(0))):
      g += d / GRAD_STEPS
    # Keras's unfused batch norm (2-D inputs) updates the moving variance
    # with the batch's biased variance.
    moving_mean = 0.9 * moving_mean + 0.1 * mean
    moving_var = 0.9 * moving_var + 0.1 * var
  gamma, beta, kernel, bias = [
      v - learning_rate * g
      for v, g in zip((gamma, beta, kernel, bias), grads)]
  return [gamma, beta, moving_mean, moving_var, kernel, bias]


def test_batch_norm_normalises_each_micro_batch_and_applies_the_mean():
  rng = np.random.RandomState(3)
  n = GRAD_STEPS * MICRO_BATCH
  x = (rng.randn(n, INPUT_DIM) * 2 + 1).astype(np.float32)
  y = rng.randn(n, OUTPUT_DIM).astype(np.float32)
  before, actual, iterations = _fit(
      _wrapped(OPTIMIZERS['GradientDescent']), MICRO_BATCH, (x, y),
      make_model=_batch_norm_model, epochs=1)
  expected = _batch_norm_cycle_in_numpy(before, x, y, learning_rate=0.1)
  _assert_moved(before, expected)
  _assert_same_weights(actual, expected, rtol=1e-4, atol=1e-5)
  assert iterations == GRAD_STEPS


def _embedding_model():
  return keras.Sequential([
      keras.layers.Embedding(50, 4, input_length=INPUT_DIM,
                             embeddings_initializer=(
                                 keras.initializers.RandomNormal(seed=1))),
      keras.layers.Flatten(),
      keras.layers.Dense(OUTPUT_DIM,
                         kernel_initializer=keras.initializers.RandomNormal(
                             seed=2)),
  ])


@pytest.mark.parametrize('name', ['Adagrad', 'Adam'])
def test_fit_with_an_embedding_layer_matches_the_large_batch(name):
  """Keras's Embedding gives sparse gradients: the wrapper's table path."""
  make_optimizer = {
      'Adagrad': lambda: tf.compat.v1.train.AdagradOptimizer(0.5),
      'Adam': lambda: tf.compat.v1.train.AdamOptimizer(0.05)}[name]
  rng = np.random.RandomState(0)
  n = GRAD_STEPS * MICRO_BATCH * CYCLES_PER_EPOCH
  data = (rng.randint(0, 50, size=(n, INPUT_DIM)),  # ids, repeats included
          rng.randn(n, OUTPUT_DIM).astype(np.float32))
  before, expected, _ = _fit(make_optimizer, GRAD_STEPS * MICRO_BATCH, data,
                             make_model=_embedding_model)
  _, actual, _ = _fit(_wrapped(make_optimizer), MICRO_BATCH, data,
                      make_model=_embedding_model)
  _assert_moved(before, expected)
  _assert_same_weights(actual, expected)


# ------------------------------------------------ the end-of-fit port check --

def _checked_fit(epochs, rows):
  """Fits the wrapper at the micro-batch with the port-check callback;
  returns its warnings."""
  tf.compat.v1.reset_default_graph()
  keras.backend.clear_session()
  model = _mlp()
  model.compile(optimizer=_wrapped(OPTIMIZERS['GradientDescent'])(),
                loss='mse')
  x, y = _data()
  with training.logged('PortCheckHook') as warned:
    model.fit(x[:rows], y[:rows], batch_size=MICRO_BATCH, epochs=epochs,
              shuffle=False, verbose=0,
              callbacks=[deferred_grad.port_check_callback()])
  return warned


def test_a_fit_ended_mid_cycle_is_named():
  """3 epochs of 2 micro-steps: 6 micro-steps, 1 update and 2 of 4 left."""
  warned = _checked_fit(epochs=3, rows=2 * MICRO_BATCH)
  assert len(warned) == 1, warned
  assert 'accumulated 2 of its 4 micro-batches' in warned[0], warned
  assert 'epochs * steps_per_epoch' in warned[0], warned


def test_a_fit_ended_on_an_update_is_silent():
  assert not _checked_fit(epochs=2, rows=2 * MICRO_BATCH)


# ------------------------------------- Keras's own optimizers and callbacks --

KERAS_OPTIMIZERS = {
    'SGD': lambda: keras.optimizers.legacy.SGD(0.1),
    'momentum': lambda: keras.optimizers.legacy.SGD(0.05, momentum=0.9,
                                                    nesterov=True),
    'Adam': lambda: keras.optimizers.legacy.Adam(1e-2),
    'RMSprop': lambda: keras.optimizers.legacy.RMSprop(1e-2),
    'Adagrad': lambda: keras.optimizers.legacy.Adagrad(0.1),
}


def _halving(epoch, learning_rate):
  del learning_rate
  return 0.02 * 0.5 ** epoch


def _keras_fit(make_optimizer, batch_size, callbacks, tmp_path=None):
  """Fits the MLP for EPOCHS + 1 epochs; returns (weights, the learning
  rate each epoch trained with, the optimizer's iterations)."""
  rates = []
  recorder = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: rates.append(
          float(keras.backend.get_value(model.optimizer.lr))))
  tf.compat.v1.reset_default_graph()
  keras.backend.clear_session()
  model = _mlp()
  model.compile(optimizer=make_optimizer(), loss='mse')
  callbacks = [make() for make in callbacks] + [recorder]
  if tmp_path is not None:  # each epoch, as the script did
    callbacks.append(keras.callbacks.ModelCheckpoint(
        str(tmp_path / 'weights-{epoch}.h5'), save_weights_only=True))
  x, y = _data()
  model.fit(x, y, batch_size=batch_size, epochs=EPOCHS + 1, shuffle=False,
            verbose=0, callbacks=callbacks)
  return (model.get_weights(), rates,
          keras.backend.get_value(model.optimizer.iterations))


@pytest.mark.parametrize('name', sorted(KERAS_OPTIMIZERS))
def test_a_keras_optimizer_with_a_schedule_matches_the_large_batch(
    name, tmp_path):
  """The Keras 2 script: its own optimizer, LearningRateScheduler and
  ModelCheckpoint; ported with keras_optimizer and 'updates', fit at the
  micro-batch trains as fit at the large batch with the same optimizer."""
  scheduler = lambda: keras.callbacks.LearningRateScheduler(_halving)
  expected, rates, iterations = _keras_fit(
      KERAS_OPTIMIZERS[name], GRAD_STEPS * MICRO_BATCH, [scheduler])
  actual, port_rates, port_iterations = _keras_fit(
      lambda: deferred_grad.keras_optimizer(
          KERAS_OPTIMIZERS[name](), GRAD_STEPS,
          global_step_counts='updates'),
      MICRO_BATCH, [scheduler, deferred_grad.port_check_callback],
      tmp_path)
  _assert_same_weights(actual, expected)
  assert port_rates == rates  # float32 values: exactly the same
  np.testing.assert_allclose(rates, [0.02 * 0.5 ** e for e in range(EPOCHS + 1)],
                             rtol=1e-6)
  assert port_iterations == iterations == (EPOCHS + 1) * CYCLES_PER_EPOCH
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      'weights-%d.h5' % (e + 1) for e in range(EPOCHS + 1)]
  # The control: the same optimizer unwrapped at the micro-batch.
  wrong, _, _ = _keras_fit(KERAS_OPTIMIZERS[name], MICRO_BATCH, [scheduler])
  assert max(np.abs(w - e).max() for w, e in zip(wrong, expected)) > 1e-3


def test_reduce_lr_on_plateau_sets_the_rate_the_next_update_uses():
  """min_delta so large that every epoch is a plateau: the rate halves at
  each epoch's end, in the port as in the large batch (whose epoch losses
  are the port's: a cycle's micro-batches see the same weights)."""
  plateau = lambda: keras.callbacks.ReduceLROnPlateau(
      monitor='loss', factor=0.5, patience=0, min_delta=1e3, min_lr=0.0)
  expected, rates, _ = _keras_fit(KERAS_OPTIMIZERS['SGD'],
                                  GRAD_STEPS * MICRO_BATCH, [plateau])
  actual, port_rates, _ = _keras_fit(
      lambda: deferred_grad.keras_optimizer(KERAS_OPTIMIZERS['SGD'](),
                                            GRAD_STEPS),
      MICRO_BATCH, [plateau])
  np.testing.assert_allclose(port_rates, rates, rtol=1e-6)
  # Halved after the second and third epochs: the test bites.
  np.testing.assert_allclose(rates, [0.1, 0.05, 0.025], rtol=1e-6)
  _assert_same_weights(actual, expected)


def test_keras_optimizer_refuses_what_it_cannot_port():
  with pytest.raises(TypeError, match='Keras 2 legacy optimizer'):
    deferred_grad.keras_optimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), GRAD_STEPS)
  with pytest.raises(ValueError, match='clipnorm=1.0.*clip_norm='):
    deferred_grad.keras_optimizer(
        keras.optimizers.legacy.SGD(0.1, clipnorm=1.0), GRAD_STEPS)


def test_the_keras_optimizer_s_state_is_in_the_model_s_checkpoint(tmp_path):
  """save_weights (TensorFlow format) holds the wrapped Keras optimizer's
  slots and iterations; load_weights restores them into a new model."""
  def trained(fit_first):
    tf.compat.v1.reset_default_graph()
    keras.backend.clear_session()
    model = _mlp()
    optimizer = deferred_grad.keras_optimizer(
        keras.optimizers.legacy.Adam(1e-2), GRAD_STEPS,
        global_step_counts='updates')
    model.compile(optimizer=optimizer, loss='mse')
    x, y = _data()
    model.fit(x[:GRAD_STEPS * MICRO_BATCH * (2 if fit_first else 1)],
              y[:GRAD_STEPS * MICRO_BATCH * (2 if fit_first else 1)],
              batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    return model, optimizer

  model, optimizer = trained(True)
  saved = keras.backend.batch_get_value(optimizer.keras_optimizer.weights)
  model.save_weights(str(tmp_path / 'ckpt'))
  model, optimizer = trained(False)
  assert keras.backend.get_value(optimizer.keras_optimizer.iterations) == 1
  model.load_weights(str(tmp_path / 'ckpt'))
  restored = keras.backend.batch_get_value(optimizer.keras_optimizer.weights)
  assert int(restored[0]) == int(saved[0]) == 2  # Adam's iterations
  for got, want in zip(restored, saved):
    np.testing.assert_allclose(got, want, rtol=1e-6)
