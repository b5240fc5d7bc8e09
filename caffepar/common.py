"""Process-wide settings pycaffe scripts expect: compute mode and the random seed."""
import numpy as np

_state = {"rng": np.random.default_rng(), "seed": None}


def set_mode_cpu():
    """caffepar always computes on the CPU; kept so pycaffe scripts run unchanged."""


def set_mode_gpu():
    import warnings
    warnings.warn("caffepar computes on the CPU; set_mode_gpu() is ignored", stacklevel=2)


def set_device(device_id):
    set_mode_gpu()


def set_random_seed(seed):
    """Seed every random draw caffepar makes (fillers, dropout, data shuffling)."""
    _state["seed"] = int(seed)
    _state["rng"] = np.random.default_rng(int(seed))


def rng():
    return _state["rng"]
