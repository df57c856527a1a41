"""The tools that answer "what does it cost on my model": they run and keep
their books.

tools/benchmark's `scale` suite at toy sizes (BERT-base's and ResNet-50's
code, shrunk), and tools/measure_model.py on README's complete script and on
a guide's model_fn: each variant in a process of its own, every variant
trained on the same examples.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import scripts
import test_readme

_newest_only = pytest.mark.skipif(
    not scripts.NEWEST_TENSORFLOW,
    reason='the benchmarks run on the newest TensorFlow (tools/benchmark)')


@scripts.run_examples_once_per_version
@_newest_only
def test_the_scale_suite_runs_at_toy_sizes_and_keeps_its_books(tmp_path):
  output, plot = str(tmp_path / 'scale.json'), str(tmp_path / 'scale.svg')
  # K=2 and a curve to 4: the curve reuses the main runs for K=1 and K=2
  # and measures K=4 in processes of its own.
  printed = scripts.run_tool(
      'benchmark.py', '--suites=scale', '--scale_toy', '--scale_grad_steps=2',
      '--scale_curve=1,2,4', '--scale_cycles=1', '--output=' + output,
      '--plot=' + plot)
  with open(output) as f:
    results = json.load(f)['scale']
  assert sorted(results) == ['bert', 'resnet'], results.keys()
  for model, result in results.items():
    measured = result['measured']
    assert sorted(measured) == ['bare_large', 'bare_micro', 'original',
                                'wrapper'], model
    # The same examples in every variant: K*b a cycle, one of warm-up.
    k, b = result['grad_steps'], result['micro_batch']
    assert set((m['id_sum'], m['examples']) for m in measured.values()) == {
        (sum(range(2 * k * b)), 2 * k * b)}, (model, measured)
    # Each in a process of its own, not this one.
    pids = [m['pid'] for m in measured.values()]
    assert len(set(pids)) == 4 and os.getpid() not in pids, pids
    for m in measured.values():
      assert m['peak_rss_mb'] >= m['rss_after_init_mb'] > 0, (model, m)
      assert len(m['step_times']) == m['steps_per_cycle'], (model, m)
    assert measured['wrapper']['steps_per_cycle'] == k
    assert measured['bare_large']['steps_per_cycle'] == 1
    assert [point[0] for point in result['curve']] == [b, 2 * b, 4 * b]
  assert '| BERT-base' in printed and '| ResNet-50' in printed, printed
  with open(plot) as f:
    svg = f.read()
  # Drawn by hand, or by matplotlib where it is installed (text kept text).
  assert '<svg' in svg and 'BERT-base' in svg and 'ResNet-50' in svg


def _measure(tmp_path, *flags):
  # Its output's form, not stable figures: a few short rounds.
  output = scripts.run_tool('measure_model.py', '--cycles=1',
                            '--budget_mb=4000', '--search_up_to=2',
                            '--max_rounds=4', '--max_seconds=10', *flags)
  # Each time with its last rounds' min-max, and NOT STABLE where they
  # did not settle.
  rows = re.findall(r'\| (bare optimizer, batch \S+|deferred_grad, K x b) '
                    r'\| [\d.]+ (?:s|ms|us) \| [\d.]+-[\d.]+ (?:s|ms|us) '
                    r'\([\d.]+%\): rounds of (\d+) cycles?, \d+ timed'
                    r'(; NOT STABLE)?', output)
  assert len(rows) == 3, output
  assert ('NOT STABLE: ' in output) == any(r[2] for r in rows), output
  assert 'what the wrapper keeps (and its checkpoints add): accumulator' in (
      output), output
  assert 'largest effective batch of the bare optimizer within 4000 MB' in (
      output), output
  return output


@scripts.run_once_per_version
@pytest.mark.skipif(not scripts.NEWEST_TENSORFLOW,
                    reason='on TensorFlow 2.15 the model_fn test runs it')
def test_measure_model_runs_on_the_readme_script(tmp_path):
  (block,) = test_readme._python_blocks()  # pylint: disable=protected-access
  script = tmp_path / 'script.py'
  script.write_text(block)
  output = _measure(tmp_path, '--model=%s:build' % script, '--micro_batch=32',
                    '--grad_steps=2')
  assert 'K=2 micro-batches of b=32' in output, output
  # P is 32 bytes: the extra memory in KB or MB, not in multiples of P.
  assert 'P = 32 bytes of parameters' in output, output
  assert 'not in multiples of the parameters\' bytes P' in output, output
  assert not re.search(r'[\d.] P\b', output), output


@scripts.run_once_per_version
@pytest.mark.skipif(not hasattr(tf.compat.v1, 'estimator'),
                    reason='the guide returns a TPUEstimatorSpec (TF 2.15)')
def test_measure_model_runs_on_a_guide_s_model_fn(tmp_path):
  guide = os.path.join(scripts.TOOLS, 'examples', 'tpu_image_porting.py')
  output = _measure(tmp_path, '--model=%s:model_fn' % guide,
                    '--input_fn=%s:input_fn' % guide, '--micro_batch=8',
                    '--grad_steps=2')
  assert 'K=2 micro-batches of b=8' in output, output


def test_measure_model_times_until_the_rounds_agree_and_says_when_not():
  import measure_model  # pylint: disable=g-import-not-at-top
  # The last three rounds within 5% (max-min over their median), no fewer.
  assert not measure_model.settled([1.0, 1.02], 0.05)
  assert measure_model.settled([3.0, 1.0, 1.02, 1.04], 0.05)
  assert not measure_model.settled([1.0, 1.02, 1.2], 0.05)
  # Rounds of 2 cycles: the last three; fewer cycles make smaller rounds.
  assert measure_model.rounds_of([9, 1, 1, 2, 2, 3, 3], 2) == ([2, 4, 6], 2)
  assert measure_model.rounds_of([9, 1, 2, 3, 4], 2) == ([2, 3, 4], 1)
  assert measure_model.rounds_of([1, 2], 2) == ([1, 2], 1)
  result = {'rounds': [0.64, 0.21, 0.3], 'cycles_per_round': 1,
            'cycles_timed': 20, 'stopped': 'stopped by --max_rounds=20'}
  time, spread = measure_model.timing(result, 1000)
  assert time == '300 us', time
  assert spread == ('210-640 us (143.3%): rounds of 1 cycle, 20 timed; NOT '
                    'STABLE (stopped by --max_rounds=20)'), spread
  result.update(rounds=[2.0, 2.01, 2.02], stopped='stable')
  assert measure_model.timing(result, 1000) == (
      '2.01 ms', '2.00-2.02 ms (1.0%): rounds of 1 cycle, 20 timed')


def test_measure_model_sizes_read_in_bytes_kb_and_mb():
  import measure_model  # pylint: disable=g-import-not-at-top
  assert measure_model.size(6 * 1024) == '6.00 KB'
  assert measure_model.size(32) == '32 bytes'
  assert measure_model.size(418 * 2**20) == '418 MB'
  assert measure_model.size(1.3 * 2**20, signed=True) == '+1.30 MB'
  assert measure_model.size(-692 * 1024, signed=True) == '-692 KB'


_CURVES = {'bert': [(2, 100.0, 100.0), (4, 104.0, 150.0), (8, 103.0, None)],
           'resnet': [(4, 50.0, 50.0), (8, 52.0, 90.0)]}


def _in_a_fresh_process(code, tmp_path):
  """Runs `code` (with `scale` imported from tools/benchmarks) in a process
  of its own: `benchmarks.common` defines absl flags that a guide imported
  by another test of this process may have defined already."""
  prelude = ('import os, sys\nsys.path.insert(0, %r)\n'
             'from benchmarks import scale\ntmp = %r\nCURVES = %r\n' % (
                 scripts.TOOLS, str(tmp_path), _CURVES))
  result = subprocess.run([sys.executable, '-c', prelude + code],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120)
  assert result.returncode == 0, result.stdout
  return result.stdout


def test_the_scale_plot_is_an_svg_without_matplotlib(tmp_path):
  _in_a_fresh_process('''
sys.modules['matplotlib'] = None  # not installed
path = os.path.join(tmp, 'scale.svg')
scale.write_plot(path, CURVES, 120)
svg = open(path).read()
assert svg.startswith('<svg') and 'BERT-base' in svg and 'budget' in svg
# Any other format needs matplotlib: --plot fails as the flags are parsed,
# naming the flag, the file and what to install.
problem = scale.plot_problem('scale.png')
assert 'writing .png needs matplotlib' in problem, problem
assert '-m pip install matplotlib' in problem, problem
try:
  scale.write_plot(os.path.join(tmp, 'scale.png'), CURVES, 120)
  raise AssertionError('no ValueError')
except ValueError as e:
  assert '--plot=' in str(e) and 'scale.png: writing' in str(e), e
assert not os.path.exists(os.path.join(tmp, 'scale.png'))
''', tmp_path)
  output = subprocess.run(
      [sys.executable, '-c', 'import sys; sys.modules["matplotlib"] = None; '
       'sys.argv = ["benchmark.py", "--suites=scale", "--plot=scale.png"]; '
       'sys.path.insert(0, %r); import runpy; runpy.run_path(%r, '
       'run_name="__main__")' % (scripts.TOOLS, os.path.join(
           scripts.TOOLS, 'benchmark.py'))],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      universal_newlines=True, timeout=120)
  assert output.returncode != 0, output.stdout
  assert ('flag --plot=scale.png: writing .png needs matplotlib' in
          output.stdout), output.stdout


def test_the_scale_plot_in_matplotlib_s_formats(tmp_path):
  pytest.importorskip('matplotlib')
  _in_a_fresh_process('''
for name, magic in (('scale.png', b'\\x89PNG\\r\\n\\x1a\\n'),
                    ('scale.pdf', b'%PDF-')):
  path = os.path.join(tmp, name)
  scale.write_plot(path, CURVES, 120)
  assert open(path, 'rb').read(len(magic)) == magic, name
path = os.path.join(tmp, 'scale.svg')
scale.write_plot(path, CURVES, 120)
svg = open(path).read()
assert '<svg' in svg and 'BERT-base' in svg and 'ResNet-50' in svg
assert 'matplotlib writes' in scale.plot_problem('scale.xyz')
''', tmp_path)