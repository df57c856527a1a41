"""tools/gpu_check.py, run here: it says when there is no GPU, and its parts
run end to end on the CPU (--allow_cpu), so that the one run on a GPU
machine is not its first."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf

import scripts

GPUS = tf.config.list_physical_devices('GPU')
# tools/gpu_check installs the newest supported TensorFlow; the script is
# checked there (its parts run in child processes of their own).
newest_tensorflow_only = pytest.mark.skipif(
    not scripts.NEWEST_TENSORFLOW,
    reason='tools/gpu_check runs TensorFlow 2.21; checked with that one')


def _run(*args):
  return subprocess.run(
      [sys.executable, os.path.join(scripts.TOOLS, 'gpu_check.py')] +
      list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      universal_newlines=True, timeout=600)


@scripts.run_once_per_version
@newest_tensorflow_only
@pytest.mark.skipif(bool(GPUS), reason='this machine has a GPU')
def test_without_a_gpu_it_checks_nothing_and_says_so(tmp_path):
  result = _run('--output=%s' % (tmp_path / 'gpu.md'))
  assert result.returncode == 3, result.stdout
  assert 'no GPU visible to TensorFlow' in result.stdout
  assert not (tmp_path / 'gpu.md').exists()


@scripts.run_once_per_version
@newest_tensorflow_only
@pytest.mark.skipif(bool(shutil.which('nvidia-smi')),
                    reason='this machine has an NVIDIA driver')
def test_without_a_driver_the_wrapper_downloads_nothing(tmp_path):
  """tools/gpu_check stops before setting up TensorFlow's CUDA build."""
  result = subprocess.run(
      ['bash', os.path.join(scripts.TOOLS, 'gpu_check')],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      universal_newlines=True, timeout=60,
      env=dict(os.environ, DEFERRED_GRAD_CACHE=str(tmp_path / 'cache')))
  assert result.returncode == 3, result.stdout
  assert 'no NVIDIA driver here' in result.stdout
  assert not (tmp_path / 'cache').exists()


@scripts.run_once_per_version
@newest_tensorflow_only
def test_its_parts_run_on_the_cpu(tmp_path):
  """The tests part and the memory part, on the CPU, at small sizes."""
  output = tmp_path / 'gpu.md'
  result = _run('--allow_cpu', '--quick', '--parts=tests,memory',
                '--output=%s' % output)
  assert result.returncode == 0, result.stdout
  with open(str(tmp_path / 'gpu.json')) as f:
    summary = json.load(f)
  for behavior in ['v1', 'v2']:
    tests = summary['tests'][behavior]
    assert tests['failed'] == 0 and tests['passed'] >= 12, tests
  rows = {row['model'].split(' ')[0]: row for row in summary['memory']}
  mlp, conv = rows['1024-4096-4096-4096'], rows['conv']
  # The accumulators are the wrapper's memory over a bare micro-batch step:
  # 1x the parameter bytes of the MLP. In TensorFlow's allocator one
  # process's peak varies by up to 0.4x with the order ops run in on 2
  # cores; the process's RSS (where this CPU's allocator keeps no
  # statistics) by up to 0.5x more, as malloc keeps what TensorFlow frees.
  extra = mlp['wrapper_minus_bare_in_parameter_bytes']
  high = 1.5 if mlp['measure'] == 'allocator peak' else 2.0
  assert 0.5 < extra < high, (
      'MLP: wrapper - bare micro-batch = %.2fx the parameter bytes (%s), '
      'expected 0.5x-%.1fx: %s' % (extra, mlp['measure'], high, mlp))
  # The conv net's micro-batches need a fraction of its large batch's
  # activations. RSS also counts TensorFlow's own few hundred MB, so there
  # the wrapper's peak need only be lower.
  ratio = conv['wrapper_over_large']
  high = 0.5 if conv['measure'] == 'allocator peak' else 1.0
  assert ratio < high, (
      'conv: wrapper / one large batch = %.2fx (%s), expected below %.1fx: '
      '%s' % (ratio, conv['measure'], high, conv))
  assert 'memory limit needs a GPU' not in output.read_text()
  assert summary['step'] == {'skipped': 'not in --parts'}
