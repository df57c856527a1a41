"""BERT's optimization.py, as google-research/bert writes it (for the
porting guide, bert_porting.py, and the benchmarks' BERT-base, tools/
benchmarks/scale.py): Adam with decoupled weight decay and a linear warm-up
and decay of the learning rate."""

import re

import tensorflow as tf


class AdamWeightDecayOptimizer(tf.compat.v1.train.Optimizer):
  """Adam with decoupled weight decay, written as BERT's optimization.py is."""

  def __init__(self, learning_rate, weight_decay_rate=0.01, beta_1=0.9,
               beta_2=0.999, epsilon=1e-6,
               exclude_from_weight_decay=('LayerNorm', 'bias'),
               name='AdamWeightDecayOptimizer'):
    super(AdamWeightDecayOptimizer, self).__init__(False, name)
    self.learning_rate = learning_rate
    self.weight_decay_rate = weight_decay_rate
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon
    self.exclude_from_weight_decay = exclude_from_weight_decay

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Ignores global_step, as BERT's does: its script counts steps itself."""
    assignments = []
    for grad, param in grads_and_vars:
      if grad is None or param is None:
        continue
      param_name = re.match('^(.*):\\d+$', param.name).group(1)
      m = tf.compat.v1.get_variable(
          name=param_name + '/adam_m', shape=param.shape.as_list(),
          dtype=tf.float32, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      v = tf.compat.v1.get_variable(
          name=param_name + '/adam_v', shape=param.shape.as_list(),
          dtype=tf.float32, trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      grad = tf.convert_to_tensor(grad)
      next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
      next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + self.epsilon)
      if not any(word in param_name for word in self.exclude_from_weight_decay):
        update += self.weight_decay_rate * param
      assignments.extend([param.assign(param - self.learning_rate * update),
                          m.assign(next_m), v.assign(next_v)])
    return tf.group(*assignments, name=name)


def learning_rate_schedule(step, init_lr, num_train_steps, num_warmup_steps):
  """BERT's: linear warm-up, then linear decay to zero, read from `step`."""
  learning_rate = tf.compat.v1.train.polynomial_decay(
      init_lr, step, num_train_steps, end_learning_rate=0.0, power=1.0)
  step = tf.cast(step, tf.float32)
  is_warmup = tf.cast(step < num_warmup_steps, tf.float32)
  warmup_learning_rate = init_lr * step / num_warmup_steps
  return (1.0 - is_warmup) * learning_rate + is_warmup * warmup_learning_rate
