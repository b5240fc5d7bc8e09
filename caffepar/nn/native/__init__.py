"""Compiled kernels for the work BLAS does not do (or does poorly): pooling, LRN, ReLU's
backward and Dropout, the direct convolution engine, the Winograd transforms, Caffe's Im2col
layer, InnerProduct on a small batch and the solver update; and the polling waits between
``blas.run_parts``'s threads (sync.inc).

They are C (``*.c`` beside this file), compiled on first use by the machine's C compiler with
``-O3 -march=native`` -- code for this CPU's own instruction set (AVX2, AVX-512, ...) -- into a
per-user cache (``$CAFFEPAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/caffepar`` or
``~/.cache/caffepar``). The library's name is a hash of the sources, the compiler and the CPU's
feature flags, so an upgrade or another CPU sharing a home directory builds its own, and every
later run (and every MPI rank) loads the built one; a lock makes concurrent first runs build
once. Loaded through ctypes, which releases the GIL during a call, so ``blas.run_parts`` runs
kernels on a block each side by side, as it does the GEMMs.

``CAFFEPAR_KERNELS`` selects the path: ``auto`` (default: compiled, or the NumPy code with one
warning when no compiler works), ``native`` (compiled or an error) or ``numpy``;
``CAFFEPAR_CFLAGS`` adds compiler flags. Pooling, LRN, ReLU, Dropout, Im2col and the solver
update compute exactly what the NumPy code computes, operation by operation and in the same
order (``-ffp-contract=off`` keeps the compiler from fusing multiply-adds); the convolution
kernels sum in their own order, as every engine does.
"""
import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from caffepar.common import env
from caffepar.errors import CaffeparError

log = logging.getLogger("caffepar")

MODES = ("auto", "native", "numpy")
SOURCES = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
         "-fPIC", "-shared", "-std=c11"]
SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}

# name: argument kinds, p = pointer, i = int64, d = double. Every kernel exists once per dtype
# (name_f32, name_f64) and returns an int64.
SIGNATURES = {
    "max_pool_forward": "ppp" + "i" * 14,
    "max_pool_backward": "ppp" + "i" * 14,
    "ave_pool_forward": "pp" + "i" * 13,
    "ave_pool_backward": "pp" + "i" * 13,
    "solver_update": "ppppiiddidddd",
    "lrn_forward": "ppppp" + "iiii" + "ddd",
    "lrn_backward": "ppppppp" + "iiii" + "d",
    "bn_sums_squares": "ppp" + "i" * 5,
    "bn_normalize": "ppppp" + "i" * 5,
    "bn_normalize_affine": "ppppppp" + "di" + "i" * 5,
    "bn_backward": "pppppp" + "d" + "i" * 5,
    "scale_forward": "ppppp" + "i" * 5,
    "scale_backward": "pppppp" + "i" * 5,
    "relu_forward": "ppid",
    "relu_backward": "pppid",
    "dropout_forward": "ppppiddi",
    "dropout_backward": "pppidi",
    "im2col": "pp" + "i" * 14,
    "col2im": "pp" + "i" * 14,
    "wino_input": "pp" + "i" * 10,
    "wino_output": "ppp" + "i" * 8,
    "wino_output_adjoint": "pp" + "i" * 8,
    "ip_forward": "pppp" + "i" * 5,
    "ip_backward_data": "ppp" + "i" * 5,
    "ipw_forward": "pppp" + "i" * 6,
    "ipw_backward_data": "pppp" + "i" * 6,
    "ipw_backward_weights": "ppp" + "i" * 5,
    "conv_pad": "pp" + "i" * 8,
    "conv_to_lanes": "pp" + "i" * 6,
    "conv_from_lanes": "ppp" + "i" * 6,
    "conv_direct_forward": "ppp" + "i" * 20,
    "conv_direct_dw": "ppp" + "i" * 19,
    "conv_direct_forward_nchw": "pppppp" + "i" * 20 + "ppdi" + "pp",
    "conv_direct_dw_nchw": "pppppp" + "i" * 21,
    "conv_dw_from_runs": "pp" + "i" * 5,
    "conv_weights": "pp" + "i" * 10,
    "conv_block": "",
    "conv_rows_forward": "ppppp" + "i" * 18 + "pdi" + "pp",
    "conv_rows_dw": "ppppp" + "i" * 19 + "ppi",
    "conv_rows_block": "",
    "conv_group_forward": "pp",
    "conv_group_dw": "pp",
    "apply_epilogue": "pppiiii",
    "nms_sorted": "ppiddp",
}

#: Kernels another kernel runs on the images of its own loop (kernels.c's image_step): their
#: addresses, passed to it with an int64 array of their arguments.
IMAGE_STEPS = ("max_pool_forward_images", "max_pool_backward_images",
               "ave_pool_forward_images")


class KernelBuildError(CaffeparError):
    """The compiled kernels were required (CAFFEPAR_KERNELS=native) but cannot be built."""


def mode():
    raw = env("CAFFEPAR_KERNELS", "auto")
    value = _modes.get(raw)
    if value is None:
        value = raw.strip().lower() or "auto"
        if value not in MODES:
            raise CaffeparError(f"CAFFEPAR_KERNELS must be one of {', '.join(MODES)}, "
                                f"got {value!r}")
        _modes[raw] = value
    return value


_modes = {}     # CAFFEPAR_KERNELS as set -> the mode it names (read at every kernel lookup)


def cache_dir():
    """$CAFFEPAR_CACHE_DIR, else ~/.cache/caffepar (or under $XDG_CACHE_HOME); a per-user temp
    folder when that cannot be written (a read-only home on a cluster node)."""
    root = os.environ.get("CAFFEPAR_CACHE_DIR")
    if root:
        return Path(root)
    root = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "caffepar"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"caffepar-{os.getuid()}"


def flags():
    """The compiler flags: FLAGS, then $CAFFEPAR_CFLAGS (e.g. -march=haswell builds AVX2 code
    on an AVX-512 host, as for a cluster of older nodes)."""
    return FLAGS + os.environ.get("CAFFEPAR_CFLAGS", "").split()


def compiler():
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_model():
    """The CPU's vendor, family, model and name ("AuthenticAMD 25 17 AMD EPYC"): engine choices
    and results are kept per CPU model, which the feature flags alone do not tell apart."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    parts = [fields.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name")]
    return " ".join(p for p in parts if p) or platform.processor() or platform.machine()


def _sources():
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".c", ".inc"))


def library_path():
    """Where this build of the kernels lives (whether built yet or not)."""
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    cc = compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "none"
    for part in (cc, version, " ".join(flags()), platform.machine(), _cpu_flags()):
        h.update(part.encode() + b"\0")
    return cache_dir() / f"kernels-{h.hexdigest()[:20]}.so"


def build(path):
    """Compile the sources into `path` (atomically), the float and double kernels side by side;
    returns the seconds it took."""
    path.parent.mkdir(parents=True, exist_ok=True)
    main = SOURCES / "kernels.c"
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent) as tmp:
        lib = os.path.join(tmp, path.name)
        for options in (flags(), [f for f in flags() if f != "-march=native"]):
            objects = [os.path.join(tmp, f"{part}.o") for part in ("f32", "f64")]
            jobs = [subprocess.Popen([compiler(), *options, "-c", f"-DONLY_{part.upper()}",
                                      "-o", obj, str(main)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                    for part, obj in zip(("f32", "f64"), objects)]
            outputs = [job.communicate(timeout=600)[0] for job in jobs]
            failed = [out for job, out in zip(jobs, outputs) if job.returncode]
            if not failed:      # else a compiler without -march=native: generic code
                break
        if not failed:
            link = subprocess.run([compiler(), *options, "-o", lib, *objects, "-lm"],
                                  capture_output=True, text=True, timeout=600)
            failed = [link.stderr or link.stdout] if link.returncode else []
        if failed:
            lines = failed[0].strip().splitlines()
            errors = [line for line in lines if "error" in line] or lines
            raise OSError(errors[0] if errors else f"{compiler()} failed")
        os.replace(lib, path)
    return time.perf_counter() - start


def _bind(lib):
    funcs = {"build": {}}
    for name in ("native_bytes", "native_regs"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int64, []
        funcs["build"][name] = fn()
    # A post is a few atomic operations, made holding the GIL: releasing it would let the
    # thread posted to take it and hold up the poster. The waits release it.
    funcs["sync"] = {"gate_post": ctypes.PYFUNCTYPE(ctypes.c_int64, ctypes.c_void_p)(
        ("gate_post", lib))}
    for name, args in (("gate_wait", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]),
                       ("gate_pass", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int64, args
        funcs["sync"][name] = fn
    kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "d": ctypes.c_double}
    for name, sig in SIGNATURES.items():
        for suffix in SUFFIX.values():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype = ctypes.c_int64
            fn.argtypes = [kinds[k] for k in sig]
            funcs[(name, suffix)] = fn
    funcs["steps"] = {(name, suffix): ctypes.cast(getattr(lib, f"{name}_{suffix}"),
                                                  ctypes.c_void_p).value
                      for name in IMAGE_STEPS for suffix in SUFFIX.values()}
    return funcs


class Kernels:
    """The kernels of one dtype: ``k.max_pool_forward(...)`` calls ``max_pool_forward_f32``."""

    def __init__(self, funcs, suffix):
        for (name, s), fn in ((k, f) for k, f in funcs.items()
                              if k not in ("build", "sync", "steps")):
            if s == suffix:
                setattr(self, name, fn)
        #: {name: address} of the IMAGE_STEPS of this dtype.
        self.steps = {name: a for (name, s), a in funcs["steps"].items() if s == suffix}
        #: The vector width (bytes) and register count the library was built for.
        self.vector_bytes = funcs["build"]["native_bytes"]
        self.registers = funcs["build"]["native_regs"]
        #: blas.run_parts's signals between threads (sync.inc), the same for every dtype.
        self.gate_post = funcs["sync"]["gate_post"]
        self.gate_wait = funcs["sync"]["gate_wait"]
        self.gate_pass = funcs["sync"]["gate_pass"]


_LOCK = threading.Lock()
_loaded = {}        # mode -> {dtype: Kernels} or None
build_seconds = None


def _load():
    """{dtype: Kernels}, building the library on first use; None when it cannot be built."""
    global build_seconds
    path = library_path()
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.parent / ".build.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.exists():
                    log.info("Compiling caffepar's kernels for this CPU into %s", path)
                    build_seconds = build(path)
                    log.info("Kernels compiled in %.1f s (once per CPU and version)",
                             build_seconds)
        funcs = _bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        if mode() == "native":
            raise KernelBuildError(f"cannot build the compiled kernels with {compiler()}: {e}",
                                   hint="install a C compiler or set CAFFEPAR_KERNELS=numpy")
        log.warning("Compiled kernels unavailable (%s); using the NumPy kernels", e)
        return None
    return {dt: Kernels(funcs, s) for dt, s in SUFFIX.items()}


def kernels(dtype):
    """The compiled kernels for arrays of `dtype`, or None: use the NumPy code. Asked before
    every kernel call: an answer is kept per setting of CAFFEPAR_KERNELS and dtype (a net of
    millions of tiny layers asks millions of times a pass)."""
    global _answers_of
    key = (env("CAFFEPAR_KERNELS"), dtype)
    if _answers_of is _loaded:
        found = _answers.get(key, _UNKNOWN)
        if found is not _UNKNOWN:
            return found
    else:                       # the loaded kernels were replaced (tests)
        _answers.clear()
        _answers_of = _loaded
    m = mode()
    if m == "numpy":
        found = None
    else:
        if m not in _loaded:
            with _LOCK:
                if m not in _loaded:
                    _loaded[m] = _load()
        found = _loaded[m]
        found = None if found is None else found.get(np.dtype(dtype))
    _answers[key] = found
    return found


def kernels_for(*arrays):
    """kernels() for arrays that are all C-contiguous and of one dtype, else None."""
    if len({a.dtype for a in arrays}) != 1 or not all(a.flags.c_contiguous for a in arrays):
        return None
    return kernels(arrays[0].dtype)


_answers = {}           # (CAFFEPAR_KERNELS, dtype) -> kernels' answer, from _answers_of
_answers_of = None
_UNKNOWN = object()


@contextlib.contextmanager
def use(path):
    """Run a block on the given path ("native" or "numpy"), for tests and benchmarks."""
    old = os.environ.get("CAFFEPAR_KERNELS")
    os.environ["CAFFEPAR_KERNELS"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CAFFEPAR_KERNELS", None)
        else:
            os.environ["CAFFEPAR_KERNELS"] = old


def _data_field():
    """Where an ndarray object keeps its data pointer: right after the object header in
    NumPy's PyArrayObject, checked here on a live array (None: not found, use a.ctypes)."""
    probe = np.empty(3, np.float32)[1:]
    offset = object.__basicsize__
    try:
        if ctypes.c_void_p.from_address(id(probe) + offset).value == probe.ctypes.data:
            return offset
    except (ValueError, OSError):
        pass
    return None


_DATA_FIELD = _data_field()


def ptr(a):
    """An array's data address for a kernel argument: read from the array object (a.ctypes
    builds a helper object, about 1 us, and a training step passes some 150 addresses)."""
    if _DATA_FIELD is None or type(a) is not np.ndarray:
        return a.ctypes.data
    return ctypes.c_void_p.from_address(id(a) + _DATA_FIELD).value or 0


class ImageStep:
    """One layer's pass handed to the layer before it, to run image by image inside that
    layer's own loop over the batch while the images are in cache (kernels.c's image_step): a
    MAX pooling's forward on each image a convolution has just written, its backward on each
    run of images just before the convolution's weight gradient reads them.

    ``address`` (None: no compiled step) and ``args`` are what a kernel takes, ``images`` the
    address of the array whose images it works on (a kernel takes the step only when that is
    the array it loops over); a pass that runs
    the step records what it returned, summed, in ``counted``, and sets ``ran``. Whoever is
    given a step must see it done: in its kernels, or through ``run()`` (the layer's own pass
    over the whole batch) where they cannot take it. A backward step that counts something has
    left work to ``finish()`` (a MAX pooling's windows without a winner), after which whatever
    read its images must read them again."""

    def __init__(self, address, args, images, run, finish=None):
        self.address, self.images = address, images
        self.args = np.ascontiguousarray(args, np.int64)
        self.args_address = ptr(self.args)
        self._run, self._finish = run, finish
        self.ran = False
        self.counted = 0

    def run(self):
        self._run()
        self.ran = True

    def finish(self):
        if self._finish is not None:
            self._finish()
