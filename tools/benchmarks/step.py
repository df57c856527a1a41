"""Suite `step`: the time of a micro-step and of a whole cycle.

One micro-step through the wrapper that only accumulates, against the bare
optimizer's step at the same micro-batch; and a whole cycle against
grad_steps bare steps. SGD and Adam; a 3x1024 MLP and a model of 200 64x64
variables. Side by side in one process, interleaved rounds, medians.

Results (`tools/benchmark --suites=step --grad_steps=8 --rounds=25`, a 2-core
AMD EPYC VM, TensorFlow 2.21.0, micro-batch 64; one round's bare step varied
from 8 to 27 ms between runs of the suite, so compare ratios within a table):

  model                    opt   bare   accumulate-only  ratio  cycle of 8  8 bare   ratio
  3x1024 MLP               SGD   17.67  18.00            1.019  142.66      141.35   1.009
  3x1024 MLP               Adam  20.93  18.66            0.892  153.38      167.42   0.916
  200 variables of 64x64   SGD    8.32   8.95            1.075   72.01       66.59   1.081
  200 variables of 64x64   Adam  15.50   9.56            0.617   85.43      124.00   0.689

At --grad_steps=4: cycle / 4 bare SGD steps 1.053x (MLP) and 1.091x (200
variables); accumulate-only 1.020x and 1.098x.

A later pair of runs on the same VM (`--rounds=25`, one after the other):
K=8, cycle / 8 bare SGD steps 1.040x (MLP) and 1.033x (200 variables),
accumulate-only 0.989x and 1.029x; K=4, cycle 1.074x and 1.132x,
accumulate-only 1.008x and 1.082x.

Targets: the accumulate-only micro-step at most 1.03x a bare SGD step on the
MLP (met) and 1.10x on the 200-variable model (met, barely); a whole cycle
at most 1.05x K bare steps at K=8 and 1.08x at K=4: met on the MLP; on the
200-variable model met at K=8 in one run of two (1.033x, 1.081x) and not at
K=4 (1.091x, 1.132x), where the apply step's ops weigh most. With Adam a cycle costs less than K bare Adam steps
(Adam's own update runs once per cycle).

Counted instead of timed (executed nodes per run, traced, 200-variable SGD
model): the accumulate-only micro-step runs 3,222 nodes against 2,809 for a
bare step (the accumulators' 400 handles and the tf.cond); the apply step
5,225, 5 per variable (8 before the shared-zeros change; pinned by
tests/test_equivalence.py::test_apply_step_costs_few_ops_per_small_variable).
On many small variables that count is the apply step's cost. The levers:
each dense gradient is added with one in-place kernel
(ResourceApplyGradientDescent with rate -1/K); the cycle's tf.cond runs as a
function where its variables share a device, so that micro-steps which do
not apply push no "dead" tensors through the apply branch; the apply step
zeroes each accumulator of up to 1 MiB with one assign of zeros shared by
its shape.

A `grad_steps` schedule (the last two columns: a callable of the updates
applied that gathers K from a table, as a batch-size schedule does) against
the int's cycle, in the same runs (2026-12-01, a noisier day on the same
VM: the int's whole cycle on the 200-variable SGD model read 1.075x-1.145x
K bare steps, the old code's 1.136x beside it):

  schedule / int cycle   MLP SGD  MLP Adam  200 vars SGD  200 vars Adam
  K=8                    0.984    1.022     0.954         0.983
  K=4, first run         1.024    1.048     1.056         1.024
  K=4, second run        1.030    0.997     0.970         1.016

Target: at most 1.03x; within the noise (one round's spread is about 5%).
Counted instead of timed, 200-variable SGD model at K=4: 1,870 executed
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

from benchmarks import common

FLAGS = common.FLAGS
common.flags.DEFINE_integer(
    'sessions', 3, 'step: sessions of each variant, timed interleaved; '
    'the median of their medians is reported.')

# name -> (description, loss builder taking (tf, batch), micro-batch)
MODELS = {
    'mlp': ('3x1024 MLP', lambda tf, b: common.mlp_loss(tf, b, [1024] * 4),
            64),
    'many': ('200 variables of 64x64',
             lambda tf, b: common.mlp_loss(tf, b, [64] * 201), 64),
}


def run():
  tf = common.import_tf()
  grad_steps = FLAGS.grad_steps
  results = []
  rows = []
  for description, build_loss, micro_batch in MODELS.values():
    for optimizer in common.OPTIMIZERS:
      # Several sessions of each variant, all interleaved: one session's
      # buffers can sit worse in the caches than another's (two sessions of
      # one graph differed by up to 7% on the 200-variable model).
      sessions = {}
      for instance in range(FLAGS.sessions):
        for name, steps in (('bare', None),
                            # So large that every step only accumulates.
                            ('accumulate', 10**9),
                            ('cycle', grad_steps), ('schedule', grad_steps)):
          sessions[name, instance] = common.training_session(
              tf, build_loss, micro_batch, optimizer, steps,
              schedule=name == 'schedule')
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
               for name in ('bare', 'accumulate', 'cycle', 'schedule')}
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
  return {'step': results}, table
