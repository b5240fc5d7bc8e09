"""pycaffe's Python API over caffepar, so scripts run after `import caffepar as caffe`."""
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
           "layer_type_list", "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed"]


class Net(_net.Net):
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
        super().__init__(model, phase=phase, level=level, stages=tuple(stages), weights=weights,
                         dtype=dtype)

    def set_input_arrays(self, data, labels):
        """Feed arrays to the net's first MemoryData layer, with pycaffe's checks. The layer
        keeps references to the arrays (no copy), as pycaffe does."""
        layer = next((l for l in self.layers if l.type == "MemoryData"), None)
        if layer is None:
            raise NetError("set_input_arrays may only be called if the net has a MemoryData layer")
        labels = np.asarray(labels) if not isinstance(labels, np.ndarray) else labels
        if labels.ndim == 1:
            labels = np.ascontiguousarray(labels[:, None, None, None])
        for name, arr, dims in (("data array", data, (layer.channels, layer.height, layer.width)),
                                ("labels array", labels, (1, 1, 1))):
            if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
                raise NetError(f"{name} must be C contiguous")
            if arr.ndim != 4:
                raise NetError(f"{name} must be 4-d")
            if arr.dtype != np.float32:
                raise NetError(f"{name} must be float32")
            for axis, what in zip(range(1, 4), ("number of channels", "height", "width")):
                if arr.shape[axis] != dims[axis - 1]:
                    raise NetError(f"{name} has wrong {what}")
        if data.shape[0] != labels.shape[0]:
            raise NetError("data and labels must have the same first dimension")
        if data.shape[0] % layer.batch_size:
            raise NetError("first dimensions of input arrays must be a multiple of batch size")
        layer.reset(data, labels, data.shape[0])

    def forward_all(self, blobs=None, **kwargs):
        """Forward inputs of any length in the net's batch size; outputs concatenated."""
        outs = {name: [] for name in set(self.outputs) | set(blobs or ())}
        if not kwargs:
            for name, value in self.forward(blobs=blobs).items():
                outs[name].append(value.copy())
        else:
            total = len(next(iter(kwargs.values())))
            batch = self.blobs[next(iter(kwargs))].shape[0]
            for start in range(0, total, batch):
                chunk = {}
                for name, value in kwargs.items():
                    part = np.asarray(value[start:start + batch])
                    if len(part) < batch:
                        pad = np.zeros((batch - len(part),) + part.shape[1:], part.dtype)
                        part = np.concatenate([part, pad])
                    chunk[name] = part
                n = min(batch, total - start)
                for name, value in self.forward(blobs=blobs, **chunk).items():
                    outs[name].append(value[:n].copy())
        return {name: np.concatenate(parts) if parts and parts[0].ndim else np.asarray(parts)
                for name, parts in outs.items()}


def layer_type_list():
    from caffepar.nn import LAYERS
    return sorted(LAYERS)


