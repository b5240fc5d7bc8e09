"""pycaffe's Python API over caffepar, so scripts run after `import caffepar as caffe`.

The net API itself (blobs, params, forward/backward, forward_all, set_input_arrays, ...) lives on
caffepar.graph.net.Net, so nets a solver makes have it too; this module adds pycaffe's
constructor forms and the names pycaffe exports."""
import sys
import time

import numpy as np

from caffepar import common
from caffepar.errors import CaffeparError, NetError
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
solver_count = common.solver_count
set_solver_count = common.set_solver_count
solver_rank = common.solver_rank
set_solver_rank = common.set_solver_rank
set_multiprocess = common.set_multiprocess

__all__ = ["Net", "Layer", "TRAIN", "TEST", "Solver", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver", "get_solver",
           "layer_type_list", "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed",
           "init_log", "log", "Timer", "NCCL", "has_nccl", "solver_count", "set_solver_count",
           "solver_rank", "set_solver_rank", "set_multiprocess", "install_as_caffe"]


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


def init_log(level=None, stderr=True):
    """pycaffe's init_log([level[, stderr]]): caffepar's log, glog-formatted, on stderr from
    `level` up (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL: glog's minloglevel, by default its
    GLOG_minloglevel variable, else 0). glog writes to files in its log folder unless told
    stderr; caffepar writes to stderr either way."""
    import logging
    from caffepar.logs import LOGGER, setup_logging
    levels = (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
    if level is None:
        level = common.env("GLOG_minloglevel", "0")
    if str(level).strip() not in ("0", "1", "2", "3"):
        raise ValueError(f"log level must be 0 (INFO) to 3 (FATAL), got {level!r}")
    setup_logging()
    LOGGER.setLevel(levels[int(level)])


def log(message):
    """pycaffe's log(s): one INFO line of caffepar's log naming the caller's file and line; on
    stderr before any init_log, as glog's lines are before InitGoogleLogging."""
    from caffepar.logs import LOGGER
    if not LOGGER.handlers:
        init_log()
    LOGGER.info("%s", message, stacklevel=2)


class Timer:
    """pycaffe's Timer: start(), stop(), and `ms`, the milliseconds from the last start to the
    last stop (reading `ms` stops a running timer, as Caffe's does)."""

    def __init__(self):
        self._start = self._stop = None

    def start(self):
        self._start, self._stop = time.perf_counter(), None

    def stop(self):
        if self._start is not None and self._stop is None:
            self._stop = time.perf_counter()

    @property
    def ms(self):
        if self._start is None:
            return 0.0
        self.stop()
        return (self._stop - self._start) * 1e3


def has_nccl():
    """False: caffepar computes on CPUs, and reduces gradients over MPI, not NCCL."""
    return False


class NCCL:
    """pycaffe's multi-GPU gradient reduction. caffepar has no GPUs: data-parallel training is
    `caffepar train --np N` (MPI). Every use says so."""

    MESSAGE = ("caffe.NCCL is multi-GPU training, which caffepar does not have (caffe.has_nccl() "
               "is False); train data-parallel with `caffepar train --solver S --np N` (MPI)")

    def __init__(self, *args, **kwargs):
        raise CaffeparError(self.MESSAGE)

    @staticmethod
    def new_uid():
        raise CaffeparError(NCCL.MESSAGE)


def real_caffe_installed():
    """True when `import caffe` gives a real pycaffe (a caffe package with its compiled
    _caffe), or a module named caffe that is not caffepar was imported already."""
    import _caffepar_caffe
    if "caffe" in sys.modules:
        return not _caffepar_caffe.aliased()
    return _caffepar_caffe.real_caffe_spec() is not None


def install_as_caffe():
    """Make `import caffe` (and caffe.proto.caffe_pb2, caffe.draw, ...) give caffepar's
    modules in this process, for code written against pycaffe. Refused when a module named
    caffe is already imported."""
    import caffepar
    import _caffepar_caffe
    current = sys.modules.get("caffe")
    if current is not None and current is not caffepar:
        raise ImportError(f"a module named caffe is already imported ({current!r})")
    sys.modules["caffe"] = caffepar
    _caffepar_caffe.install()
