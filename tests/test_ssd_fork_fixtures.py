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


# ------------------------------------------------------------------ AnnotatedData
def records_db(z, folder):
    """The fixture's AnnotatedDatum records written into an LMDB."""
    import lmdb
    env = lmdb.open(str(folder / "db"), map_size=1 << 26)
    with env.begin(write=True) as txn:
        ends = z["record_ends"]
        for i, (start, end) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
            txn.put(b"%08d" % i, z["records"][start:end].tobytes())
    env.close()
    return folder / "db"


def data_net(z, key, source, phase, batch=None):
    text = str(z[f"{key}/text"]).replace("SOURCE", str(source))
    if batch is not None:
        text = text.replace("batch_size: 8", f"batch_size: {batch}")
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=phase)


def test_annotated_data_test_output_is_the_forks(tmp_path):
    """TEST phase (resize LINEAR, mean, scale; PNG records): the fork's blobs exactly."""
    z = load("annotated_data")
    net = data_net(z, "test", records_db(z, tmp_path), TEST)
    for k in range(2):
        net.forward()
        np.testing.assert_array_equal(net.blobs["data"].data, z[f"test/data{k}"])
        np.testing.assert_array_equal(net.blobs["label"].data, z[f"test/label{k}"])


def statistics_agree(ours, forks, n_ours, n_forks, what):
    """Each statistic within 4 standard errors of the difference of two sample means."""
    bad = []
    for key, (value, spread) in ours.items():
        want, _ = forks[key]
        tolerance = 4 * spread * np.sqrt(1 / n_ours + 1 / n_forks) + 1e-6
        if abs(value - want) > tolerance:
            bad.append(f"{key}: {value:.4f} against {want:.4f} (+-{tolerance:.4f})")
    assert not bad, f"{what}: " + "; ".join(bad)


def fixture_stats(z, prefix):
    return {k[len(prefix):]: tuple(z[k]) for k in z.files
            if k.startswith(prefix) and z[k].shape == (2,)}


def test_samplers_draw_as_the_forks():
    """GenerateBatchSamples with MobileNet-SSD's seven samplers around three objects (the fork:
    20000 draws): count of samples, their sizes, shapes and places."""
    from google.protobuf import text_format
    z = load("annotated_data")
    param = caffe_pb2.AnnotatedDataParameter()
    text_format.Parse(str(z["samples/samplers"]), param)
    anno = caffe_pb2.AnnotatedDatum()
    text_format.Parse(str(z["samples/objects/text"]), anno)
    objects = [np.array([a.bbox.xmin, a.bbox.ymin, a.bbox.xmax, a.bbox.ymax], np.float32)
               for g in anno.annotation_group for a in g.annotation]
    n = 400
    rng = np.random.default_rng(4)
    counts, boxes = [], []
    for _ in range(n):
        found = A.generate_samples(objects, param.batch_sampler, rng)
        counts.append(len(found))
        boxes += found
    statistics_agree(sample_stats(np.array(counts), np.array(boxes)),
                     fixture_stats(z, "samples/objects/"), n, 20000, "samplers")


def test_annotated_data_train_output_has_the_forks_statistics(tmp_path):
    """TRAIN with MobileNet-SSD's augmentations (distortion, expansion, the samplers, five
    interpolations, mirror) on the same records: the boxes that come out (per image, their
    sizes, places, classes) and the pixels (each channel's mean and spread) as the fork's
    2400 images."""
    z = load("annotated_data")
    net = data_net(z, "train", records_db(z, tmp_path), caffe_pb2.TRAIN)
    layer = net.layer_dict["data"]
    batches, rows, pixels = 30, [], []
    for k in range(batches):
        data, label = layer.make_batch(k)
        lab = label.reshape(-1, 8).copy()
        lab[:, 0] += 8 * k
        rows.append(lab[lab[:, 1] >= 0])
        pixels.append(pixel_stats(data))
    layer.close()
    statistics_agree(box_stats(np.concatenate(rows), 8 * batches),
                     fixture_stats(z, "train/boxes/"), 8 * batches, 2400, "boxes")
    # Pixels: each channel's mean and spread. Not their roughness (the last statistic): the
    # fork JPEG-encodes each record again after distortion, expansion and the crop, which
    # smooths it (0.046 against caffepar's 0.059 here); caffepar keeps the decoded image.
    pixels = np.array(pixels)[:, :6]
    want_mean, want_spread = z["train/pixels"][:, :6]
    tolerance = 4 * want_spread * np.sqrt(1 / batches + 1 / 300)
    assert np.all(np.abs(pixels.mean(axis=0) - want_mean) <= tolerance), \
        f"pixel statistics {pixels.mean(axis=0)} against {want_mean} (+-{tolerance})"


# The fixture's statistics, as its README says: (value, spread per draw) each.
def box_stats(rows, images):
    w, h = rows[:, 5] - rows[:, 3], rows[:, 6] - rows[:, 4]
    per_image = np.bincount(rows[:, 0].astype(int), minlength=images)
    empty = (per_image == 0).mean()
    out = {"per_image": (per_image.mean(), per_image.std()),
           "empty": (empty, np.sqrt(empty * (1 - empty))),
           "label1": ((rows[:, 1] == 1).mean(), 0.5)}
    for name, v in (("w", w), ("h", h), ("area", w * h), ("cx", (rows[:, 3] + rows[:, 5]) / 2),
                    ("cy", (rows[:, 4] + rows[:, 6]) / 2), ("xmin", rows[:, 3]),
                    ("xmax", rows[:, 5])):
        out[name] = (v.mean(), v.std())
        out[name + "_q25"] = (np.quantile(v, 0.25), 1.4 * v.std())
        out[name + "_q75"] = (np.quantile(v, 0.75), 1.4 * v.std())
    return out


def pixel_stats(d):
    return np.concatenate([d.mean(axis=(0, 2, 3)), d.std(axis=(0, 2, 3)),
                           [np.abs(d[:, :, :, 1:] - d[:, :, :, :-1]).mean()]])


def sample_stats(counts, boxes):
    out = {"count": (counts.mean(), counts.std())}
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    for name, v in (("w", w), ("h", h), ("area", w * h), ("aspect", w / h),
                    ("x", boxes[:, 0]), ("y", boxes[:, 1])):
        out[name] = (v.mean(), v.std())
        out[name + "_q25"] = (np.quantile(v, 0.25), 1.4 * v.std())
        out[name + "_q75"] = (np.quantile(v, 0.75), 1.4 * v.std())
    return out
