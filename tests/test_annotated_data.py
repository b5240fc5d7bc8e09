"""SSD's data side: `caffepar data annoset` (records, label map, name/size file), the
AnnotatedData layer (TEST output computed by hand, per-record seeding across shards), the
augmentation pieces against OpenCV, detection evaluation in `caffepar train`."""
import csv
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from caffepar.cli import main
from caffepar.data import annotated as A
from caffepar.data.annoset import write_label_map
from caffepar.data.sources import cv_resize, decode_image_bytes, open_db
from caffepar.errors import CaffeparError
from caffepar.graph.net import TEST, TRAIN, Net
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from ssd_nets import SOLVER, tiny_ssd, voc_folder

try:
    import cv2
except ImportError:
    cv2 = None
need_cv2 = pytest.mark.skipif(cv2 is None, reason="opencv-python-headless not installed")


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    folder = tmp_path_factory.mktemp("voc")
    root, label_map = voc_folder(folder)
    return folder, root, label_map


def test_annoset_records_are_the_xml_boxes(voc):
    folder, root, _ = voc
    db = open_db(str(folder / "trainval_lmdb"))
    lines = (root / "trainval.txt").read_text().split()
    names = {"circle": 1, "square": 2, "triangle": 3, "star": 4, "ring": 5}
    sizes = (folder / "trainval_name_size.txt").read_text().split("\n")
    assert len(db) == len(lines) // 2
    for i in range(len(db)):
        anno = caffe_pb2.AnnotatedDatum.FromString(db.get(i))
        image, xml = lines[2 * i], lines[2 * i + 1]
        assert anno.type == caffe_pb2.AnnotatedDatum.BBOX and anno.datum.encoded
        assert anno.datum.data == (root / image).read_bytes()      # stored as it was
        w, h = Image.open(root / image).size
        assert (anno.datum.channels, anno.datum.height, anno.datum.width) == (3, h, w)
        tree = ElementTree.parse(root / xml).getroot()
        w, h = int(tree.findtext("size/width")), int(tree.findtext("size/height"))
        assert sizes[i] == f"{Path(image).stem} {h} {w}"
        want = {}
        for obj in tree.iter("object"):
            box = [int(obj.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax")]
            want.setdefault(names[obj.findtext("name")], []).append(
                (np.float32(box[0]) / np.float32(w), np.float32(box[1]) / np.float32(h),
                 np.float32(box[2]) / np.float32(w), np.float32(box[3]) / np.float32(h),
                 obj.findtext("difficult") == "1"))
        got = {g.group_label: [(a.bbox.xmin, a.bbox.ymin, a.bbox.xmax, a.bbox.ymax,
                                a.bbox.difficult) for a in g.annotation]
               for g in anno.annotation_group}
        assert got == want
        for g in anno.annotation_group:
            assert [a.instance_id for a in g.annotation] == list(range(len(g.annotation)))


def test_annoset_cli_writes_a_label_map_from_the_annotations(voc, tmp_path, capsys):
    _, root, _ = voc
    label_map = tmp_path / "labelmap.prototxt"
    with pytest.raises(SystemExit) as e:
        main(["data", "annoset", str(root), str(root / "test.txt"), str(tmp_path / "x" / "db"),
              "--label-map-file", str(label_map), "--encode-type", "jpg", "--name-size-file",
              str(tmp_path / "sizes.txt")])
    assert e.value.code == 0, capsys.readouterr().err
    items = A.read_label_map(str(label_map)).item
    assert [(i.name, i.label) for i in items][0] == ("none_of_the_above", 0)
    assert [i.name for i in items[1:]] == sorted(i.name for i in items[1:])
    assert len((tmp_path / "sizes.txt").read_text().split("\n")) == 7
    with pytest.raises(SystemExit) as e:                 # an unknown class is one line
        main(["data", "annoset", str(root), str(root / "test.txt"), str(tmp_path / "y"),
              "--label-map-file", str(write_map(tmp_path, ["circle"]))])
    err = capsys.readouterr().err
    assert e.value.code != 0 and "unknown class name" in err and "Traceback" not in err


def write_map(folder, names):
    path = folder / "small_map.prototxt"
    write_label_map(str(path), names)
    return path


def test_annotated_data_test_phase_by_hand(voc):
    """TEST: each image resized (LINEAR) to 64x64, minus the mean, times the scale; the label
    rows are the records' boxes (WARP clips them to the image)."""
    folder, root, label_map = voc
    text = tiny_ssd("TEST", str(folder / "test_lmdb"), 3, label_map=str(label_map))
    net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST)
    net.forward_from_to(0, 0)
    db = open_db(str(folder / "test_lmdb"))
    rows = []
    for i in range(3):
        anno = caffe_pb2.AnnotatedDatum.FromString(db.get(i))
        img = decode_image_bytes(anno.datum.data, None)
        want = (cv_resize(img, 64, 64).astype(np.float32) - 127.5) * np.float32(0.007843)
        np.testing.assert_array_equal(net.blobs["data"].data[i], want.transpose(2, 0, 1))
        for g in anno.annotation_group:
            for a in g.annotation:
                b = a.bbox
                rows.append([i, g.group_label, a.instance_id, b.xmin, b.ymin, b.xmax, b.ymax,
                             b.difficult])
    np.testing.assert_allclose(net.blobs["label"].data.reshape(-1, 8), np.array(rows, np.float32),
                               rtol=0, atol=2e-7)


def test_records_are_augmented_alike_in_any_split(voc):
    """One process at batch 4 and two shards at batch 2 make the same augmented images and
    boxes (record i goes to shard i mod 2, its random choices with it)."""
    folder, _, label_map = voc

    def layer_outputs(batch, shard):
        text = tiny_ssd("TRAIN", str(folder / "trainval_lmdb"), batch, label_map=str(label_map))
        net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TRAIN, shard=shard)
        layer = net.layer_dict["data"]
        out = [layer.make_batch(k) for k in range(2)]
        layer.close()
        return out

    whole = layer_outputs(4, (0, 1))
    parts = [layer_outputs(2, (r, 2)) for r in range(2)]
    for k in range(2):
        data, label = whole[k]
        for r in range(2):
            pdata, plabel = parts[r][k]
            np.testing.assert_array_equal(pdata, data[r::2])
            mine = label.reshape(-1, 8)
            mine = mine[mine[:, 0] % 2 == r].copy()
            mine[:, 0] //= 2
            np.testing.assert_array_equal(plabel.reshape(-1, 8), mine)
    assert not np.array_equal(whole[0][0], whole[1][0])


def test_boxes_follow_expand_crop_and_mirror():
    """A white square and its box stay together through expansion, a sampled crop, a warp
    and a mirror."""
    rng = np.random.default_rng(0)
    img = np.zeros((60, 80, 3), np.uint8)
    img[20:40, 30:50] = 255
    box = np.array([30 / 80, 20 / 60, 50 / 80, 40 / 60], np.float32)
    record = A.Record(img, [box], [1], [0], [False])
    tp = caffe_pb2.TransformationParameter()
    parse_text("""mirror: true resize_param { height: 64 width: 64 interp_mode: NEAREST }
                  expand_param { prob: 1 max_expand_ratio: 3 } emit_constraint { emit_type: CENTER }""", tp)
    sampler = caffe_pb2.BatchSampler()
    parse_text("sampler { min_scale: 0.5 max_scale: 1 min_aspect_ratio: 0.5 max_aspect_ratio: 2 } "
               "sample_constraint { min_object_coverage: 1 } max_trials: 50 max_sample: 1", sampler)
    t = A.AnnotatedTransformer(tp, [sampler], TRAIN)
    for k in range(20):
        data, labels, _, _, boxes = t(record, np.random.default_rng(k))
        assert list(labels) == [1]
        # The crop's pixels start at the sampled box's truncated corner (as the fork's): the
        # square's edges and the box's agree within a source pixel, here up to 3 of the 64.
        ys, xs = np.nonzero(data[0] > 128)
        np.testing.assert_allclose([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1],
                                   np.asarray(boxes[0]) * 64, atol=3)


@need_cv2
@pytest.mark.parametrize("interp", ["nearest", "linear", "area", "cubic", "lanczos4"])
def test_resize_is_opencvs(interp):
    flags = {"nearest": cv2.INTER_NEAREST, "linear": cv2.INTER_LINEAR, "area": cv2.INTER_AREA,
             "cubic": cv2.INTER_CUBIC, "lanczos4": cv2.INTER_LANCZOS4}
    img = np.random.default_rng(1).integers(0, 256, (45, 61, 3), dtype=np.uint8)
    for h, w in ((20, 30), (90, 122), (64, 64), (30, 100)):
        d = np.abs(A.resize(img, h, w, interp).astype(int)
                   - cv2.resize(img, (w, h), interpolation=flags[interp]).astype(int))
        # Cubic: OpenCV's wheels resize through IPP, a level off on a few pixels (against the
        # fork's OpenCV, without IPP, exact: test_ssd_fork_fixtures).
        assert d.max() <= (1 if interp == "cubic" else 0)
        assert (d > 0).mean() < (0.06 if interp == "cubic" else 1e-9)


@need_cv2
def test_hsv_is_opencvs():
    """BGR2HSV is integer arithmetic in every OpenCV; HSV2BGR is checked against the fork's own
    OpenCV (4.6) in test_ssd_fork_fixtures: later versions round where 4.6 truncates, so here
    within one level."""
    img = np.random.default_rng(2).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    np.testing.assert_array_equal(A.bgr_to_hsv(img), hsv)
    hsv[..., 0] = A.convert_scale(hsv[..., 0], 1, 37.3)      # hues past 180, as AdjustHue does
    d = A.hsv_to_bgr(hsv).astype(int) - cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR).astype(int)
    assert d.min() >= -1 and d.max() <= 0


def test_bad_settings_are_one_line(voc, tmp_path):
    folder, _, label_map = voc
    text = tiny_ssd("TRAIN", str(folder / "trainval_lmdb"), 2, label_map=str(label_map))
    bad = text.replace("min_scale: 0.3", "min_scale: 0")
    with pytest.raises(CaffeparError, match=r'layer "data".*batch_sampler needs 0 < min_scale'):
        Net(parse_text(bad, caffe_pb2.NetParameter()), phase=TRAIN)
    bad = text.replace("resize_mode: WARP", "resize_mode: FIT_SMALL_SIZE")
    with pytest.raises(CaffeparError, match="FIT_SMALL_SIZE needs batch_size 1"):
        Net(parse_text(bad, caffe_pb2.NetParameter()), phase=TRAIN)


def test_train_reports_map_in_log_and_csv(voc, tmp_path, monkeypatch, capsys):
    folder, _, label_map = voc
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snap").mkdir()
    (tmp_path / "train.prototxt").write_text(
        tiny_ssd("TRAIN", str(folder / "trainval_lmdb"), 4, size=32, label_map=str(label_map)))
    (tmp_path / "test.prototxt").write_text(
        tiny_ssd("TEST", str(folder / "test_lmdb"), 3, size=32, label_map=str(label_map)))
    (tmp_path / "solver.prototxt").write_text(
        SOLVER.format(test_iter=2, test_interval=2, max_iter=4))
    with pytest.raises(SystemExit) as e:
        main(["train", "--solver", "solver.prototxt", "--log", "train.log"])
    assert e.value.code == 0, capsys.readouterr().err[-2000:]
    log = (tmp_path / "train.log").read_text()
    assert log.count("Test net output #0: detection_eval = ") == 3       # 0, 2 and the end
    with open(tmp_path / "snap" / "tiny_log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    values = [float(r["test/detection_eval"]) for r in rows if r["test/detection_eval"]]
    assert len(values) == 2 and all(0 <= v <= 1 for v in values)
    (tmp_path / "solver.prototxt").write_text(
        SOLVER.format(test_iter=1, test_interval=2, max_iter=1).replace("11point", "VOC"))
    with pytest.raises(SystemExit) as e:
        main(["train", "--solver", "solver.prototxt"])
    err = capsys.readouterr().err
    assert e.value.code != 0 and 'unknown ap_version "VOC"' in err and "Traceback" not in err
