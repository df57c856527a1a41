"""Running the scripts under tools/ from the tests."""

import os
import re
import subprocess
import sys

import pytest

import behavior

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                     'tools')

# The benchmarks' helpers that tests share: free_ports, and the ps traffic
# measurement that tests/test_parameter_servers.py checks.
sys.path.insert(0, TOOLS)
# pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks.cluster import bytes_into_ps  # pylint: disable=unused-import
from benchmarks.cluster import free_ports  # pylint: disable=unused-import
# pylint: enable=g-import-not-at-top,wrong-import-position

# Scripts under tools/ set their own TensorFlow behaviour: run them once per
# TensorFlow version, in one pass of the test runner (which runs a version's
# two passes side by side): in the v1 pass, the shorter one; on the newest
# version, whose v1 pass also runs tools/gpu_check's tests, the examples
# compared with the large batch run in its v2 pass, so that the two passes
# take about as long.
def _once_per_version_in(pass_behavior):
  return pytest.mark.skipif(
      behavior.BEHAVIOR != pass_behavior,
      reason='runs a tools/ script, which sets its own TF behaviour: once per '
      'TensorFlow version, in the %s pass' % pass_behavior)


NEWEST_TENSORFLOW = behavior.tf.__version__.startswith('2.21.')
run_once_per_version = _once_per_version_in('v1')
run_examples_once_per_version = _once_per_version_in(
    'v2' if NEWEST_TENSORFLOW else 'v1')


def run_tool(script, *args):
  """Runs a Python script under tools/; returns its combined output.

  Fails the test if the script exits non-zero.
  """
  result = subprocess.run(
      [sys.executable, os.path.join(TOOLS, script)] + list(args),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      universal_newlines=True,
      timeout=300)
  assert result.returncode == 0, result.stdout
  assert_no_porting_warning(result.stdout)
  return result.stdout


# The words of the wrapper's warnings about a port's missed edit, which no
# guide (a correct port) may print.
PORTING_WARNINGS = ('which counts micro-steps: a schedule on it',
                    'deferred_grad.PortCheckHook:')


def assert_no_porting_warning(output):
  for warning in PORTING_WARNINGS:
    assert warning not in output, output


def largest_differences(output):
  """Every 'largest ... difference ...: X' figure an example printed."""
  found = [float(x) for x in re.findall(
      r'largest [^\n]*?difference[^\n]*?: ([-+\d.e]+)', output)]
  assert found, output
  return found


def loss_decrease(output):
  """(first, last) from an example's 'loss went from A to B' line."""
  match = re.search(r'loss went from ([\d.]+) to ([\d.]+)', output)
  assert match, output
  return float(match.group(1)), float(match.group(2))
