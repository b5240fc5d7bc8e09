"""Gradient checks (Caffe's semantics, float64) of Convolution, Deconvolution, Im2col and
InnerProduct through the net, over their options; plus InnerProduct against NumPy."""
import numpy as np
import pytest

from gradcheck import check_net_gradients

pytestmark = pytest.mark.usefixtures("kernel_path")

RNG = np.random.default_rng(4)


def _net(layer, shape, extra=""):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f"""
      force_backward: true
      layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}
      layer {{ name: "l" bottom: "x" top: "y" {layer} }}
      {extra}
    """


FILLERS = 'weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "gaussian" std: 0.3 }'


@pytest.mark.parametrize("shape,param", [
    ((2, 3, 5, 5), "num_output: 4 kernel_size: 3"),
    ((2, 4, 6, 5), "num_output: 4 kernel_size: 3 stride: 2 pad: 1 group: 2"),
    ((1, 2, 7, 7), "num_output: 3 kernel_size: 3 dilation: 2 pad: 2"),
    ((1, 2, 5, 6), "num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0"),
    ((1, 4, 4, 4), "num_output: 4 kernel_size: 3 pad: 1 group: 4 bias_term: false"),
    ((1, 2, 4, 4, 3), "num_output: 2 kernel_size: 2 kernel_size: 3 kernel_size: 2 pad: 1"),
])
def test_convolution_gradients(shape, param):
    check_net_gradients(_net(f'type: "Convolution" convolution_param {{ {param} {FILLERS} }}',
                             shape), {"x": RNG.standard_normal(shape)})


@pytest.mark.parametrize("shape,param", [
    ((2, 3, 3, 3), "num_output: 2 kernel_size: 3"),
    ((1, 4, 3, 4), "num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2"),
    ((1, 2, 3, 3), "num_output: 3 kernel_size: 3 dilation: 2 bias_term: false"),
])
def test_deconvolution_gradients(shape, param):
    check_net_gradients(_net(f'type: "Deconvolution" convolution_param {{ {param} {FILLERS} }}',
                             shape), {"x": RNG.standard_normal(shape)})


def test_im2col_gradient():
    check_net_gradients(_net('type: "Im2col" convolution_param { kernel_size: 3 stride: 2 pad: 1 }',
                             (2, 2, 5, 5)), {"x": RNG.standard_normal((2, 2, 5, 5))})


@pytest.mark.parametrize("shape,param", [
    ((3, 2, 2, 2), "num_output: 4"),
    ((2, 3, 4), "num_output: 5 axis: 2"),
    ((3, 6), "num_output: 2 transpose: true"),
    ((3, 6), "num_output: 2 bias_term: false"),
])
def test_inner_product_gradients(shape, param):
    net = check_net_gradients(
        _net(f'type: "InnerProduct" inner_product_param {{ {param} {FILLERS} }}', shape),
        {"x": RNG.standard_normal(shape)})
    p = net.layer_dict["l"]
    w = p.blobs[0].data
    x = net.blobs["x"].data.reshape(p.m, p.k)
    want = x @ (w if p.transpose else w.T) + (p.blobs[1].data if p.bias_term else 0)
    np.testing.assert_allclose(net.blobs["y"].data.reshape(p.m, -1), want, rtol=1e-12)


@pytest.mark.parametrize("shape,param", [
    ((2, 3, 5, 6), "num_output: 4 kernel_size: 3 pad: 1"),
    ((1, 4, 5, 5), "num_output: 2 kernel_size: 3 pad_h: 0 pad_w: 2 group: 2"),
])
def test_winograd_convolution_gradients(shape, param, monkeypatch):
    """The Winograd F(2x2, 3x3) engine, taken for any width here."""
    from caffepar.nn.conv import winograd
    monkeypatch.setattr(winograd, "WINOGRAD_MIN_CHANNELS", 1)
    monkeypatch.setattr(winograd, "WINOGRAD_MAX_WASTE", 1.0)
    check_net_gradients(_net(f'type: "Convolution" convolution_param {{ {param} {FILLERS} }}',
                             shape), {"x": RNG.standard_normal(shape)})


def test_reshape_follows_the_bottoms():
    """Convolution and InnerProduct return at once from a reshape that repeats the last one,
    and follow a changed batch, or a top reshaped by someone else, at the next."""
    from caffepar.graph.net import TEST, Net
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import parse_text
    text = _net(f'type: "Convolution" convolution_param {{ num_output: 4 kernel_size: 3 '
                f'{FILLERS} }}', (2, 3, 5, 5),
                f'layer {{ name: "ip" type: "InnerProduct" bottom: "y" top: "z" '
                f'inner_product_param {{ num_output: 3 {FILLERS} }} }}')
    net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST, dtype=np.float64)
    ip = net.layer_dict["ip"]
    for batch in (2, 2, 3, 1):
        net.blobs["x"].reshape(batch, 3, 5, 5)
        net.blobs["x"].data[...] = RNG.standard_normal((batch, 3, 5, 5))
        net.reshape()
        net.forward_from_to()
        y = net.blobs["y"].data
        assert y.shape == (batch, 4, 3, 3) and net.blobs["z"].shape == (batch, 3)
        want = y.reshape(batch, -1) @ ip.blobs[0].data.T + ip.blobs[1].data
        np.testing.assert_allclose(net.blobs["z"].data, want, rtol=1e-12)
    net.blobs["y"].reshape(7, 1)
    net.reshape()
    assert net.blobs["y"].shape == (1, 4, 3, 3)
