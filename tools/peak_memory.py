"""Resident memory of this process, for the demo and the benchmarks."""

import resource


def peak_rss_mb():
  """This process's peak resident set size, in MiB.

  Reads VmHWM from /proc/self/status (Linux). `getrusage`'s ru_maxrss is not
  used there: across fork and exec it keeps the parent's peak, so a child of
  a large parent would report the parent's memory.
  """
  peak = _status_mb('VmHWM')
  if peak is not None:
    return peak
  # Elsewhere (macOS reports bytes, Linux kB): only right for a fresh process.
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb():
  """This process's resident set size now, in MiB (Linux; else None)."""
  return _status_mb('VmRSS')


def _status_mb(field):
  """A memory field of /proc/self/status (given in kB), in MiB, or None."""
  try:
    with open('/proc/self/status') as status:
      for line in status:
        if line.startswith(field + ':'):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return None
