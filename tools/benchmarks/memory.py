"""Suite `memory`: peak memory of one large batch against K micro-batches.

Effective batch B as one batch (bare optimizer) and as K micro-batches
(wrapper), and a bare micro-batch step, each in its own process: peak RSS
and TensorFlow's allocator peak during a traced cycle. The wrapper's extra
memory over the bare micro-batch step is given in parameter bytes.

Results (`tools/benchmark --suites=memory`: B = 4096, K = 8, SGD, least of
three processes, since one process's peak varies by up to 0.8x the MLP's
parameter bytes with the order in which independent ops run):

  model                        params  one batch   bare B/K   wrapper    wrapper/one  wrapper - bare B/K
                               (MB)    RSS/TF MB   RSS/TF MB  RSS/TF MB  RSS/TF       in parameter bytes
  conv net (activations)       0.1     2079/1181   735/148    738/148    0.35x/0.12x  +3 MB
  1024-4096-4096-4096 MLP      144.0   1242/512    901/256    1065/394   0.86x/0.77x  +164 MB = 1.14x/0.96x

On the activation-heavy conv net K micro-batches peak at 0.35x the memory of
one batch of 4096 and the wrapper costs nothing measurable over a bare
micro-batch step. On the parameter-heavy MLP (38M parameters) the target is
at most 1.2x the parameter bytes over a bare micro-batch step (the
accumulators themselves are 1x): 1.14x of RSS and 0.96x in the allocator in
the run above; a second run gave 1.23x and 1.00x, and a 2-core AMD EPYC VM
after the shared-zeros change +177 MB = 1.23x of RSS (wrapper 1055 MB, bare
micro-batch 878 MB, one batch 1125 MB): the RSS target is met about as often
as not, the allocator's every time. That CPU's TensorFlow (its plain `cpu`
allocator, no oneDNN pool) keeps no allocator statistics: the TF columns
read `-` there.

Before and after the five-module core (2026-12-02, that AMD VM, each
`tools/benchmark --suites=memory` in turn from a checkout of each): the
MLP's extra RSS +191 and +165 MB (1.33x, 1.15x) before, +185 and +177 MB
(1.28x, 1.23x) after; the conv net 0.46x-0.47x of one batch both. The core
changed no buffer: the spread is the noise above.

Four things as large as the parameters were found and removed: the
accumulators' initial zeros (TensorFlow's zeros slot is a graph constant the
session keeps: 2.39x), the apply step's zeros made as a constant, made for
all accumulators at once (1.18x), and the apply step's zeros themselves
(2.47x): assigning zeros wrote a second buffer as large as each accumulator
and oneDNN's pool keeps the pages it grows. Large accumulators are zeroed in
their own buffer by a scatter of one scalar zero over all rows, followed by
DisableCopyOnRead (a scatter puts a resource variable into copy-on-read
mode); RSS rises by 0 to 13 MB at the apply step
(tests/test_costs.py checks that a large accumulator's buffer never
moves and its reads copy nothing). Tried and dropped: overwriting the
accumulator with the cycle's first gradient (2.84x), a strided-slice
assign (2.44x).

Under disable_v2_behavior() (`--tf_behavior=v1`) the MLP's wrapper costs
+1.38x of RSS and 1.00x in the allocator (the process at 0.88x the large
batch; the conv net 0.35x), against +3.1x before. What lies above 1.2x is how
oneDNN's pool fragments over the first micro-steps, which varies from
process to process (1.2x to 1.56x in single runs).

The memory saving comes from activations, which scale with the micro-batch:
an activation-heavy model saves most; a parameter-heavy one pays 1x its
parameters for the accumulators and saves only if its large-batch
activations are bigger than that.
"""

import json

from benchmarks import common

import peak_memory  # tools/peak_memory.py

FLAGS = common.FLAGS

# name -> (description, loss builder taking (tf, batch), effective batch)
MODELS = {
    'conv': ('conv net (activation-heavy)', common.conv_loss, 4096),
    'wide': ('1024-4096-4096-4096 MLP (parameter-heavy)',
             lambda tf, b: common.mlp_loss(tf, b, [1024, 4096, 4096, 4096]),
             4096),
}


def child(spec):
  """Runs one configuration 'model,optimizer,batch,grad_steps|none[,limit]'.

  With a limit (MiB), the first GPU gets that much memory (a logical device
  configuration), and running out of it is reported, not raised. A last
  field 'baseline' wraps with --baseline's deferred_grad.
  """
  fields = spec.split(',')
  module = None
  if fields[-1] == 'baseline':
    module = common.deferred_grad_modules()[fields.pop()]
  model, optimizer, batch, grad_steps = fields[:4]
  limit_mb = int(fields[4]) if len(fields) == 5 else None
  grad_steps = None if grad_steps == 'none' else int(grad_steps)
  tf = common.import_tf()
  if limit_mb is not None:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices('GPU')[0],
        [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mb)])
  _, build_loss, _ = MODELS[model]
  try:
    session, train_op, parameters = common.training_session(
        tf, build_loss, int(batch), optimizer, grad_steps, module=module)
    for _ in range(grad_steps or 1):  # a cycle of warm-up
      session.run(train_op)
    # A traced cycle: TensorFlow's own allocator peaks, beside the process
    # RSS, which also counts what malloc keeps after TensorFlow frees it.
    device_peaks = {}
    tracked = set()  # allocators whose records carry their bytes in use
    for _ in range(grad_steps or 1):
      metadata = tf.compat.v1.RunMetadata()
      session.run(train_op,
                  options=tf.compat.v1.RunOptions(
                      trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                  run_metadata=metadata)
      for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
          for memory in node.memory:
            device_peaks[memory.allocator_name] = max(
                device_peaks.get(memory.allocator_name, 0),
                memory.peak_bytes, memory.allocator_bytes_in_use)
            if memory.allocator_bytes_in_use:
              tracked.add(memory.allocator_name)
  except tf.errors.ResourceExhaustedError:
    print(json.dumps({'out_of_memory': True}))
    return
  # An allocator that keeps no statistics (TensorFlow's plain `cpu` one,
  # where oneDNN's `mkl_cpu` is not used, as on some AMD CPUs) records each
  # op's own allocations with 0 bytes in use: the largest of those is no
  # peak. Only allocators whose records carry their bytes in use count.
  device_peaks = {name: peak for name, peak in device_peaks.items()
                  if name in tracked}
  print(json.dumps({
      'out_of_memory': False,
      'gpu_memory_info_peak_mb': _gpu_memory_info_peak_mb(tf),
      'peak_rss_mb': peak_memory.peak_rss_mb(),
      # None where no allocator's trace carries its bytes in use.
      'allocator_peak_mb': (max(device_peaks.values()) / 2**20
                            if device_peaks else None),
      # Per allocator ('mkl_cpu', 'GPU_0_bfc', ...): tools/gpu_check.
      'allocator_peaks_mb': {name: peak / 2**20
                             for name, peak in device_peaks.items()},
      'parameter_mb': parameters * 4 / 2**20,
  }))


def _gpu_memory_info_peak_mb(tf):
  """The first GPU allocator's peak over the process, or None.

  `tf.config.experimental.get_memory_info` asks the eager context, whose
  GPU device shares the session's allocator (one per GPU and process). Not
  run on a GPU yet: any error gives None (tools/gpu_check then relies on
  the traced peaks).
  """
  if not tf.config.list_physical_devices('GPU'):
    return None
  try:
    return tf.config.experimental.get_memory_info('GPU:0')['peak'] / 2**20
  except Exception:  # pylint: disable=broad-except
    return None


def measure(model, optimizer, batch, grad_steps, repeats=3, baseline=False):
  """Least peaks over `repeats` fresh processes.

  Peaks vary from process to process with the order in which the executor
  runs independent ops (on 2 cores, by up to 0.8x the parameter bytes on
  the MLP); the least is the configuration's own cost. `baseline`: wrap
  with --baseline's deferred_grad.
  """
  spec = '%s,%s,%d,%s' % (model, optimizer, batch, grad_steps or 'none')
  if baseline:
    spec += ',baseline'
  peaks = [common.run_child('memory', spec) for _ in range(repeats)]
  least = {key: _least(p[key] for p in peaks) for key in peaks[0]
           if not isinstance(peaks[0][key], dict)}
  least['allocator_peaks_mb'] = {
      name: min(p['allocator_peaks_mb'][name] for p in peaks)
      for name in peaks[0]['allocator_peaks_mb']
      if all(name in p['allocator_peaks_mb'] for p in peaks)}
  return least


def _least(values):
  """The least of `values` that are not None (None if all are)."""
  values = [value for value in values if value is not None]
  return min(values) if values else None


def _ratio(numerator, denominator):
  """numerator / denominator, or None where either is unknown."""
  if numerator is None or denominator is None:
    return None
  return numerator / denominator


def _text(value, form):
  return '-' if value is None else form % value


def run():
  grad_steps = FLAGS.grad_steps
  baseline = 'baseline' in common.deferred_grad_modules()
  results = []
  rows = []
  baseline_rows = []
  for model, (description, _, batch) in MODELS.items():
    optimizer = 'SGD'
    micro_batch = batch // grad_steps
    large = measure(model, optimizer, batch, None)
    bare_micro = measure(model, optimizer, micro_batch, None)
    wrapper = measure(model, optimizer, micro_batch, grad_steps)
    parameter_mb = large['parameter_mb']
    result = {
        'model': description, 'optimizer': optimizer, 'batch': batch,
        'grad_steps': grad_steps, 'parameter_mb': parameter_mb,
        'large_batch_mb': large['peak_rss_mb'],
        'bare_micro_batch_mb': bare_micro['peak_rss_mb'],
        'wrapper_mb': wrapper['peak_rss_mb'],
    }
    result['wrapper_over_large'] = (result['wrapper_mb'] /
                                    result['large_batch_mb'])
    result['extra_mb'] = (result['wrapper_mb'] -
                          result['bare_micro_batch_mb'])
    result['extra_parameter_bytes'] = result['extra_mb'] / parameter_mb
    for name, measured in [('large_batch', large),
                           ('bare_micro_batch', bare_micro),
                           ('wrapper', wrapper)]:
      result[name + '_allocator_mb'] = measured['allocator_peak_mb']
    # None where this build's allocator trace carries no peaks (see child).
    result['allocator_extra_parameter_bytes'] = _ratio(
        None if result['wrapper_allocator_mb'] is None or
        result['bare_micro_batch_allocator_mb'] is None else
        result['wrapper_allocator_mb'] -
        result['bare_micro_batch_allocator_mb'], parameter_mb)
    if baseline:  # --baseline's wrapper, measured the same way
      before = measure(model, optimizer, micro_batch, grad_steps,
                       baseline=True)
      result['baseline_wrapper_mb'] = before['peak_rss_mb']
      result['baseline_extra_parameter_bytes'] = (
          before['peak_rss_mb'] - result['bare_micro_batch_mb']) / parameter_mb
      baseline_rows.append([description, '%.0f' % result['wrapper_mb'],
                            '%.0f' % before['peak_rss_mb'],
                            '%.2fx' % result['extra_parameter_bytes'],
                            '%.2fx' % result['baseline_extra_parameter_bytes']])
    results.append(result)
    print('memory: %s' % result, flush=True)
    rows.append([description, '%.1f' % parameter_mb] + [
        '%.0f / %s' % (result[name + '_mb'],
                       _text(result[name + '_allocator_mb'], '%.0f'))
        for name in ['large_batch', 'bare_micro_batch', 'wrapper']] + [
            '%.2fx / %s' % (result['wrapper_over_large'], _text(_ratio(
                result['wrapper_allocator_mb'],
                result['large_batch_allocator_mb']), '%.2fx')),
            '%+.0f MB = %.2fx / %s' % (
                result['extra_mb'], result['extra_parameter_bytes'],
                _text(result['allocator_extra_parameter_bytes'], '%.2fx'))])
  # '-' in a TF column: this build's allocator trace records no peaks.
  table = common.markdown(
      ['model (SGD, K=%d)' % grad_steps, 'parameters (MB)',
       'one batch of B: RSS / TF (MB)', 'bare, batch B/K: RSS / TF (MB)',
       'wrapper, K x B/K: RSS / TF (MB)', 'wrapper / one batch: RSS / TF',
       'wrapper - bare B/K, in parameter bytes: RSS / TF'], rows)
  if baseline_rows:
    table += ('\n\nAgainst --baseline=%s (peak RSS, MB; the wrapper\'s '
              'extra over a bare micro-batch step in parameter bytes):\n\n'
              % FLAGS.baseline) + common.markdown(
                  ['model', 'this tree', 'baseline', 'extra, this tree',
                   'extra, baseline'], baseline_rows)
  return {'memory': results}, table
