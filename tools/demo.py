r"""Demo: a big batch trained in small memory, checked against the real thing.

Trains a small convolutional classifier on generated images (nothing is
downloaded) at an effective batch `--batch_size`, twice, each run in its own
process so that their peak memory can be compared:

  (a) one batch of `batch_size` per update, with the bare optimizer;
  (b) `grad_steps` micro-batches of `batch_size / grad_steps` per update,
      through `deferred_grad.GradientAggregationOptimizer`.

It prints the loss of both runs after each update (a table), the largest
weight difference, the peak memory (RSS) and the wall time of each run, and
exits non-zero if the two runs differ beyond round-off. --plot=FILE.png also
draws the two loss curves, their difference against the tolerance and the
peak memory of each, to FILE.png as given (a relative path is relative to
the current directory; *.png at the repository's top is ignored by git).
Summing micro-batch means rounds differently from
taking one large mean, and momentum and ReLUs amplify that through training:
in float32 the runs agree to about 4e-5 after 8 updates, in float64
(`--dtype=float64`) to about 1e-16, which shows the difference is round-off.

  tools/demo --grad_steps=8 --batch_size=2048 --updates=8
  tools/demo --plot=demo.png   # tools/demo installs matplotlib for it
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

import peak_memory  # tools/peak_memory.py, beside this script

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 8, 'Micro-batches per update in run (b).')
flags.DEFINE_integer('batch_size', 2048, 'Effective batch size B.')
flags.DEFINE_integer('updates', 8, 'Number of weight updates.')
flags.DEFINE_float('learning_rate', 0.05, 'Momentum optimizer learning rate.')
flags.DEFINE_integer('seed', 0, 'Seed of the generated data and weights.')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'float64'],
                  'Precision of the model and data.')
flags.DEFINE_float('rtol', None, 'Relative tolerance of the comparison '
                   '(default: 1e-3 for float32, 1e-9 for float64).')
flags.DEFINE_float('atol', None, 'Absolute tolerance of the comparison '
                   '(default: 1e-4 for float32, 1e-10 for float64).')
flags.DEFINE_string('plot', None, 'Also draw the loss curves, their '
                    'difference and the peak memory to this PNG file '
                    '(relative to the current directory).')
flags.DEFINE_enum('role', None, ['large', 'micro'],
                  'Internal: run one side and write its results.')
flags.DEFINE_string('output', None, 'Internal: where the role writes.')

IMAGE_SIZE, CLASSES = 28, 10
TOLERANCES = {'float32': (1e-3, 1e-4), 'float64': (1e-9, 1e-10)}


def make_batch(rng, templates, size):
  """Images of noisy class templates, and their labels."""
  labels = rng.randint(0, CLASSES, size=size)
  noise = rng.normal(scale=1.0, size=(size, IMAGE_SIZE, IMAGE_SIZE, 1))
  return (templates[labels] + noise).astype(FLAGS.dtype), labels.astype('int64')


def run_role(role):
  """Trains one side and saves its losses, weights, memory and time."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import deferred_grad  # pylint: disable=g-import-not-at-top
  tf.compat.v1.disable_eager_execution()

  grad_steps = 1 if role == 'large' else FLAGS.grad_steps
  micro_batch = FLAGS.batch_size // grad_steps
  rng = np.random.RandomState(FLAGS.seed)
  templates = rng.normal(size=(CLASSES, IMAGE_SIZE, IMAGE_SIZE, 1))
  init = tf.compat.v1.glorot_uniform_initializer(seed=FLAGS.seed)
  dtype = tf.as_dtype(FLAGS.dtype)

  images = tf.compat.v1.placeholder(dtype, [None, IMAGE_SIZE, IMAGE_SIZE, 1])
  labels = tf.compat.v1.placeholder(tf.int64, [None])
  weights = {
      'conv1': tf.compat.v1.get_variable('conv1', [5, 5, 1, 32], dtype,
                                         initializer=init),
      'conv2': tf.compat.v1.get_variable('conv2', [3, 3, 32, 32], dtype,
                                         initializer=init),
      'dense': tf.compat.v1.get_variable('dense', [7 * 7 * 32, CLASSES], dtype,
                                         initializer=init),
      'bias': tf.compat.v1.get_variable('bias', [CLASSES], dtype,
                                        initializer=tf.zeros_initializer()),
  }
  net = tf.nn.relu(tf.nn.conv2d(images, weights['conv1'], 1, 'SAME'))
  net = tf.nn.max_pool2d(net, 2, 2, 'SAME')
  net = tf.nn.relu(tf.nn.conv2d(net, weights['conv2'], 1, 'SAME'))
  net = tf.nn.max_pool2d(net, 2, 2, 'SAME')
  logits = tf.matmul(tf.reshape(net, [-1, 7 * 7 * 32]),
                     weights['dense']) + weights['bias']
  loss = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits))

  global_step = tf.compat.v1.train.get_or_create_global_step()
  optimizer = tf.compat.v1.train.MomentumOptimizer(FLAGS.learning_rate, 0.9)
  if role == 'micro':
    optimizer = deferred_grad.GradientAggregationOptimizer(
        optimizer, grad_steps)
  train_op = optimizer.minimize(loss, global_step=global_step)

  losses = []
  start = time.time()
  with tf.compat.v1.Session() as session:
    session.run(tf.compat.v1.global_variables_initializer())
    for update in range(FLAGS.updates):
      x, y = make_batch(rng, templates, FLAGS.batch_size)
      micro_losses = []
      for k in range(grad_steps):
        rows = slice(k * micro_batch, (k + 1) * micro_batch)
        _, value = session.run([train_op, loss], {
            images: x[rows],
            labels: y[rows]
        })
        micro_losses.append(float(value))
      # The mean of equal-sized micro-batch means is the large batch's mean.
      losses.append(float(np.mean(micro_losses)))
      print('  [%s] update %d/%d  loss %.5f' %
            (role, update + 1, FLAGS.updates, losses[-1]), flush=True)
    final = session.run(weights)
    step = int(session.run(global_step))
  seconds = time.time() - start
  np.savez(FLAGS.output + '.npz', **final)
  with open(FLAGS.output + '.json', 'w') as f:
    json.dump({
        'losses': losses,
        'global_step': step,
        'train_seconds': seconds,
        'peak_rss_mb': peak_memory.peak_rss_mb(),
    }, f)


def run_side(role, output):
  """Runs one side in a child process; returns its results and wall time."""
  start = time.time()
  command = [sys.executable, os.path.abspath(__file__), '--role=' + role,
             '--output=' + output] + [
                 '--%s=%s' % (name, FLAGS[name].value)
                 for name in ['grad_steps', 'batch_size', 'updates',
                              'learning_rate', 'seed', 'dtype']
             ]
  subprocess.run(command, check=True)
  with open(output + '.json') as f:
    results = json.load(f)
  results['wall_seconds'] = time.time() - start
  return results


def check_plot_dependency():
  """Exits before any training if --plot cannot be drawn."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    sys.exit('--plot needs matplotlib, which this Python lacks. tools/demo '
             'installs it into its own environment when given --plot; '
             'running %s directly: pip install matplotlib' % sys.argv[0])


def plot(path, large, micro, max_diff, rtol, atol):
  """Draws what the demo shows: same losses, less memory."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  micro_batch = FLAGS.batch_size // FLAGS.grad_steps
  updates = np.arange(1, len(large['losses']) + 1)
  large_losses = np.array(large['losses'])
  figure, (losses, memory) = plt.subplots(
      1, 2, figsize=(11, 4.8), gridspec_kw={'width_ratios': [2, 1]})
  figure.suptitle(
      '%d micro-batches of %d through GradientAggregationOptimizer train '
      'like one batch of %d,\nin %.2fx its peak memory (largest weight '
      'difference %.2g, %s)' % (FLAGS.grad_steps, micro_batch,
                                FLAGS.batch_size,
                                micro['peak_rss_mb'] / large['peak_rss_mb'],
                                max_diff, FLAGS.dtype))
  losses.plot(updates, large_losses, 'o-',
              label='loss (a): one batch of %d' % FLAGS.batch_size)
  losses.plot(updates, micro['losses'], 'x--', label='loss (b): %d x %d' %
              (FLAGS.grad_steps, micro_batch))
  losses.set_xticks(updates)
  losses.set_xlabel('update')
  losses.set_ylabel('training loss')
  difference = losses.twinx()
  difference.semilogy(updates, np.maximum(np.abs(
      np.array(micro['losses']) - large_losses), 1e-20), 's:',
                      color='gray', label='|loss (b) - loss (a)|')
  # The demo's pass mark, as np.allclose applies it to each loss.
  difference.semilogy(updates, atol + rtol * np.abs(large_losses), '-',
                      color='tab:red', linewidth=1,
                      label='tolerance: %g + %g |loss (a)|' % (atol, rtol))
  difference.set_ylabel('loss difference (log)')
  lines = losses.get_legend_handles_labels()
  more = difference.get_legend_handles_labels()
  # Below the axes, where it covers no marker.
  losses.legend(lines[0] + more[0], lines[1] + more[1], loc='upper center',
                bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize='small')
  bars = memory.bar(['(a) one batch', '(b) micro-batches'],
                    [large['peak_rss_mb'], micro['peak_rss_mb']],
                    color=['tab:blue', 'tab:orange'])
  memory.bar_label(bars, fmt='%.0f MB')
  memory.set_ylabel('peak RSS (MB)')
  memory.set_ylim(0, 1.15 * max(large['peak_rss_mb'], micro['peak_rss_mb']))
  figure.tight_layout()
  figure.subplots_adjust(wspace=0.5)
  figure.savefig(path)
  print('wrote', os.path.abspath(path))


def main(argv):
  del argv
  if FLAGS.role:
    return run_role(FLAGS.role)
  for name in ['grad_steps', 'batch_size', 'updates']:
    if FLAGS[name].value < 1:
      sys.exit('--%s must be a positive integer, got %d' %
               (name, FLAGS[name].value))
  if FLAGS.batch_size % FLAGS.grad_steps:
    sys.exit('--batch_size (%d) must be a multiple of --grad_steps (%d)' %
             (FLAGS.batch_size, FLAGS.grad_steps))
  if FLAGS.plot:
    check_plot_dependency()
  import numpy as np  # pylint: disable=g-import-not-at-top
  rtol, atol = TOLERANCES[FLAGS.dtype]
  rtol = rtol if FLAGS.rtol is None else FLAGS.rtol
  atol = atol if FLAGS.atol is None else FLAGS.atol

  print('Effective batch %d for %d updates: (a) one batch of %d, (b) %d '
        'micro-batches of %d through GradientAggregationOptimizer.' %
        (FLAGS.batch_size, FLAGS.updates, FLAGS.batch_size, FLAGS.grad_steps,
         FLAGS.batch_size // FLAGS.grad_steps), flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    large = run_side('large', os.path.join(tmp, 'large'))
    micro = run_side('micro', os.path.join(tmp, 'micro'))
    large_weights = np.load(os.path.join(tmp, 'large.npz'))
    micro_weights = np.load(os.path.join(tmp, 'micro.npz'))
    names = sorted(large_weights.files)
    max_diff = max(
        float(np.max(np.abs(large_weights[n] - micro_weights[n])))
        for n in names)
    weights_match = all(
        np.allclose(micro_weights[n], large_weights[n], rtol=rtol, atol=atol) for n in names)
  losses_match = np.allclose(micro['losses'], large['losses'],
                             rtol=rtol, atol=atol)

  print('\n| update | loss (a) one batch | loss (b) micro-batches |')
  print('|---:|---:|---:|')
  for update, (a, b) in enumerate(zip(large['losses'], micro['losses'])):
    print('| %d | %.6f | %.6f |' % (update + 1, a, b))
  print('\n| run | peak RSS (MB) | wall time (s) | global_step |')
  print('|---|---:|---:|---:|')
  print('| (a) one batch of %d | %.0f | %.1f | %d |' %
        (FLAGS.batch_size, large['peak_rss_mb'], large['wall_seconds'],
         large['global_step']))
  print('| (b) %d x %d, deferred_grad | %.0f | %.1f | %d |' %
        (FLAGS.grad_steps, FLAGS.batch_size // FLAGS.grad_steps,
         micro['peak_rss_mb'], micro['wall_seconds'], micro['global_step']))
  print('\nlargest weight difference: %.3g; peak memory (b)/(a): %.2f' %
        (max_diff, micro['peak_rss_mb'] / large['peak_rss_mb']))
  if FLAGS.plot:
    plot(FLAGS.plot, large, micro, max_diff, rtol, atol)
  if not (weights_match and losses_match):
    print('FAIL: the runs differ beyond rtol=%g, atol=%g' %
          (rtol, atol))
    return 1
  print('OK: (b) trained like (a) up to %s round-off (rtol=%g, atol=%g).' %
        (FLAGS.dtype, rtol, atol))
  return 0


if __name__ == '__main__':
  app.run(main)
