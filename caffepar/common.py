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
