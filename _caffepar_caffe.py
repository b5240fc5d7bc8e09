"""`import caffe` gives caffepar, unless a real pycaffe is importable.

caffepar's wheel installs `_caffepar_caffe.pth`, which calls install() when the interpreter
starts, so pycaffe scripts run as published after `pip install caffepar`; importing caffepar
calls it too. A real pycaffe is a `caffe` package whose folder holds its compiled `_caffe`
extension (a built BVLC or fork checkout's python/caffe, conda's or Debian's caffe); `import
caffe` then imports it, wherever it stands on sys.path. Anything else named caffe that Python
would find first (the unbuilt python/caffe folder beside a Caffe checkout's own scripts, a
namespace folder, a caffe.py) does not count, and caffepar takes the name.

This module runs in every interpreter of the environment: it imports nothing beyond what the
interpreter has loaded at start-up, and does its work only when `caffe` is imported."""
import os
import sys
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec, PathFinder

NAME = "caffe"


def real_caffe_spec(path=None):
    """The spec of the first real pycaffe on `path` (sys.path by default), else None."""
    for entry in sys.path if path is None else path:
        spec = PathFinder.find_spec(NAME, [entry])
        if spec is not None and is_real_caffe(spec):
            return spec
    return None


def is_real_caffe(spec):
    """True for a caffe package whose folder holds a compiled _caffe module."""
    return any(os.path.isfile(os.path.join(folder, "_caffe" + suffix))
               for folder in spec.submodule_search_locations or ()
               for suffix in EXTENSION_SUFFIXES)


def aliased():
    """True when `caffe` is caffepar in this process."""
    return getattr(sys.modules.get(NAME), "__name__", None) == "caffepar"


class _Alias:
    """Loads caffepar's module `target` under a pycaffe name: the same module object, so that
    `caffe.io is caffepar.io`. The module keeps its own __spec__."""

    def __init__(self, target):
        self.target = target
        self._spec = None

    def create_module(self, spec):
        import importlib
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec


class CaffeFinder:
    """First on sys.meta_path: `caffe` is the real pycaffe when there is one, else caffepar;
    once caffe is caffepar, `caffe.X` is caffepar.X."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == NAME:
            return real_caffe_spec() or ModuleSpec(NAME, _Alias("caffepar"), is_package=True)
        if not name.startswith(NAME + ".") or not aliased():
            return None
        import importlib.util
        ours = "caffepar" + name[len(NAME):]
        if importlib.util.find_spec(ours) is None:
            return None
        return ModuleSpec(name, _Alias(ours), is_package=True)

    @staticmethod
    def invalidate_caches():
        pass


def install():
    """Put CaffeFinder first on sys.meta_path (once)."""
    if CaffeFinder not in sys.meta_path:
        sys.meta_path.insert(0, CaffeFinder)
