"""SSD fork layers (Permute, PriorBox, Normalize, DetectionOutput): forward against plain
NumPy/Python references written from the fork's definitions, gradient checks, and one-line
errors naming the layer."""
import math

import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

RNG = np.random.default_rng(20)


def one_layer(layer, shapes, extra, bottoms=("x",), top="y"):
    inputs = "".join(
        f'layer {{ name: "in_{b}" type: "Input" top: "{b}" input_param {{ shape {{ '
        + " ".join(f"dim: {d}" for d in s) + " } } }\n" for b, s in zip(bottoms, shapes))
    bl = " ".join(f'bottom: "{b}"' for b in bottoms)
    return (f"force_backward: true\n{inputs}"
            f'layer {{ name: "l" type: "{layer}" {bl} top: "{top}"\n  {extra} }}\n')


def build(text, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST, dtype=dtype)


def run(text, values, dtype=np.float64):
    net = build(text, dtype)
    for name, v in values.items():
        net.blobs[name].data[...] = v
    net.forward()
    return net


# ------------------------------------------------------------------ Permute
@pytest.mark.parametrize("order,full", [((0, 2, 3, 1), (0, 2, 3, 1)), ((1, 0), (1, 0, 2, 3)),
                                        ((3, 1), (3, 1, 0, 2))])
def test_permute_forward_and_gradient(order, full):
    shape = (2, 3, 4, 5)
    x = RNG.standard_normal(shape)
    text = one_layer("Permute", [shape], "permute_param { "
                     + " ".join(f"order: {o}" for o in order) + " }")
    net = run(text, {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data, x.transpose(full))
    check_net_gradients(text, {"x": x})


def test_permute_bad_order_names_layer():
    text = one_layer("Permute", [(2, 3)], "permute_param { order: 1 order: 1 }")
    with pytest.raises(CaffeparError, match=r'layer "l".*order names axis 1 twice'):
        build(text)


# ------------------------------------------------------------------ Normalize
def ref_normalize(x, across_spatial, scale, eps):
    n, c = x.shape[:2]
    y = np.empty_like(x)
    for i in range(n):
        if across_spatial:
            y[i] = x[i] / math.sqrt(float((x[i] ** 2).sum()) + eps)
        else:
            y[i] = x[i] / np.sqrt((x[i] ** 2).sum(axis=0, keepdims=True) + eps)
    return y * np.asarray(scale).reshape((1, -1) + (1,) * (x.ndim - 2))


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_normalize_forward_and_gradient(across, shared):
    shape = (2, 3, 3, 2)
    x = RNG.standard_normal(shape)
    filler = 'scale_filler { type: "gaussian" std: 1 }'
    text = one_layer("Normalize", [shape],
                     f"norm_param {{ across_spatial: {str(across).lower()} "
                     f"channel_shared: {str(shared).lower()} eps: 0.001 {filler} }}")
    net = run(text, {"x": x})
    scale = net.params["l"][0].data
    assert scale.shape == (() if shared else (3,))
    np.testing.assert_allclose(net.blobs["y"].data,
                               ref_normalize(x, across, scale, float(np.float32(0.001))),
                               rtol=1e-12)
    check_net_gradients(text, {"x": x})


def test_normalize_default_scale_is_one():
    text = one_layer("Normalize", [(1, 4, 2, 2)], "norm_param { channel_shared: false }")
    assert np.array_equal(build(text).params["l"][0].data, np.ones(4))


# ------------------------------------------------------------------ PriorBox
def ref_priors(fh, fw, ih, iw, min_sizes, max_sizes=(), ratios=(), flip=True, clip=False,
               variance=(0.1,), step=None, offset=0.5):
    """The fork's loops, literally, in Python floats."""
    ars = [1.0]
    for r in ratios:
        if all(abs(r - a) >= 1e-6 for a in ars):
            ars.append(r)
            if flip:
                ars.append(1 / r)
    sw = step[1] if step else iw / fw
    sh = step[0] if step else ih / fh
    out = []
    for h in range(fh):
        for w in range(fw):
            cx, cy = (w + offset) * sw, (h + offset) * sh
            for s, m in enumerate(min_sizes):
                m = int(m)
                boxes = [(m, m)]
                if max_sizes:
                    side = math.sqrt(m * int(max_sizes[s]))
                    boxes.append((side, side))
                boxes += [(m * math.sqrt(a), m / math.sqrt(a)) for a in ars if abs(a - 1) >= 1e-6]
                for bw, bh in boxes:
                    out += [(cx - bw / 2) / iw, (cy - bh / 2) / ih, (cx + bw / 2) / iw,
                            (cy + bh / 2) / ih]
    out = np.array(out)
    if clip:
        out = out.clip(0, 1)
    var = np.resize(np.array(variance), out.size)
    return np.stack([out, var])[None]


PRIOR_CASES = [
    ("min_size: 60 aspect_ratio: 2 variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2",
     dict(min_sizes=[60], ratios=[2], variance=(0.1, 0.1, 0.2, 0.2)), (19, 19), (300, 300)),
    ("min_size: 30 max_size: 60 aspect_ratio: 2 aspect_ratio: 3 aspect_ratio: 2 clip: true",
     dict(min_sizes=[30], max_sizes=[60], ratios=[2, 3], clip=True), (5, 4), (40, 32)),
    ("min_size: 8 min_size: 16 max_size: 12 max_size: 20 aspect_ratio: 0.5 flip: false "
     "step: 8 offset: 0.25 img_size: 32", dict(min_sizes=[8, 16], max_sizes=[12, 20],
                                               ratios=[0.5], flip=False, step=(8, 8),
                                               offset=0.25), (4, 4), (32, 32)),
    ("min_size: 10 step_h: 4 step_w: 6 img_h: 20 img_w: 30 variance: 0.5",
     dict(min_sizes=[10], step=(4, 6), variance=(0.5,)), (3, 5), (20, 30)),
]


@pytest.mark.parametrize("params,ref,feature,image", PRIOR_CASES)
def test_priorbox_matches_the_forks_loops(params, ref, feature, image):
    text = one_layer("PriorBox", [(1, 2) + feature, (1, 3) + image],
                     f"prior_box_param {{ {params} }}", bottoms=("f", "img"))
    net = run(text, {}, dtype=np.float32)
    if "img_size" in params or "img_h" in params:
        ref = dict(ref)
    want = ref_priors(*feature, *image, **ref)
    assert net.blobs["y"].shape == want.shape
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=2e-6, atol=2e-7)


def test_priorbox_first_box_of_mobilenet_ssd_conv11():
    """A value worked by hand: 300x300 image, 19x19 map, min_size 60: step 300/19, so the first
    box is centred at 150/19 pixels, 30 pixels each way."""
    text = one_layer("PriorBox", [(1, 2, 19, 19), (1, 3, 300, 300)],
                     "prior_box_param { min_size: 60 }", bottoms=("f", "img"))
    y = run(text, {}, dtype=np.float32).blobs["y"].data
    c = 150 / 19
    np.testing.assert_allclose(y[0, 0, :4], [(c - 30) / 300, (c - 30) / 300, (c + 30) / 300,
                                             (c + 30) / 300], rtol=1e-6)
    assert np.all(y[0, 1] == np.float32(0.1))


def test_priorbox_without_min_size_is_one_line_naming_the_layer():
    text = one_layer("PriorBox", [(1, 2, 3, 3), (1, 3, 9, 9)], "prior_box_param { clip: true }",
                     bottoms=("f", "img"))
    with pytest.raises(CaffeparError) as e:
        build(text)
    assert 'layer "l" (PriorBox)' in str(e.value) and "min_size" in str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ DetectionOutput
def ref_detections(loc, conf, prior, num_classes, share=True, background=0, nms=0.45,
                   top_k=-1, keep_top_k=-1, threshold=None, code="CENTER_SIZE",
                   in_target=False, clip=False, eta=1.0):
    """The fork's DetectionOutput, box by box, in float32 scalars."""
    f = np.float32
    n = loc.shape[0]
    p = prior.shape[-1] // 4
    cl = 1 if share else num_classes
    pri = prior.reshape(2, p, 4)

    def decode(pb, var, lb):
        if in_target:
            var = [f(1)] * 4
        if code == "CORNER":
            return [f(pb[k] + f(var[k] * lb[k])) for k in range(4)]
        pw, ph = f(pb[2] - pb[0]), f(pb[3] - pb[1])
        if code == "CORNER_SIZE":
            size = [pw, ph, pw, ph]
            return [f(pb[k] + f(f(var[k] * lb[k]) * size[k])) for k in range(4)]
        cx = f(f(f(var[0] * lb[0]) * pw) + f(f(pb[0] + pb[2]) / f(2)))
        cy = f(f(f(var[1] * lb[1]) * ph) + f(f(pb[1] + pb[3]) / f(2)))
        w = f(math.exp(float(f(var[2] * lb[2]))) * float(pw))
        h = f(math.exp(float(f(var[3] * lb[3]))) * float(ph))
        return [f(cx - w / f(2)), f(cy - h / f(2)), f(cx + w / f(2)), f(cy + h / f(2))]

    def size(b):
        return f(0) if b[2] < b[0] or b[3] < b[1] else f(f(b[2] - b[0]) * f(b[3] - b[1]))

    def iou(a, b):
        w = f(min(a[2], b[2]) - max(a[0], b[0]))
        h = f(min(a[3], b[3]) - max(a[1], b[1]))
        if not (w > 0 and h > 0):
            return f(0)
        inter = f(w * h)
        return f(inter / f(f(size(a) + size(b)) - inter))

    thr = f(threshold) if threshold is not None else -np.finfo(f).max
    rows = []
    for i in range(n):
        lp = loc[i].reshape(p, cl, 4).astype(f)
        cs = conf[i].reshape(p, num_classes).astype(f)
        found = []
        for c in range(num_classes):
            if c == background:
                continue
            boxes = [decode(pri[0, j], pri[1, j], lp[j, 0 if share else c]) for j in range(p)]
            if clip:
                boxes = [[min(max(v, f(0)), f(1)) for v in b] for b in boxes]
            cand = sorted((j for j in range(p) if cs[j, c] > thr), key=lambda j: (-cs[j, c], j))
            if top_k > -1:
                cand = cand[:top_k]
            kept = []
            adaptive = f(nms)
            for j in cand:
                if all(iou(boxes[j], boxes[k]) <= adaptive for k in kept):
                    kept.append(j)
                    if eta < 1 and adaptive > 0.5:
                        adaptive = f(adaptive * f(eta))
            found += [(c, j, boxes[j]) for j in kept]
        if -1 < keep_top_k < len(found):
            order = sorted(range(len(found)), key=lambda t: (-cs[found[t][1], found[t][0]], t))
            found = [found[t] for t in sorted(order[:keep_top_k])]
        rows += [[i, c, cs[j, c], *b] for c, j, b in found]
    if not rows:
        return np.array([[i] + [-1] * 6 for i in range(n)], f)
    return np.array(rows, f)


def ssd_inputs(n, p, c, cl=1, seed=0, spread=0.3):
    rng = np.random.default_rng(seed)
    centers = rng.uniform(0.2, 0.8, (p, 2))
    sizes = rng.uniform(0.1, 0.4, (p, 2))
    prior = np.concatenate([centers - sizes / 2, centers + sizes / 2], axis=1).reshape(-1)
    var = np.tile([0.1, 0.1, 0.2, 0.2], p)
    priors = np.stack([prior, var])[None].astype(np.float32)
    loc = (rng.standard_normal((n, p * cl * 4)) * spread).astype(np.float32)
    logits = rng.standard_normal((n, p, c)) * 2
    conf = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return loc, conf.reshape(n, -1).astype(np.float32), priors


def detection_net(n, p, c, params, cl=1):
    return one_layer("DetectionOutput", [(n, p * cl * 4), (n, p * c), (1, 2, p * 4)],
                     f"detection_output_param {{ num_classes: {c} {params} }}",
                     bottoms=("loc", "conf", "prior"))


DET_CASES = [
    ("nms_param { nms_threshold: 0.45 top_k: 20 } code_type: CENTER_SIZE keep_top_k: 15 "
     "confidence_threshold: 0.2", dict(nms=0.45, top_k=20, keep_top_k=15, threshold=0.2), 1),
    ("nms_param { nms_threshold: 0.3 } code_type: CORNER", dict(nms=0.3, code="CORNER"), 1),
    ("nms_param { nms_threshold: 0.5 top_k: 10 } code_type: CORNER_SIZE "
     "variance_encoded_in_target: true background_label_id: 2",
     dict(nms=0.5, top_k=10, code="CORNER_SIZE", in_target=True, background=2), 1),
    ("share_location: false nms_param { nms_threshold: 0.4 } code_type: CENTER_SIZE "
     "keep_top_k: 7 background_label_id: -1", dict(share=False, nms=0.4, keep_top_k=7,
                                                   background=-1), 4),
    ("nms_param { nms_threshold: 0.9 eta: 0.8 } code_type: CENTER_SIZE",
     dict(nms=0.9, eta=0.8), 1),
    # clip is OpenCV's field (the res10 face detector's prototxt sets it).
    ("nms_param { nms_threshold: 0.45 top_k: 30 } code_type: CENTER_SIZE clip: true",
     dict(nms=0.45, top_k=30, clip=True), 1),
    # Scores rounded to tenths: ties at the top_k cut, kept by index.
    ("nms_param { nms_threshold: 0.6 top_k: 12 } code_type: CENTER_SIZE",
     dict(nms=0.6, top_k=12, tenths=True), 1),
]


@pytest.mark.parametrize("params,ref,cl", DET_CASES)
def test_detection_output_matches_reference(params, ref, cl):
    n, p, c = 2, 40, 4
    cl = c if cl > 1 else 1
    loc, conf, prior = ssd_inputs(n, p, c, cl)
    ref = dict(ref)
    if ref.pop("tenths", False):
        conf = np.round(conf, 1)
    net = run(detection_net(n, p, c, params, cl), {"loc": loc, "conf": conf, "prior": prior},
              dtype=np.float32)
    got = net.blobs["y"].data
    want = ref_detections(loc, conf, prior, c, **ref)
    assert got.shape == (1, 1, len(want), 7)
    assert len(want) > 5
    if ref.get("clip"):
        assert np.any((want[:, 3:] == 0) | (want[:, 3:] == 1))
    np.testing.assert_array_equal(got[0, 0, :, :3], want[:, :3])
    np.testing.assert_allclose(got[0, 0, :, 3:], want[:, 3:], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("table", [True, False])
def test_nms_compiled_and_numpy_are_the_same(table, monkeypatch):
    """The compiled NMS (each candidate against the kept boxes), the NumPy one with all
    overlaps at once and, past PAIRWISE_MAX, the NumPy one computing each kept box's overlaps
    as it goes: the same detections bit for bit, with tied scores, eta < 1, top_k and
    keep_top_k cutting, and a NaN box (the compiled path leaves that class to NumPy)."""
    from caffepar.nn import native, ssd
    if native.kernels(np.float32) is None:
        pytest.skip("no compiled kernels on this machine")
    loc, conf, prior = ssd_inputs(2, 300, 4, spread=0.1)
    conf = np.round(conf, 2)                    # many tied scores
    loc[1, 17] = np.nan
    feed = {"loc": loc, "conf": conf, "prior": prior}
    text = detection_net(2, 300, 4, "nms_param { nms_threshold: 0.7 eta: 0.9 top_k: 200 } "
                         "keep_top_k: 150 confidence_threshold: 0.05")
    calls = []
    compiled = native.Kernels.__getattribute__

    def counted(self, name):
        if name == "nms_sorted":
            calls.append(name)
        return compiled(self, name)
    monkeypatch.setattr(native.Kernels, "__getattribute__", counted)
    want = run(text, feed, dtype=np.float32).blobs["y"].data.copy()
    assert 3 <= len(calls) < 6 and want.shape[2] == 2 * 150  # NaN-box classes: NumPy
    monkeypatch.setenv("CAFFEPAR_KERNELS", "numpy")
    if not table:
        monkeypatch.setattr(ssd, "PAIRWISE_MAX", 0)
    np.testing.assert_array_equal(run(text, feed, dtype=np.float32).blobs["y"].data, want)


def test_detection_output_nothing_found_gives_a_row_per_image():
    loc, conf, prior = ssd_inputs(3, 10, 3)
    net = run(detection_net(3, 10, 3, "confidence_threshold: 0.999"),
              {"loc": loc, "conf": conf, "prior": prior}, dtype=np.float32)
    want = np.full((3, 7), -1.0)
    want[:, 0] = [0, 1, 2]
    np.testing.assert_array_equal(net.blobs["y"].data[0, 0], want)


def test_detection_output_keeps_save_output_param_without_writing():
    loc, conf, prior = ssd_inputs(1, 10, 3)
    text = detection_net(1, 10, 3, 'save_output_param { output_directory: "no_such_dir" '
                                    'output_format: "VOC" }')
    net = run(text, {"loc": loc, "conf": conf, "prior": prior}, dtype=np.float32)
    assert net.blobs["y"].shape[3] == 7


def test_detection_output_num_classes_mismatch_is_one_line_naming_the_layer():
    text = detection_net(1, 10, 3, "").replace("num_classes: 3", "num_classes: 5")
    with pytest.raises(CaffeparError) as e:
        build(text, np.float32)
    msg = str(e.value)
    assert 'layer "l" (DetectionOutput)' in msg and "num_classes (5)" in msg
    assert "10 priors x 5 classes = 50" in msg and "\n" not in msg


SSD_BAD = {
    "no_min_size": ('layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "p"\n'
                    '  prior_box_param { aspect_ratio: 2 } }\n',
                    'net.prototxt:3: error: layer "pb" (PriorBox): prior_box_param needs '
                    "min_size (none given)"),
    "num_classes": ('layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "p"\n'
                    '  prior_box_param { min_size: 4 } }\n'
                    'layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf"\n'
                    '  bottom: "p" top: "d" detection_output_param { num_classes: 21 } }\n',
                    'net.prototxt:5: error: layer "det" (DetectionOutput): num_classes (21) does '
                    'not match the bottoms: the confidence bottom "conf" has 18 values per '
                    "image, 9 priors x 21 classes = 189 expected"),
}


@pytest.mark.parametrize("case", sorted(SSD_BAD))
def test_bad_ssd_layers_are_one_line_from_the_cli(case, tmp_path, monkeypatch, capsys):
    from caffepar.cli import main
    text, message = SSD_BAD[case]
    inputs = ('layer { name: "in" type: "Input" top: "f" top: "img" top: "loc" top: "conf"\n'
              "  input_param { shape { dim: 1 dim: 2 dim: 3 dim: 3 } shape { dim: 1 dim: 3 "
              "dim: 12 dim: 12 } shape { dim: 1 dim: 36 } shape { dim: 1 dim: 18 } } }\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(inputs + text)
    with pytest.raises(SystemExit) as e:
        main(["time", "--model", "net.prototxt", "--iterations", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0] == f"caffepar: {message}", err[0]
