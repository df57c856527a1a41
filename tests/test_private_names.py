"""The private TensorFlow names the package uses are all in one list.

`deferred_grad.compat.PRIVATE_NAMES` lists each with its reason. This test
finds them in the package's syntax tree: an attribute beginning with `_` on
an object the package did not define (`x._name`, or `self._name` where no
package code sets `self._name`), a method of a TensorFlow base class that a
package class overrides under a `_` name, an import from `tensorflow.`
(`tensorflow.python`, `tensorflow.compiler`), a `tf.raw_ops` op, and a
string beginning with `_` (a private attribute or key TensorFlow reads).
It also finds undocumented attributes of TensorFlow's internal classes
(`_UNDOCUMENTED`) and a class told by its name (`type(x).__name__` in a
comparison). The list's own keys are not scanned. Each found must be
listed, and each listed found. No frame inspection.
"""

import ast
import importlib
import inspect
import os


from deferred_grad import compat

_PACKAGE = os.path.dirname(compat.__file__)
# namedtuple's documented methods.
_NAMEDTUPLE = {'_replace', '_fields', '_asdict', '_make'}
# Attributes of TensorFlow's internal classes (control flow contexts,
# function graphs) that no public API documents.
_UNDOCUMENTED = {'IsXLAContext', 'outer_context', 'outer_graph', 'captures',
                 'GetWhileContext', 'GetControlPivot', 'external_captures',
                 'inner_graph', 'function_captures'}


def _trees():
  return {name[:-3]: ast.parse(open(os.path.join(_PACKAGE, name)).read())
          for name in sorted(os.listdir(_PACKAGE)) if name.endswith('.py')}


def _set_on_self(trees):
  """Attribute names package code assigns on `self` (or defines)."""
  names = set()
  for tree in trees.values():
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        names.add(node.name)
      elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = getattr(node, 'targets', None) or [node.target]
        for target in targets:
          for part in ast.walk(target):
            if (isinstance(part, ast.Attribute) and
                isinstance(part.value, ast.Name) and part.value.id == 'self'):
              names.add(part.attr)
  return names


def _found():
  """{private name: [module:line, ...]} in the package's source."""
  trees = _trees()
  own = _set_on_self(trees)
  found = {}

  def add(name, where):
    found.setdefault(name, []).append(where)

  for module, tree in trees.items():
    listed = _private_names_node(tree)
    for node in ast.walk(tree):
      where = '%s:%d' % (module, getattr(node, 'lineno', 0))
      if listed is not None and _inside(node, listed):
        continue
      if isinstance(node, ast.Compare) and any(
          _is_type_name(part) for part in [node.left] + node.comparators):
        add('type().__name__', where)
      if isinstance(node, ast.Attribute) and node.attr in _UNDOCUMENTED:
        add(node.attr, where)
      elif (isinstance(node, ast.Constant) and node.value in _UNDOCUMENTED):
        add(node.value, where)  # getattr(graph, 'outer_graph', None)
      if isinstance(node, ast.Attribute):
        attr = node.attr
        if (isinstance(node.value, ast.Attribute) and
            node.value.attr == 'raw_ops'):
          add(attr, where)
        elif (attr.startswith('_') and not attr.startswith('__') and
              attr not in _NAMEDTUPLE and not (
                  isinstance(node.value, ast.Name) and
                  node.value.id in ('self', 'cls') and attr in own)):
          add(attr, where)
      elif isinstance(node, ast.ImportFrom) and (
          node.module or '').startswith('tensorflow.'):
        add(node.module, where)
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name.startswith('tensorflow.'):
            add(alias.name, where)
      elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.startswith('_') and
            not node.value.startswith('__') and
            node.value.replace('_', 'a').isalnum()):
        add(node.value, where)
  for module in trees:
    loaded = importlib.import_module('deferred_grad.' + module)
    for name, cls in vars(loaded).items():
      if not (inspect.isclass(cls) and cls.__module__ == loaded.__name__):
        continue
      bases = [base for base in cls.__mro__[1:]
               if not base.__module__.startswith('deferred_grad')]
      for attr in vars(cls):
        if (attr.startswith('_') and not attr.startswith('__') and
            any(hasattr(base, attr) for base in bases)):
          add(attr, '%s.%s' % (module, name))
  return found


def _private_names_node(tree):
  """The value of the module's `PRIVATE_NAMES = ...`, or None."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == 'PRIVATE_NAMES'
        for t in node.targets):
      return node.value
  return None


def _inside(node, outer):
  """Whether `node` lies within `outer` (by source position)."""
  if not hasattr(node, 'lineno'):
    return False
  return (outer.lineno, outer.col_offset) <= (node.lineno, node.col_offset) \
      and (node.end_lineno, node.end_col_offset) <= (
          outer.end_lineno, outer.end_col_offset)


def _is_type_name(node):
  """`type(x).__name__`: a class told by its name."""
  return (isinstance(node, ast.Attribute) and node.attr == '__name__' and
          isinstance(node.value, ast.Call) and
          isinstance(node.value.func, ast.Name) and
          node.value.func.id == 'type')


def test_every_private_name_is_listed_with_its_reason():
  found = _found()
  unlisted = {name: where for name, where in found.items()
              if name not in compat.PRIVATE_NAMES}
  assert not unlisted, (
      'private TensorFlow names not in compat.PRIVATE_NAMES: %s' % unlisted)
  stale = sorted(set(compat.PRIVATE_NAMES) - set(found))
  assert not stale, 'listed but no longer used: %s' % stale
  for name, (where, why) in compat.PRIVATE_NAMES.items():
    assert where and len(why) > 10, name


def test_the_scan_finds_what_it_looks_for():
  """The scan itself: a private attribute, an override, a raw op, an
  undocumented attribute (read directly and through getattr)."""
  found = _found()
  assert {'_create_slots', '_trackable_children', 'MutexV2',
          '_lower_using_switch_merge', 'tensorflow.python.training',
          'IsXLAContext', 'outer_graph', 'captures'} <= set(found)
  assert any(where.startswith('compat:') for where in found['captures'])


def test_the_scan_sees_a_class_told_by_its_name():
  tree = ast.parse("ok = 'ParameterServerStrategy' in type(strategy).__name__"
                   "\nmessage = 'got %s' % type(value).__name__")
  compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
  assert len(compares) == 1 and _is_type_name(compares[0].comparators[0])
  names = [n for n in ast.walk(tree) if _is_type_name(n)]
  assert len(names) == 2  # the message's is no comparison: not private


def test_the_list_s_own_keys_are_not_found_as_uses():
  """A name listed and no longer used is stale: the list does not count."""
  tree = _trees()['compat']
  listed = _private_names_node(tree)
  assert listed is not None
  keys = [k.value for k in listed.args[0].keys]  # MappingProxyType({...})
  assert '_create_slots' in keys and '_name' not in keys


def test_no_frame_inspection():
  words = set()
  for tree in _trees().values():
    for node in ast.walk(tree):
      if isinstance(node, ast.Name):
        words.add(node.id)
      elif isinstance(node, ast.Attribute):
        words.add(node.attr)
      elif isinstance(node, ast.alias):
        words.add(node.name)
  assert not words & {'inspect', 'currentframe', 'f_back', 'f_locals',
                      '_getframe'}
