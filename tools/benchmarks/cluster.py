"""Clusters on 127.0.0.1 for the benchmarks (and the tests): ports, traffic.

No flags and no TensorFlow import here, so that tests/ can use it too.
"""

import re

_UNITS = {'B': 1, 'KB': 2**10, 'MB': 2**20, 'GB': 2**30}


def free_ports(count):
  """`count` free TCP ports on 127.0.0.1."""
  import socket  # pylint: disable=g-import-not-at-top
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(('127.0.0.1', 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def bytes_into_ps(metadata):
  """Bytes the ps tasks received in a traced run (its `RunMetadata`).

  Summed from the RecvTensor records of the ps devices' step stats, whose
  labels give sizes rounded to two significant digits ('[4B]', '[0.2MB]';
  TensorFlow 2.21 prefixes them with 'RecvTensor ').
  """
  received = 0.0
  for device in metadata.step_stats.dev_stats:
    if '/job:ps' not in device.device:
      continue
    for node in device.node_stats:
      match = re.search(r'^(?:RecvTensor )?\[([\d.]+)([KMG]?B)\]',
                        node.timeline_label)
      if node.node_name == 'RecvTensor' and match:
        received += float(match.group(1)) * _UNITS[match.group(2)]
  return received
