"""GEMM into an existing array, so big layers accumulate parameter diffs without temporaries."""
import numpy as np
from scipy.linalg import blas


def _as_fortran_operand(m):
    """(array BLAS can read as Fortran order, whether BLAS must transpose it)."""
    if m.flags.f_contiguous:
        return m, 0
    if m.flags.c_contiguous:
        return m.T, 1
    return np.asfortranarray(m), 0


def gemm(a, b, out, alpha=1.0, beta=0.0):
    """out = alpha * a @ b + beta * out, written into `out` (a C-contiguous 2-D array)."""
    if not out.flags.c_contiguous:
        raise ValueError("gemm output must be C-contiguous")
    if out.size == 0:
        return out
    if a.shape[1] == 0:
        out *= beta
        return out
    func = blas.get_blas_funcs("gemm", (a, b, out))
    # Row-major out = a @ b is column-major out.T = b.T @ a.T.
    bt, tb = _as_fortran_operand(b.T)
    at, ta = _as_fortran_operand(a.T)
    res = func(alpha, bt, at, beta=beta, c=out.T, trans_a=tb, trans_b=ta, overwrite_c=1)
    if not np.shares_memory(res, out):
        out[...] = res.T
    return out
