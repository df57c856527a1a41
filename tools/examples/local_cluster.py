"""What the cluster examples share: free 127.0.0.1 addresses for servers."""

import socket


def free_addresses(count):
  """`count` 'host:port' strings of free ports on 127.0.0.1.

  The ports are free when this returns; the servers bind them next (a port
  taken in between makes a server fail to start, not train wrong).
  """
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(('127.0.0.1', 0))
  addresses = ['127.0.0.1:%d' % s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return addresses
