"""caffepar against outputs of the SSD fork of Caffe itself (weiliu89/caffe, branch ssd, built
CPU_ONLY; tests/fixtures/ssd/README.md says how they were made): MultiBoxLoss's loss and bottom
diffs for each option, DetectionEvaluate's rows, the solver's average precision, the photometric
adjustments and resizes of AnnotatedData, the samplers' statistics and AnnotatedData's output."""
from pathlib import Path

import numpy as np
import pytest

from caffepar.data import annotated as A
from caffepar.graph.net import TEST, Net
from caffepar.nn.ssd_train import average_precision
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ssd"
RTOL = 1e-5


def load(name):
    path = FIXTURES / f"{name}.npz"
    if not path.exists():
        pytest.skip(f"fixture {path.name} missing")
    return np.load(path)


def cases(fixture, suffix):
    path = FIXTURES / f"{fixture}.npz"
    if not path.exists():
        return []
    with np.load(path) as z:
        return sorted({k.rsplit("/", 1)[0] for k in z.files if k.endswith(suffix)})


def close(got, want, what):
    """Equal to RTOL relative, on the scale of the array (diffs hold exact zeros)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale, err_msg=what)


# ------------------------------------------------------------------ MultiBoxLoss
@pytest.mark.parametrize("case", cases("multibox_loss", "/loss"))
def test_multibox_loss_is_the_forks(case):
    z = load("multibox_loss")
    net = Net(parse_text(str(z[f"{case}/text"]), caffe_pb2.NetParameter()), phase=TEST)
    inputs = str(z[f"{case}/inputs"])
    net.blobs["loc"].data[...] = z[f"{inputs}/loc"]
    net.blobs["conf"].data[...] = z[f"{inputs}/conf"]
    net.blobs["prior"].data[...] = z["prior"]
    net.blobs["label"].data[...] = z[f"{case}/label"]
    net.forward()
    net.backward()
    close(net.blobs["loss"].data, z[f"{case}/loss"], f"{case}: loss")
    close(net.blobs["loc"].diff, z[f"{case}/loc_diff"], f"{case}: loc diff")
    close(net.blobs["conf"].diff, z[f"{case}/conf_diff"], f"{case}: conf diff")


# ------------------------------------------------------------------ DetectionEvaluate
@pytest.mark.parametrize("case", cases("detection_evaluate", "/rows0"))
def test_detection_evaluate_rows_are_the_forks(case, tmp_path):
    z = load("detection_evaluate")
    name, which = case.split("/")
    params = str(z[f"{case}/params"])
    if "NAME_SIZE" in params:
        (tmp_path / "sizes.txt").write_text(str(z["sizes"]))
        params = params.replace("NAME_SIZE", str(tmp_path / "sizes.txt"))
    det, gt = z[which], z["gt"]
    text = f"""layer {{ name: "a" type: "Input" top: "det"
  input_param {{ shape {{ dim: 1 dim: 1 dim: {det.shape[2]} dim: 7 }} }} }}
layer {{ name: "b" type: "Input" top: "gt"
  input_param {{ shape {{ dim: 1 dim: 1 dim: {gt.shape[2]} dim: 8 }} }} }}
layer {{ name: "e" type: "DetectionEvaluate" bottom: "det" bottom: "gt" top: "rows"
  detection_evaluate_param {{ num_classes: 4 background_label_id: 0 {params} }} }}
"""
    net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST)
    net.blobs["det"].data[...] = det
    net.blobs["gt"].data[...] = gt
    for k in range(2):                       # name_size_file's counter moves on between passes
        net.forward()
        want = z[f"{case}/rows{k}"]
        got = net.blobs["rows"].data.reshape(-1, 5)
        assert got.shape == want.shape, f"{case}: pass {k}"
        np.testing.assert_array_equal(got, want, err_msg=f"{case}: pass {k}")


def test_average_precision_is_the_forks():
    z = load("average_precision")
    versions = ("11point", "MaxIntegral", "Integral")
    for k, want in enumerate(z["ap"]):
        scores, tp = z[f"{k}/scores"], z[f"{k}/tp"]
        pairs_tp = list(zip(scores, tp))
        pairs_fp = list(zip(scores, 1 - tp))
        got = [average_precision(pairs_tp, pairs_fp, int(z[f"{k}/num_pos"]), v)
               for v in versions]
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"block {k}")


# ------------------------------------------------------------------ AnnotatedData pieces
def test_photometric_adjustments_are_the_forks():
    z = load("image_ops")
    img = z["image"]
    deltas = {"brightness": (-20.5, 31.7), "contrast": (0.6, 1.37),
              "saturation": (0.5, 1.45), "hue": (-17.3, 12.9)}
    for kind, values in deltas.items():
        for k, delta in enumerate(values):
            delta = np.float32(delta)
            if kind == "brightness":
                got = A.convert_scale(img, 1, delta)
            elif kind == "contrast":
                got = A.convert_scale(img, delta, 0)
            else:
                hsv = A.bgr_to_hsv(img)
                channel = 1 if kind == "saturation" else 0
                hsv[..., channel] = A.convert_scale(hsv[..., channel], *(
                    (delta, 0) if kind == "saturation" else (1, delta)))
                got = A.hsv_to_bgr(hsv)
            np.testing.assert_array_equal(got, z[f"adjust/{kind}{k}"], err_msg=f"{kind} {delta}")


@pytest.mark.parametrize("case", cases("image_ops", "/params"))
def test_resize_is_the_forks(case):
    """ApplyResize of the fork's OpenCV (Debian's 4.6, without IPP) and caffepar's."""
    z = load("image_ops")
    param = caffe_pb2.ResizeParameter()
    parse_text(str(z[f"{case}/params"]), param)
    got = A.apply_resize(z["image"], param, np.random.default_rng(0))
    want = z[case]
    assert got.shape == want.shape, case
    d = np.abs(got.astype(int) - want.astype(int))
    assert d.max() == 0, f"{case}: {int((d > 0).sum())} of {d.size} values differ, by up to {d.max()}"
