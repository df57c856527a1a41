r"""Benchmarks of deferred_grad, run on demand (not in CI).

Writes the results as JSON (--output) and Markdown tables (beside it, .md).

  tools/benchmark --suites=sparse
  tools/benchmark --suites=step,memory,keras,sparse --output=/tmp/bench.json

Each suite is a module of tools/benchmarks/, named for it, whose docstring
says what it measures; tools/benchmarks/common.py holds the timing, table,
model and child-process helpers they share. To add a suite, add a module
with `run()` (and `child(spec)` if it measures in fresh processes) and list
it in SUITES below.
"""

import json
import os
import sys

from absl import app
from absl import flags

# pylint: disable=g-import-not-at-top,wrong-import-position
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks import common
from benchmarks import keras
from benchmarks import memory
from benchmarks import multiworker
from benchmarks import parameter_servers
from benchmarks import scale
from benchmarks import sparse
from benchmarks import step
# pylint: enable=g-import-not-at-top,wrong-import-position

SUITES = {
    'step': step,
    'memory': memory,
    'keras': keras,
    'sparse': sparse,
    'multiworker': multiworker,
    'parameter_servers': parameter_servers,
    'scale': scale,
}

FLAGS = flags.FLAGS
flags.DEFINE_list('suites', [name for name in SUITES if name != 'scale'],
                  'Which suites to run (scale: only when named).')
flags.DEFINE_string('output', 'benchmark.json',
                    'JSON results; the Markdown tables go beside it (.md).')
flags.DEFINE_string('child', None,
                    'Internal: SUITE:SPEC, one measurement in this process.')


def _machine():
  import platform  # pylint: disable=g-import-not-at-top
  tf = common.import_tf()
  return {
      'cpus': os.cpu_count(),
      'python': platform.python_version(),
      'tensorflow': tf.__version__,
      'processor': platform.processor() or platform.machine(),
  }


def main(argv):
  del argv
  if FLAGS.child:
    suite, spec = FLAGS.child.split(':', 1)
    return SUITES[suite].child(spec)
  unknown = set(FLAGS.suites) - set(SUITES)
  if unknown:
    sys.exit('unknown --suites %s; known: %s' % (sorted(unknown),
                                                 sorted(SUITES)))
  results = {'machine': _machine()}
  tables = []
  for name in FLAGS.suites:
    data, table = SUITES[name].run()
    results.update(data)
    tables.append('### %s\n\n%s\n' % (name, table))
  with open(FLAGS.output, 'w') as f:
    json.dump(results, f, indent=2)
  markdown = os.path.splitext(FLAGS.output)[0] + '.md'
  with open(markdown, 'w') as f:
    f.write('\n'.join(tables))
  print('\n'.join(tables))
  print('wrote %s and %s' % (FLAGS.output, markdown))


if __name__ == '__main__':
  app.run(main)
