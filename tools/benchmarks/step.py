"""Suite `step`: the time of a micro-step and of a whole cycle.

One micro-step through the wrapper that only accumulates, against the bare
optimizer's step at the same micro-batch; and a whole cycle against
grad_steps bare steps. SGD and Adam; a 3x1024 MLP and a model of 200 64x64
variables. Side by side in one process, interleaved rounds, medians.
"""

from benchmarks import common

FLAGS = common.FLAGS

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
      sessions = {
          'bare': common.training_session(tf, build_loss, micro_batch,
                                          optimizer, None),
          # So large a grad_steps that every step only accumulates.
          'accumulate': common.training_session(tf, build_loss, micro_batch,
                                                optimizer, 10**9),
          'cycle': common.training_session(tf, build_loss, micro_batch,
                                           optimizer, grad_steps),
      }
      variants = {name: (lambda s=s, op=op: s.run(op))
                  for name, (s, op, _) in sessions.items()}
      # Whole cycles in every round, for the 'cycle' variant.
      times = common.time_interleaved(variants, steps=grad_steps)
      for session, _, _ in sessions.values():
        session.close()
      result = {
          'model': description, 'optimizer': optimizer,
          'micro_batch': micro_batch, 'grad_steps': grad_steps,
          'bare_ms': times['bare'] * 1e3,
          'accumulate_ms': times['accumulate'] * 1e3,
          'cycle_ms': times['cycle'] * grad_steps * 1e3,
      }
      result['accumulate_ratio'] = times['accumulate'] / times['bare']
      result['cycle_ratio'] = times['cycle'] / times['bare']
      results.append(result)
      print('step: %s' % result, flush=True)
      rows.append([
          description, optimizer, '%.3f' % result['bare_ms'],
          '%.3f' % result['accumulate_ms'],
          '%.3f' % result['accumulate_ratio'],
          '%.2f' % result['cycle_ms'],
          '%.2f' % (grad_steps * result['bare_ms']),
          '%.3f' % result['cycle_ratio']])
  table = common.markdown(
      ['model', 'optimizer', 'bare step (ms)', 'accumulate-only step (ms)',
       'ratio', 'cycle of %d (ms)' % grad_steps,
       '%d bare steps (ms)' % grad_steps, 'ratio'], rows)
  return {'step': results}, table
