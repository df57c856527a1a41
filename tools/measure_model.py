r"""What deferred_grad saves and costs on your own model.

Give it a function that builds your training graph for a batch size, with
the wrapper or without it, and it trains three ways, each in a fresh process
of its own, on the same input in the same order (each process trains from
its first example, whole cycles, as many as its timing needs, and reports
the example count it trained):

* the bare optimizer at the micro-batch b;
* the bare optimizer at the large batch K*b, the batch the wrapper stands in
  for (the largest that fits --budget_mb is found by doubling K);
* the wrapper, K micro-batches of b.

It prints the time per example of a whole cycle against the bare optimizer
at b and at K*b, the peak resident memory (RSS) of each, the wrapper's extra
memory in MB (and in parameter bytes P where P is 1 MB or more: after
initialisation, after the first cycle, at the peak), and what the wrapper
keeps (README "Performance" has the formula): its accumulators, a table's
list of rows, its counters, which are also what its checkpoints add.

Times are taken after a cycle of warm-up, in rounds of --cycles cycles or
of as many as last 0.2 s, until the last three rounds agree within
--stable_within (5%: their max-min over their median), or --max_rounds,
--max_seconds or the end of the input stops them (the cycles timed then
make the three rounds). Each time is the median of the last three rounds,
printed with their min-max; one that did not settle is marked NOT STABLE,
with what stopped it (on a busy machine, rerun it or raise the bounds).

  python tools/measure_model.py --model=train.py:build --micro_batch=32 \
      --grad_steps=4 --budget_mb=8000

The model, one of:

* `--model=FILE:build`, a function `build(batch_size, grad_steps)` that
  builds the input, the model and the train op in the current graph and
  returns the train op (or a tuple starting with it), with the wrapper's
  `grad_steps` (README's complete script has one). The bare optimizer's
  runs call it with grad_steps=1, where the wrapper passes each gradient
  on as it comes: the bare optimizer's update, no accumulators;
* `--model=FILE:model_fn --input_fn=FILE:input_fn`, Estimator style: the
  `model_fn(features, labels, mode, params)` wraps its optimizer where
  `params['grad_steps']` is set (as the guides' model_fns do) and the
  `input_fn(params)` returns a `tf.data.Dataset` of (features, labels)
  batches of `params['batch_size']`.

Needs TensorFlow in graph mode (it disables eager execution) and
deferred_grad importable; run it with the Python you train with.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time

from absl import flags

import peak_memory  # tools/peak_memory.py, beside this script

# The tool's own flags, apart from absl's global ones, which the measured
# model's module may define (the guides define --grad_steps, --micro_batch).
FLAGS = flags.FlagValues()
WINDOW = 3  # timing rounds that must agree
ROUND_SECONDS = 0.2  # a timing round lasts at least about this long
flags.DEFINE_string('model', None, 'FILE:FUNCTION, a build function or a '
                    'model_fn (see the docstring).', flag_values=FLAGS)
flags.DEFINE_string('input_fn', None, 'FILE:FUNCTION, with a model_fn.',
                    flag_values=FLAGS)
flags.DEFINE_integer('micro_batch', 32, 'b, the micro-batch.',
                     flag_values=FLAGS)
flags.DEFINE_integer('grad_steps', 4, 'K, micro-batches per update.',
                     flag_values=FLAGS)
flags.DEFINE_integer('cycles', 2, 'Cycles a timing round at least (after '
                     'one cycle of warm-up; more where they take under %g '
                     's).' % ROUND_SECONDS, lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float('stable_within', 0.05, 'Rounds stop once the last %d '
                   'agree within this fraction (their max-min over their '
                   'median).' % WINDOW, lower_bound=0, flag_values=FLAGS)
flags.DEFINE_integer('max_rounds', 20, 'Timing rounds at most, per '
                     'process.', lower_bound=1, flag_values=FLAGS)
flags.DEFINE_float('max_seconds', 60, 'No new timing round after this many '
                   'seconds of timing, per process.', lower_bound=0,
                   flag_values=FLAGS)
flags.DEFINE_integer('budget_mb', 8000, 'The memory a process may use: the '
                     'bare optimizer is not run at larger batches past it.',
                     flag_values=FLAGS)
flags.DEFINE_integer('search_up_to', 64, 'The search for the largest '
                     'batch that fits doubles K up to this many times K.',
                     flag_values=FLAGS)
flags.DEFINE_enum('tf_behavior', 'v2', ['v2', 'v1'],
                  'disable_eager_execution() (v2) or disable_v2_behavior().',
                  flag_values=FLAGS)
flags.DEFINE_string('child', None, 'Internal: BATCH,GRAD_STEPS|none,'
                    'STEPS_PER_CYCLE,CYCLES,MAX_ROUNDS.', flag_values=FLAGS)


def _load(spec):
  """The function FILE:NAME names (each file loaded once)."""
  path, name = spec.rsplit(':', 1)
  path = os.path.abspath(path)
  module = sys.modules.get('measured:' + path)
  if module is None:
    module_spec = importlib.util.spec_from_file_location('measured_model',
                                                         path)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, os.path.dirname(path))
    module_spec.loader.exec_module(module)
    sys.modules['measured:' + path] = module
    if not flags.FLAGS.is_parsed():  # its flags, if any, at their defaults
      flags.FLAGS.mark_as_parsed()
  return getattr(module, name)


def _train_op(tf, batch, grad_steps):
  """Builds the user's graph in the current one; returns its train op."""
  build = _load(FLAGS.model)
  if FLAGS.input_fn is None:  # grad_steps=1: the bare optimizer's update
    made = build(batch, grad_steps or 1)
    return made[0] if isinstance(made, (tuple, list)) else made
  tf.compat.v1.train.get_or_create_global_step()
  params = {'batch_size': batch, 'grad_steps': grad_steps}
  dataset = _load(FLAGS.input_fn)(dict(params))
  features, labels = tf.compat.v1.data.make_one_shot_iterator(
      dataset).get_next()
  return build(features, labels, 'train', params).train_op


def _spread(values):
  """(max - min) / median of some times."""
  return (max(values) - min(values)) / _median(values)


def settled(rounds, within):
  """Whether the last WINDOW rounds agree within `within` (a fraction)."""
  return len(rounds) >= WINDOW and _spread(rounds[-WINDOW:]) <= within


def rounds_of(cycle_times, size):
  """The seconds of the last WINDOW rounds of `size` cycles (of fewer where
  fewer cycles ran: of a third of them, or of one)."""
  size = min(size, max(1, len(cycle_times) // WINDOW))
  count = min(WINDOW, len(cycle_times) // size)
  end = len(cycle_times)
  return [sum(cycle_times[end - (i + 1) * size:end - i * size])
          for i in reversed(range(count))], size


def child(spec):
  """Trains in this process; prints one JSON line of figures.

  A cycle is `steps` runs (the wrapper's K micro-steps, the bare
  optimizer's K steps at b or one at K*b). One cycle of warm-up, then
  cycles are timed, `cycles` at a time, in rounds of `cycles` cycles or
  of as many as take ROUND_SECONDS, until the last WINDOW rounds agree
  within --stable_within, or `max_rounds` rounds (0: no timing),
  --max_seconds or the end of the input stop them ('stopped' says which).
  """
  batch, grad_steps, steps, cycles, max_rounds = spec.split(',')
  batch, steps, cycles, max_rounds = (int(batch), int(steps), int(cycles),
                                      int(max_rounds))
  grad_steps = None if grad_steps == 'none' else int(grad_steps)
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.tf_behavior == 'v1':
    tf.compat.v1.disable_v2_behavior()
  else:
    tf.compat.v1.disable_eager_execution()
  graph = tf.Graph()
  with graph.as_default():
    train_op = _train_op(tf, batch, grad_steps)
    parameters = sum(int(np.prod(v.shape.as_list())) * v.dtype.size
                     for v in tf.compat.v1.trainable_variables())
    # The wrapper's state: (variable, its value afresh) pairs.
    from deferred_grad import registry  # pylint: disable=g-import-not-at-top
    state = [v for v, _ in registry.of(graph).state]
    init = [tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer(),
            tf.compat.v1.tables_initializer()]
  result = {'pid': os.getpid(), 'parameter_bytes': parameters}
  failed = stopped = None
  times, size, runs = [], cycles, 0  # seconds a cycle; a round's cycles
  with tf.compat.v1.Session(graph=graph) as session:
    session.run(init)
    result['rss_after_init_mb'] = peak_memory.current_rss_mb()
    try:
      for _ in range(steps):  # warm-up
        session.run(train_op)
        runs += 1
      result['rss_after_cycle_mb'] = peak_memory.current_rss_mb()
      began = time.perf_counter()
      while max_rounds:
        for _ in range(cycles):
          took = 0.0
          for _ in range(steps):
            start = time.perf_counter()
            session.run(train_op)
            took += time.perf_counter() - start
            runs += 1
          times.append(took)
        if len(times) == cycles:  # rounds long enough to even out jitter
          size = max(cycles, int(math.ceil(ROUND_SECONDS / _median(times))))
        if len(times) >= WINDOW * size and settled(
            rounds_of(times, size)[0], FLAGS.stable_within):
          stopped = 'stable'
        elif len(times) >= max_rounds * size:
          stopped = 'stopped by --max_rounds=%d' % max_rounds
        elif time.perf_counter() - began > FLAGS.max_seconds:
          stopped = 'stopped by --max_seconds=%g' % FLAGS.max_seconds
        if stopped:
          break
    except tf.errors.OutOfRangeError as e:
      if times:  # the timing ends with the input (a partial cycle dropped)
        stopped = 'the input ran out'
      else:
        failed = type(e).__name__
    except tf.errors.ResourceExhaustedError as e:
      failed = type(e).__name__
    state_bytes = {}
    for variable in state:  # a list of rows: as large as it is now
      kind = ('list of rows' if variable.shape.rank is None else
              'accumulator' if variable.shape.rank else 'counter')
      value = session.run(variable)
      state_bytes[kind] = state_bytes.get(kind, 0) + value.nbytes
  rounds, size = rounds_of(times, size) if times else ([], size)
  if stopped != 'stable' and settled(rounds, FLAGS.stable_within):
    stopped = 'stable'  # the rounds the cycles timed make agree
  result.update(peak_rss_mb=peak_memory.peak_rss_mb(), rounds=rounds,
                cycles_per_round=size, cycles_timed=len(times),
                stopped=stopped, examples=runs * batch, failed=failed,
                state_bytes=state_bytes)
  print(json.dumps(result))


def _run(batch, grad_steps, steps, cycles, max_rounds):
  """One configuration in a fresh process; its figures."""
  command = [sys.executable, os.path.abspath(__file__),
             '--child=%d,%s,%d,%d,%d' % (batch, grad_steps or 'none', steps,
                                         cycles, max_rounds),
             '--model=' + FLAGS.model, '--tf_behavior=' + FLAGS.tf_behavior,
             '--stable_within=%r' % FLAGS.stable_within,
             '--max_seconds=%r' % FLAGS.max_seconds]
  if FLAGS.input_fn:
    command.append('--input_fn=' + FLAGS.input_fn)
  output = subprocess.run(command, check=True, stdout=subprocess.PIPE,
                          universal_newlines=True).stdout
  return json.loads(output.strip().splitlines()[-1])


def _median(values):
  values = sorted(values)
  return values[len(values) // 2] if values else None


def _digits(value):
  """About three significant figures."""
  return 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2


def duration(seconds):
  """'1.23 ms': in s, ms or us, whichever reads best."""
  for unit, scale in (('s', 1.0), ('ms', 1e-3), ('us', 1e-6)):
    if seconds >= scale or unit == 'us':
      return '%.*f %s' % (_digits(seconds / scale), seconds / scale, unit)


def size(nbytes, signed=False):
  """'6.00 KB': bytes in MB, or in KB or bytes when smaller."""
  for unit, scale in (('MB', 2**20), ('KB', 2**10), ('bytes', 1)):
    if abs(nbytes) >= scale or unit == 'bytes':
      value = nbytes / float(scale)
      return ('%+.*f %s' if signed else '%.*f %s') % (
          0 if scale == 1 else _digits(value), value, unit)


def timing(result, examples_per_cycle):
  """(time cell, spread cell) of a configuration's table row: the median of
  its last WINDOW rounds, their min-max and how the rounds ended."""
  per_round = examples_per_cycle * result['cycles_per_round']
  rounds = result['rounds']
  last = [t / per_round for t in rounds[-WINDOW:]]
  low, high = duration(min(last)), duration(max(last))
  if low.split()[1] == high.split()[1]:  # one unit: '1.20-1.30 ms'
    low = low.split()[0]
  cycles = result['cycles_per_round']
  spread = '%s-%s (%.1f%%): rounds of %d cycle%s, %d timed' % (
      low, high, 100 * _spread(last), cycles, 's' * (cycles > 1),
      result['cycles_timed'])
  if result['stopped'] != 'stable':
    spread += '; NOT STABLE (%s)' % result['stopped']
  return duration(_median(last)), spread


def measure():
  """Runs the three processes; returns (figures, the text to print)."""
  b, k = FLAGS.micro_batch, FLAGS.grad_steps
  cycles, max_rounds = FLAGS.cycles, FLAGS.max_rounds
  load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0
  bare = _run(b, None, k, cycles, max_rounds)
  wrapper = _run(b, k, k, cycles, max_rounds)
  for name, result in (('bare optimizer at b', bare), ('wrapper', wrapper)):
    if result['failed']:
      sys.exit('%s: %s before its first timing round ended (%s).' % (
          name, result['failed'], 'the input ran out: give it more examples '
          'or fewer --cycles' if result['failed'] == 'OutOfRangeError' else
          'out of memory: a smaller --micro_batch'))
  large = _run(k * b, None, 1, cycles, max_rounds)
  fits = []  # (K', peak) of the bare optimizer at K'*b, from K doubling
  multiple, measured, stopped = k, large, ''
  while True:
    if measured['failed'] or measured['peak_rss_mb'] > FLAGS.budget_mb:
      stopped = ('at %d the input ran out' % (multiple * b)
                 if measured['failed'] == 'OutOfRangeError' else
                 '%d takes more' % (multiple * b))
      break
    fits.append((multiple, measured['peak_rss_mb']))
    limit = FLAGS.search_up_to * k
    if multiple >= limit or measured['peak_rss_mb'] * 2 > FLAGS.budget_mb:
      stopped = ('the search stops at %d K' % FLAGS.search_up_to
                 if multiple >= limit else
                 '%d would take about twice as much' % (2 * multiple * b))
      break
    multiple *= 2
    measured = _run(multiple * b, None, 1, 0, 0)
  if not fits or fits[0][0] != k:
    large = None
  # Each configuration in a process of its own, from the input's first
  # example: the warm-up cycle and at least one timing round.
  timed = [bare, wrapper] + ([large] if large else [])
  assert all(r['examples'] >= (1 + cycles) * k * b for r in timed), timed
  assert len(set(r['pid'] for r in timed)) == len(timed), timed
  p = wrapper['parameter_bytes']

  def extra(key):
    nbytes = (wrapper[key] - bare[key]) * 2**20
    return size(nbytes, signed=True) + (
        ' (%+.2f P)' % (nbytes / p) if p >= 2**20 else '')

  def row(name, result):
    return '| %s | %s | %s | %.0f |' % (
        (name,) + timing(result, k * b) + (result['peak_rss_mb'],))

  lines = [
      'model: %s, P = %s of parameters; K=%d micro-batches of b=%d' % (
          FLAGS.model, size(p), k, b),
      '',
      '| | time per example | its last %d rounds: min-max (spread) | peak '
      'RSS (MB) |' % WINDOW,
      '|---|---:|---|---:|',
      row('bare optimizer, batch b=%d' % b, bare),
      row('deferred_grad, K x b', wrapper)]
  if large:
    lines.append(row('bare optimizer, batch K*b=%d' % (k * b), large))
  else:
    lines.append('| bare optimizer, batch K*b=%d | does not fit %d MB | | |' %
                 (k * b, FLAGS.budget_mb))
  unstable = [name for name, r in (('bare at b', bare), ('wrapper', wrapper),
                                   ('bare at K*b', large))
              if r and r['stopped'] != 'stable']
  if unstable:
    lines += ['', 'NOT STABLE: %s. Their last %d rounds differ by more than '
              '%g%% (max-min over median), or fewer ran: at that level the '
              'times are noise. Rerun on an idle machine, or raise '
              '--max_rounds or --max_seconds (or give more input).' % (
                  ', '.join(unstable), WINDOW, 100 * FLAGS.stable_within)]
  else:
    lines += ['', 'Each time: the median of the last %d rounds of '
              '--cycles=%d cycles or more, which agree within %g%%.' % (
                  WINDOW, cycles, 100 * FLAGS.stable_within)]
  if load >= 0.5:
    lines.append('The machine was busy as this began (load average %.1f on '
                 '%d cores): its load can change between the processes, each '
                 'timed alone, by more than the spreads show; rerun when it '
                 'is idle.' % (load, os.cpu_count()))
  lines += [
      '',
      'RSS of the wrapper over the bare optimizer at b: after initialisation '
      '%s, after the first cycle %s, at the peak %s%s.' % (
          extra('rss_after_init_mb'), extra('rss_after_cycle_mb'),
          extra('peak_rss_mb'),
          ' (P: the parameters\' bytes)' if p >= 2**20 else
          ' (not in multiples of the parameters\' bytes P: at %s, under 1 '
          'MB, they would mean little)' % size(p)),
      'what the wrapper keeps (and its checkpoints add): %s.' % ', '.join(
          '%s %s' % (kind, size(nbytes))
          for kind, nbytes in sorted(wrapper['state_bytes'].items())),
      'largest effective batch of the bare optimizer within %d MB: %s (%s, '
      'doubling from K*b); the wrapper\'s peak does not grow with K.' % (
          FLAGS.budget_mb, '%d, %.0f MB' % (fits[-1][0] * b, fits[-1][1])
          if fits else 'less than K*b', stopped),
  ]
  return {'bare': bare, 'wrapper': wrapper, 'large': large,
          'bare_fits': fits}, '\n'.join(lines)


def main(argv):
  try:
    FLAGS(argv)
  except flags.Error as e:
    sys.exit('%s\n%s' % (e, FLAGS.main_module_help()))
  if not FLAGS.model:
    sys.exit('--model=FILE:FUNCTION is required.\n' +
             FLAGS.main_module_help())
  if FLAGS.child:
    return child(FLAGS.child)
  _, text = measure()
  print(text)


if __name__ == '__main__':
  if any(arg in ('-h', '--help') for arg in sys.argv[1:]):
    print(__doc__ + '\nflags:\n' + FLAGS.main_module_help())
    sys.exit(0)
  main(sys.argv)
