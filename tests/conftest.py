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


# Tests that start worker processes (MultiWorkerMirroredStrategy) are the
# slowest: by default each case runs in one of the test runner's four runs
# (TensorFlow 2.15 and 2.21, each in the v2 and the v1 behaviour), in turn,
# so that the cases spread over every version and behaviour.
# DEFERRED_GRAD_ALL_CONFIGURATIONS=1 (tools/soak sets it) runs every case in
# every run.
_ROTATING_MODULES = ('test_multi_worker.py',)
# (TensorFlow: 2.15, or the newer one the runner tests; behaviour)
_RUNS = (('2.15', 'v2'), ('2.15', 'v1'), ('2.16+', 'v2'), ('2.16+', 'v1'))


def pytest_collection_modifyitems(config, items):
  del config
  if os.environ.get('DEFERRED_GRAD_ALL_CONFIGURATIONS', '') not in ('', '0'):
    return
  version = tuple(int(p) for p in behavior.tf.__version__.split('.')[:2])
  this_run = ('2.15' if version <= (2, 15) else '2.16+', behavior.BEHAVIOR)
  index = 0
  for item in items:
    if os.path.basename(str(item.fspath)) not in _ROTATING_MODULES:
      continue
    # Estimator's exist on 2.15 alone: there they run in both behaviours.
    if 'estimator' in item.name:
      continue
    runs_in = _RUNS[index % len(_RUNS)]
    index += 1
    if runs_in != this_run:
      item.add_marker(pytest.mark.skip(reason=(
          'worker processes: this case runs with TensorFlow %s in the %s '
          'behaviour (DEFERRED_GRAD_ALL_CONFIGURATIONS=1 runs it in every '
          'run)' % runs_in)))


def pytest_report_header(config):
  del config
  return 'TensorFlow %s, %s behaviour, deferred_grad from %s' % (
      behavior.tf.__version__, behavior.BEHAVIOR,
      os.path.dirname(deferred_grad.__file__))
