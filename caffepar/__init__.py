"""caffepar: Caffe-compatible training in Python. `import caffepar as caffe` gives pycaffe's API.

Unless a real pycaffe is installed (see _caffepar_caffe), `import caffe` gives caffepar too, and
caffe.proto, caffe.io, caffe._caffe, ... name caffepar's modules, so pycaffe scripts and Python
layer modules run unchanged."""
__version__ = "0.1.0"
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
from caffepar.pycaffe import (NCCL, Timer, has_nccl, init_log, log, set_multiprocess,
                              set_solver_count, set_solver_rank, solver_count, solver_rank)
from caffepar.net_spec import NetSpec, layers, params, to_proto
from caffepar.classifier import Classifier
from caffepar.detector import Detector
from caffepar import _caffe, coord_map, draw, pycaffe  # noqa: E402  (caffe._caffe, caffe.draw)

try:
    import _caffepar_caffe  # noqa: F401  (installed beside the package by pip)
except ImportError:         # caffepar run from a source tree: `import caffe` is left alone
    pass
else:
    if not pycaffe.real_caffe_installed():
        pycaffe.install_as_caffe()

__all__ = ["Net", "Layer", "TRAIN", "TEST", "io", "proto", "layer_type_list", "set_mode_cpu",
           "set_mode_gpu", "set_device", "set_random_seed", "__version__",
           "Solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
           "AdaDeltaSolver", "AdamSolver", "get_solver", "NetSpec", "layers", "params",
           "to_proto", "Classifier", "Detector", "coord_map", "draw", "init_log", "log", "Timer",
           "NCCL", "has_nccl", "solver_count", "set_solver_count", "solver_rank",
           "set_solver_rank", "set_multiprocess"]
