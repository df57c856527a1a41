"""One task of the Estimator parameter-server test (test_parameter_servers).

Usage: ps_estimator_worker.py OUTPUT.npz, with TF_CONFIG naming a chief, a
worker and two ps tasks. Runs `tf.estimator.train_and_evaluate` with the
identifiable model of test_parameter_servers.py (a dense part and an
embedding table partitioned over both ps): the chief feeds micro-batches
0..11, the worker 12..23, asynchronously. The task that finishes last
writes the recorded updates and the final state to OUTPUT.npz; ps tasks
serve until the test ends them.
"""

import json
import os
import sys

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import behavior  # the TF behaviour of the tests, set before any graph
import test_parameter_servers as ps_test

TRAINERS = 2  # the chief and the worker


class _LastOneReports(tf.compat.v1.train.SessionRunHook):
  """The trainer that ends last reads every update and the final state."""

  def __init__(self, output):
    self._output = output

  def begin(self):
    graph = tf.compat.v1.get_default_graph()
    by_name = {v.op.name: v for v in tf.compat.v1.global_variables()}
    self._finished = tf.compat.v1.assign_add(by_name['finished'], 1,
                                             use_locking=True)
    queue = graph.get_collection('update_queue')[0]
    self._state = dict(
        updates=queue.dequeue_many(queue.size()),
        global_step=tf.compat.v1.train.get_global_step(),
        w=by_name['w'], w2=by_name['w2'],
        table=tf.concat([by_name['table/part_0'], by_name['table/part_1']],
                        0))

  def end(self, session):
    if session.run(self._finished) == TRAINERS:
      np.savez(self._output, **session.run(self._state))


def main(output):
  task = json.loads(os.environ['TF_CONFIG'])['task']
  first = 0 if task['type'] == 'chief' else ps_test.MICRO_BATCHES
  size = ps_test.MICRO_BATCHES * TRAINERS

  def input_fn():
    indices = tf.range(first, first + ps_test.MICRO_BATCHES)
    return tf.data.Dataset.from_tensor_slices((indices, indices))

  def model_fn(features, labels, mode):
    del labels
    tf.compat.v1.get_variable('finished', [], tf.int32,
                              tf.compat.v1.zeros_initializer(),
                              trainable=False)
    loss, opt, queue = ps_test.identifiable_model(features, size, ps_tasks=2,
                                                  use_tpu=False, table=True)
    tf.compat.v1.add_to_collection('update_queue', queue)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=opt.minimize(
        loss, tf.compat.v1.train.get_global_step()))

  estimator = tf.estimator.Estimator(model_fn, config=tf.estimator.RunConfig(
      model_dir=os.path.join(os.path.dirname(output), 'model'),
      save_summary_steps=None, save_checkpoints_steps=None,
      save_checkpoints_secs=None, log_step_count_steps=10**6))
  # The input ends each trainer's run after its micro-batches.
  tf.estimator.train_and_evaluate(
      estimator,
      tf.estimator.TrainSpec(input_fn, max_steps=10**6,
                             hooks=[_LastOneReports(output)]),
      tf.estimator.EvalSpec(input_fn, steps=1))


if __name__ == '__main__':
  main(sys.argv[1])
