"""The layers' GEMM entry point against NumPy, for every BLAS it can bind."""
import numpy as np
import pytest

from caffepar.layers import blas

LOADERS = {"numpy-openblas": blas._numpy_openblas, "scipy": blas._scipy_blas}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_views(loader, dtype, monkeypatch):
    table = LOADERS[loader]()
    if not table:
        pytest.skip(f"{loader} BLAS not found in this install")
    monkeypatch.setattr(blas, "_BLAS", table)
    rng = np.random.default_rng(0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    big = rng.standard_normal((40, 50)).astype(dtype)
    a = big[3:20, 5:30]            # strided rows: leading dimension 50
    b = rng.standard_normal((25, 33)).astype(dtype)
    c = np.zeros((30, 40), dtype)
    out = c[2:19, 1:34]
    blas.gemm_views(a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=tol, atol=tol * 10)
    before = out.copy()
    blas.gemm_views(a.T.copy(), b.T.copy(), out, trans_a=True, trans_b=True, beta=1.0)
    np.testing.assert_allclose(out, before + (a @ b), rtol=tol, atol=tol * 10)
    assert not c[:2].any() and not c[19:].any() and not c[:, :1].any()
    w = rng.standard_normal((33, 25)).astype(dtype)
    y = np.empty((17, 33), dtype)
    blas.gemm(a, w.T, y)
    np.testing.assert_allclose(y, a @ w.T, rtol=tol, atol=tol * 10)


def test_found_a_blas():
    assert blas._BLAS, "no BLAS bound: every GEMM would fall back to numpy.matmul"


def test_shape_mismatch_is_an_error():
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="cannot fill 3x6"):
        blas.gemm_views(a, b, np.empty((3, 6), np.float32))
    with pytest.raises(ValueError):
        blas.gemm_views(a, b, np.empty((3, 5), np.float32), trans_a=True)
