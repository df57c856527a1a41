r"""Porting a TF1 training script: BERT's create_optimizer, before and after.

A tiny BERT-like masked language model (2 layers, hidden 32) trained with an
optimizer written like BERT's `optimization.py`: `AdamWeightDecayOptimizer`
(it creates its slots with `tf.compat.v1.get_variable` in
`apply_gradients`, ignores `global_step` and applies weight decay), a linear
warm-up and decay of the learning rate, global-norm clipping, and the
script's own `global_step` increment. `create_optimizer_before` is that
code; `create_optimizer_after` is the same code after the porting
checklist below. Run as a script, it trains the model both ways on the same
examples (a large batch, and `--grad_steps` micro-batches whose masked-token
counts differ) and prints the largest weight difference.

A script written for one large batch needs only the wrapper. Real TF1
scripts (BERT's run_pretraining.py was tried) have habits that each train
silently wrong under accumulation; with these edits BERT-style training
matches the large batch within float32 round-off, on both paths, in both
graph behaviours, resumed mid-cycle too (tests/test_porting.py). The edits
are safe to make unconditionally: grad_steps=1 keeps every one of them.

With `global_step_counts='updates'` (the README's first edit), global_step
counts updates as the large batch does, and edits 3 and 4 below go away:
the schedule reads global_step itself (`applied_updates(global_step,
grad_steps)` is then refused, naming it) and the step flags keep their
values; a kept increment (1.) fails the next micro-step naming it. This
guide shows the default, micro-step counting, the original's.

1. Step increments. The wrapper increments global_step once per micro-step,
   whatever the wrapped optimizer does with it: remove the script's own
   `global_step.assign(global_step + 1)` (with both, it counts two per
   micro-step and schedules run twice as fast). Or keep the script's own
   increment: pass no global_step to the wrapper (it counts its cycle in its
   own update_count) and run the increment after the wrapper's op, so that
   nothing reads the step while it changes:

     train_op = opt.apply_gradients(grads_and_vars)   # no global_step
     with tf.control_dependencies([train_op]):
       train_op = global_step.assign_add(1)           # the script's own

   Kept beside the wrapper, an increment ordered after the train op is
   named by `deferred_grad.PortCheckHook` (which `train` below runs), and
   the next micro-step fails naming it where the wrapper reads the step it
   left (counting updates; counting micro-steps, on the GPU path with an
   int grad_steps).
2. Clipping. `tf.clip_by_global_norm` between compute_gradients and
   apply_gradients clips each micro-batch: move it into `clip_norm=`, which
   clips the cycle's gradient. For sparse gradients the wrapper clips the
   norm of the accumulated gradient, repeated ids summed as in the dense
   gradient (tf.clip_by_global_norm on an IndexedSlices counts a repeated
   id's rows separately).
3. Schedules. Feed learning-rate schedules (and AdagradDAOptimizer)
   `deferred_grad.applied_updates(global_step, grad_steps)`, the number of
   updates applied so far (global_step // grad_steps), not global_step;
   their step counts (decay steps, warm-up steps) stay in updates. Fed
   global_step itself, a schedule advances grad_steps times too fast.
4. Step flags count micro-steps. max_steps, steps, num_train_steps given to
   Estimator.train, StopAtStepHook(last_step=...), save_checkpoints_steps,
   save_summary_steps, log_step_count_steps and TPUEstimator's
   iterations_per_loop are read against global_step: multiply them by
   grad_steps.
5. Token-mean losses. A masked-LM or sequence loss that is a mean over a
   micro-batch's tokens needs `micro_batch_weight=` its number of tokens:
   the plain mean of micro-batch means weighs a micro-batch of 1 token like
   one of 7 (see numerics_example.py).
6. Existing checkpoints. A model_dir written without accumulation lacks the
   accumulators: train once with
   `hooks=[deferred_grad.ConvertCheckpointHook(model_dir)]` (see
   monitored_session_example.py).

`create_optimizer_before` and `create_optimizer_after` below are BERT's
function before (its step increment made ordered) and after the edits, with
`masked_tokens = tf.reduce_sum(label_weights)`, and max_steps multiplied by
grad_steps (4.). BERT's loss adds 1e-5 to the token count, a relative 1e-5
per token count: the two runs end 2.8e-5 apart (2e-6 without it).

  python tools/examples/bert_porting.py --grad_steps=4
"""

import os

from absl import flags
import numpy as np
import tensorflow as tf

from bert_optimization import AdamWeightDecayOptimizer
from bert_optimization import learning_rate_schedule
import deferred_grad
import run_guide

VOCAB, HIDDEN, SEQUENCE, LAYERS = 20, 32, 6, 2


# ----------------------------------------------------------------- before --
def create_optimizer_before(loss, init_lr, num_train_steps, num_warmup_steps):
  """BERT's create_optimizer (its own step increment made ordered)."""
  global_step = tf.compat.v1.train.get_or_create_global_step()
  learning_rate = learning_rate_schedule(global_step, init_lr,
                                         num_train_steps, num_warmup_steps)
  optimizer = AdamWeightDecayOptimizer(learning_rate)
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients(loss, tvars)
  grads, _ = tf.clip_by_global_norm(grads, clip_norm=1.0)
  train_op = optimizer.apply_gradients(zip(grads, tvars),
                                       global_step=global_step)
  with tf.control_dependencies([train_op]):
    return global_step.assign_add(1)


# ------------------------------------------------------------------ after --
def create_optimizer_after(loss, init_lr, num_train_steps, num_warmup_steps,
                           grad_steps, masked_tokens, use_tpu=False):
  """The same after the porting checklist (the module docstring).

  num_train_steps and num_warmup_steps count updates, as before. use_tpu
  picks the wrapper's TPU path (the default is its GPU path).
  """
  global_step = tf.compat.v1.train.get_or_create_global_step()
  updates = deferred_grad.applied_updates(global_step, grad_steps)  # 3.
  learning_rate = learning_rate_schedule(updates, init_lr,
                                         num_train_steps, num_warmup_steps)
  optimizer = deferred_grad.GradientAggregationOptimizer(
      AdamWeightDecayOptimizer(learning_rate), grad_steps,
      clip_norm=1.0,                       # 2. clipping moves here
      micro_batch_weight=masked_tokens,    # 5. a token-mean loss
      use_tpu=use_tpu)
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients(loss, tvars)
  # 1. The wrapper counts global_step (one per micro-step): no increment.
  return optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)


# ------------------------------------------------------------------ model --
def masked_lm_loss(ids, labels, label_weights, epsilon=1e-5):
  """A BERT-like encoder and its masked-LM loss, a mean over masked tokens.

  Args:
    ids, labels: int32 [batch, SEQUENCE]; label_weights: float32, 1.0 where
      a token is masked and scored.
    epsilon: BERT adds 1e-5 to the count of masked tokens. Micro-batches
      weighted by their counts then differ from the large batch by a
      relative epsilon / count (2.8e-5 in weights here); 0 makes the two
      equal to round-off.

  Returns:
    The loss.
  """
  rng = np.random.RandomState(0)
  embedding = tf.compat.v1.get_variable(
      'bert/embeddings/word_embeddings',
      initializer=rng.normal(0, 0.2, [VOCAB, HIDDEN]).astype(np.float32))
  hidden = tf.nn.embedding_lookup(embedding, ids)
  for layer in range(LAYERS):
    with tf.compat.v1.variable_scope('bert/encoder/layer_%d' % layer):
      kernel = tf.compat.v1.get_variable(
          'kernel', initializer=rng.normal(
              0, 0.2, [HIDDEN, HIDDEN]).astype(np.float32))
      bias = tf.compat.v1.get_variable(
          'bias', [HIDDEN], initializer=tf.compat.v1.zeros_initializer())
      gamma = tf.compat.v1.get_variable(
          'LayerNorm/gamma', [HIDDEN],
          initializer=tf.compat.v1.ones_initializer())
      beta = tf.compat.v1.get_variable(
          'LayerNorm/beta', [HIDDEN],
          initializer=tf.compat.v1.zeros_initializer())
      hidden = hidden + tf.tanh(tf.einsum('bsh,hk->bsk', hidden, kernel) +
                                bias)
      mean, variance = tf.nn.moments(hidden, axes=[-1], keepdims=True)
      hidden = (hidden - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta
  logits = tf.einsum('bsh,vh->bsv', hidden, embedding)
  per_token = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                             logits=logits)
  return (tf.reduce_sum(label_weights * per_token) /
          (tf.reduce_sum(label_weights) + epsilon))


def make_examples(micro_batches, micro_batch, masked_counts, seed=1):
  """Ids, labels and masks; micro-batch i masks masked_counts[i % len]."""
  rng = np.random.RandomState(seed)
  rows = micro_batches * micro_batch
  ids = rng.randint(0, VOCAB, size=(rows, SEQUENCE)).astype(np.int32)
  labels = rng.randint(0, VOCAB, size=(rows, SEQUENCE)).astype(np.int32)
  weights = np.zeros([rows, SEQUENCE], np.float32)
  for index in range(micro_batches):
    flat = weights[index * micro_batch:(index + 1) * micro_batch].reshape(-1)
    flat[rng.permutation(flat.size)[:masked_counts[index %
                                                   len(masked_counts)]]] = 1
  return ids, labels, weights


SCHEDULE = dict(init_lr=0.05, num_train_steps=10, num_warmup_steps=2)


def build(grad_steps=None, use_tpu=False, epsilon=1e-5):
  """The graph: grad_steps None is the script before porting.

  Returns:
    (graph, train op, feeds (ids, labels, label_weights)).
  """
  graph = tf.Graph()
  with graph.as_default():
    feeds = (tf.compat.v1.placeholder(tf.int32, [None, SEQUENCE]),
             tf.compat.v1.placeholder(tf.int32, [None, SEQUENCE]),
             tf.compat.v1.placeholder(tf.float32, [None, SEQUENCE]))
    loss = masked_lm_loss(*feeds, epsilon=epsilon)
    if grad_steps is None:
      train_op = create_optimizer_before(loss, **SCHEDULE)
    else:
      train_op = create_optimizer_after(
          loss, grad_steps=grad_steps, use_tpu=use_tpu,
          masked_tokens=tf.reduce_sum(feeds[2]), **SCHEDULE)
  return graph, train_op, feeds


def train(examples, batch, runs, grad_steps=None, **kwargs):
  """Trains from scratch on `runs` batches of `batch` rows of `examples`.

  Returns:
    ({name: value} of the trainable variables, final global_step).
  """
  graph, train_op, feeds = build(grad_steps, **kwargs)
  port_check = deferred_grad.PortCheckHook()  # logs nothing on this port
  with graph.as_default(), tf.compat.v1.Session() as session:
    port_check.begin()
    session.run(tf.compat.v1.global_variables_initializer())
    for run in range(runs):
      rows = slice(run * batch, (run + 1) * batch)
      session.run(train_op, {feed: part[rows]
                             for feed, part in zip(feeds, examples)})
    port_check.end(session)
    return (session.run({v.op.name: v
                         for v in tf.compat.v1.trainable_variables()}),
            session.run(tf.compat.v1.train.get_global_step()))


FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('micro_batch', 2, 'Sequences per micro-batch.')
flags.DEFINE_integer('updates', 6, 'Number of updates.')


def main(argv):
  del argv
  tf.compat.v1.disable_eager_execution()
  k, micro_batch, updates = FLAGS.grad_steps, FLAGS.micro_batch, FLAGS.updates
  examples = make_examples(updates * k, micro_batch,
                           masked_counts=(3, 7, 1, 5))
  before, step_before = train(examples, k * micro_batch, updates)
  after, step_after = train(examples, micro_batch, updates * k, k)
  difference = max(float(np.max(np.abs(before[n] - after[n])))
                   for n in before)
  print('large batch: global_step %d; %d micro-batches per update: '
        'global_step %d' % (step_before, k, step_after))
  print('largest weight difference: %.3g' % difference)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
