"""Data pipeline: DataTransformer, the data layers (Data, ImageData, HDF5Data, MemoryData),
prefetching, sharding and resumable state."""
import gc
import threading
import time

import numpy as np
import pytest
from google.protobuf import text_format

from caffepar import common
from caffepar.blob import Blob
from caffepar.data.prefetch import PrefetchError, Prefetcher
from caffepar.data.tools import _raw_datum, _Writer
from caffepar.data.transform import DataTransformer
from caffepar.errors import CaffeparError, DataError, NetError
from caffepar.nn import create_layer
from caffepar.proto import caffe_pb2
from conftest import CAFFE_REF, DATA, need_shared

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


@pytest.fixture(autouse=True)
def seeded():
    saved = dict(common._state)
    common.set_random_seed(1701)
    yield
    common._state.update(saved)


def make_layer(text, phase=TRAIN, shard=(0, 1), net_dir=None, ntop=2):
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    param.phase = phase
    layer = create_layer(param, phase, np.float32, {})
    layer.shard = shard
    layer.net_dir = net_dir
    tops = [Blob() for _ in range(ntop)]
    layer.setup([], tops)
    return layer, tops


def run(layer, tops, n):
    out = []
    for _ in range(n):
        layer.reshape([], tops)
        layer.forward([], tops)
        out.append([t.data.copy() for t in tops])
    return out


def make_lmdb(path, images, labels):
    w = _Writer(str(path))
    for i, (img, lab) in enumerate(zip(images, labels)):
        c, h, wd = img.shape
        w.put("%05d" % i, _raw_datum(img.tobytes(), int(lab), c, h, wd).SerializeToString())
    w.close()


@pytest.fixture
def small_lmdb(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (37, 3, 10, 12), dtype=np.uint8)
    labels = np.arange(37) % 10
    make_lmdb(tmp_path / "db", images, labels)
    return tmp_path / "db", images, labels


# ---------------------------------------------------------------- DataTransformer
def naive_transform(img, mirror, h_off, w_off, crop, mean=None, mean_values=None, scale=1.0):
    c, h, w = img.shape
    oh, ow = (crop, crop) if crop else (h, w)
    out = np.zeros((c, oh, ow), np.float32)
    for ch in range(c):
        for y in range(oh):
            for x in range(ow):
                sy, sx = h_off + y, w_off + x
                tx = ow - 1 - x if mirror else x
                v = np.float32(img[ch, sy, sx])
                if mean is not None:
                    v = v - np.float32(mean[ch, sy, sx])
                elif mean_values is not None:
                    v = v - np.float32(mean_values[ch if len(mean_values) > 1 else 0])
                out[ch, y, tx] = v * np.float32(scale)
    return out


@pytest.mark.parametrize("phase", [TRAIN, TEST])
@pytest.mark.parametrize("kind", ["mean_file", "mean_value1", "mean_value3", "none"])
def test_transformer_matches_naive(phase, kind):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (5, 3, 9, 11), dtype=np.uint8)
    tp = caffe_pb2.TransformationParameter(crop_size=6, mirror=True, scale=0.0078125)
    mean = None
    if kind == "mean_file":
        mean = rng.random((3, 9, 11)).astype(np.float32) * 255
    elif kind == "mean_value1":
        tp.mean_value.append(104.0)
    elif kind == "mean_value3":
        tp.mean_value.extend([104.0, 117.0, 123.0])
    t = DataTransformer(tp, phase, mean=mean)
    out = t(images, np.random.default_rng(7))
    mirror, h_off, w_off = t.draw(5, 9, 11, np.random.default_rng(7))
    if phase == TEST:
        assert (h_off == 1).all() and (w_off == 2).all()
    else:
        assert len({(a, b) for a, b in zip(h_off, w_off)}) > 1
    for i in range(5):
        ref = naive_transform(images[i], mirror[i], h_off[i], w_off[i], 6, mean,
                              list(tp.mean_value) or None, tp.scale)
        np.testing.assert_array_equal(out[i], ref)
    assert out.dtype == np.float32 and out.shape == (5, 3, 6, 6)


def test_transformer_plain_and_float():
    x = np.random.default_rng(0).random((2, 1, 4, 4)).astype(np.float32)
    t = DataTransformer(caffe_pb2.TransformationParameter(scale=2.0), TEST)
    np.testing.assert_array_equal(t(x), x * 2)
    np.testing.assert_array_equal(DataTransformer(None, TEST)(x), x)


def test_transformer_errors():
    tp = caffe_pb2.TransformationParameter(crop_size=20)
    with pytest.raises(DataError, match="crop_size"):
        DataTransformer(tp, TRAIN)(np.zeros((1, 3, 8, 8), np.uint8), np.random.default_rng(0))
    tp = caffe_pb2.TransformationParameter(mean_value=[1, 2])
    with pytest.raises(DataError, match="mean_value"):
        DataTransformer(tp, TRAIN)(np.zeros((1, 3, 8, 8), np.uint8))
    t = DataTransformer(None, TRAIN, mean=np.zeros((3, 4, 4), np.float32))
    with pytest.raises(DataError, match="mean has shape"):
        t(np.zeros((1, 3, 8, 8), np.uint8))


# ---------------------------------------------------------------- Data layer
DATA_LAYER = """name: "d" type: "Data" top: "data" top: "label"
data_param {{ source: "{src}" batch_size: {bs} backend: LMDB {extra} }}
transform_param {{ {tp} }}"""


def test_data_layer_sequential_and_wraps(small_lmdb):
    path, images, labels = small_lmdb
    layer, tops = make_layer(DATA_LAYER.format(src=path, bs=8, extra="", tp="scale: 0.5"))
    assert tops[0].shape == (8, 3, 10, 12) and tops[1].shape == (8,)
    batches = run(layer, tops, 6)
    order = np.arange(48) % 37
    for k, (d, l) in enumerate(batches):
        idx = order[k * 8:(k + 1) * 8]
        np.testing.assert_array_equal(d, images[idx].astype(np.float32) * 0.5)
        np.testing.assert_array_equal(l, labels[idx])
    assert layer.get_state()["epoch"] == 1 and layer.get_state()["batch"] == 6
    assert layer.data_wait_seconds >= 0
    assert layer.reset_data_wait() >= 0 and layer.data_wait_seconds == 0
    layer.close()


def test_data_layer_deterministic_and_resumable(small_lmdb):
    path, _, _ = small_lmdb
    text = DATA_LAYER.format(src=path, bs=5, extra="prefetch: 2",
                             tp="crop_size: 7 mirror: true")
    a, ta = make_layer(text)
    b, tb = make_layer(text)
    straight = run(a, ta, 12)
    for x, y in zip(straight, run(b, tb, 12)):
        np.testing.assert_array_equal(x[0], y[0])
    # Stop after 4 batches (mid-epoch), resume in a new layer: same next batches.
    c, tc = make_layer(text)
    run(c, tc, 4)
    state = c.get_state()
    c.close()
    assert state["batch"] == 4 and state["record"] == 20
    d, td = make_layer(text)
    d.set_state(state)
    for x, y in zip(straight[4:], run(d, td, 8)):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
    # set_state on a running layer drops the read-ahead.
    d.set_state({"batch": 1})
    np.testing.assert_array_equal(run(d, td, 1)[0][0], straight[1][0])
    common.set_random_seed(1702)
    e, te = make_layer(text)
    assert not np.array_equal(run(e, te, 1)[0][0], straight[0][0])
    for layer in (a, b, d, e):
        layer.close()


def test_data_layer_test_phase_centre_crop_is_fixed(small_lmdb):
    path, images, _ = small_lmdb
    text = DATA_LAYER.format(src=path, bs=4, extra="", tp="crop_size: 6")
    layer, tops = make_layer(text, phase=TEST)
    d = run(layer, tops, 1)[0][0]
    np.testing.assert_array_equal(d, images[:4, :, 2:8, 3:9].astype(np.float32))
    layer.close()


@pytest.mark.parametrize("kind", ["Data", "ImageData", "HDF5Data"])
def test_sharding_interleaves_to_single_rank(kind, small_lmdb, tmp_path):
    path, images, labels = small_lmdb
    if kind == "Data":
        text = DATA_LAYER.format(src=path, bs=3, extra="", tp="")
    elif kind == "ImageData":
        from PIL import Image
        lines = []
        for i in range(11):
            Image.fromarray(images[i].transpose(1, 2, 0)[:, :, ::-1]).save(tmp_path / f"{i}.png")
            lines.append(f"{i}.png {labels[i]}")
        (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
        text = f"""name: "d" type: "ImageData" top: "data" top: "label"
        image_data_param {{ source: "list.txt" root_folder: "{tmp_path}/" batch_size: 3 }}"""
    else:
        import h5py
        with h5py.File(tmp_path / "a.h5", "w") as f:
            f["data"] = images[:7].astype(np.float64)
            f["label"] = labels[:7]
        with h5py.File(tmp_path / "b.h5", "w") as f:
            f["data"] = images[7:13].astype(np.float64)
            f["label"] = labels[7:13]
        (tmp_path / "list.txt").write_text("a.h5\nb.h5\n")
        text = """name: "d" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "list.txt" batch_size: 3 }"""
    one, t1 = make_layer(text, net_dir=str(tmp_path))
    r0, t0 = make_layer(text, shard=(0, 2), net_dir=str(tmp_path))
    r1, tr1 = make_layer(text, shard=(1, 2), net_dir=str(tmp_path))
    single = np.concatenate([b[1] for b in run(one, t1, 8)])
    b0 = np.stack([b[1] for b in run(r0, t0, 4)])
    b1 = np.stack([b[1] for b in run(r1, tr1, 4)])
    merged = np.stack([b0.reshape(-1), b1.reshape(-1)], 1).reshape(-1)
    np.testing.assert_array_equal(merged, single)
    assert r1.get_state()["world"] == 2
    for layer in (one, r0, r1):
        layer.close()


def test_data_layer_reads_caffe_lmdb_with_mean_file(tmp_path):
    snap = need_shared(CAFFE_REF / "snapshots" / "data")
    arrays = np.load(snap / "cifar_synth_arrays.npz")
    from caffepar.data.transform import blob_proto_array
    from caffepar.proto.text import read_blob_proto
    mean = blob_proto_array(read_blob_proto(snap / "mean.binaryproto"))[0]
    layer, tops = make_layer(DATA_LAYER.format(src="data/cifar_synth_train_lmdb", bs=100, extra="",
                                               tp='mean_file: "data/mean.binaryproto"'),
                             net_dir=str(snap.parent))
    for k, (d, l) in enumerate(run(layer, tops, 6)):
        i = (k * 100) % 500
        np.testing.assert_array_equal(d, arrays["train_images"][i:i + 100].astype(np.float32) - mean)
        np.testing.assert_array_equal(l, arrays["train_labels"][i:i + 100])
    layer.close()


def test_data_layer_float_data_and_single_top(tmp_path):
    w = _Writer(str(tmp_path / "db"))
    vals = np.random.default_rng(1).random((4, 2, 3, 3)).astype(np.float32)
    for i, v in enumerate(vals):
        d = caffe_pb2.Datum(channels=2, height=3, width=3, label=i)
        d.float_data.extend(v.reshape(-1).tolist())
        w.put("%03d" % i, d.SerializeToString())
    w.close()
    text = ('name: "d" type: "Data" top: "data" '
            'data_param { source: "db" batch_size: 4 backend: LMDB }')
    layer, tops = make_layer(text, net_dir=str(tmp_path), ntop=1)
    np.testing.assert_array_equal(run(layer, tops, 1)[0][0], vals)
    layer.close()


def test_leveldb_backend(tmp_path):
    pytest.importorskip("plyvel")
    images = np.arange(2 * 3 * 4 * 4, dtype=np.uint8).reshape(2, 3, 4, 4)
    w = _Writer(str(tmp_path / "ldb"), "leveldb")
    for i, img in enumerate(images):
        w.put("%05d" % i, _raw_datum(img.tobytes(), i, 3, 4, 4).SerializeToString())
    w.close()
    text = ('name: "d" type: "Data" top: "data" top: "label" '
            'data_param { source: "ldb" batch_size: 2 backend: LEVELDB }')
    layer, tops = make_layer(text, net_dir=str(tmp_path))
    d, l = run(layer, tops, 1)[0]
    np.testing.assert_array_equal(d, images.astype(np.float32))
    np.testing.assert_array_equal(l, [0, 1])
    layer.close()


# ---------------------------------------------------------------- errors and threads
def test_missing_source_names_path_and_layer(tmp_path):
    text = DATA_LAYER.format(src="no/such_lmdb", bs=2, extra="", tp="")
    with pytest.raises(CaffeparError) as e:
        make_layer(text, net_dir=str(tmp_path))
    assert "no/such_lmdb" in str(e.value) and '"d"' in str(e.value)
    text = """name: "h" type: "HDF5Data" top: "data" hdf5_data_param { source: "nope.txt" batch_size: 2 }"""
    with pytest.raises(DataError, match="nope.txt"):
        make_layer(text, net_dir=str(tmp_path), ntop=1)
    (tmp_path / "list.txt").write_text("missing.h5\n")
    text = """name: "h" type: "HDF5Data" top: "data" hdf5_data_param { source: "list.txt" batch_size: 2 }"""
    with pytest.raises(DataError, match="missing.h5"):
        make_layer(text, net_dir=str(tmp_path), ntop=1)


def test_reader_error_surfaces_in_forward(tmp_path):
    from PIL import Image
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "ok.png")
    (tmp_path / "list.txt").write_text("ok.png 0\nok.png 1\ngone.png 2\nok.png 3\n")
    text = """name: "img" type: "ImageData" top: "data" top: "label"
    image_data_param { source: "list.txt" batch_size: 2 }"""
    layer, tops = make_layer(text, net_dir=str(tmp_path))
    run(layer, tops, 1)
    with pytest.raises(DataError) as e:
        run(layer, tops, 1)
    assert "gone.png" in str(e.value) and '"img"' in str(e.value)
    layer.close()


def test_prefetcher_error_order_and_close():
    def produce(i):
        if i == 3:
            raise ValueError("disk on fire")
        return i

    p = Prefetcher(produce, start=1, depth=2)
    assert p.next()[0] == 1 and p.next()[0] == 2
    with pytest.raises(PrefetchError, match="disk on fire"):
        p.next()
    p.restart(5)
    assert p.next()[0] == 5
    p.close()
    slow = Prefetcher(lambda i: time.sleep(0.05) or i, depth=3)
    item, waited = slow.next()
    assert item == 0 and waited > 0.01
    slow.close()


def test_layer_threads_stop_on_close_and_collection(small_lmdb):
    path, _, _ = small_lmdb
    before = {t for t in threading.enumerate() if t.name.startswith("data:")}
    layer, tops = make_layer(DATA_LAYER.format(src=path, bs=2, extra="", tp=""))
    run(layer, tops, 1)
    thread = layer._prefetcher._thread
    assert thread.daemon
    layer.close()
    assert not thread.is_alive()
    layer, tops = make_layer(DATA_LAYER.format(src=path, bs=2, extra="", tp=""))
    run(layer, tops, 1)
    thread = layer._prefetcher._thread
    del layer, tops
    gc.collect()
    thread.join(2)
    assert not thread.is_alive()
    assert {t for t in threading.enumerate() if t.name.startswith("data:")} <= before


# ---------------------------------------------------------------- ImageData
def test_image_data_sample_matches_converted_db(tmp_path):
    sample = need_shared(DATA / "cifar10_jpeg" / "sample")
    from caffepar.data.tools import convert_imageset
    from caffepar.data.sources import read_image_list
    text = f"""name: "img" type: "ImageData" top: "data" top: "label"
    image_data_param {{ source: "{sample}/list.txt" root_folder: "{sample}/" batch_size: 50 }}"""
    layer, tops = make_layer(text)
    assert tops[0].shape == (50, 3, 32, 32)
    got = run(layer, tops, 4)
    layer.close()
    convert_imageset(f"{sample}/", sample / "list.txt", tmp_path / "db")
    db_layer, db_tops = make_layer(DATA_LAYER.format(src=tmp_path / "db", bs=50, extra="", tp=""))
    for x, y in zip(got, run(db_layer, db_tops, 4)):
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
    db_layer.close()
    labels = [lab for _, lab in read_image_list(sample / "list.txt")]
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), labels)
    from PIL import Image
    first = np.asarray(Image.open(sample / read_image_list(sample / "list.txt")[0][0]).convert("RGB"))
    np.testing.assert_array_equal(got[0][0][0], first.transpose(2, 0, 1)[::-1])


def test_image_data_shuffle_resize_gray(tmp_path):
    sample = need_shared(DATA / "cifar10_jpeg" / "sample")
    text = f"""name: "img" type: "ImageData" top: "data" top: "label"
    image_data_param {{ source: "{sample}/list.txt" root_folder: "{sample}/" batch_size: 40
                        shuffle: true new_height: 16 new_width: 20 is_color: false }}"""
    layer, tops = make_layer(text)
    assert tops[0].shape == (40, 1, 16, 20)
    labels = np.concatenate([b[1] for b in run(layer, tops, 10)])
    layer.close()
    epoch0, epoch1 = labels[:200], labels[200:]
    assert sorted(epoch0) == sorted(epoch1) and not np.array_equal(epoch0, epoch1)


# ---------------------------------------------------------------- HDF5Data
def test_hdf5_data_solver_data():
    sol = need_shared(CAFFE_REF / "solvers")
    x, y = np.load(sol / "data" / "train_data.npy"), np.load(sol / "data" / "train_label.npy")
    text = """name: "data" type: "HDF5Data" top: "data" top: "label"
    hdf5_data_param { source: "data/train_list.txt" batch_size: 16 }"""
    layer, tops = make_layer(text, net_dir=str(sol))
    for k, (d, l) in enumerate(run(layer, tops, 9)):
        i = (k * 16) % 64
        np.testing.assert_array_equal(d, x[i:i + 16])
        np.testing.assert_array_equal(l, y[i:i + 16])
    assert layer.get_state() == {"batch": 9, "epoch": 2, "record": 16, "skip": 0, "rank": 0,
                                 "world": 1, "batch_size": 16}
    layer.close()


def test_hdf5_data_shuffle_covers_epoch_and_refuses_transform(tmp_path):
    import h5py
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.arange(12, dtype=np.int32)[:, None]
    (tmp_path / "l.txt").write_text("a.h5")
    text = """name: "h" type: "HDF5Data" top: "data" hdf5_data_param { source: "l.txt" batch_size: 4 shuffle: true }"""
    layer, tops = make_layer(text, net_dir=str(tmp_path), ntop=1)
    vals = np.concatenate([b[0].ravel() for b in run(layer, tops, 6)])
    assert sorted(vals[:12]) == list(range(12)) and sorted(vals[12:]) == list(range(12))
    assert not np.array_equal(vals[:12], np.arange(12))
    layer.close()
    with pytest.raises(CaffeparError, match="transform"):
        make_layer(text + " transform_param { scale: 2 }", net_dir=str(tmp_path), ntop=1)


def test_hdf5_output_writes_bottoms_as_4d_datasets(tmp_path):
    import h5py
    out = tmp_path / "out.h5"
    text = f"""name: "o" type: "HDF5Output" bottom: "data" bottom: "label"
    hdf5_output_param {{ file_name: "{out}" }}"""
    for shard, path in [((0, 1), out), ((1, 2), tmp_path / "out.rank1.h5")]:
        layer = create_layer(text_format.Parse(text, caffe_pb2.LayerParameter()), TRAIN,
                             np.float32)
        layer.shard = shard
        data, label = Blob((3, 2, 4, 5)), Blob((3,))
        layer.setup([data, label], [])
        with h5py.File(path, "r") as f:
            assert list(f) == []
        for k in range(2):
            data.data[...] = np.random.default_rng(k).standard_normal(data.shape)
            label.data[...] = np.arange(3) + k
            layer.reshape([data, label], [])
            layer.forward([data, label], [])
            with h5py.File(path, "r") as f:
                np.testing.assert_array_equal(f["data"][...], data.data)
                np.testing.assert_array_equal(f["label"][...], label.data.reshape(3, 1, 1, 1))
    with pytest.raises(CaffeparError, match="same num"):
        layer.reshape([Blob((3, 2)), Blob((2,))], [])
    bad = text.replace(str(out), str(tmp_path / "missing" / "out.h5"))
    with pytest.raises(DataError, match="cannot write HDF5 output") as e:
        create_layer(text_format.Parse(bad, caffe_pb2.LayerParameter()), TRAIN,
                     np.float32).setup([Blob((1, 1)), Blob((1,))], [])
    assert "missing" in str(e.value)
    with pytest.raises(CaffeparError, match="file_name"):
        create_layer(text_format.Parse(text.replace(f'file_name: "{out}"', ""),
                                       caffe_pb2.LayerParameter()), TRAIN, np.float32).setup(
            [Blob((1, 1)), Blob((1,))], [])


# ---------------------------------------------------------------- MemoryData
MEMORY_NET = """name: "m"
layer { name: "mem" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 1 weight_filler { type: "constant" value: 1 } } }
"""


def test_memory_data_set_input_arrays(tmp_path):
    import caffepar as caffe
    (tmp_path / "net.prototxt").write_text(MEMORY_NET)
    net = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST)
    data = np.arange(24, dtype=np.float32).reshape(4, 1, 2, 3)
    labels = np.arange(4, dtype=np.float32)
    net.set_input_arrays(data, labels)
    for k in range(3):
        net.forward()
        i = (k * 2) % 4
        np.testing.assert_array_equal(net.blobs["data"].data, data[i:i + 2])
        np.testing.assert_array_equal(net.blobs["label"].data.ravel(), labels[i:i + 2])
        np.testing.assert_allclose(net.blobs["ip"].data.ravel(), data[i:i + 2].sum(axis=(1, 2, 3)))
    with pytest.raises(NetError, match="float32"):
        net.set_input_arrays(data.astype(np.float64), labels)
    with pytest.raises(NetError, match="C contiguous"):
        net.set_input_arrays(np.asfortranarray(data), labels)
    with pytest.raises(NetError, match="4-d"):
        net.set_input_arrays(data.reshape(4, 6), labels)
    with pytest.raises(NetError, match="same first dimension"):
        net.set_input_arrays(data, labels[:2])
    with pytest.raises(NetError, match="multiple of batch size"):
        net.set_input_arrays(data[:3], labels[:3])
    with pytest.raises(NetError, match="height"):
        net.set_input_arrays(data.reshape(4, 1, 3, 2), labels)
    fresh = caffe.Net(str(tmp_path / "net.prototxt"), caffe.TEST)
    with pytest.raises(CaffeparError, match="set_input_arrays"):
        fresh.forward()
