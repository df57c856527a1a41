"""Smoke test of tools/demo.py, the README's main job, on a small run."""

import os
import subprocess
import sys

import pytest

import conftest

DEMO = os.path.join(os.path.dirname(__file__), os.pardir, 'tools', 'demo.py')


@pytest.mark.skipif(
    conftest.BEHAVIOR != 'v2',
    reason='the demo sets its own TensorFlow behaviour: run once per version')
def test_demo_trains_like_the_large_batch():
  result = subprocess.run(
      [sys.executable, DEMO, '--batch_size=64', '--grad_steps=4',
       '--updates=3'],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
      timeout=300)
  assert result.returncode == 0, result.stdout
  assert 'OK: (b) trained like (a)' in result.stdout
  assert '| (b) 4 x 16, deferred_grad |' in result.stdout
