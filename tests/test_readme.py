"""The README is the front door: short, every block runs, every link works.

Every Python block of README.md is a complete script: it runs as written, in
a fresh process (it sets TensorFlow's behaviour itself), and its output is
what the README says it prints. The guides it links are runnable examples
under tools/examples/, which test_demo.py runs.
"""

import os
import re
import subprocess
import sys

import behavior
import scripts

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
README = os.path.join(ROOT, 'README.md')
EXAMPLES = os.path.join(ROOT, 'tools', 'examples')


def _readme():
  with open(README) as f:
    return f.read()


def _python_blocks():
  return re.findall(r'```python\n(.*?)```', _readme(), re.S)


def test_readme_is_short():
  lines = _readme().count('\n')
  assert lines <= 300, 'README.md has %d lines; the front door keeps to 300' % (
      lines)


def test_every_python_block_is_a_complete_script():
  blocks = _python_blocks()
  assert blocks, 'README.md has no Python block'
  for block in blocks:
    assert re.search(r'^\s*\.\.\.\s*$|=\s*\.\.\.\s*$', block, re.M) is None, (
        'a README block with a placeholder:\n' + block)
    assert 'import deferred_grad' in block, block


def test_the_complete_script_runs_and_prints_what_the_readme_says():
  (block,) = _python_blocks()
  # It says "or disable_v2_behavior()": the v1 pass runs it that way.
  mode = 'tf.compat.v1.disable_eager_execution()   # or disable_v2_behavior()'
  assert mode in block
  if behavior.BEHAVIOR == 'v1':
    block = block.replace(mode, 'tf.compat.v1.disable_v2_behavior()')
  result = subprocess.run([sys.executable, '-c', block],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300)
  assert result.returncode == 0, result.stdout
  scripts.assert_no_porting_warning(result.stdout)
  match = re.search(r'global_step (\d+), (\d+) updates, loss ([\d.]+)',
                    result.stdout)
  assert match, result.stdout
  # The README: "It prints `global_step 200, 50 updates` and a loss below
  # 0.01."
  assert 'It prints `global_step 200, 50 updates` and a loss below 0.01' in (
      ' '.join(_readme().split()))
  assert (int(match.group(1)), int(match.group(2))) == (200, 50), match.group(0)
  assert float(match.group(3)) < 0.01, match.group(0)


def test_every_relative_link_points_to_a_file():
  links = re.findall(r'\]\(([^)#]+)\)', _readme())
  missing = [link for link in links if not link.startswith('http') and
             not os.path.exists(os.path.join(ROOT, link))]
  assert links and not missing, 'README links to missing files: %s' % missing


def test_every_guide_is_in_the_setups_table():
  section = _readme().split('## Setups', 1)[1].split('\n## ', 1)[0]
  guides = sorted(name for name in os.listdir(EXAMPLES)
                  if name.endswith(('_example.py', '_porting.py')))
  unlisted = [name for name in guides
              if '(tools/examples/%s)' % name not in section]
  assert not unlisted, 'examples missing from the README setups table: %s' % (
      unlisted)
