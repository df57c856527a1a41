"""`tf.cond` whose branch not taken costs nothing on the micro-steps.

The wrapper's `tf.cond`s (apply or not, add a finite micro-batch or not)
take one branch on most runs; this runs that branch only.
"""

from __future__ import absolute_import
from __future__ import division
from __future__ import print_function

from deferred_grad import compat

tf = compat.import_tensorflow()

# pylint: disable=g-direct-tensorflow-import,g-import-not-at-top
from tensorflow.core.framework import attr_value_pb2
# pylint: enable=g-direct-tensorflow-import,g-import-not-at-top


def _source(tensor):
  """The tensor a branch function captured, through nested branches."""
  while True:
    outer = {id(inner): outer for outer, inner in getattr(
        tensor.graph, 'captures', ())}.get(id(tensor))
    if outer is None:
      return tensor
    tensor = outer


def run_cond_as_function(graph, ops_before):
  """Keeps the control flow v2 `If` ops made since `ops_before` unlowered.

  In a session, TensorFlow lowers `If` to Switch/Merge, which pushes "dead"
  tensors through every op of the branch not taken, on every run. The
  wrapper's apply branch holds a few ops per variable, and it is not taken
  on grad_steps - 1 of grad_steps micro-steps: run as a function, `If`
  executes only the branch taken (`tools/benchmark --suites=step`). XLA and
  control flow v1 ignore this.

  An unlowered `If` is placed with all the resources it reads, so this is
  done only where they are on one device: not under MirroredStrategy, nor
  with variables spread over parameter servers.
  """
  for op in graph.get_operations()[len(ops_before):]:
    if op.type not in ('If', 'StatelessIf'):
      continue
    devices = {_source(x).op.device for x in op.inputs
               if x.dtype == tf.resource}
    if len(devices) <= 1:
      op._set_attr('_lower_using_switch_merge',  # pylint: disable=protected-access
                   attr_value_pb2.AttrValue(b=False))


def cond(pred, true_fn, false_fn):
  """`tf.cond` whose control flow v2 `If` op is run as a function.

  See `run_cond_as_function`. A Python bool `pred` (decided at graph
  build, as grad_steps=1's cycle end) builds the branch it names alone.
  """
  if isinstance(pred, bool):
    return true_fn() if pred else false_fn()
  graph = tf.compat.v1.get_default_graph()
  ops_before = graph.get_operations()
  result = tf.cond(pred, true_fn, false_fn)
  run_cond_as_function(graph, ops_before)
  return result
