"""Keywords in combination, drawn at random, against the large batch.

Each case draws one wrapper configuration (model, optimizer, `grad_steps`
as an int or a schedule of a constant length: a tensor under
MirroredStrategy, a callable everywhere; both code paths, MirroredStrategy with the
wrapper built once or inside the replica function, `sparse_as_dense`,
`nonfinite_policy`, `accumulator_dtype`, `clip_norm`, `aggregation`,
`micro_batch_weight`, `xla_num_partitions`, `global_step_counts`,
partitioned tables, with or without a `global_step`) from a seed of its own, trains it on micro-batches
and compares every variable after each cycle with the bare optimizer
trained on the large batches. What the keywords change is put into the
reference's gradients, independently of the wrapper: 'sum' applies
`grad_steps` (times the weight) times the mean, `clip_norm` clips the
(densified) large-batch gradient to that global norm, and `sparse_as_dense`
hands the bare optimizer a dense gradient. The data are finite and the
weights equal, so a `nonfinite_policy` and a weighted mean change nothing.

Half as many of the draws are stopped after a drawn micro-step, saved with
`deferred_grad.Saver`, restored into a new graph and continued: they end with
the uninterrupted run's weights.

DEFERRED_GRAD_COMBINATIONS=N draws N cases (default 24); the seeds are the
case numbers, so a failure reruns alone (`-k case_<n>`).
"""

import os
import random

import pytest
import tensorflow as tf

import deferred_grad
import models
import training

CASES = int(os.environ.get('DEFERRED_GRAD_COMBINATIONS', '24'))
RESUMED = (CASES + 1) // 2  # cases stopped, saved and resumed
WEIGHT = 2.0


def _draw(case):
  """The configuration of case `case` (a dict), from its own seed."""
  rng = random.Random(case)
  model = rng.choice(['mlp', 'embedding', 'embedding'])
  mirrored = rng.random() < 0.35
  # ProximalAdagrad fails under MirroredStrategy without the wrapper too.
  names = sorted(set(models.OPTIMIZERS) -
                 ({'ProximalAdagrad', 'AdagradDA'} if mirrored else set()))
  config = dict(
      model=model, mirrored=mirrored, optimizer=rng.choice(names),
      grad_steps=rng.choice([1, 2, 3, 4]),
      kind=rng.choice(['int', 'int', 'tensor', 'callable']),
      weighted=rng.random() < 0.3,
      use_global_step=rng.random() < 0.8,
      partitions=(rng.choice([None, 2, 3])
                  if model == 'embedding' and not mirrored else None),
      per_replica=mirrored and rng.random() < 0.5,
      wrapper=dict(
          use_tpu=not mirrored and rng.random() < 0.4,
          sparse_as_dense=rng.random() < 0.3,
          nonfinite_policy=rng.choice(
              [None, 'skip_micro_batch', 'skip_cycle']),
          accumulator_dtype=rng.choice([None, tf.float32, tf.float64]),
          clip_norm=rng.choice([None, 1e6, 0.01]),
          aggregation=rng.choice(['mean', 'mean', 'sum'])))
  if rng.random() < 0.2:
    config['wrapper']['xla_num_partitions'] = 2
  # Drawn last: the draws above stay those of earlier releases' cases.
  config['wrapper']['global_step_counts'] = rng.choice(
      ['micro_steps', 'micro_steps', 'updates'])
  if config['optimizer'] == 'AdagradDA':
    # Reads the step it is given: `applied_updates` of an int cycle.
    config.update(kind='int', use_global_step=True)
  return config


def _reference_optimizer(config):
  """The bare optimizer's factory, its gradients changed as the keywords
  change what the wrapper applies (see the module docstring)."""
  make_optimizer = models.OPTIMIZERS[config['optimizer']]
  wrapper = config['wrapper']
  factor = 1.0
  if wrapper['aggregation'] == 'sum':
    factor = config['grad_steps'] * (WEIGHT if config['weighted'] else 1.0)
  densify = wrapper['sparse_as_dense'] and config['model'] == 'embedding'
  clip_norm = wrapper['clip_norm']

  def scaled(gradient, scale):
    if isinstance(gradient, tf.IndexedSlices):
      return tf.IndexedSlices(gradient.values * scale, gradient.indices,
                              gradient.dense_shape)
    return gradient * scale

  def transform(pairs):
    pairs = [(tf.convert_to_tensor(g) if densify else g, v)
             for g, v in pairs]
    pairs = [(scaled(g, factor), v) for g, v in pairs]
    if clip_norm is not None:
      norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(
          tf.convert_to_tensor(g))) for g, _ in pairs]))
      scale = clip_norm / tf.maximum(norm, clip_norm)
      pairs = [(scaled(g, scale), v) for g, v in pairs]
    return pairs

  if factor == 1.0 and not densify and clip_norm is None:
    return make_optimizer
  return models.with_gradient_transform(make_optimizer, transform)


def _grad_steps(config):
  """`grad_steps` of the drawn kind in one process: an int, or a callable
  (a 'tensor' too: `Trainer` makes its graph itself)."""
  steps = config['grad_steps']
  if config['kind'] == 'int':
    return steps
  return lambda updates: tf.constant(steps, tf.int64)


def _trainer(config):
  """The wrapper's `Trainer` (or `MirroredTrainer`) of `config`, with a
  `deferred_grad.Saver` (`saver`) built after its train op."""
  steps = config['grad_steps']
  make_optimizer = models.OPTIMIZERS[config['optimizer']]
  weight_fn = ((lambda *inputs: tf.constant(WEIGHT))
               if config['weighted'] else None)
  if config['mirrored']:
    trainer = training.MirroredTrainer(
        make_optimizer, steps, use_global_step=config['use_global_step'],
        model=config['model'], weight_fn=weight_fn,
        wrapper_per_replica=config['per_replica'],
        schedule=None if config['kind'] == 'int' else config['kind'],
        **config['wrapper'])
  else:
    trainer = training.Trainer(
        make_optimizer, _grad_steps(config),
        use_global_step=config['use_global_step'],
        # (Counting updates, global_step is the updates.)
        step_tensor=None if config['kind'] != 'int' else (
            'global_step' if config['wrapper']['global_step_counts'] ==
            'updates' else 'auto'),
        model=config['model'], model_kwargs=_model_kwargs(config),
        weight_fn=weight_fn, **config['wrapper'])
    trainer.micro_steps = steps
  with trainer.graph.as_default():
    trainer.saver = deferred_grad.Saver()
  return trainer


def _model_kwargs(config):
  return ({'partitions': config['partitions']} if config['partitions']
          else None)


def _data(config, case):
  replicas = training.REPLICAS if config['mirrored'] else 1
  make_data = models.MODELS[config['model']][0]
  return make_data(models.CYCLES,
                   models.MICRO_BATCH * config['grad_steps'] * replicas,
                   seed=case)


@pytest.mark.parametrize('case', range(CASES),
                         ids=['case_%d' % i for i in range(CASES)])
def test_a_drawn_combination_trains_like_the_large_batch(case):
  config = _draw(case)
  data = _data(config, case)
  expected, _, _ = training.train(_reference_optimizer(config), data,
                                  model=config['model'],
                                  model_kwargs=_model_kwargs(config))
  trainer = _trainer(config)
  with trainer.session() as session:
    actual = trainer.run(session, data)
  try:
    training.assert_same_training(actual, expected, rtol=2e-5, atol=2e-6)
  except AssertionError as error:
    raise AssertionError('%s\nconfiguration: %r' % (error, config))


def _micro_batches(trainer, data):
  """The micro-batches of every cycle of `data`, in order."""
  micro_batches = []
  for batch in zip(*data):
    size = len(batch[0]) // trainer.micro_steps
    micro_batches.extend([part[k * size:(k + 1) * size] for part in batch]
                         for k in range(trainer.micro_steps))
  return micro_batches


@pytest.mark.parametrize('case', range(RESUMED),
                         ids=['case_%d' % i for i in range(RESUMED)])
def test_a_drawn_combination_resumes_where_it_stopped(case, tmp_path):
  """Stopped after a drawn micro-step (mid-cycle or not), saved with
  `deferred_grad.Saver` and restored into a new graph, it ends with the
  uninterrupted run's weights."""
  config = _draw(case)
  if config['grad_steps'] == 1:
    config['grad_steps'] = 2  # a cycle to stop in
  data = _data(config, case)
  trainer = _trainer(config)
  micro_batches = _micro_batches(trainer, data)
  with trainer.session() as session:
    for batch in micro_batches:
      trainer.micro_step(session, *batch)
    expected = session.run(trainer.variables)
  stop = random.Random(case).randrange(1, len(micro_batches))
  trainer = _trainer(config)
  with trainer.session() as session:
    for batch in micro_batches[:stop]:
      trainer.micro_step(session, *batch)
    path = trainer.saver.save(session, str(tmp_path / 'stopped'))
  trainer = _trainer(config)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    trainer.saver.restore(session, path)
    for batch in micro_batches[stop:]:
      trainer.micro_step(session, *batch)
    actual = session.run(trainer.variables)
  try:
    training.assert_same_training([actual], [expected], rtol=1e-6,
                                  atol=1e-7)
  except AssertionError as error:
    raise AssertionError('%s\nstopped after micro-step %d; configuration: '
                         '%r' % (error, stop, config))
