"""pycaffe's API on caffepar: constructor forms, forward/backward with start/end and keyword
blobs, Blob attributes, reshape, forward_all, load_hdf5, learnable blobs of Python layers, and
caffe.io helpers."""
import ast
import os
import sys

import numpy as np
import pytest

import caffepar as caffe
from caffepar.errors import DataError, NetError, WeightsError
from conftest import DATA, need_shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "models/cifar10_quick/deploy.prototxt")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    caffe.set_random_seed(3)
    net = caffe.Net(DEPLOY, caffe.TEST)
    for blobs in net.params.values():
        blobs[0].data[...] = np.random.default_rng(0).standard_normal(blobs[0].shape) * 0.05
    path = tmp_path_factory.mktemp("w") / "w.caffemodel"
    net.save(str(path))
    return str(path)


def test_constructor_forms_agree(weights):
    nets = [caffe.Net(DEPLOY, weights, caffe.TEST),
            caffe.Net(DEPLOY, caffe.TEST, weights=weights),
            caffe.Net(DEPLOY, phase=caffe.TEST, weights=weights)]
    for net in nets[1:]:
        for name in nets[0].params:
            assert np.array_equal(net.params[name][0].data, nets[0].params[name][0].data)
    with pytest.raises(NetError, match="phase"):
        caffe.Net(DEPLOY)


def test_blob_api_and_reshape(weights):
    net = caffe.Net(DEPLOY, weights, caffe.TEST)
    data = net.blobs["data"]
    assert data.shape == (1, 3, 32, 32) and data.count == 3 * 32 * 32
    data.reshape(5, 3, 32, 32)
    net.reshape()
    assert net.blobs["prob"].shape == (5, 10)
    assert [l.type for l in net.layers][:2] == ["Input", "Convolution"]
    assert list(net.params) == ["conv1", "conv2", "conv3", "ip1", "ip2"]
    assert net.inputs == ["data"] and net.outputs == ["prob"]


def test_forward_start_end_and_backward_kwargs(weights):
    net = caffe.Net(DEPLOY, weights, caffe.TEST)
    x = np.random.default_rng(1).uniform(-50, 50, (1, 3, 32, 32)).astype(np.float32)
    full = net.forward(data=x)["prob"].copy()
    part = net.forward(end="relu1")
    assert list(part) == ["pool1"]
    rest = net.forward(start="conv2")
    np.testing.assert_allclose(rest["prob"], full, rtol=1e-6)
    out = net.forward(blobs=["conv1"], data=x)
    assert set(out) == {"prob", "conv1"}
    grads = net.backward(prob=np.ones((1, 10), np.float32))
    assert set(grads) == {"data"} and grads["data"].shape == x.shape
    back = net.backward(diffs=["conv1"], start="ip2", end="conv2",
                        prob=np.ones((1, 10), np.float32))
    assert "conv1" in back and "pool1" in back


def test_forward_all_batches_any_length(weights):
    net = caffe.Net(DEPLOY, weights, caffe.TEST)
    net.blobs["data"].reshape(4, 3, 32, 32)
    net.reshape()
    x = np.random.default_rng(2).uniform(-50, 50, (10, 3, 32, 32)).astype(np.float32)
    probs = net.forward_all(data=x)["prob"]
    assert probs.shape == (10, 10)
    single = caffe.Net(DEPLOY, weights, caffe.TEST)
    np.testing.assert_allclose(probs[7], single.forward(data=x[7:8])["prob"][0], rtol=1e-5,
                               atol=1e-7)


def test_io_blobproto_and_datum_round_trip():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert np.array_equal(caffe.io.blobproto_to_array(caffe.io.array_to_blobproto(arr)), arr)
    img = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    datum = caffe.io.array_to_datum(img, label=7)
    assert datum.label == 7 and np.array_equal(caffe.io.datum_to_array(datum), img)
    arrays = caffe.io.blobprotovector_str_to_arraylist(
        caffe.io.arraylist_to_blobprotovector_str([arr, arr * 2]))
    assert np.array_equal(arrays[1], arr * 2)


def test_transformer_on_a_real_image():
    sample = need_shared(DATA / "cifar10_jpeg/sample")
    image = caffe.io.load_image(str(sample / "cat/0000.jpg"))
    assert image.shape == (32, 32, 3) and 0 <= image.min() and image.max() <= 1
    t = caffe.io.Transformer({"data": (1, 3, 32, 32)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    x = t.preprocess("data", image)
    assert x.shape == (3, 32, 32)
    np.testing.assert_allclose(x[0], image[:, :, 2] * 255 - 104, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(t.deprocess("data", x), image, atol=1e-5)


def test_blobproto_to_array_shapes_as_pycaffe():
    blob = caffe.proto.caffe_pb2.BlobProto()
    blob.data.extend(range(12))
    with pytest.raises(ValueError, match="12 values"):
        caffe.io.blobproto_to_array(blob)
    blob.shape.dim.extend([3, 4])
    assert caffe.io.blobproto_to_array(blob).shape == (3, 4)
    blob.num, blob.channels, blob.height, blob.width = 1, 2, 2, 3
    assert caffe.io.blobproto_to_array(blob).shape == (1, 2, 2, 3)
    blob.diff.extend(range(12, 24))
    assert caffe.io.blobproto_to_array(blob, return_diff=True)[0, 1, 1, 2] == 23
    scalar = caffe.proto.caffe_pb2.BlobProto(data=[123])
    arr = caffe.io.blobproto_to_array(scalar)
    assert arr.shape == () and arr == 123


def test_load_hdf5_round_trip(weights, tmp_path):
    net = caffe.Net(DEPLOY, weights, caffe.TEST)
    path = str(tmp_path / "w.h5")
    net.save_hdf5(path)
    other = caffe.Net(DEPLOY, caffe.TEST)
    other.load_hdf5(path)
    for name, blobs in net.params.items():
        for mine, theirs in zip(blobs, other.params[name]):
            assert np.array_equal(mine.data, theirs.data)
    with pytest.raises(WeightsError, match="not an HDF5 file"):
        other.load_hdf5(weights)


def test_forward_backward_all(weights):
    net = caffe.Net(DEPLOY, weights, caffe.TEST)
    net.blobs["data"].reshape(2, 3, 32, 32)
    net.reshape()
    x = np.random.default_rng(4).uniform(-50, 50, (3, 3, 32, 32)).astype(np.float32)
    outs, grads = net.forward_backward_all(data=x, prob=np.ones((3, 10), np.float32))
    assert outs["prob"].shape == (3, 10) and grads["data"].shape == x.shape
    single = caffe.Net(DEPLOY, weights, caffe.TEST)
    single.forward(data=x[2:])
    want = single.backward(prob=np.ones((1, 10), np.float32))["data"]
    np.testing.assert_allclose(grads["data"][2:], want, rtol=1e-4, atol=1e-6)


PARAM_LAYER = """
import caffe


class Scale(caffe.Layer):
    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs[0].data[...] = 2
        self.note = "user attribute"

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.blobs[0].data * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[...] += (top[0].diff * bottom[0].data).sum()
        bottom[0].diff[...] = self.blobs[0].data * top[0].diff
"""


def test_python_layer_learnable_blob(tmp_path, monkeypatch):
    """add_blob makes a parameter: in net.params, in the flat buffers, trained by the solver,
    saved and loaded with the caffemodel. net.layers[i] answers for the user object."""
    (tmp_path / "scale_layer.py").write_text(PARAM_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    net_path = tmp_path / "net.prototxt"
    net_path.write_text("""
      layer { name: "in" type: "DummyData" top: "x" top: "y"
              dummy_data_param { shape { dim: 4 } shape { dim: 4 }
                                 data_filler { type: "constant" value: 1 }
                                 data_filler { type: "constant" value: 5 } } }
      layer { name: "scale" type: "Python" bottom: "x" top: "sx"
              python_param { module: "scale_layer" layer: "Scale" } }
      layer { name: "loss" type: "EuclideanLoss" bottom: "sx" bottom: "y" top: "loss" }""")
    solver_path = tmp_path / "solver.prototxt"
    solver_path.write_text(f'net: "{net_path}" base_lr: 0.25 lr_policy: "fixed" max_iter: 1 '
                           f'snapshot_prefix: "{tmp_path}/s"')
    try:
        solver = caffe.SGDSolver(str(solver_path))
        net = solver.net
        assert isinstance(net, caffe.Net) and not isinstance(net, caffe.Classifier)
        layer = net.layers[list(net._layer_names).index("scale")]
        assert layer.note == "user attribute" and layer.type == "Python"
        blob = net.params["scale"][0]
        assert blob.shape == (1,) and np.shares_memory(blob.data, net.param_data)
        solver.step(1)
        # loss = sum((w x - y)^2) / 2 / 4 with x = 1, y = 5, w = 2: dL/dw = (2 - 5) = -3
        assert blob.data[0] == pytest.approx(2 + 0.25 * 3)
        path = str(tmp_path / "w.caffemodel")
        net.save(path)
        other = caffe.Net(str(net_path), caffe.TEST, weights=path)
        assert other.params["scale"][0].data[0] == pytest.approx(2.75)
    finally:
        sys.modules.pop("scale_layer", None)


def test_solver_depends_on_the_net_not_on_the_pycaffe_facade():
    source = os.path.join(ROOT, "caffepar/solvers/solver.py")
    imported = set()
    for node in ast.walk(ast.parse(open(source).read())):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert "caffepar.graph.net" in imported
    assert not {m for m in imported if m and "pycaffe" in m}


def test_transformer_resizes_an_image_mean_of_another_size():
    """An ImageNet-style 3 x 256 x 256 mean for a smaller input is resized, as pycaffe does;
    a mean with the wrong channels is refused."""
    t = caffe.io.Transformer({"data": (1, 3, 8, 8)})
    ramp = np.linspace(0, 1, 16, dtype=np.float32)
    mean = np.stack([np.full((16, 16), 10.0), np.full((16, 16), 20.0),
                     np.tile(ramp, (16, 1)) * 30]).astype(np.float32)
    t.set_mean("data", mean)
    resized = t.mean["data"]
    assert resized.shape == (3, 8, 8)
    np.testing.assert_allclose(resized[:2], np.broadcast_to([[[10.0]], [[20.0]]], (2, 8, 8)),
                               rtol=1e-6)
    assert np.all(np.diff(resized[2], axis=1) > 0) and np.ptp(resized[2], axis=0).max() < 1e-5
    with pytest.raises(DataError, match="channels"):
        t.set_mean("data", np.zeros((4, 8, 8), np.float32))


HOOKED_NET = """name: "hooked"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 }
                        bias_filler { type: "gaussian" std: 1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "ip" }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "data" top: "loss" }
"""


@pytest.mark.parametrize("phase", [caffe.TRAIN, caffe.TEST])
def test_layer_hooks_see_each_layer_as_caffe_leaves_it(tmp_path, phase):
    """before_forward & co. are called with each layer's index, in Caffe's order, and a hook
    reads the blobs as they are between two layers: an in-place chain's top after the
    InnerProduct holds its own output, not the BatchNorm's or ReLU's (which a forward without
    hooks folds into it)."""
    path = tmp_path / "net.prototxt"
    path.write_text(HOOKED_NET.replace('type: "EuclideanLoss" bottom: "ip" bottom: "data"',
                                       'type: "EuclideanLoss" bottom: "ip" bottom: "ip"')
                    if phase == caffe.TEST else HOOKED_NET.replace(
                        'dim: 5', 'dim: 4'))
    net = caffe.Net(str(path), phase)
    net.blobs["data"].data[...] = np.random.default_rng(0).normal(size=net.blobs["data"].shape)
    if phase == caffe.TEST:
        bn = net.params["bn"]
        bn[0].data[...], bn[1].data[...], bn[2].data[...] = 3.0, 2.0, 1.0
    calls, seen = [], {}
    net.before_forward(lambda i: calls.append(("before", i)))
    net.after_forward(lambda i: calls.append(("after", i)))
    net.after_forward(lambda i: seen.setdefault(i, net.blobs["ip"].data.copy()))
    net.before_backward(lambda i: calls.append(("before_backward", i)))
    net.forward()
    n = len(net.layers)
    assert calls == [(when, i) for i in range(n) for when in ("before", "after")]
    w, b = (p.data.astype(np.float64) for p in net.params["ip"])
    ip = net.blobs["data"].data @ w.T + b
    at = list(net._layer_names).index("ip")    # TRAIN has a Split of data before it
    np.testing.assert_allclose(seen[at], ip, rtol=1e-5, atol=1e-5)
    assert (seen[at] < 0).any()
    assert (net.blobs["ip"].data >= 0).all()
    calls.clear()
    net.backward()
    assert calls == [("before_backward", i) for i in range(n - 1, -1, -1)]
    with pytest.raises(NetError, match="after_forward hook must be callable"):
        net.after_forward(3)
