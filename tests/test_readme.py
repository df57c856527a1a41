"""Every Python block of README.md runs as written, with `...` filled in.

Each block has an entry in FILL_INS, keyed by its first line: code run
before it (the names the block takes from the surrounding prose),
replacements of its `...` placeholders, and code run after it that checks
what it did. A block without an entry fails `test_every_block_has_a_fill_in`,
so the README cannot drift from what runs.
"""

import os
import re
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import scripts

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                      'README.md')
sys.path.insert(0, os.path.join(scripts.TOOLS, 'examples'))

_HAS_ESTIMATOR = hasattr(tf.compat.v1, 'estimator')


def _python_blocks():
  """(first line, code) of every ```python block of the README."""
  with open(README) as f:
    text = f.read()
  blocks = [textwrap.dedent(code)
            for code in re.findall(r'```python\n(.*?)```', text, re.S)]
  return [(code.strip().splitlines()[0], code) for code in blocks]


# Names the prose around the blocks assumes.
_MODEL = '''
import numpy as np
import tensorflow as tf
import deferred_grad
global_step = tf.compat.v1.train.get_or_create_global_step()
w = tf.compat.v1.get_variable('w', initializer=[1.0, -2.0])
x = tf.constant(np.random.RandomState(0).randn(4, 2).astype(np.float32))
loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - 1.0))
opt = tf.compat.v1.train.AdamOptimizer(1e-3)
learning_rate = 0.1
num_updates = 2
'''

_RUN_AND_CHECK = '''
with tf.compat.v1.Session() as session:
  session.run(tf.compat.v1.global_variables_initializer())
  before = session.run(w)
  for _ in range(16):
    session.run(train_op)
  assert session.run(global_step) == 16
  assert not np.array_equal(session.run(w), before)
'''

_ESTIMATOR_INPUT = '''
import tempfile
import numpy as np
import tensorflow as tf
import deferred_grad
num_updates = 2

def input_fn(params=None):
  x = np.random.RandomState(1).randn(512, 3).astype(np.float32)
  return tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))
                                           ).repeat().batch(8)
'''

_ESTIMATOR_LOSS = ('loss = tf.reduce_mean(tf.square(tf.compat.v1.layers.dense('
                   'features, 1) - labels))')

_BERT = '''
import numpy as np
import tensorflow as tf
import deferred_grad
from bert_porting import AdamWeightDecayOptimizer, learning_rate_schedule
'''

FILL_INS = {
    'import tensorflow as tf': dict(  # Usage
        before='''
import numpy as np
def next_micro_batch():
  return tf.constant(np.random.RandomState(0).randn(4, 2).astype(np.float32))
def build_model(x):
  global w
  w = tf.compat.v1.get_variable('w', initializer=[1.0, -2.0])
  return tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - 1.0))
num_updates = 2
''',
        after='''
with tf.compat.v1.Session() as session:
  session.run(tf.compat.v1.global_variables_initializer())
  assert session.run(global_step) == 0
'''),
    'opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)': dict(
        before=_MODEL, after=_RUN_AND_CHECK),
    'train_op = deferred_grad.GradientAggregationOptimizer(opt, 8).minimize(':
        dict(before=_MODEL + 'import tempfile\nmodel_dir = tempfile.mkdtemp()\n',
             after='''
assert tf.train.load_variable(model_dir, 'global_step') == 16
'''),
    'def model_fn(features, labels, mode, params):': dict(  # Estimator
        needs_estimator=True,
        before=_ESTIMATOR_INPUT,
        replace={'  loss = ...': '  ' + _ESTIMATOR_LOSS,
                 'estimator.train(': 'estimator = tf.compat.v1.estimator.'
                                     'Estimator(model_fn, model_dir='
                                     'tempfile.mkdtemp())\nestimator.train('},
        after='''
assert estimator.get_variable_value('global_step') == 16
'''),
    'use_tpu = False  # True on a TPU; the same value goes to TPUEstimator': dict(
        needs_estimator=True,
        before=_ESTIMATOR_INPUT.replace(
            '.batch(8)', ".batch(params['batch_size'], drop_remainder=True)"),
        replace={'  loss = ...': '  ' + _ESTIMATOR_LOSS},
        after='''
tpu = tf.compat.v1.estimator.tpu
estimator = tpu.TPUEstimator(
    model_fn, config=tpu.RunConfig(
        model_dir=tempfile.mkdtemp(),
        tpu_config=tpu.TPUConfig(iterations_per_loop=8)),
    train_batch_size=8, use_tpu=use_tpu)
estimator.train(input_fn, max_steps=16)
assert estimator.get_variable_value('global_step') == 16
'''),
    'train_op = opt.apply_gradients(grads_and_vars)   # no global_step': dict(
        before=_MODEL + '''
opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)
grads_and_vars = opt.compute_gradients(loss)
''',
        after=_RUN_AND_CHECK),
    'def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps):':
        dict(before=_BERT, after='create_optimizer_before = create_optimizer'),
    'def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps,':
        dict(before=_BERT, after='create_optimizer_after = create_optimizer'),
    'updates = deferred_grad.applied_updates(global_step, grad_steps=8)': dict(
        before=_MODEL,
        after='''
train_op = opt.minimize(loss, global_step=global_step)
''' + _RUN_AND_CHECK),
    'tokens = tf.compat.v1.placeholder(tf.int32, [None, 16])': dict(
        before=_MODEL + '''
weights_to_learn = tf.compat.v1.get_variable('weights_to_learn',
                                             initializer=0.5)
''',
        after='''
rng = np.random.RandomState(0)
with tf.compat.v1.Session() as session:
  session.run(tf.compat.v1.global_variables_initializer())
  for _ in range(8):
    batch = rng.randint(0, 5, size=(2, 16))
    session.run(train_op, {tokens: batch})
  assert session.run(global_step) == 8
  assert session.run(weights_to_learn) != 0.5
'''),
    'train_op = opt.minimize(loss, global_step=global_step)': dict(
        variants={
            'summary': dict(
                before=_MODEL + '''
opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)
''',
                after='''
with tf.compat.v1.Session() as session:
  session.run(tf.compat.v1.global_variables_initializer())
  written = [session.run([train_op, summary])[1] for _ in range(16)]
  assert [bool(s) for s in written] == [i % 8 == 7 for i in range(16)]
'''),
            'saver': dict(
                before=_MODEL + '''
opt = deferred_grad.GradientAggregationOptimizer(opt, grad_steps=8)
''',
                after='''
import tempfile
path = tempfile.mkdtemp() + '/model'
with tf.compat.v1.Session() as session:
  session.run(tf.compat.v1.global_variables_initializer())
  session.run(train_op)
  saver.save(session, path)
  saver.restore(session, path)
  assert session.run(global_step) == 1
'''),
        }),
    'strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()':
        dict(skip='needs two worker processes: tests/test_multi_worker.py '
             'runs this recipe'),
    'def model_fn(features, labels, mode):': dict(
        skip='needs a chief and a worker process: tests/test_multi_worker.py '
             'runs this recipe (TensorFlow 2.15)'),
    'cluster = tf.train.ClusterSpec({\'ps\': [...], \'worker\': [...]})': dict(
        # One ps and one worker server in this process.
        before='''
import socket
import numpy as np
import tensorflow as tf
import deferred_grad
sockets = [socket.socket() for _ in range(2)]
for s in sockets:
  s.bind(('127.0.0.1', 0))
addresses = ['127.0.0.1:%d' % s.getsockname()[1] for s in sockets]
for s in sockets:
  s.close()
task_index = 0
''',
        replace={
            "{'ps': [...], 'worker': [...]}":
                "{'ps': addresses[:1], 'worker': addresses[1:]})\n"
                "ps_server = tf.distribute.Server(cluster, 'ps', 0)\n"
                "server = tf.distribute.Server(cluster, 'worker', 0",
            '  loss = ...': "  loss = tf.reduce_sum(tf.square("
                            "tf.compat.v1.get_variable('w', initializer="
                            "[1.0, -2.0])))",
            'is_chief=task_index == 0)':
                'is_chief=task_index == 0, '
                'hooks=[tf.compat.v1.train.StopAtStepHook(last_step=16)])',
        },
        after='''
assert all(v.device.startswith('/job:worker')
           for v in tf.compat.v1.local_variables())
assert tf.compat.v1.local_variables()
with tf.compat.v1.Session(server.target) as session:
  assert session.run(global_step) == 16
'''),
    'opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(':
        dict(before=_MODEL, after='''
train_op = opt.minimize(loss, global_step=global_step)
''' + _RUN_AND_CHECK),
}


def _cases():
  """(id, first line, code, fill-in) for every block and variant."""
  cases = []
  seen = {}
  for first, code in _python_blocks():
    fill_in = FILL_INS.get(first, {})
    if 'variants' in fill_in:
      names = sorted(fill_in['variants'])
      # Blocks that share a first line: told apart by what they contain.
      name = [n for n in names if n in code][0] if any(
          n in code for n in names) else names[seen.get(first, 0)]
      seen[first] = seen.get(first, 0) + 1
      fill_in = fill_in['variants'][name]
    cases.append(('line: %s' % first[:40], first, code, fill_in))
  return cases


def test_every_block_has_a_fill_in():
  blocks = _python_blocks()
  assert len(blocks) >= 15
  missing = [first for first, _ in blocks if first not in FILL_INS]
  assert not missing, 'README blocks without a fill-in: %s' % missing


def _run(code, fill_in):
  for old, new in fill_in.get('replace', {}).items():
    assert old in code, old
    code = code.replace(old, new)
  assert re.search(r'=\s*\.\.\.\s*$', code, re.M) is None, code
  namespace = {}
  with tf.Graph().as_default():
    exec(fill_in.get('before', ''), namespace)  # pylint: disable=exec-used
    exec(code, namespace)  # pylint: disable=exec-used
    exec(fill_in.get('after', ''), namespace)  # pylint: disable=exec-used
  return namespace


@pytest.mark.parametrize('case', _cases(), ids=lambda case: case[0])
def test_block_runs(case):
  _, first, code, fill_in = case
  if 'skip' in fill_in:
    pytest.skip(fill_in['skip'])
  if fill_in.get('needs_estimator') and not _HAS_ESTIMATOR:
    pytest.skip('tf.estimator was removed after TensorFlow 2.15 (tested '
                'there)')
  del first
  _run(code, fill_in)


def test_porting_blocks_train_like_each_other():
  """The README's BERT create_optimizer, before (a large batch) and after
  (micro-batches with token weights), train to the same weights."""
  import bert_porting  # pylint: disable=g-import-not-at-top
  blocks = {first: code for first, code in _python_blocks()}
  functions = {}
  for key in ('def create_optimizer(loss, init_lr, num_train_steps, '
              'num_warmup_steps):',
              'def create_optimizer(loss, init_lr, num_train_steps, '
              'num_warmup_steps,'):
    functions.update(_run(blocks[key], FILL_INS[key]))
  grad_steps, micro_batch, updates = 4, 2, 4
  examples = bert_porting.make_examples(updates * grad_steps, micro_batch,
                                        (3, 7, 1, 5))
  weights = []
  for name, batch, runs in (
      ('create_optimizer_before', grad_steps * micro_batch, updates),
      ('create_optimizer_after', micro_batch, updates * grad_steps)):
    with tf.Graph().as_default():
      feeds = [tf.compat.v1.placeholder(dtype, [None, bert_porting.SEQUENCE])
               for dtype in (tf.int32, tf.int32, tf.float32)]
      loss = bert_porting.masked_lm_loss(*feeds, epsilon=0.0)
      kwargs = dict(bert_porting.SCHEDULE)
      if name.endswith('after'):
        kwargs.update(grad_steps=grad_steps,
                      masked_tokens=tf.reduce_sum(feeds[2]))
      train_op = functions[name](loss, **kwargs)
      with tf.compat.v1.Session() as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for run in range(runs):
          rows = slice(run * batch, (run + 1) * batch)
          session.run(train_op, {f: part[rows]
                                 for f, part in zip(feeds, examples)})
        weights.append(session.run(
            {v.op.name: v for v in tf.compat.v1.trainable_variables()}))
  for name in weights[0]:
    np.testing.assert_allclose(weights[1][name], weights[0][name],
                               rtol=1e-5, atol=1e-5, err_msg=name)
