"""pycaffe's API on caffepar: constructor forms, forward/backward with start/end and keyword
blobs, Blob attributes, reshape, forward_all, and caffe.io helpers."""
import os

import numpy as np
import pytest

import caffepar as caffe
from caffepar.errors import NetError
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
