"""Training loops: a model trained through the wrapper or the bare optimizer.

`Trainer` builds a graph for one model and optimizer, and `train` runs it over
whole cycles of data; `MirroredTrainer` does the same under MirroredStrategy
over two logical CPUs. `assert_same_training` compares per-cycle weights.
"""

import contextlib
import logging

import numpy as np
import tensorflow as tf

import behavior  # pylint: disable=unused-import
import deferred_grad
from models import MODELS

# Errors of float32 round-off between summing micro-batch means and taking
# one large-batch mean; measured differences are below 1e-6.
RTOL, ATOL = 1e-5, 1e-6

class Trainer(object):
  """Builds the model and its training op in a graph of its own.

  Args:
    make_optimizer: factory taking the step tensor (see OPTIMIZERS).
    grad_steps: None trains with the bare optimizer; else with the wrapper.
    use_global_step: pass a global step to `minimize`.
    step_tensor: what `make_optimizer` receives: 'auto' is the global step for
      the bare optimizer and `applied_updates` for the wrapper; 'global_step'
      is the global step in both cases; None is None.
    model: a key of MODELS.
    model_kwargs: passed to the model's loss function (e.g. with_unused for
      the MLP, partitions for the embedding model).
    device: device (or device function) to build the graph under.
    weight_fn: None, or a function of the inputs giving the wrapper's
      `micro_batch_weight` (e.g. models.token_weight).
    scope: None, or a name scope to call `minimize` in (a canned head's,
      where optimizers name their non-slot variables).
    after_minimize: None, or a function of (optimizer, train op, {name:
      variable}) returning the op to run instead of the train op: what a
      model attaches after it (a moving average, see test_once_per_update).
    **wrapper_kwargs: passed to `GradientAggregationOptimizer`.
  """

  def __init__(self,
               make_optimizer,
               grad_steps=None,
               use_global_step=True,
               step_tensor='auto',
               model='mlp',
               model_kwargs=None,
               device=None,
               weight_fn=None,
               scope=None,
               after_minimize=None,
               **wrapper_kwargs):
    self.micro_steps = 1 if grad_steps is None else grad_steps
    self.graph = tf.Graph()
    with self.graph.as_default(), self.graph.device(device):
      self.global_step = tf.compat.v1.train.get_or_create_global_step()
      _, input_specs, loss_fn = MODELS[model]
      self.inputs = [
          tf.compat.v1.placeholder(dtype, shape)
          for dtype, shape in input_specs
      ]
      loss, self.variables = loss_fn(*self.inputs, **(model_kwargs or {}))
      self.loss = loss
      if step_tensor == 'auto' and grad_steps is not None:
        step_tensor = deferred_grad.applied_updates(self.global_step,
                                                    grad_steps)
      elif step_tensor in ('auto', 'global_step'):
        step_tensor = self.global_step
      self.optimizer = make_optimizer(step_tensor)
      if weight_fn is not None:
        wrapper_kwargs['micro_batch_weight'] = weight_fn(*self.inputs)
      if grad_steps is not None:
        self.optimizer = deferred_grad.GradientAggregationOptimizer(
            self.optimizer, grad_steps, **wrapper_kwargs)
      with tf.compat.v1.name_scope(scope):
        self.train_op = self.optimizer.minimize(
            loss, global_step=self.global_step if use_global_step else None)
      if after_minimize is not None:
        self.train_op = after_minimize(self.optimizer, self.train_op,
                                       self.variables)
      self.init_op = tf.compat.v1.global_variables_initializer()

  def session(self):
    session = tf.compat.v1.Session(graph=self.graph)
    session.run(self.init_op)
    return session

  def micro_step(self, session, *batch):
    session.run(self.train_op, dict(zip(self.inputs, batch)))

  def run_cycle(self, session, *batch):
    """Runs one cycle on a large batch split into `micro_steps` parts."""
    micro_batch = len(batch[0]) // self.micro_steps
    for k in range(self.micro_steps):
      rows = slice(k * micro_batch, (k + 1) * micro_batch)
      self.micro_step(session, *[part[rows] for part in batch])

  def run(self, session, data):
    """Trains on every cycle of `data`; returns the weights after each."""
    snapshots = []
    for batch in zip(*data):
      self.run_cycle(session, *batch)
      snapshots.append(session.run(self.variables))
    return snapshots


REPLICAS = 2


class MirroredTrainer(Trainer):
  """The wrapper under MirroredStrategy over two logical CPU devices.

  Each micro-batch is split between the replicas; each replica's loss is its
  mean divided by the replica count, so that the optimizer's all-reduce (a
  sum) gives the mean over the whole micro-batch.

  With `wrapper_per_replica`, each replica builds its own wrapper (and
  wrapped optimizer) inside the replica function, as an Estimator
  `model_fn` under `train_distribute` does; its weight is a tensor of that
  replica's inputs. `optimizer` is then the first replica's. `schedule`
  'tensor' or 'callable' gives the wrapper `grad_steps` as such a schedule
  of the same constant value. `after_minimize` (see `Trainer`) is called
  in the replica function.
  """

  def __init__(self, make_optimizer, grad_steps, use_global_step=True,
               model='mlp', model_kwargs=None, weight_fn=None,
               wrapper_per_replica=False, schedule=None, after_minimize=None,
               **wrapper_kwargs):
    # pylint: disable=super-init-not-called
    self.micro_steps = grad_steps
    self.graph = tf.Graph()
    with self.graph.as_default():
      self.strategy = tf.distribute.MirroredStrategy(
          ['/cpu:%d' % i for i in range(REPLICAS)])
      _, input_specs, loss_fn = MODELS[model]
      with self.strategy.scope():
        self.global_step = tf.compat.v1.train.get_or_create_global_step()
        # [replica, rows, ...]: replica r reads its own slice.
        self.inputs = [
            tf.compat.v1.placeholder(dtype, [REPLICAS] + shape)
            for dtype, shape in input_specs
        ]
        if weight_fn is not None and not wrapper_per_replica:
          # Called on each replica: the weight of that replica's inputs.
          wrapper_kwargs['micro_batch_weight'] = lambda: weight_fn(
              *self._replica_inputs())
        wrapper_grad_steps = grad_steps
        if schedule == 'tensor':
          wrapper_grad_steps = tf.constant(grad_steps, tf.int64)
        elif schedule == 'callable':
          wrapper_grad_steps = lambda updates: tf.constant(grad_steps,
                                                           tf.int64)
        make_wrapper = lambda: deferred_grad.GradientAggregationOptimizer(
            make_optimizer(None), wrapper_grad_steps, **wrapper_kwargs)
        self.optimizer = None if wrapper_per_replica else make_wrapper()
        self.variables = {}

        def replica_step():
          loss, variables = loss_fn(*self._replica_inputs(),
                                    **(model_kwargs or {}))
          self.variables.update(variables)
          optimizer = self.optimizer
          if wrapper_per_replica:
            if weight_fn is not None:
              wrapper_kwargs['micro_batch_weight'] = weight_fn(
                  *self._replica_inputs())
            optimizer = make_wrapper()
            self.optimizer = self.optimizer or optimizer
          train_op = optimizer.minimize(
              loss / REPLICAS,
              global_step=self.global_step if use_global_step else None)
          if after_minimize is not None:
            train_op = after_minimize(optimizer, train_op, variables)
          return train_op

        self.train_op = self.strategy.group(
            self.strategy.extended.call_for_each_replica(replica_step))
      self.init_op = tf.compat.v1.global_variables_initializer()

  def _replica_inputs(self):
    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return [tf.gather(part, replica) for part in self.inputs]

  def split(self, batch):
    return batch.reshape((REPLICAS, -1) + batch.shape[1:])

  def micro_step(self, session, *batch):
    super(MirroredTrainer, self).micro_step(
        session, *[self.split(part) for part in batch])


def train(make_optimizer, data, grad_steps=None, **kwargs):
  """Trains a fresh model on `data` (see `Trainer` for the arguments).

  The bare optimizer's training (`grad_steps` None), the reference most
  tests compare with, is computed once per pytest process for each
  (factory, data, arguments): a test's gpu_path and tpu_path cases, and
  tests of one optimizer, share it.

  Returns:
    (snapshots, final global step, graph): one dict of variable name -> value
    per cycle.
  """
  key = _reference_key(make_optimizer, data, kwargs) if (
      grad_steps is None) else None
  if key is not None and key in _REFERENCES:
    return _copied(_REFERENCES[key])
  trainer = Trainer(make_optimizer, grad_steps, **kwargs)
  with trainer.session() as session:
    snapshots = trainer.run(session, data)
    final_step = session.run(trainer.global_step)
  result = snapshots, final_step, trainer.graph
  if key is None:
    return result
  _REFERENCES[key] = result
  return _copied(result)


def _copied(result):
  """A shared training's result, its snapshots copied: a test may change
  what it got."""
  snapshots, final_step, graph = result
  return ([{name: np.copy(value) for name, value in snapshot.items()}
           for snapshot in snapshots], final_step, graph)


# Bare trainings by `_reference_key`. A key holds the factory itself, not
# its id, so that no later factory can reuse the id.
_REFERENCES = {}
_PLAIN = (str, int, float, bool, type(None))


def _reference_key(make_optimizer, data, kwargs):
  """What determines a bare training, or None where an argument is not
  plain data (a device function, a weight function: never shared)."""
  def plain(value):
    if isinstance(value, (tuple, list)):
      return all(plain(v) for v in value)
    if isinstance(value, dict):
      return all(plain(k) and plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)
  if not plain(kwargs):
    return None
  arrays = tuple((a.dtype.str, a.shape, a.tobytes())
                 for a in (np.asarray(part) for part in data))
  return make_optimizer, arrays, repr(sorted(kwargs.items()))


def assert_same_training(actual, expected, rtol=RTOL, atol=ATOL):
  """Asserts two lists of per-cycle weight snapshots are equal."""
  assert len(actual) == len(expected)
  for cycle, (got, want) in enumerate(zip(actual, expected)):
    assert sorted(got) == sorted(want)
    for name in want:
      np.testing.assert_allclose(
          got[name], want[name], rtol=rtol, atol=atol,
          err_msg='variable %s after cycle %d' % (name, cycle))


def assert_weights_moved(before, after):
  assert any(not np.array_equal(before[n], after[n]) for n in before)


def listed_rows(value, row_shape):
  """(ids, rows) of a table's list of rows (`accumulators.RowListAccumulator`).

  Row 0 records the number n of rows listed, an int64 in its first
  columns; each of rows 1 to n an int64 id the same way, then the row's
  accumulated gradient; the rows after them are free room.
  """
  value = np.asarray(value)
  id_columns = 8 // value.dtype.itemsize
  ids = np.ascontiguousarray(value[:, :id_columns]).view(np.int64)[:, 0]
  listed = slice(1, 1 + ids[0])
  return ids[listed], value[listed, id_columns:].reshape(
      (-1,) + tuple(row_shape))


def dense_accumulator(value, shape):
  """The original's table-sized accumulator holding the same partial sums."""
  ids, rows = listed_rows(value, shape[1:])
  dense = np.zeros(shape, value.dtype)
  np.add.at(dense, ids, rows)
  return dense


@contextlib.contextmanager
def logged(word):
  """Yields a list of the messages TensorFlow logs meanwhile with `word`."""
  messages = []

  class Handler(logging.Handler):

    def emit(self, record):
      if word in record.getMessage():
        messages.append(record.getMessage())

  handler = Handler()
  tf.get_logger().addHandler(handler)
  try:
    yield messages
  finally:
    tf.get_logger().removeHandler(handler)
