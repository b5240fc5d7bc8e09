"""Loss layers and Accuracy: gradient checks in float64 and forward checks against NumPy."""
import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients


def shape_text(shape):
    return "shape { " + " ".join(f"dim: {d}" for d in shape) + " }"


def net_text(layer, inputs, tops=("loss",), extra=""):
    """An Input layer providing `inputs` (name -> shape) and one layer over them."""
    names = "".join(f'  top: "{n}"\n' for n in inputs)
    shapes = " ".join(shape_text(s) for s in inputs.values())
    bottoms = "".join(f'  bottom: "{n}"\n' for n in inputs)
    top_lines = "".join(f'  top: "{t}"\n' for t in tops)
    return (f'force_backward: true\nlayer {{\n  name: "input"\n  type: "Input"\n{names}'
            f"  input_param {{ {shapes} }}\n}}\n"
            f'layer {{\n  name: "l"\n  type: "{layer}"\n{bottoms}{top_lines}{extra}\n}}\n')


def build(text, phase=TEST, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=phase, dtype=dtype)


def run(text, inputs):
    net = build(text)
    for k, v in inputs.items():
        net.blobs[k].data[...] = v
    net.forward()
    return net


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


RNG = np.random.default_rng(0)


# ------------------------------------------------------------------ SoftmaxWithLoss
SWL_CASES = [
    ("", None),
    ("loss_param { normalization: BATCH_SIZE }", None),
    ("loss_param { normalization: FULL }", None),
    ("loss_param { normalization: NONE }", None),
    ("loss_param { normalization: VALID ignore_label: 2 }", 2),
    ("loss_param { normalize: false ignore_label: 1 }", 1),
    ("loss_param { normalize: true }", None),
    ("loss_weight: 2.5", None),
]


def swl_reference(x, label, extra, ignore, axis=1):
    p = np_softmax(x, axis)
    p = np.moveaxis(p, axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    valid = lab != ignore if ignore is not None else np.ones(lab.size, bool)
    loss = -np.log(p[valid, lab[valid]]).sum()
    outer = int(np.prod(x.shape[:axis]))
    if "BATCH_SIZE" in extra or "normalize: false" in extra:
        norm = outer
    elif "FULL" in extra:
        norm = lab.size
    elif "NONE" in extra:
        norm = 1
    else:
        norm = valid.sum()
    lw = 2.5 if "loss_weight" in extra else 1.0
    return loss / max(norm, 1), lw


@pytest.mark.parametrize("extra,ignore", SWL_CASES)
def test_softmax_with_loss(extra, ignore):
    x = RNG.standard_normal((3, 4, 2))
    label = np.array([[0, 2], [1, 3], [2, 2]], float)
    text = net_text("SoftmaxWithLoss", {"x": x.shape, "label": label.shape}, extra=extra)
    net = run(text, {"x": x, "label": label})
    want, lw = swl_reference(x, label, extra, ignore)
    assert net.blobs["loss"].data.shape == ()
    np.testing.assert_allclose(net.blobs["loss"].data, want, rtol=1e-10)
    assert net.blob_loss_weights["loss"] == lw
    check_net_gradients(text, {"x": x, "label": label}, skip_bottoms=("label",))


def test_softmax_with_loss_axis2():
    x = RNG.standard_normal((2, 3, 5))
    label = RNG.integers(0, 5, (2, 3)).astype(float)
    extra = "softmax_param { axis: 2 }"
    text = net_text("SoftmaxWithLoss", {"x": x.shape, "label": label.shape}, extra=extra)
    net = run(text, {"x": x, "label": label})
    want, _ = swl_reference(x, label, "", None, axis=2)
    np.testing.assert_allclose(net.blobs["loss"].data, want, rtol=1e-10)
    check_net_gradients(text, {"x": x, "label": label}, skip_bottoms=("label",))


def test_softmax_with_loss_all_ignored_gives_zero():
    x = RNG.standard_normal((2, 3))
    label = np.array([1.0, 1.0])
    text = net_text("SoftmaxWithLoss", {"x": x.shape, "label": label.shape},
                    extra="loss_param { ignore_label: 1 }")
    net = run(text, {"x": x, "label": label})
    assert float(net.blobs["loss"].data) == 0
    net.backward()
    assert not net.blobs["x"].diff.any()


def test_softmax_with_loss_prob_top():
    """A second top holds the probabilities; only the loss top carries a loss weight."""
    x = RNG.standard_normal((4, 5))
    label = np.array([0, 4, 2, 1], float)
    one = run(net_text("SoftmaxWithLoss", {"x": x.shape, "label": label.shape}),
              {"x": x, "label": label})
    two = run(net_text("SoftmaxWithLoss", {"x": x.shape, "label": label.shape},
                       tops=("loss", "prob")), {"x": x, "label": label})
    np.testing.assert_allclose(two.blobs["prob"].data, np_softmax(x, 1), rtol=1e-12)
    np.testing.assert_allclose(two.blobs["loss"].data, one.blobs["loss"].data)
    assert two.layers[1].loss_weights == (1.0, 0.0)
    one.backward()
    two.backward()
    np.testing.assert_allclose(two.blobs["x"].diff, one.blobs["x"].diff)


def test_softmax_with_loss_label_count_mismatch():
    text = net_text("SoftmaxWithLoss", {"x": (2, 3, 4), "label": (2, 3)})
    with pytest.raises(CaffeparError, match="number of labels"):
        build(text)


# ------------------------------------------------------------------ SigmoidCrossEntropyLoss
@pytest.mark.parametrize("extra,norm", [
    ("", "batch"),
    ("loss_param { normalization: FULL }", "full"),
    ("loss_param { normalization: VALID ignore_label: -1 }", "valid"),
    ("loss_param { normalize: true }", "valid"),
    ("loss_param { normalization: NONE }", "none"),
])
def test_sigmoid_cross_entropy(extra, norm):
    x = RNG.standard_normal((3, 4)) * 3
    t = RNG.integers(0, 2, (3, 4)).astype(float)
    if "ignore_label" in extra:
        t[0, 1] = t[2, 3] = -1
    text = net_text("SigmoidCrossEntropyLoss", {"x": x.shape, "label": t.shape}, extra=extra)
    net = run(text, {"x": x, "label": t})
    valid = t != -1
    sig = 1 / (1 + np.exp(-x))
    per = -(t * np.log(sig) + (1 - t) * np.log(1 - sig))
    denom = {"batch": 3, "full": 12, "valid": valid.sum(), "none": 1}[norm]
    np.testing.assert_allclose(net.blobs["loss"].data, per[valid].sum() / denom, rtol=1e-9)
    check_net_gradients(text, {"x": x, "label": t}, skip_bottoms=("label",))


# ------------------------------------------------------------------ EuclideanLoss
@pytest.mark.parametrize("extra", ["", "loss_weight: 3"])
def test_euclidean(extra):
    a = RNG.standard_normal((3, 2, 2))
    b = RNG.standard_normal((3, 4))
    text = net_text("EuclideanLoss", {"a": a.shape, "b": b.shape}, extra=extra)
    net = run(text, {"a": a, "b": b})
    np.testing.assert_allclose(net.blobs["loss"].data,
                               ((a.reshape(3, -1) - b) ** 2).sum() / 3 / 2)
    check_net_gradients(text, {"a": a, "b": b})


# ------------------------------------------------------------------ HingeLoss
def _away_from_kinks(shape):
    """Values whose hinge terms 1 -+ x stay clear of 0 under a 1e-2 perturbation."""
    return RNG.choice([-2.1, -1.4, -0.6, -0.2, 0.3, 0.7, 1.5, 2.2], size=shape)


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge(norm):
    x = _away_from_kinks((4, 5))
    label = np.array([0, 3, 4, 1], float)
    text = net_text("HingeLoss", {"x": x.shape, "label": label.shape},
                    extra=f"hinge_loss_param {{ norm: {norm} }}")
    net = run(text, {"x": x, "label": label})
    sign = -np.ones_like(x)
    sign[np.arange(4), label.astype(int)] = 1
    margin = np.maximum(0, 1 - sign * x)
    want = margin.sum() / 4 if norm == "L1" else (margin ** 2).sum() / 4
    np.testing.assert_allclose(net.blobs["loss"].data, want)
    check_net_gradients(text, {"x": x, "label": label}, skip_bottoms=("label",))


# ------------------------------------------------------------------ InfogainLoss
def write_h(path, h):
    bp = caffe_pb2.BlobProto()
    bp.shape.dim.extend([1, 1, *h.shape])
    bp.data.extend(h.reshape(-1).tolist())
    path.write_bytes(bp.SerializeToString())


def infogain_reference(x, label, h, axis=1, ignore=None):
    p = np.moveaxis(np_softmax(x, axis), axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    valid = lab != ignore if ignore is not None else np.ones(lab.size, bool)
    loss = -(h[lab[valid]] * np.log(p[valid])).sum()
    return loss / max(valid.sum(), 1)


@pytest.mark.parametrize("extra,ignore", [("", None), ("loss_param { ignore_label: 0 }", 0),
                                          ("loss_param { normalization: FULL }", None)])
def test_infogain_from_file(tmp_path, monkeypatch, extra, ignore):
    h = RNG.uniform(0, 1, (4, 4))
    write_h(tmp_path / "H.binaryproto", h)
    monkeypatch.chdir(tmp_path)
    x = RNG.standard_normal((5, 4))
    label = np.array([0, 1, 3, 2, 0], float)
    text = net_text("InfogainLoss", {"x": x.shape, "label": label.shape},
                    extra='infogain_loss_param { source: "H.binaryproto" }\n' + extra)
    net = run(text, {"x": x, "label": label})
    want = infogain_reference(x, label, h, ignore=ignore)
    np.testing.assert_allclose(net.blobs["loss"].data, want, rtol=1e-6)
    check_net_gradients(text, {"x": x, "label": label}, skip_bottoms=("label",))


def test_infogain_axis_and_third_bottom():
    h = RNG.uniform(0, 1, (3, 3))
    x = RNG.standard_normal((2, 2, 3))
    label = RNG.integers(0, 3, (2, 2)).astype(float)
    text = net_text("InfogainLoss", {"x": x.shape, "label": label.shape, "H": h.shape},
                    extra="infogain_loss_param { axis: 2 }").replace("force_backward: true", "")
    net = run(text, {"x": x, "label": label, "H": h})
    np.testing.assert_allclose(net.blobs["loss"].data, infogain_reference(x, label, h, axis=2),
                               rtol=1e-10)


def test_infogain_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = net_text("InfogainLoss", {"x": (2, 3), "label": (2,)})
    with pytest.raises(CaffeparError, match="source"):
        build(base)
    with pytest.raises(CaffeparError, match="missing.binaryproto"):
        build(base.replace('type: "InfogainLoss"',
                           'type: "InfogainLoss"\n infogain_loss_param { source: '
                           '"missing.binaryproto" }'))
    write_h(tmp_path / "H.binaryproto", np.eye(3))
    with pytest.raises(CaffeparError, match="normalization"):
        build(base.replace('type: "InfogainLoss"',
                           'type: "InfogainLoss"\n infogain_loss_param { source: "H.binaryproto" }'
                           " loss_param { normalize: true }"))


# ------------------------------------------------------------------ MultinomialLogisticLoss
def test_multinomial_logistic():
    p = RNG.uniform(0.2, 1.0, (4, 3))
    label = np.array([0, 2, 1, 1], float)
    text = net_text("MultinomialLogisticLoss", {"x": p.shape, "label": label.shape})
    net = run(text, {"x": p, "label": label})
    np.testing.assert_allclose(net.blobs["loss"].data,
                               -np.log(p[np.arange(4), label.astype(int)]).mean())
    check_net_gradients(text, {"x": p, "label": label}, skip_bottoms=("label",))


# ------------------------------------------------------------------ ContrastiveLoss
@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive(legacy):
    a = RNG.standard_normal((6, 3)) * 0.5
    b = RNG.standard_normal((6, 3)) * 0.5
    y = np.array([1, 0, 1, 0, 0, 0], float)
    margin = 1.5
    d2 = ((a - b) ** 2).sum(1)
    dissim = np.maximum(margin - d2, 0) if legacy else np.maximum(margin - np.sqrt(d2), 0) ** 2
    want = np.where(y == 1, d2, dissim).sum() / 6 / 2
    extra = f"contrastive_loss_param {{ margin: {margin} legacy_version: {str(legacy).lower()} }}"
    text = net_text("ContrastiveLoss", {"a": a.shape, "b": b.shape, "y": y.shape}, extra=extra)
    net = run(text, {"a": a, "b": b, "y": y})
    np.testing.assert_allclose(net.blobs["loss"].data, want)
    # Caffe's gradient for dissimilar pairs divides by (dist + 1e-4), not dist: looser threshold.
    check_net_gradients(text, {"a": a, "b": b, "y": y}, skip_bottoms=("y",),
                        threshold=1e-3 if legacy else 2e-3)


# ------------------------------------------------------------------ Accuracy
def accuracy_reference(x, label, k, axis=1, ignore=None):
    s = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
    lab = label.reshape(-1).astype(int)
    hits, nums = np.zeros(x.shape[axis]), np.zeros(x.shape[axis])
    correct = count = 0
    for row, l in zip(s, lab):
        if ignore is not None and l == ignore:
            continue
        ok = (row >= row[l]).sum() <= k
        correct += ok
        count += 1
        hits[l] += ok
        nums[l] += 1
    per = np.divide(hits, nums, out=np.zeros_like(hits), where=nums > 0)
    return correct / count if count else 0, per


@pytest.mark.parametrize("extra,k,axis,ignore", [
    ("", 1, 1, None),
    ("accuracy_param { top_k: 3 }", 3, 1, None),
    ("accuracy_param { ignore_label: 2 }", 1, 1, 2),
    ("accuracy_param { axis: 2 top_k: 2 }", 2, 2, None),
])
def test_accuracy(extra, k, axis, ignore):
    x = RNG.standard_normal((6, 5, 4)) if axis == 1 else RNG.standard_normal((3, 4, 5))
    x[0, 0] = x[0, 1]  # ties count against the true class
    lab_shape = (6, 4) if axis == 1 else (3, 4)
    label = RNG.integers(0, 5, lab_shape).astype(float)
    text = net_text("Accuracy", {"x": x.shape, "label": label.shape}, tops=("acc", "per"),
                    extra=extra).replace("force_backward: true", "")
    net = run(text, {"x": x, "label": label})
    want, per = accuracy_reference(x, label, k, axis, ignore)
    np.testing.assert_allclose(net.blobs["acc"].data, want)
    np.testing.assert_allclose(net.blobs["per"].data, per)
    assert net.blobs["per"].data.shape == (x.shape[axis],)


def test_accuracy_top_k_too_large():
    text = net_text("Accuracy", {"x": (2, 3), "label": (2,)}, tops=("acc",),
                    extra="accuracy_param { top_k: 4 }").replace("force_backward: true", "")
    with pytest.raises(CaffeparError, match="top_k"):
        build(text)
