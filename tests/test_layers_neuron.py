"""Neuron layers: numeric gradient checks, forward against NumPy references, Dropout masks."""
import numpy as np
import pytest

from caffepar import common
from caffepar.errors import CaffeparError
from caffepar.graph.net import TEST, TRAIN, Net
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

pytestmark = pytest.mark.usefixtures("kernel_path")

SHAPE = (2, 3, 4, 5)


def net_text(layer_type, params="", shape=SHAPE, in_place=False, force=True):
    """Input x -> layer -> y. In-place runs on a copy of x (an identity Power layer first), so
    the net input survives the forward pass and the gradient checker can perturb it."""
    dims = " ".join(f"dim: {d}" for d in shape)
    bottom = "y" if in_place else "x"
    copy = 'layer { name: "copy" type: "Power" bottom: "x" top: "y" }' if in_place else ""
    return f"""
name: "t"
force_backward: {"true" if force else "false"}
layer {{ name: "input" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}
{copy}
layer {{ name: "l" type: "{layer_type}" bottom: "{bottom}" top: "y" {params} }}
"""


def build(text, phase=TEST, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=phase, dtype=dtype)


def run_forward(text, x, phase=TEST):
    net = build(text, phase)
    net.blobs["x"].data[...] = x
    net.forward_from_to()
    return net, net.blobs["y"].data.copy()


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape or SHAPE)


def away_from(x, points, gap=0.05):
    """Moves values within `gap` of any kink to gap beyond it, so differences stay one-sided."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


def f32(v):
    """A prototxt float as the layer sees it (the schema stores float32)."""
    return float(np.float32(v))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------- ReLU
@pytest.mark.parametrize("slope", [0.0, 0.3])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu(slope, in_place):
    text = net_text("ReLU", f"relu_param {{ negative_slope: {slope} }}", in_place=in_place)
    x = away_from(randn(), [0])
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, np.where(x > 0, x, slope * x))
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("slope", [0.0, 0.25])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu_chunked_passes(slope, in_place, monkeypatch):
    """Chunks that do not divide the blob (last one short) give the one-shot formulas, with
    Caffe's x > 0 test (0 and NaN go to the negative side in backward)."""
    from caffepar.nn import neuron
    monkeypatch.setattr(neuron, "CHUNK", 7)
    text = net_text("ReLU", f"relu_param {{ negative_slope: {slope} }}", in_place=in_place)
    x = randn()
    x.flat[:3] = [0.0, np.nan, -0.0]
    net, y = run_forward(text, x)
    np.testing.assert_array_equal(y, np.maximum(x, 0) + slope * np.minimum(x, 0))
    dy = randn(seed=1)
    net.blobs["y"].diff[...] = dy
    net.backward_from_to()
    np.testing.assert_array_equal(net.blobs["x"].diff, dy * np.where(x > 0, 1, slope))


# ---------------------------------------------------------------- PReLU
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_prelu_gradients(shared, in_place):
    params = (f"prelu_param {{ channel_shared: {str(shared).lower()} "
              "filler { type: 'uniform' min: -0.5 max: 0.5 } }")
    text = net_text("PReLU", params, in_place=in_place)
    x = away_from(randn(seed=1), [0])
    net, y = run_forward(text, x)
    a = net.params["l"][0].data
    assert a.shape == (() if shared else (3,))
    slope = a if shared else a.reshape(1, 3, 1, 1)
    np.testing.assert_allclose(y, np.maximum(x, 0) + slope * np.minimum(x, 0))
    check_net_gradients(text, {"x": x})


def test_prelu_default_filler_and_2d():
    text = net_text("PReLU", shape=(4, 6))
    net, y = run_forward(text, away_from(randn(4, 6), [0]))
    np.testing.assert_array_equal(net.params["l"][0].data, np.full(6, 0.25))
    check_net_gradients(text, {"x": away_from(randn(4, 6, seed=3), [0])})


def test_prelu_needs_two_axes():
    with pytest.raises(CaffeparError, match="2 axes"):
        build(net_text("PReLU", shape=(5,)))


# ---------------------------------------------------------------- smooth functions
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_elu(alpha):
    text = net_text("ELU", f"elu_param {{ alpha: {alpha} }}")
    x = away_from(randn(), [0])
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, np.where(x > 0, x, alpha * (np.exp(x) - 1)))
    check_net_gradients(text, {"x": x})
    check_net_gradients(net_text("ELU", f"elu_param {{ alpha: {alpha} }}", in_place=True),
                        {"x": x})


@pytest.mark.parametrize("in_place", [False, True])
def test_sigmoid(in_place):
    text = net_text("Sigmoid", in_place=in_place)
    x = randn() * 3
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, sigmoid(x))
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("in_place", [False, True])
def test_tanh(in_place):
    text = net_text("TanH", in_place=in_place)
    x = randn()
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, np.tanh(x))
    check_net_gradients(text, {"x": x})


def test_sigmoid_extremes_are_finite():
    _, y = run_forward(net_text("Sigmoid", shape=(4,)), np.array([-1e4, -50.0, 50.0, 1e4]))
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, [0, 0, 1, 1], atol=1e-20)


def test_absval():
    text = net_text("AbsVal")
    x = away_from(randn(), [0])
    _, y = run_forward(text, x)
    np.testing.assert_array_equal(y, np.abs(x))
    check_net_gradients(text, {"x": x})


def test_absval_refuses_in_place():
    with pytest.raises(CaffeparError, match="in-place"):
        build(net_text("AbsVal", in_place=True))


def test_bnll():
    text = net_text("BNLL")
    x = randn() * 3
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, np.log1p(np.exp(x)))
    check_net_gradients(text, {"x": x})
    _, big = run_forward(net_text("BNLL", shape=(2,)), np.array([-800.0, 800.0]))
    np.testing.assert_allclose(big, [0.0, 800.0])


@pytest.mark.parametrize("beta", [1.0, 2.0, 0.5])
def test_swish(beta):
    text = net_text("Swish", f"swish_param {{ beta: {beta} }}")
    x = randn() * 2
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, x * sigmoid(beta * x))
    check_net_gradients(text, {"x": x})
    check_net_gradients(net_text("Swish", f"swish_param {{ beta: {beta} }}", in_place=True),
                        {"x": x})


# ---------------------------------------------------------------- Power / Exp / Log
@pytest.mark.parametrize("power,scale,shift,lo", [
    (1.0, 1.0, 0.0, None), (2.0, 0.5, 1.0, None), (1.0, 2.0, -1.0, None), (0.0, 1.0, 0.0, None),
    (3.0, 1.0, 0.0, 0.1), (0.5, 1.0, 3.0, 0.0), (-1.5, 2.0, 0.5, 0.2), (2.0, 0.0, 3.0, None),
    (2.0, 1.5, 0.0, None)])
def test_power(power, scale, shift, lo):
    text = net_text("Power", f"power_param {{ power: {power} scale: {scale} shift: {shift} }}")
    x = randn(seed=4)
    if lo is not None:
        x = lo + np.abs(x)
    _, y = run_forward(text, x)
    want = np.ones_like(x) if power == 0 else (shift + scale * x) ** power
    np.testing.assert_allclose(y, want, rtol=1e-12)
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("base,scale,shift", [(-1, 1, 0), (2.0, 0.5, 0.1), (10.0, -1.0, 2.0),
                                              (-1, 0.5, -0.3)])
def test_exp(base, scale, shift):
    text = net_text("Exp", f"exp_param {{ base: {base} scale: {scale} shift: {shift} }}")
    x = randn(seed=5)
    _, y = run_forward(text, x)
    b = np.e if base == -1 else base
    np.testing.assert_allclose(y, b ** (f32(shift) + f32(scale) * x), rtol=1e-12)
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("base,scale,shift", [(-1, 1, 0), (10.0, 2.0, 0.5), (2.0, 0.5, 1.0)])
def test_log(base, scale, shift):
    text = net_text("Log", f"log_param {{ base: {base} scale: {scale} shift: {shift} }}")
    x = 0.5 + np.abs(randn(seed=6))
    _, y = run_forward(text, x)
    b = np.e if base == -1 else base
    np.testing.assert_allclose(y, np.log(f32(shift) + f32(scale) * x) / np.log(b), rtol=1e-12)
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("layer", ["Exp", "Log"])
def test_exp_log_reject_bad_base(layer):
    with pytest.raises(CaffeparError, match="base"):
        build(net_text(layer, f"{layer.lower()}_param {{ base: -2 }}"))


# ---------------------------------------------------------------- Threshold / Clip
def test_threshold_forward_only():
    text = net_text("Threshold", "threshold_param { threshold: 0.3 }", force=False)
    x = randn()
    _, y = run_forward(text, x)
    np.testing.assert_array_equal(y, (x > 0.3).astype(float))
    with pytest.raises(CaffeparError, match="backpropagate"):
        build(net_text("Threshold")).backward_from_to()


def test_clip():
    text = net_text("Clip", "clip_param { min: -0.5 max: 0.8 }")
    x = away_from(randn() * 2, [-0.5, 0.8])
    _, y = run_forward(text, x)
    np.testing.assert_array_equal(y, np.clip(x, -0.5, f32(0.8)))
    check_net_gradients(text, {"x": x})


# ---------------------------------------------------------------- Dropout
def test_dropout_test_phase_is_identity():
    text = net_text("Dropout", "dropout_param { dropout_ratio: 0.7 }")
    x = randn()
    _, y = run_forward(text, x)
    np.testing.assert_array_equal(y, x)
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_train_mask_and_scale(in_place):
    ratio = 0.3
    text = net_text("Dropout", f"dropout_param {{ dropout_ratio: {ratio} }}", shape=(200, 500),
                    in_place=in_place)
    common.set_random_seed(11)
    net = build(text, TRAIN, np.float32)
    x = np.random.default_rng(1).uniform(1, 2, (200, 500)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward_from_to()
    out = "y"
    y = net.blobs[out].data.copy()
    kept = y != 0
    assert abs(1 - kept.mean() - ratio) < 0.01
    np.testing.assert_allclose(y[kept], x[kept] * np.float32(1 / (1 - ratio)), rtol=1e-6)
    dy = np.random.default_rng(2).standard_normal((200, 500)).astype(np.float32)
    net.blobs[out].diff[...] = dy
    net.backward_from_to()
    dx = net.blobs["x"].diff
    np.testing.assert_array_equal(dx[~kept], 0)
    np.testing.assert_allclose(dx[kept], dy[kept] * np.float32(1 / (1 - ratio)), rtol=1e-6)


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_scale_train_false(in_place):
    """caffe-fast-rcnn's `scale_train: false` (its Fast R-CNN test nets set it): TRAIN keeps
    the kept values as they are, TEST multiplies by 1 - ratio; both directions, and the
    gradients by numeric check."""
    ratio = 0.3
    text = net_text("Dropout", f"dropout_param {{ dropout_ratio: {ratio} scale_train: false }}",
                    in_place=in_place)
    x = randn()
    _, y = run_forward(text, x)
    np.testing.assert_allclose(y, x * (1 - f32(ratio)), rtol=1e-12)
    check_net_gradients(text, {"x": x})
    common.set_random_seed(11)
    net = build(text, TRAIN, np.float32)
    net.blobs["x"].data[...] = x
    net.forward_from_to()
    y = net.blobs["y"].data.copy()
    kept = y != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_array_equal(y[kept], x.astype(np.float32)[kept])
    dy = randn(seed=2).astype(np.float32)
    net.blobs["y"].diff[...] = dy
    net.backward_from_to()
    np.testing.assert_array_equal(net.blobs["x"].diff, np.where(kept, dy, 0))


def test_dropout_train_gradient_with_fixed_mask():
    """Re-seeding before every forward keeps the mask fixed, so the numeric check applies."""
    text = net_text("Dropout", "dropout_param { dropout_ratio: 0.4 }")

    class Reseed:
        def __init__(self, layer):
            self.layer, self.forward = layer, layer.forward

        def __call__(self, bottom, top):
            common.set_random_seed(3)
            self.forward(bottom, top)

    def prepare(net):
        layer = net.layer_dict["l"]
        layer.forward = Reseed(layer)

    net = check_net_gradients(text, {"x": randn()}, phase=TRAIN, prepare=prepare)
    assert 0 < np.mean(net.blobs["y"].data == 0) < 1


def test_dropout_seed_reproducible():
    text = net_text("Dropout", shape=(50,))
    masks = []
    for _ in range(2):
        common.set_random_seed(5)
        net = build(text, TRAIN)
        net.blobs["x"].data[...] = 1
        net.forward_from_to()
        masks.append(net.blobs["y"].data.copy())
    np.testing.assert_array_equal(masks[0], masks[1])


@pytest.mark.parametrize("in_place", [False, True])
def test_dropout_chunked_mask_is_the_one_shot_draw(in_place, monkeypatch):
    """Drawing the uniforms a chunk at a time continues the same random stream, so masks do
    not depend on the chunk size."""
    from caffepar.nn import neuron
    monkeypatch.setattr(neuron, "CHUNK", 13)
    ratio = 0.375
    text = net_text("Dropout", f"dropout_param {{ dropout_ratio: {ratio} }}", in_place=in_place)
    common.set_random_seed(9)
    net = build(text, TRAIN, np.float32)
    x = randn().astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward_from_to()
    keep = np.random.default_rng(9).random(SHAPE, dtype=np.float32) >= np.float32(ratio)
    scale = np.float32(1 / (1 - ratio))
    np.testing.assert_array_equal(net.blobs["y"].data, x * keep * scale)
    dy = randn(seed=4).astype(np.float32)
    net.blobs["y"].diff[...] = dy
    net.backward_from_to()
    np.testing.assert_array_equal(net.blobs["x"].diff, dy * keep * scale)


def test_dropout_rejects_bad_ratio():
    with pytest.raises(CaffeparError, match="dropout_ratio"):
        build(net_text("Dropout", "dropout_param { dropout_ratio: 1.0 }"))


def test_float32_stays_float32():
    for layer in ["ReLU", "Sigmoid", "TanH", "ELU", "Swish", "BNLL", "Exp", "AbsVal"]:
        net = build(net_text(layer), dtype=np.float32)
        net.blobs["x"].data[...] = randn()
        net.forward_from_to()
        net.blobs["y"].diff[...] = 1
        net.backward_from_to()
        assert net.blobs["y"].data.dtype == np.float32
        assert net.blobs["x"].diff.dtype == np.float32
