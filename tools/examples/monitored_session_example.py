r"""MonitoredTrainingSession with deferred_grad: checkpoints and resume.

Run as a script it trains one model three ways and prints how far apart
they end: without a stop; stopped mid-cycle and started again on the same
`checkpoint_dir`; and from a checkpoint written without the wrapper.

Step limits count micro-steps. `StopAtStepHook(last_step=...)`,
`save_checkpoint_steps` and `save_summaries_steps` read `global_step`, which
the wrapper increments once per micro-step: for N updates run
N * grad_steps steps.

Resuming needs nothing special. The accumulators (`<var>/GradientAccumulator`),
the step and, on the TPU path, `update_count` are ordinary global variables:
every saver writes them, and a job stopped mid-cycle resumes with its
half-accumulated gradient, ending with exactly the weights of an
uninterrupted run (tested for Session, MonitoredTrainingSession, Estimator
and TPUEstimator's model_fn). Only the input pipeline must resume where it
stopped, as it must without this library: here each micro-batch is chosen
by the step it is fed at.

Checkpoint names are the original's, so its checkpoints restore:

  variable                            checkpoint key
  accumulator of v (slot grad_accum)  v/GradientAccumulator
  the same, of a second train op      v/GradientAccumulator_1 (slot grad_accum_1)
  a partitioned table's, per part     table/part_0/GradientAccumulator (the
                                        original: slices of
                                        table/GradientAccumulator)
  cycle counter (TPU path, or no      update_count (a float32 scalar;
    global_step)                        update_count_1, ... for later ones)
  the wrapped optimizer's slots       their usual names: v/Adam, v/Adam_1
  its non-slot variables              beta1_power (control flow v2) or
                                        cond/beta1_power (control flow v1)

`update_count` counts modulo grad_steps; a value written by the original
(which counted on) is read modulo grad_steps and continues its cycle.

The wrapper installs no saver: MonitoredTrainingSession, Estimator and
Supervisor save with the saver they make without it (keeping what you told
them: `RunConfig(keep_checkpoint_max=...)`, a Scaffold's saver, yours).

Switching accumulation on, off, to another grad_steps or to the other graph
behaviour over an existing checkpoint (written at a cycle boundary) is one
step: `deferred_grad.convert_checkpoint(checkpoint_dir)`, after the graph is
built and before the session restores (`train` below calls it every time:
where nothing needs converting it writes nothing). A checkpoint written
without the wrapper lacks the accumulators, which start afresh, and names
Adam's powers `head/beta1_power` where the wrapper, as the original, names
them `beta1_power` (control flow v2) or `head/cond/beta1_power` (v1): it
writes a copy under this graph's names (`model.ckpt.converted-<step>`) and
makes it the directory's latest. Skipped, a plain restore fails with
`NotFoundError: Key .../GradientAccumulator not found` (or
`.../deferred_grad_settings`, or the powers' name). An Estimator takes
`hooks=[deferred_grad.ConvertCheckpointHook(model_dir)]` in `train`; a
Session restores with `deferred_grad.Saver()`, which converts as it
restores. On the GPU path the cycle is read from `global_step`: restored at
a step that is not a multiple of grad_steps, the first cycle would be short
(the sum of fewer micro-batches, divided by grad_steps), so its first
micro-step fails saying so; give grad_steps as a tensor (`tf.constant(k)`),
whose counters start afresh, to turn accumulation on at any step.

Resuming with other settings (the README's "Checkpoints" has the table):
aggregation, sparse_as_dense and the TPU-to-GPU path may change at any
step. grad_steps (an int), micro_batch_weight and nonfinite_policy may
change at a cycle boundary: each train op's settings are a variable
(`<scope>/deferred_grad_settings`) that every saver saves, and a mid-cycle
checkpoint restored under others fails the first micro-step with an error
naming them. Give grad_steps as a tensor or callable (schedule_example.py)
to change it at any step: its counters are saved, and a cycle restored
mid-way ends with the length it began with. Where a setting adds a
counter (a policy, weights, the GPU-to-TPU path, an int to a schedule), the
conversion starts the wrapper's state afresh.

Under MirroredStrategy (also Estimator's train_distribute) each replica adds
into its own part of an accumulator; the checkpoint holds their sum under
the usual key (sync-on-read variables, SUM aggregation), and a restore gives
each replica an equal share: a job stopped mid-cycle resumes with the same
cycle sum, within round-off. Multi-worker jobs checkpoint at cycle
boundaries only (see multi_worker_example.py).

TensorFlow's StepCounterHook may print "It seems that global step
(tf.train.get_global_step) has not been increased": it fetches global_step
in the same run as the train op, unordered with the increment. It is
harmless; `log_step_count_steps=None` removes the hook.

  python tools/examples/monitored_session_example.py --grad_steps=4
"""

import os
import shutil
import tempfile

from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

import deferred_grad
import run_guide

FLAGS = flags.FLAGS
flags.DEFINE_integer('grad_steps', 4, 'Micro-batches per update.')
flags.DEFINE_integer('micro_batch', 16, 'Examples per micro-batch.')
flags.DEFINE_integer('updates', 6, 'Number of updates.')

TRUE_W = np.random.RandomState(0).randn(8, 1).astype(np.float32)


def micro_batch(step):
  """The micro-batch fed at `step`: the input resumes with the step."""
  x = np.random.RandomState(step).randn(FLAGS.micro_batch, 8)
  return x.astype(np.float32), x.dot(TRUE_W).astype(np.float32)


def train(checkpoint_dir, last_step, grad_steps):
  """Trains to `last_step` from what `checkpoint_dir` holds; returns w, loss."""
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 8])
    y = tf.compat.v1.placeholder(tf.float32, [None, 1])
    w = tf.compat.v1.get_variable('w', [8, 1],
                                  initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = tf.compat.v1.train.AdamOptimizer(0.2)
    if grad_steps > 1:
      optimizer = deferred_grad.GradientAggregationOptimizer(optimizer,
                                                             grad_steps)
    with tf.compat.v1.name_scope('head'):  # as a model_fn's head
      train_op = optimizer.minimize(loss, global_step=global_step)
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=last_step)]
    if tf.train.latest_checkpoint(checkpoint_dir):  # the step of a switch
      deferred_grad.convert_checkpoint(checkpoint_dir)
    # No Scaffold: MonitoredTrainingSession's own plain saver.
    with tf.compat.v1.train.MonitoredTrainingSession(
        checkpoint_dir=checkpoint_dir, hooks=hooks,
        save_checkpoint_steps=grad_steps, log_step_count_steps=None) as session:
      while not session.should_stop():
        batch_x, batch_y = micro_batch(session.run(global_step))
        value, _ = session.run([loss, train_op], {x: batch_x, y: batch_y})
    return tf.train.load_variable(checkpoint_dir, 'w'), value


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # the hooks' INFO lines
  tf.compat.v1.disable_eager_execution()
  k = FLAGS.grad_steps
  last_step = FLAGS.updates * k
  root = tempfile.mkdtemp()
  try:
    _, first_loss = train(root + '/a', 1, k)
    straight, loss = train(root + '/a', last_step, k)
    print('uninterrupted: %d micro-steps, %d updates' % (last_step,
                                                          FLAGS.updates))
    # Stop mid-cycle (the checkpoint is written when the session ends).
    train(root + '/b', last_step // 2 + 1, k)
    resumed, _ = train(root + '/b', last_step, k)
    print('stopped at micro-step %d and resumed: largest weight difference '
          'from the uninterrupted run: %.3g'
          % (last_step // 2 + 1, np.abs(resumed - straight).max()))
    # Written without the wrapper, then accumulation on, then off again.
    train(root + '/c', k, 1)
    train(root + '/c', k + last_step, k)
    train(root + '/c', 2 * k + last_step, 1)
    print('accumulation turned on over a checkpoint written without it, '
          'then off: trained on to step %d' % (2 * k + last_step))
    print('loss went from %.5f to %.5f' % (first_loss, loss))
  finally:
    shutil.rmtree(root)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  run_guide.run(main)
