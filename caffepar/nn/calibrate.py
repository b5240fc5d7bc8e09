"""Engine choice by measurement: the first time a layer shape runs on a machine, each engine
able to run it (a convolution's, or BLAS vs the compiled kernels for a small-batch
InnerProduct) is timed on random data of the layer's shape, and the fastest is kept, in memory
and in a per-user cache file (next to the compiled kernels), so later runs and other processes
pick it without measuring.

A rule tuned on one CPU is only a guess on another (a 13x13 layer, a 64-channel one, an AVX2
host with a slower BLAS, a BLAS that does not know the CPU): measuring on the machine at hand
holds everywhere. The cache file's name is a hash of everything the timing depends on -- the
CPU model and its features, the engine code and the flags the kernels are built with, the BLAS,
the kernel path -- and each entry's key holds the thread count too.

Each pass is chosen on its own -- a layer's forward, and its backward (the gradients it
computes: dw and db, and dx when the bottom wants it) -- since the engine fastest for one is
often not the fastest for the other, and no engine's backward uses what its forward left.

A choice must hold between runs: when two engines come out close, they are timed again in
alternating rounds until one is clearly ahead (by CLEAR) or the rounds run out; then a tie
(within TIE) goes to the one listed first, whichever happened to be faster this time. Each entry
keeps the times it was chosen on, which `caffepar time --engines` prints.

No pathological engine: a busy machine (other processes on the cores) once made one
measurement keep a path 100x slower than the best for good (MobileNet v2's conv2_1/expand:
90-228 ms in use against 0.8 ms on the right engine). So each timing run reads how long the
process's threads waited for a core meanwhile (the kernel's schedstat); a run that waited
DISTURBED of its time or more is run again (RETRIES; not while the cores stay contended, when
runs again would fare alike), and a choice some of whose timings stayed disturbed is provisional: kept in memory, not in the cache file, and measured again once the
cores are quiet (at most REMEASURES times), and meanwhile the fixed rules' engine is kept unless
the measured winner beat it by FALLBACK_MARGIN. A choice in use is also watched (``observe``): a
pass that takes STRAY times what its engine measured, STRAY_RUNS times in a row on cores that
are not contended, is measured again.

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

from caffepar.common import env

log = logging.getLogger("caffepar")

#: Timing rounds per shape (the fastest counts).
ROUNDS = 3
#: The runner-up this much slower (best times): the choice is clear.
CLEAR = 0.05
#: More alternating rounds of the two best, at most, while the choice is not clear.
MORE_ROUNDS = 8
#: The two best this close after all rounds: a tie, settled by the candidates' order.
TIE = 0.03

#: A timing run whose threads waited for a core this share of its wall time was disturbed ...
DISTURBED = 0.1
#: ... and is run again, this many times at most.
RETRIES = 3
#: A pass in use this many times slower than its engine measured ...
STRAY = 8.0
#: ... this many times in a row, on cores not contended, has its engine measured again.
STRAY_RUNS = 3
#: Where timing runs stayed disturbed, a winner must be this many times faster than the fixed
#: rules' engine to be chosen over it (the second engine the noisy measurement is checked
#: against: a busy spell once made the grid engine win a depthwise layer it runs 10x slower).
FALLBACK_MARGIN = 2.0
#: Measurements of one shape again (disturbed or strayed), at most, per process.
REMEASURES = 2

_LOCK = threading.RLock()
_chosen = {}            # cache file path -> {key: engine}
_measuring = threading.local()
_measured = [0]         # choices measured in this process


def mode():
    return env("CAFFEPAR_CONV_ENGINES", "measure").strip().lower() or "measure"


def _cache_file():
    from caffepar.nn import native
    setting = tuple(env(name) for name in _SETTINGS)
    if setting not in _paths:
        _paths[setting] = _hashed_path(native)
    return _paths[setting]


#: The settings the cache file's path depends on: the kernel mode and flags, the BLAS and
#: where the cache is (read at every layer's lookup; resolving the folder costs system calls).
_SETTINGS = ("CAFFEPAR_KERNELS", "CAFFEPAR_CFLAGS", "CAFFEPAR_BLAS", "CAFFEPAR_CACHE_DIR",
             "XDG_CACHE_HOME", "HOME")
_paths = {}     # the settings it depends on -> cache file path


def _hashed_path(native):
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for p in (sorted(here.glob("conv/*.py")) + [here / "inner_product.py", Path(__file__)]
              + native._sources()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    for part in (native.cpu_model(), native._cpu_flags(), " ".join(native.flags()),
                 native.mode(), np.__version__, os.environ.get("CAFFEPAR_BLAS", "")):
        h.update(part.encode() + b"\0")
    return native.cache_dir() / f"conv-engines-{h.hexdigest()[:20]}.json"


def _load(path):
    try:
        with open(path) as f:
            found = json.load(f)
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(path, key, entry):
    """Add one entry to the cache file (merged with what other processes wrote meanwhile)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / ".engines.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = _load(path)
            entries[key] = entry
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                json.dump(entries, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
    except OSError as e:
        log.warning("Could not save the convolution engine choice in %s: %s", path, e)


def measuring():
    """True inside a measurement (nested shapes then take their rule or cached engine)."""
    return getattr(_measuring, "on", False)


def measured():
    """How many choices this process has measured (not found in the cache)."""
    return _measured[0]


@contextlib.contextmanager
def _measurement():
    _measuring.on = True
    try:
        yield
    finally:
        _measuring.on = False


def backward_pass(need_dx, need_dw):
    """The name of the backward pass a layer runs (its cache keys end in it): "backward" (dw
    and dx), "backward no dx" (a bottom that wants no diff) or "backward dx" (frozen weights,
    a Deconvolution's forward)."""
    if need_dx and need_dw:
        return "backward"
    return "backward dx" if need_dx else "backward no dx"


def _entry(chosen, key, candidates):
    entry = chosen.get(key)
    if isinstance(entry, str):          # written before the times were kept
        entry = {"engine": entry, "ms": {}}
    if isinstance(entry, dict) and entry.get("engine") in candidates:
        return entry
    return None


def _chosen_in(path):
    chosen = _chosen.get(path)
    if chosen is None:
        chosen = _chosen[path] = _load(path)
    return chosen


def cached(key, candidates):
    """The engine chosen for `key` before, without measuring, or None."""
    with _LOCK:
        entry = _entry(_chosen_in(_cache_file()), key, candidates)
    return None if entry is None else entry["engine"]


def choose(key, candidates, timing, describe, fallback=None):
    """The engine for a shape's pass: cached, or the fastest of `candidates` measured now and
    cached; timing() makes run(engine), that one pass (it may look up or measure the passes
    it runs inside it first). `describe` names the shape in the log. `fallback`, an engine
    of the candidates (the fixed rules' choice), is kept over a measured winner less than
    FALLBACK_MARGIN times faster where timing runs stayed disturbed."""
    if len(candidates) == 1:
        _last.entry = {"engine": candidates[0], "ms": {}}
        return candidates[0]
    with _LOCK:
        path = _cache_file()
        chosen = _chosen_in(path)
        entry = _entry(chosen, key, candidates)
        if entry is not None and not (entry.get("disturbed") and _remeasure_now(key)):
            _last.entry = entry
            return entry["engine"]
        run = timing()
        start = time.perf_counter()
        _disturbed.count = 0
        with _measurement():
            times = _measure(run, candidates)
        # The work arrays every candidate left behind: only the chosen one's come back.
        from caffepar.nn.blas import release_workspace
        release_workspace()
        _measured[0] += 1
        engine = _pick(times, candidates)
        if (_disturbed.count and fallback in times and engine != fallback
                and times[engine] * FALLBACK_MARGIN > times[fallback]):
            engine = fallback       # the busy spell may have fallen on the fallback's runs
        log.info("Convolution %s: engine %s (%s; measured once in %.1f s)", describe, engine,
                 ", ".join(f"{e} {1e3 * t:.1f} ms" for e, t in sorted(times.items(),
                                                                      key=lambda i: i[1])),
                 time.perf_counter() - start)
        entry = {"engine": engine, "ms": {e: round(1e3 * t, 3) for e, t in times.items()}}
        if _disturbed.count:
            entry["disturbed"] = _disturbed.count
            log.info("Convolution %s: %d timing runs disturbed by other load; the choice is "
                     "provisional and will be measured again on quiet cores", describe,
                     _disturbed.count)
        chosen[key] = _last.entry = entry
        _watch[key] = [times[engine], 0, _watch.get(key, [0, 0, 0])[2]]
        if not entry.get("disturbed"):
            _save(path, key, entry)
        return engine


def _remeasure_now(key):
    """Whether a provisional (disturbed) choice is measured again now: the cores are quiet and
    the shape has not been measured again too often."""
    from caffepar.nn.blas import cores_contended
    watch = _watch.setdefault(key, [0, 0, 0])
    if watch[2] >= REMEASURES or cores_contended():
        return False
    watch[2] += 1
    return True


_watch = {}     # key -> [measured seconds of the chosen engine, strays in a row, re-measures]


def watched_seconds(key):
    """What the choice `key` measured (its engine's seconds), or 0 when it is not watched."""
    watch = _watch.get(key)
    return watch[0] if watch else 0.0


def observe(key, seconds):
    """A pass of the shape `key` took `seconds` in use: after STRAY_RUNS passes in a row
    STRAY times slower than its engine measured, on cores not contended, its choice is dropped
    (measured again at its next lookup). Returns True when it was dropped."""
    watch = _watch.get(key)
    if watch is None or not watch[0]:
        return False
    if seconds < STRAY * watch[0]:
        watch[1] = 0
        return False
    from caffepar.nn.blas import cores_contended
    if watch[2] >= REMEASURES or cores_contended():     # a busy spell does not count
        return False
    watch[1] += 1
    if watch[1] < STRAY_RUNS:
        return False
    watch[1] = 0
    with _LOCK:
        entry = _chosen_in(_cache_file()).get(key)
        if isinstance(entry, dict):
            entry["disturbed"] = entry.get("disturbed", 0) or 1
    log.info("Convolution %s: %.2f ms in use, %.0fx what its engine measured: measuring "
             "again", key, 1e3 * seconds, seconds / watch[0])
    return True


def _measure(run, candidates):
    """{engine: fastest seconds}: a first run of each (its first touches of buffers count
    against it: a slow one is out anyway), alternating rounds over the ones within 2x of the
    best (a busy spell on a shared machine hits them alike), then more rounds of the two best
    while they are close."""
    times = {e: _timed(run, e) for e in candidates}
    for _ in range(ROUNDS):
        best = min(times.values())
        for e in [e for e in candidates if times[e] < 2 * best]:
            times[e] = min(times[e], _timed(run, e))
    for _ in range(MORE_ROUNDS):
        first, second = sorted(times, key=times.get)[:2]
        if times[second] >= (1 + CLEAR) * times[first]:
            break
        for e in (first, second):
            times[e] = min(times[e], _timed(run, e))
    return times


def _pick(times, candidates):
    """The fastest, or of two within TIE the one first in `candidates`."""
    first, second = sorted(times, key=times.get)[:2]
    if times[second] < (1 + TIE) * times[first]:
        return min((first, second), key=candidates.index)
    return first


_last = threading.local()       # .entry: the last choice looked up in this thread


def last_choice(clear=False):
    """The last choice made or looked up in this thread: {"engine", "ms": {engine: ms}} (ms
    empty when there was nothing to choose from or the entry predates them), or None; with
    clear, forget it afterwards."""
    entry = getattr(_last, "entry", None)
    if clear:
        _last.entry = None
    return entry


def with_entry(lookup):
    """(engine, entry) of one lookup(): the engine it returns and the measured choice behind
    it, or None for the entry when nothing was measured (forced, rules, one engine able)."""
    last_choice(clear=True)
    engine = lookup()
    entry = last_choice(clear=True)
    if not (entry and entry.get("engine") == engine and entry.get("ms")):
        entry = None
    return engine, entry


def describe(choices):
    """A layer's engines ({pass: (engine, entry)}) in words: the one engine when its passes
    share it, else each pass's ("forward direct, backward im2col")."""
    engines = {part: engine for part, (engine, _) in choices.items()}
    if len(set(engines.values())) == 1:
        return next(iter(engines.values()))
    return ", ".join(f"{part} {engine}" for part, engine in engines.items())


def margin(entry):
    """How the chosen engine won: (runner-up, runner-up's ms / chosen's) or None."""
    ms = dict(entry.get("ms") or {})
    chosen = ms.pop(entry["engine"], None)
    if not ms or not chosen:
        return None
    runner = min(ms, key=ms.get)
    return runner, ms[runner] / chosen


def random_array(rng, shape, dtype, scale=1.0):
    """Normal draws of `dtype` for a timing run, drawn in that type (no float64 array twice
    the size on the way)."""
    dtype = np.dtype(dtype)
    if dtype in (np.float32, np.float64):
        a = rng.standard_normal(shape, dtype=dtype)
    else:
        a = rng.standard_normal(shape).astype(dtype)
    if scale != 1.0:
        a *= dtype.type(scale)
    return a


def written_array(shape, dtype):
    """An output array for a timing run, every page of it written: np.empty and np.zeros map
    fresh pages lazily, and the engine timed first paid for their first touch (on a virtual
    machine, 25 MB of output cost the depthwise engine, first of the candidates, 10-30 ms, and
    its place on MobileNet v2's conv2_1/dwise to an engine 3x slower in use)."""
    a = np.empty(shape, dtype)
    a.fill(0)
    return a


_disturbed = threading.local()      # .count: timing runs that stayed disturbed


def _waited():
    """Seconds this process's threads have spent runnable but waiting for a core (schedstat's
    run delay, summed over the threads); None where the kernel does not say."""
    total = 0
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total * 1e-9


def _timed(run, engine):
    """Seconds of one run of `engine`: run again (RETRIES times at most) while the process's
    threads waited for a core DISTURBED of the time or more; the fastest run counts, and a
    timing whose every run was disturbed is counted in _disturbed.count. CAFFEPAR_CONTENDED
    (blas.Contention), when set, says whether runs are disturbed in place of the kernel."""
    from caffepar.nn.blas import cores_contended
    forced = cores_contended.forced
    if forced is not None:
        t0 = time.perf_counter()
        run(engine)
        if forced:
            _disturbed.count = getattr(_disturbed, "count", 0) + 1
        return time.perf_counter() - t0
    best = None
    for attempt in range(RETRIES + 1):
        w0 = _waited()
        t0 = time.perf_counter()
        run(engine)
        wall = time.perf_counter() - t0
        w1 = _waited()
        best = wall if best is None else min(best, wall)
        if w0 is None or w1 is None or w1 - w0 < DISTURBED * wall:
            return best
        if attempt == 0 and cores_contended():
            break       # a lasting load, not a spell: runs again would be disturbed alike
    _disturbed.count = getattr(_disturbed, "count", 0) + 1
    return best
