"""The scripts under tools/ run: the demo and every example (the guides).

Each example that compares itself with the large batch prints its largest
difference; the tests hold it to float32 round-off.
"""

import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import scripts
from scripts import run_once_per_version
from scripts import run_tool

_needs_estimator = pytest.mark.skipif(
    not hasattr(tf.compat.v1, 'estimator'),
    reason='tf.estimator was removed after TensorFlow 2.15 (tested there)')
_SMALL = ['--grad_steps=2', '--updates=6']


@run_once_per_version
def test_demo_trains_like_the_large_batch():
  output = run_tool('demo.py', '--batch_size=64', '--grad_steps=4',
                    '--updates=3')
  assert 'OK: (b) trained like (a)' in output
  assert '| (b) 4 x 16, deferred_grad |' in output


@run_once_per_version
@pytest.mark.parametrize('example', [
    'session_example.py',
    pytest.param('estimator_example.py', marks=_needs_estimator),
    pytest.param('tpu_estimator_example.py', marks=_needs_estimator),
])
def test_example_trains(example):
  output = run_tool('examples/' + example, *_SMALL)
  first, last = scripts.loss_decrease(output)
  assert last < first
  if example == 'estimator_example.py':  # global_step counts updates
    assert 'global_step 3 ' in output and 'global_step 6 ' in output, output
    scripts.assert_no_porting_warning(output)


@run_once_per_version
def test_bert_porting_example_trains_like_the_large_batch():
  output = run_tool('examples/bert_porting.py', '--updates=3')
  assert 'large batch: global_step 3; 4 micro-batches per update: ' \
      'global_step 12' in output, output
  difference = float(output.rsplit('largest weight difference:', 1)[1])
  # BERT's loss adds 1e-5 to the masked-token count (see the example).
  assert difference < 1e-4, output


@run_once_per_version
@_needs_estimator
def test_tpu_image_porting_example_trains_like_the_large_batch():
  """Weights and moving averages as the large batch's; the averaged models
  evaluate alike."""
  output = run_tool('examples/tpu_image_porting.py', '--grad_steps=3',
                    '--updates=4')
  differences = scripts.largest_differences(output)
  assert len(differences) == 2 and max(differences) < 1e-5, output
  large, micro = [float(x) for x in re.findall(
      r'(?:large batch|deferred_grad) ([\d.]+)', output.splitlines()[-1])]
  assert abs(large - micro) < 1e-5, output


@scripts.run_examples_once_per_version
@pytest.mark.parametrize('example, flags, figures', [
    ('mirrored_example.py', ['--grad_steps=3', '--updates=4'], 1),
    ('multi_worker_example.py', ['--grad_steps=3', '--updates=3'], 2),
    ('embedding_example.py', ['--grad_steps=3', '--updates=4'], 1),
    ('xla_example.py', ['--grad_steps=3', '--updates=4'], 1),
    ('numerics_example.py', ['--grad_steps=3', '--updates=5'], 2),
    ('monitored_session_example.py', ['--grad_steps=3', '--updates=4'], 1),
    ('schedule_example.py', ['--micro_batch=64', '--updates_per=2'], 1),
])
def test_example_trains_like_the_large_batch(example, flags, figures):
  output = run_tool('examples/' + example, *flags)
  differences = scripts.largest_differences(output)
  assert len(differences) == figures, output
  assert max(differences) < 1e-5, output


@run_once_per_version
@_needs_estimator
def test_canned_estimator_example_trains_like_the_large_batch():
  output = run_tool('examples/canned_estimator_example.py', '--grad_steps=2',
                    '--updates=4')
  difference, = scripts.largest_differences(output)
  assert difference < 1e-5, output
  assert 'global_step 8, ' in output, output


@run_once_per_version
def test_parameter_server_example_trains():
  first, last = scripts.loss_decrease(run_tool(
      'examples/parameter_server_example.py', '--grad_steps=2',
      '--updates=8'))
  assert last < first


@run_once_per_version
def test_keras_example_ports_fit_as_the_large_batch():
  """Keras's Adam, LearningRateScheduler and ModelCheckpoint: the port
  matches fit at the large batch without batch norm; with it (ghost batch
  norm) it prints what it measured."""
  output = run_tool('examples/keras_fit_example.py', '--grad_steps=2',
                    '--epochs=3')
  first, last = scripts.loss_decrease(output)
  assert last < first
  # An epoch is 8 updates; 'updates' counts them in iterations.
  assert "iterations (updates): 24, the large batch's 24" in output, output
  difference, = scripts.largest_differences(output)
  assert difference < 1e-5, output
  assert re.search(r'with batch norm .* weights [\d.e-]+ relative off',
                   output), output
  scripts.assert_no_porting_warning(output)


@run_once_per_version
@pytest.mark.skipif(not scripts.NEWEST_TENSORFLOW and os.environ.get(
    'DEFERRED_GRAD_ALL_CONFIGURATIONS', '') in ('', '0'),
                    reason='flag parsing, as the newest TensorFlow runs it '
                    '(DEFERRED_GRAD_ALL_CONFIGURATIONS=1: every version)')
def test_every_guide_prints_its_help_and_exits_zero():
  """absl exits 1 after --help; the guides (run_guide.run) exit 0. Each
  guide also runs (and so imports) on each version in the tests above."""
  guides = sorted(name for name in os.listdir(os.path.join(scripts.TOOLS,
                                                           'examples'))
                  if name.endswith(('_example.py', '_porting.py')))
  assert len(guides) >= 15, guides
  # Two at a time: each imports TensorFlow, which takes a few seconds.
  running = []
  for guide, flag in [(guide, '--help') for guide in guides] + [
      (guides[0], '-h')]:
    running.append((guide, flag, subprocess.Popen(
        [sys.executable, os.path.join(scripts.TOOLS, 'examples', guide),
         flag], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        universal_newlines=True)))
    if len(running) >= 2:
      running[-2][2].wait(timeout=120)
  for guide, flag, process in running:
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, (guide, flag, output)
    assert 'flags:' in output, (guide, flag, output)
