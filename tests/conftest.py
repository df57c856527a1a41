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


# The slowest tests take turns over the test runner's four runs
# (TensorFlow 2.15 and 2.21, each in the v2 and the v1 behaviour), so that
# their cases spread over every version and behaviour:
# * worker processes (MultiWorkerMirroredStrategy): each case in one run;
# * the examples under tools/ (a process each; they set their own behaviour
#   and run in one pass per version): each in one version;
# * the two paths of the schedules: each path in both versions and both
#   behaviours, not in every combination of the three;
# * the slow modules (`_SLOW_MODULES`: tables, partitioned ones, checkpoints
#   switched, combinations, porting, savers, costs, parameter-server
#   clusters and Estimators):
#   each case in one run, in turn (one of 2.15's two runs where it needs
#   tf.estimator).
# The rest (the contract: equivalence, numerics, counting, checkpoints,
# errors, concurrency, the port checks' warnings and their controls, ...)
# runs every case in every run.
# DEFERRED_GRAD_ALL_CONFIGURATIONS=1 (tools/soak sets it) runs every case in
# every run.
_VERSIONS, _BEHAVIORS = ('2.15', '2.16+'), ('v2', 'v1')
_CROSSED = [(('2.15', 'v2'), ('2.16+', 'v1')), (('2.15', 'v1'), ('2.16+', 'v2'))]
# The runs a case of each kind takes turns over.
_TURNS = {
    'worker processes': [((v, b),) for v in _VERSIONS for b in _BEHAVIORS],
    'example': [tuple((v, b) for b in _BEHAVIORS) for v in _VERSIONS],
    'path': _CROSSED,
    'slow module': [((v, b),) for v in _VERSIONS for b in _BEHAVIORS],
    'slow module on tf.estimator': [(('2.15', b),) for b in _BEHAVIORS],
}
_EXAMPLES = ('test_example_trains', 'test_bert_porting_example',
             'test_parameter_server_example', 'test_keras_example')
_PATH_MODULES = ('test_schedules.py',)
_SLOW_MODULES = ('test_partitioned.py', 'test_switching.py',
                 'test_combinations.py', 'test_replica_wrappers.py',
                 'test_porting.py', 'test_checkpoint_saver.py',
                 'test_sparse.py', 'test_costs.py', 'test_checkpoints_kept.py',
                 'test_ported_scripts.py', 'test_several_wrappers.py',
                 'test_parameter_servers.py',
                 'test_canned_estimators.py', 'test_estimator.py')


def _needs_estimator(item):
  """Whether `item` runs on TensorFlow 2.15 only (tf.estimator's last)."""
  return 'estimator' in item.name or any(
      'estimator' in str(marker.kwargs.get('reason', ''))
      for marker in item.iter_markers('skipif'))


def _turn(item, counters):
  """(kind, the runs `item` runs in), or None where it runs in every run.

  `counters` counts the cases of each kind so far (the same order in every
  run: collection's)."""
  module = os.path.basename(str(item.fspath))
  if module in _SLOW_MODULES:
    kind = ('slow module on tf.estimator' if _needs_estimator(item) else
            'slow module')
    counters[kind] = counters.get(kind, -1) + 1
    return kind, _TURNS[kind][counters[kind] % len(_TURNS[kind])]
  if 'estimator' in item.name:
    return None
  params = getattr(getattr(item, 'callspec', None), 'params', {})
  if module in _PATH_MODULES and 'use_tpu' in params:
    return 'path', _TURNS['path'][int(params['use_tpu'])]
  kind = None
  if module == 'test_multi_worker.py':
    kind = 'worker processes'
  elif module == 'test_demo.py' and item.name.startswith(_EXAMPLES):
    kind = 'example'
  if kind is None:
    return None
  counters[kind] = counters.get(kind, -1) + 1
  return kind, _TURNS[kind][counters[kind] % len(_TURNS[kind])]


def pytest_collection_modifyitems(config, items):
  del config
  if os.environ.get('DEFERRED_GRAD_ALL_CONFIGURATIONS', '') not in ('', '0'):
    return
  version = tuple(int(p) for p in behavior.tf.__version__.split('.')[:2])
  this_run = (_VERSIONS[version > (2, 15)], behavior.BEHAVIOR)
  counters = {}
  for item in items:
    turn = _turn(item, counters)
    if turn is None or this_run in turn[1]:
      continue
    kind, runs_in = turn
    item.add_marker(pytest.mark.skip(reason=(
        '%s: this case runs with %s (DEFERRED_GRAD_ALL_CONFIGURATIONS=1 '
        'runs it in every run)' % (kind, _described(runs_in)))))


def _described(runs):
  """'TensorFlow 2.15, v2 behaviour and ...', a whole version named once."""
  versions = [v for v in _VERSIONS if all((v, b) in runs for b in _BEHAVIORS)]
  return ' and '.join(['TensorFlow %s' % v for v in versions] + [
      'TensorFlow %s, %s behaviour' % run for run in runs
      if run[0] not in versions])


def pytest_report_header(config):
  del config
  return 'TensorFlow %s, %s behaviour, deferred_grad from %s' % (
      behavior.tf.__version__, behavior.BEHAVIOR,
      os.path.dirname(deferred_grad.__file__))
