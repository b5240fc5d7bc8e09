"""pycaffe's coord_map: maps between tops of a NetSpec, checked against offsets worked out by
hand and against where an impulse actually lands in a net that runs."""
import numpy as np
import pytest

import caffepar as caffe
from caffepar import layers as L, params as P
from caffepar.coord_map import coord_map_from_to, crop


def fcn_like(pad=100):
    """FCN's pattern: a padded conv, 2x pooling, a conv, 2x upsampling deconv.
    Input x maps to conv1 x + pad - 1, pool (x + pad - 1) / 2 - 1/4, conv2 that - 1, and
    upscore 2 (that) + 3/2 = x + pad - 2: upscore is the data shifted by pad - 2."""
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 20, 20]))
    n.conv1 = L.Convolution(n.data, num_output=1, kernel_size=3, pad=pad)
    n.pool1 = L.Pooling(n.conv1, pool=P.Pooling.AVE, kernel_size=2, stride=2)
    n.conv2 = L.Convolution(n.pool1, num_output=1, kernel_size=3)
    n.upscore = L.Deconvolution(n.conv2, convolution_param=dict(num_output=1, kernel_size=4,
                                                                stride=2, bias_term=False))
    return n


def test_fcn_like_offsets_match_hand_computation():
    n = fcn_like()
    ax, a, b = coord_map_from_to(n.upscore, n.data)
    assert ax == 1 and a == 1 and b == -98
    n.score = crop(n.upscore, n.data)
    layer = n.to_proto().layer[-1]
    assert layer.type == "Crop" and list(layer.bottom) == ["upscore", "data"]
    assert layer.crop_param.axis == 2 and list(layer.crop_param.offset) == [98]
    net = caffe.Net(n.to_proto(), caffe.TEST)
    assert net.blobs["upscore"].shape == (1, 1, 216, 216)
    assert net.blobs["score"].shape == net.blobs["data"].shape
    ax, a, b = coord_map_from_to(n.pool1, n.data)
    assert (ax, a, b) == (1, 2, -98.5)


def test_an_impulse_lands_where_the_map_says():
    """Stride-1 layers with symmetric kernels keep an impulse's centre: conv k5 pad 3 maps
    x to x + 1, deconv k3 to x + 1, so the crop takes offset 2 and gives the impulse back at
    its input position."""
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 12, 12]))
    n.conv = L.Convolution(n.data, num_output=1, kernel_size=5, pad=3,
                           weight_filler=dict(type="constant", value=1))
    n.relu = L.ReLU(n.conv)
    n.up = L.Deconvolution(n.relu, convolution_param=dict(
        num_output=1, kernel_size=3, bias_term=False, weight_filler=dict(type="constant",
                                                                         value=1)))
    assert coord_map_from_to(n.up, n.data)[1:] == (1, -2)
    n.out = crop(n.up, n.data)
    net = caffe.Net(n.to_proto(), caffe.TEST)
    x = np.zeros((1, 1, 12, 12), np.float32)
    x[0, 0, 4, 7] = 1
    y = net.forward(data=x)["out"][0, 0]
    assert y.shape == (12, 12)
    rows, cols = np.indices(y.shape)
    assert (rows * y).sum() / y.sum() == pytest.approx(4)
    assert (cols * y).sum() / y.sum() == pytest.approx(7)


def test_dilation_and_per_axis_kernels():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 30, 30]))
    n.conv = L.Convolution(n.data, num_output=1, kernel_size=[3, 5], dilation=2, pad=[1, 0])
    ax, a, b = coord_map_from_to(n.conv, n.data)
    # effective kernels 5 and 9: conv = data + pad - (k_eff - 1) / 2, so data = conv + (1, 4)
    assert ax == 1 and np.all(a == 1) and list(b) == [1, 4]


def test_unmappable_and_impossible_crops_are_refused():
    n = fcn_like()
    n.ip = L.InnerProduct(n.upscore, num_output=2)
    with pytest.raises(RuntimeError, match="connected by spatial layers"):
        coord_map_from_to(n.ip, n.data)
    small = fcn_like(pad=0)
    with pytest.raises(AssertionError, match="negative offset"):
        crop(small.upscore, small.data)
    legacy = caffe.NetSpec()
    legacy.data = L.Input(shape=dict(dim=[1, 1, 8, 8]))
    legacy.conv = L.Convolution(legacy.data, num_output=1, kernel_h=3, kernel_w=3)
    with pytest.raises(AssertionError, match="legacy"):
        coord_map_from_to(legacy.conv, legacy.data)
