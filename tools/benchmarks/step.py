"""Suite `step`: the time of a micro-step and of a whole cycle.

One micro-step through the wrapper that only accumulates, against the bare
optimizer's step at the same micro-batch; and a whole cycle against
grad_steps bare steps. SGD and Adam; a 3x1024 MLP and a model of 200 64x64
variables. Side by side in one process: --sessions sessions of each
variant (one session's buffers can sit worse in the caches than another's:
two of one graph differed by up to 7%), all interleaved in rounds of whole
cycles; the median of the sessions' medians.

Results (`tools/benchmark --suites=step --grad_steps=8`, then
`--grad_steps=4`, one after the other; a 2-core AMD EPYC VM, TensorFlow
2.21.0, micro-batch 64):

  model                    opt   K  bare   accumulate-only  ratio  cycle    K bare   ratio
  3x1024 MLP               SGD   8  22.84  23.87            1.045  192.11   182.70   1.052
  3x1024 MLP               Adam  8  26.20  24.83            0.948  213.12   209.62   1.017
  200 variables of 64x64   SGD   8  13.08  13.44            1.027  109.82   104.62   1.050
  200 variables of 64x64   Adam  8  26.06  16.62            0.638  138.46   208.47   0.664
  3x1024 MLP               SGD   4  22.88  23.73            1.037   97.69    91.53   1.067
  3x1024 MLP               Adam  4  29.41  28.97            0.985  122.74   117.65   1.043
  200 variables of 64x64   SGD   4  13.15  13.38            1.018   55.45    52.59   1.054
  200 variables of 64x64   Adam  4  22.55  14.71            0.653   67.48    90.19   0.748

A second K=8 run the same day: MLP SGD cycle 0.986 (accumulate-only
1.003), Adam 0.987; 200 variables SGD 1.060 (accumulate-only 1.053), Adam
0.645. A third, `--sessions=5`: MLP SGD 1.042 (1.020), Adam 0.955; 200
variables SGD 1.051 (1.030), Adam 0.702 (bare steps 15.8 and 8.6 ms: the
VM ran faster that hour).

With the apply branch's handles made in the branch (2026-12-02, later; the
VM's bare steps 8-11 ms that day, and runs of one suite differing by up to
8%): K=8, two runs: MLP SGD 1.013, 1.034; Adam 0.938, 0.970; 200 variables
SGD 1.075, 1.065 (accumulate-only 1.076, 1.054); Adam 0.691, 0.713. K=4:
MLP SGD 1.037, Adam 0.974; 200 variables SGD 1.157 (the same run's
schedule cycle, the same graph but for its counters: 0.943 of it), Adam
0.760. Side by side in one process, the cycle before and after that change
(/tmp script: bare, before, after, 3 sessions each, interleaved): K=8 1.054
-> 1.024 (Adam 0.746 -> 0.698); K=4, three runs: 1.049 -> 1.087, 1.125 ->
1.100, 1.034 -> 1.026; timed by position in the cycle (K=4), the apply step
10.04 -> 9.19 ms, the micro-steps within 0.1 ms.

Targets, SGD: a whole cycle at most 1.05x K bare steps at K=8 and 1.08x at
K=4. Met on the MLP on the AMD EPYC VM, not on the faster Intel one (below);
on the 200-variable model at the target or above it by
the run-to-run noise (1.050-1.075 at K=8), bounded by its accumulate-only
micro-step (1.03-1.08x a bare step: the accumulators' own memory traffic,
their handles' lookup, about 80 us for 400, and the cycle's decision after
the last add). The cycle's `If` took each variable's handle as an argument
(the wrapped optimizer's ops captured them), about 0.25 us each per run
taken or not, and the apply step ran an `_Arg` node for each; the branch
now makes them itself (`compat.cond`'s own handles), and an `If` of 2
arguments costs what no `If` costs (/tmp microbenchmark, 200 variables: a
run 109 us without a cond, 108 us with it, 199 us with the handles taken
as arguments). With Adam a cycle costs less than K bare Adam steps where
Adam's own update is the larger part (Adam updates once per cycle).

Counted instead of timed (executed nodes per run, traced, 200-variable SGD
model): the accumulate-only micro-step runs 2,419 nodes against 2,409 for a
bare step, the apply step 3,226 (3,625 with the branch taking the handles
as arguments; 3,222 and 5,225 before the accumulators' handles and reads
were batched, on the model's earlier graph: `compat.handles` and
`compat.read` now; tests/test_costs.py pins how the counts scale). In one process, three sessions of each, the cycle of
the 200-variable model cost 1.059x-1.087x K=4 bare steps batched against
1.103x-1.114x one handle per accumulator, and 1.052x against 1.073x at K=8.
The levers: each dense gradient is added with one in-place kernel
(ResourceApplyGradientDescent with rate -1/K); on a CPU the accumulators'
handles and reads are one op per device; the cycle's tf.cond runs as a
function where its variables share a device, so that micro-steps which do
not apply push no "dead" tensors through the apply branch; the apply step
zeroes each accumulator of up to 1 MiB with one assign of zeros shared by
its shape; the apply branch reads the variables and slots by handles it
makes (one op per device). What remains per variable and cycle: the
wrapped update and the zeroing assign; and on every micro-step the
accumulator's own memory traffic.

Since the public core (2026-12-04) the batched handles and reads and the
apply branch's own handles above are gone (they were private TensorFlow):
each accumulator is added through its variable's own handle, and the
cycle's `If` takes the handles its branch uses as arguments; only the `If`
left unlowered stays. Side by side with the commit before, twice
(`tools/benchmark --suites=step --baseline=6d28636`, K=8; this tree / that
commit, accumulate-only, cycle, schedule cycle): MLP SGD 1.014/0.978,
0.987/0.988, 0.981/0.994; MLP Adam 1.001/1.009, 0.987/0.981, 1.013/1.030;
200 variables SGD 1.025/1.051, 0.980/1.056, 1.013/1.031; 200 variables
Adam 1.051/1.036, 1.115/1.074, 1.029/1.014.

Not built: folding the cycle's last micro-batch into the read (the apply
step reading `accumulator + gradient` instead of adding, then reading).
It saves one in-place add per variable and cycle, but the add must then
move into the cycle's tf.cond, whose other branch adds: every micro-step
would pass each gradient into the cond (an argument of the function, 1-2
us each on 2 cores; a Switch under control flow v1), K times per cycle to
save one add, and the GPU path adds in each replica before its
merge_call decides.

What remains is the zeroing (2026-12-02, later, on another VM: a 2-core
Intel Xeon, 4 MiB L2 a core; bare steps 6-7 ms, the MLP's 6.6 ms against
22 ms on the AMD EPYC, so fixed costs weigh more). The apply step zeroes
each accumulator with an `AssignVariableOp` of zeros shared by shape;
TensorFlow 2.21's makes the variable alias them, and the next micro-step's
add copies them into a buffer of its own. `--zeroing_bound` times a cycle
never zeroed (wrong sums, timing only) beside the rest. In one process
(/tmp script, bare and both variants, 3 sessions each, interleaved), the
200-variable model: K=4 1.125x and 1.154x K bare steps zeroed, 1.064x and
1.075x never zeroed; K=8 1.076x and 1.155x against 1.049x and 1.121x
(one slow run). By position in a K=4 cycle
(bare = 1): zeroed 1.165, 1.084, 1.039, 1.211; never zeroed 1.102, 1.017,
1.007, 1.132 (the first micro-step copies, the apply step assigns). Every
exact way TensorFlow's stock kernels offer costs as much or more: a scatter
of one zero in place and `DisableCopyOnRead` (two ops a variable, no copy
after; 1.092-1.121 against 1.101-1.107 in one process); an XLA-compiled
zeroing of all 400 accumulators in one op (1,350 us, then 650 us for the
next adds, against 633 and 780 us for the 400 assigns, /tmp
microbenchmark); the assigns in a function of
their own beside the wrapped update, run by a second thread (the two
cores contend: no gain). One in-place kernel of arithmetic (acc -= acc, a
momentum kernel decaying by 0) would do it in one op but is not exact: an
inf or NaN in a cycle's sum (one a LossScaleOptimizer skips) would poison
every later cycle. Zeroing on the next cycle's first micro-step would keep
the last cycle's sums in checkpoints saved between cycles. Also tried and
dropped, K=4, in one process (2 sessions each, twice): the counter read
before the adds (1.103 and 1.122 against 1.116 and 1.133: within the
noise), and the cycle's `If` inside a lowered cond, so that a micro-step
not applying skips the function call (1.141 and 1.158: worse).

The suite on that Intel VM, `tools/benchmark --suites=step --grad_steps=4
--zeroing_bound`, then `--grad_steps=8`:

  model, SGD       K  accumulate-only  cycle  never zeroed
  3x1024 MLP       4  1.021            1.084  1.039
  200 variables    4  1.025            1.099  1.065
  3x1024 MLP       8  1.050            1.076  1.042
  200 variables    8  1.072            1.101  1.044

Adam: cycles 1.024 and 0.934 (MLP), 0.833 and 0.792 (200 variables).

A `grad_steps` schedule (the suite's last two columns: a callable of the
updates applied that gathers K from a table, as a batch-size schedule does)
against the int's cycle, in earlier runs (2026-12-01, one session each):

  schedule / int cycle   MLP SGD  MLP Adam  200 vars SGD  200 vars Adam
  K=8                    0.984    1.022     0.954         0.983
  K=4, first run         1.024    1.048     1.056         1.024
  K=4, second run        1.030    0.997     0.970         1.016

Target: at most 1.03x; within the noise (one round's spread is about 5%).
In the runs above (2026-12-02): 1.016, 0.970, 1.052, 1.073 at K=8 and 1.012,
0.998, 1.088, 1.020 at K=4 (MLP SGD, MLP Adam, 200 variables SGD, Adam).
Counted instead of timed (then), 200-variable SGD model at K=4: 1,870 executed
nodes per accumulate-only micro-step against the int's 1,823, and 2,872
against 2,825 on the apply step: +47 scalar nodes per micro-step whatever
the number of variables (the schedule read before adding, for the
divisor, and again for the decision; its check; its three counters). The
int's graph is the one it had: 123.95 ms for a cycle of 8 before the
schedules, 124.38 ms after, on the same day.

Choosing K: a micro-step costs about what a bare step costs (SGD) or less
(optimizers with slots, which update once per cycle), so the time for an
effective batch B is about that of K steps of B/K: larger K trades time for
memory only through the smaller micro-batch.
"""

import contextlib

from benchmarks import common

FLAGS = common.FLAGS
common.flags.DEFINE_integer(
    'sessions', 3, 'step: sessions of each variant, timed interleaved; '
    'the median of their medians is reported.')
common.flags.DEFINE_boolean(
    'zeroing_bound', False, "step: also time a cycle whose accumulators are "
    "never zeroed (wrong sums; timing only): the cycle's cost without the "
    'apply step zeroing each accumulator, for the SGD rows.')

# name -> (description, loss builder taking (tf, batch), micro-batch)
MODELS = {
    'mlp': ('3x1024 MLP', lambda tf, b: common.mlp_loss(tf, b, [1024] * 4),
            64),
    'many': ('200 variables of 64x64',
             lambda tf, b: common.mlp_loss(tf, b, [64] * 201), 64),
}


def run():
  tf = common.import_tf()
  modules = common.deferred_grad_modules()
  grad_steps = FLAGS.grad_steps
  results = []
  rows = []
  for description, build_loss, micro_batch in MODELS.values():
    for optimizer in common.OPTIMIZERS:
      # Several sessions of each variant, all interleaved: one session's
      # buffers can sit worse in the caches than another's (two sessions of
      # one graph differed by up to 7% on the 200-variable model).
      sessions = {}
      names = [('bare', None),
               # So large that every step only accumulates.
               ('accumulate', 10**9),
               ('cycle', grad_steps), ('schedule', grad_steps)]
      if FLAGS.zeroing_bound and optimizer == 'SGD':
        names.append(('unzeroed', grad_steps))
      if 'baseline' in modules:  # --baseline: the same, with that commit's
        names += [('baseline ' + name, steps) for name, steps in names[1:4]]
      for instance in range(FLAGS.sessions):
        for name, steps in names:
          module = modules['baseline' if name.startswith('baseline') else '']
          with _unzeroed(module, tf, name == 'unzeroed'):
            sessions[name, instance] = common.training_session(
                tf, build_loss, micro_batch, optimizer, steps,
                schedule=name.endswith('schedule'), module=module)
      variants = {key: (lambda s=s, op=op: s.run(op))
                  for key, (s, op, _) in sessions.items()}
      # Whole cycles in every round, for the 'cycle' variant: as many as
      # make --steps_per_round steps or more (one round of a single cycle
      # of 4 steps, 50 ms, swung by 10% on a 2-core VM).
      cycles = -(-FLAGS.steps_per_round // grad_steps)
      per_session = common.time_interleaved(variants,
                                            steps=cycles * grad_steps)
      for session, _, _ in sessions.values():
        session.close()
      times = {name: common.median([t for (n, _), t in per_session.items()
                                    if n == name])
               for name, _ in names}
      result = {
          'model': description, 'optimizer': optimizer,
          'micro_batch': micro_batch, 'grad_steps': grad_steps,
          'bare_ms': times['bare'] * 1e3,
          'accumulate_ms': times['accumulate'] * 1e3,
          'cycle_ms': times['cycle'] * grad_steps * 1e3,
          'schedule_cycle_ms': times['schedule'] * grad_steps * 1e3,
      }
      result['accumulate_ratio'] = times['accumulate'] / times['bare']
      result['cycle_ratio'] = times['cycle'] / times['bare']
      result['schedule_ratio'] = times['schedule'] / times['cycle']
      if 'unzeroed' in times:
        result['unzeroed_cycle_ratio'] = times['unzeroed'] / times['bare']
      if 'baseline cycle' in times:
        for name in ('accumulate', 'cycle', 'schedule'):
          result['baseline_%s_ms' % name] = (
              times['baseline ' + name] * 1e3 *
              (1 if name == 'accumulate' else grad_steps))
          result['%s_over_baseline' % name] = (
              times[name] / times['baseline ' + name])
      results.append(result)
      print('step: %s' % result, flush=True)
      rows.append([
          description, optimizer, '%.3f' % result['bare_ms'],
          '%.3f' % result['accumulate_ms'],
          '%.3f' % result['accumulate_ratio'],
          '%.2f' % result['cycle_ms'],
          '%.2f' % (grad_steps * result['bare_ms']),
          '%.3f' % result['cycle_ratio'],
          '%.2f' % result['schedule_cycle_ms'],
          '%.3f' % result['schedule_ratio']])
  table = common.markdown(
      ['model', 'optimizer', 'bare step (ms)', 'accumulate-only step (ms)',
       'ratio', 'cycle of %d (ms)' % grad_steps,
       '%d bare steps (ms)' % grad_steps, 'ratio',
       'schedule cycle (ms)', 'schedule / int'], rows)
  if 'baseline' in modules:
    table += ('\n\nAgainst --baseline=%s, side by side (this tree / '
              'that commit):\n\n' % FLAGS.baseline) + common.markdown(
                  ['model', 'optimizer', 'accumulate-only', 'cycle of %d'
                   % grad_steps, 'schedule cycle'],
                  [[r['model'], r['optimizer']] +
                   ['%.3f' % r['%s_over_baseline' % name]
                    for name in ('accumulate', 'cycle', 'schedule')]
                   for r in results])
  bounds = ['%s, %s: cycle %.3f, never zeroed %.3f' % (
      r['model'], r['optimizer'], r['cycle_ratio'], r['unzeroed_cycle_ratio'])
            for r in results if 'unzeroed_cycle_ratio' in r]
  if bounds:
    table += ('\n\nWithout zeroing the accumulators (timing only), / %d bare '
              'steps:\n\n' % grad_steps) + '\n'.join(
                  '* ' + bound for bound in bounds)
  return {'step': results}, table


@contextlib.contextmanager
def _unzeroed(module, tf, unzeroed):
  """Builds, if `unzeroed`, with each dense accumulator's zeroing a no-op."""
  if not unzeroed:
    yield
    return
  # The zeroing function: kernels.zero before the inside was reorganized,
  # accumulators._zero after (--baseline may time either).
  owner, name = ((module.kernels, 'zero') if hasattr(module, 'kernels') else
                 (module.accumulators, '_zero'))
  zero = getattr(owner, name)
  setattr(owner, name, lambda *unused_args, **unused_kwargs: tf.no_op())
  try:
    yield
  finally:
    setattr(owner, name, zero)
