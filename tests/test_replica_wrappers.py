"""Wrappers built inside the replica function, as an Estimator model_fn does.

Under `train_distribute=MirroredStrategy` an Estimator calls `model_fn` once
per replica, so each replica builds its own wrapper and wrapped optimizer.
Every combination of keywords and dtypes that trains with one wrapper built
outside the replica function trains the same with one built inside it.
"""

import numpy as np
import pytest
import tensorflow as tf

import models
import training
from training import MirroredTrainer

GRAD_STEPS = 3
CYCLES = 2
FLOAT64 = {'dtype': tf.float64}

# (model, model_kwargs, weighted, wrapper keywords)
CASES = {
    'dense': ('mlp', None, False, {}),
    'dense_float64': ('mlp', FLOAT64, False, {}),
    'table': ('embedding', None, False, {}),
    'table_float64': ('embedding', FLOAT64, False, {}),
    'table_float64_weighted': ('embedding', FLOAT64, True, {}),
    'table_as_dense': ('embedding', None, False, {'sparse_as_dense': True}),
    'weighted_tokens': ('token_embedding', None, True, {}),
    'policy': ('embedding', FLOAT64, False,
               {'nonfinite_policy': 'skip_micro_batch'}),
    'policy_weighted': ('token_embedding', None, True,
                        {'nonfinite_policy': 'skip_cycle'}),
    'clip_norm': ('embedding', None, False, {'clip_norm': 0.05}),
    'clip_norm_float64': ('mlp', FLOAT64, False, {'clip_norm': 0.05}),
    'sum': ('mlp', None, False, {'aggregation': 'sum'}),
    'sum_weighted': ('token_embedding', None, True, {'aggregation': 'sum'}),
    'accumulator_dtype': ('mlp', None, False,
                          {'accumulator_dtype': tf.float64}),
    'schedule': ('embedding', FLOAT64, False, {'schedule': 'callable'}),
    'schedule_tensor': ('token_embedding', None, True, {'schedule': 'tensor'}),
    'own_counter': ('embedding', None, False, {'use_global_step': False}),
}


def _weight_fn(model):
  """The micro-batch's weight: its tokens, or (alike) its examples as 1.5."""
  if model.startswith('token'):
    return models.token_weight
  return lambda ids, y: 1.5 * tf.cast(tf.shape(ids)[0], tf.float32)


def _data(model):
  micro_batch = training.REPLICAS * (
      models.MAX_TOKENS if model.startswith('token') else models.MICRO_BATCH)
  return models.MODELS[model][0](CYCLES, GRAD_STEPS * micro_batch)


def _train(case, per_replica, optimizer):
  model, model_kwargs, weighted, kwargs = CASES[case]
  kwargs = dict(kwargs)
  use_global_step = kwargs.pop('use_global_step', True)
  trainer = MirroredTrainer(
      models.OPTIMIZERS[optimizer], GRAD_STEPS, use_global_step, model=model,
      model_kwargs=model_kwargs,
      weight_fn=_weight_fn(model) if weighted else None,
      wrapper_per_replica=per_replica, **kwargs)
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    snapshots = trainer.run(session, _data(model))
    step = session.run(trainer.global_step)
  return snapshots, step


@pytest.mark.parametrize('case', sorted(CASES))
def test_a_wrapper_per_replica_trains_as_one_outside(case):
  optimizer = 'Adam' if 'dense' in case else 'Momentum'
  expected, expected_step = _train(case, False, optimizer)
  actual, step = _train(case, True, optimizer)
  assert step == expected_step
  float64 = CASES[case][1] == FLOAT64
  training.assert_same_training(actual, expected,
                                rtol=1e-12 if float64 else 1e-6, atol=0)


@pytest.mark.parametrize('case', ['dense_float64', 'table_float64',
                                  'table_float64_weighted'])
def test_a_wrapper_per_replica_matches_the_large_batch(case):
  model, model_kwargs, weighted, _ = CASES[case]
  make_optimizer = models.OPTIMIZERS['Momentum']
  expected, _, _ = training.train(make_optimizer, _data(model), model=model,
                                  model_kwargs=model_kwargs)
  actual, _ = _train(case, True, 'Momentum')
  float64 = model_kwargs == FLOAT64
  if not weighted:
    training.assert_same_training(actual, expected,
                                  rtol=1e-12 if float64 else training.RTOL,
                                  atol=0 if float64 else training.ATOL)
  else:  # the embedding model's micro-batches weigh alike: the plain mean
    training.assert_same_training(actual, expected,
                                  rtol=1e-12, atol=0)


def test_per_replica_wrappers_share_one_cycle_and_its_state():
  trainer = MirroredTrainer(models.OPTIMIZERS['Momentum'], GRAD_STEPS,
                            model='embedding', model_kwargs=FLOAT64,
                            wrapper_per_replica=True,
                            nonfinite_policy='skip_cycle')
  with trainer.graph.as_default():
    names = sorted(v.op.name for v in tf.compat.v1.global_variables())
  assert names.count('table/GradientAccumulator') == 1
  assert [n for n in names if n.startswith('table/GradientAccumulator')] == [
      'table/GradientAccumulator']
  assert len([n for n in names if 'skipped_cycles' in n]) == 1
  accumulator = trainer.optimizer.get_slot(trainer.variables['table'],
                                           'grad_accum')
  assert accumulator.dtype.base_dtype == tf.float64
  ids, y = _data('embedding')
  with tf.compat.v1.Session(graph=trainer.graph) as session:
    session.run(trainer.init_op)
    trainer.micro_step(session, ids[0][:training.REPLICAS], y[0][:2])
    listed, rows = training.listed_rows(session.run(accumulator),
                                        [models.EMBEDDING_DIM])
  # Both replicas' rows, once: the replicas share one list.
  assert len(listed) == training.REPLICAS * models.IDS_PER_EXAMPLE
  assert rows.dtype == np.float64
