"""What the benchmark suites share: flags, timing, tables, models, children."""

import glob
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer('rounds', 15, 'Interleaved timing rounds per variant.')
flags.DEFINE_integer('steps_per_round', 10, 'Timed steps per round.')
flags.DEFINE_integer('grad_steps', 8, 'K, micro-batches per update.')
flags.DEFINE_enum('tf_behavior', 'v2', ['v2', 'v1'],
                  "TensorFlow's graph behaviour: v2 disable_eager_execution() "
                  '(resource variables), v1 disable_v2_behavior() (ref '
                  'variables); children get the same.')

flags.DEFINE_string(
    'baseline', None, 'A git ref of this repository (a commit, a branch): '
    'its deferred_grad is timed side by side with the working tree in the '
    'same processes (suites step, memory, sparse), as variants named '
    '"baseline".')
flags.DEFINE_string('baseline_dir', None,
                    'Internal: where --baseline was unpacked (children).')

ENTRY_POINT = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'benchmark.py')
REPOSITORY = os.path.dirname(os.path.dirname(ENTRY_POINT))
BASELINE_PACKAGE = 'deferred_grad_baseline'


def _unpack_baseline(ref):
  """Unpacks `ref`'s deferred_grad as the package `deferred_grad_baseline`.

  Under another name, so that one process imports both it and the working
  tree's `deferred_grad`; its own imports of itself are renamed to match.

  Returns:
    The directory to put on sys.path.
  """
  archive = subprocess.run(
      ['git', '-C', REPOSITORY, 'archive', ref, 'deferred_grad'],
      check=True, stdout=subprocess.PIPE).stdout
  target = tempfile.mkdtemp(prefix='deferred_grad_baseline_')
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(target)
  package = os.path.join(target, BASELINE_PACKAGE)
  os.rename(os.path.join(target, 'deferred_grad'), package)
  for path in glob.glob(os.path.join(package, '*.py')):
    with open(path) as f:
      text = f.read()
    text = re.sub(r'\b(from|import) deferred_grad\b',
                  r'\1 ' + BASELINE_PACKAGE, text)
    with open(path, 'w') as f:
      f.write(text)
  return target


def deferred_grad_modules():
  """{variant prefix: deferred_grad module}: '' the working tree's, and
  'baseline' --baseline's where given."""
  import deferred_grad  # pylint: disable=g-import-not-at-top
  modules = {'': deferred_grad}
  if FLAGS.baseline or FLAGS.baseline_dir:
    if not FLAGS.baseline_dir:
      FLAGS.baseline_dir = _unpack_baseline(FLAGS.baseline)
    if FLAGS.baseline_dir not in sys.path:
      sys.path.insert(0, FLAGS.baseline_dir)
    modules['baseline'] = importlib.import_module(BASELINE_PACKAGE)
  return modules


def import_tf():
  """TensorFlow in graph mode (--tf_behavior), quietly."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.tf_behavior == 'v1':
    tf.compat.v1.disable_v2_behavior()
  else:
    tf.compat.v1.disable_eager_execution()
  return tf


def median(values):
  values = sorted(values)
  middle = len(values) // 2
  if len(values) % 2:
    return values[middle]
  return (values[middle - 1] + values[middle]) / 2


def time_interleaved(variants, rounds=None, steps=None):
  """Median seconds per call of each variant, measured in interleaved rounds.

  Args:
    variants: dict name -> zero-argument callable running one step.
    rounds, steps: rounds, and calls timed per round (default: the flags).

  Returns:
    dict name -> median over rounds of the mean seconds per call.
  """
  rounds = rounds or FLAGS.rounds
  steps = steps or FLAGS.steps_per_round
  for run_step in variants.values():  # warm-up
    for _ in range(steps):
      run_step()
  per_round = {name: [] for name in variants}
  for _ in range(rounds):
    for name, run_step in variants.items():
      start = time.perf_counter()
      for _ in range(steps):
        run_step()
      per_round[name].append((time.perf_counter() - start) / steps)
  return {name: median(times) for name, times in per_round.items()}


def markdown(header, rows):
  """A Markdown table; every column but the first is right-aligned."""
  lines = ['| ' + ' | '.join(header) + ' |',
           '|' + '|'.join('---:' if i else '---' for i in range(len(header)))
           + '|']
  lines += ['| ' + ' | '.join(str(cell) for cell in row) + ' |' for row in rows]
  return '\n'.join(lines)


def child_command(suite, spec, *extra_flags):
  """The command line that runs `suite`'s `child(spec)` in a new process."""
  baseline = ['--baseline_dir=' + FLAGS.baseline_dir] if (
      FLAGS.baseline_dir) else []
  return [sys.executable, ENTRY_POINT, '--child=%s:%s' % (suite, spec),
          '--tf_behavior=' + FLAGS.tf_behavior] + baseline + list(extra_flags)


def run_child(suite, spec, *extra_flags, timeout=None):
  """Runs `suite`'s `child(spec)` in a fresh process; returns its JSON line.

  Raises subprocess.TimeoutExpired after `timeout` seconds (None: no limit).
  """
  output = subprocess.run(
      child_command(suite, spec, *extra_flags), check=True,
      stdout=subprocess.PIPE, universal_newlines=True,
      timeout=timeout).stdout
  return json.loads(output.strip().splitlines()[-1])


# ------------------------------------------------------------------ models --

def mlp_loss(tf, batch, widths, seed=0):
  """A tanh MLP on a fixed random batch; returns (loss, parameter count)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(seed)
  x = tf.constant(rng.randn(batch, widths[0]).astype(np.float32))
  hidden = x
  parameters = 0
  for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
    w = tf.compat.v1.get_variable(
        'w%d' % i, [fan_in, fan_out],
        initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
    b = tf.compat.v1.get_variable('b%d' % i, [fan_out],
                                  initializer=tf.compat.v1.zeros_initializer())
    hidden = tf.tanh(tf.matmul(hidden, w) + b)
    parameters += fan_in * fan_out + fan_out
  return tf.reduce_mean(tf.square(hidden)), parameters


def conv_loss(tf, batch, seed=0):
  """The demo's conv net on a fixed random batch: activation-heavy."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(seed)
  images = tf.constant(rng.randn(batch, 28, 28, 1).astype(np.float32))
  labels = tf.constant(rng.randint(0, 10, size=batch).astype(np.int64))
  init = tf.compat.v1.glorot_uniform_initializer(seed=seed)
  shapes = {'conv1': [5, 5, 1, 32], 'conv2': [3, 3, 32, 32],
            'dense': [7 * 7 * 32, 10]}
  weights = {name: tf.compat.v1.get_variable(name, shape, initializer=init)
             for name, shape in shapes.items()}
  net = tf.nn.relu(tf.nn.conv2d(images, weights['conv1'], 1, 'SAME'))
  net = tf.nn.max_pool2d(net, 2, 2, 'SAME')
  net = tf.nn.relu(tf.nn.conv2d(net, weights['conv2'], 1, 'SAME'))
  net = tf.nn.max_pool2d(net, 2, 2, 'SAME')
  logits = tf.matmul(tf.reshape(net, [-1, 7 * 7 * 32]), weights['dense'])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))
  return loss, sum(int(np.prod(s)) for s in shapes.values())


OPTIMIZERS = {
    'SGD': lambda tf: tf.compat.v1.train.GradientDescentOptimizer(0.01),
    'Adam': lambda tf: tf.compat.v1.train.AdamOptimizer(0.001),
}


def training_session(tf, build_loss, batch, optimizer, grad_steps,
                     schedule=False, module=None):
  """A session and its train op; grad_steps None means the bare optimizer.

  With `schedule`, grad_steps is given as a schedule: a callable of the
  updates applied that gathers it from a table (always grad_steps), as a
  batch-size schedule does. `module`: the deferred_grad to wrap with
  (default: the working tree's; see `deferred_grad_modules`).

  Returns:
    (session, train op, parameter count).
  """
  deferred_grad = module or deferred_grad_modules()['']
  graph = tf.Graph()
  with graph.as_default():
    loss, parameters = build_loss(tf, batch)
    opt = OPTIMIZERS[optimizer](tf)
    if grad_steps is not None:
      if schedule:
        grad_steps = (lambda k: lambda updates: tf.gather(
            tf.constant([k], tf.int64), tf.minimum(updates, 0)))(grad_steps)
      opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps)
    train_op = opt.minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    session = tf.compat.v1.Session(graph=graph)
    session.run(tf.compat.v1.global_variables_initializer())
  return session, train_op, parameters
