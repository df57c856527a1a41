"""One worker of the multi-worker tests (test_multi_worker.py starts two).

Usage: multi_worker_worker.py OUTPUT.npz MODE DELAY_SECONDS, with TF_CONFIG
set. MODE is 'session' (a raw Session) or 'monitored'
(MonitoredTrainingSession, is_chief=True on every worker). Each worker feeds
its half of every micro-batch and writes its final weights (and, in session
mode, the executed collectives per micro-step) to OUTPUT.npz.
"""

import os
import sys
import time

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # the model, data and behaviour set-up of the tests

WORKERS = 2
GRAD_STEPS = 3


def main(output, mode, delay):
  time.sleep(delay)
  strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()
  config = tf.compat.v1.ConfigProto()
  strategy.configure(session_config=config)
  resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
  task = resolver.task_id
  server = tf.distribute.Server(
      resolver.cluster_spec(), job_name='worker', task_index=task,
      config=config, start=True)
  x_data, y_data = conftest.make_data(conftest.CYCLES,
                                      WORKERS * GRAD_STEPS *
                                      conftest.MICRO_BATCH)
  with tf.Graph().as_default(), strategy.scope():
    global_step = tf.compat.v1.train.get_or_create_global_step()
    x = tf.compat.v1.placeholder(tf.float32, [None, conftest.INPUT_DIM])
    y = tf.compat.v1.placeholder(tf.float32, [None, conftest.OUTPUT_DIM])
    optimizer = conftest.deferred_grad.GradientAggregationOptimizer(
        conftest.OPTIMIZERS['Momentum'](None), GRAD_STEPS)
    variables = {}

    def replica_step():
      loss, model = conftest.model_loss(x, y)
      variables.update(model)
      return optimizer.minimize(loss / WORKERS, global_step=global_step)

    train_op = strategy.group(
        strategy.extended.call_for_each_replica(replica_step))
    barrier = conftest.deferred_grad.collective_barrier(strategy)
    options = conftest.deferred_grad.collective_run_options()

    def feeds():
      micro_batch = WORKERS * conftest.MICRO_BATCH
      for cycle in range(conftest.CYCLES):
        for k in range(GRAD_STEPS):
          start = k * micro_batch + task * conftest.MICRO_BATCH
          rows = slice(start, start + conftest.MICRO_BATCH)
          yield {x: x_data[cycle, rows], y: y_data[cycle, rows]}

    collectives = []  # executed Collective* ops per micro-step
    if mode == 'session':
      session = tf.compat.v1.Session(server.target, config=config)
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(barrier, options=options)
      options.trace_level = tf.compat.v1.RunOptions.FULL_TRACE
      for feed in feeds():
        metadata = tf.compat.v1.RunMetadata()
        session.run(train_op, feed, options=options, run_metadata=metadata)
        collectives.append(sum(
            1 for device in metadata.step_stats.dev_stats
            for node in device.node_stats
            if node.timeline_label.split(' = ')[-1].startswith('Collective')
            or node.node_name.startswith('Collective')))
      weights = session.run(variables)
    else:
      # Every worker runs the collective initializers: all are chiefs.
      with tf.compat.v1.train.MonitoredTrainingSession(
          master=server.target, config=config, is_chief=True,
          save_checkpoint_secs=None, save_summaries_steps=None,
          save_summaries_secs=None, log_step_count_steps=None) as session:
        session.run(barrier, options=options)
        for feed in feeds():
          session.run(train_op, feed, options=options)
        weights = session.run(variables)
  np.savez(output, collectives=np.array(collectives, np.int64), **weights)


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
