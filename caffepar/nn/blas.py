"""GEMM written into existing (possibly strided) arrays, the one BLAS entry point of the layers.

SciPy's f2py wrappers (`scipy.linalg.blas.sgemm`) copy any operand that is not Fortran-contiguous,
and `numpy.matmul` has no beta, so big layers would make full-size temporaries. Here the Fortran
sgemm/dgemm are called through ctypes on row-major views with their leading dimensions; anything
BLAS cannot read that way falls back to NumPy.

The BLAS is the OpenBLAS that NumPy's wheels bundle when it can be found (it is newer than SciPy's
and about 1.3x faster on the thin GEMMs of small convolutions, and one library means one thread
pool), else SciPy's exported one (`scipy.linalg.cython_blas`).

The cores a process may use are its BLAS threads (`blas_threads`, set per MPI rank by
`caffepar._threads`; `_catch_up` when NumPy loaded OpenBLAS first). Layers whose work comes in
independent blocks can instead run the blocks side by side on that many Python threads
(`run_parts`), each with single-threaded GEMMs and its own work arrays (`scratch`).

BLAS splits a GEMM into one fixed share per thread, and its threads wait for one another by
spinning. When other processes keep the cores busy (`cores_contended`), a share whose thread
is descheduled holds up the rest: a GEMM then took 5-10x its fair-share time, and a small one
(a 1x1 convolution on a 7x7 map at batch 1) 100x and more. There, big GEMMs are cut into
smaller parts that whichever thread is running takes (`run_parts`), and the others run on the
calling thread alone; they round like one BLAS thread.
"""
import contextlib
import ctypes
import glob
import itertools
import logging
import math
import os
import queue
import threading
import time

import numpy as np

from caffepar import _threads

log = logging.getLogger("caffepar")


def _numpy_openblas(catch_up=False):
    """({dtype: (sgemm/dgemm, scalar type, integer type)}, (get, set) of its thread count or
    None) from NumPy's bundled OpenBLAS, or ({}, None); with catch_up, first given the settings
    it was loaded too early to read (`_catch_up`)."""
    root = os.path.dirname(np.__file__)
    paths = sorted(glob.glob(os.path.join(root + ".libs", "libscipy_openblas*"))
                   + glob.glob(os.path.join(root, ".dylibs", "libscipy_openblas*")))
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for suffix, integer in (("_64_", ctypes.c_int64), ("_", ctypes.c_int)):
            try:
                fns = [getattr(lib, f"scipy_{name}{suffix}") for name in ("sgemm", "dgemm")]
            except AttributeError:
                continue
            for fn in fns:
                fn.restype = None
            gemms = {np.dtype(np.float32): (fns[0], ctypes.c_float, integer),
                     np.dtype(np.float64): (fns[1], ctypes.c_double, integer)}
            threads = _thread_control(lib, suffix)
            if catch_up:
                _catch_up(lib, suffix, threads, _threads.missed_settings(path))
            return gemms, threads
    return {}, None


def _catch_up(lib, suffix, threads, missed):
    """Apply the settings of `caffepar._threads` that OpenBLAS missed ({variable: value}),
    NumPy having loaded it before caffepar was imported.

    Without the short thread timeout its idle workers spin for a tenth of a second after every
    threaded GEMM, taking a core from the layers' own threads (`run_parts`): cifar10_quick's
    training step took 1.5-1.8x as long on 2 cores. OpenBLAS reads the timeout when it starts its
    thread pool, so it re-reads the environment and the pool is shut down, through two entry
    points it exports for its own use (its fork handler shuts the pool down the same way); the
    next threaded GEMM starts the pool again. This runs at import, when no GEMM is in flight. A
    rank's thread count goes through the public setter. The kernels (OPENBLAS_CORETYPE) are
    chosen once, at load, and no entry point changes them safely under live threads: a warning
    says so where OpenBLAS chose other kernels than the ones asked for, as one does where the
    library cannot restart its pool."""
    if "OPENBLAS_THREAD_TIMEOUT" in missed:
        try:
            read_env, shutdown = lib.openblas_read_env, lib.blas_thread_shutdown_
        except AttributeError:
            log.warning("NumPy's OpenBLAS was loaded before caffepar, and its idle threads "
                        "spin after each GEMM; import caffepar before NumPy or run with "
                        "OPENBLAS_THREAD_TIMEOUT=4")
        else:
            read_env()
            shutdown()
    if "OPENBLAS_NUM_THREADS" in missed and threads is not None:
        threads[1](int(missed["OPENBLAS_NUM_THREADS"]))
    want = missed.get("OPENBLAS_CORETYPE")
    if want:
        chosen = "its default"
        with contextlib.suppress(AttributeError):
            corename = getattr(lib, f"scipy_openblas_get_corename{suffix.strip('_')}_")
            corename.restype, corename.argtypes = ctypes.c_char_p, []
            chosen = (corename() or b"?").decode(errors="replace")
        if chosen.lower() != want.lower():
            log.warning("NumPy's OpenBLAS was loaded before caffepar, and runs %s kernels, not "
                        "%s; import caffepar before NumPy or run with OPENBLAS_CORETYPE=%s",
                        chosen, want, want)


def _thread_control(lib, suffix):
    """(get, set) of an OpenBLAS's thread count, or None."""
    tag = suffix.strip("_")
    try:
        get = getattr(lib, f"scipy_openblas_get_num_threads{tag}_")
        put = getattr(lib, f"scipy_openblas_set_num_threads{tag}_")
    except AttributeError:
        return None
    get.restype, get.argtypes = ctypes.c_int, []
    put.restype, put.argtypes = None, [ctypes.c_int]
    return get, put


def _scipy_blas():
    """The same from SciPy's exported BLAS (whose thread count is not reachable), or ({}, None)."""
    try:
        from scipy.linalg import cython_blas
    except Exception:
        return {}, None
    get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
        ("PyCapsule_GetName", ctypes.pythonapi))
    get_ptr = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 13))
    found = {}
    for dtype, name, scalar in ((np.float32, "sgemm", ctypes.c_float),
                                (np.float64, "dgemm", ctypes.c_double)):
        try:
            capsule = cython_blas.__pyx_capi__[name]
            ptr = get_ptr(capsule, get_name(capsule))
        except Exception:
            continue
        if ptr:
            found[np.dtype(dtype)] = (proto(ptr), scalar, ctypes.c_int)
    return found, None


def _load_blas():
    if os.environ.get("CAFFEPAR_BLAS", "").lower() != "scipy":
        found = _numpy_openblas(catch_up=True)
        if found[0]:
            return found
    return _scipy_blas()


_BLAS, _THREADS = _load_blas()
_TRANS = {False: ctypes.c_char_p(b"N"), True: ctypes.c_char_p(b"T")}


def _ld(v):
    """Leading dimension of a row-major 2-D view, or 0 if BLAS cannot read it."""
    rows, cols = v.shape
    isz = v.itemsize
    if cols > 1 and v.strides[1] != isz:
        return 0
    if rows <= 1:
        return max(cols, 1)
    s0 = v.strides[0]
    if s0 <= 0 or s0 % isz:
        return 0
    ld = s0 // isz
    return ld if ld >= max(cols, 1) else 0


def gemm_views(a, b, c, trans_a=False, trans_b=False, beta=0.0):
    """c = op(a) @ op(b) + beta * c, in place, on row-major strided views."""
    m, n = c.shape
    am, k = a.shape[::-1] if trans_a else a.shape
    kb, bn = b.shape[::-1] if trans_b else b.shape
    if (am, bn, kb) != (m, n, k):
        raise ValueError(f"gemm: op(a) {am}x{k} times op(b) {kb}x{bn} cannot fill {m}x{n}")
    if m == 0 or n == 0:
        return
    if k == 0:
        if beta == 0.0:
            c[...] = 0
        return
    entry = _BLAS.get(c.dtype)
    lda, ldb, ldc = _ld(a), _ld(b), _ld(c)
    if (entry is None or not (lda and ldb and ldc)
            or a.dtype != c.dtype or b.dtype != c.dtype):
        r = np.matmul(a.T if trans_a else a, b.T if trans_b else b)
        if beta == 0.0:
            c[...] = r
        else:
            c += r
        return
    fn, scalar, ci = entry
    if not getattr(_PART, "running", False) and cores_contended():
        if m * n * k >= SPLIT_MIN_MACS and _gemm_parts(a, b, c, trans_a, trans_b, beta):
            return
        with single_threaded_blas():
            _call_gemm(fn, scalar, ci, a, b, c, m, n, k, lda, ldb, ldc, trans_a, trans_b,
                       beta)
        return
    _call_gemm(fn, scalar, ci, a, b, c, m, n, k, lda, ldb, ldc, trans_a, trans_b, beta)


def _call_gemm(fn, scalar, ci, a, b, c, m, n, k, lda, ldb, ldc, trans_a, trans_b, beta):
    # Row-major C = A B is column-major C^T = B^T A^T.
    fn(_TRANS[trans_b], _TRANS[trans_a],
       ctypes.byref(ci(n)), ctypes.byref(ci(m)), ctypes.byref(ci(k)),
       ctypes.byref(scalar(1.0)),
       ctypes.c_void_p(b.ctypes.data), ctypes.byref(ci(ldb)),
       ctypes.c_void_p(a.ctypes.data), ctypes.byref(ci(lda)),
       ctypes.byref(scalar(beta)),
       ctypes.c_void_p(c.ctypes.data), ctypes.byref(ci(ldc)))


def prepare_gemm(a, b, c, trans_a=False, trans_b=False, beta=0.0):
    """A call with no arguments running gemm_views(a, b, c, ...) on whatever the arrays hold
    then, its BLAS arguments built once (a prepared forward runs the same GEMM every pass;
    building them took several microseconds a call)."""
    m, n = c.shape
    am, k = a.shape[::-1] if trans_a else a.shape
    kb, bn = b.shape[::-1] if trans_b else b.shape
    entry = _BLAS.get(c.dtype)
    lda, ldb, ldc = _ld(a), _ld(b), _ld(c)
    if ((am, bn, kb) != (m, n, k) or not (m and n and k) or entry is None
            or not (lda and ldb and ldc) or a.dtype != c.dtype or b.dtype != c.dtype):
        return lambda: gemm_views(a, b, c, trans_a, trans_b, beta)
    fn, scalar, ci = entry
    args = (_TRANS[trans_b], _TRANS[trans_a], ctypes.byref(ci(n)), ctypes.byref(ci(m)),
            ctypes.byref(ci(k)), ctypes.byref(scalar(1.0)), ctypes.c_void_p(b.ctypes.data),
            ctypes.byref(ci(ldb)), ctypes.c_void_p(a.ctypes.data), ctypes.byref(ci(lda)),
            ctypes.byref(scalar(beta)), ctypes.c_void_p(c.ctypes.data), ctypes.byref(ci(ldc)))

    def run(a=a, b=b, c=c):     # (keeps the arrays whose addresses it passes)
        if cores_contended():
            gemm_views(a, b, c, trans_a, trans_b, beta)
        else:
            fn(*args)
    return run


def _gemm_parts(a, b, c, trans_a, trans_b, beta):
    """gemm_views cut along the longer side of c into parts of at least 64 rows or columns,
    run by `run_parts`; False (nothing done) when it would not make two parts."""
    workers = blas_threads()
    m, n = c.shape
    size = max(m, n)
    count = min(PARTS_PER_THREAD * workers, size // 64)
    if workers < 2 or count < 2:
        return False
    edges = [size * i // count // 16 * 16 for i in range(count)] + [size]
    if n >= m:
        def part(r):
            gemm_views(a, b[r[0]:r[1]] if trans_b else b[:, r[0]:r[1]], c[:, r[0]:r[1]],
                       trans_a, trans_b, beta)
    else:
        def part(r):
            gemm_views(a[:, r[0]:r[1]] if trans_a else a[r[0]:r[1]], b, c[r[0]:r[1]],
                       trans_a, trans_b, beta)
    run_parts(part, list(zip(edges, edges[1:])), workers)
    return True


def gemm(a, b, out, beta=0.0):
    """out = a @ b + beta * out, in place. Transposed views (`w.T`) are passed to BLAS as
    their base with the transpose flag, so no operand is copied."""
    trans_a = trans_b = False
    if not _ld(a) and a.ndim == 2 and _ld(a.T):
        a, trans_a = a.T, True
    if not _ld(b) and b.ndim == 2 and _ld(b.T):
        b, trans_b = b.T, True
    gemm_views(a, b, out, trans_a, trans_b, beta)
    return out


# ------------------------------------------------------------------ the cores

_THREADS_LOCK = threading.Lock()
_single_users = 0
_saved_threads = 1


def blas_threads():
    """How many threads a GEMM runs on; 1 when the BLAS's thread count cannot be set (so
    callers never split work they cannot hand to single-threaded GEMMs)."""
    if _THREADS is None:
        return 1
    with _THREADS_LOCK:
        return _saved_threads if _single_users else max(1, _THREADS[0]())


def set_blas_threads(count):
    """Run GEMMs and parts on `count` threads from now on (the commands' --threads in a
    process of their own, where the variables set at import came too late); False where the
    BLAS's thread count cannot be set."""
    global _saved_threads
    if _THREADS is None:
        return False
    with _THREADS_LOCK:
        if _single_users:
            _saved_threads = count
        else:
            _THREADS[1](count)
    return True


@contextlib.contextmanager
def single_threaded_blas():
    """GEMMs run on the calling thread only, for work split over Python threads by the caller.
    OpenBLAS's count is process-wide, so nested and concurrent users share one saved value."""
    global _single_users, _saved_threads
    if _THREADS is None:
        yield
        return
    get, put = _THREADS
    with _THREADS_LOCK:
        if not _single_users:
            _saved_threads = get()
            put(1)
        _single_users += 1
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _single_users -= 1
            if not _single_users:
                put(_saved_threads)


#: GEMMs of at least this many multiply-adds are split into parts on contended cores, ...
SPLIT_MIN_MACS = 1 << 22
#: ... this many per thread, so a thread that runs more often takes more of them.
PARTS_PER_THREAD = 4
#: The cores count as contended while the main thread waits for one at least this share of
#: the time (on a quiet machine it waits well under 1%).
CONTENDED_WAIT = 0.2


class Contention:
    """Whether other runnable threads keep this process off the cores: the share of wall time
    the process's main thread spent runnable but waiting for a core (the kernel's schedstat),
    over the last `period` seconds. Read at most once a period, so asking costs nothing.
    CAFFEPAR_CONTENDED=1 or 0 forces the answer."""

    def __init__(self, path="/proc/self/schedstat", period=0.25):
        self.path, self.period = path, period
        self.at = self.waited = None
        self.busy = False
        forced = os.environ.get("CAFFEPAR_CONTENDED", "")
        self.forced = bool(int(forced)) if forced in ("0", "1") else None

    def __call__(self, now=None):
        if self.forced is not None:
            return self.forced
        now = time.monotonic() if now is None else now
        if self.at is not None and now - self.at < self.period:
            return self.busy
        try:
            with open(self.path, "rb") as f:
                waited = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if self.at is not None:
            self.busy = waited - self.waited >= CONTENDED_WAIT * (now - self.at) * 1e9
        self.at, self.waited = now, waited
        return self.busy


cores_contended = Contention()
#: How long a thread of `run_parts` polls for its next signal (a worker for the next call's
#: parts, the caller for the workers' end) before it blocks, while the cores are not
#: contended. Waking a blocked thread costs tens of microseconds (a futex, and in a virtual
#: machine an interrupt to a halted CPU), twice a call, where small layers' parts take a few
#: hundred; half of cifar10_quick's calls come within 300 us of the one before. On contended
#: cores nothing polls: a poll would take a core from the work that would end it.
SPIN_SECONDS = 300e-6
_WORKERS = []
_RUNNING = threading.Lock()     # held while a call hands parts to the workers
_PART = threading.local()       # .running: this thread is inside a part


def _after_fork():
    """A forked child has none of the parent's threads: its workers would never run a part,
    and a call the parent's other thread was making would hold the lock for good."""
    global _RUNNING
    _WORKERS.clear()
    _RUNNING = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _sync():
    """(gate_post, gate_wait, gate_pass) of the compiled kernels, or None (polling then left out)."""
    from caffepar.errors import CaffeparError
    from caffepar.nn import native
    try:
        k = native.kernels(np.float32)
    except CaffeparError:       # no compiled kernels: the layers say why
        return None
    return None if k is None else (k.gate_post, k.gate_wait, k.gate_pass)


class _Gate:
    """A count one thread raises and one other thread waits on: polled without the GIL for
    up to a given time (the compiled gate_wait), then blocked on a queue until posted. Without
    the compiled kernels, the same protocol under a lock, never polled."""

    def __init__(self, sync):
        cells = np.zeros(16, np.int64)      # [0] signals, [1] waiter blocked, own cache line
        self.cells = cells[(-cells.ctypes.data % 64) // 8:][:2]
        self.address = self.cells.ctypes.data
        self.sync = sync
        self.lock = threading.Lock()
        self.blocked = queue.SimpleQueue()
        self.seen = 0

    def post(self):
        if self.sync is not None:
            blocked = self.sync[0](self.address)
        else:
            with self.lock:
                self.cells[0] += 1
                blocked = self.cells[1]
        if blocked:
            self.blocked.put(None)

    def _look(self, spin_ns):
        if self.sync is not None:
            return self.sync[1](self.address, self.seen, spin_ns)
        with self.lock:
            if self.cells[0] != self.seen:
                self.cells[1] = 0
                return int(self.cells[0])
            self.cells[1] = 1
            return -1

    def wait(self, spin_seconds):
        spin_ns = int(spin_seconds * 1e9)
        while True:
            count = self._look(spin_ns)
            if count >= 0:
                self.seen = count
                return
            self.blocked.get()
            spin_ns = 0

    def post_then_wait(self, other, spin_seconds):
        """other.post(), then self.wait(spin_seconds), holding no GIL in between unless
        other's waiter must be woken (the thread it wakes wants the GIL at once)."""
        if self.sync is None:
            other.post()
        else:
            count = self.sync[2](other.address, self.address, self.seen,
                                 int(spin_seconds * 1e9))
            if count >= 0:
                self.seen = count
                return
            if count == -1:         # polled in vain, marked blocked
                self.blocked.get()
                spin_seconds = 0.0
            else:                   # other's waiter blocked: nothing waited yet
                other.blocked.put(None)
        self.wait(spin_seconds)


class _Worker:
    """A thread that runs one function per call of `run_parts` (its share of the parts) and
    then waits for the next, polling for as long as the call it ended said."""

    def __init__(self, sync):
        self.job, self.done = _Gate(sync), _Gate(sync)
        self.run = self.error = None
        self.spin = 0.0
        self.thread = threading.Thread(target=self._loop, name="caffepar-part", daemon=True)
        self.thread.start()

    def _loop(self):
        self.job.wait(self.spin)
        while True:
            try:
                self.run()
            except BaseException as e:     # raised by the caller, once every part has ended
                self.error = e
            self.run = None
            self.job.post_then_wait(self.done, self.spin)

    def start(self, run, spin):
        self.run, self.spin, self.error = run, spin, None
        self.job.post()

    def join(self, spin):
        """The error its function raised, or None, once it has ended."""
        self.done.wait(spin)
        error, self.error = self.error, None
        return error


def split_parts(items, count=None):
    """items as `count` contiguous runs (at most one per item; default one per item), the
    longer runs first: threads taking runs in turn then end together (100 in 8 runs as 13,
    13, 13, 13, 12, ... gives two threads 50 each, where alternating 12s and 13s gave 48 and
    52). A range comes back as ranges, without a list of every item."""
    items = items if isinstance(items, range) else list(items)
    count = max(1, len(items) if count is None else min(count, len(items)))
    size, longer = divmod(len(items), count)
    bounds = [i * size + min(i, longer) for i in range(count + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def channel_parts(channels):
    """Channel ranges for run_parts: a few per thread, so that one slowed by other load takes
    fewer."""
    return split_parts(range(channels), min(channels, 4 * blas_threads()))


def run_parts(fn, parts, workers=None):
    """[fn(part) for part in parts], the parts handed out in order to up to `workers` (default:
    the BLAS's thread count) Python threads as each becomes free, every GEMM single-threaded.

    Thin GEMMs (a few dozen output channels) keep two cores busier this way than split inside
    BLAS, and NumPy's copies and ufuncs between them release the GIL, so they run in parallel
    too; a thread slowed by other load on the machine just takes fewer parts. fn must keep its
    scratch arrays per thread. Results come back in part order whichever thread ran them, so
    sums over them round the same way every run. A part that raises stops the hand-out and
    re-raises here once the running parts have ended. The workers are persistent threads that
    poll briefly for the next call (`SPIN_SECONDS`) on cores not contended; a call made while
    another thread's call holds them runs its parts in place."""
    workers = min(blas_threads() if workers is None else workers, len(parts))
    if (workers <= 1 or getattr(_PART, "running", False)
            or not _RUNNING.acquire(blocking=False)):
        return [fn(part) for part in parts]
    try:
        if len(_WORKERS) < workers - 1:
            sync = _sync()
            while len(_WORKERS) < workers - 1:
                _WORKERS.append(_Worker(sync))
        return _hand_out(fn, parts, _WORKERS[:workers - 1])
    finally:
        _RUNNING.release()


def _hand_out(fn, parts, pool):
    results = [None] * len(parts)
    order = itertools.count()
    failed = []

    def drain():
        _PART.running = True
        try:
            while not failed:
                i = next(order)
                if i >= len(parts):
                    return
                results[i] = fn(parts[i])
        except BaseException:
            failed.append(True)
            raise
        finally:
            _PART.running = False

    spin = 0.0 if cores_contended() else SPIN_SECONDS
    with single_threaded_blas():
        for w in pool:
            w.start(drain, spin)
        try:
            drain()
        finally:
            try:
                errors = [w.join(spin) for w in pool]
            except BaseException:       # interrupted (Ctrl-C): a worker may still be running
                for w in pool:          # this call's parts; later calls start new ones
                    _WORKERS.remove(w)
                raise
    for error in errors:
        if error is not None:
            raise error
    return results


_POOL = threading.local()
_ALL_POOLS = []


def scratch(key, shape, dtype, zero=False):
    """A reusable work array of the calling thread, one per role `key` (never returned to
    callers; its contents last until the thread's next use of the key).

    Fresh large allocations cost page faults and kernel zeroing on every call; keeping one
    buffer per role bounds the workspace and avoids that. The view of each (key, shape, dtype)
    asked for is kept too: a pass asks for the same ones every iteration, and making a view
    took a few microseconds, some 60 times a cifar10_quick step.
    """
    bufs = getattr(_POOL, "bufs", None)
    if bufs is None:
        bufs = _POOL.bufs = {}
        _POOL.views = {}
        _ALL_POOLS.extend((bufs, _POOL.views))
    views = _POOL.views
    try:
        known = views.get((key, shape, dtype))
    except TypeError:       # a shape given as a list
        shape = tuple(shape)
        known = views.get((key, shape, dtype))
    if known is not None:
        if zero:
            known.fill(0)
        return known
    dtype_ = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype_.itemsize
    raw = bufs.get(key)
    if raw is None or raw.nbytes < nbytes:
        for view in [k for k in views if k[0] == key]:
            del views[view]     # views of the buffer given up
        bufs.pop(key, None)
        raw = bufs[key] = np.empty(max(nbytes, 64), np.uint8)
    a = views[(key, shape, dtype)] = raw[:nbytes].view(dtype_).reshape(shape)
    if zero:
        a.fill(0)
    return a


def release_workspace():
    """Free the cached work arrays of every thread (call it between passes)."""
    for bufs in _ALL_POOLS:
        bufs.clear()
