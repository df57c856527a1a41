"""The inside stays as the README's Development section draws it.

Building one train op (a dense variable, an int grad_steps=4, Momentum,
global_step given, no strategy) enters at most 6 of the package's modules,
with at most 40 switches from one to another; no module keeps mutable state
at module level (state lives on the wrapper, its train ops' records, and
graph collections); TensorFlow's private modules are imported in compat.py
only, beside the Saver's `saveable_object` in checkpoints.py.
"""

import collections
import importlib
import os
import pkgutil
import re
import sys
import weakref

import tensorflow as tf

import deferred_grad

_PACKAGE = os.path.dirname(os.path.abspath(deferred_grad.__file__))


def _trace_one_train_op():
  """[(module, function)] of the package's calls while apply_gradients
  builds one train op."""
  calls = []

  def tracer(frame, event, arg):
    del arg
    module = frame.f_globals.get('__name__', '')
    if event == 'call' and module.startswith('deferred_grad'):
      calls.append((module.split('.')[-1], frame.f_code.co_name))

  with tf.Graph().as_default():
    w = tf.compat.v1.get_variable('w', [4, 3])
    loss = tf.reduce_sum(w * w)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = deferred_grad.GradientAggregationOptimizer(
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 4)
    pairs = opt.compute_gradients(loss)
    sys.settrace(tracer)
    try:
      opt.apply_gradients(pairs, global_step=global_step)
    finally:
      sys.settrace(None)
  return calls


def test_one_train_op_is_built_in_few_modules_and_switches():
  calls = _trace_one_train_op()
  modules = collections.Counter(module for module, _ in calls)
  switches = sum(1 for a, b in zip(calls, calls[1:]) if a[0] != b[0])
  assert calls[0] == ('optimizer', 'apply_gradients'), calls[:3]
  assert len(modules) <= 6, modules
  assert switches <= 40, (switches, modules)


def test_no_module_keeps_mutable_state():
  mutable = (dict, list, set, collections.deque, weakref.WeakKeyDictionary,
             weakref.WeakValueDictionary, weakref.WeakSet)
  found = []
  for info in pkgutil.iter_modules([_PACKAGE]):
    module = importlib.import_module('deferred_grad.' + info.name)
    found.extend('%s.%s' % (info.name, name)
                 for name, value in vars(module).items()
                 if not name.startswith('__') and isinstance(value, mutable))
  assert not found, found


def test_private_tensorflow_modules_are_imported_in_compat_only():
  allowed = {'compat.py': None,
             'checkpoints.py': {'tensorflow.python.training.saving'}}
  private = re.compile(r'\b(tensorflow\.(?:python|compiler)[\w.]*)')
  offenders = []
  for name in sorted(os.listdir(_PACKAGE)):
    if not name.endswith('.py'):
      continue
    with open(os.path.join(_PACKAGE, name)) as source:
      for line in source:
        for module in private.findall(line):
          if name in allowed and (allowed[name] is None or
                                  module in allowed[name]):
            continue
          offenders.append((name, line.strip()))
  assert not offenders, offenders
