"""Process-wide settings: those pycaffe scripts expect (compute mode, the random seed, the
solver count and rank), and the environment variables caffepar reads as it runs (``env``)."""
import os
import sys

import numpy as np

_state = {"rng": np.random.default_rng(), "seed": None}


def set_mode_cpu():
    """caffepar always computes on the CPU; kept so pycaffe scripts run unchanged."""


def set_mode_gpu():
    warn_caller("caffepar computes on the CPU; set_mode_gpu() is ignored")


def set_device(device_id):
    warn_caller(f"caffepar computes on the CPU; set_device({device_id!r}) is ignored")


_solvers = {"count": 1, "rank": 0}


def solver_count():
    return _solvers["count"]


def set_solver_count(count):
    """Recorded and read back, as in pycaffe, where it tells Caffe how many GPU solvers NCCL
    joins. A pycaffe process here trains as one solver: more than one is warned about."""
    count = int(count)
    if count < 1:
        raise ValueError(f"solver count must be at least 1, got {count}")
    if count > 1:
        warn_caller(f"set_solver_count({count}): a pycaffe process trains as one solver in "
                    f"caffepar; train data-parallel with `caffepar train --np {count}` (MPI)")
    _solvers["count"] = count


def solver_rank():
    return _solvers["rank"]


def set_solver_rank(rank):
    rank = int(rank)
    if rank < 0:
        raise ValueError(f"solver rank must be at least 0, got {rank}")
    _solvers["rank"] = rank


def set_multiprocess(flag):
    """Kept so pycaffe scripts run: it tells Caffe that each GPU solver is a process of its
    own, and a pycaffe process here is one solver."""


def warn_caller(message, category=UserWarning):
    """warnings.warn naming the first line outside caffepar: the script's call, wherever in
    caffepar the warning is decided."""
    import warnings
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def set_random_seed(seed):
    """Seed every random draw caffepar makes (fillers, dropout, data shuffling)."""
    _state["seed"] = int(seed)
    _state["rng"] = np.random.default_rng(int(seed))


def rng():
    return _state["rng"]


_fresh = {"seed": None}


def run_seed():
    """The seed set by set_random_seed, else one drawn from the OS once per process."""
    if _state["seed"] is not None:
        return _state["seed"]
    if _fresh["seed"] is None:
        _fresh["seed"] = int(np.random.SeedSequence().entropy % (1 << 63))
    return _fresh["seed"]


def seed_for(name):
    """A stable per-consumer seed (e.g. a data layer's name) derived from the run's seed, so
    random choices are reproducible across processes without a shared global RNG."""
    import zlib
    return (int(run_seed()) % (1 << 63)) * (1 << 32) + zlib.crc32(str(name).encode())


def env(name, default=None):
    """os.environ.get(name, default), read without os.environ's Python frames where the
    platform keeps the environment in os.environ's byte dictionary (POSIX): the kernels and
    engine lookups read their settings at every call, so that a script or test may change them
    at any time, about 70 times in a cifar10_quick step, where os.environ.get took 2 us each
    warm and several times that between the step's large array passes."""
    raw = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(raw, dict):
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = name.encode(_ENCODING, "surrogateescape")
    value = raw.get(key)
    return default if value is None else value.decode(_ENCODING, "surrogateescape")


_KEYS = {}      # a variable's name -> its bytes in os.environ's byte dictionary


_ENCODING = sys.getfilesystemencoding()
