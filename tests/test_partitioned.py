"""Embedding tables as TF1 feature columns make them.

`tf.compat.v1.feature_column` puts a model's tables under the variable
scope's partitioner (canned Estimators always set one), combines a
feature's rows (`embedding_lookup_sparse`: mean, sqrtn, sum), shares one
table between features, and weighs ids. Each model here trains through the
wrapper on micro-batches as the bare optimizer does on batches GRAD_STEPS
times larger, and a job stopped mid-cycle resumes exactly: a partitioned
table's accumulator is one list of rows per partition, saved as a variable
of its own (`<table>/part_<n>/GradientAccumulator`).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import deferred_grad
import training

fc = tf.compat.v1.feature_column

GRAD_STEPS = 3
CYCLES = 3
MICRO_BATCH = 4
VOCABULARY = 12
WORDS = ['w%d' % i for i in range(8)]
DIMENSION = 3
_INITIALIZER = tf.compat.v1.truncated_normal_initializer(stddev=0.5, seed=3)


def _identity(key):
  return fc.categorical_column_with_identity(key, VOCABULARY)


def _embedding(categorical, combiner='mean'):
  return fc.embedding_column(categorical, DIMENSION, combiner=combiner,
                             initializer=_INITIALIZER)


# name -> (columns of an input layer (None: a linear model), their maker)
MODELS = {
    'mean': lambda: [_embedding(_identity('a'))],
    'sqrtn': lambda: [_embedding(_identity('a'), 'sqrtn')],
    'sum': lambda: [_embedding(_identity('a'), 'sum')],
    'shared': lambda: fc.shared_embedding_columns(
        [_identity('a'), _identity('b')], DIMENSION, initializer=_INITIALIZER),
    'weighted': lambda: [_embedding(
        fc.weighted_categorical_column(_identity('a'), 'a_weight'), 'sum')],
    'linear': lambda: [
        fc.categorical_column_with_hash_bucket('w', 16),
        fc.categorical_column_with_vocabulary_list('v', WORDS),
        fc.crossed_column([_identity('a'), 'w'], 32),
        _identity('b')],
}

OPTIMIZERS = {
    'Adagrad': lambda: tf.compat.v1.train.AdagradOptimizer(0.5),
    'Momentum': lambda: tf.compat.v1.train.MomentumOptimizer(0.25, 0.5),
    'Ftrl': lambda: tf.compat.v1.train.FtrlOptimizer(
        0.5, l1_regularization_strength=0.01,
        l2_regularization_strength=0.01),
}


def _examples(count, seed=0):
  """`count` examples: 1 to 3 ids of 'a' (weighted) and 'b', two words."""
  rng = np.random.RandomState(seed)
  examples = []
  for _ in range(count):
    a = rng.randint(0, VOCABULARY, size=rng.randint(1, 4))
    examples.append({
        'a': a, 'a_weight': rng.uniform(0.5, 2.0, size=len(a)),
        'b': rng.randint(0, VOCABULARY, size=rng.randint(1, 4)),
        'w': np.array([WORDS[rng.randint(len(WORDS))]]),
        'v': np.array([WORDS[rng.randint(len(WORDS))]]),
        'y': rng.randn()})
  return examples


def _sparse(rows, dtype):
  indices = [[i, j] for i, row in enumerate(rows) for j in range(len(row))]
  values = np.array([v for row in rows for v in row], dtype)
  return tf.compat.v1.SparseTensorValue(
      np.array(indices, np.int64).reshape(-1, 2), values,
      np.array([len(rows), max(len(row) for row in rows)], np.int64))


_KEYS = {'a': tf.int64, 'a_weight': tf.float32, 'b': tf.int64,
         'w': tf.string, 'v': tf.string}


class _Model(object):
  """A feature-column model and its train op, in a graph of its own.

  Args:
    model: a key of MODELS.
    make_optimizer: a key of OPTIMIZERS.
    grad_steps: None for the bare optimizer, else the wrapper's.
    partitions: None, or the number of parts of every table.
    **kwargs: for the wrapper.
  """

  def __init__(self, model, optimizer, grad_steps, partitions=None,
               **kwargs):
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.compat.v1.set_random_seed(1)
      self.features = {key: tf.compat.v1.sparse_placeholder(dtype)
                       for key, dtype in _KEYS.items()}
      self.y = tf.compat.v1.placeholder(tf.float32, [None])
      partitioner = (tf.compat.v1.fixed_size_partitioner(partitions)
                     if partitions else None)
      with tf.compat.v1.variable_scope('model', partitioner=partitioner):
        if model == 'linear':
          logits = fc.linear_model(self.features, MODELS[model]())
        else:
          net = fc.input_layer(self.features, MODELS[model]())
      if model != 'linear':  # a dense head, not partitioned
        kernel = tf.compat.v1.get_variable(
            'kernel', initializer=np.linspace(
                -1.0, 1.0, net.shape[1]).astype(np.float32)[:, None])
        logits = tf.matmul(net, kernel)
      loss = tf.reduce_mean(tf.square(tf.reshape(logits, [-1]) - self.y))
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      self.optimizer = OPTIMIZERS[optimizer]()
      if grad_steps:
        self.optimizer = deferred_grad.GradientAggregationOptimizer(
            self.optimizer, grad_steps, **kwargs)
      self.train_op = self.optimizer.minimize(loss,
                                              global_step=self.global_step)
      self.variables = {v.op.name: v
                        for v in tf.compat.v1.trainable_variables()}
      self.init_op = tf.group(tf.compat.v1.global_variables_initializer(),
                              tf.compat.v1.tables_initializer())
      self.micro_steps = grad_steps or 1

  def feed(self, examples):
    feed = {placeholder: _sparse([e[key] for e in examples],
                                 _KEYS[key].as_numpy_dtype)
            for key, placeholder in self.features.items()}
    feed[self.y] = np.array([e['y'] for e in examples], np.float32)
    return feed

  def run(self, session, examples, steps):
    """Runs micro-steps `steps` on `examples`, a large batch per cycle."""
    size = len(examples) // (CYCLES * self.micro_steps)
    for step in steps:
      session.run(self.train_op,
                  self.feed(examples[step * size:(step + 1) * size]))

  def train(self, examples):
    """Weights after each cycle."""
    snapshots = []
    with tf.compat.v1.Session(graph=self.graph) as session:
      session.run(self.init_op)
      for cycle in range(CYCLES):
        self.run(session, examples, range(cycle * self.micro_steps,
                                          (cycle + 1) * self.micro_steps))
        snapshots.append(session.run(self.variables))
    return snapshots


def _check_matches_large_batch(model, optimizer, partitions, **kwargs):
  examples = _examples(CYCLES * GRAD_STEPS * MICRO_BATCH)
  expected = _Model(model, optimizer, None, partitions).train(examples)
  actual = _Model(model, optimizer, GRAD_STEPS, partitions,
                  **kwargs).train(examples)
  training.assert_same_training(actual, expected)
  return actual


@pytest.mark.parametrize('partitions', [None, 1, 3])
@pytest.mark.parametrize('model', sorted(MODELS))
def test_feature_columns_match_the_large_batch(model, partitions):
  optimizer = 'Ftrl' if model == 'linear' else 'Adagrad'
  trained = _check_matches_large_batch(model, optimizer, partitions)
  if partitions:
    assert any('/part_%d' % (partitions - 1) in name for name in trained[0])


@pytest.mark.parametrize('model', ['mean', 'shared', 'linear'])
def test_partitioned_feature_columns_on_the_tpu_path(model):
  _check_matches_large_batch(model, 'Momentum', 2, use_tpu=True)


def test_partitioned_tables_as_dense_match_the_large_batch():
  """Densified, as the original: exact for Adagrad (not for Momentum, whose
  dense update also decays the rows the large batch leaves alone)."""
  _check_matches_large_batch('weighted', 'Adagrad', 2, sparse_as_dense=True)


STOP_STEP = GRAD_STEPS * 2 + 1  # one micro-step into the third cycle


def _train_monitored(model, examples, checkpoint_dir, last_step):
  """Trains under MonitoredTrainingSession (it saves at its first step)."""
  with model.graph.as_default():
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=last_step),
             tf.compat.v1.train.CheckpointSaverHook(checkpoint_dir,
                                                    save_steps=2)]
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, hooks=hooks, save_checkpoint_secs=None,
        save_checkpoint_steps=None, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None) as session:
      while not session.should_stop():
        step = session.run(model.global_step)
        model.run(session, examples, [step])


@pytest.mark.parametrize('sparse_as_dense', [False, True],
                         ids=['list', 'dense'])
@pytest.mark.parametrize('partitions', [1, 2, 3])
def test_a_partitioned_table_resumes_mid_cycle(partitions, sparse_as_dense,
                                               use_tpu, tmp_path):
  """Stopped one micro-step into a cycle and resumed from the checkpoint,
  it trains as the uninterrupted job, to the bit."""
  examples = _examples(CYCLES * GRAD_STEPS * MICRO_BATCH)
  kwargs = dict(sparse_as_dense=sparse_as_dense, use_tpu=use_tpu)
  expected = _Model('weighted', 'Momentum', GRAD_STEPS, partitions,
                    **kwargs).train(examples)[-1]
  checkpoint_dir = str(tmp_path)
  _train_monitored(_Model('weighted', 'Momentum', GRAD_STEPS, partitions,
                          **kwargs), examples, checkpoint_dir, STOP_STEP)
  keys = {name for name, _ in tf.train.list_variables(checkpoint_dir)}
  if sparse_as_dense:  # the original's: slices of one whole accumulator
    assert 'model/input_layer/a_weighted_by_a_weight_embedding/' \
        'embedding_weights/GradientAccumulator' in keys
  else:  # a list of rows per partition
    for part in range(partitions):
      assert ('model/input_layer/a_weighted_by_a_weight_embedding/'
              'embedding_weights/part_%d/GradientAccumulator' % part) in keys
  resumed = _Model('weighted', 'Momentum', GRAD_STEPS, partitions, **kwargs)
  _train_monitored(resumed, examples, checkpoint_dir, CYCLES * GRAD_STEPS)
  actual = {name: tf.train.load_variable(checkpoint_dir, name)
            for name in expected if '/part_' not in name}
  for name, value in actual.items():
    np.testing.assert_array_equal(value, expected[name], err_msg=name)
  reader = tf.train.load_checkpoint(checkpoint_dir)
  table = [n for n in expected if '/part_' in n]
  whole = np.concatenate([expected[n] for n in sorted(table)])
  np.testing.assert_array_equal(
      reader.get_tensor(table[0].rsplit('/part_', 1)[0]), whole)


def test_a_partitioned_checkpoint_restores_into_a_graph_without_the_wrapper(
    tmp_path):
  """Written mid-cycle by the wrapper: a bare graph's Saver takes the model
  (and the wrapped optimizer's slots) from it."""
  examples = _examples(CYCLES * GRAD_STEPS * MICRO_BATCH)
  wrapped = _Model('shared', 'Adagrad', GRAD_STEPS, 2)
  path = os.path.join(str(tmp_path), 'model')
  with tf.compat.v1.Session(graph=wrapped.graph) as session:
    session.run(wrapped.init_op)
    wrapped.run(session, examples, range(STOP_STEP))
    with wrapped.graph.as_default():
      tf.compat.v1.train.Saver().save(session, path)
    values = session.run(wrapped.variables)
  bare = _Model('shared', 'Adagrad', None, 2)
  with tf.compat.v1.Session(graph=bare.graph) as session, \
      bare.graph.as_default():
    tf.compat.v1.train.Saver().restore(session, path)
    restored = session.run(bare.variables)
  for name, value in values.items():
    np.testing.assert_array_equal(restored[name], value)


@pytest.mark.parametrize('partitions', [1, 3])
def test_the_original_s_checkpoint_of_a_partitioned_table(partitions,
                                                          use_tpu, tmp_path):
  """The original kept one dense accumulator in slices, as it keeps the
  table (`<table>/GradientAccumulator`). deferred_grad.Saver restores each
  partition's list from its slice (turned into the rows that are not zero
  at the next micro-step), and the cycle goes on as it would have."""
  examples = _examples(CYCLES * GRAD_STEPS * MICRO_BATCH)
  kwargs = dict(use_tpu=use_tpu)
  expected = _Model('weighted', 'Momentum', GRAD_STEPS, partitions,
                    **kwargs).train(examples)[-1]
  written = _Model('weighted', 'Momentum', GRAD_STEPS, partitions, **kwargs)
  with tf.compat.v1.Session(graph=written.graph) as session:
    session.run(written.init_op)
    written.run(session, examples, range(STOP_STEP))
    with written.graph.as_default():
      state = {v.op.name: session.run(v)
               for v in tf.compat.v1.global_variables()}
  # As the original saved it: each partitioned name whole, its accumulator
  # dense (the lists' rows added up where they were looked up).
  original = {}
  for name in sorted(state):
    if '/part_' not in name:
      original[name] = state[name]
      continue
    whole, part = name.split('/part_', 1)
    index, _, slot = part.partition('/')
    key = whole + ('/' + slot if slot else '')
    value = state[name]
    if slot == 'GradientAccumulator':
      value = training.dense_accumulator(
          value, state[whole + '/part_' + index].shape)
    original.setdefault(key, []).append((int(index), value))
  original = {key: (np.concatenate([v for _, v in sorted(value)])
                    if isinstance(value, list) else value)
              for key, value in original.items()}
  assert any(np.any(value) for key, value in original.items()
             if key.endswith('GradientAccumulator'))
  path = os.path.join(str(tmp_path), 'original')
  with tf.Graph().as_default():
    variables = [tf.compat.v1.Variable(value, name=key)
                 for key, value in original.items()]
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      tf.compat.v1.train.Saver(variables).save(session, path)
  resumed = _Model('weighted', 'Momentum', GRAD_STEPS, partitions, **kwargs)
  with tf.compat.v1.Session(graph=resumed.graph) as session, \
      resumed.graph.as_default():
    session.run(tf.compat.v1.tables_initializer())
    deferred_grad.Saver().restore(session, path)
    resumed.run(session, examples, range(STOP_STEP, CYCLES * GRAD_STEPS))
    actual = session.run(resumed.variables)
  for name, value in expected.items():
    np.testing.assert_allclose(actual[name], value, rtol=1e-6, atol=1e-7,
                               err_msg=name)
