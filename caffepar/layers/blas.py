"""GEMM written into existing (possibly strided) arrays, the one BLAS entry point of the layers.

SciPy's f2py wrappers (`scipy.linalg.blas.sgemm`) copy any operand that is not Fortran-contiguous,
and `numpy.matmul` has no beta, so big layers would make full-size temporaries. Here the Fortran
sgemm/dgemm are called through ctypes on row-major views with their leading dimensions; anything
BLAS cannot read that way falls back to NumPy.

The BLAS is the OpenBLAS that NumPy's wheels bundle when it can be found (it is newer than SciPy's
and about 1.3x faster on the thin GEMMs of small convolutions, and one library means one thread
pool), else SciPy's exported one (`scipy.linalg.cython_blas`).
"""
import ctypes
import glob
import os

import numpy as np


def _numpy_openblas():
    """{dtype: (sgemm/dgemm, scalar type, integer type)} from NumPy's bundled OpenBLAS, or {}."""
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
            return {np.dtype(np.float32): (fns[0], ctypes.c_float, integer),
                    np.dtype(np.float64): (fns[1], ctypes.c_double, integer)}
    return {}


def _scipy_blas():
    """The same from SciPy's exported BLAS, or {}."""
    try:
        from scipy.linalg import cython_blas
    except Exception:
        return {}
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
    return found


def _load_blas():
    if os.environ.get("CAFFEPAR_BLAS", "").lower() == "scipy":
        return _scipy_blas()
    return _numpy_openblas() or _scipy_blas()


_BLAS = _load_blas()
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
    # Row-major C = A B is column-major C^T = B^T A^T.
    fn(_TRANS[trans_b], _TRANS[trans_a],
       ctypes.byref(ci(n)), ctypes.byref(ci(m)), ctypes.byref(ci(k)),
       ctypes.byref(scalar(1.0)),
       ctypes.c_void_p(b.ctypes.data), ctypes.byref(ci(ldb)),
       ctypes.c_void_p(a.ctypes.data), ctypes.byref(ci(lda)),
       ctypes.byref(scalar(beta)),
       ctypes.c_void_p(c.ctypes.data), ctypes.byref(ci(ldc)))


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
