"""pytest set-up: TensorFlow's behaviour (see behavior.py) and fixtures.

The helpers live in modules named for what they build: models.py (models,
data, optimizers), training.py (training loops and comparisons), scripts.py
(running tools/ scripts).
"""

import os

import pytest

import behavior
import deferred_grad


@pytest.fixture(params=[False, True], ids=['gpu_path', 'tpu_path'])
def use_tpu(request):
  return request.param


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'gpu: runs on a GPU; skipped where TensorFlow sees none '
      '(tools/gpu_check runs these on a GPU machine)')


def pytest_report_header(config):
  del config
  return 'TensorFlow %s, %s behaviour, deferred_grad from %s' % (
      behavior.tf.__version__, behavior.BEHAVIOR,
      os.path.dirname(deferred_grad.__file__))
