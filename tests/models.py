"""Models, data and optimizers the tests train, with numpy references.

Every model exists in a few sizes of data (`make_*_data`), and its loss
function builds the variables in the current graph and returns
(loss, {name: variable}).
"""

import numpy as np
import tensorflow as tf

import behavior  # pylint: disable=unused-import

INPUT_DIM, HIDDEN_DIM, OUTPUT_DIM = 4, 5, 3
MICRO_BATCH = 3
CYCLES = 3
_l1_l2 = dict(l1_regularization_strength=0.001, l2_regularization_strength=0.01)

# Every tf.compat.v1.train optimizer that takes dense gradients. Each factory
# receives the step tensor that step-dependent optimizers read: the global
# step for large-batch training, `applied_updates` for the wrapper.
OPTIMIZERS = {
    'GradientDescent':
        lambda step: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    'Momentum':
        lambda step: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    'Nesterov':
        lambda step: tf.compat.v1.train.MomentumOptimizer(
            0.1, 0.9, use_nesterov=True),
    'Adam':
        lambda step: tf.compat.v1.train.AdamOptimizer(0.01),
    'Adagrad':
        lambda step: tf.compat.v1.train.AdagradOptimizer(0.1),
    'AdagradDA':
        lambda step: tf.compat.v1.train.AdagradDAOptimizer(
            0.1, global_step=step, **_l1_l2),
    'RMSProp':
        lambda step: tf.compat.v1.train.RMSPropOptimizer(0.01),
    'RMSPropMomentum':
        lambda step: tf.compat.v1.train.RMSPropOptimizer(0.01, momentum=0.9),
    'RMSPropCentered':
        lambda step: tf.compat.v1.train.RMSPropOptimizer(
            0.01, momentum=0.5, centered=True),
    'Adadelta':
        lambda step: tf.compat.v1.train.AdadeltaOptimizer(1.0),
    'Ftrl':
        lambda step: tf.compat.v1.train.FtrlOptimizer(0.1, **_l1_l2),
    'ProximalGradientDescent':
        lambda step: tf.compat.v1.train.ProximalGradientDescentOptimizer(
            0.1, **_l1_l2),
    'ProximalAdagrad':
        lambda step: tf.compat.v1.train.ProximalAdagradOptimizer(
            0.1, **_l1_l2),
}


def keras2():
  """Keras 2: `tf.keras` on TensorFlow 2.15, the tf_keras package after (the
  test is skipped where it is missing)."""
  if tf.__version__.startswith('2.15.'):
    return tf.keras
  import pytest  # pylint: disable=g-import-not-at-top
  return pytest.importorskip(
      'tf_keras', reason='Keras 2 on TensorFlow %s is the tf_keras package: '
      'pip install tf_keras==%s' % (tf.__version__, tf.__version__))


def with_gradient_transform(make_optimizer, transform):
  """An optimizer factory whose optimizers transform what they apply.

  Args:
    make_optimizer: factory taking the step tensor (see OPTIMIZERS).
    transform: function of the list of (gradient, variable) pairs that
      `apply_gradients` receives; returns the pairs to apply.

  Returns:
    A factory like `make_optimizer`.
  """
  def make(step):
    optimizer = make_optimizer(step)
    apply_gradients = optimizer.apply_gradients

    def apply_transformed(grads_and_vars, *args, **kwargs):
      return apply_gradients(transform(list(grads_and_vars)), *args, **kwargs)

    optimizer.apply_gradients = apply_transformed
    return optimizer
  return make


def sgd(step=None):
  del step
  return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def make_data(cycles, batch, seed=0):
  """Fresh inputs and targets for each cycle: [cycles, batch, dim] arrays."""
  rng = np.random.RandomState(seed)
  x = rng.randn(cycles, batch, INPUT_DIM).astype(np.float32)
  y = rng.randn(cycles, batch, OUTPUT_DIM).astype(np.float32)
  return x, y


_INITIAL = {
    name: np.random.RandomState(100 + i).uniform(
        -0.5, 0.5, size=shape).astype(np.float32)
    for i, (name, shape) in enumerate([
        ('w1', [INPUT_DIM, HIDDEN_DIM]),
        ('b1', [HIDDEN_DIM]),
        ('w2', [HIDDEN_DIM, OUTPUT_DIM]),
        ('b2', [OUTPUT_DIM]),
    ])
}


def unknown_shape_variable(value):
  """A float32 variable whose static shape is unknown, in either behaviour."""
  return tf.compat.v1.Variable(np.array(value, np.float32),
                               shape=tf.TensorShape(None), validate_shape=False,
                               name='v')


def model_loss(x, y, with_unused=False, dtype=tf.float32):
  """A small tanh MLP with a mean squared error; returns (loss, variables).

  Args:
    x, y: input and target tensors.
    with_unused: also create a trainable variable the loss ignores (its
      gradient is None).
    dtype: the variables' dtype (the inputs are cast to it).
  """
  x, y = tf.cast(x, dtype), tf.cast(y, dtype)
  variables = {
      name: tf.compat.v1.get_variable(
          name, initializer=value.astype(dtype.as_numpy_dtype), dtype=dtype)
      for name, value in sorted(_INITIAL.items())
  }
  if with_unused:
    variables['unused'] = tf.compat.v1.get_variable(
        'unused', initializer=np.ones([2], np.float32))
  hidden = tf.tanh(tf.matmul(x, variables['w1']) + variables['b1'])
  prediction = tf.matmul(hidden, variables['w2']) + variables['b2']
  return tf.reduce_mean(tf.square(prediction - y)), variables


TABLE_ROWS, EMBEDDING_DIM, IDS_PER_EXAMPLE = 24, 4, 3
_TABLE = np.random.RandomState(7).uniform(
    -0.5, 0.5, size=[TABLE_ROWS, EMBEDDING_DIM]).astype(np.float32)
_PROJECTION = np.random.RandomState(8).uniform(
    -0.5, 0.5, size=[EMBEDDING_DIM, OUTPUT_DIM]).astype(np.float32)


def make_embedding_data(cycles, batch, seed=0):
  """Ids and targets per cycle; each cycle looks up a shifted window of rows.

  Ids repeat within a micro-batch, and every cycle leaves some rows of the
  previous one alone and touches some new ones.
  """
  rng = np.random.RandomState(seed)
  window = TABLE_ROWS // 2
  ids = np.stack([
      rng.randint(0, window, size=(batch, IDS_PER_EXAMPLE)) +
      (cycle * window // 2) % (TABLE_ROWS - window) for cycle in range(cycles)
  ]).astype(np.int32)
  y = rng.randn(cycles, batch, OUTPUT_DIM).astype(np.float32)
  return ids, y


def _table_initializer(shape, dtype=tf.float32, partition_info=None):
  """The fixed table, or the rows of it that one partition holds."""
  offset = partition_info.single_offset(shape) if partition_info else 0
  return tf.constant(_TABLE[offset:offset + shape[0]], dtype)


def embedding_loss(ids, y, partitions=None, dtype=tf.float32):
  """Mean of looked-up rows, projected; returns (loss, variables).

  The table's gradient is a `tf.IndexedSlices`, the projection's is dense.

  Args:
    ids: int32 [batch, IDS_PER_EXAMPLE]; y: float32 [batch, OUTPUT_DIM].
    partitions: split the table into this many variables.
    dtype: the variables' dtype (the targets are cast to it).
  """
  y = tf.cast(y, dtype)
  table = tf.compat.v1.get_variable(
      'table', [TABLE_ROWS, EMBEDDING_DIM], dtype=dtype,
      initializer=_table_initializer,
      partitioner=(tf.compat.v1.fixed_size_partitioner(partitions)
                   if partitions else None))
  projection = tf.compat.v1.get_variable(
      'projection', initializer=_PROJECTION.astype(dtype.as_numpy_dtype),
      dtype=dtype)
  looked_up = tf.nn.embedding_lookup(table, ids)
  prediction = tf.matmul(tf.reduce_mean(looked_up, axis=1), projection)
  # (MirroredStrategy ignores partitioners: one variable there.)
  tables = [table] if isinstance(table, tf.Variable) else list(table)
  variables = {v.name.rsplit(':', 1)[0]: v for v in tables + [projection]}
  return tf.reduce_mean(tf.square(prediction - y)), variables


LINEAR_DIM = 3
LINEAR_INITIAL = np.array([[0.5], [-0.25], [1.0]], np.float32)


def make_linear_data(cycles, batch, seed=0):
  """Inputs, targets and a per-example 'poison' (0: clean) for each cycle."""
  rng = np.random.RandomState(seed)
  x = rng.randn(cycles, batch, LINEAR_DIM).astype(np.float32)
  y = rng.randn(cycles, batch, 1).astype(np.float32)
  return x, y, np.zeros([cycles, batch], np.float32)


def linear_loss(x, y, poison):
  """mean((x w - y)^2) + mean(poison) * sum(w); returns (loss, variables).

  Its gradient, 2/n x^T (x w - y) + mean(poison), is easy in numpy; a NaN or
  inf poison makes it non-finite.
  """
  w = tf.compat.v1.get_variable('w', initializer=LINEAR_INITIAL)
  loss = (tf.reduce_mean(tf.square(tf.matmul(x, w) - y)) +
          tf.reduce_mean(poison) * tf.reduce_sum(w))
  return loss, {'w': w}


def linear_gradient(w, x, y, poison):
  """The gradient of linear_loss, in float64 numpy."""
  x, y = x.astype(np.float64), y.astype(np.float64)
  return 2.0 / len(x) * x.T.dot(x.dot(w) - y) + np.mean(poison)


MAX_TOKENS = 7
# Tokens per micro-batch: a cycle of 4 micro-batches of unequal size.
TOKEN_COUNTS = (3, 7, 1, 5)


PADDING_ID = 0


def make_token_data(cycles, batch, seed=0, padding_id=None):
  """Token inputs, targets and masks: each MAX_TOKENS rows a micro-batch.

  `batch` is a multiple of MAX_TOKENS; the micro-batches of a cycle hold
  TOKEN_COUNTS real tokens in turn (rotated every cycle), the rest padding.
  Returns (x, ids, y, mask): x [cycles, batch, INPUT_DIM] float32, ids
  [cycles, batch] int32 (rows of the embedding table), y [cycles, batch,
  OUTPUT_DIM], mask [cycles, batch] float32. With `padding_id`, every
  padding position looks up that row and no real token does: its gradient
  is always exactly zero.
  """
  rng = np.random.RandomState(seed)
  x = rng.randn(cycles, batch, INPUT_DIM).astype(np.float32)
  ids = rng.randint(0, TABLE_ROWS, size=(cycles, batch)).astype(np.int32)
  y = rng.randn(cycles, batch, OUTPUT_DIM).astype(np.float32)
  mask = np.zeros([cycles, batch], np.float32)
  for cycle in range(cycles):
    for part in range(batch // MAX_TOKENS):
      count = TOKEN_COUNTS[(part + cycle) % len(TOKEN_COUNTS)]
      mask[cycle, part * MAX_TOKENS:part * MAX_TOKENS + count] = 1
  if padding_id is not None:
    ids[ids == padding_id] = (padding_id + 1) % TABLE_ROWS
    ids[mask == 0] = padding_id
  return x, ids, y, mask


def token_mean(per_token, mask):
  """The mean over real tokens (mask 1) of a per-token loss."""
  return tf.reduce_sum(per_token * mask) / tf.reduce_sum(mask)


def token_loss(x, ids, y, mask, sparse=False):
  """A token-mean loss, as masked-LM losses are; returns (loss, variables).

  Dense: the MLP on each token's features. Sparse: each token's row of the
  embedding table, projected (the table's gradient is an IndexedSlices).
  """
  if sparse:
    table = tf.compat.v1.get_variable('table',
                                      initializer=_TABLE.astype(np.float32))
    projection = tf.compat.v1.get_variable('projection',
                                           initializer=_PROJECTION)
    prediction = tf.matmul(tf.nn.embedding_lookup(table, ids), projection)
    variables = {'table': table, 'projection': projection}
  else:
    del ids
    _, variables = model_loss(x, y)
    hidden = tf.tanh(tf.matmul(x, variables['w1']) + variables['b1'])
    prediction = tf.matmul(hidden, variables['w2']) + variables['b2']
  per_token = tf.reduce_sum(tf.square(prediction - y), axis=1)
  return token_mean(per_token, mask), variables


def token_weight(x, ids, y, mask):
  """The micro-batch's weight: its number of real tokens."""
  del x, ids, y
  return tf.reduce_sum(mask)


_TOKEN_INPUTS = [(tf.float32, [None, INPUT_DIM]), (tf.int32, [None]),
                 (tf.float32, [None, OUTPUT_DIM]), (tf.float32, [None])]

# name -> (make_data, input dtypes and shapes, loss function)
MODELS = {
    'mlp': (make_data, [(tf.float32, [None, INPUT_DIM]),
                        (tf.float32, [None, OUTPUT_DIM])], model_loss),
    'embedding': (make_embedding_data,
                  [(tf.int32, [None, IDS_PER_EXAMPLE]),
                   (tf.float32, [None, OUTPUT_DIM])], embedding_loss),
    'linear': (make_linear_data,
               [(tf.float32, [None, LINEAR_DIM]), (tf.float32, [None, 1]),
                (tf.float32, [None])], linear_loss),
    'tokens': (make_token_data, _TOKEN_INPUTS, token_loss),
    'token_embedding': (make_token_data, _TOKEN_INPUTS,
                        lambda *inputs: token_loss(*inputs, sparse=True)),
}
