r"""Every GPU check of deferred_grad in one bounded run, with a summary.

Run it through `tools/gpu_check` (which sets up TensorFlow with CUDA) on a
machine with a GPU; each part has its own time limit, and the whole run fits
in about 15 minutes on one GPU:

1. tests/test_gpu.py on the GPU, in both graph behaviours: dense and sparse
   accumulation, both paths, float16 variables with float32 accumulators,
   float16 compute under a loss-scale optimizer; soft placement off;
2. the `memory` suite's models on the GPU: TensorFlow's GPU allocator peak
   (traced, and `tf.config.experimental.get_memory_info`) for one large
   batch, a bare micro-batch step and the wrapper;
3. a memory limit between the wrapper's peak and the large batch's (a
   logical device configuration): the large batch runs out of memory, the
   wrapper trains;
4. the `step` suite on the GPU (fewer rounds);
5. the `scale` suite on the GPU: BERT-base and ResNet-50, the wrapper, the
   bare optimizer at the micro-batch and at the large batch, the original;
   TensorFlow's GPU allocator peaks beside the process's RSS (with --quick:
   at toy sizes), its own time limit (--scale_timeout).

Writes the summary as Markdown and JSON (--output). Without a GPU it says
so and exits with status 3; --allow_cpu runs parts 1, 2, 4 and 5 on the CPU
instead (how the test suite checks this script).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

from absl import app
from absl import flags

# pylint: disable=g-import-not-at-top,wrong-import-position
TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
from benchmarks import common
from benchmarks import memory
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string('output', 'gpu_check.md',
                    'Markdown summary; the JSON goes beside it (.json).')
flags.DEFINE_bool('allow_cpu', False,
                  'Without a GPU, run the checks on the CPU (to check this '
                  'script) instead of stopping.')
flags.DEFINE_bool('quick', False, 'Smaller models and fewer timing rounds.')
flags.DEFINE_integer('part_timeout', 240, 'Seconds each part may take.')
flags.DEFINE_integer('scale_timeout', 900, 'Seconds the scale part may take.')
flags.DEFINE_list('parts', ['tests', 'memory', 'out_of_memory', 'step',
                            'scale'],
                  'Which parts to run.')

NO_GPU_STATUS = 3
REPO = os.path.dirname(TOOLS)


def _gpus():
  """TensorFlow's version, and [(name, description)] of the GPUs it sees."""
  tf = common.import_tf()
  gpus = tf.config.list_physical_devices('GPU')
  described = []
  for gpu in gpus:
    try:
      details = tf.config.experimental.get_device_details(gpu)
    except (AttributeError, ValueError):
      details = {}
    described.append((gpu.name, details.get('device_name', 'GPU')))
  return tf.__version__, described


def _tests(on_gpu):
  """tests/test_gpu.py in both behaviours: counts per behaviour."""
  results = {}
  for behavior in ['v2', 'v1']:
    report = os.path.join(tempfile.mkdtemp(), 'report.xml')
    # PYTHONPATH (set by main) names this checkout.
    environment = dict(os.environ, DEFERRED_GRAD_TF_BEHAVIOR=behavior)
    command = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
               '-m', 'gpu' if on_gpu else 'not gpu', '--junitxml=' + report,
               'test_gpu.py']
    try:
      run = subprocess.run(command, cwd=os.path.join(REPO, 'tests'),
                           env=environment, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True,
                           timeout=FLAGS.part_timeout)
    except subprocess.TimeoutExpired:
      results[behavior] = {'error': 'timed out'}
      continue
    counts = {'tests': 0, 'failures': 0, 'errors': 0, 'skipped': 0}
    if os.path.exists(report):
      for suite in ElementTree.parse(report).getroot().iter('testsuite'):
        for key in counts:
          counts[key] += int(suite.get(key, 0))
    failed = counts['failures'] + counts['errors']
    results[behavior] = {
        'passed': counts['tests'] - failed - counts['skipped'],
        'failed': failed, 'skipped': counts['skipped'],
        'exit_status': run.returncode,
    }
    if run.returncode:
      results[behavior]['output_tail'] = run.stdout[-3000:]
  return results


def _device_peak(measured, on_gpu):
  """The allocator peak (MiB) of the device the model ran on, or None.

  None where this build's allocator keeps no statistics for the trace (see
  `benchmarks.memory.child`).
  """
  peaks = measured['allocator_peaks_mb']
  names = [name for name in peaks if name.upper().startswith('GPU')]
  if not on_gpu:
    names = [name for name in peaks if name not in names]
  return max(peaks[name] for name in names) if names else None


ALLOCATOR, RSS = 'allocator peak', 'peak RSS'


def _memory(on_gpu):
  """Allocator peaks of the large batch, a bare micro-batch and the wrapper."""
  grad_steps = 8
  results = []
  for model, (description, _, batch) in sorted(memory.MODELS.items()):
    if FLAGS.quick:
      batch //= 8
    micro_batch = batch // grad_steps
    row = {'name': model, 'model': description, 'batch': batch,
           'grad_steps': grad_steps}
    measured = {}
    for name, size, steps in [('large_batch', batch, None),
                              ('bare_micro_batch', micro_batch, None),
                              ('wrapper', micro_batch, grad_steps)]:
      spec = '%s,SGD,%d,%s' % (model, size, steps or 'none')
      measured[name] = common.run_child('memory', spec,
                                        timeout=FLAGS.part_timeout)
      row[name + '_memory_info_mb'] = measured[name]['gpu_memory_info_peak_mb']
      row['parameter_mb'] = measured[name]['parameter_mb']
    # The allocator's peak where its trace has one (a GPU, oneDNN's CPU
    # allocator), else, on a CPU whose allocator keeps no statistics, the
    # process's peak RSS, which also counts TensorFlow's own few hundred MB.
    peaks = {name: _device_peak(m, on_gpu) for name, m in measured.items()}
    row['measure'] = ALLOCATOR
    if None in peaks.values():
      if on_gpu:
        raise RuntimeError('no GPU allocator peak in the trace: %s' %
                           measured)
      row['measure'] = RSS
      peaks = {name: m['peak_rss_mb'] for name, m in measured.items()}
    for name, peak in peaks.items():
      row[name + '_mb'] = peak
    row['wrapper_over_large'] = row['wrapper_mb'] / row['large_batch_mb']
    row['wrapper_minus_bare_in_parameter_bytes'] = (
        (row['wrapper_mb'] - row['bare_micro_batch_mb']) / row['parameter_mb'])
    results.append(row)
  return results


def _out_of_memory(memory_rows):
  """Under a limit between the wrapper's peak and the large batch's."""
  results = []
  for row in memory_rows:
    if row['wrapper_mb'] >= row['large_batch_mb']:
      results.append({'model': row['model'], 'skipped':
                      'the wrapper peaks no lower than the large batch'})
      continue
    limit = int((row['wrapper_mb'] + row['large_batch_mb']) / 2)
    batch, grad_steps = row['batch'], row['grad_steps']
    outcome = {'model': row['model'], 'memory_limit_mb': limit}
    for name, size, steps in [('large_batch', batch, None),
                              ('wrapper', batch // grad_steps, grad_steps)]:
      spec = '%s,SGD,%d,%s,%d' % (row['name'], size, steps or 'none', limit)
      measured = common.run_child('memory', spec, timeout=FLAGS.part_timeout)
      outcome[name] = ('out of memory' if measured['out_of_memory']
                       else 'trained')
    results.append(outcome)
  return results


def _step():
  """The `step` suite, through tools/benchmark.py, with fewer rounds."""
  output = os.path.join(tempfile.mkdtemp(), 'step.json')
  rounds = ['--rounds=3', '--steps_per_round=3'] if FLAGS.quick else [
      '--rounds=7', '--steps_per_round=10']
  subprocess.run([sys.executable, os.path.join(TOOLS, 'benchmark.py'),
                  '--suites=step', '--output=' + output] + rounds,
                 check=True, stdout=subprocess.DEVNULL,
                 timeout=FLAGS.part_timeout)
  with open(output) as f:
    return json.load(f)['step']


def _scale():
  """The `scale` suite, through tools/benchmark.py (--quick: toy sizes)."""
  output = os.path.join(tempfile.mkdtemp(), 'scale.json')
  sizes = ['--scale_toy', '--scale_curve=1,2'] if FLAGS.quick else []
  subprocess.run([sys.executable, os.path.join(TOOLS, 'benchmark.py'),
                  '--suites=scale', '--output=' + output,
                  '--plot=' + os.path.splitext(FLAGS.output)[0] + '.svg'] +
                 sizes, check=True, stdout=subprocess.DEVNULL,
                 timeout=FLAGS.scale_timeout)
  with open(os.path.splitext(output)[0] + '.md') as f:
    return {'table': f.read()}


def _part(summary, name, function, *args):
  """Runs one part; a failure is recorded in the summary, not raised."""
  start = time.time()
  try:
    summary[name] = function(*args)
  except Exception as error:  # pylint: disable=broad-except
    summary[name] = {'error': '%s: %s' % (type(error).__name__, error)}
  print('%s: %.0f s' % (name, time.time() - start), flush=True)


def _mb(value):
  return '-' if value is None else '%.0f' % value


def _markdown(summary):
  lines = ['TensorFlow %s on %s' % (
      summary['tensorflow'], ', '.join(summary['devices']) or 'the CPU'), '']
  tests = summary['tests']
  if 'error' in tests or 'skipped' in tests:
    lines.append('tests: %s' % tests)
  else:
    lines.append(common.markdown(
        ['tests/test_gpu.py', 'passed', 'failed', 'skipped'],
        [[behavior, r.get('passed', '-'), r.get('failed', r.get('error')),
          r.get('skipped', '-')] for behavior, r in sorted(tests.items())]))
  lines.append('')
  if isinstance(summary['memory'], list):
    lines.append(common.markdown(
        ['model (SGD, K=8), peak (MB): traced / get_memory_info',
         'parameters (MB)', 'one batch of B (MB)', 'bare, B/K (MB)',
         'wrapper, K x B/K (MB)', 'wrapper / one batch',
         'wrapper - bare B/K, in parameter bytes'],
        [[r['model'] + ', B=%d, %s' % (r['batch'], r['measure']),
          '%.1f' % r['parameter_mb']] +
         ['%.0f / %s' % (r[name + '_mb'], _mb(r[name + '_memory_info_mb']))
          for name in ['large_batch', 'bare_micro_batch', 'wrapper']] +
         ['%.2fx' % r['wrapper_over_large'],
          '%+.2fx' % r['wrapper_minus_bare_in_parameter_bytes']]
         for r in summary['memory']]))
  else:
    lines.append('memory: %s' % summary['memory'])
  lines.append('')
  if isinstance(summary['out_of_memory'], list):
    lines.append(common.markdown(
        ['model', 'memory limit (MB)', 'one batch of B', 'wrapper, K x B/K'],
        [[r['model'], r.get('memory_limit_mb', '-'),
          r.get('large_batch', r.get('skipped')), r.get('wrapper', '-')]
         for r in summary['out_of_memory']]))
  else:
    lines.append('out of memory: %s' % summary['out_of_memory'])
  lines.append('')
  if isinstance(summary['step'], list):
    lines.append(common.markdown(
        ['model', 'optimizer', 'bare step (ms)', 'accumulate-only (ms)',
         'cycle / K bare steps'],
        [[r['model'], r['optimizer'], '%.3f' % r['bare_ms'],
          '%.3f' % r['accumulate_ms'], '%.3f' % r['cycle_ratio']]
         for r in summary['step']]))
  else:
    lines.append('step: %s' % summary['step'])
  lines.append('')
  lines.append(summary['scale'].get('table', 'scale: %s' % summary['scale']))
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  version, gpus = _gpus()
  on_gpu = bool(gpus)
  if not on_gpu and not FLAGS.allow_cpu:
    print('no GPU visible to TensorFlow %s: nothing checked; the README\'s '
          'GPU figures stay pending' % version)
    return NO_GPU_STATUS
  # The children import deferred_grad from this checkout.
  os.environ['PYTHONPATH'] = os.pathsep.join(
      [REPO] + [p for p in [os.environ.get('PYTHONPATH')] if p])
  summary = {'tensorflow': version,
             'devices': ['%s (%s)' % gpu for gpu in gpus]}
  for part in ['tests', 'memory', 'out_of_memory', 'step', 'scale']:
    summary[part] = {'skipped': 'not in --parts'}
  if 'tests' in FLAGS.parts:
    _part(summary, 'tests', _tests, on_gpu)
  if 'memory' in FLAGS.parts:
    _part(summary, 'memory', _memory, on_gpu)
  if 'out_of_memory' in FLAGS.parts:
    if not on_gpu:
      summary['out_of_memory'] = {'skipped': 'a memory limit needs a GPU'}
    elif not isinstance(summary['memory'], list):
      summary['out_of_memory'] = {'skipped': 'needs the memory part'}
    else:
      _part(summary, 'out_of_memory', _out_of_memory, summary['memory'])
  if 'step' in FLAGS.parts:
    _part(summary, 'step', _step)
  if 'scale' in FLAGS.parts:
    _part(summary, 'scale', _scale)
  text = _markdown(summary)
  with open(FLAGS.output, 'w') as f:
    f.write(text)
  with open(os.path.splitext(FLAGS.output)[0] + '.json', 'w') as f:
    json.dump(summary, f, indent=2)
  print(text)
  print('wrote %s' % FLAGS.output)
  return 1 if _failures(summary) else 0


def _failures(summary):
  """What went wrong: a part that broke, a failed test, a wrapper that ran
  out of memory under the limit."""
  failures = [part for part in ['tests', 'memory', 'out_of_memory', 'step',
                                'scale']
              if isinstance(summary[part], dict) and 'error' in summary[part]]
  if isinstance(summary['tests'], dict):
    failures += ['tests (%s)' % behavior
                 for behavior, result in summary['tests'].items()
                 if behavior in ('v1', 'v2') and (
                     result.get('failed') or not result.get('passed'))]
  if isinstance(summary['out_of_memory'], list):
    failures += ['wrapper under the limit (%s)' % r['model']
                 for r in summary['out_of_memory']
                 if r.get('wrapper', 'trained') != 'trained']
  for failure in failures:
    print('FAILED: %s' % failure)
  return failures

if __name__ == '__main__':
  app.run(main)
