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
# slowest: by default each runs in one pass of each TensorFlow version,
# alternating (case i in the v2 pass on 2.15 and the v1 pass on 2.21, case
# i+1 the other way round), so that every case meets both behaviours and
# both versions. DEFERRED_GRAD_ALL_CONFIGURATIONS=1 (tools/soak sets it)
# runs every case in every pass.
_ALTERNATING_MODULES = ('test_multi_worker.py',)


def pytest_collection_modifyitems(config, items):
  del config
  if os.environ.get('DEFERRED_GRAD_ALL_CONFIGURATIONS', '') not in ('', '0'):
    return
  version = tuple(int(p) for p in behavior.tf.__version__.split('.')[:2])
  index = 0
  for item in items:
    if os.path.basename(str(item.fspath)) not in _ALTERNATING_MODULES:
      continue
    # Estimator's exist on 2.15 alone: there they run in both passes.
    if 'estimator' not in item.name:
      runs_in = ('v2', 'v1')[(index + (version > (2, 15))) % 2]
      index += 1
      if runs_in != behavior.BEHAVIOR:
        item.add_marker(pytest.mark.skip(reason=(
            'worker processes: on TensorFlow %d.%d this case runs in the %s '
            'pass (DEFERRED_GRAD_ALL_CONFIGURATIONS=1 runs it in both)' %
            (version + (runs_in,)))))


def pytest_report_header(config):
  del config
  return 'TensorFlow %s, %s behaviour, deferred_grad from %s' % (
      behavior.tf.__version__, behavior.BEHAVIOR,
      os.path.dirname(deferred_grad.__file__))
