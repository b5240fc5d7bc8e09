"""caffepar: Caffe-compatible training in Python. `import caffepar as caffe` gives pycaffe's API.

Unless a real Caffe is installed, importing caffepar also makes `caffe` (and caffe.proto,
caffe.draw, ...) name caffepar's modules, so `from caffe import layers as L` and Python layer
modules that `import caffe` work unchanged."""
from caffepar import _signals
_signals.hold()     # the command notes signals until it can act on them (see _signals)
if _signals.is_command():
    from caffepar.parallel.supervise import supervise
    supervise()     # a rank of a job runs under a parent that reports its death by a signal
from caffepar import _threads  # noqa: E402,F401  (must run before NumPy loads BLAS)
from caffepar import io, proto
from caffepar.pycaffe import (TEST, TRAIN, Layer, Net, layer_type_list, set_device, set_mode_cpu,
                              set_mode_gpu, set_random_seed)
from caffepar.pycaffe import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,
                              RMSPropSolver, SGDSolver, Solver, get_solver)
from caffepar.net_spec import NetSpec, layers, params, to_proto
from caffepar.classifier import Classifier
from caffepar.detector import Detector
from caffepar import coord_map, draw, pycaffe  # noqa: E402  (caffe.coord_map, caffe.draw)

__version__ = "0.1.0"

if not pycaffe.real_caffe_installed():
    pycaffe.install_as_caffe()

__all__ = ["Net", "Layer", "TRAIN", "TEST", "io", "proto", "layer_type_list", "set_mode_cpu",
           "set_mode_gpu", "set_device", "set_random_seed", "__version__",
           "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
           "AdaDeltaSolver", "AdamSolver", "get_solver", "NetSpec", "layers", "params",
           "to_proto", "Classifier", "Detector", "coord_map", "draw"]
