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


# Appended to the complete script: trains its `build` as the port (K
# micro-batches a cycle) and as the large batch (`build(K * MICRO_BATCH, 1)`,
# the bare optimizer), and prints how far apart the weights, the moving
# averages and global_step end.
_AGAINST_THE_LARGE_BATCH = """

def _trained(batch_size, grad_steps, runs):
  with tf.Graph().as_default():
    train_op, _, global_step, _ = build(batch_size, grad_steps)
    variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(runs):
        session.run(train_op)
      return session.run([variables['w'],
                          variables['w/ExponentialMovingAverage'],
                          global_step])


port = _trained(MICRO_BATCH, GRAD_STEPS, GRAD_STEPS * UPDATES)
large = _trained(GRAD_STEPS * MICRO_BATCH, 1, UPDATES)
print('against the large batch: weights %g, moving average %g, global_step '
      '%d and %d' % (np.abs(port[0] - large[0]).max() / np.abs(large[0]).max(),
                     np.abs(port[1] - large[1]).max() / np.abs(large[1]).max(),
                     port[2], large[2]))
"""


def _run(block):
  result = subprocess.run([sys.executable, '-c', block],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300)
  assert result.returncode == 0, result.stdout
  return result.stdout


def _against_the_large_batch(output):
  match = re.search(r'against the large batch: weights (\S+), moving average '
                    r'(\S+), global_step (\d+) and (\d+)', output)
  assert match, output
  return (float(match.group(1)), float(match.group(2)), int(match.group(3)),
          int(match.group(4)))


def test_the_complete_script_runs_and_prints_what_the_readme_says():
  """It runs as written, prints what the README says, and its `build`
  trains as the large batch does (weights, moving average, global_step)."""
  (block,) = _python_blocks()
  # It says "or disable_v2_behavior()": the v1 pass runs it that way.
  mode = 'tf.compat.v1.disable_eager_execution()   # or disable_v2_behavior()'
  assert mode in block
  if behavior.BEHAVIOR == 'v1':
    block = block.replace(mode, 'tf.compat.v1.disable_v2_behavior()')
  output = _run(block + _AGAINST_THE_LARGE_BATCH)
  scripts.assert_no_porting_warning(output)
  match = re.search(r'global_step (\d+) after (\d+) micro-steps, loss '
                    r'([\d.]+)', output)
  assert match, output
  assert ('It prints `global_step 50 after 200 micro-steps` and a loss below '
          '0.01') in ' '.join(_readme().split())
  assert (int(match.group(1)), int(match.group(2))) == (50, 200), (
      match.group(0))
  assert float(match.group(3)) < 0.01, match.group(0)
  weights, average, step, large_step = _against_the_large_batch(output)
  assert weights < 1e-5 and average < 1e-5, output
  assert step == large_step == 50, output
  # The control: the same port counting micro-steps (the schedule and the
  # moving average then run K times too fast) is told apart.
  wrong = block.replace(", global_step_counts='updates'", '')
  assert wrong != block
  weights, average, step, large_step = _against_the_large_batch(
      _run(wrong + _AGAINST_THE_LARGE_BATCH))
  assert weights > 1e-3 and step == 4 * large_step, (weights, step)


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
