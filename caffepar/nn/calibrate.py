"""Engine choice by measurement: the first time a layer shape runs on a machine, each engine
able to run it (a convolution's, or BLAS vs the compiled kernels for a small-batch
InnerProduct) is timed on random data of the layer's shape, and the fastest is kept, in memory
and in a per-user cache file (next to the compiled kernels), so later runs and other processes
pick it without measuring.

A rule tuned on one CPU is only a guess on another (a 13x13 layer, a 64-channel one, an AVX2
host with a slower BLAS, a BLAS that does not know the CPU): measuring on the machine at hand
holds everywhere. The cache file's name is a hash of everything the timing depends on -- the
CPU, the engine code, the BLAS, the kernel path -- and each entry's key holds the thread count
too.

``CAFFEPAR_CONV_ENGINES`` selects: ``measure`` (default), ``rules`` (fixed thresholds, no
timing; the test suite uses it) or a convolution engine's name (every shape it can run goes to
it; benchmarks use it).
"""
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("caffepar")

#: Timing rounds per shape (the fastest counts).
ROUNDS = 3

_LOCK = threading.RLock()
_chosen = {}            # cache file path -> {key: engine}
_measuring = threading.local()


def mode():
    return os.environ.get("CAFFEPAR_CONV_ENGINES", "measure").strip().lower() or "measure"


def _cache_file():
    from caffepar.nn import native
    setting = (native.mode(), os.environ.get("CAFFEPAR_BLAS", ""), str(native.cache_dir()))
    if setting not in _paths:
        _paths[setting] = _hashed_path(native)
    return _paths[setting]


_paths = {}     # the settings it depends on -> cache file path


def _hashed_path(native):
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for p in (sorted(here.glob("conv/*.py")) + [here / "inner_product.py", Path(__file__)]
              + native._sources()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    for part in (native._cpu_flags(), native.mode(), np.__version__,
                 os.environ.get("CAFFEPAR_BLAS", "")):
        h.update(part.encode() + b"\0")
    return native.cache_dir() / f"conv-engines-{h.hexdigest()[:20]}.json"


def _load(path):
    try:
        with open(path) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(path, key, engine):
    """Add one entry to the cache file (merged with what other processes wrote meanwhile)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".engines.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = _load(path)
            entries[key] = engine
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump(entries, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
    except OSError as e:
        log.warning("Could not save the convolution engine choice in %s: %s", path, e)


def measuring():
    """True inside a measurement (nested shapes then take their rule or cached engine)."""
    return getattr(_measuring, "on", False)


@contextlib.contextmanager
def _measurement():
    _measuring.on = True
    try:
        yield
    finally:
        _measuring.on = False


def choose(key, candidates, timing, describe):
    """The engine for a shape: cached, or the fastest of `candidates` measured now and cached;
    timing() makes run(engine), one forward + backward. `describe` names the shape in the
    log."""
    if len(candidates) == 1:
        return candidates[0]
    with _LOCK:
        path = _cache_file()
        chosen = _chosen.get(path)
        if chosen is None:
            chosen = _chosen[path] = _load(path)
        engine = chosen.get(key)
        if engine in candidates:
            return engine
        with _measurement():
            start = time.perf_counter()
            run = timing()
            # A first run of each (its first touches of buffers count against it: a slow one
            # is out anyway), then alternating rounds over the ones within 2x of the best (a
            # busy spell on a shared machine hits them alike), and a last look at the two best
            # when close.
            times = {e: _timed(run, e) for e in candidates}
            for _ in range(ROUNDS):
                best = min(times.values())
                for e in [e for e in candidates if times[e] < 2 * best]:
                    times[e] = min(times[e], _timed(run, e))
            ranked = sorted(times, key=times.get)
            if times[ranked[1]] < 1.1 * times[ranked[0]]:
                for e in ranked[:2]:
                    times[e] = min(times[e], _timed(run, e))
            engine = min(times, key=times.get)
        log.info("Convolution %s: engine %s (%s; measured once in %.1f s)", describe, engine,
                 ", ".join(f"{e} {1e3 * t:.1f} ms" for e, t in sorted(times.items(),
                                                                      key=lambda i: i[1])),
                 time.perf_counter() - start)
        chosen[key] = engine
        _save(path, key, engine)
        return engine


def _timed(run, engine):
    t0 = time.perf_counter()
    run(engine)
    return time.perf_counter() - t0
