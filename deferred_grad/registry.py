"""The wrapper's state in a graph: one `Registry` per graph.

Everything the package keeps about a graph, beside the wrapper and its
train ops' records, lives on the graph's registry: no module-level state.
It sits in the graph's one collection under a tuple key, which meta graphs
never serialize (as TensorFlow's own variable store does).
"""

_KEY = ('deferred_grad', 'registry')


class Registry(object):
  """What the package knows of one graph's train ops.

  Attributes:
    records: the train ops' `records.Record`s, in the order built: the n-th
      train op each replica builds shares the n-th.
    built: {replica index: how many train ops it has built}.
    counted_steps: [(a global step's name, whether its train op decides its
      cycle on it)], one per train op that counts one.
    updates_tensors: the tensors `applied_updates` made.
    warned: the names of the global steps a raw read was warned about.
    state: [(variable, its value afresh or None)]: what a checkpoint holds
      of the wrapper (`checkpoints`).
    aliases: [(variable, its names under other settings)].
    settings: the train ops' `checkpoints.Settings`.
    slot_owners: [(accumulator slot, the record that accumulates in it)].
    plain_read: the plain read of the global step hooks fetch, or None.
  """

  def __init__(self):
    self.records = []
    self.built = {}
    self.counted_steps = []
    self.updates_tensors = []
    self.warned = set()
    self.state = []
    self.aliases = []
    self.settings = []
    self.slot_owners = []
    self.plain_read = None


def of(graph):
  """The registry of `graph`, made once.

  Args:
    graph: a `tf.Graph`.

  Returns:
    A `Registry`.
  """
  listed = graph.get_collection_ref(_KEY)
  if not listed:
    listed.append(Registry())
  return listed[0]


def records_of(wrapper, graph):
  """The records of the train ops `wrapper` built in `graph`, in order.

  Args:
    wrapper: a `GradientAggregationOptimizer`.
    graph: a `tf.Graph`.

  Returns:
    A list of `records.Record`s.
  """
  return [record for record in of(graph).records
          if any(built is wrapper for built in record.wrappers)]
