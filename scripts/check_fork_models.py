#!/usr/bin/env python
"""Caffe fork layers and published fork models side by side: caffepar, OpenCV's dnn module (the
reference), caffepar's ONNX export in onnxruntime, and caffe2onnx's export in onnxruntime.

    python scripts/check_fork_models.py [--out results/fork_models] [--cache DIR] [--fetch]
                                        [--caffe2onnx PYTHON] [--only NAME ...]

Each fork layer type runs as a one-layer net (LAYER_CASES: one line per type), and each
published model of PUBLISHED that is in the cache runs whole. The cache is
`$CAFFEPAR_CACHE_DIR/fork_models` (else ~/.cache/caffepar/fork_models), outside the
repository; `--fetch` downloads the prototxts there. Their caffemodels are not fetched (the
public repositories keep them as large files, or not at all): every net runs with random
weights, saved once as a .caffemodel that all four tools read. Random weights here are the
fillers' values, BatchNorm statistics of mean 0 and variance 1, and the class-score
convolutions (*_mbox_conf) times 4 for the 21-class MobileNet-SSD, so that some scores pass its
threshold (not for the 2-class face detector, whose scores would then saturate at 1.0 and
tie). Fast R-CNN's test prototxts have no fillers (all zeros, every output a constant): their
weights are drawn from N(0, 2 / fan-in), biases from N(0, 0.01^2), and they are fed an image and
8 valid regions (batch index 0, x1 <= x2, y1 <= y2, inside the image); cls_prob and bbox_pred
are compared.

Comparisons: a one-layer net's output element by element, rtol 1e-4 (atol 1e-5); a published
model's dense outputs as its users compare them, against the output's scale: max |a - b| <=
1e-4 * max |b|. A deep net in float32 carries rounding of its own through every layer: with
random weights VGG16's cls_prob and bbox_pred differ from OpenCV's by a few 1e-6 of their
scale, more than 1e-4 of their smallest values (OpenCV's default 3x3 convolutions, Winograd's,
round more than a direct sum: its conv1_1 is 1e-5 of the scale away from the same net in
float64, ours 2e-7; with its net.enableWinograd(False) the two agree to 1.5e-6 of the scale). Each model row's note gives both tools' distance from caffepar run in
float64 (`float64:`), which says whose rounding a difference is. Detections (N x 7 rows) after
sorting the rows, same count and rtol 1e-4 (atol 1e-5). OpenCV is `opencv-python-headless` 4.x (5.x
has no Caffe reader), imported in this interpreter. caffe2onnx runs in the interpreter given by
--caffe2onnx (it pins an old onnx; a separate venv with `pip install --no-deps caffe2onnx onnx
onnxruntime protobuf` works, run with PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python for its old
generated protobuf code); without it that column says it was not run. Writes OUT.csv and OUT.md.
"""
import argparse
import csv
import os
import platform
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cpuinfo import cpu_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RAW = "https://raw.githubusercontent.com/{repo}/{ref}/{path}"


def ssd_image(rng):
    return {"data": rng.uniform(-1, 1, (1, 3, 300, 300)).astype(np.float32)}


def image_and_regions(rng, size=224, regions=8):
    """An image and valid regions for it, as Fast R-CNN's test feeds them: [batch index 0,
    x1, y1, x2, y2] in the image's pixels, x1 <= x2, y1 <= y2, inside the image."""
    corner = rng.uniform(0, size * 0.8, (regions, 2))
    far = np.minimum(corner + rng.uniform(8, size, (regions, 2)), size - 1)
    rois = np.concatenate([np.zeros((regions, 1)), corner, far], axis=1)
    return {"data": rng.uniform(-1, 1, (1, 3, size, size)).astype(np.float32),
            "rois": rois.astype(np.float32)}


@dataclass
class Published:
    """A published prototxt, its inputs (feeds(rng) -> {input: array}) and the outputs
    compared. `he_weights`: the prototxt has no fillers (its weights come from a caffemodel),
    so every weight is drawn from N(0, 2 / fan-in) and every bias from N(0, 0.01^2) instead
    of its filler's zeros, which would make every output a constant."""
    name: str
    file: str
    repo: str
    ref: str
    path: str
    note: str = ""
    conf_gain: float = 4.0
    feeds: object = ssd_image
    outputs: tuple = ("detection_out",)
    detections: bool = True
    he_weights: bool = False


FAST_RCNN = dict(feeds=image_and_regions, outputs=("cls_prob", "bbox_pred"), detections=False,
                 he_weights=True)

PUBLISHED = [
    Published("MobileNet-SSD", "MobileNetSSD_deploy.prototxt", "chuanqi305/MobileNet-SSD",
              "master", "deploy.prototxt", "grouped (depthwise) Convolution, BatchNorm/Scale"),
    Published("MobileNet-SSD, BN merged", "MobileNetSSD_voc_deploy.prototxt",
              "chuanqi305/MobileNet-SSD", "master", "voc/MobileNetSSD_deploy.prototxt",
              "the same net with BatchNorm folded into the convolutions"),
    Published("res10 SSD face detector", "res10_300x300_ssd_deploy.prototxt", "opencv/opencv",
              "4.x", "samples/dnn/face_detector/deploy.prototxt",
              "ResNet-10 SSD; sets DetectionOutput's clip (an OpenCV field)", conf_gain=1.0),
    Published("Fast R-CNN ZF", "fast_rcnn_zf_test.prototxt", "rbgirshick/py-faster-rcnn",
              "master", "models/pascal_voc/ZF/fast_rcnn/test.prototxt",
              "ROIPooling of 8 regions; Dropout with scale_train: false (caffe-fast-rcnn)",
              **FAST_RCNN),
    Published("Fast R-CNN VGG16", "fast_rcnn_vgg16_test.prototxt", "rbgirshick/py-faster-rcnn",
              "master", "models/pascal_voc/VGG16/fast_rcnn/test.prototxt",
              "ROIPooling of 8 regions, 7 by 7; Dropout without scale_train; 13 convolutions, "
              "all 3x3", **FAST_RCNN),
]


@dataclass
class LayerCase:
    """A one-layer net: the layer's type and parameter text, its bottoms' shapes, and how to
    make its inputs (None: standard normal). `before` is layer text placed ahead of it (a
    MAX pooling that gives Upsample its mask), whose tops `layer_bottoms` then names.
    `opencv_differs`: OpenCV's answer is known to differ, as the note says; the row still
    shows it, but the script's exit status does not count it."""
    type: str
    params: str
    bottoms: dict
    make_inputs: object = None
    detections: bool = False
    note: str = ""
    before: str = ""
    layer_bottoms: tuple = ()
    opencv_differs: bool = False


def ssd_bottoms(rng, num=2, priors=50, classes=4):
    """Location offsets, softmax scores and priors (corners in (0, 1)) as SSD's heads give."""
    centers = rng.uniform(0.2, 0.8, (priors, 2))
    sizes = rng.uniform(0.1, 0.4, (priors, 2))
    prior = np.concatenate([centers - sizes / 2, centers + sizes / 2], axis=1).reshape(-1)
    variance = np.tile([0.1, 0.1, 0.2, 0.2], priors)
    logits = rng.standard_normal((num, priors, classes)) * 2
    conf = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return {"loc": (rng.standard_normal((num, priors * 4)) * 0.5).astype(np.float32),
            "conf": conf.reshape(num, -1).astype(np.float32),
            "prior": np.stack([prior, variance])[None].astype(np.float32)}


# One line per fork layer type; a type this build does not register is reported as such.
LAYER_CASES = [
    LayerCase("Permute", "permute_param { order: 0 order: 2 order: 3 order: 1 }",
              {"x": (2, 3, 4, 5)}),
    LayerCase("Normalize", 'norm_param { across_spatial: false channel_shared: false '
              'scale_filler { type: "gaussian" std: 5 } }', {"x": (2, 6, 5, 4)}),
    LayerCase("Normalize", "norm_param { across_spatial: true channel_shared: true eps: 0.001 "
              'scale_filler { type: "constant" value: 20 } }', {"x": (2, 6, 5, 4)},
              note="the shared scale is a 0-axis blob, as the fork saves it; OpenCV cannot "
                   "load that (it agrees when the blob is given shape (1))"),
    LayerCase("PriorBox", "prior_box_param { min_size: 30 max_size: 60 aspect_ratio: 2 "
              "aspect_ratio: 3 flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2 "
              "variance: 0.2 step: 8 offset: 0.5 }", {"f": (1, 8, 19, 19), "img": (1, 3, 150, 150)}),
    LayerCase("PriorBox", "prior_box_param { min_size: 60 aspect_ratio: 2 clip: true "
              "variance: 0.1 }", {"f": (1, 8, 10, 10), "img": (1, 3, 300, 300)}),
    LayerCase("DetectionOutput", "detection_output_param { num_classes: 4 share_location: true "
              "background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 30 } "
              "code_type: CENTER_SIZE keep_top_k: 25 confidence_threshold: 0.1 }",
              {"loc": (2, 200), "conf": (2, 200), "prior": (1, 2, 200)}, ssd_bottoms, True),
    LayerCase("DetectionOutput", "detection_output_param { num_classes: 4 share_location: true "
              "background_label_id: 0 nms_param { nms_threshold: 0.3 } code_type: CORNER "
              "keep_top_k: 40 confidence_threshold: 0.05 }",
              {"loc": (2, 200), "conf": (2, 200), "prior": (1, 2, 200)},
              lambda rng: {**ssd_bottoms(rng), "loc": (rng.standard_normal((2, 200)) * 0.05)
                           .astype(np.float32)}, True),
    # Mobile, segmentation and detection forks.
    LayerCase("ConvolutionDepthwise", "convolution_param { num_output: 6 kernel_size: 3 pad: 1 "
              'weight_filler { type: "msra" } }', {"x": (2, 6, 7, 7)}),
    LayerCase("DepthwiseConvolution", "convolution_param { num_output: 6 group: 6 "
              'kernel_size: 3 stride: 2 weight_filler { type: "msra" } }', {"x": (2, 6, 7, 7)}),
    LayerCase("ReLU6", "", {"x": (2, 3, 4, 5)}, lambda rng: {
        "x": (rng.standard_normal((2, 3, 4, 5)) * 6).astype(np.float32)}),
    LayerCase("ShuffleChannel", "shuffle_channel_param { group: 3 }", {"x": (2, 6, 3, 4)}),
    LayerCase("Interp", "interp_param { height: 9 width: 11 }", {"x": (1, 3, 5, 6)}),
    LayerCase("Interp", "interp_param { zoom_factor: 2 }", {"x": (1, 3, 5, 6)}),
    LayerCase("Upsample", "upsample_param { scale: 2 }", {"x": (1, 3, 5, 6)}),
    LayerCase("ROIPooling", "roi_pooling_param { pooled_h: 3 pooled_w: 3 spatial_scale: 0.25 }",
              {"x": (1, 4, 12, 12), "rois": (3, 5)}, lambda rng: {
                  "x": rng.standard_normal((1, 4, 12, 12)).astype(np.float32),
                  "rois": np.array([[0, 0, 0, 40, 40], [0, 8, 4, 30, 44], [0, 20, 20, 47, 47]],
                                   np.float32)}),
    LayerCase("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 ceil_mode: false }",
              {"x": (1, 3, 8, 8)}, note="ceil_mode: a fork's field of BVLC's Pooling"),
    LayerCase("Pooling", "pooling_param { pool: MAX kernel_size: 3 stride: 2 ceil_mode: true }",
              {"x": (1, 3, 8, 8)}, note="ceil_mode: true; 8 by 8 in 3 by 3 windows of stride 2 "
              "gives 4 by 4 (3 by 3 with ceil_mode: false)"),
    LayerCase("Axpy", "", {"a": (1, 6, 1, 1), "x": (1, 6, 5, 4), "s": (1, 6, 5, 4)},
              opencv_differs=True, note="SENet's Axpy is a * bottom 1 + bottom 2 (the residual "
              "branch scaled, plus the shortcut); OpenCV computes a * bottom 2 + bottom 1 (and fails "
              "outright with a batch of 2)"),
    LayerCase("Upsample", "upsample_param { scale: 2 }", {"x": (1, 3, 10, 12)},
              before='layer { name: "p" type: "Pooling" bottom: "x" top: "pool" top: "mask" '
                     "pooling_param { pool: MAX kernel_size: 2 stride: 2 } }",
              layer_bottoms=("pool", "mask"),
              note="SegNet's form: unpooling by the mask top of the MAX Pooling before it"),
    LayerCase("PSROIPooling", "psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 "
              "group_size: 2 }", {"x": (1, 8, 10, 12), "rois": (4, 5)}, lambda rng: {
                  "x": rng.standard_normal((1, 8, 10, 12)).astype(np.float32),
                  "rois": np.array([[0, 0, 0, 23, 19], [0, 4, 2, 13, 9], [0, 6, 6, 6, 7],
                                    [0, 10, 12, 30, 30]], np.float32)}),
    LayerCase("BN", 'bn_param { slope_filler { type: "uniform" min: 0.5 max: 1.5 } '
              'bias_filler { type: "gaussian" std: 0.3 } }', {"x": (1, 8, 10, 12)},
              note="PSPNet's form (moving mean 0, variance 1)"),
    LayerCase("BN", 'bn_param { bn_mode: INFERENCE scale_filler { type: "gaussian" std: 1 } '
              'shift_filler { type: "gaussian" std: 0.3 } }', {"x": (1, 8, 10, 12)},
              note="SegNet's form"),
    LayerCase("Interp", "interp_param { shrink_factor: 2 pad_beg: -1 pad_end: -2 }",
              {"x": (1, 8, 10, 12)}, opencv_differs=True,
              note="DeepLab crops by the pads, then shrinks: 10 by 12 gives 4 by 5; OpenCV "
                   "does not apply shrink_factor or the pads (its output here is 0 by 0)"),
]


def cache_root(override=None):
    if override:
        return Path(override)
    from caffepar.nn.native import cache_dir
    return cache_dir() / "fork_models"


def fetch(cache):
    cache.mkdir(parents=True, exist_ok=True)
    for p in PUBLISHED:
        target = cache / p.file
        if target.exists():
            continue
        url = RAW.format(repo=p.repo, ref=p.ref, path=p.path)
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                target.write_bytes(r.read())
            print(f"fetched {p.repo}/{p.path}")
        except OSError as e:
            print(f"could not fetch {p.repo}/{p.path}: {e}")


# ------------------------------------------------------------------------- running the tools
def layer_prototxt(case):
    lines = ['name: "one_layer"']
    for name, shape in case.bottoms.items():
        lines.append(f'input: "{name}"')
        lines.append("input_shape { " + " ".join(f"dim: {d}" for d in shape) + " }")
    if case.before:
        lines.append(case.before)
    bottoms = " ".join(f'bottom: "{b}"' for b in case.layer_bottoms or case.bottoms)
    lines.append(f'layer {{ name: "l" type: "{case.type}" {bottoms} top: "y" {case.params} }}')
    return "\n".join(lines) + "\n"


def random_weights(model, weights, seed=1, conf_gain=4.0, he_weights=False):
    """Save the net's random weights (see the module docstring) as a .caffemodel."""
    import caffepar as caffe
    caffe.set_random_seed(seed)
    net = caffe.Net(str(model), caffe.TEST)
    rng = np.random.default_rng(seed)
    for name, layer in zip(net._layer_names, net.layers):
        blobs = net.params.get(name, [])
        if he_weights and blobs:
            w = blobs[0].data
            w[...] = rng.standard_normal(w.shape) * np.sqrt(2.0 / max(1, np.prod(w.shape[1:])))
            for b in blobs[1:]:
                b.data[...] = rng.standard_normal(b.shape) * 0.01
        if layer.type == "BatchNorm":
            blobs[0].data[...], blobs[1].data[...], blobs[2].data[...] = 0, 1, 1
        if layer.type == "BN" and len(blobs) == 4:      # PSPNet's moving statistics
            blobs[2].data[...], blobs[3].data[...] = 0, 1
        if layer.type == "Convolution" and name.endswith("mbox_conf"):
            blobs[0].data[...] *= conf_gain
    net.save(str(weights))


def run_caffepar(model, weights, feeds, outputs, dtype=np.float32):
    import caffepar as caffe
    net = caffe.Net(str(model), str(weights), caffe.TEST, dtype=dtype)
    for name, value in feeds.items():
        net.blobs[name].reshape(*value.shape)
        net.blobs[name].data[...] = value
    net.reshape()
    out = net.forward(blobs=list(outputs))
    return [out[o].copy() for o in outputs]


def run_opencv(model, weights, feeds, outputs):
    import cv2
    net = (cv2.dnn.readNetFromCaffe(str(model), str(weights)) if weights
           else cv2.dnn.readNetFromCaffe(str(model)))
    for name, value in feeds.items():
        net.setInput(np.ascontiguousarray(value), name)
    return [np.asarray(v) for v in net.forward(list(outputs))]


def run_onnx(path, feeds, outputs):
    """The outputs by name, or (another converter's names) the graph's first ones in order."""
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if not set(names) <= set(feeds):
        # Another converter's own input names: the net's inputs in order.
        feeds = dict(zip(names, feeds.values()))
    have = [o.name for o in session.get_outputs()]
    wanted = list(outputs) if set(outputs) <= set(have) else have[:len(outputs)]
    return session.run(wanted, {k: feeds[k] for k in names})


def run_caffepar_onnx(model, weights, feeds, out, outputs):
    from caffepar.convert.onnx_export import export_onnx
    export_onnx(model, weights, out)
    return run_onnx(out, feeds, outputs)


def run_caffe2onnx(python, model, weights, feeds, out, outputs, timeout=600):
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    proc = subprocess.run([python, "-m", "caffe2onnx.convert", "--prototxt", str(model),
                           "--caffemodel", str(weights), "--onnx", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not Path(out).exists():
        tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise RuntimeError("conversion fails: " + (tail[-1] if tail else f"exit {proc.returncode}"))
    try:
        return run_onnx(out, feeds, outputs)
    except Exception as e:  # onnxruntime's own exceptions
        raise RuntimeError("converts; onnxruntime cannot run it: " + _first(e)) from None


# ------------------------------------------------------------------------- comparing
def sorted_rows(d):
    rows = np.asarray(d, np.float64).reshape(-1, 7)
    return rows[np.lexsort(rows.T[::-1])]


def compare_all(got, want, names, detections, scaled=False):
    """compare() of each output; with several, 'agrees' only if every one does, and each
    named."""
    if len(names) == 1:
        return compare(got[0], want[0], detections, scaled)
    parts = [(n, compare(g, w, detections, scaled)) for n, g, w in zip(names, got, want)]
    ok = all(text.startswith("agrees") for _n, text in parts)
    return f"{'agrees' if ok else 'differs'}: " + "; ".join(
        f"{n} {text.split(': ', 1)[1] if text.startswith(('agrees', 'differs')) else text}"
        for n, text in parts)


def compare(got, want, detections, scaled=False):
    """'agrees (...)' or 'differs (...)' for an output against caffepar's; `scaled`: a dense
    output against its scale (max |got - want| <= 1e-4 max |want|), else element by element."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if detections:
        g, w = sorted_rows(got), sorted_rows(want)
        if g.shape != w.shape:
            return f"differs: {len(g)} detections, caffepar {len(w)}"
        diff = float(np.abs(g - w).max()) if g.size else 0.0
        ok = np.allclose(g, w, rtol=1e-4, atol=1e-5)
        return f"{'agrees' if ok else 'differs'}: {len(g)} detections, max abs diff {diff:.2g}"
    if got.size != want.size:
        return f"differs: shape {got.shape}, caffepar {want.shape}"
    got = got.reshape(want.shape)
    diff = float(np.abs(got - want).max())
    if scaled:
        scale = float(np.abs(want).max())
        ok = diff <= 1e-4 * scale
        return (f"{'agrees' if ok else 'differs'}: max abs diff {diff:.2g} "
                f"({diff / scale if scale else float(diff > 0):.1g} of max |value| {scale:.3g})")
    ok = np.allclose(got, want, rtol=1e-4, atol=1e-5)
    return f"{'agrees' if ok else 'differs'}: max abs diff {diff:.2g}"


def float64_distances(model, weights, feeds, outputs, ours, opencv):
    """How far caffepar (float32) and OpenCV each are from caffepar run in float64, as a
    fraction of each output's scale: whose rounding a difference between them is."""
    exact = run_caffepar(model, weights, feeds, outputs, dtype=np.float64)
    parts = []
    for name, ref, a, b in zip(outputs, exact, ours, opencv):
        scale = float(np.abs(ref).max()) or 1.0
        far = [float(np.abs(np.asarray(x, np.float64).reshape(ref.shape) - ref).max()) / scale
               for x in (a, b)]
        parts.append(f"{name} caffepar {far[0]:.1g}, OpenCV {far[1]:.1g}")
    return "float64: " + "; ".join(parts) + " of max |value|"


def _first(e):
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def check(name, kind, model, feeds, outputs, detections, work, caffe2onnx, note="",
          cv_outputs=None, conf_gain=4.0, he_weights=False):
    """One row: what each tool does with the net, on each of `outputs` (blob names). OpenCV
    names outputs by layer (`cv_outputs`, default the tops' names)."""
    from caffepar.errors import CaffeparError
    row = {"item": name, "kind": kind, "note": note}
    weights = work / "random.caffemodel"
    cv_outputs = cv_outputs or outputs
    opencv = None
    try:
        random_weights(model, weights, conf_gain=conf_gain, he_weights=he_weights)
        ours = run_caffepar(model, weights, feeds, outputs)
        row["caffepar"] = (f"runs: {len(sorted_rows(ours[0]))} detections" if detections
                           else "runs: output " + ", ".join(str(tuple(o.shape)) for o in ours))
    except CaffeparError as e:
        row["caffepar"] = "refuses: " + _first(e)
        ours = None
    for column, runner in (("opencv", lambda: run_opencv(model, weights, feeds, cv_outputs)),
                           ("caffepar_onnx", lambda: run_caffepar_onnx(
                               model, weights, feeds, work / "caffepar.onnx", outputs)),
                           ("caffe2onnx", lambda: run_caffe2onnx(
                               caffe2onnx, model, weights, feeds, work / "caffe2onnx.onnx",
                               outputs))):
        if column == "caffe2onnx" and not caffe2onnx:
            row[column] = "not run (no --caffe2onnx interpreter)"
            continue
        if ours is None and column == "caffepar_onnx":
            row[column] = "-"
            continue
        if ours is None and not weights.exists():
            if column != "opencv":
                row[column] = "-"
                continue
            # caffepar could not build the net to save weights: OpenCV on the prototxt alone.
            runner = lambda: run_opencv(model, None, feeds, cv_outputs)  # noqa: E731
        try:
            theirs = runner()
        except Exception as e:  # each tool's own exceptions, reported as its answer
            row[column] = ("refuses: " if column == "caffepar_onnx" else "fails: ") + _first(e)
            continue
        if ours is None:
            row[column] = f"runs{'' if weights.exists() else ' (no weights)'}: output " \
                + ", ".join(str(tuple(np.shape(t))) for t in theirs)
        else:
            row[column] = compare_all(theirs, ours, outputs, detections,
                                      scaled=kind == "model" and not detections)
            if column == "opencv":
                opencv = theirs
    if kind == "model" and not detections and ours is not None and opencv is not None:
        row["float64"] = float64_distances(model, weights, feeds, outputs, ours, opencv)
    # Messages name files of the scratch folder: keep their names only.
    return {k: v.replace(f"{work}{os.sep}", "") if isinstance(v, str) else v
            for k, v in row.items()}


def layer_rows(caffe2onnx, only):
    from caffepar.nn import LAYERS
    rng = np.random.default_rng(20)
    rows = []
    for i, case in enumerate(LAYER_CASES):
        if only and case.type not in only:
            continue
        feeds = (case.make_inputs(rng) if case.make_inputs else
                 {n: rng.standard_normal(s).astype(np.float32) for n, s in case.bottoms.items()})
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            model = work / "layer.prototxt"
            model.write_text(layer_prototxt(case))
            inner = case.params.split("{", 1)[1].strip(" }") if "{" in case.params else ""
            label = f"{case.type} ({inner[:70]})" if inner else case.type
            if case.type not in LAYERS:
                row = {"item": label, "kind": "layer", "caffepar": "not in this build",
                       "caffepar_onnx": "-", "note": case.note}
                try:
                    row["opencv"] = "runs (no weights): output " + str(
                        tuple(np.shape(run_opencv(model, None, feeds, ["l"])[0])))
                except Exception as e:  # OpenCV's own exceptions
                    row["opencv"] = "fails (no weights): " + _first(e)
                row["caffe2onnx"] = "-"
            else:
                row = check(label, "layer", model, feeds, ["y"], case.detections, work,
                            caffe2onnx, case.note, cv_outputs=["l"])
            row["opencv_differs"] = case.opencv_differs
        print(f"[{i + 1}/{len(LAYER_CASES)}] {row['item']}: {row['caffepar']} | OpenCV "
              f"{row['opencv']} | ONNX {row['caffepar_onnx']} | caffe2onnx {row['caffe2onnx']}",
              flush=True)
        rows.append(row)
    return rows


def model_rows(cache, caffe2onnx, only):
    rows = []
    for p in PUBLISHED:
        if only and p.name not in only:
            continue
        path = cache / p.file
        label = f"{p.name} ({p.repo}: {p.path})"
        if not path.exists():
            rows.append({"item": label, "kind": "model", "caffepar": "not in the cache "
                         f"(run with --fetch, or put {p.path} at {p.file})", "opencv": "-",
                         "caffepar_onnx": "-", "caffe2onnx": "-", "note": p.note})
            continue
        feeds = p.feeds(np.random.default_rng(300))
        with tempfile.TemporaryDirectory() as tmp:
            row = check(label, "model", path, feeds, list(p.outputs), p.detections, Path(tmp),
                        caffe2onnx, p.note, conf_gain=p.conf_gain, he_weights=p.he_weights)
            row["note"] = (p.note + "; " if p.note else "") + \
                ("random weights N(0, 2/fan-in)" if p.he_weights else "random weights") + \
                ("; " + row.pop("float64") if "float64" in row else "")
        print(f"{row['item']}: {row['caffepar']} | OpenCV {row['opencv']} | ONNX "
              f"{row['caffepar_onnx']} | caffe2onnx {row['caffe2onnx']}", flush=True)
        rows.append(row)
    return rows


COLUMNS = ["item", "kind", "caffepar", "opencv", "caffepar_onnx", "caffe2onnx", "note"]
HEADERS = ["item", "kind", "caffepar", "OpenCV dnn vs caffepar",
           "caffepar's ONNX in onnxruntime vs caffepar", "caffe2onnx's ONNX in onnxruntime "
           "vs caffepar", "note"]


def versions(caffe2onnx):
    out = [f"Python {platform.python_version()}", f"CPU {cpu_name()}"]
    for mod in ("cv2", "onnxruntime", "onnx"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            out.append(f"{mod} not installed")
    if caffe2onnx:
        proc = subprocess.run([caffe2onnx, "-m", "pip", "show", "caffe2onnx"],
                              capture_output=True, text=True)
        version = next((ln.split()[1] for ln in proc.stdout.splitlines()
                        if ln.startswith("Version:")), "?")
        proc = subprocess.run([caffe2onnx, "-c", "import onnx; print(onnx.__version__)"],
                              capture_output=True, text=True)
        out.append(f"caffe2onnx {version} (beside onnx {proc.stdout.strip() or '?'}, with the "
                   "pure-Python protobuf)")
    return ", ".join(out)


def summary(rows):
    """Counts of what each tool runs and agrees on, and where OpenCV differs."""
    def count(column, word):
        return sum(str(r.get(column, "")).startswith(word) for r in rows)
    ran = {c: count(c, "agrees") + count(c, "differs") for c in ("opencv", "caffe2onnx")}
    text = (f"Summary: of {len(rows)} nets, caffepar runs {count('caffepar', 'runs')}; its ONNX "
            f"export agrees with it in onnxruntime on {count('caffepar_onnx', 'agrees')}. "
            f"OpenCV runs {ran['opencv']} and agrees on {count('opencv', 'agrees')}; "
            f"caffe2onnx's export runs on {ran['caffe2onnx']} and agrees on "
            f"{count('caffe2onnx', 'agrees')}.")
    odd = [r for r in rows if r["kind"] == "layer" and r.get("opencv_differs") or
           r["kind"] == "layer" and (str(r.get("opencv", "")).startswith("differs")
                                          or "OpenCV" in str(r.get("note", "")))]
    if odd:
        text += " Where OpenCV differs or fails on a layer it has: " + "; ".join(
            f"{r['item'].split(' (')[0]}: {r['note']}" for r in odd) + "."
    return text


def write(out, rows, caffe2onnx):
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
    lines = ["# Caffe fork layers and models: caffepar, OpenCV, caffepar's ONNX, caffe2onnx", "",
             "Made by `scripts/check_fork_models.py` (its docstring says how each tool runs and "
             "what the random weights are). Tools: " + versions(caffe2onnx) + ".", "",
             summary(rows), "",
             "Published models are their prototxts with random weights (their caffemodels are "
             "not fetched). Comparisons are against caffepar's output: a one-layer net's "
             "output element by element, rtol 1e-4 (atol 1e-5); a published model's dense "
             "outputs against their scale, max |a - b| <= 1e-4 max |b|, as a deep net in "
             "float32 is compared (its rounding is carried through every layer: OpenCV's "
             "Winograd 3x3 convolutions round more than a direct sum); the note's `float64:` "
             "gives each tool's distance from caffepar run in float64, as a fraction of the "
             "output's scale; detections sorted, same count, rtol 1e-4 (atol 1e-5). A row "
             f"whose note ends in \"{EARLIER.strip()}\" was not run this time (`--only`, or "
             "its prototxt was not in the cache) and keeps an earlier run's result.", "",
             "caffe2onnx pins an onnx release that does not build on this Python; it was "
             "installed without its dependencies beside the onnx named above, so an error in its "
             "column may also come from that newer onnx (the empty `max_sizes` error is raised "
             "by onnx's attribute helper). Its PriorBox and DetectionOutput nodes are custom "
             "operators that onnxruntime refuses to load.", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).replace("|", "/") for c in COLUMNS)
                     + " |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.csv and {out}.md")


def labels():
    """Every row's item, in the order rows are written (LAYER_CASES, then PUBLISHED)."""
    out = []
    for case in LAYER_CASES:
        inner = case.params.split("{", 1)[1].strip(" }") if "{" in case.params else ""
        out.append(f"{case.type} ({inner[:70]})" if inner else case.type)
    return out + [f"{p.name} ({p.repo}: {p.path})" for p in PUBLISHED]


EARLIER = " (earlier run)"


def _keyed(rows):
    """(item, its occurrence) for each row: two cases may share a label (the same type with
    parameters alike in their first characters)."""
    seen = {}
    keys = []
    for r in rows:
        k = seen[r["item"]] = seen.get(r["item"], -1) + 1
        keys.append((r["item"], k))
    return keys


def with_earlier(rows, out):
    """`rows` and, for every item this run gave no result (not chosen by --only, or a
    published prototxt not in this cache), the row OUT.csv holds from an earlier run, its
    note saying so; in the order of labels()."""
    path = Path(f"{out}.csv")
    fresh = {key: r for key, r in zip(_keyed(rows), rows)
             if not str(r.get("caffepar", "")).startswith("not in the cache")}
    earlier = {}
    if path.exists():
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
        earlier = {key: r for key, r in zip(_keyed(old), old)
                   if not r["caffepar"].startswith("not in the cache")}
    cases = {label: case for label, case in zip(labels(), LAYER_CASES)}
    merged = []
    for key in _keyed([{"item": label} for label in labels()]):
        r = fresh.get(key)
        if r is None and key in earlier:
            r = earlier[key]
            note = r.get("note", "")
            r["note"] = note if note.endswith(EARLIER) else note + EARLIER
        if r is None:
            r = next((x for k, x in zip(_keyed(rows), rows) if k == key), None)
        if r is None:
            continue
        if r["item"] in cases:
            r.setdefault("opencv_differs", cases[r["item"]].opencv_differs)
        merged.append(r)
    return merged


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "fork_models"))
    ap.add_argument("--cache", help="folder of published prototxts (default: the cache)")
    ap.add_argument("--fetch", action="store_true", help="download missing prototxts first")
    ap.add_argument("--caffe2onnx", metavar="PYTHON",
                    help="an interpreter with caffe2onnx installed")
    ap.add_argument("--only", nargs="*", default=[], help="layer types or model names")
    args = ap.parse_args()
    cache = cache_root(args.cache)
    if args.fetch:
        fetch(cache)
    rows = layer_rows(args.caffe2onnx, args.only) + model_rows(cache, args.caffe2onnx, args.only)
    write(Path(args.out), with_earlier(rows, args.out), args.caffe2onnx)
    bad = [r for r in rows if any(str(r.get(c, "")).startswith("differs")
                                  for c in ("opencv", "caffepar_onnx")
                                  if not (c == "opencv" and r.get("opencv_differs")))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
