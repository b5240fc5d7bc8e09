"""LRN, BatchNorm and MVN: NumPy references for the forward pass, gradient checks."""
import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST, TRAIN
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

pytestmark = pytest.mark.usefixtures("kernel_path")

RNG = np.random.default_rng(5)


def net_text(layer, shape, extra="", top="y", bottom="x", params=""):
    dims = " ".join(f"dim: {d}" for d in shape)
    return (f'force_backward: true\nlayer {{ name: "input" type: "Input" top: "{bottom}"\n'
            f"  input_param {{ shape {{ {dims} }} }} }}\n"
            f'layer {{ name: "l" type: "{layer}" bottom: "{bottom}" top: "{top}" {params}\n'
            f"  {extra} }}\n")


def build(text, phase=TEST, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=phase, dtype=dtype)


def run(text, x, phase=TEST, dtype=np.float64):
    net = build(text, phase, dtype)
    net.blobs["x"].data[...] = x
    net.forward()
    return net


# ------------------------------------------------------------------ LRN
def ref_lrn_across(x, n, alpha, beta, k):
    c = x.shape[1]
    half = (n - 1) // 2
    y = np.empty_like(x)
    for ch in range(c):
        lo, hi = max(0, ch - half), min(c, ch + half + 1)
        s = k + alpha / n * (x[:, lo:hi] ** 2).sum(axis=1)
        y[:, ch] = x[:, ch] * s ** -beta
    return y


def ref_lrn_within(x, n, alpha, beta):
    """Caffe ignores k here: 1 + alpha * mean of x^2 over an n x n window (zeros padded)."""
    half = (n - 1) // 2
    h, w = x.shape[2:]
    y = np.empty_like(x)
    for i in range(h):
        for j in range(w):
            win = x[:, :, max(0, i - half):i + half + 1, max(0, j - half):j + half + 1]
            s = 1 + alpha * (win ** 2).sum(axis=(2, 3)) / (n * n)
            y[:, :, i, j] = x[:, :, i, j] * s ** -beta
    return y


# Values exact in float32, the proto's type for alpha, beta and k.
LRN_ACROSS = [(5, 1.0, 0.75, 1.0), (3, 0.375, 0.5, 2.0), (1, 0.5, 0.75, 1.5), (7, 2.0, 0.875, 1.0)]


@pytest.mark.parametrize("n,alpha,beta,k", LRN_ACROSS)
def test_lrn_across_channels(n, alpha, beta, k):
    shape = (2, 6, 3, 2)
    x = RNG.standard_normal(shape)
    text = net_text("LRN", shape, f"lrn_param {{ local_size: {n} alpha: {alpha} beta: {beta} "
                                  f"k: {k} }}")
    net = run(text, x)
    np.testing.assert_allclose(net.blobs["y"].data, ref_lrn_across(x, n, alpha, beta, k),
                               rtol=1e-12)
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("n,alpha,beta,k", [(3, 1.0, 0.75, 1.0), (5, 0.375, 0.625, 2.0)])
def test_lrn_within_channel(n, alpha, beta, k):
    shape = (2, 2, 5, 6)
    x = RNG.standard_normal(shape)
    text = net_text("LRN", shape, f"lrn_param {{ local_size: {n} alpha: {alpha} beta: {beta} "
                                  f"k: {k} norm_region: WITHIN_CHANNEL }}")
    net = run(text, x)
    np.testing.assert_allclose(net.blobs["y"].data, ref_lrn_within(x, n, alpha, beta),
                               rtol=1e-12)
    check_net_gradients(text, {"x": x})


def ref_lrn_across_backward(x, dy, n, alpha, beta, k):
    """Caffe's across-channel backward written out from the chain rule."""
    c = x.shape[1]
    half = (n - 1) // 2
    scale = np.empty_like(x)
    for ch in range(c):
        lo, hi = max(0, ch - half), min(c, ch + half + 1)
        scale[:, ch] = k + alpha / n * (x[:, lo:hi] ** 2).sum(axis=1)
    ratio = dy * x * scale ** -beta / scale
    dx = dy * scale ** -beta
    for ch in range(c):
        lo, hi = max(0, ch - half), min(c, ch + half + 1)
        dx[:, ch] -= 2 * alpha * beta / n * x[:, ch] * ratio[:, lo:hi].sum(axis=1)
    return dx


@pytest.mark.parametrize("block_bytes", [1, 1400, 1 << 30], ids=["1-image", "few-images", "all"])
@pytest.mark.parametrize("shape,n,beta", [((5, 7, 3, 4), 5, 0.75), ((3, 2, 4, 3), 5, 0.75),
                                          ((4, 6, 2, 5), 3, 0.5), ((3, 6, 3, 3), 5, 1.0),
                                          ((3, 4, 3, 3), 1, 0.625)])
@pytest.mark.parametrize("workers", [1, 2])
def test_lrn_across_blocks_match_reference(shape, n, beta, block_bytes, workers, monkeypatch):
    """The image-blocked forward/backward (and its beta shortcuts) against the formulas,
    including fewer channels than the window, the blocks on one thread or two."""
    from caffepar.nn import blas, normalization
    monkeypatch.setattr(normalization, "LRN_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(blas, "blas_threads", lambda: workers)
    alpha, k = 1.5, 2.0
    x = RNG.standard_normal(shape)
    dy = RNG.standard_normal(shape)
    text = net_text("LRN", shape, f"lrn_param {{ local_size: {n} alpha: {alpha} beta: {beta} "
                                  f"k: {k} }}")
    for dtype, rtol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        net = run(text, x.astype(dtype), dtype=dtype)
        np.testing.assert_allclose(net.blobs["y"].data, ref_lrn_across(x, n, alpha, beta, k),
                                   rtol=rtol, atol=rtol)
        net.blobs["y"].diff[...] = dy
        net.backward_from_to()
        np.testing.assert_allclose(net.blobs["x"].diff,
                                   ref_lrn_across_backward(x, dy, n, alpha, beta, k),
                                   rtol=rtol, atol=rtol)


def test_lrn_even_size_refused():
    with pytest.raises(CaffeparError, match="odd"):
        build(net_text("LRN", (1, 3, 2, 2), "lrn_param { local_size: 4 }"))


# ------------------------------------------------------------------ BatchNorm
def set_bn_stats(net, mean, var, factor):
    b = net.params["l"]
    b[0].data[...] = mean * factor
    b[1].data[...] = var * factor
    b[2].data[...] = factor


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 3), (3, 2, 4)])
def test_batchnorm_train_batch_statistics(shape):
    x = RNG.standard_normal(shape) * 2 + 1
    text = net_text("BatchNorm", shape, "batch_norm_param { moving_average_fraction: 0.9 }")
    net = run(text, x, phase=TRAIN)
    axes = (0,) + tuple(range(2, len(shape)))
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    eps = net.layers[1].eps
    np.testing.assert_allclose(net.blobs["y"].data, (x - mean) / np.sqrt(var + eps), rtol=1e-10)
    m = x.size // shape[1]
    b = net.params["l"]
    np.testing.assert_allclose(b[0].data, mean.reshape(-1))
    np.testing.assert_allclose(b[1].data, var.reshape(-1) * m / (m - 1))
    np.testing.assert_allclose(b[2].data, [1.0])
    net.forward()
    np.testing.assert_allclose(b[0].data, mean.reshape(-1) * 1.9)
    np.testing.assert_allclose(b[2].data, [1.9])
    check_net_gradients(text, {"x": x}, phase=TRAIN)


def test_batchnorm_test_phase_uses_stored_statistics():
    shape = (3, 2, 2, 2)
    x = RNG.standard_normal(shape)
    mean, var = np.array([0.5, -1.0]), np.array([2.0, 0.3])
    text = net_text("BatchNorm", shape, "batch_norm_param { eps: 0.001 }")
    net = build(text)
    set_bn_stats(net, mean, var, 4.0)
    net.blobs["x"].data[...] = x
    net.forward()
    want = (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 0.001)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-6)
    np.testing.assert_allclose(net.params["l"][2].data, [4.0])
    check_net_gradients(text, {"x": x}, check_params=False,
                        prepare=lambda n: set_bn_stats(n, mean, var, 4.0))


def test_batchnorm_zero_scale_factor_means_zero_statistics():
    x = RNG.standard_normal((2, 2, 2, 2))
    net = run(net_text("BatchNorm", x.shape, "batch_norm_param { eps: 0.25 }"), x)
    np.testing.assert_allclose(net.blobs["y"].data, x / 0.5)


def test_batchnorm_use_global_stats_false_in_test_phase():
    x = RNG.standard_normal((4, 2, 3))
    text = net_text("BatchNorm", x.shape, "batch_norm_param { use_global_stats: false }")
    net = run(text, x)
    assert net.params["l"][2].data[0] == 1.0
    np.testing.assert_allclose(net.blobs["y"].data.mean(axis=(0, 2)), 0, atol=1e-12)
    check_net_gradients(text, {"x": x})


def test_batchnorm_in_place_matches_out_of_place():
    shape = (4, 3, 2, 2)
    x = RNG.standard_normal(shape)
    dy = RNG.standard_normal(shape)
    results = []
    for top in ("y", "x"):
        net = run(net_text("BatchNorm", shape, top=top), x, phase=TRAIN)
        results.append(net.blobs[top].data.copy())
        net.blobs[top].diff[...] = dy
        net.backward_from_to()
        results.append(net.blobs["x"].diff.copy())
    np.testing.assert_allclose(results[2], results[0])
    np.testing.assert_allclose(results[3], results[1])


CHAIN = """force_backward: true
layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 3 dim: 37 dim: 9 dim: 11 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
  convolution_param { num_output: 37 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" }
layer { name: "scale" type: "Scale" bottom: "c" top: "c" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "c" top: "c" }
"""


def chain_net(dtype, low, high):
    """CHAIN in training with parameters uniform in [low, high) (constant fillers first: no
    draws from the fillers' global generator)."""
    net = build(CHAIN, TRAIN, dtype)
    for name, p in net.params.items():
        for i, b in enumerate(p):
            b.data[...] = np.random.default_rng(i + len(name)).uniform(low, high, b.shape)
    return net


def two_iterations(net, x, dy):
    """Two forward-backward passes; the top, input diff, parameter diffs and BatchNorm's
    running statistics after them."""
    net.blobs["x"].data[...] = x
    for _ in range(2):
        net.forward()
        net.blobs["c"].diff[...] = dy
        net.clear_param_diffs()
        net.backward()
    return [net.blobs["c"].data.copy(), net.blobs["x"].diff.copy()] + \
        [b.diff.copy() for p in net.params.values() for b in p] + \
        [b.data.copy() for b in net.params["bn"]]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_batchnorm_and_scale_match_the_numpy_code(dtype):
    """The in-place conv -> BatchNorm -> Scale -> ReLU chain of published nets, training: the
    compiled kernels (channel ranges side by side, sums in double) give the NumPy code's tops,
    diffs, parameter diffs and running statistics."""
    from caffepar.nn import native
    x = RNG.standard_normal((3, 37, 9, 11))
    dy = RNG.standard_normal((3, 37, 9, 11))
    found = {}
    for path in ("numpy", "native"):
        with native.use(path):
            net = chain_net(dtype, 0.5, 1.5)
            net.params["conv"][1].data[...] += 2        # a mean far from 0 for BatchNorm
            found[path] = two_iterations(net, x, dy)
    tol = 2e-4 if dtype == np.float32 else 1e-10
    for got, want in zip(found["native"], found["numpy"]):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batchnorm_applies_the_scale_after_it_in_training(dtype):
    """Training's in-place BatchNorm -> Scale: the BatchNorm writes the Scale's map as it
    normalizes and finishes the Scale's diff in its backward; every blob, diff, parameter
    diff and running statistic is what the two layers give run apart (a net with a hook runs
    layer by layer, nothing fused), a channel of scale 0 included, and a backward that stops
    at the Scale leaves the Scale's own diff."""
    from caffepar.nn import native
    applied = native.kernels_for(np.zeros(2, dtype)) is not None    # NumPy's path: apart
    x = RNG.standard_normal((3, 37, 9, 11))
    dy = RNG.standard_normal((3, 37, 9, 11))
    found = {}
    for fused in (True, False):
        net = chain_net(dtype, -1.5, 1.5)
        net.params["scale"][0].data[5] = 0
        net.params["bn"][2].data[...] = 1
        net.params["bn"][1].data[...] = 1
        if not fused:
            net.after_forward(lambda i: None)
        found[fused] = two_iterations(net, x, dy)
        applies = fused and applied
        assert net.layers[net.layer_index("bn")].scaled == applies
        assert net.forward_host(net.layer_index("scale")) == (net.layer_index("bn") if applies
                                                               else None)
        net.blobs["c"].diff[...] = dy
        net.backward(end="scale")       # the BatchNorm does not run: the Scale writes its diff
        found[fused].append(net.blobs["c"].diff.copy())
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for got, want in zip(found[True], found[False]):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(found[True][-1][:, 5], 0)


def test_batchnorm_statistics_are_not_learned():
    net = build(net_text("BatchNorm", (2, 3)))
    assert [m[0] for m in net.lr_mults] == [0.0, 0.0, 0.0]
    with pytest.raises(CaffeparError, match="batch normalization statistics"):
        build(net_text("BatchNorm", (2, 3), params="param { lr_mult: 1 }"))
    build(net_text("BatchNorm", (2, 3), params="param { lr_mult: 0 } param { lr_mult: 0 }"))


# ------------------------------------------------------------------ MVN
@pytest.mark.parametrize("extra", ["", "mvn_param { normalize_variance: false }",
                                   "mvn_param { across_channels: true }",
                                   "mvn_param { across_channels: true normalize_variance: false }"])
def test_mvn(extra):
    shape = (2, 3, 3, 2)
    x = RNG.standard_normal(shape) * 3 + 2
    text = net_text("MVN", shape, extra)
    net = run(text, x)
    axes = (1, 2, 3) if "across_channels: true" in extra else (2, 3)
    want = x - x.mean(axis=axes, keepdims=True)
    if "normalize_variance: false" not in extra:
        want = want / (np.sqrt((want ** 2).mean(axis=axes, keepdims=True)) + 1e-9)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-8)
    check_net_gradients(text, {"x": x})


def test_mvn_top_is_four_dimensional():
    x = RNG.standard_normal((3, 5))
    net = run(net_text("MVN", x.shape, "mvn_param { across_channels: true }"), x)
    assert net.blobs["y"].shape == (3, 5, 1, 1)
    want = (x - x.mean(1, keepdims=True)) / (x.std(1, keepdims=True) + 1e-9)
    np.testing.assert_allclose(net.blobs["y"].data[..., 0, 0], want, rtol=1e-8)
