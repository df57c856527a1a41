"""Suite `scale`: what the wrapper saves and costs on real models.

Two real architectures at their real sizes: BERT-base (110M parameters,
BERT's `AdamWeightDecayOptimizer` with global-norm clipping at 1.0, as
BERT trains it) on sequences of --scale_sequence tokens, and ResNet-50
(25.6M parameters, 224x224 images, Momentum, batch norm in training mode,
its moving statistics updated every step). Each runs, one fresh process per
variant (peak memory is a process's), on the same examples in the same
order (each process sums the example ids it trained, and the suite checks
the sums):

* `bare b`: the bare optimizer at the micro-batch b;
* `bare Kb`: the bare optimizer at the large batch K*b, the batch being
  replaced (until it no longer fits the memory budget --scale_budget_mb);
* `wrapper`: `GradientAggregationOptimizer(grad_steps=K)` on K micro-
  batches of b;
* `original`: the original module (original_deferred_grad_optimizer.py.txt
  beside this file, loaded for measurement only, its one import fixed for
  today's TensorFlow), wrapping the same optimizer, as its users clip
  (each micro-batch's gradient).

Each process times --scale_cycles cycles after one of warm-up (a cycle: K
micro-steps, or one large step), accumulate-only and apply steps apart, and
reads its resident memory (RSS) after `global_variables_initializer`, after
the first cycle and at its peak, and TensorFlow's allocator peak of a
traced cycle. The wrapper's extra memory is its RSS minus the bare micro-
batch's at the same point, in parameter bytes P (float32: 4 bytes a
parameter); its accumulators are 1 P. Memory against the effective batch:
b fixed, K in --scale_curve, the wrapper at K x b and the bare optimizer at
K*b until it exceeds the budget; --plot=FILE draws it, with matplotlib in
any format it writes (.png, .pdf, .svg, ...), without it as an SVG drawn by
hand (.svg only; another name fails as the flags are parsed).

How the figures scale: time per example is set by the model's compute and
is about the same for every b large enough to keep the cores busy; the bare
optimizer's peak grows with the batch by the activations per example (BERT
at sequence 128: about 110 MB an example with Adam; ResNet-50: about 100
MB an image), the wrapper's stays at the micro-batch's plus its
accumulators. On a GPU (tools/gpu_check runs this suite) the budget is the
device's memory.

Results, 2 CPU cores, TensorFlow 2.21, Python 3.11, 2026-12-04
(`tools/benchmark --suites=scale --plot=tools/benchmarks/scale.svg`, 9 min
46 s). Time per example varies by about 5% from run to run (three runs:
wrapper over bare at K*b 0.99x-1.05x on BERT-base, 1.02x-1.12x on
ResNet-50); peak RSS by about 1 P on BERT-base (the host allocator's
arenas), less on ResNet-50; README "Performance" gives the ranges.

| model | variant | time per example, whole cycle | / bare at b | / bare at K*b | accumulate-only / apply step, over a bare step at b |
|---|---:|---:|---:|---:|---:|
| BERT-base, sequence 128 (P = 418 MB), K=4 x b=2 | wrapper | 549.6 ms | 0.857x | 1.045x | 0.699x / 1.291x |
| BERT-base, sequence 128 (P = 418 MB), K=4 x b=2 | original | 565.1 ms | 0.881x | 1.074x | 0.748x / 1.236x |
| ResNet-50, 224x224 (P = 97 MB), K=4 x b=4 | wrapper | 172.8 ms | 1.087x | 1.049x | 1.103x / 1.090x |
| ResNet-50, 224x224 (P = 97 MB), K=4 x b=4 | original | 177.2 ms | 1.115x | 1.076x | 1.176x / 1.125x |

Peak RSS (MB, each a process of its own):

| model | variant | bare at b | this variant | bare at K*b | this / bare at K*b | extra over bare at b, in parameter bytes: after init / after a cycle / peak | TF allocator peak: bare at b / this / bare at K*b (extra) |
|---|---:|---:|---:|---:|---:|---:|---:|
| BERT-base, sequence 128, K=4 x b=2 | wrapper | 5554 | 5257 | 6308 | 0.83 | +0.14 P / -2.55 P / -0.71 P | 4406 / 4011 / 5262 (-0.94 P) |
| BERT-base, sequence 128, K=4 x b=2 | original | 5554 | 5432 | 6308 | 0.86 | +2.12 P / -1.51 P / -0.29 P | 4406 / 4272 / 5262 (-0.32 P) |
| ResNet-50, 224x224, K=4 x b=4 | wrapper | 1361 | 1546 | 2730 | 0.57 | +1.80 P / +0.57 P / +1.90 P | 666 / 760 / 1698 (+0.96 P) |
| ResNet-50, 224x224, K=4 x b=4 | original | 1361 | 1659 | 2730 | 0.61 | +0.70 P / +1.90 P / +3.06 P | 666 / 911 / 1698 (+2.51 P) |

Peak RSS (MB) against the effective batch, bert (b=2):

| effective batch | wrapper | bare |
|---|---:|---:|
| 2 | 5554 | 5554 |
| 4 | 4628 | 5431 |
| 8 | 5257 | 6308 |
| 16 | 5263 | 7398 |
| 32 | 4892 | 10392 |

Peak RSS (MB) against the effective batch, resnet (b=4):

| effective batch | wrapper | bare |
|---|---:|---:|
| 4 | 1361 | 1361 |
| 8 | 1518 | 1728 |
| 16 | 1546 | 2730 |
| 32 | 1536 | 4721 |
| 64 | 1555 | 6893 |

plot: tools/benchmarks/scale.svg
"""

import json
import math
import os
import sys
import time

from benchmarks import common

import peak_memory  # tools/peak_memory.py

FLAGS = common.FLAGS
common.flags.DEFINE_list('scale_models', ['bert', 'resnet'],
                         'Models of the scale suite: bert, resnet.')
common.flags.DEFINE_integer('scale_grad_steps', 4,
                            'K of the scale suite\'s wrapper and original.')
common.flags.DEFINE_integer('scale_bert_batch', 2,
                            'BERT-base micro-batch b (sequences).')
common.flags.DEFINE_integer('scale_resnet_batch', 4,
                            'ResNet-50 micro-batch b (images).')
common.flags.DEFINE_integer('scale_sequence', 128, 'BERT sequence length.')
common.flags.DEFINE_integer('scale_image', 224, 'ResNet-50 image size.')
common.flags.DEFINE_integer('scale_cycles', 2,
                            'Timed cycles after one of warm-up.')
common.flags.DEFINE_list('scale_curve', ['1', '2', '4', '8', '16'],
                         'K values of the memory against the effective '
                         'batch (b fixed); empty: no curve.')
common.flags.DEFINE_integer('scale_budget_mb', 12000,
                            'Memory budget: the bare optimizer at a larger '
                            'effective batch is not run past it.')
common.flags.DEFINE_boolean('scale_toy', False,
                            'Toy sizes of both architectures (the tests).')
common.flags.DEFINE_string(
    'plot', None, 'Draw memory against the effective batch into this file: '
    'with matplotlib in any format it writes (.png, .pdf, .svg, ...), '
    'without it .svg only (drawn by hand).')

VARIANTS = ('bare_micro', 'bare_large', 'wrapper', 'original')
NAMES = {'bert': 'BERT-base', 'resnet': 'ResNet-50'}
ORIGINAL = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'original_deferred_grad_optimizer.py.txt')


# ------------------------------------------------------------------ models --

def _dims(model):
  """The architecture's sizes: real, or --scale_toy's."""
  if model == 'bert':
    if FLAGS.scale_toy:
      return dict(vocab=97, hidden=16, layers=2, heads=2, intermediate=32,
                  positions=16, sequence=8, masked=3)
    return dict(vocab=30522, hidden=768, layers=12, heads=12,
                intermediate=3072, positions=512,
                sequence=FLAGS.scale_sequence, masked=20)
  if FLAGS.scale_toy:
    return dict(image=16, width=2, blocks=(1, 1, 1, 1), classes=5)
  return dict(image=FLAGS.scale_image, width=64, blocks=(3, 4, 6, 3),
              classes=1000)


def _examples(tf, model, first, count):
  """Examples `first` .. `first + count - 1`, each a function of its id:
  (inputs, labels, ids) tensors, the same in every process."""
  dims = _dims(model)
  ids = tf.range(first, first + count, dtype=tf.int64)

  def seeded(kind, shape, maxval=None, dtype=tf.float32):
    def one(example):
      seed = tf.stack([example, tf.constant(kind, tf.int64)])
      if maxval is None:
        return tf.random.stateless_normal(shape, seed)
      return tf.random.stateless_uniform(shape, seed, maxval=maxval,
                                         dtype=dtype, minval=0)
    return tf.map_fn(one, ids, fn_output_signature=dtype)

  if model == 'bert':
    tokens = seeded(1, [dims['sequence']], dims['vocab'], tf.int32)
    positions = seeded(2, [dims['masked']], dims['sequence'], tf.int32)
    labels = seeded(3, [dims['masked']], dims['vocab'], tf.int32)
    return (tokens, positions), labels, ids
  images = seeded(1, [dims['image'], dims['image'], 3])
  labels = seeded(2, [], dims['classes'], tf.int32)
  return images, labels, ids


def _dense(tf, x, units, name, seed):
  width = x.shape[-1]
  w = tf.compat.v1.get_variable(
      name + '/kernel', [width, units],
      initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.02,
                                                            seed=seed))
  b = tf.compat.v1.get_variable(name + '/bias', [units],
                                initializer=tf.compat.v1.zeros_initializer())
  return tf.tensordot(x, w, 1) + b


def _layer_norm(tf, x, name):
  gamma = tf.compat.v1.get_variable(
      name + '/gamma', [x.shape[-1]], initializer=tf.compat.v1.ones_initializer())
  beta = tf.compat.v1.get_variable(
      name + '/beta', [x.shape[-1]], initializer=tf.compat.v1.zeros_initializer())
  mean, variance = tf.nn.moments(x, [-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + 1e-12) * gamma + beta


def bert_loss(tf, inputs, labels):
  """BERT-base's encoder and masked-LM head (the output embedding tied to
  the input's), as google-research/bert's run_pretraining builds them; no
  next-sentence head. Returns the loss."""
  d = _dims('bert')
  tokens, positions = inputs
  batch = tf.shape(tokens)[0]
  init = lambda seed: tf.compat.v1.truncated_normal_initializer(
      stddev=0.02, seed=seed)
  words = tf.compat.v1.get_variable(
      'bert/embeddings/word_embeddings', [d['vocab'], d['hidden']],
      initializer=init(1))
  places = tf.compat.v1.get_variable(
      'bert/embeddings/position_embeddings', [d['positions'], d['hidden']],
      initializer=init(2))
  kinds = tf.compat.v1.get_variable(
      'bert/embeddings/token_type_embeddings', [2, d['hidden']],
      initializer=init(3))
  x = tf.gather(words, tokens) + places[:d['sequence']] + kinds[0]
  x = _layer_norm(tf, x, 'bert/embeddings/LayerNorm')
  head = d['hidden'] // d['heads']
  for layer in range(d['layers']):
    scope = 'bert/encoder/layer_%d/' % layer

    def split(t):
      return tf.transpose(tf.reshape(t, [batch, -1, d['heads'], head]),
                          [0, 2, 1, 3])

    q, k, v = [split(_dense(tf, x, d['hidden'],
                            scope + 'attention/self/' + name, 10 + layer))
               for name in ('query', 'key', 'value')]
    weights = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) /
                            float(head) ** 0.5)
    context = tf.reshape(tf.transpose(tf.matmul(weights, v), [0, 2, 1, 3]),
                         [batch, -1, d['hidden']])
    x = _layer_norm(tf, x + _dense(tf, context, d['hidden'],
                                   scope + 'attention/output/dense', layer),
                    scope + 'attention/output/LayerNorm')
    hidden = tf.nn.gelu(_dense(tf, x, d['intermediate'],
                               scope + 'intermediate/dense', layer),
                        approximate=True)
    x = _layer_norm(tf, x + _dense(tf, hidden, d['hidden'],
                                   scope + 'output/dense', layer),
                    scope + 'output/LayerNorm')
  masked = tf.gather(x, positions, batch_dims=1)
  masked = _layer_norm(tf, tf.nn.gelu(_dense(
      tf, masked, d['hidden'], 'cls/predictions/transform/dense', 4),
                                      approximate=True),
                       'cls/predictions/transform/LayerNorm')
  bias = tf.compat.v1.get_variable('cls/predictions/output_bias',
                                   [d['vocab']],
                                   initializer=tf.compat.v1.zeros_initializer())
  logits = tf.tensordot(masked, words, [[2], [1]]) + bias
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def _batch_norm(tf, x, name, updates):
  """Batch norm in training mode; its moving statistics' updates go to
  `updates` (as tf.compat.v1.layers put them in UPDATE_OPS)."""
  channels = x.shape[-1]
  variable = lambda suffix, init, trainable=True: tf.compat.v1.get_variable(
      name + '/' + suffix, [channels], initializer=init, trainable=trainable)
  gamma = variable('gamma', tf.compat.v1.ones_initializer())
  beta = variable('beta', tf.compat.v1.zeros_initializer())
  moving_mean = variable('moving_mean', tf.compat.v1.zeros_initializer(),
                         False)
  moving_variance = variable('moving_variance',
                             tf.compat.v1.ones_initializer(), False)
  y, mean, variance = tf.compat.v1.nn.fused_batch_norm(
      x, gamma, beta, epsilon=1e-5, is_training=True)
  for moving, value in ((moving_mean, mean), (moving_variance, variance)):
    updates.append(tf.compat.v1.assign_sub(moving, 0.1 * (moving - value)))
  return y


def resnet_loss(tf, images, labels, updates):
  """ResNet-50 (v1.5: the stride in the 3x3 convolution), as the TPU
  reference models build it; returns the loss. Batch norm's updates go to
  `updates`."""
  d = _dims('resnet')
  count = [0]

  def conv(x, filters, size, stride=1):
    count[0] += 1
    w = tf.compat.v1.get_variable(
        'conv%d/kernel' % count[0], [size, size, x.shape[-1], filters],
        initializer=tf.compat.v1.variance_scaling_initializer(
            2.0, seed=count[0]))
    return tf.nn.conv2d(x, w, stride, 'SAME')

  def norm(x, relu=True):
    x = _batch_norm(tf, x, 'bn%d' % count[0], updates)
    return tf.nn.relu(x) if relu else x

  x = norm(conv(images, d['width'], 7, 2))
  x = tf.nn.max_pool2d(x, 3, 2, 'SAME')
  for stage, blocks in enumerate(d['blocks']):
    filters = d['width'] * 2**stage
    for block in range(blocks):
      stride = 2 if stage and not block else 1
      shortcut = x
      if not block:
        shortcut = norm(conv(x, 4 * filters, 1, stride), relu=False)
      y = norm(conv(x, filters, 1))
      y = norm(conv(y, filters, 3, stride))
      y = norm(conv(y, 4 * filters, 1), relu=False)
      x = tf.nn.relu(y + shortcut)
  x = tf.reduce_mean(x, [1, 2])
  logits = _dense(tf, x, d['classes'], 'logits', 0)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


# -------------------------------------------------------------- optimizers --

def _original_module():
  """The original module, loaded from its copy beside this file with its
  one import of a moved TensorFlow module fixed (measurement only)."""
  import types  # pylint: disable=g-import-not-at-top
  with open(ORIGINAL) as f:
    text = f.read().split('\n', 1)[1]  # (its first line is its file name)
  text = text.replace(
      'from tensorflow.compiler.xla.experimental.xla_sharding import '
      'xla_sharding',
      'from tensorflow.python.compiler.xla.experimental import xla_sharding')
  module = types.ModuleType('original_deferred_grad_optimizer')
  exec(compile(text, ORIGINAL, 'exec'), module.__dict__)  # pylint: disable=exec-used
  return module


def _train_op(tf, model, variant, loss, grad_steps, updates):
  """The variant's train op on `loss` (BERT clips, as BERT does)."""
  import deferred_grad  # pylint: disable=g-import-not-at-top
  global_step = tf.compat.v1.train.get_or_create_global_step()
  if model == 'bert':
    sys.path.insert(0, os.path.join(common.REPOSITORY, 'tools', 'examples'))
    from bert_optimization import AdamWeightDecayOptimizer  # pylint: disable=g-import-not-at-top
    optimizer = AdamWeightDecayOptimizer(1e-4)
    clip_norm = 1.0
  else:
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    clip_norm = None
  pairs = None
  if variant in ('bare_micro', 'bare_large', 'original'):
    pairs = optimizer.compute_gradients(loss)
    if clip_norm is not None:  # the script's own, before apply_gradients
      gradients, _ = tf.clip_by_global_norm([g for g, _ in pairs], clip_norm)
      pairs = list(zip(gradients, [v for _, v in pairs]))
  with tf.control_dependencies(updates):
    if variant == 'wrapper':
      train_op = deferred_grad.GradientAggregationOptimizer(
          optimizer, grad_steps, clip_norm=clip_norm).minimize(
              loss, global_step=global_step)
    elif variant == 'original':
      train_op = _original_module().GradientAggregationOptimizer(
          optimizer, grad_steps).apply_gradients(pairs, global_step)
    else:
      # (BERT's optimizer ignores global_step: counted here, as BERT does.)
      train_op = optimizer.apply_gradients(pairs, global_step)
      if model == 'bert':
        with tf.control_dependencies([train_op]):
          train_op = global_step.assign_add(1)
  return train_op


# ------------------------------------------------------------------ child --

def _parameter_count(tf):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return int(sum(np.prod(v.shape.as_list())
                 for v in tf.compat.v1.trainable_variables()))


def child(spec):
  """One variant in this process: 'model,variant,batch,grad_steps,cycles,
  traced' (traced 1: TensorFlow's allocator peak of one more cycle).

  Prints one JSON line: its pid, the parameter count, RSS (MB) after
  initialisation and after the first cycle, peaks, step times (s) by
  position in the cycle, and the sum and count of the example ids trained.
  """
  model, variant, batch, grad_steps, cycles, traced = spec.split(',')
  batch, grad_steps, cycles = int(batch), int(grad_steps), int(cycles)
  tf = common.import_tf()
  steps_per_cycle = 1 if variant == 'bare_large' else grad_steps
  examples_per_step = batch * (grad_steps if variant == 'bare_large' else 1)
  graph = tf.Graph()
  with graph.as_default():
    step = tf.compat.v1.placeholder(tf.int64, [])
    inputs, labels, ids = _examples(tf, model, step * examples_per_step,
                                    examples_per_step)
    updates = []
    if model == 'bert':
      loss = bert_loss(tf, inputs, labels)
    else:
      loss = resnet_loss(tf, inputs, labels, updates)
    train_op = _train_op(tf, model, variant, loss, grad_steps, updates)
    id_sum = tf.reduce_sum(ids)
    parameters = _parameter_count(tf)
    init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
  result = {'pid': os.getpid(), 'parameters': parameters,
            'parameter_mb': parameters * 4 / 2**20}
  with tf.compat.v1.Session(graph=graph) as session:
    session.run(init)
    result['rss_after_init_mb'] = peak_memory.current_rss_mb()
    result['peak_after_init_mb'] = peak_memory.peak_rss_mb()
    times, id_total, trained = [], 0, 0
    for run in range((1 + cycles) * steps_per_cycle):
      start = time.perf_counter()
      _, ids_here = session.run([train_op, id_sum], {step: run})
      times.append(time.perf_counter() - start)
      id_total += int(ids_here)
      trained += examples_per_step
      if run == steps_per_cycle - 1:
        result['rss_after_cycle_mb'] = peak_memory.current_rss_mb()
    # The peak before the traced cycle, whose trace itself takes memory
    # (about 1 GB on BERT-base): runs traced and not compare.
    result['peak_rss_mb'] = peak_memory.peak_rss_mb()
    if traced == '1':
      result['allocator_peak_mb'] = _traced_peak_mb(
          tf, session, train_op, step, len(times), steps_per_cycle)
  result.update(step_times=times[steps_per_cycle:],
                warm_up_times=times[:steps_per_cycle],
                id_sum=id_total, examples=trained,
                steps_per_cycle=steps_per_cycle)
  print(json.dumps(result))


def _traced_peak_mb(tf, session, train_op, step, done, steps):
  """TensorFlow's allocator peak over one traced cycle (MB), or None where
  its trace carries no bytes in use (its plain CPU allocator)."""
  peaks, tracked = {}, set()
  for run in range(done, done + steps):
    metadata = tf.compat.v1.RunMetadata()
    session.run(train_op, {step: run}, options=tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                run_metadata=metadata)
    for device in metadata.step_stats.dev_stats:
      for node in device.node_stats:
        for memory in node.memory:
          name = memory.allocator_name
          peaks[name] = max(peaks.get(name, 0), memory.peak_bytes,
                            memory.allocator_bytes_in_use)
          if memory.allocator_bytes_in_use:
            tracked.add(name)
  # (As the memory suite reads them: only allocators that record their
  # bytes in use keep a peak.)
  peaks = [peak for name, peak in peaks.items() if name in tracked]
  return max(peaks) / 2**20 if peaks else None


# ----------------------------------------------------------------- parent --

def measure(model, variant, batch, grad_steps, cycles, traced=True):
  """One variant's figures, from a fresh process (with the sizes' flags)."""
  return common.run_child(
      'scale', '%s,%s,%d,%d,%d,%d' % (model, variant, batch, grad_steps,
                                      cycles, traced),
      '--scale_sequence=%d' % FLAGS.scale_sequence,
      '--scale_image=%d' % FLAGS.scale_image,
      '--scale_toy=%s' % FLAGS.scale_toy)


def _micro_batch(model):
  if FLAGS.scale_toy:
    return 2
  return FLAGS.scale_bert_batch if model == 'bert' else FLAGS.scale_resnet_batch


def _per_example(result, examples_per_cycle):
  """Median seconds per example of a whole cycle."""
  per_cycle = result['steps_per_cycle']
  times = result['step_times']
  cycles = [sum(times[i:i + per_cycle])
            for i in range(0, len(times), per_cycle)]
  return common.median(cycles) / examples_per_cycle


def _by_position(result):
  """(median accumulate-only step, median apply step) seconds."""
  per_cycle = result['steps_per_cycle']
  times = result['step_times']
  accumulate = [t for i, t in enumerate(times) if i % per_cycle < per_cycle - 1]
  apply = [t for i, t in enumerate(times) if i % per_cycle == per_cycle - 1]
  return (common.median(accumulate) if accumulate else None,
          common.median(apply))


def _curve(model, batch, measured):
  """[(effective batch, wrapper's peak MB, bare's peak MB or None)].

  K=1 is the bare optimizer at b for both (with grad_steps=1 the wrapper
  passes each gradient on); the suite's K is its main runs'; the others
  run two cycles (one of warm-up), untraced.
  """
  points = []
  bare_fits = True
  for k in [int(k) for k in FLAGS.scale_curve]:
    if k == 1:
      wrapped = bare = measured['bare_micro']['peak_rss_mb']
    elif k == FLAGS.scale_grad_steps:
      wrapped = measured['wrapper']['peak_rss_mb']
      bare = measured['bare_large']['peak_rss_mb'] if bare_fits else None
    else:
      wrapped = measure(model, 'wrapper', batch, k, 1, False)['peak_rss_mb']
      bare = None
      if bare_fits:
        bare = measure(model, 'bare_large', batch, k, 1,
                       False)['peak_rss_mb']
    # A larger batch would take more than the budget: not run.
    bare_fits = bare_fits and bare * 1.5 <= FLAGS.scale_budget_mb
    points.append((k * batch, wrapped, bare))
    print('scale curve: %s %s' % (model, points[-1]), flush=True)
  return points


def run():
  k = FLAGS.scale_grad_steps
  results, rows, memory_rows, curves = {}, [], [], {}
  for model in FLAGS.scale_models:
    batch = _micro_batch(model)
    measured = {variant: measure(model, variant, batch, k, FLAGS.scale_cycles)
                for variant in VARIANTS}
    for variant, result in measured.items():
      print('scale: %s %s %s' % (model, variant, json.dumps(
          {key: value for key, value in result.items()
           if not key.endswith('times')})), flush=True)
    # The bookkeeping: every variant trained the same examples, each in a
    # process of its own.
    sums = set((r['id_sum'], r['examples']) for r in measured.values())
    assert len(sums) == 1, sums
    assert len(set(r['pid'] for r in measured.values())) == len(VARIANTS)
    parameter_mb = measured['wrapper']['parameter_mb']
    # A cycle of every variant trains K*b examples (bare at b: K steps).
    per_example = {v: _per_example(r, k * batch) for v, r in measured.items()}
    bare = measured['bare_micro']
    name = {'bert': 'BERT-base, sequence %d' % _dims('bert')['sequence'],
            'resnet': 'ResNet-50, %dx%d' % ((_dims('resnet')['image'],) * 2)
            }[model]
    for variant in ('wrapper', 'original'):
      result = measured[variant]
      accumulate, apply = _by_position(result)
      bare_step, _ = _by_position(bare)
      bare_step = bare_step or _by_position(bare)[1]
      rows.append([
          '%s (P = %.0f MB), K=%d x b=%d' % (name, parameter_mb, k, batch),
          variant,
          '%.1f ms' % (1e3 * per_example[variant]),
          '%.3fx' % (per_example[variant] / per_example['bare_micro']),
          '%.3fx' % (per_example[variant] / per_example['bare_large']),
          '%.3fx / %.3fx' % (accumulate / bare_step, apply / bare_step)])
      extra = lambda key, r=result: (r[key] - bare[key]) / parameter_mb
      allocator = [r.get('allocator_peak_mb') for r in (
          bare, result, measured['bare_large'])]
      memory_rows.append([
          '%s, K=%d x b=%d' % (name, k, batch), variant,
          '%.0f' % bare['peak_rss_mb'], '%.0f' % result['peak_rss_mb'],
          '%.0f' % measured['bare_large']['peak_rss_mb'],
          '%.2f' % (result['peak_rss_mb'] /
                    measured['bare_large']['peak_rss_mb']),
          '%+.2f P / %+.2f P / %+.2f P' % (
              extra('rss_after_init_mb'), extra('rss_after_cycle_mb'),
              extra('peak_rss_mb')),
          '-' if None in allocator else '%.0f / %.0f / %.0f (%+.2f P)' % (
              tuple(allocator) + ((allocator[1] - allocator[0]) /
                                  parameter_mb,))])
    results[model] = {'micro_batch': batch, 'grad_steps': k,
                      'per_example_s': per_example, 'measured': measured}
    if FLAGS.scale_curve:
      curves[model] = _curve(model, batch, measured)
      results[model]['curve'] = curves[model]
  table = common.markdown(
      ['model', 'variant', 'time per example, whole cycle',
       '/ bare at b', '/ bare at K*b',
       'accumulate-only / apply step, over a bare step at b'], rows)
  table += '\n\nPeak RSS (MB, each a process of its own):\n\n' + (
      common.markdown(['model', 'variant', 'bare at b', 'this variant',
                       'bare at K*b', 'this / bare at K*b',
                       'extra over bare at b, in parameter bytes: after '
                       'init / after a cycle / peak',
                       'TF allocator peak: bare at b / this / bare at K*b '
                       '(extra)'], memory_rows))
  for model, points in curves.items():
    table += '\n\nPeak RSS (MB) against the effective batch, %s (b=%d):' \
             '\n\n' % (model, _micro_batch(model)) + common.markdown(
                 ['effective batch', 'wrapper', 'bare'],
                 [[n, '%.0f' % w, '-' if b is None else '%.0f' % b]
                  for n, w, b in points])
  if FLAGS.plot and curves:
    write_plot(FLAGS.plot, curves, FLAGS.scale_budget_mb)
    table += '\n\nplot: %s' % FLAGS.plot
  return {'scale': results}, table


# ------------------------------------------------------------------- plot --

def _matplotlib():
  """matplotlib, or None where this Python lacks it."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return matplotlib


def plot_problem(path):
  """Why `path` cannot be drawn with this Python, or None where it can."""
  extension = os.path.splitext(path)[1].lower()
  if _matplotlib() is None:
    if extension == '.svg':
      return None  # drawn by hand
    return ('writing %s needs matplotlib, which this Python lacks: %s -m pip '
            'install matplotlib; or name a .svg file, drawn without it' % (
                extension or 'a file without an extension', sys.executable))
  from matplotlib import backend_bases  # pylint: disable=g-import-not-at-top
  formats = backend_bases.FigureCanvasBase.get_supported_filetypes()
  if extension[1:] not in formats:
    return 'matplotlib writes %s, not %s' % (
        ', '.join('.' + name for name in sorted(formats)),
        extension or 'a file without an extension')
  return None


def _check_plot(path):
  """--plot's validator: fails the flags' parsing, before any run."""
  problem = path and plot_problem(path)
  if problem:
    raise common.flags.ValidationError(problem)
  return True


common.flags.register_validator('plot', _check_plot)


def write_plot(path, curves, budget_mb):
  """Draws `curves` ({model: [(effective batch, wrapper's peak MB, bare's
  or None)]}) into `path`: with matplotlib where this Python has it, in
  the format its extension names; else an SVG drawn by hand (.svg only)."""
  problem = plot_problem(path)
  if problem:
    raise ValueError('--plot=%s: %s' % (path, problem))
  if _matplotlib() is None:
    with open(path, 'w') as f:
      f.write(plot_svg(curves, budget_mb))
    return
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib import figure  # pylint: disable=g-import-not-at-top
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  models = sorted(curves)
  drawn = figure.Figure(figsize=(4.5 * len(models), 3.6))
  for index, (axes, model) in enumerate(zip(
      drawn.subplots(1, len(models), squeeze=False)[0], models)):
    points = curves[model]
    batches = [n for n, _, _ in points]
    for column, colour, marker, label in (
        (1, '#1f77b4', 'o-', 'deferred_grad, K x b'),
        (2, '#d62728', 's--', 'bare optimizer, K*b')):
      line = [(p[0], p[column]) for p in points if p[column] is not None]
      axes.plot([n for n, _ in line], [v for _, v in line], marker,
                color=colour, label=label)
    values = [v for _, w, b in points for v in (w, b) if v is not None]
    if budget_mb < 2 * max(values):  # as the SVG: shown when it is near
      axes.axhline(budget_mb, color='gray', linestyle=':', label='budget')
    # The batch doubles from point to point: a log scale spaces them evenly.
    axes.set_xscale('log', base=2)
    axes.xaxis.set_major_locator(ticker.FixedLocator(batches))
    axes.xaxis.set_major_formatter(ticker.FixedFormatter(
        [str(n) for n in batches]))
    axes.xaxis.set_minor_locator(ticker.NullLocator())
    axes.set_ylim(bottom=0)
    axes.set_title(NAMES.get(model, model))
    axes.set_xlabel('effective batch')
    axes.grid(alpha=0.3)
    if not index:
      axes.set_ylabel('peak RSS (MB)')
      axes.legend(fontsize=8, loc='best')
  drawn.tight_layout()
  # Text stays text in an SVG (searchable, as the hand-drawn one's).
  with matplotlib.rc_context({'svg.fonttype': 'none'}):
    drawn.savefig(path, dpi=120)


def plot_svg(curves, budget_mb):
  """An SVG of peak memory against the effective batch, a panel a model:
  the bare optimizer's line rises with the batch, the wrapper's stays."""
  width, height, margin = 360, 260, 50
  panels = []
  for index, (model, points) in enumerate(sorted(curves.items())):
    left = index * (width + 20)
    batches = [n for n, _, _ in points]
    values = [v for _, w, b in points for v in (w, b) if v is not None]
    top = max(values + [budget_mb if budget_mb < 2 * max(values) else 0])
    # The batch doubles from point to point: a log scale spaces them evenly.
    x = lambda n, l=left, lo=math.log(min(batches)), hi=math.log(
        max(batches)): l + margin + (width - margin - 20) * (
            math.log(n) - lo) / float(hi - lo or 1)
    y = lambda v, t=top: height - margin + 10 - (height - margin - 10) * v / t
    parts = ['<text x="%d" y="16" font-size="13">%s</text>' % (
        left + margin, NAMES.get(model, model))]
    parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (
        x(min(batches)), y(0), x(max(batches)), y(0)))
    parts.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>' % (
        x(min(batches)), y(0), x(min(batches)), y(top)))
    for n in batches:
      parts.append('<text x="%.0f" y="%.0f" font-size="10" '
                   'text-anchor="middle">%d</text>' % (x(n), y(0) + 14, n))
    for fraction in (0.5, 1.0):
      parts.append('<text x="%.0f" y="%.0f" font-size="10" '
                   'text-anchor="end">%.0f</text>' % (
                       x(min(batches)) - 4, y(top * fraction) + 3,
                       top * fraction))
    parts.append('<text x="%.0f" y="%.0f" font-size="10">effective batch'
                 '</text>' % (x(min(batches)) + 60, y(0) + 28))
    for column, colour, label, below in (
        (1, '#1f77b4', 'deferred_grad, K x b', 14),
        (2, '#d62728', 'bare optimizer, K*b', -6)):
      line = [(x(p[0]), y(p[column])) for p in points if p[column] is not None]
      parts.append('<polyline fill="none" stroke="%s" stroke-width="2" '
                   'points="%s"/>' % (colour, ' '.join(
                       '%.1f,%.1f' % xy for xy in line)))
      parts.extend('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (
          px, py, colour) for px, py in line)
      parts.append('<text x="%.0f" y="%.0f" font-size="10" fill="%s">%s'
                   '</text>' % (line[-1][0] - 100, line[-1][1] + below,
                                colour, label))
    if budget_mb <= top:
      parts.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="gray" '
                   'stroke-dasharray="4"/><text x="%d" y="%.1f" '
                   'font-size="10" fill="gray">budget</text>' % (
                       x(min(batches)), y(budget_mb), x(max(batches)),
                       y(budget_mb), x(min(batches)) + 4, y(budget_mb) - 3))
    panels.append('\n'.join(parts))
  return ('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d">'
          '\n<rect width="100%%" height="100%%" fill="white"/>'
          '\n<text x="4" y="%d" font-size="10" transform="rotate(-90 4 %d)">'
          'peak RSS (MB)</text>\n%s\n</svg>\n' % (
              len(curves) * (width + 20), height + 10, height // 2,
              height // 2, '\n'.join(panels)))
