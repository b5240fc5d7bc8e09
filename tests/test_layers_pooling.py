"""Pooling and SPP: forward against an explicit-loop reference of Caffe's loops, gradient checks."""
import math

import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

pytestmark = pytest.mark.usefixtures("kernel_path")

FLT_MAX = float(np.finfo(np.float32).max)
RNG = np.random.default_rng(3)


def net_text(layer, shape, extra, tops=("y",)):
    dims = " ".join(f"dim: {d}" for d in shape)
    top_lines = "".join(f'  top: "{t}"\n' for t in tops)
    return (f'force_backward: true\nlayer {{ name: "input" type: "Input" top: "x"\n'
            f"  input_param {{ shape {{ {dims} }} }} }}\n"
            f'layer {{\n  name: "l"\n  type: "{layer}"\n  bottom: "x"\n{top_lines}  {extra}\n}}\n')


def build(text, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST, dtype=dtype)


def run(text, x, dtype=np.float64):
    net = build(text, dtype)
    net.blobs["x"].data[...] = x
    net.forward()
    return net


def ref_pool(x, kh, kw, ph, pw, sh, sw, method, ceil_mode=True):
    """Caffe's Pooling forward, loop for loop: returns the output and the max mask."""
    n, c, h, w = x.shape
    rnd = math.ceil if ceil_mode else math.floor
    oh = rnd((h + 2 * ph - kh) / sh) + 1
    ow = rnd((w + 2 * pw - kw) / sw) + 1
    if ph or pw:
        if (oh - 1) * sh >= h + ph:
            oh -= 1
        if (ow - 1) * sw >= w + pw:
            ow -= 1
    y = np.zeros((n, c, oh, ow))
    mask = np.full((n, c, oh, ow), -1.0)
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * sh - ph, j * sw - pw
                    if method == "MAX":
                        he, we = min(hs + kh, h), min(ws + kw, w)
                        hs, ws = max(hs, 0), max(ws, 0)
                        best = -FLT_MAX
                        for r in range(hs, he):
                            for q in range(ws, we):
                                if x[a, b, r, q] > best:
                                    best = x[a, b, r, q]
                                    mask[a, b, i, j] = r * w + q
                        y[a, b, i, j] = best
                    else:
                        he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                        size = (he - hs) * (we - ws)
                        hs, ws = max(hs, 0), max(ws, 0)
                        he, we = min(he, h), min(we, w)
                        y[a, b, i, j] = x[a, b, hs:he, ws:we].sum() / size
    return y, mask


def distinct(shape):
    """Values at least 0.05 apart, so a 1e-2 step never changes a max-pool winner."""
    n = int(np.prod(shape))
    return (RNG.permutation(n) * 0.05 - n * 0.025).reshape(shape)


# (shape, pooling_param text, kh, kw, ph, pw, sh, sw)
CASES = [
    ((2, 2, 6, 6), "kernel_size: 2 stride: 2", 2, 2, 0, 0, 2, 2),
    ((1, 2, 6, 6), "kernel_size: 3 stride: 2", 3, 3, 0, 0, 2, 2),
    ((1, 2, 5, 5), "kernel_size: 3 stride: 1 pad: 1", 3, 3, 1, 1, 1, 1),
    ((1, 2, 5, 5), "kernel_size: 2 stride: 2 pad: 1", 2, 2, 1, 1, 2, 2),
    ((1, 2, 6, 6), "kernel_size: 2 stride: 2 pad: 1", 2, 2, 1, 1, 2, 2),
    ((1, 2, 7, 5), "kernel_size: 3 stride: 2 pad: 1", 3, 3, 1, 1, 2, 2),
    ((1, 1, 5, 7), "kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0",
     3, 2, 1, 0, 2, 3),
    ((2, 1, 4, 6), "kernel_h: 2 kernel_w: 4 stride: 1", 2, 4, 0, 0, 1, 1),
    # padding along one axis clips the last window along both, as Caffe's Reshape does
    ((1, 2, 6, 5), "kernel_h: 1 kernel_w: 2 stride: 2 pad_h: 0 pad_w: 1", 1, 2, 0, 1, 2, 2),
]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_pooling_forward_matches_loops(method, case):
    shape, text, *geom = case
    x = RNG.standard_normal(shape)
    tops = ("y", "mask") if method == "MAX" else ("y",)
    net = run(net_text("Pooling", shape, f"pooling_param {{ pool: {method} {text} }}", tops), x)
    want, mask = ref_pool(x, *geom, method)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-12)
    if method == "MAX":
        np.testing.assert_array_equal(net.blobs["mask"].data, mask)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_pooling_gradients(method, case):
    shape, text, *_ = case
    prototxt = net_text("Pooling", shape, f"pooling_param {{ pool: {method} {text} }}")
    check_net_gradients(prototxt, {"x": distinct(shape)})


def test_pooling_mask_top_backward_matches_internal_index():
    shape = (2, 3, 7, 7)
    x = distinct(shape)
    extra = "pooling_param { pool: MAX kernel_size: 3 stride: 2 }"
    a = run(net_text("Pooling", shape, extra), x)
    b = run(net_text("Pooling", shape, extra, ("y", "mask")), x)
    dy = RNG.standard_normal(a.blobs["y"].shape)
    a.blobs["y"].diff[...] = dy
    b.blobs["y"].diff[...] = dy
    a.backward_from_to()
    b.backward_from_to()
    np.testing.assert_allclose(a.blobs["x"].diff, b.blobs["x"].diff)


def test_pooling_ties_take_first_cell():
    x = np.zeros((1, 1, 4, 4))
    net = run(net_text("Pooling", x.shape, "pooling_param { pool: MAX kernel_size: 2 stride: 2 }",
                       ("y", "mask")), x)
    np.testing.assert_array_equal(net.blobs["mask"].data[0, 0], [[0, 2], [8, 10]])


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_global_pooling(method):
    shape = (2, 3, 4, 5)
    x = distinct(shape)
    text = net_text("Pooling", shape, f"pooling_param {{ pool: {method} global_pooling: true }}")
    net = run(text, x)
    want = x.max(axis=(2, 3)) if method == "MAX" else x.mean(axis=(2, 3))
    np.testing.assert_allclose(net.blobs["y"].data, want[..., None, None])
    check_net_gradients(text, {"x": x})


def test_floor_round_mode():
    shape = (1, 1, 6, 6)
    x = RNG.standard_normal(shape)
    net = run(net_text("Pooling", shape,
                       "pooling_param { pool: MAX kernel_size: 3 stride: 2 round_mode: FLOOR }"), x)
    want, _ = ref_pool(x, 3, 3, 0, 0, 2, 2, "MAX", ceil_mode=False)
    assert net.blobs["y"].shape == (1, 1, 2, 2)
    np.testing.assert_allclose(net.blobs["y"].data, want)


def test_window_past_the_image_keeps_caffe_values():
    """Stride > kernel without padding: ceil can create a window entirely outside the image."""
    shape = (1, 2, 5, 5)
    x = RNG.standard_normal(shape)
    net = run(net_text("Pooling", shape, "pooling_param { pool: MAX kernel_size: 1 stride: 3 }"),
              x)
    want, _ = ref_pool(x, 1, 1, 0, 0, 3, 3, "MAX")
    np.testing.assert_allclose(net.blobs["y"].data, want)
    assert net.blobs["y"].data[0, 0, 2, 2] == -FLT_MAX


def test_float32_runs_and_matches():
    shape = (2, 3, 9, 9)
    x = RNG.standard_normal(shape).astype(np.float32)
    net = run(net_text("Pooling", shape, "pooling_param { pool: AVE kernel_size: 3 stride: 2 "
                       "pad: 1 }"), x, dtype=np.float32)
    want, _ = ref_pool(x.astype(float), 3, 3, 1, 1, 2, 2, "AVE")
    assert net.blobs["y"].data.dtype == np.float32
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-5, atol=1e-6)


def test_stochastic_pooling_refused_when_run():
    net = build(net_text("Pooling", (1, 1, 4, 4), "pooling_param { pool: STOCHASTIC "
                         "kernel_size: 2 stride: 2 }"))
    assert net.blobs["y"].shape == (1, 1, 2, 2)
    with pytest.raises(CaffeparError, match="not implemented on the CPU"):
        net.forward()
    spp = build(net_text("SPP", (1, 1, 4, 4), "spp_param { pyramid_height: 2 pool: STOCHASTIC }"))
    with pytest.raises(CaffeparError, match="not implemented on the CPU"):
        spp.forward()


@pytest.mark.parametrize("extra,match", [
    ("pooling_param { pool: STOCHASTIC kernel_size: 3 pad: 1 }", "padding is implemented only"),
    ("pooling_param { pool: MAX }", "kernel_h and kernel_w"),
    ("pooling_param { pool: MAX kernel_size: 2 kernel_h: 2 }", "not both"),
    ("pooling_param { pool: MAX global_pooling: true kernel_size: 2 }", "global_pooling"),
    ("pooling_param { pool: MAX kernel_size: 2 pad: 2 }", "pad must be smaller"),
])
def test_pooling_errors(extra, match):
    with pytest.raises(CaffeparError, match=match):
        build(net_text("Pooling", (1, 1, 4, 4), extra))


def test_ave_pooling_refuses_mask_top():
    with pytest.raises(CaffeparError, match="mask"):
        build(net_text("Pooling", (1, 1, 4, 4), "pooling_param { pool: AVE kernel_size: 2 }",
                       ("y", "mask")))


# ------------------------------------------------------------------ SPP
def ref_spp(x, height, method):
    n, c, h, w = x.shape
    parts = []
    for level in range(height):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        y, _ = ref_pool(x, kh, kw, ph, pw, kh, kw, method)
        parts.append(y.reshape(n, -1))
    return np.concatenate(parts, axis=1) if height > 1 else y


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("shape,height", [((2, 2, 5, 6), 2), ((1, 2, 7, 9), 3),
                                          ((2, 3, 4, 4), 1)])
def test_spp(method, shape, height):
    x = distinct(shape)
    text = net_text("SPP", shape, f"spp_param {{ pyramid_height: {height} pool: {method} }}")
    net = run(text, x)
    want = ref_spp(x, height, method)
    assert net.blobs["y"].shape == want.shape
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-12)
    check_net_gradients(text, {"x": x})


# ------------------------------------------------------------------ phase-split fast path
def ref_pool_backward(x, dy, kh, kw, ph, pw, sh, sw, method, mask):
    """Caffe's Pooling backward, loop for loop (MAX through the forward's mask)."""
    n, c, h, w = x.shape
    dx = np.zeros_like(x)
    for a in range(n):
        for b in range(c):
            for i in range(dy.shape[2]):
                for j in range(dy.shape[3]):
                    if method == "MAX":
                        idx = int(mask[a, b, i, j])
                        if idx >= 0:
                            dx[a, b].flat[idx] += dy[a, b, i, j]
                        elif b or a:
                            prev = dx[a, b - 1] if b else dx[a - 1, c - 1]
                            prev.flat[-1] += dy[a, b, i, j]
                        continue
                    hs, ws = i * sh - ph, j * sw - pw
                    he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                    size = (he - hs) * (we - ws)
                    hs, ws = max(hs, 0), max(ws, 0)
                    he, we = min(he, h), min(we, w)
                    dx[a, b, hs:he, ws:we] += dy[a, b, i, j] / size
    return dx


# Kernel/stride/pad mixes whose ceil rule needs overhang rows or columns, floor mode leaving
# cells no window reaches, kernels smaller than the stride, and a 12x12 kernel (16-bit index).
FAST_CASES = [
    ((3, 4, 8, 8), "kernel_size: 3 stride: 2", (3, 3, 0, 0, 2, 2), True),
    ((2, 5, 9, 7), "kernel_size: 3 stride: 2", (3, 3, 0, 0, 2, 2), True),
    ((2, 3, 8, 8), "kernel_size: 2 stride: 2", (2, 2, 0, 0, 2, 2), True),
    ((2, 3, 7, 9), "kernel_size: 2 stride: 2", (2, 2, 0, 0, 2, 2), True),
    ((2, 3, 9, 9), "kernel_size: 3 stride: 2 round_mode: FLOOR", (3, 3, 0, 0, 2, 2), False),
    ((2, 3, 10, 11), "kernel_size: 2 stride: 3 round_mode: FLOOR", (2, 2, 0, 0, 3, 3), False),
    ((2, 3, 7, 8), "kernel_size: 2 stride: 3", (2, 2, 0, 0, 3, 3), True),
    ((1, 4, 7, 6), "kernel_size: 3 stride: 1 pad: 1", (3, 3, 1, 1, 1, 1), True),
    ((2, 2, 9, 8), "kernel_h: 3 kernel_w: 4 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 2",
     (3, 4, 1, 2, 2, 3), True),
    ((1, 3, 13, 14), "kernel_size: 12 stride: 1", (12, 12, 0, 0, 1, 1), True),
]


@pytest.fixture(params=[None, 700, 3000], ids=["one-block", "1-plane-blocks", "few-planes"])
def block_bytes(request, monkeypatch):
    """Tiny blocks split the planes into several runs with a short last one."""
    from caffepar.nn import pooling
    if request.param:
        monkeypatch.setattr(pooling, "BLOCK_BYTES", request.param)
    return request.param


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def workers(request, monkeypatch):
    """The blocks run on one thread, or spread over three."""
    from caffepar.nn import pooling
    monkeypatch.setattr(pooling, "blas_threads", lambda: request.param)
    return request.param


@pytest.mark.parametrize("case", FAST_CASES, ids=[c[1] for c in FAST_CASES])
@pytest.mark.parametrize("method,values", [("MAX", "normal"), ("MAX", "ties"), ("MAX", "nan_inf"),
                                           ("AVE", "normal")])
def test_fast_path_matches_loops(method, case, values, block_bytes, workers):
    shape, text, geom, ceil_mode = case
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape)
    if values == "ties":
        x = np.round(x)
    elif values == "nan_inf":
        x[rng.random(shape) < 0.15] = np.nan
        x[rng.random(shape) < 0.25] = -np.inf
        x[0, 0] = -np.inf
    for dtype, rtol, atol in ((np.float64, 1e-12, 1e-12), (np.float32, 1e-5, 1e-6)):
        tops = ("y", "mask") if method == "MAX" else ("y",)
        net = run(net_text("Pooling", shape, f"pooling_param {{ pool: {method} {text} }}", tops),
                  x.astype(dtype), dtype)
        want, mask = ref_pool(x, *geom, method, ceil_mode=ceil_mode)
        assert net.blobs["y"].shape == want.shape
        np.testing.assert_allclose(net.blobs["y"].data, want, rtol=rtol, atol=atol)
        if method == "MAX":
            np.testing.assert_array_equal(net.blobs["mask"].data, mask)
        dy = rng.standard_normal(want.shape)
        if method == "MAX":
            net = run(net_text("Pooling", shape, f"pooling_param {{ pool: MAX {text} }}"),
                      x.astype(dtype), dtype)
        net.blobs["y"].diff[...] = dy
        net.backward_from_to()
        np.testing.assert_allclose(net.blobs["x"].diff,
                                   ref_pool_backward(x, dy, *geom, method, mask),
                                   rtol=rtol, atol=atol)


def test_fast_path_repeated_calls_reuse_buffers(block_bytes):
    """Forward/backward twice on new data: block buffers kept across calls must not leak
    values between runs (the -inf overhang cells stay -inf, gradients start from zero)."""
    shape = (2, 3, 8, 8)
    text = net_text("Pooling", shape, "pooling_param { pool: MAX kernel_size: 3 stride: 2 }")
    net = build(text)
    rng = np.random.default_rng(2)
    for _ in range(2):
        x = rng.standard_normal(shape) - 5
        net.blobs["x"].data[...] = x
        net.forward()
        want, mask = ref_pool(x, 3, 3, 0, 0, 2, 2, "MAX")
        np.testing.assert_array_equal(net.blobs["y"].data, want)
        dy = rng.standard_normal(want.shape)
        net.blobs["y"].diff[...] = dy
        net.backward_from_to()
        np.testing.assert_allclose(net.blobs["x"].diff,
                                   ref_pool_backward(x, dy, 3, 3, 0, 0, 2, 2, "MAX", mask))


# ------------------------------------------------------------------ MAX backward, bit for bit
def caffe_max_backward(mask, dy, h, w):
    """Caffe's MAX Backward_cpu literally, in dy's dtype: bottom diff set to +0, then for every
    plane and output cell in order bottom_diff[mask] += top_diff (a -1 mask lands on the last
    cell of the previous plane)."""
    n, c, oh, ow = dy.shape
    dx = np.zeros((n * c, h * w), dy.dtype)
    m = mask.reshape(n * c, oh * ow).astype(int)
    d = dy.reshape(n * c, oh * ow)
    for p in range(n * c):
        for q in range(oh * ow):
            if m[p, q] >= 0:
                dx[p, m[p, q]] += d[p, q]
            elif p:
                dx[p - 1, -1] += d[p, q]
    return dx.reshape(n, c, h, w)


def assert_same_bits(got, want, what=""):
    """Equal bit for bit (the sign of zero included); NaNs only where the reference has them."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
    uint = np.uint32 if got.dtype == np.float32 else np.uint64
    bad = (got.view(uint) != want.view(uint)) & ~nan
    assert not bad.any(), (f"{what}: {bad.sum()} cells differ, first at {np.argwhere(bad)[0]}: "
                           f"{got[bad][:3]} != {want[bad][:3]}")


# FAST_CASES's overlapping windows (a cell winning up to 4 or 9), kernels equal to and smaller
# than the stride, padding, ceil mode clipping the last window, and one more padded stride-2 mix.
EXACT_CASES = FAST_CASES + [
    ((2, 3, 9, 8), "kernel_size: 3 stride: 2 pad: 1", (3, 3, 1, 1, 2, 2), True),
]
# Through a mask top: overlapping stride-2 windows, and stride 1 (where float32 sums tell
# Caffe's in-order adds from a float64 sum rounded once).
MASK_CASES = [FAST_CASES[0], next(c for c in FAST_CASES if "stride: 1 pad: 1" in c[1])]


@pytest.mark.parametrize("case", EXACT_CASES, ids=[c[1] for c in EXACT_CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("split", ["one-run", "blocks-3-threads"])
def test_max_backward_sums_as_caffe(case, dtype, split, monkeypatch):
    """Cells winning several windows (planted ties) get the windows' diffs added in Caffe's
    window order from +0; a -0 diff alone gives +0; a NaN or Inf diff reaches only its winner;
    windows with no winner add to the previous plane's last cell in order."""
    from caffepar.nn import pooling
    if split != "one-run":
        monkeypatch.setattr(pooling, "BLOCK_BYTES", 3000)
        monkeypatch.setattr(pooling, "blas_threads", lambda: 3)
    shape, text, geom, ceil_mode = case
    rng = np.random.default_rng(5)
    x = rng.integers(0, 3, shape).astype(dtype)
    x[rng.random(shape) < 0.1] = np.nan
    x[0, 1, :3, :4] = np.nan
    x[-1, 1] = -np.inf
    net = run(net_text("Pooling", shape, f"pooling_param {{ pool: MAX {text} }}"), x, dtype)
    _, mask = ref_pool(x.astype(np.float64), *geom, "MAX", ceil_mode=ceil_mode)
    oshape = net.blobs["y"].shape
    dy = (rng.standard_normal(oshape) * 2.0 ** rng.integers(-4, 5, oshape)).astype(dtype)
    dy[rng.random(oshape) < 0.2] = -0.0
    diffs = {"mixed": dy, "nan": np.where(rng.random(oshape) < 0.05, np.nan, dy),
             "inf": np.where(rng.random(oshape) < 0.05, -np.inf, dy),
             "all -0": np.full(oshape, -0.0)}
    for name, diff in diffs.items():
        diff = diff.astype(dtype)
        net.blobs["y"].diff[...] = diff
        net.backward_from_to()
        want = caffe_max_backward(mask, diff, *shape[2:])
        assert_same_bits(net.blobs["x"].diff, want, name)


@pytest.mark.parametrize("case", MASK_CASES, ids=[c[1] for c in MASK_CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_backward_through_mask_top_sums_as_caffe(case, dtype):
    """With a mask top the diffs go through the mask's indices, summed in dy's dtype in window
    order from +0 (not in float64 and rounded once: 3x3/1 float32 tells them apart)."""
    shape, text, geom, ceil_mode = case
    rng = np.random.default_rng(6)
    x = rng.integers(0, 2, shape).astype(dtype)
    x[-1, 1] = np.nan
    net = run(net_text("Pooling", shape, f"pooling_param {{ pool: MAX {text} }}", ("y", "mask")),
              x, dtype)
    _, mask = ref_pool(x.astype(np.float64), *geom, "MAX", ceil_mode=ceil_mode)
    np.testing.assert_array_equal(net.blobs["mask"].data, mask)
    oshape = net.blobs["y"].shape
    dy = (rng.standard_normal(oshape) * 2.0 ** rng.integers(-12, 13, oshape)).astype(dtype)
    dy[rng.random(oshape) < 0.2] = -0.0
    dy[rng.random(oshape) < 0.05] = np.nan
    net.blobs["y"].diff[...] = dy
    net.backward_from_to()
    assert_same_bits(net.blobs["x"].diff, caffe_max_backward(mask, dy, *shape[2:]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_max_pooling_as_caffe(dtype):
    """Global MAX scans as Caffe: NaN never wins, ties keep the first cell, a plane of -inf has
    no winner (-FLT_MAX out, its diff to the previous plane's last cell); a -0 diff gives +0."""
    shape = (2, 3, 4, 5)
    rng = np.random.default_rng(8)
    x = rng.integers(0, 3, shape).astype(dtype)
    x[0, 0, 0, 0] = np.nan
    x[0, 1] = np.nan
    x[0, 1, 2, 3] = 1
    x[1, 2] = -np.inf
    text = net_text("Pooling", shape, "pooling_param { pool: MAX global_pooling: true }",
                    ("y", "mask"))
    net = run(text, x, dtype)
    want, mask = ref_pool(x.astype(np.float64), 4, 5, 0, 0, 1, 1, "MAX")
    assert_same_bits(net.blobs["y"].data, want.astype(dtype))
    np.testing.assert_array_equal(net.blobs["mask"].data, mask)
    net = run(net_text("Pooling", shape, "pooling_param { pool: MAX global_pooling: true }"),
              x, dtype)
    dy = rng.standard_normal((2, 3, 1, 1)).astype(dtype)
    dy[0, 2] = -0.0
    net.blobs["y"].diff[...] = dy
    net.backward_from_to()
    assert_same_bits(net.blobs["x"].diff, caffe_max_backward(mask, dy, 4, 5))
