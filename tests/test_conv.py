"""The convolution engines against naive references and adjoint identities."""

import itertools

import numpy as np
import pytest

from caffepar.nn import conv as cm
from caffepar.nn.blas import blas_threads
from caffepar.nn.conv import band, cols, direct, geometry, grid, winograd
from test_calibrate import pass_timer

pytestmark = pytest.mark.usefixtures("kernel_path")


# ---------------------------------------------------------------- references

def _taps(kernel):
    return itertools.product(*[range(k) for k in kernel])


def _tap_slices(kidx, dilation, stride, out):
    return tuple(slice(i * d, i * d + (o - 1) * s + 1, s)
                 for i, d, s, o in zip(kidx, dilation, stride, out))


def ref_conv(x, w, b, stride, pad, dilation, group):
    """Direct convolution, one einsum per tap and group."""
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    out = cm.conv_output_shape(x.shape[2:], w.shape[2:], stride, pad, dilation)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    y = np.zeros((n, o) + out)
    for kidx in _taps(w.shape[2:]):
        xs = xp[(slice(None), slice(None)) + _tap_slices(kidx, dilation, stride, out)]
        for g in range(group):
            y[:, g * og:(g + 1) * og] += np.einsum(
                "nc...,oc->no...", xs[:, g * cg:(g + 1) * cg],
                w[(slice(g * og, (g + 1) * og), slice(None)) + kidx])
    if b is not None:
        y += b.reshape((1, -1) + (1,) * len(out))
    return y


def ref_conv_grads(dy, x, w, stride, pad, dilation, group):
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    out = dy.shape[2:]
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    for kidx in _taps(w.shape[2:]):
        sl = (slice(None), slice(None)) + _tap_slices(kidx, dilation, stride, out)
        xs = xp[sl]
        for g in range(group):
            osl, csl = slice(g * og, (g + 1) * og), slice(g * cg, (g + 1) * cg)
            red = [0] + list(range(2, dy.ndim))
            dw[(osl, slice(None)) + kidx] = np.tensordot(dy[:, osl], xs[:, csl], (red, red))
            dxp[sl][:, csl] += np.einsum("no...,oc->nc...", dy[:, osl],
                                         w[(osl, slice(None)) + kidx])
    crop = (slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(pad, x.shape[2:]))
    db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
    return dxp[crop], dw, db


def loop_conv2d(x, w, b, stride, pad, dilation, group):
    """Pixel-by-pixel 2-D convolution, to validate ref_conv itself."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    og = o // group
    ho, wo = cm.conv_output_shape((h, wd), (kh, kw), stride, pad, dilation)
    y = np.zeros((n, o, ho, wo))
    for ni, oi, i, j in itertools.product(range(n), range(o), range(ho), range(wo)):
        g = oi // og
        acc = b[oi]
        for ci, p, q in itertools.product(range(cg), range(kh), range(kw)):
            r = i * stride[0] - pad[0] + p * dilation[0]
            s = j * stride[1] - pad[1] + q * dilation[1]
            if 0 <= r < h and 0 <= s < wd:
                acc += x[ni, g * cg + ci, r, s] * w[oi, ci, p, q]
        y[ni, oi, i, j] = acc
    return y


def ref_deconv(x, w, b, stride, pad, dilation, group):
    """Caffe deconvolution by scattering every input pixel through the kernel."""
    n, cin = x.shape[:2]
    cig, cog = cin // group, w.shape[1]
    insp = x.shape[2:]
    full = tuple(s * (i - 1) + d * (k - 1) + 1
                 for i, k, s, d in zip(insp, w.shape[2:], stride, dilation))
    yp = np.zeros((n, cog * group) + full)
    for kidx in _taps(w.shape[2:]):
        sl = _tap_slices(kidx, dilation, stride, insp)
        for g in range(group):
            isl, osl = slice(g * cig, (g + 1) * cig), slice(g * cog, (g + 1) * cog)
            yp[(slice(None), osl) + sl] += np.einsum("nc...,co->no...", x[:, isl],
                                                     w[(isl, slice(None)) + kidx])
    y = yp[(slice(None), slice(None)) + tuple(slice(p, f - p) for p, f in zip(pad, full))]
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * len(insp))
    return y


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(np.abs(b).max(initial=0.0), 1e-30)
    err = np.abs(a - b).max(initial=0.0)
    assert err <= tol * scale, f"max error {err:.3g} vs scale {scale:.3g}"


# ---------------------------------------------------------------- cases

def case(n, c, sp, o, k, stride=1, pad=0, dil=1, group=1):
    nd = len(sp)
    t = lambda v: tuple(v) if isinstance(v, tuple) else (v,) * nd
    return (n, c, tuple(sp), o, t(k), t(stride), t(pad), t(dil), group)


CASES = [
    case(1, 3, (7, 7), 4, 3, 1, 1),
    case(3, 3, (7, 7), 4, 3, 1, 1),
    case(3, 4, (8, 9), 6, 3, 2, 0),
    case(2, 4, (9, 8), 4, 3, 3, 2, 1, 2),
    case(2, 4, (10, 10), 6, 3, 1, 2, 2, 2),
    case(2, 3, (11, 10), 4, 3, 2, 1, 2),
    case(2, 4, (7, 7), 4, 3, 1, 1, 1, 4),          # depthwise
    case(2, 3, (6, 7), 6, 3, 2, 1, 1, 3),          # depthwise, multiplier 2
    case(2, 3, (9, 11), 5, (2, 4), (1, 2), (0, 1)),
    case(2, 2, (8, 10), 3, (3, 1), (2, 1), (1, 0), (2, 1)),
    case(3, 5, (4, 4), 7, 1),                      # 1x1
    case(2, 3, (40, 40), 4, 1),                    # 1x1, per-image GEMM path
    case(5, 6, (33, 32), 4, 1, 1, 0, 1, 2),        # 1x1 groups, images in runs
    case(2, 4, (7, 7), 3, 1, 2),                   # 1x1 stride 2
    case(2, 4, (5, 6), 3, 1, 1, 1),                # 1x1 pad 1
    case(1, 2, (4, 4), 3, 2, 1, 2),                # pad >= kernel
    case(2, 3, (10, 10), 4, 2, 3),                 # stride > kernel: unused pixels
    case(2, 64, (6, 6), 8, 3, 1, 1),               # per-tap GEMM path
    case(2, 64, (7, 8), 8, 3, 2, 1),               # per-tap GEMM, polyphase
    case(1, 128, (5, 5), 6, 3, 2, 1, 1, 2),        # per-tap GEMM, groups
    case(2, 64, (9, 9), 4, 3, 1, 2, 2),            # per-tap GEMM, dilation
    case(2, 16, (7, 7), 5, 3, 1, 1),               # im2col, dx by flipped kernel
    case(2, 16, (6, 6), 4, 3, 1, 1, 1, 2),
    case(2, 8, (9, 8), 4, (3, 2), 1, (2, 1), (2, 1)),
    case(1, 8, (5, 5), 3, 3, 1, 3),                # over-padded: col2im dx
    case(2, 3, (10,), 4, 3, 2, 1),                 # 1-D
    case(2, 3, (5, 6, 4), 4, (3, 2, 2), (1, 2, 1), (1, 0, 1), (1, 1, 2)),   # 3-D
    case(1, 64, (4, 4, 4), 4, 3, 1, 1),            # 3-D per-tap path
    case(2, 4, (5, 5, 5), 4, 3, 2, 1, 1, 2),       # 3-D stride 2 groups
    case(2, 8, (4, 5, 4), 3, (2, 3, 2), 1, 1),     # 3-D flipped-kernel dx
    case(3, 3, (5, 36), 4, 3, 1, 1),               # long rows: image-major im2col
    case(2, 4, (6, 70), 4, 3, (1, 2), 1, 1, 2),
    case(2, 16, (4, 40), 4, 3, 1, 1),
    case(2, 64, (5, 5), 64, 3, 1, 1),              # many channels, small image: im2col
]


def make(cs, seed=0, dtype=np.float64):
    n, c, sp, o, k, stride, pad, dil, group = cs
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c) + sp)
    w = rng.standard_normal((o, c // group) + k)
    b = rng.standard_normal(o)
    out = cm.conv_output_shape(sp, k, stride, pad, dil)
    dy = rng.standard_normal((n, o) + out)
    return [a.astype(dtype) for a in (x, w, b, dy)]


def ids(cs):
    n, c, sp, o, k, stride, pad, dil, group = cs
    return f"n{n}c{c}s{'x'.join(map(str, sp))}o{o}k{'x'.join(map(str, k))}" \
           f"st{''.join(map(str, stride))}p{''.join(map(str, pad))}" \
           f"d{''.join(map(str, dil))}g{group}"


# ---------------------------------------------------------------- tests

def test_reference_matches_pixel_loops():
    for cs in (case(2, 4, (7, 8), 6, (3, 2), (2, 1), (1, 2), (1, 2), 2),
               case(1, 3, (6, 6), 3, 3, 1, 1, 1, 3)):
        x, w, b, _ = make(cs)
        args = cs[5:]
        close(ref_conv(x, w, b, *args), loop_conv2d(x, w, b, *args), 1e-12)


@pytest.mark.parametrize("cs", CASES, ids=ids)
def test_conv_float64(cs):
    x, w, b, dy = make(cs)
    args = cs[5:]
    y = cm.conv_forward(x, w, b, *args)
    assert y.flags.c_contiguous and y.dtype == np.float64
    close(y, ref_conv(x, w, b, *args), 1e-10)
    dx, dw, db = cm.conv_backward(dy, x, w, *args)
    rdx, rdw, rdb = ref_conv_grads(dy, x, w, *args)
    close(dx, rdx, 1e-10)
    close(dw, rdw, 1e-10)
    close(db, rdb, 1e-10)
    # Adjoint identities, independent of the reference.
    w2 = np.random.default_rng(1).standard_normal(w.shape)
    assert np.isclose(np.vdot(cm.conv_forward(x, w, None, *args), dy), np.vdot(x, dx),
                      rtol=1e-10)
    assert np.isclose(np.vdot(cm.conv_forward(x, w2, None, *args), dy), np.vdot(w2, dw),
                      rtol=1e-10)


@pytest.mark.parametrize("cs", CASES[::3], ids=ids)
def test_conv_float32(cs):
    x, w, b, dy = make(cs, dtype=np.float32)
    args = cs[5:]
    x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
    y = cm.conv_forward(x, w, b, *args)
    assert y.dtype == np.float32
    close(y, ref_conv(x64, w64, b64, *args), 1e-4)
    dx, dw, db = cm.conv_backward(dy, x, w, *args)
    assert dx.dtype == dw.dtype == db.dtype == np.float32
    for got, want in zip((dx, dw, db), ref_conv_grads(dy64, x64, w64, *args)):
        close(got, want, 1e-4)


def test_need_flags():
    cs = case(2, 3, (6, 6), 4, 3, 2, 1)
    x, w, b, dy = make(cs)
    args = cs[5:]
    full = cm.conv_backward(dy, x, w, *args)
    assert cm.conv_backward(dy, x, w, *args, need_dx=False, need_db=False)[0::2] == (None, None)
    close(cm.conv_backward(dy, x, w, *args, need_dx=False)[1], full[1], 1e-12)
    dx, dw, db = cm.conv_backward(dy, x, w, *args, need_dw=False, need_db=False)
    assert dw is None and db is None
    close(dx, full[0], 1e-12)
    dx, dw, db = cm.conv_backward(dy, x, w, *args, need_dx=False, need_dw=False)
    assert dx is None and dw is None
    close(db, full[2], 1e-12)


@pytest.mark.parametrize("cs", [CASES[i] for i in (1, 3, 7, 9, 16, 17, 21, 25, 28, 29, 31, 32)], ids=ids)
@pytest.mark.parametrize("direct", [1, 1 << 30])
def test_small_workspace_and_blocks(cs, direct, monkeypatch):
    """Chunking over images, rows and grid columns must not change results."""
    monkeypatch.setattr(geometry, "WORKSPACE_BYTES", 1)
    monkeypatch.setattr(grid, "BLOCK_BYTES", 1)
    monkeypatch.setattr(grid, "BLOCK_MIN_COLS", 7)
    monkeypatch.setattr(cols, "COLS_BYTES", 1 if direct == 1 else 1 << 30)
    monkeypatch.setattr(cols, "COLS_DIRECT_MIN", direct)
    x, w, b, dy = make(cs)
    args = cs[5:]
    close(cm.conv_forward(x, w, b, *args), ref_conv(x, w, b, *args), 1e-10)
    for got, want in zip(cm.conv_backward(dy, x, w, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, 1e-10)


@pytest.mark.parametrize("cs", [CASES[i] for i in (3, 21, 25, 29, 30)], ids=ids)
@pytest.mark.parametrize("workers", [1, 2])
def test_im2col_row_blocks_over_image_batches(cs, workers, monkeypatch):
    """Several images per block and a few rows at a time, in either layout, the blocks on one
    thread or split over two."""
    cs = (2 * workers,) + cs[1:]
    n, c, sp, o, k, stride, pad, dil, group = cs
    g = geometry.Geom(sp, k, stride, pad, dil)
    rest = int(np.prod(g.out[1:]))
    monkeypatch.setattr(cols, "blas_threads", lambda: workers)
    monkeypatch.setattr(cols, "COLS_BYTES",
                        2 * rest * (g.ntaps * c // group + 1) * group * 8 * workers)
    monkeypatch.setattr(cols, "COLS_SHORT_ROW", 1 << 30)
    plan = cols._ColsPlan(g, n, c, o, group, 8, workers)
    assert plan.nb == 2 and plan.rows < g.out[0] and plan.batch_last
    assert len(plan.chunks(n)) == workers
    x, w, b, dy = make(cs)
    args = cs[5:]
    close(cm.conv_forward(x, w, b, *args), ref_conv(x, w, b, *args), 1e-10)
    for got, want in zip(cm.conv_backward(dy, x, w, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, 1e-10)


DECONV_CASES = [
    case(2, 4, (5, 5), 3, 3, 1, 1),
    case(2, 4, (4, 5), 6, 3, 2, 1),
    case(1, 4, (4, 4), 4, (4, 3), (2, 3), (1, 0), (1, 2), 2),
    case(2, 3, (5, 5), 3, 3, 2, 0, 1, 3),     # depthwise
    case(1, 64, (3, 4), 4, 2, 2, 0),          # per-tap GEMM path
    case(2, 3, (3, 4, 3), 2, (2, 3, 2), (2, 1, 2), (0, 1, 1)),   # 3-D
]


@pytest.mark.parametrize("cs", DECONV_CASES, ids=ids)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("wide_winograd", [False, True])
def test_deconv(cs, dtype, tol, wide_winograd, monkeypatch):
    if wide_winograd:
        monkeypatch.setattr(winograd, "WINOGRAD_MIN_CHANNELS", 1)
        monkeypatch.setattr(winograd, "WINOGRAD_MAX_WASTE", 1.0)
    n, cin, sp, cout, k, stride, pad, dil, group = cs
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, cin) + sp)
    w = rng.standard_normal((cin, cout // group) + k)
    b = rng.standard_normal(cout)
    args = (stride, pad, dil, group)
    want = ref_deconv(x, w, b, *args)
    y = cm.deconv_forward(x.astype(dtype), w.astype(dtype), b.astype(dtype), *args)
    assert y.dtype == dtype and y.flags.c_contiguous
    close(y, want, tol)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = cm.deconv_backward(dy.astype(dtype), x.astype(dtype), w.astype(dtype), *args)
    # dx is a convolution of dy with the same weights.
    close(dx, ref_conv(dy, w, None, *args), tol)
    close(db, dy.sum(axis=(0,) + tuple(range(2, dy.ndim))), tol)
    # <deconv(x, w2), dy> == <w2, dw> and <deconv(x), dy> == <x, dx>.
    w2 = rng.standard_normal(w.shape)
    assert np.isclose(np.vdot(ref_deconv(x, w2, None, *args), dy), np.vdot(w2, dw),
                      rtol=10 * tol)
    assert np.isclose(np.vdot(ref_deconv(x, w, None, *args), dy), np.vdot(x, dx),
                      rtol=10 * tol)
    # Deconvolution is the adjoint of convolution with the same weight blob.
    xc = rng.standard_normal(y.shape)
    yc = cm.conv_forward(xc, w, None, *args)
    assert yc.shape == x.shape
    assert np.isclose(np.vdot(yc, x), np.vdot(xc, ref_deconv(x, w, None, *args)), rtol=1e-10)


def test_im2col_layout_by_hand():
    x = np.arange(18, dtype=np.float64).reshape(1, 2, 3, 3)
    cols = cm.im2col(x, (2, 2), (1, 1), (0, 0), (1, 1))
    assert cols.shape == (1, 8, 2, 2)
    assert cols[0, 0].tolist() == [[0, 1], [3, 4]]          # c0, (0, 0)
    assert cols[0, 1].tolist() == [[1, 2], [4, 5]]          # c0, (0, 1)
    assert cols[0, 2].tolist() == [[3, 4], [6, 7]]          # c0, (1, 0)
    assert cols[0, 3].tolist() == [[4, 5], [7, 8]]          # c0, (1, 1)
    assert cols[0, 4].tolist() == [[9, 10], [12, 13]]       # c1, (0, 0)
    cols = cm.im2col(x[:, :1], (2, 2), (2, 2), (1, 1), (1, 1))
    assert cols[0, :, 0, 0].tolist() == [0, 0, 0, 0]        # all padding
    assert cols[0, :, 1, 1].tolist() == [4, 5, 7, 8]


@pytest.mark.parametrize("cs", [CASES[i] for i in (2, 9, 25)], ids=ids)
def test_im2col_col2im(cs):
    n, c, sp, o, k, stride, pad, dil, group = cs
    x, _, _, _ = make(cs)
    cols = cm.im2col(x, k, stride, pad, dil)
    out = cm.conv_output_shape(sp, k, stride, pad, dil)
    assert cols.shape == (n, c * int(np.prod(k))) + out
    # A convolution is the weight matrix times the columns.
    w = np.random.default_rng(2).standard_normal((o, c) + k)
    y = np.einsum("ok,nk...->no...", w.reshape(o, -1), cols)
    close(y, ref_conv(x, w, None, stride, pad, dil, 1), 1e-12)
    r = np.random.default_rng(4).standard_normal(cols.shape)
    back = cm.col2im(r, x.shape, k, stride, pad, dil)
    assert back.shape == x.shape
    assert np.isclose(np.vdot(cols, r), np.vdot(x, back), rtol=1e-12)


def test_output_shape_and_errors():
    assert cm.conv_output_shape((224, 224), (3, 3), (1, 1), (1, 1), (1, 1)) == (224, 224)
    assert cm.conv_output_shape((227, 100), (11, 3), (4, 2), (0, 1), (1, 2)) == (55, 49)
    x = np.zeros((1, 3, 2, 2))
    with pytest.raises(ValueError):
        cm.conv_forward(x, np.zeros((4, 3, 5, 5)), None, (1, 1), (0, 0), (1, 1), 1)
    with pytest.raises(ValueError):
        cm.conv_forward(x, np.zeros((4, 2, 1, 1)), None, (1, 1), (0, 0), (1, 1), 1)


BAND_CASES = [
    case(3, 3, (7, 9), 4, 3, 1, 1),
    case(2, 5, (9, 8), 4, (3, 2), (1, 2), (2, 1), (2, 1)),
    case(3, 16, (6, 6), 5, 5, 1, 2),
    case(2, 4, (5, 11), 3, (2, 3), (1, 3), (0, 2), (1, 1)),
    case(2, 8, (4, 4), 3, 3, 1, 3),                # over-padded: col2im dx
]


@pytest.mark.parametrize("cs", BAND_CASES, ids=ids)
@pytest.mark.parametrize("fold_all", [True, False])
@pytest.mark.parametrize("blocks", ["one row", "row bands", "image batches", "whole"])
@pytest.mark.parametrize("workers", [1, 3])
def test_band_folds_and_blocks(cs, fold_all, blocks, workers, monkeypatch):
    """Full and per-column-tap folding, image batches and row bands with halo, the blocks run
    on one thread or split over three."""
    monkeypatch.setattr(band, "BAND_FOLD_ALL", 1 << 30 if fold_all else 1)
    monkeypatch.setattr(cols, "FLIP_MIN_CHANNELS", 1)
    monkeypatch.setattr(band, "blas_threads", lambda: workers)
    x, w, b, dy = make(cs)
    n = x.shape[0]
    args = cs[5:]
    g = geometry.Geom(x.shape[2:], w.shape[2:], *args[:3])
    assert band.usable(g, args[3]) and cols.usable(g, w.shape[1], w.shape[0], args[3])
    plan = band._BandPlan(g, n, x.shape[1], 8)
    row = (plan.k + (plan.depth if fold_all else 0)) * plan.wo * 8
    budget = {"one row": 1, "row bands": (2 + plan.halo) * row,
              "image batches": 2 * (g.out[0] + plan.halo) * row, "whole": 1 << 30}[blocks]
    monkeypatch.setattr(band, "BAND_BYTES", budget * workers)
    plan = band._BandPlan(g, n, x.shape[1], 8, workers)
    assert plan.fold_all == fold_all
    nb, rows = {"one row": (1, 1), "row bands": (1, 2), "image batches": (2, g.out[0]),
                "whole": (n, g.out[0])}[blocks]
    assert plan.rows == rows
    if workers == 1:
        assert plan.nb == nb
    else:                               # as many blocks as fit, in a multiple of the threads
        nblocks = len(list(plan.blocks(g, n)))
        assert plan.nb <= nb and (nblocks % workers == 0 or plan.nb == 1)
    close(cm.conv_forward(x, w, b, *args), ref_conv(x, w, b, *args), 1e-10)
    for got, want in zip(cm.conv_backward(dy, x, w, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, 1e-10)


def test_many_threads_keep_blocks_large():
    """On many cores the buffer bounds are split in at most MAX_SHARES shares, so blocks stay
    as large as with MAX_SHARES threads instead of shrinking to slivers."""
    g = geometry.Geom((32, 32), (5, 5), (1, 1), (2, 2), (1, 1))
    shares = geometry.MAX_SHARES
    assert (band._BandPlan(g, 100, 3, 4, 64).nb, band._BandPlan(g, 100, 3, 4, 64).rows) == \
        (band._BandPlan(g, 100, 3, 4, shares).nb, 32)
    g = geometry.Geom((56, 56), (3, 3), (1, 1), (1, 1), (1, 1))
    assert cols._ColsPlan(g, 64, 3, 16, 1, 4, 64).nb == cols._ColsPlan(g, 64, 3, 16, 1, 4, shares).nb


@pytest.mark.parametrize("cs", [CASES[i] for i in (1, 4, 15, 19, 29)], ids=ids)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "float64-into-float32"])
def test_out_arguments(cs, layout):
    """out= and dx_out= receive the result, whatever their layout and dtype."""
    x, w, b, dy = make(cs, dtype=np.float32)
    args = cs[5:]
    want_y = cm.conv_forward(x, w, b, *args)
    want = cm.conv_backward(dy, x, w, *args)

    def target(shape):
        if layout == "contiguous":
            return np.full(shape, np.nan, np.float32)
        if layout == "strided":
            return np.full(shape[:-1] + (2 * shape[-1],), np.nan, np.float32)[..., ::2]
        return np.full(shape, np.nan, np.float64)

    y = target(want_y.shape)
    assert cm.conv_forward(x, w, b, *args, out=y) is y
    close(y, want_y, 1e-6)
    dx = target(x.shape)
    got = cm.conv_backward(dy, x, w, *args, dx_out=dx)
    assert got[0] is dx
    close(dx, want[0], 1e-6)
    close(got[1], want[1], 1e-6)
    with pytest.raises(ValueError):
        cm.conv_forward(x, w, b, *args, out=np.empty(want_y.shape[:-1] + (want_y.shape[-1] + 1,)))


@pytest.mark.parametrize("cs", DECONV_CASES[:3], ids=ids)
def test_deconv_out_arguments(cs):
    n, cin, sp, cout, k, stride, pad, dil, group = cs
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, cin) + sp)
    w = rng.standard_normal((cin, cout // group) + k)
    b = rng.standard_normal(cout)
    args = (stride, pad, dil, group)
    want = cm.deconv_forward(x, w, b, *args)
    y = np.full(want.shape, np.nan)
    assert cm.deconv_forward(x, w, b, *args, out=y) is y
    close(y, want, 1e-12)
    dy = rng.standard_normal(want.shape)
    ref = cm.deconv_backward(dy, x, w, *args)
    dx = np.full(x.shape, np.nan)
    got = cm.deconv_backward(dy, x, w, *args, dx_out=dx)
    assert got[0] is dx
    close(dx, ref[0], 1e-12)


WINOGRAD_CASES = [
    case(2, 3, (7, 8), 4, 3, 1, 1),
    case(3, 4, (6, 5), 6, 3, 1, (0, 2), 1, 2),
    case(1, 2, (3, 3), 2, 3, 1, 2),
    case(3, 4, (1, 4), 4, 3, 1, 1),
    case(2, 6, (9, 9), 3, 3, 1, (1, 0)),
    case(1, 2, (5, 70), 3, 3, 1, 1),               # rows of 35 tiles: whole vectors of them
    case(1, 2, (6, 37), 3, 3, 1, (0, 2)),
]


@pytest.mark.parametrize("cs", WINOGRAD_CASES, ids=ids)
@pytest.mark.parametrize("chunked", [False, True])
def test_winograd(cs, chunked, monkeypatch):
    """F(2x2, 3x3) tiles, odd output sizes (a half-empty last tile), pads 0..2 per axis, groups,
    and one image per workspace chunk: equal to the direct convolution."""
    monkeypatch.setattr(winograd, "WINOGRAD_MIN_CHANNELS", 1)
    monkeypatch.setattr(winograd, "WINOGRAD_MAX_WASTE", 1.0)
    if chunked:
        monkeypatch.setattr(geometry, "WORKSPACE_BYTES", 1)
    x, w, b, dy = make(cs)
    args = cs[5:]
    g = geometry.Geom(x.shape[2:], w.shape[2:], *args[:3])
    assert winograd.usable(g, w.shape[1], w.shape[0] // args[3])
    close(cm.conv_forward(x, w, b, *args), ref_conv(x, w, b, *args), 1e-12)
    for got, want in zip(cm.conv_backward(dy, x, w, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, 1e-12)
    x32, w32, b32, dy32 = (a.astype(np.float32) for a in (x, w, b, dy))
    close(cm.conv_forward(x32, w32, b32, *args), ref_conv(x, w, b, *args), 2e-6)
    for got, want in zip(cm.conv_backward(dy32, x32, w32, *args),
                         ref_conv_grads(dy, x, w, *args)):
        close(got, want, 2e-6)


def test_winograd_only_for_wide_3x3_stride_1():
    def use(sp, k, stride, pad, dil, cg, og):
        return winograd.usable(geometry.Geom(sp, k, stride, pad, dil), cg, og)
    wide = winograd.WINOGRAD_MIN_CHANNELS
    assert use((28, 28), 3, 1, 1, 1, wide, wide)
    assert not use((28, 28), 3, 1, 1, 1, wide - 1, wide)
    assert not use((28, 28), 3, 2, 1, 1, wide, wide)
    assert not use((28, 28), 3, 1, 1, 2, wide, wide)
    assert not use((28, 28), 3, 1, 3, 1, wide, wide)
    assert not use((28, 28), 5, 1, 2, 1, wide, wide)
    assert not use((8, 8, 8), 3, 1, 1, 1, wide, wide)
    assert not use((13, 13), 3, 1, 1, 1, wide, wide)   # 14x14 of tiles: 16% more
    assert use((27, 28), 3, 1, 1, 1, wide, wide)       # 28x28: 4% more


def test_engine_measured_once_and_cached(tmp_path, monkeypatch, kernel_path):
    """With CAFFEPAR_CONV_ENGINES=measure the first run of a shape times every engine able to
    run it and keeps the fastest in the cache; later lookups, in this process or another, read
    it. An engine's name forces it where it applies; "rules" takes the fixed thresholds."""
    from caffepar.nn import calibrate
    from caffepar.nn.conv import dispatch
    monkeypatch.setenv("CAFFEPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "measure")
    monkeypatch.setattr(calibrate, "_chosen", {})
    timed = []
    fake = {"depthwise": 6.0, "direct": 5.0, "winograd": 4.0, "band": 3.0, "im2col": 1.0,
            "grid": 2.0}

    def timing(run, engine):
        run(engine)
        timed.append(engine)
        return fake[engine]

    monkeypatch.setattr(calibrate, "_timed", timing)
    shape = ((9, 9), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1)
    g = geometry.Geom(*shape[0:1], shape[1][2:], *shape[2:5])
    able = dispatch.candidates(g, 3, 1, np.dtype(np.float32))
    native = kernel_path == "native"
    assert able == ["depthwise", "direct"] * native + ["winograd", "band", "im2col", "grid"]
    assert cm.conv_engine(*shape, batch=2) == "im2col"
    # Per pass (forward, backward): every engine once, then the rounds on those within 2x of
    # the best (im2col alone).
    per_pass = len(able) + calibrate.ROUNDS
    assert sorted(set(timed)) == sorted(able) and len(timed) == 2 * per_pass
    assert timed[len(able):per_pass] == ["im2col"] * calibrate.ROUNDS
    assert cm.conv_engine(*shape, batch=2) == "im2col" and len(timed) == 2 * per_pass
    monkeypatch.setattr(calibrate, "_chosen", {})         # another process: reads the file
    assert cm.conv_engine(*shape, batch=2) == "im2col" and len(timed) == 2 * per_pass
    entries = calibrate._load(calibrate._cache_file())
    threads = f" t{blas_threads()}"
    assert sorted(entries) == ["2x3x9x9 4 k3x3 s1x1 p1x1 d1x1 g1 float32 " + p + threads
                               for p in ("backward", "forward")]
    assert all(e["engine"] == "im2col" and e["ms"]["im2col"] == 1000.0
               for e in entries.values())
    assert cm.conv_engine(*shape, batch=3) == "im2col" and len(timed) == 4 * per_pass
    # A first layer: its forward is the one measured already, its backward has no dx.
    assert cm.conv_engine(*shape, batch=3, need_dx=False) == "im2col"
    assert len(timed) == 5 * per_pass
    assert any(k.endswith(" backward no dx" + threads)
               for k in calibrate._load(calibrate._cache_file()))
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "grid")
    assert cm.conv_engine(*shape, batch=2) == "grid"
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "pointwise")      # cannot run 3x3: the rule
    assert cm.conv_engine(*shape, batch=2) == dispatch.rule_engine(g, 3, 4, 1) == "band"
    x, w, b, dy = make(case(2, 3, (9, 9), 4, 3, 1, 1))
    for engine in ("winograd", "band", "im2col", "grid"):
        monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", engine)
        close(cm.conv_forward(x, w, b, (1, 1), (1, 1), (1, 1), 1),
              ref_conv(x, w, b, (1, 1), (1, 1), (1, 1), 1), 1e-10)


@pytest.mark.parametrize("cs", [case(3, 3, (7, 7), 4, 3, 1, 1),
                                case(2, 16, (7, 7), 5, 3, 1, 1),       # dx by flipped kernel
                                case(2, 8, (9, 8), 4, (3, 2), 1, (2, 1), (2, 1))], ids=ids)
@pytest.mark.parametrize("forward,backward", [("direct", "im2col"), ("im2col", "direct"),
                                              ("grid", "im2col")])
def test_engine_per_pass(cs, forward, backward, tmp_path, monkeypatch):
    """Measured per pass, a layer's forward runs the engine fastest for the forward alone and
    its backward the one fastest for the backward: the same results as the references (as one
    engine gives), each pass's choice under a key of its own in the cache, read back by another
    process without measuring."""
    from caffepar.nn import calibrate
    from caffepar.nn.conv import dispatch
    x, w, b, dy = make(cs)
    args = cs[5:]
    g = geometry.Geom(x.shape[2:], w.shape[2:], *args[:3])
    if not {forward, backward} <= set(dispatch.candidates(g, w.shape[1], args[3], x.dtype)):
        pytest.skip("an engine this shape (or kernel path) does not take")
    monkeypatch.setenv("CAFFEPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "measure")
    monkeypatch.setattr(calibrate, "_chosen", {})
    measured = pass_timer(monkeypatch, {"forward": {forward}, "backward": {backward}})
    ran = []
    for module, name in ((direct, "direct"), (cols, "im2col"), (grid, "grid")):
        for step in ("forward", "backward"):
            fn = getattr(module, step)
            monkeypatch.setattr(module, step, lambda *a, fn=fn, tag=f"{name} {step}":
                                ran.append(tag) or fn(*a))
    cm.conv_forward(x, w, b, *args)                        # measures the forward pass
    cm.conv_backward(dy, x, w, *args)                      # and the backward
    keys = sorted(calibrate._load(calibrate._cache_file()))
    assert [k.rsplit(" t", 1)[0].split(" float64 ")[1] for k in keys
            if k.startswith(f"{x.shape[0]}x{x.shape[1]}x")] == ["backward", "forward"]
    monkeypatch.setattr(calibrate, "_chosen", {})         # another process: reads the file
    count = len(measured)
    del ran[:]
    close(cm.conv_forward(x, w, b, *args), ref_conv(x, w, b, *args), 1e-10)
    assert ran == [f"{forward} forward"]
    del ran[:]
    for got, want in zip(cm.conv_backward(dy, x, w, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, 1e-10)
    # im2col's dx of many channels is a forward convolution, on the forward's choice.
    assert f"{backward} backward" in ran and f"{forward} backward" not in ran
    assert len(measured) == count
    assert cm.conv_engine(x.shape[2:], w.shape, *args, batch=x.shape[0]) == \
        f"forward {forward}, backward {backward}"
    # A Deconvolution runs the passes the other way round: its forward the dx, its backward
    # the dw and the forward.
    close(cm.deconv_forward(dy, w, None, *args), ref_deconv(dy, w, None, *args), 1e-10)
    dx, dw, _ = cm.deconv_backward(x, dy, w, *args)
    close(dx, ref_conv(x, w, None, *args), 1e-10)
    close(dw, ref_conv_grads(dy, x, w, *args)[1], 1e-10)


DIRECT_CASES = [cs for cs in CASES if len(cs[2]) == 2] + [
    case(17, 5, (6, 7), 10, 3, 1, 1),              # a second, partly filled lane block
    case(3, 8, (5, 9), 12, (3, 5), 1, (1, 2), (2, 1), 2),
    # dw's tiles of whole 5-wide kernel rows: the edge columns' taps left out (stride 1),
    # looked up (stride 2), all taps where 3 or 4 read padding (pad 4).
    case(2, 8, (7, 9), 20, 5, 1, 2),
    case(2, 6, (9, 8), 12, 5, 2, 2),
    case(2, 6, (6, 7), 10, 5, 1, 4),
    case(2, 6, (9, 9), 5, 7, 1, 3),                # 49 taps in tiles of unequal sizes
    # Few input channels, rows of whole vectors: the rows kernels (partial channel blocks,
    # dilation, groups, a kernel row wider than a weight-gradient tile, rows all padding).
    case(3, 3, (5, 16), 10, 3, 1, 1),
    case(2, 4, (6, 32), 7, (3, 5), 1, (1, 2), (2, 1)),
    case(2, 6, (4, 16), 10, 3, 1, 1, 1, 2),
    case(2, 1, (8, 16), 12, 7, 1, 3),
    case(2, 2, (3, 16), 3, 3, 1, (2, 1)),
    # The forward kernel on an image read as it is, or padded where it would read the padding
    # (three columns of it) or the image is larger than 16 KB.
    case(3, 8, (7, 9), 4, 7, 1, 3),
    case(3, 18, (16, 16), 5, 5, 1, 2),
]


@pytest.mark.parametrize("cs", DIRECT_CASES, ids=ids)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("by_images", [True, False])
def test_direct_engine(cs, dtype, tol, by_images, kernel_path, monkeypatch):
    """The compiled direct engine for every 2-D case it takes (strided ones too): forward, dx,
    dw, db, and deconvolution through it; each run of images doing all its steps, or each step
    over the whole batch."""
    monkeypatch.setattr(direct, "_by_images", lambda n: by_images)
    x, w, b, dy = make(cs)
    args = cs[5:]
    g = geometry.Geom(x.shape[2:], w.shape[2:], *args[:3])
    if not direct.applicable(g, np.dtype(dtype)):
        pytest.skip("not a shape (or kernel path) the direct engine takes")
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "direct")
    monkeypatch.setattr(direct, "PARTS_PER_THREAD", 3)
    xx, ww, bb, dd = (a.astype(dtype) for a in (x, w, b, dy))
    close(cm.conv_forward(xx, ww, bb, *args), ref_conv(x, w, b, *args), tol)
    for got, want in zip(cm.conv_backward(dd, xx, ww, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, tol)
    dx, dw, _ = cm.conv_backward(dd, xx, ww, *args, need_dw=False, need_db=False)
    assert dw is None
    close(dx, ref_conv_grads(dy, x, w, *args)[0], tol)
    yd = cm.deconv_forward(dd, ww, None, *args)
    close(yd, ref_deconv(dy, w, None, *args), tol)


@pytest.mark.parametrize("cs", DIRECT_CASES[-2:] + [case(4, 6, (6, 7), 5, 5, 1, 2),
                                                    case(6, 3, (5, 32), 10, 5, 1, 2)], ids=ids)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_direct_forward_run_of_images(cs, dtype, tol, kernel_path, monkeypatch):
    """A run of images through the forward kernel (and dx, the same kernel on dy), each image
    after the first padded into the padding the first left, or read as it is; and through the
    weight gradient, whose rows kernels sum ROWS_DW_IMAGES images per tile (6: a tile of 4
    and one of 2)."""
    monkeypatch.setattr(direct, "blas_threads", lambda: 1)
    monkeypatch.setattr(direct, "PARTS_PER_THREAD", 1)
    monkeypatch.setattr(direct, "_by_images", lambda n: True)
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "direct")
    x, w, b, dy = make(cs)
    args = cs[5:]
    if not direct.applicable(geometry.Geom(x.shape[2:], w.shape[2:], *args[:3]), np.dtype(dtype)):
        pytest.skip("not a kernel path the direct engine takes")
    xx, ww, bb, dd = (a.astype(dtype) for a in (x, w, b, dy))
    close(cm.conv_forward(xx, ww, bb, *args), ref_conv(x, w, b, *args), tol)
    dx, _, _ = cm.conv_backward(dd, xx, ww, *args, need_dw=False, need_db=False)
    close(dx, ref_conv_grads(dy, x, w, *args)[0], tol)
    for got, want in zip(cm.conv_backward(dd, xx, ww, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, want, tol)


@pytest.mark.parametrize("threads", [1, 2])
def test_direct_weight_gradient_of_a_pooling_step_with_windows_without_winner(threads,
                                                                               monkeypatch):
    """A MAX pooling's backward run as a step inside the rows kernels' weight gradient (each
    tile's images just before it reads them) gives the gradients of the pooling run first. A
    window without a winner (a plane of NaN) adds its dy to a cell after the step (Caffe's
    index -1: the previous plane's last cell), so the gradients are taken again after it."""
    from caffepar.nn import native, pooling
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "direct")
    monkeypatch.setattr(direct, "blas_threads", lambda: threads)
    x, w, b, _ = make(case(6, 3, (16, 16), 10, 5, 1, 2), dtype=np.float32)
    args = ((1, 1), (2, 2), (1, 1), 1)
    if not direct.applicable(geometry.Geom(x.shape[2:], w.shape[2:], *args[:3]),
                             np.dtype(np.float32)) or native.kernels(np.float32) is None:
        pytest.skip("not a kernel path the direct engine takes")
    y = cm.conv_forward(x, w, b, *args)
    y[:, 3] = np.nan
    g = pooling.PoolGeometry(3, 3, 0, 0, 2, 2)
    g.reshape(16, 16)
    out = np.empty(y.shape[:2] + (g.oh, g.ow), np.float32)
    arg = pooling.max_pool_forward(g, y, out)
    assert (g.compact(arg, out.shape)[:, 3] < 0).all()
    dout = np.random.default_rng(2).standard_normal(out.shape).astype(np.float32)
    dy = np.zeros_like(y)
    pooling.max_pool_backward(g, arg, dout, dy)
    want = cm.conv_backward(dy, x, w, *args)
    made = np.full_like(y, 7)
    ran = []
    step = pooling.max_pool_backward_step(g, arg, dout, made, lambda: ran.append(True))
    got = cm.conv_backward(made, x, w, *args, before=step)
    assert step.ran and step.counted > 0 and not ran
    np.testing.assert_array_equal(made, dy)
    for a, e in zip(got, want):
        np.testing.assert_array_equal(a, e)


def test_direct_parts_end_together(monkeypatch):
    """The direct engine's runs of images cover the batch once, in order, the longer runs
    first: two threads taking 100 images' 8 runs in turn get 50 each."""
    monkeypatch.setattr(direct, "blas_threads", lambda: 2)
    monkeypatch.setattr(direct, "PARTS_PER_THREAD", 4)
    parts = direct._parts(100, 1)
    assert [p[0] for p in parts] == list(itertools.accumulate([0] + [p[1] for p in parts]))[:-1]
    assert sum(p[1] for p in parts) == 100
    assert [p[1] for p in parts] == sorted((p[1] for p in parts), reverse=True)
    assert sum(p[1] for p in parts[::2]) == sum(p[1] for p in parts[1::2]) == 50
    assert list(direct._parts(5, 16)[:3]) == [(0, 1, 0, 8), (0, 1, 8, 16), (1, 1, 0, 8)]


@pytest.mark.parametrize("cs", [case(12, 3, (6, 32), 10, 5, 1, 2),      # rows kernels
                                case(12, 8, (8, 8), 20, 3, 1, 1),       # lanes, a partial vector
                                case(12, 8, (9, 9), 12, 3, 2, 1, 1, 2)], ids=ids)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_direct_bias_gradient_in_runs(cs, dtype, tol, kernel_path, monkeypatch):
    """The direct engine's runs of images sum db beside dw (no pass of its own over dy): db
    as the float64 sum, and dw and db bit for bit the same on every call and whether one
    thread or two take the runs."""
    x, w, _, dy = make(cs, dtype=dtype)
    args = cs[5:]
    if not direct.applicable(geometry.Geom(x.shape[2:], w.shape[2:], *args[:3]),
                             np.dtype(dtype)):
        pytest.skip("not a kernel path the direct engine takes")
    from caffepar.nn import blas
    from caffepar.nn.conv import dispatch
    monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", "direct")
    monkeypatch.setattr(direct, "blas_threads", lambda: 2)       # the same runs throughout
    monkeypatch.setattr(dispatch, "bias_diff", None)             # not called
    want = dy.astype(np.float64).sum(axis=(0, 2, 3))
    got = []
    for workers in (1, 2, 2, 1):
        monkeypatch.setattr(blas, "blas_threads", lambda: workers)
        _, dw, db = cm.conv_backward(dy, x, w, *args, need_dx=False)
        got.append((dw, db))
    close(got[0][1], want, tol)
    for dw, db in got[1:]:
        assert np.array_equal(dw, got[0][0]) and np.array_equal(db, got[0][1])


# Geometries a first run meets in published nets and that fixed-threshold tests never reach:
# kernels larger than the unpadded input (MobileNet-SSD's conv17_2: 2x2 input, k3 s2 p1),
# strides larger than the kernel, dilation, groups and depthwise, 1x1 inputs.
ODD_CASES = [
    case(1, 8, (2, 2), 4, 3, 1, 1),
    case(2, 8, (2, 2), 6, 3, 2, 1),
    case(2, 3, (1, 1), 4, 3, 1, 1),
    case(2, 4, (1, 1), 6, 1),
    case(2, 4, (3, 2), 4, 5, 1, 2),
    case(2, 4, (2, 3), 4, 3, 1, 2, 2),
    case(2, 4, (5, 5), 6, 3, 1, 2, 3),
    case(2, 4, (7, 6), 4, 2, 3, 0),
    case(2, 4, (9, 9), 6, 1, 4, 0),
    case(2, 4, (5, 4), 6, 2, 3, 1, 1, 2),
    case(2, 4, (2, 2), 4, 3, 1, 1, 1, 4),
    case(2, 6, (3, 3), 6, 5, 2, 2, 1, 3),
    case(2, 4, (4, 1), 4, (3, 1), (1, 2), (1, 0), (2, 1)),
]


@pytest.mark.parametrize("cs", ODD_CASES, ids=ids)
def test_engines_declare_odd_geometries(cs, tmp_path, monkeypatch):
    """Every engine a shape's candidates name runs it right (forward, dx, dw, db, against the
    naive reference), and the default measured path, which times all of them on a first run,
    ends with the right answer too."""
    from caffepar.nn import calibrate
    from caffepar.nn.conv import dispatch
    x, w, b, dy = make(cs, dtype=np.float32)
    args = cs[5:]
    want = ref_conv(x, w, b, *args)
    grads = ref_conv_grads(dy, x, w, *args)
    g = geometry.Geom(x.shape[2:], w.shape[2:], *args[:3])
    monkeypatch.setenv("CAFFEPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "_chosen", {})
    engines = dispatch.candidates(g, w.shape[1], args[3], np.dtype(np.float32))
    for engine in engines + ["measure"]:
        monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", engine)
        close(cm.conv_forward(x, w, b, *args), want, 1e-4)
        for got, ref in zip(cm.conv_backward(dy, x, w, *args), grads):
            close(got, ref, 1e-4)
        close(cm.deconv_forward(dy, w, None, *args), ref_deconv(dy, w, None, *args), 1e-4)


@pytest.mark.parametrize("act", [None, "relu", "leaky", "clip", "prelu", "prelu_shared"])
def test_epilogue_is_the_unfused_chain(act):
    """conv_forward with an epilogue equals the convolution, then its bias, a folded
    BatchNorm + Scale (per-channel scale and shift) and the activation, each on its own."""
    from caffepar.nn.conv.epilogue import Epilogue
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 7, 8)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    scale = rng.uniform(0.5, 2, 6).astype(np.float32)
    shift = rng.standard_normal(6).astype(np.float32)
    slopes = rng.uniform(0.1, 0.3, 6).astype(np.float32)
    kw = {None: {}, "relu": dict(act="relu"), "leaky": dict(act="relu", slope=0.1),
          "clip": dict(act="clip", lo=0.0, hi=1.0), "prelu": dict(act="prelu", slopes=slopes),
          "prelu_shared": dict(act="prelu", slopes=slopes[:1])}[act]
    ep = Epilogue(scale=scale, shift=b * scale + shift, **kw)
    y = cm.conv_forward(x, w, None, 1, 1, 1, 3, epilogue=ep)
    z = cm.conv_forward(x, w, b, 1, 1, 1, 3).astype(np.float64)
    z = z * scale[:, None, None] + shift[:, None, None]
    if act == "relu":
        z = np.maximum(z, 0)
    elif act == "leaky":
        z = np.where(z < 0, 0.1 * z, z)
    elif act == "clip":
        z = np.clip(z, 0, 1)
    elif act in ("prelu", "prelu_shared"):
        s = slopes[:, None, None] if act == "prelu" else slopes[0]
        z = np.where(z < 0, s * z, z)
    np.testing.assert_allclose(y, z, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="epilogue takes the place"):
        cm.conv_forward(x, w, b, 1, 1, 1, 3, epilogue=ep)


def test_prepared_forward_reads_its_arrays_at_each_call():
    """A prepared forward runs on what its bound arrays hold when called, not when prepared."""
    from caffepar.nn.conv.epilogue import Epilogue
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    w = rng.standard_normal((8, 4, 1, 1)).astype(np.float32)
    y = np.empty((1, 8, 6, 6), np.float32)
    ep = Epilogue(scale=np.ones(8, np.float32), shift=np.zeros(8, np.float32), act="relu")
    run = cm.prepare_conv_forward(x, w, 1, 0, 1, 1, y, ep)
    for _ in range(2):
        x[...] = rng.standard_normal(x.shape)
        ep.scale[...] = rng.uniform(0.5, 2, 8)
        ep.shift[...] = rng.standard_normal(8)
        run()
        z = np.einsum("oc,nchw->nohw", w[:, :, 0, 0], x) * ep.scale[:, None, None] \
            + ep.shift[:, None, None]
        np.testing.assert_allclose(y, np.maximum(z, 0), rtol=1e-5, atol=1e-5)


DEPTHWISE_CASES = [
    case(2, 8, (9, 10), 8, 3, 1, 1, 1, 8),         # 3x3 stride 1
    case(1, 8, (11, 9), 8, 3, 2, 1, 1, 8),         # stride 2
    case(2, 6, (12, 12), 6, 3, 1, 2, 2, 6),        # dilated
    case(1, 4, (13, 12), 4, 5, 1, 2, 1, 4),        # 5x5
    case(1, 4, (9, 9), 4, 5, 2, 2, 1, 4),          # 5x5 stride 2
    case(2, 3, (8, 7), 6, 3, 2, 1, 1, 3),          # channel multiplier 2
    case(1, 2, (7, 7), 16, 3, 1, 1, 1, 2),         # multiplier 8: a full tile of outputs
    case(2, 12, (6, 7), 24, 1, 1, 0, 1, 3),        # group-3 1x1 (ShuffleNet v1), 4 a group
    case(1, 12, (10, 9), 9, 3, 1, 1, 1, 3),        # grouped 3x3, 4 -> 3 channels a group
    case(1, 4, (4, 4), 4, 3, 1, 3, 1, 4),          # over-padded
    case(2, 20, (19, 37), 20, 3, 2, 1, 1, 20),     # long rows: whole vectors and masked tails
]


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("cs", DEPTHWISE_CASES, ids=ids)
def test_depthwise_engine(cs, dtype, tol, kernel_path):
    """Depthwise and few-channel grouped layers run on the depthwise engine under the rules
    (the compiled kernels; else a GEMM engine) and agree with the reference in forward, dx,
    dw, db and as a grouped Deconvolution."""
    from caffepar.nn.conv import dispatch
    x, w, b, dy = make(cs, dtype=dtype)
    args = cs[5:]
    g = geometry.Geom(x.shape[2:], w.shape[2:], *args[:3])
    engine = dispatch.rule_engine(g, w.shape[1], w.shape[0] // args[3], args[3],
                                  np.dtype(dtype))
    assert (engine == "depthwise") == (kernel_path == "native")
    close(cm.conv_forward(x, w, b, *args), ref_conv(x, w, b, *args), tol)
    for got, ref in zip(cm.conv_backward(dy, x, w, *args), ref_conv_grads(dy, x, w, *args)):
        close(got, ref, tol)
    close(cm.deconv_forward(dy, w, None, *args), ref_deconv(dy, w, None, *args), tol)


def _chain(y, ep):
    """The unfused chain an epilogue stands for, in float64."""
    scale, shift = (np.asarray(v, np.float64)[:, None, None] for v in (ep.scale, ep.shift))
    z = y.astype(np.float64) * scale + shift
    if ep.act == "relu":
        z = np.where(z < 0, ep.slope * z, z)
    elif ep.act == "clip":
        z = np.clip(z, ep.lo, ep.hi)
    elif ep.act == "prelu":
        s = np.asarray(ep.slopes, np.float64)
        z = np.where(z < 0, (s[:, None, None] if s.size > 1 else s[0]) * z, z)
    return z


@pytest.mark.parametrize("act", ["relu", "leaky", "clip", "prelu", "prelu_shared", None])
@pytest.mark.parametrize("cs", [case(2, 6, (9, 10), 6, 3, 1, 1, 1, 6),
                                case(1, 4, (8, 9), 8, 3, 2, 1, 1, 4),
                                case(2, 5, (6, 7), 7, 1)], ids=ids)
def test_prepared_forward_with_epilogue(cs, act, kernel_path):
    """A prepared forward (the depthwise engine's kernel, or another engine and the compiled
    epilogue) computes the unfused chain, and sees at each call what x, w and the epilogue's
    arrays hold then, also where the epilogue was given as values it must convert."""
    from caffepar.nn.conv.epilogue import Epilogue
    x, w, _, _ = make(cs, dtype=np.float32)
    args = cs[5:]
    rng = np.random.default_rng(5)
    o = w.shape[0]
    slopes = rng.uniform(0.1, 0.3, o).astype(np.float32)
    kw = {None: {}, "relu": dict(act="relu"), "leaky": dict(act="relu", slope=0.1),
          "clip": dict(act="clip", lo=0.0, hi=1.0), "prelu": dict(act="prelu", slopes=slopes),
          "prelu_shared": dict(act="prelu", slopes=slopes[:1])}[act]
    ep = Epilogue(scale=np.ones(o, np.float32), shift=np.zeros(o, np.float32), **kw)
    y = np.empty((x.shape[0], o) + cm.conv_output_shape(x.shape[2:], w.shape[2:], *args[:3]),
                 np.float32)
    run = cm.prepare_conv_forward(x, w, *args, y, ep)
    for _ in range(2):
        x[...] = rng.standard_normal(x.shape)
        w[...] = rng.standard_normal(w.shape)
        ep.scale[...] = rng.uniform(0.5, 2, o)
        ep.shift[...] = rng.standard_normal(o)
        run()
        close(y, _chain(ref_conv(x, w, None, *args), ep), 1e-5)
    listed = Epilogue(scale=[float(v) for v in ep.scale], shift=ep.shift.astype(np.float64),
                      **kw)
    run = cm.prepare_conv_forward(x, w, *args, y, listed)
    listed.shift[...] = rng.standard_normal(o)
    run()
    close(y, _chain(ref_conv(x, w, None, *args), listed), 1e-5)


@pytest.mark.parametrize("spelling", ['type: "Convolution" convolution_param { num_output: 6 '
                                      'group: 6',
                                      'type: "ConvolutionDepthwise" convolution_param {',
                                      'type: "DepthwiseConvolution" convolution_param { '
                                      'num_output: 6'])
def test_every_depthwise_spelling_runs_on_the_depthwise_engine(spelling, kernel_path):
    from caffepar.graph.net import Net, TEST
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import parse_text
    text = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 6 '
            'dim: 8 dim: 8 } } }\n'
            f'layer {{ name: "dw" bottom: "x" top: "y" {spelling} kernel_size: 3 pad: 1 }} }}')
    net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST)
    layer = net.layer_dict["dw"]
    assert layer.engine(net.blobs["x"].shape) == \
        ("depthwise" if kernel_path == "native" else "grid")
