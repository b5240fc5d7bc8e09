"""Caffe's data tools: convert_cifar10, convert_mnist, convert_imageset, compute_image_mean."""
import gzip
import io
import lzma

import numpy as np
import pytest

from caffepar.data import tools
from caffepar.data.sources import datum_array, open_db, parse_datum, read_image_list
from caffepar.errors import DataError, MissingFileError
from caffepar.proto.text import read_blob_proto
from conftest import CAFFE_REF, DATA, need_shared


def records(path, backend="lmdb"):
    db = open_db(str(path), backend)
    try:
        return [(k.decode(), parse_datum(v)) for k, v in db.items()]
    finally:
        db.close()


def test_convert_cifar10_real_partial_batches(tmp_path):
    src = need_shared(DATA / "cifar10")
    n = tools.convert_cifar10(src, tmp_path)
    raw = {}
    for name in ["data_batch_%d" % i for i in range(1, 6)] + ["test_batch"]:
        path = next(src.glob(name + ".*bin.xz"))
        raw[name] = np.frombuffer(lzma.open(path).read(), np.uint8).reshape(-1, 3073)
    n_train = sum(len(raw["data_batch_%d" % i]) for i in range(1, 6))
    assert n == n_train + len(raw["test_batch"])
    train = records(tmp_path / "cifar10_train_lmdb")
    assert len(train) == n_train
    assert [k for k, _ in train[:2]] == ["00000", "00001"]
    assert train[len(raw["data_batch_1"])][0] == "10000"
    expected = np.concatenate([raw["data_batch_%d" % i] for i in range(1, 6)])
    got = np.stack([np.frombuffer(d.data, np.uint8) for _, d in train])
    np.testing.assert_array_equal(got, expected[:, 1:])
    np.testing.assert_array_equal([d.label for _, d in train], expected[:, 0])
    d = train[0][1]
    assert (d.channels, d.height, d.width, d.encoded) == (3, 32, 32, False)
    stored = np.fromfile(src / "labels" / "data_batch_1.labels", np.uint8)
    np.testing.assert_array_equal([d.label for _, d in train[:len(raw["data_batch_1"])]],
                                  stored[:len(raw["data_batch_1"])])
    test = records(tmp_path / "cifar10_test_lmdb")
    assert test[-1][0] == "%05d" % (len(raw["test_batch"]) - 1)
    with pytest.raises(DataError, match="exists"):
        tools.convert_cifar10(src, tmp_path)


def test_convert_cifar10_matches_caffe_bytes(tmp_path):
    """Caffe's convert_cifar_data output for the synthetic snapshot set, byte for byte."""
    snap = need_shared(CAFFE_REF / "snapshots" / "data")
    arrays = np.load(snap / "cifar_synth_arrays.npz")
    src = tmp_path / "bins"
    src.mkdir()
    x, y = arrays["train_images"].reshape(500, -1), arrays["train_labels"].astype(np.uint8)
    for i in range(5):
        part = np.concatenate([y[i * 100:(i + 1) * 100, None], x[i * 100:(i + 1) * 100]], 1)
        with gzip.open(src / f"data_batch_{i + 1}.bin.gz", "wb") as f:
            f.write(part.tobytes())
    test = np.concatenate([arrays["test_labels"].astype(np.uint8)[:, None],
                           arrays["test_images"].reshape(100, -1)], 1)
    test.tofile(src / "test_batch.bin")
    assert tools.convert_cifar10(src, tmp_path) == 600
    ref = open_db(str(snap / "cifar_synth_test_lmdb"))
    ours = open_db(str(tmp_path / "cifar10_test_lmdb"))
    assert list(ref.items()) == list(ours.items())


def test_convert_mnist_test_set(tmp_path):
    mnist = need_shared(DATA / "mnist")
    n = tools.convert_mnist(mnist / "t10k-images-idx3-ubyte.gz",
                            mnist / "t10k-labels-idx1-ubyte.gz", tmp_path / "mnist_test_lmdb")
    assert n == 10000
    with gzip.open(mnist / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(mnist / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    db = open_db(str(tmp_path / "mnist_test_lmdb"))
    assert len(db) == 10000
    for i in (0, 1, 2, 9999):
        value = db.get(i)
        d = parse_datum(value)
        assert (d.channels, d.height, d.width) == (1, 28, 28)
        np.testing.assert_array_equal(datum_array(d)[0], images[i])
        assert d.label == labels[i]
    first = next(db.items())[0]
    assert first == b"00000000"
    assert labels[:3].tolist() == [7, 2, 1]
    with pytest.raises(DataError, match="magic"):
        tools.convert_mnist(mnist / "t10k-labels-idx1-ubyte.gz",
                            mnist / "t10k-labels-idx1-ubyte.gz", tmp_path / "bad")


def test_compute_image_mean_matches_caffe(tmp_path):
    snap = need_shared(CAFFE_REF / "snapshots" / "data")
    out = tmp_path / "mean.binaryproto"
    assert tools.compute_image_mean(snap / "cifar_synth_train_lmdb", out) == 500
    assert out.read_bytes() == (snap / "mean.binaryproto").read_bytes()
    images = np.load(snap / "cifar_synth_arrays.npz")["train_images"]
    blob = read_blob_proto(out)
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 32, 32)
    np.testing.assert_allclose(np.asarray(blob.data).reshape(3, 32, 32),
                               images.astype(np.float64).mean(0), rtol=0, atol=1e-4)


def test_compute_image_mean_encoded_and_numpy(tmp_path):
    sample = need_shared(DATA / "cifar10_jpeg" / "sample")
    tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "raw")
    tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "enc", encoded=True)
    raw, n = tools.image_mean(tmp_path / "raw")
    enc, n2 = tools.image_mean(tmp_path / "enc")
    assert n == n2 == 200
    imgs = np.stack([datum_array(d) for _, d in records(tmp_path / "raw")])
    np.testing.assert_allclose(raw, imgs.mean(0), atol=1e-4)
    np.testing.assert_array_equal(raw, enc)
    with pytest.raises(MissingFileError):
        tools.compute_image_mean(tmp_path / "nothing")


def test_convert_imageset_raw_encoded_resized(tmp_path):
    sample = need_shared(DATA / "cifar10_jpeg" / "sample")
    from PIL import Image
    lines = read_image_list(sample / "list.txt")
    assert tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "raw") == 200
    raw = records(tmp_path / "raw")
    assert [k for k, _ in raw[:2]] == ["%08d_%s" % (i, lines[i][0]) for i in range(2)]
    first = np.asarray(Image.open(sample / lines[0][0]).convert("RGB"))
    d = raw[0][1]
    assert (d.channels, d.height, d.width, d.label) == (3, 32, 32, lines[0][1])
    assert d.HasField("encoded") and not d.encoded
    np.testing.assert_array_equal(datum_array(d), first[:, :, ::-1].transpose(2, 0, 1))

    tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "enc", encoded=True)
    enc = records(tmp_path / "enc")
    assert enc[5][1].encoded and enc[5][1].data == (sample / lines[5][0]).read_bytes()
    assert not enc[5][1].HasField("channels")
    np.testing.assert_array_equal(datum_array(enc[5][1]), datum_array(raw[5][1]))

    n = tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "png",
                               resize_height=16, resize_width=16, encode_type="png", gray=True,
                               shuffle=True, seed=0)
    assert n == 200
    png = records(tmp_path / "png")
    with Image.open(io.BytesIO(png[0][1].data)) as im:
        assert im.format == "PNG" and im.size == (16, 16) and im.mode == "L"
    keys = [k for k, _ in png]
    assert keys != ["%08d_%s" % (i, p) for i, (p, _) in enumerate(lines)]
    assert sorted(k.split("_", 1)[1] for k in keys) == sorted(p for p, _ in lines)
    assert datum_array(png[0][1]).shape == (1, 16, 16)


# A 5x7 gray image and what OpenCV's cv2.resize (INTER_LINEAR) makes of it.
RESIZE_SRC = np.array([
    [95, 130, 194, 217, 207, 235, 15],
    [163, 33, 215, 217, 130, 248, 189],
    [16, 69, 184, 232, 205, 78, 169],
    [61, 125, 10, 29, 240, 66, 19],
    [182, 39, 59, 4, 59, 81, 222],
], np.uint8)
RESIZE_3x4 = np.array([
    [110, 203, 186, 135],
    [36, 190, 208, 135],
    [114, 39, 106, 125],
], np.uint8)
RESIZE_9x11 = np.array([
    [95, 111, 136, 176, 202, 217, 211, 214, 232, 115, 15],
    [118, 108, 107, 173, 207, 217, 194, 197, 234, 148, 73],
    [155, 105, 59, 166, 214, 217, 167, 168, 237, 205, 169],
    [98, 75, 63, 160, 209, 224, 185, 166, 172, 176, 180],
    [16, 40, 79, 153, 201, 232, 215, 170, 90, 128, 169],
    [41, 68, 99, 91, 99, 119, 186, 182, 85, 79, 86],
    [74, 93, 106, 43, 19, 26, 149, 178, 81, 53, 41],
    [142, 108, 65, 49, 31, 12, 80, 107, 80, 118, 154],
    [182, 117, 41, 53, 39, 4, 39, 65, 79, 158, 222],
], np.uint8)


def test_cv_resize_matches_opencv():
    from caffepar.data.sources import cv_resize
    src = RESIZE_SRC[:, :, None]
    np.testing.assert_array_equal(cv_resize(src, 3, 4)[:, :, 0], RESIZE_3x4)
    np.testing.assert_array_equal(cv_resize(src, 9, 11)[:, :, 0], RESIZE_9x11)
    img = np.arange(4 * 6, dtype=np.uint8).reshape(4, 6, 1) * 10
    half = cv_resize(img, 2, 3)[..., 0]
    np.testing.assert_array_equal(half, (img[..., 0].reshape(2, 2, 3, 2).astype(int).sum((1, 3))
                                         + 2) >> 2)


def test_leveldb_round_trip(tmp_path):
    pytest.importorskip("plyvel")
    sample = need_shared(DATA / "cifar10_jpeg" / "sample")
    tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "ldb", backend="leveldb")
    lmdb_recs = None
    tools.convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "lmdb")
    lmdb_recs = [(k, d.SerializeToString()) for k, d in records(tmp_path / "lmdb")]
    assert [(k, d.SerializeToString()) for k, d in records(tmp_path / "ldb", "leveldb")] == lmdb_recs


def test_progress_only_on_terminal():
    buf = io.StringIO()
    with tools.Progress(3, "x", stream=buf) as bar:
        bar.update(3)
    assert buf.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    with tools.Progress(2, "x", stream=tty) as bar:
        bar.update(2)
    assert "2/2" in tty.getvalue() and tty.getvalue().endswith("\n")
