"""caffemodel reading and writing: V1 files, legacy 4-D blob shapes, HDF5, atomic saves, and a
VGG-16-sized (553 MB) file loading in seconds."""
import os
import time

import numpy as np
import pytest

import caffepar as caffe
from caffepar.errors import WeightsError
from caffepar.proto import caffe_pb2
from conftest import CAFFE_REF, need_shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPGRADE = CAFFE_REF / "upgrade"


def test_v1_caffemodel_and_prototxt_give_caffes_forward():
    need_shared(UPGRADE)
    net = caffe.Net(str(UPGRADE / "v1_small.prototxt"), str(UPGRADE / "v1_small.caffemodel"),
                    caffe.TEST)
    for key, want in np.load(UPGRADE / "v1_small_weights.npz").items():
        layer, i = key.rsplit("/", 1)
        np.testing.assert_array_equal(net.params[layer][int(i)].data, want)
    probs = np.load(UPGRADE / "forward_prob.npz")
    out = net.forward(data=np.load(UPGRADE / "forward_input.npy"))
    for name, want in probs.items():
        np.testing.assert_allclose(out[name], want, rtol=1e-4, atol=1e-6)


def test_legacy_num_channels_height_width_blob_shape(tmp_path):
    model = os.path.join(ROOT, "tests/bad_inputs/small.prototxt")
    net = caffe.Net(model, caffe.TEST)
    proto = net.to_proto()
    for lp in proto.layer:
        for blob in lp.blobs:
            dims = list(blob.shape.dim)
            blob.ClearField("shape")
            legacy = [1] * (4 - len(dims)) + dims
            blob.num, blob.channels, blob.height, blob.width = legacy
    path = tmp_path / "legacy.caffemodel"
    path.write_bytes(proto.SerializeToString())
    other = caffe.Net(model, caffe.TEST, weights=str(path))
    for name in net.params:
        for a, b in zip(net.params[name], other.params[name]):
            assert np.array_equal(a.data, b.data)


def test_saved_caffemodel_is_a_plain_netparameter(tmp_path):
    net = caffe.Net(os.path.join(ROOT, "tests/bad_inputs/small.prototxt"), caffe.TEST)
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    proto = caffe_pb2.NetParameter.FromString(path.read_bytes())
    ip = [l for l in proto.layer if l.name == "ip1"][0]
    assert list(ip.blobs[0].shape.dim) == [5, 144]
    np.testing.assert_array_equal(np.asarray(ip.blobs[0].data, np.float32).reshape(5, 144),
                                  net.params["ip1"][0].data)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp_")]


def test_blob_count_mismatch(tmp_path):
    net = caffe.Net(os.path.join(ROOT, "tests/bad_inputs/small.prototxt"), caffe.TEST)
    proto = net.to_proto()
    del [l for l in proto.layer if l.name == "ip1"][0].blobs[1]
    path = tmp_path / "w.caffemodel"
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(WeightsError, match='layer "ip1": the caffemodel has 1 blob'):
        net.copy_from(str(path))


def test_vgg16_sized_caffemodel_loads_in_seconds(tmp_path):
    """553 MB of weights: well past protobuf's 64 MB default limit."""
    net = caffe.Net(os.path.join(ROOT, "models/vgg16/deploy.prototxt"), caffe.TEST)
    path = tmp_path / "vgg16.caffemodel"
    net.save(str(path))
    size = path.stat().st_size
    assert size > 550e6
    fc6 = net.params["fc6"][0].data.copy()
    net.params["fc6"][0].data[...] = 0
    t0 = time.perf_counter()
    net.copy_from(str(path))
    seconds = time.perf_counter() - t0
    assert np.array_equal(net.params["fc6"][0].data, fc6)
    assert seconds < 30, f"loading {size / 1e6:.0f} MB took {seconds:.1f} s"


TWO_WAYS_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 5 dim: 5 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "c"
        convolution_param { num_output: NUM kernel_size: 3 } }
layer { name: "FC" type: "InnerProduct" bottom: "c" top: "y" inner_product_param { num_output: 2 } }
"""


def test_weights_wrong_two_ways_are_reported_together(tmp_path):
    """conv1 of the wrong shape and fc1 missing: one message naming both, the shape first
    (--allow-missing cannot fix it); with --allow-missing, still the shape."""
    import caffepar as caffe
    from caffepar.errors import WeightsError
    from caffepar.io.weights import copy_weights_files
    theirs = tmp_path / "theirs.prototxt"
    theirs.write_text(TWO_WAYS_NET.replace("NUM", "5").replace("FC", "fc_other"))
    caffe.Net(str(theirs), caffe.TEST).save(str(tmp_path / "w.caffemodel"))
    ours = tmp_path / "ours.prototxt"
    ours.write_text(TWO_WAYS_NET.replace("NUM", "4").replace("FC", "fc1"))
    net = caffe.Net(str(ours), caffe.TEST)
    with pytest.raises(WeightsError) as info:
        copy_weights_files(net, [str(tmp_path / "w.caffemodel")], allow_missing=False)
    text = str(info.value)
    assert "\n" not in text
    shape = text.index('layer "conv1" param 0: shape mismatch, the caffemodel has 5 2 3 3')
    assert shape < text.index("no weights for layer(s) fc1")
    with pytest.raises(WeightsError, match='layer "conv1" param 0: shape mismatch') as info:
        copy_weights_files(net, [str(tmp_path / "w.caffemodel")], allow_missing=True)
    assert "fc1" not in str(info.value)
