"""pycaffe's Python API over caffepar, so scripts run after `import caffepar as caffe`.

The net API itself (blobs, params, forward/backward, forward_all, set_input_arrays, ...) lives on
caffepar.graph.net.Net, so nets a solver makes have it too; this module adds pycaffe's
constructor forms and the names pycaffe exports."""
import sys

import numpy as np

from caffepar import common
from caffepar.errors import NetError
from caffepar.graph import net as _net
from caffepar.nn.python_layer import PythonLayerBase as Layer
from caffepar.solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,
                              RMSPropSolver, SGDSolver, Solver, get_solver)

TRAIN = _net.TRAIN
TEST = _net.TEST
set_mode_cpu = common.set_mode_cpu
set_mode_gpu = common.set_mode_gpu
set_device = common.set_device
set_random_seed = common.set_random_seed

__all__ = ["Net", "Layer", "TRAIN", "TEST", "Solver", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver",
           "layer_type_list", "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed",
           "install_as_caffe"]


class _NetType(type):
    """Every caffepar net (a solver's too) is a `caffe.Net`, as in pycaffe."""

    def __instancecheck__(cls, obj):
        if cls is Net:
            return isinstance(obj, _net.Net)
        return super().__instancecheck__(obj)


class Net(_net.Net, metaclass=_NetType):
    """pycaffe's constructor forms:
    Net(model, phase), Net(model, weights, phase), Net(model, phase, weights=..., level=, stages=)."""

    def __init__(self, model, *args, phase=None, weights=None, level=0, stages=(),
                 dtype=np.float32):
        args = list(args)
        if args and isinstance(args[0], (str, bytes)) or (args and hasattr(args[0], "__fspath__")):
            if weights is not None:
                raise NetError("weights given twice (positional and keyword)")
            weights = args.pop(0)
        if args:
            if phase is not None:
                raise NetError("phase given twice (positional and keyword)")
            phase = args.pop(0)
        if args:
            raise NetError(f"unexpected arguments to Net: {args!r}")
        if phase is None:
            raise NetError("Net needs a phase: caffe.TRAIN or caffe.TEST")
        if phase not in (TRAIN, TEST):
            raise NetError(f"phase must be caffe.TRAIN ({TRAIN}) or caffe.TEST ({TEST}), got {phase!r}")
        super().__init__(model, phase=phase, level=level, stages=tuple(stages or ()),
                         weights=weights, dtype=dtype)


def layer_type_list():
    from caffepar.nn import LAYERS
    return sorted(LAYERS)


# pycaffe's modules, by the name scripts import them under.
_CAFFE_MODULES = {
    "caffe": "caffepar",
    "caffe.proto": "caffepar.proto",
    "caffe.proto.caffe_pb2": "caffepar.proto.caffe_pb2",
    "caffe.pycaffe": "caffepar.pycaffe",
    "caffe.io": "caffepar.io",
    "caffe.net_spec": "caffepar.net_spec",
    "caffe.draw": "caffepar.draw",
    "caffe.coord_map": "caffepar.coord_map",
    "caffe.classifier": "caffepar.classifier",
    "caffe.detector": "caffepar.detector",
}


def real_caffe_installed():
    """True when `import caffe` would find a module of its own (a namespace folder named
    caffe, such as a Caffe checkout's root, does not count)."""
    import importlib.util
    current = sys.modules.get("caffe")
    if current is not None:
        return getattr(current, "__name__", None) != "caffepar"
    spec = importlib.util.find_spec("caffe")
    return spec is not None and spec.origin not in (None, "namespace")


def install_as_caffe():
    """Make `import caffe` (and caffe.proto.caffe_pb2, caffe.draw, ...) give caffepar's
    modules in this process, for code written against pycaffe. Refused when a real Caffe is
    already imported."""
    import importlib
    current = sys.modules.get("caffe")
    if current is not None and getattr(current, "__name__", None) != "caffepar":
        raise ImportError(f"a module named caffe is already imported ({current!r})")
    for alias, name in _CAFFE_MODULES.items():
        sys.modules[alias] = importlib.import_module(name)
