"""Caffe's `Python` layer: a user class (pycaffe's `caffe.Layer` subclass) named by
python_param { module layer param_str }, called with Caffe's setup/reshape/forward/backward."""
import importlib
import sys

from caffepar.nn.base import Layer, register


class PythonLayerBase:
    """What user layers subclass as `caffe.Layer`; caffepar fills in `param_str`, `phase`,
    `blobs` before calling `setup`."""

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass


@register("Python")
class PythonLayer(Layer):
    def layer_setup(self, bottom, top):
        p = self.param.python_param
        if not p.module or not p.layer:
            raise self.error("python_param needs both module and layer")
        folder = getattr(self, "net_dir", None)
        if folder and folder not in sys.path:
            sys.path.append(folder)
        try:
            module = importlib.import_module(p.module)
        except ImportError as e:
            raise self.error(f'cannot import python module "{p.module}": {e}') from e
        except Exception as e:      # the module's own code failed (--debug shows where)
            raise self.error(f'python module "{p.module}" (class "{p.layer}") failed to import: '
                             f'{type(e).__name__}: {e}') from e
        cls = getattr(module, p.layer, None)
        if cls is None:
            raise self.error(f'module "{p.module}" has no class "{p.layer}"')
        self.user = cls()
        self.user.param_str = p.param_str
        self.user.phase = self.phase
        self.user.blobs = self.blobs
        self.user.setup(bottom, top)

    def __getattr__(self, name):
        """The user object's own (public) attributes, as pycaffe's `net.layers[i]` is that
        object."""
        user = self.__dict__.get("user")
        if user is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(user, name)

    def reshape(self, bottom, top):
        self.user.reshape(bottom, top)

    def forward(self, bottom, top):
        self.user.blobs = self.blobs
        self.user.forward(bottom, top)

    def backward(self, top, propagate_down, bottom):
        self.user.blobs = self.blobs
        self.user.backward(top, propagate_down, bottom)
