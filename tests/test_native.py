"""The compiled kernels: building and caching them, the switch, and each kernel against the NumPy
code it replaces (bit for bit where they compute the same operations in the same order)."""
import subprocess
import sys

import numpy as np
import pytest

from caffepar.nn import native, pooling
from caffepar.solvers import rules
from test_solvers import RULE_PARAMS, solver_param


@pytest.fixture(scope="module")
def compiled():
    try:
        with native.use("native"):
            native.kernels(np.float32)
    except native.KernelBuildError as e:
        pytest.skip(f"compiled kernels unavailable: {e}")


def both(fn):
    """fn() on the NumPy code and on the compiled kernels."""
    out = {}
    for path in ("numpy", "native"):
        with native.use(path):
            out[path] = fn()
    return out["numpy"], out["native"]


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b, equal_nan=True), f"max difference {np.nanmax(abs(a - b))}"
    if a.dtype.kind == "f":
        signed = ~np.isnan(a)
        assert np.array_equal(np.signbit(a[signed]), np.signbit(b[signed])), "-0 against +0"


# ------------------------------------------------------------------ building

def test_build_is_cached_and_keyed(tmp_path, monkeypatch):
    """A fresh cache builds once; a second process loads the built library; another compiler
    (or CPU, or source) gets another library name."""
    monkeypatch.setenv("CAFFEPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CAFFEPAR_CFLAGS", "-O0")     # what is tested is the build, not its speed
    code = ("import time, numpy as np; from caffepar.nn import native; t = time.perf_counter(); "
            "k = native.kernels(np.float32); print(k is not None, native.build_seconds, "
            "native.library_path())")
    env = dict(__import__("os").environ, CAFFEPAR_KERNELS="native")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if first.returncode and "cannot build" in first.stderr:
        pytest.skip(first.stderr.strip().splitlines()[-1])
    assert first.returncode == 0, first.stderr
    loaded, seconds, path = first.stdout.split()
    assert loaded == "True" and float(seconds) > 0 and path.startswith(str(tmp_path))
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert second.stdout.split() == ["True", "None", path]
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".so"] == [path.split("/")[-1]]
    assert str(native.library_path()) == path
    sources = native.SOURCES
    for name in ("kernels.c", "pool.inc"):
        copy = tmp_path / name.replace(".", "_")
        copy.mkdir()
        for source in native._sources():
            (copy / source.name).write_bytes(source.read_bytes())
        (copy / name).write_text((copy / name).read_text() + "\n")
        monkeypatch.setattr(native, "SOURCES", copy)
        assert str(native.library_path()) != path
    monkeypatch.setattr(native, "SOURCES", sources)
    monkeypatch.setenv("CC", "gcc -DOTHER")
    assert str(native.library_path()) != path


def test_switch_and_fallback(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CAFFEPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "_loaded", {})
    with native.use("numpy"):
        assert native.kernels(np.float32) is None
    with native.use("auto"):
        assert native.kernels(np.float32) is None
    assert "using the NumPy kernels" in caplog.text
    with native.use("native"), pytest.raises(native.KernelBuildError, match="cannot build"):
        native.kernels(np.float32)
    with native.use("fast"), pytest.raises(native.CaffeparError, match="CAFFEPAR_KERNELS"):
        native.kernels(np.float32)


# ------------------------------------------------------------------ pooling

POOLS = [  # n, c, h, w, kh, kw, ph, pw, sh, sw[, ceil_mode]
    (100, 32, 32, 32, 3, 3, 0, 0, 2, 2),         # cifar10_quick pool1
    (2, 3, 7, 9, 3, 2, 1, 1, 2, 1),
    (2, 3, 8, 8, 2, 2, 0, 0, 2, 2),
    (1, 2, 5, 5, 3, 3, 1, 1, 1, 1),
    (2, 9, 10, 11, 2, 3, 0, 1, 3, 4),            # stride > kernel: unread cells
    (1, 3, 6, 6, 3, 3, 2, 2, 2, 2),              # windows starting in the padding
    (1, 2, 13, 13, 13, 13, 0, 0, 1, 1),          # one window over the image
    (1, 1, 4, 30, 1, 12, 0, 0, 1, 1),            # 12-wide windows
    (2, 3, 45, 61, 3, 3, 1, 1, 2, 2),            # odd pad and sizes: every vector width of the
                                                 # stride-2 split and merge, then single cells
    (2, 2, 9, 11, 2, 2, 0, 0, 2, 2, False),      # floor mode: cells no window reaches
    (4, 36, 8, 8, 3, 3, 0, 0, 2, 2),             # small planes (cifar10_quick pool3's), AVE
                                                 # with planes in the lanes, then single planes
    (4, 36, 7, 5, 3, 3, 1, 1, 2, 2),             # ... with a part vector of cells
]


@pytest.mark.parametrize("shape", POOLS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pooling_equals_numpy(shape, dtype, compiled):
    n, c, h, w, kh, kw, ph, pw, sh, sw = shape[:10]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    x[0, 0, :2, :3] = -np.inf                       # windows with no winner (Caffe index -1)
    x[0, -1, 1, 1] = np.nan
    x.reshape(-1)[::7] = x.reshape(-1)[::7].round()  # ties
    g = pooling.PoolGeometry(kh, kw, ph, pw, sh, sw, *shape[10:])
    g.reshape(h, w)
    dy = rng.standard_normal((n, c, g.oh, g.ow)).astype(dtype)
    dy.reshape(-1)[1::5] = -0.0                     # alone on a cell: +0, as Caffe's sum starts
    dy.reshape(-1)[3::97] = np.nan                  # to the winner only
    dy.reshape(-1)[4::89] = -np.inf

    def run():
        y = np.empty((n, c, g.oh, g.ow), dtype)
        arg = pooling.max_pool_forward(g, x, y)
        dx = np.empty_like(x)
        pooling.max_pool_backward(g, arg, dy, dx)
        ya = np.empty_like(y)
        pooling.ave_pool_forward(g, x, ya)
        dxa = np.empty_like(x)
        pooling.ave_pool_backward(g, dy, dxa)
        return y, g.compact(arg, y.shape).copy(), dx, ya, dxa

    for a, b in zip(*both(run)):
        same(a, b)


# ------------------------------------------------------------------ solver update

@pytest.mark.parametrize("kind", list(RULE_PARAMS))
@pytest.mark.parametrize("regularization,iter_size", [("L2", 1), ("L1", 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_solver_update_equals_numpy(kind, regularization, iter_size, dtype, compiled):
    """normalize, regularize, the rule and data -= step, fused in one pass: every value the same
    as the NumPy steps give."""
    p = solver_param(**RULE_PARAMS[kind])
    rule = rules.make_rule(kind, p)
    f = np.dtype(dtype).type
    rng = np.random.default_rng(1)
    n = 1003
    g0 = rng.standard_normal(n).astype(dtype)
    w0 = rng.standard_normal(n).astype(dtype)
    w0[:5] = [0, -0.0, np.nan, 1, -1]
    h0 = [np.abs(rng.standard_normal(n)).astype(dtype) * f(0.1) for _ in range(2)]
    rate, decay = f(0.01) * f(2), f(0.0005) * f(1)

    g, w, hist = g0.copy(), w0.copy(), [h.copy() for h in h0[:rule.num_history]]
    scratch = [np.empty(n, dtype) for _ in range(max(1, rule.num_scratch))]
    rules.normalize(g, iter_size)
    rules.regularize(g, w, decay, regularization, scratch[0])
    rule.update(g, hist, rate, 4, scratch)
    w -= g

    k = native.kernels(dtype)
    cg, cw, ch = g0.copy(), w0.copy(), [h.copy() for h in h0]
    k.solver_update(*[native.ptr(a) for a in (cg, cw, ch[0], ch[1])], n, rule.code,
                    1.0 / iter_size, float(decay), rules.regularization_code(regularization),
                    *rule.kernel_args(rate, 4))
    same(cg, g)
    same(cw, w)
    for a, b in zip(ch, hist):
        same(a, b)


# ------------------------------------------------------------------ LRN

@pytest.mark.parametrize("size,beta,channels", [(5, 0.75, 96), (3, 0.5, 4), (5, 1.0, 3),
                                                (7, 0.6, 9), (1, 0.75, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lrn_equals_numpy(size, beta, channels, dtype, compiled):
    """Same values as the NumPy code; bit for bit where scale^-beta goes through square roots
    (pow may round its last bit differently)."""
    from caffepar.nn.normalization import LRNLayer
    from caffepar.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name="norm", type="LRN")
    param.lrn_param.local_size, param.lrn_param.alpha = size, 1e-2
    param.lrn_param.beta, param.lrn_param.k = beta, 2.0
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, channels, 5, 7)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)

    def run():
        layer = LRNLayer(param)
        layer.layer_setup(None, None)
        y, dx = np.empty_like(x), np.empty_like(x)
        layer._across_forward(x, y)
        layer._across_backward(x, y, dy, dx)
        return y, dx, layer.scale, layer.power

    for a, b in zip(*both(run)):
        if beta in (0.5, 0.75, 1.0):
            same(a, b)
        else:
            np.testing.assert_allclose(b, a, rtol=4 * np.finfo(dtype).eps)


# ------------------------------------------------------------------ ReLU, Dropout

@pytest.mark.parametrize("slope", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu_forward_equals_numpy(slope, dtype, in_place, compiled):
    """Caffe's max(x, 0) + slope * min(x, 0), NaN and infinities included, over runs side by
    side (a size no run count divides); -0 stays -0, as Caffe's std::max keeps the first of
    equal arguments (NumPy's maximum gives +0)."""
    from caffepar.nn.neuron import ReLULayer
    from caffepar.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name="relu", type="ReLU")
    param.relu_param.negative_slope = slope
    x = np.random.default_rng(5).standard_normal(700_003).astype(dtype)
    x[:5] = [0, -0.0, np.nan, np.inf, -5]

    def run():
        layer = ReLULayer(param, dtype=dtype)
        layer.neuron_setup(None, None)
        bottom = _blob(x)
        top = bottom if in_place else _blob(np.full_like(x, 7))
        layer.forward([bottom], [top])
        return top.data.copy()

    numpy_y, native_y = both(run)
    same(numpy_y, native_y)
    assert np.signbit(native_y[1])
    slope = dtype(np.float32(slope))     # negative_slope is a float field
    np.testing.assert_array_equal(native_y, np.maximum(x, 0) + slope * np.minimum(x, 0))


@pytest.mark.parametrize("slope", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_backward_equals_numpy(slope, dtype, compiled):
    from caffepar.nn.neuron import ReLULayer
    from caffepar.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name="relu", type="ReLU")
    param.relu_param.negative_slope = slope
    rng = np.random.default_rng(3)
    x = rng.standard_normal(700_003).astype(dtype)
    x[:4] = [0, -0.0, np.nan, np.inf]
    dy = rng.standard_normal(x.size).astype(dtype)
    dy[4:6] = np.nan

    def run():
        layer = ReLULayer(param, dtype=dtype)
        layer.neuron_setup(None, None)
        bottom, top = _blob(x), _blob(x)
        top.diff[...] = dy
        layer.backward([top], [True], [bottom])
        return bottom.diff.copy()

    same(*both(run))


@pytest.mark.parametrize("scale_train", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_equals_numpy(scale_train, dtype, compiled):
    """The same draws (one stream, whatever the chunks), masks, outputs and gradients."""
    from caffepar import common
    from caffepar.nn.neuron import DropoutLayer
    from caffepar.proto import caffe_pb2
    param = caffe_pb2.LayerParameter(name="drop", type="Dropout")
    param.dropout_param.dropout_ratio = 0.3
    x = np.random.default_rng(4).standard_normal((3, 300_001)).astype(dtype)

    def run():
        common.set_random_seed(11)
        layer = DropoutLayer(param, phase=caffe_pb2.TRAIN, dtype=dtype)
        layer.neuron_setup(None, None)
        layer.scale_train = scale_train
        bottom, top = _blob(x), _blob(x)
        layer.forward([bottom], [top])
        top.diff[...] = x[::-1]
        layer.backward([top], [True], [bottom])
        return top.data.copy(), layer.mask.copy(), bottom.diff.copy()

    for a, b in zip(*both(run)):
        same(a, b)


def _blob(values):
    from caffepar.blob import Blob
    b = Blob(values.shape, values.dtype)
    b.data[...] = values
    return b


# ------------------------------------------------------------------ Caffe's Im2col layer

@pytest.mark.parametrize("geometry", [((3, 3), (1, 1), (1, 1), (1, 1)),
                                      ((2, 5), (2, 3), (0, 2), (2, 1)),
                                      ((4, 4), (3, 1), (3, 1), (1, 1))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_im2col_col2im_equal_numpy(geometry, dtype, compiled):
    from caffepar.nn import conv
    x = np.random.default_rng(5).standard_normal((2, 3, 11, 13)).astype(dtype)

    def run():
        cols = conv.im2col(x, *geometry)
        back = conv.col2im(cols * np.float32(0.5), x.shape, *geometry)
        return cols, back

    for a, b in zip(*both(run)):
        same(a, b)


# ------------------------------------------------------------------ InnerProduct, small batch

@pytest.mark.parametrize("m,k,n", [(1, 5, 3), (3, 37, 5), (4, 64, 8), (7, 100, 17), (16, 33, 9),
                                   (9, 70, 40), (16, 300, 130)])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("engine", ["wide", "rows"])
def test_inner_product_kernels_equal_blas(m, k, n, dtype, tol, engine, compiled):
    """y = x W^T + b, dx = dy W and dW += dy^T x through the compiled kernels: the BLAS results
    up to the order of the sums (shapes with partial register tiles and vector tails)."""
    from caffepar.nn import inner_product
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((m, n)).astype(dtype)
    w, b = rng.standard_normal((n, k)).astype(dtype), rng.standard_normal(n).astype(dtype)
    start = rng.standard_normal((n, k)).astype(dtype)
    results = {}
    for name in (engine, "blas"):
        y, dx, dw = np.empty((m, n), dtype), np.empty_like(x), start.copy()
        inner_product._forward(name, x, w, b, y)
        inner_product._backward(name, dy, x, w, dx, dw)
        results[name] = y, dx, dw
    for got, want in zip(results[engine], results["blas"]):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_ptr_is_the_data_address_of_any_array():
    """native.ptr reads the address from the array object; it must be what NumPy reports
    for views, offsets, empty arrays and subclasses."""
    a = np.arange(120.0).reshape(10, 12)
    for v in (a, a[3], a[:, 5], a.T, a[2:, 3:], np.empty(0, np.float32), a[4:4],
              a.view(np.matrix), np.ma.masked_array(a)):
        assert native.ptr(v) == v.ctypes.data
