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


def test_idle_blas_workers_sleep():
    """After a GEMM, OpenBLAS's worker threads must not spin on the cores the layers' NumPy
    work and the data threads need (caffepar sets OPENBLAS_THREAD_TIMEOUT before NumPy loads)."""
    import os
    import subprocess
    import sys
    code = (
        "import caffepar, numpy as np, resource, time\n"
        "a = np.ones((512, 512), np.float32)\n"
        "a @ a\n"
        "r0 = resource.getrusage(resource.RUSAGE_SELF)\n"
        "time.sleep(0.3)\n"
        "r1 = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["OPENBLAS_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert float(out.stdout) < 0.03, f"BLAS workers used {out.stdout.strip()} s of CPU while idle"
