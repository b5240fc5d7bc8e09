"""Layers of Caffe's forks (mobile, segmentation, detection): forward against loops written
from each fork's definition, backward by Caffe's gradient checker (float64), and one-line
errors naming the layer."""
import re
from pathlib import Path

import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import Net, TEST
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

RNG = np.random.default_rng(20)


def _inputs(*shapes):
    return "\n".join(
        f'layer {{ name: "in{i}" type: "Input" top: "{name}" input_param {{ shape {{ '
        + " ".join(f"dim: {d}" for d in shape) + " } } }"
        for i, (name, shape) in enumerate(shapes))


def _net(layer, *shapes):
    return f"force_backward: true\n{_inputs(*shapes)}\nlayer {{ name: \"l\" {layer} }}"


def _forward(text, inputs, dtype=np.float64):
    net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TEST, dtype=dtype)
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    net.forward_from_to()
    return net


def _spread(shape):
    """Distinct values far apart (no ties or near-ties for max pooling's finite differences)."""
    n = int(np.prod(shape))
    return (RNG.permutation(n) * 0.1 - n * 0.05).reshape(shape)


# ------------------------------------------------------------------ mobile
def _depthwise_ref(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    k = w.shape[-1]
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    y = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            win = xp[:, :, i * stride:i * stride + k, j * stride:j * stride + k]
            y[:, :, i, j] = np.einsum("ncab,cab->nc", win, w[:, 0]) + b
    return y


@pytest.mark.parametrize("layer_type,extra", [
    ("ConvolutionDepthwise", ""),
    ("ConvolutionDepthwise", "num_output: 3 group: 3"),
    ("DepthwiseConvolution", "num_output: 3"),
    ("DepthwiseConvolution", "num_output: 3 group: 3"),
])
def test_depthwise_forward_and_gradients(layer_type, extra):
    text = _net(f'type: "{layer_type}" bottom: "x" top: "y" convolution_param {{ {extra} '
                'kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.5 } '
                'bias_filler { type: "gaussian" std: 0.5 } }', ("x", (2, 3, 5, 5)))
    x = RNG.standard_normal((2, 3, 5, 5))
    net = _forward(text, {"x": x})
    w, b = net.params["l"][0].data, net.params["l"][1].data
    assert w.shape == (3, 1, 3, 3)
    np.testing.assert_allclose(net.blobs["y"].data, _depthwise_ref(x, w, b, 2, 1), rtol=1e-12)
    check_net_gradients(text, {"x": x})


def test_depthwise_refuses_other_group_or_outputs():
    for layer in ('type: "ConvolutionDepthwise" convolution_param { num_output: 6 kernel_size: 3 }',
                  'type: "DepthwiseConvolution" convolution_param { num_output: 3 group: 1 '
                  'kernel_size: 3 }'):
        with pytest.raises(CaffeparError, match=r'layer "l".*(num_output 6|group 1)'):
            _forward(_net(layer + ' bottom: "x" top: "y"', ("x", (1, 3, 4, 4))), {})


def test_relu6():
    x = RNG.uniform(-3, 9, (2, 3, 4, 4))
    x[np.abs(x) < 0.05] = 0.5
    x[np.abs(x - 6) < 0.05] = 5.5
    text = _net('type: "ReLU6" bottom: "x" top: "y"', ("x", x.shape))
    np.testing.assert_array_equal(_forward(text, {"x": x}).blobs["y"].data,
                                  np.minimum(np.maximum(x, 0), 6))
    check_net_gradients(text, {"x": x})


def test_shuffle_channel():
    x = RNG.standard_normal((2, 6, 3, 2))
    text = _net('type: "ShuffleChannel" bottom: "x" top: "y" shuffle_channel_param { group: 2 }',
                ("x", x.shape))
    y = _forward(text, {"x": x}).blobs["y"].data
    group, per = 2, 3
    for i in range(group):          # ShuffleNet's Resize_cpu: channel i*per + j -> j*group + i
        for j in range(per):
            np.testing.assert_array_equal(y[:, j * group + i], x[:, i * per + j])
    check_net_gradients(text, {"x": x})
    with pytest.raises(CaffeparError, match=r'layer "l".*divisible by group \(4\)'):
        _forward(_net('type: "ShuffleChannel" bottom: "x" top: "y" '
                      'shuffle_channel_param { group: 4 }', ("x", x.shape)), {})


# ------------------------------------------------------------------ segmentation
def _interp_ref(x, crop, h2, w2):
    """DeepLab's caffe_cpu_interp2, pixel by pixel (float32 source positions)."""
    y0, x0, h1, w1 = crop
    out = np.zeros(x.shape[:2] + (h2, w2))
    if (h1, w1) == (h2, w2):
        return x[:, :, y0:y0 + h1, x0:x0 + w1].copy()
    rh = np.float32(h1 - 1) / np.float32(h2 - 1) if h2 > 1 else np.float32(0)
    rw = np.float32(w1 - 1) / np.float32(w2 - 1) if w2 > 1 else np.float32(0)
    for i in range(h2):
        hr = np.float32(rh * np.float32(i))
        hi = int(hr)
        hp = 1 if hi < h1 - 1 else 0
        l1 = float(hr - np.float32(hi))
        for j in range(w2):
            wr = np.float32(rw * np.float32(j))
            wi = int(wr)
            wp = 1 if wi < w1 - 1 else 0
            m1 = float(wr - np.float32(wi))
            p = x[:, :, y0 + hi:, x0 + wi:]
            out[:, :, i, j] = ((1 - l1) * ((1 - m1) * p[:, :, 0, 0] + m1 * p[:, :, 0, wp])
                               + l1 * ((1 - m1) * p[:, :, hp, 0] + m1 * p[:, :, hp, wp]))
    return out


@pytest.mark.parametrize("param,shape,out", [
    ("zoom_factor: 2", (1, 2, 4, 3), (7, 5)),
    ("shrink_factor: 2", (1, 2, 5, 6), (3, 3)),
    ("zoom_factor: 3 shrink_factor: 2", (1, 1, 5, 5), (7, 7)),
    ("height: 6 width: 4", (2, 2, 3, 5), (6, 4)),
    ("zoom_factor: 2 pad_beg: -1 pad_end: -1", (1, 2, 6, 5), (7, 5)),
])
def test_interp(param, shape, out):
    text = _net(f'type: "Interp" bottom: "x" top: "y" interp_param {{ {param} }}',
                ("x", shape))
    x = RNG.standard_normal(shape)
    y = _forward(text, {"x": x}).blobs["y"].data
    assert y.shape[2:] == out
    pad = -int(param.split("pad_beg: ")[1].split()[0]) if "pad_beg" in param else 0
    crop = (pad, pad, shape[2] - 2 * pad, shape[3] - 2 * pad)
    np.testing.assert_allclose(y, _interp_ref(x, crop, *out), rtol=1e-6, atol=1e-12)
    check_net_gradients(text, {"x": x})


def test_interp_size_of_second_bottom():
    text = _net('type: "Interp" bottom: "x" bottom: "ref" top: "y"',
                ("x", (1, 2, 3, 3)), ("ref", (1, 1, 5, 4)))
    x = RNG.standard_normal((1, 2, 3, 3))
    y = _forward(text, {"x": x}).blobs["y"].data
    np.testing.assert_allclose(y, _interp_ref(x, (0, 0, 3, 3), 5, 4), rtol=1e-6)


def _segnet_mask(n, c, h, w, scale=2):
    """A max-pooling mask: one position in each scale x scale cell of the (h*s, w*s) plane."""
    rows = np.arange(h)[:, None] * scale + RNG.integers(0, scale, (n, c, h, w))
    cols = np.arange(w)[None, :] * scale + RNG.integers(0, scale, (n, c, h, w))
    return (rows * (w * scale) + cols).astype(np.float64)


def test_upsample_segnet_with_pooling_mask():
    """Unpooling a max pooling's output by its mask puts each max back where it was."""
    x = _spread((2, 3, 6, 4))
    text = (_inputs(("x", x.shape)) + """
      layer { name: "pool" type: "Pooling" bottom: "x" top: "p" top: "mask"
              pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
      layer { name: "up" type: "Upsample" bottom: "p" bottom: "mask" top: "y"
              upsample_param { scale: 2 } }""")
    y = _forward(text, {"x": x}).blobs["y"].data
    cells = x.reshape(2, 3, 3, 2, 2, 2)
    is_max = cells == cells.max(axis=(3, 5), keepdims=True)
    np.testing.assert_array_equal(y, np.where(is_max.reshape(x.shape), x, 0))


@pytest.mark.parametrize("param,out", [("scale: 2", (6, 4)), ("", (6, 4)),
                                       ("upsample_h: 5 upsample_w: 4", (5, 4)),
                                       ("scale: 2 pad_out_h: true", (5, 4))])
def test_upsample_segnet_gradients(param, out):
    mask = _segnet_mask(2, 2, 3, 2)
    mask[..., -1, :] -= np.where(mask[..., -1, :] >= out[0] * 4, 4, 0)
    text = _net(f'type: "Upsample" bottom: "x" bottom: "mask" top: "y" upsample_param {{ {param} }}',
                ("x", (2, 2, 3, 2)), ("mask", (2, 2, 3, 2)))
    x = RNG.standard_normal((2, 2, 3, 2))
    net = _forward(text, {"x": x, "mask": mask})
    y = net.blobs["y"].data
    assert y.shape == (2, 2) + out
    flat = y.reshape(2, 2, -1)
    np.testing.assert_array_equal(np.take_along_axis(flat, mask.reshape(2, 2, -1).astype(int), 2),
                                  x.reshape(2, 2, -1))
    assert np.count_nonzero(flat) == np.count_nonzero(x)
    check_net_gradients(text, {"x": x, "mask": mask}, skip_bottoms=("mask",))


def test_upsample_yolo_nearest():
    x = RNG.standard_normal((1, 2, 3, 2))
    text = _net('type: "Upsample" bottom: "x" top: "y" upsample_param { scale: 3 }',
                ("x", x.shape))
    y = _forward(text, {"x": x}).blobs["y"].data
    np.testing.assert_array_equal(y, x.repeat(3, axis=2).repeat(3, axis=3))
    check_net_gradients(text, {"x": x})


# ------------------------------------------------------------------ BN (PSPNet, SegNet)
def _bn_net(param, tops=1):
    extra = "".join(f' top: "s{i}"' for i in range(1, tops))
    return _net(f'type: "BN" bottom: "x" top: "y"{extra} {param}', ("x", (2, 3, 4, 5)))


def _bn_set(net, *blobs):
    for b, v in zip(net.params["l"], blobs):
        b.data[...] = np.asarray(v).reshape(1, 3, 1, 1)


BN_SLOPE, BN_BIAS, BN_MEAN, BN_VAR = [1.5, -0.5, 2.0], [0.1, 0.2, -0.3], [0.3, -1.0, 0.5], \
    [0.5, 2.0, 1.5]
EPS = float(np.float32(1e-5))       # the field's float default


@pytest.mark.parametrize("phase,frozen", [(TEST, ""), ("TRAIN", "bn_param { frozen: true }")])
def test_pspnet_bn_moving_statistics(phase, frozen):
    """PSPNet's BN at TEST (or frozen): slope * (x - mean) / sqrt(var + eps) + bias."""
    from caffepar.graph.net import TRAIN
    x = RNG.standard_normal((2, 3, 4, 5))
    net = Net(parse_text(_bn_net(frozen), caffe_pb2.NetParameter()),
              phase=TRAIN if phase == "TRAIN" else TEST, dtype=np.float64)
    _bn_set(net, BN_SLOPE, BN_BIAS, BN_MEAN, BN_VAR)
    net.blobs["x"].data[...] = x
    net.forward_from_to()
    c = (1, 3, 1, 1)
    want = (np.reshape(BN_SLOPE, c) * (x - np.reshape(BN_MEAN, c))
            / np.sqrt(np.reshape(BN_VAR, c) + EPS) + np.reshape(BN_BIAS, c))
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-12, atol=1e-14)
    assert [s.lr_mult for s in net.layers[1].param.param] == \
        ([0, 0, 0, 0] if frozen else [1, 1, 0, 0])

    def prepare(n):
        _bn_set(n, BN_SLOPE, BN_BIAS, BN_MEAN, BN_VAR)
    check_net_gradients(_bn_net(frozen), {"x": x}, check_params=False, prepare=prepare,
                        phase=TRAIN if phase == "TRAIN" else TEST)


def test_pspnet_bn_training_uses_the_batch_and_moves_the_averages():
    from caffepar.graph.net import TRAIN
    x = RNG.standard_normal((2, 3, 4, 5)) * 2 + 1
    text = _bn_net("bn_param { momentum: 0.8 }")
    net = Net(parse_text(text, caffe_pb2.NetParameter()), phase=TRAIN, dtype=np.float64)
    _bn_set(net, BN_SLOPE, BN_BIAS, BN_MEAN, BN_VAR)
    net.blobs["x"].data[...] = x
    net.forward_from_to()
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    c = (1, 3, 1, 1)
    want = (np.reshape(BN_SLOPE, c) * (x - mean.reshape(c)) / np.sqrt(var.reshape(c) + EPS)
            + np.reshape(BN_BIAS, c))
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-10, atol=1e-14)
    m = float(np.float32(0.8))
    np.testing.assert_allclose(net.params["l"][2].data.ravel(),
                               (1 - m) * mean + m * np.array(BN_MEAN), rtol=1e-12)
    np.testing.assert_allclose(net.params["l"][3].data.ravel(),
                               (1 - m) * var + m * np.array(BN_VAR), rtol=1e-12)

    def prepare(n):
        _bn_set(n, BN_SLOPE, BN_BIAS, BN_MEAN, BN_VAR)
    check_net_gradients(text, {"x": x}, phase=TRAIN, prepare=prepare)


SEGNET_BN = 'bn_param { bn_mode: %s scale_filler { type: "gaussian" } shift_filler { type: ' \
    '"gaussian" } }'


def test_segnet_bn_inference_and_learn():
    x = RNG.standard_normal((2, 3, 4, 5)) * 3 - 1
    c = (1, 3, 1, 1)
    net = _forward(_bn_net(SEGNET_BN % "INFERENCE"), {"x": x})
    scale, shift = (b.data for b in net.params["l"])
    assert len(net.params["l"]) == 2
    np.testing.assert_allclose(net.blobs["y"].data, scale * x + shift, rtol=1e-12)
    check_net_gradients(_bn_net(SEGNET_BN % "INFERENCE"), {"x": x})
    # LEARN: the batch's statistics in every phase; tops 2 and 3 are the batch mean and variance.
    net = _forward(_bn_net(SEGNET_BN % "LEARN", tops=3), {"x": x})
    scale, shift = (b.data for b in net.params["l"])
    mean, var = x.mean(axis=(0, 2, 3)).reshape(c), x.var(axis=(0, 2, 3)).reshape(c)
    np.testing.assert_allclose(net.blobs["y"].data,
                               scale * (x - mean) / np.sqrt(var + 1e-9) + shift, rtol=1e-10)
    np.testing.assert_allclose(net.blobs["s1"].data, mean, rtol=1e-12)
    np.testing.assert_allclose(net.blobs["s2"].data, var, rtol=1e-12)
    check_net_gradients(_bn_net(SEGNET_BN % "LEARN"), {"x": x})


def test_bn_mixing_the_forks_fields_is_an_error():
    with pytest.raises(CaffeparError, match=r'layer "l".*mixes SegNet.s BN fields \(bn_mode\) '
                                            r"with PSPNet's \(frozen\)"):
        _forward(_bn_net("bn_param { bn_mode: INFERENCE frozen: true }"), {})


# ------------------------------------------------------------------ detection
def _c_round(v):
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _roi_pool_ref(x, rois, ph_, pw_, scale):
    """Fast R-CNN's ROIPoolingLayer::Forward_cpu, element by element."""
    n, c, h, w = x.shape
    y = np.zeros((len(rois), c, ph_, pw_))
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh, ew, eh = (int(_c_round(v * scale)) for v in roi[1:])
        rh, rw = max(eh - sh + 1, 1), max(ew - sw + 1, 1)
        for i in range(ph_):
            for j in range(pw_):
                h0 = min(max(int(np.floor(i * rh / ph_)) + sh, 0), h)
                h1 = min(max(int(np.ceil((i + 1) * rh / ph_)) + sh, 0), h)
                w0 = min(max(int(np.floor(j * rw / pw_)) + sw, 0), w)
                w1 = min(max(int(np.ceil((j + 1) * rw / pw_)) + sw, 0), w)
                if h1 > h0 and w1 > w0:
                    y[r, :, i, j] = x[b, :, h0:h1, w0:w1].max(axis=(1, 2))
    return y


ROIS = np.array([[0, 0, 0, 15, 15], [1, 4, 2, 13, 9], [0, 6, 6, 6, 7], [1, 10, 12, 30, 30],
                 [0, 9, 9, 3, 3]], np.float64)


def test_roi_pooling():
    x = _spread((2, 2, 8, 8))
    text = _net('type: "ROIPooling" bottom: "x" bottom: "rois" top: "y" '
                'roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 }',
                ("x", x.shape), ("rois", ROIS.shape))
    y = _forward(text, {"x": x, "rois": ROIS}).blobs["y"].data
    np.testing.assert_array_equal(y, _roi_pool_ref(x, ROIS, 3, 2, 0.5))
    # The reversed last region passes no gradient, as in the fork: checked on the others.
    check_net_gradients(text.replace("dim: 5 dim: 5", "dim: 4 dim: 5"),
                        {"x": x, "rois": ROIS[:4]}, skip_bottoms=("rois",))


def _psroi_ref(x, rois, dim, g, scale):
    """R-FCN's PSROIPoolingForward, element by element."""
    n, c, h, w = x.shape
    y = np.zeros((len(rois), dim, g, g))
    for r, roi in enumerate(rois):
        b = int(roi[0])
        sw, sh = _c_round(roi[1]) * scale, _c_round(roi[2]) * scale
        ew, eh = (_c_round(roi[3]) + 1) * scale, (_c_round(roi[4]) + 1) * scale
        bh, bw = max(eh - sh, 0.1) / g, max(ew - sw, 0.1) / g
        for k in range(dim):
            for i in range(g):
                for j in range(g):
                    h0 = min(max(int(np.floor(i * bh + sh)), 0), h)
                    h1 = min(max(int(np.ceil((i + 1) * bh + sh)), 0), h)
                    w0 = min(max(int(np.floor(j * bw + sw)), 0), w)
                    w1 = min(max(int(np.ceil((j + 1) * bw + sw)), 0), w)
                    if h1 > h0 and w1 > w0:
                        y[r, k, i, j] = x[b, (k * g + i) * g + j, h0:h1, w0:w1].mean()
    return y


def test_psroi_pooling():
    x = RNG.standard_normal((2, 8, 6, 6))
    text = _net('type: "PSROIPooling" bottom: "x" bottom: "rois" top: "y" '
                'psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 group_size: 2 }',
                ("x", x.shape), ("rois", ROIS.shape))
    y = _forward(text, {"x": x, "rois": ROIS}).blobs["y"].data
    np.testing.assert_allclose(y, _psroi_ref(x, ROIS, 2, 2, 0.5), rtol=1e-12)
    check_net_gradients(text, {"x": x, "rois": ROIS}, skip_bottoms=("rois",))


# ------------------------------------------------------------------ SENet
@pytest.mark.parametrize("scale_shape", [(2, 3, 1, 1), (2, 3)])
def test_axpy(scale_shape):
    a, x, y = (RNG.standard_normal(s) for s in (scale_shape, (2, 3, 4, 5), (2, 3, 4, 5)))
    text = _net('type: "Axpy" bottom: "a" bottom: "x" bottom: "y" top: "z"',
                ("a", scale_shape), ("x", x.shape), ("y", y.shape))
    z = _forward(text, {"a": a, "x": x, "y": y}).blobs["z"].data
    for n in range(2):          # SENet's Forward_cpu: one axpy per channel
        for c in range(3):
            np.testing.assert_allclose(z[n, c], a.reshape(2, 3)[n, c] * x[n, c] + y[n, c],
                                       rtol=1e-14)
    check_net_gradients(text, {"a": a, "x": x, "y": y})


# ------------------------------------------------------------------ pooling's ceil_mode
@pytest.mark.parametrize("field,size", [("ceil_mode: false", 2), ("ceil_mode: true", 3),
                                        ("round_mode: FLOOR", 2), ("", 3)])
def test_pooling_ceil_mode(field, size):
    text = _net(f'type: "Pooling" bottom: "x" top: "y" pooling_param {{ pool: MAX '
                f'kernel_size: 2 stride: 2 {field} }}', ("x", (1, 1, 5, 5)))
    x = _spread((1, 1, 5, 5))
    y = _forward(text, {"x": x}).blobs["y"].data
    assert y.shape == (1, 1, size, size)
    np.testing.assert_array_equal(y[0, 0, :2, :2], x[0, 0, :4, :4].reshape(2, 2, 2, 2)
                                  .max(axis=(1, 3)))


# ------------------------------------------------------------------ one-line errors
@pytest.mark.parametrize("layer,shapes,expected", [
    ('type: "Interp" bottom: "x" top: "y"', [("x", (1, 1, 4, 4))],
     "gives no output size: set zoom_factor, shrink_factor, height and width"),
    ('type: "Interp" bottom: "x" top: "y" interp_param { zoom_factor: 2 pad_beg: 1 }',
     [("x", (1, 1, 4, 4))], "pad_beg and pad_end must be <= 0"),
    ('type: "Upsample" bottom: "x" top: "y" upsample_param { upsample_h: 8 upsample_w: 8 }',
     [("x", (1, 1, 4, 4))], "upsample_h, upsample_w apply only to SegNet's form"),
    ('type: "Upsample" bottom: "x" bottom: "m" top: "y" upsample_param { scale: 3 '
     'pad_out_h: true }', [("x", (1, 1, 4, 4)), ("m", (1, 1, 4, 4))],
     "pad_out_h needs scale_h 2, got 3"),
    ('type: "Upsample" bottom: "x" bottom: "m" top: "y"', [("x", (1, 1, 4, 4)),
                                                          ("m", (1, 1, 4, 3))],
     "the mask bottom must have the shape of the data bottom"),
    ('type: "ROIPooling" bottom: "x" top: "y" roi_pooling_param { pooled_h: 2 pooled_w: 2 }',
     [("x", (1, 1, 4, 4))], "takes 2 bottoms, the features and the regions of interest"),
    ('type: "ROIPooling" bottom: "x" bottom: "r" top: "y"', [("x", (1, 1, 4, 4)),
                                                            ("r", (1, 5))],
     "pooled_h must be > 0, got 0"),
    ('type: "PSROIPooling" bottom: "x" bottom: "r" top: "y" psroi_pooling_param { '
     'spatial_scale: 1 output_dim: 2 group_size: 2 }', [("x", (1, 6, 4, 4)), ("r", (1, 5))],
     r"input channels \(6\) must be output_dim x group_size\^2"),
    ('type: "Axpy" bottom: "a" bottom: "x" bottom: "x" top: "y"', [("a", (1, 2)),
                                                                  ("x", (1, 3, 2, 2))],
     r"the scale bottom must be \(N, C\) or \(N, C, 1, 1\)"),
    ('type: "PSROIPooling" bottom: "x" bottom: "r" top: "y" psroi_pooling_param { '
     'output_dim: 2 group_size: 2 }', [("x", (1, 8, 4, 4)), ("r", (1, 5))],
     "psroi_pooling_param.spatial_scale is required"),
    ('type: "Pooling" bottom: "x" top: "y" pooling_param { kernel_size: 2 ceil_mode: false '
     'round_mode: FLOOR }', [("x", (1, 1, 4, 4))], "sets both ceil_mode"),
])
def test_fork_layer_errors_name_the_layer(layer, shapes, expected):
    with pytest.raises(CaffeparError) as info:
        _forward(_net(layer, *shapes), {})
    message = str(info.value)
    assert "\n" not in message.split(" hint:")[0]
    assert 'layer "l"' in message
    assert re.search(expected, message), message


def test_upsample_mask_out_of_range():
    text = _net('type: "Upsample" bottom: "x" bottom: "m" top: "y" upsample_param { scale: 2 }',
                ("x", (1, 1, 2, 2)), ("m", (1, 1, 2, 2)))
    with pytest.raises(CaffeparError, match=r'layer "l".*mask index 99 is outside the 4x4 top'):
        _forward(text, {"m": np.full((1, 1, 2, 2), 99.0)})


# ------------------------------------------------------------------ fork .caffemodel fields
def test_caffemodel_fields_numbered_as_in_the_forks(tmp_path):
    """DeepLab writes interp_param as 143 and SegNet upsample_param as 137 (BVLC's input_param
    and embed_param) and bn_param as 45 with its own numbering: read back by the layer's type,
    every value intact."""
    from caffepar.io.weights import _length_delimited, read_caffemodel

    def layer(name, type_name, number, param):
        head = caffe_pb2.LayerParameter(name=name, type=type_name).SerializeToString()
        return _length_delimited(100, head + _length_delimited(number, param.SerializeToString()))

    interp = caffe_pb2.InterpParameter(zoom_factor=2, pad_beg=-1, pad_end=-1)
    upsample = caffe_pb2.UpsampleParameter(scale_h=2, scale_w=3, pad_out_h=True, upsample_w=7)
    shape = caffe_pb2.InputParameter()
    shape.shape.add(dim=[1, 2, 3, 4])
    blob = caffe_pb2.BlobProto(data=[1.0, 2.0])
    blob.shape.dim.append(2)
    conv = caffe_pb2.LayerParameter(name="c", type="Convolution")
    conv.blobs.append(blob)
    path = tmp_path / "fork.caffemodel"
    segnet_bn = caffe_pb2.SegNetBNParameter(bn_mode=caffe_pb2.BNParameter.INFERENCE)
    segnet_bn.scale_filler.type = "gaussian"
    path.write_bytes(layer("in", "Input", 143, shape) + layer("i", "Interp", 143, interp)
                     + layer("u", "Upsample", 137, upsample) + layer("bn", "BN", 45, segnet_bn)
                     + _length_delimited(100, conv.SerializeToString()))
    model = read_caffemodel(path)
    by_name = {lp.name: lp for lp in model.net_param.layer}
    assert by_name["i"].interp_param == interp and not by_name["i"].HasField("input_param")
    assert by_name["u"].upsample_param == upsample and not by_name["u"].HasField("embed_param")
    assert by_name["in"].input_param == shape
    bn = by_name["bn"].bn_param
    assert bn.bn_mode == bn.INFERENCE and bn.scale_filler.type == "gaussian"
    assert not bn.HasField("slope_filler") and not bn.HasField("shift_filler")
    assert model.by_name()["c"][0][0].tolist() == [1.0, 2.0]


def test_unknown_fork_type_names_its_fork():
    from caffepar.nn import layer_class
    with pytest.raises(CaffeparError) as info:
        layer_class("Mish", "m", 3, "net.prototxt")
    assert "darknet2caffe" in str(info.value) and "unknown layer type \"Mish\"" in str(info.value)


# ------------------------------------------------------------------ fine-tuning
FINETUNE_NET = """name: "seg"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 8 dim: 3 dim: 15 dim: 15 } shape { dim: 8 dim: 1 dim: 15 dim: 15 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1
                      weight_filler { type: "msra" } } }
layer { name: "relu" type: "ReLU6" bottom: "conv" top: "conv" }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "conv" top: "dw"
  convolution_param { kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu_dw" type: "ReLU6" bottom: "dw" top: "dw" }
layer { name: "score" type: "Convolution" bottom: "dw" top: "score"
  convolution_param { num_output: 2 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "up" type: "Interp" bottom: "score" top: "up" interp_param { zoom_factor: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "up" bottom: "label" top: "loss" }
"""


def test_finetuning_a_depthwise_relu6_interp_net_lowers_its_loss(tmp_path, monkeypatch):
    """A small segmentation task (is a 5x5-smoothed channel sum above zero?): fine-tuned from
    saved weights, the loss on held-out images falls to well under its start (0.85 -> 0.43)."""
    import caffepar as caffe
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(FINETUNE_NET)
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nlr_policy: "fixed"\nmax_iter: 200\n'
        'random_seed: 3\nsnapshot_after_train: false\n')
    rng = np.random.default_rng(11)

    def batch():
        x = rng.standard_normal((8, 3, 15, 15)).astype(np.float32)
        s = x.sum(axis=1)
        smooth = sum(np.roll(np.roll(s, i, 1), j, 2) for i in range(-2, 3) for j in range(-2, 3))
        return x, (smooth > 0).astype(np.float32)[:, None]

    start = caffe.get_solver("solver.prototxt")
    start.net.save(str(tmp_path / "start.caffemodel"))
    solver = caffe.get_solver("solver.prototxt")
    solver.net.copy_from(str(tmp_path / "start.caffemodel"))
    held_out = [batch() for _ in range(2)]

    def held_out_loss():
        losses = []
        for x, y in held_out:
            solver.net.blobs["data"].data[...] = x
            solver.net.blobs["label"].data[...] = y
            losses.append(float(solver.net.forward()["loss"]))
        return np.mean(losses)

    before = held_out_loss()
    for _ in range(200):
        x, y = batch()
        solver.net.blobs["data"].data[...] = x
        solver.net.blobs["label"].data[...] = y
        solver.step(1)
    after = held_out_loss()
    assert after < 0.6 * before, (before, after)
    moved = np.abs(solver.net.params["dw"][0].data - start.net.params["dw"][0].data).max()
    assert moved > 1e-2, "the depthwise weights did not train"


# ------------------------------------------------------------------ one-layer fixtures
FIXTURES = sorted((Path(__file__).parent / "fork_layers").glob("*.prototxt"))
FIXTURE_ROIS = np.array([[0, 0, 0, 23, 19], [0, 4, 2, 13, 9], [0, 6, 6, 6, 7],
                         [0, 10, 12, 30, 30]], np.float32)


def fixture_inputs(net):
    """Random features, and fixed regions for a `rois` input."""
    rng = np.random.default_rng(0)
    return {n: FIXTURE_ROIS if n == "rois" else
            rng.standard_normal(net.blobs[n].shape).astype(np.float32) for n in net.inputs}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fork_layer_fixtures_run(path):
    """The one-layer nets of tests/fork_layers (a table for checks against other tools) build
    and give finite outputs."""
    net = Net(str(path), phase=TEST)
    for name, value in fixture_inputs(net).items():
        net.blobs[name].data[...] = value
    out = net.forward()
    assert out and all(np.isfinite(v).all() and v.size for v in out.values())


def test_depthwise_flops_count_one_input_channel_per_output():
    from caffepar.convert.info import layer_flops
    net = Net(str(Path(__file__).parent / "fork_layers" / "convolution_depthwise.prototxt"),
              phase=TEST)
    layer = net.layers[1]
    out = 8 * 5 * 6
    assert layer_flops(layer, [(1, 8, 10, 12)], [(1, 8, 5, 6)]) == 2 * out * 9 + out


#: Fixtures OpenCV's dnn (4.x) runs as the forks do. The others: OpenCV has no
#: DepthwiseConvolution, Upsample or BN layer; its Interp ignores shrink_factor, pad_beg and pad_end
#: (DeepLab's rules, which caffepar follows: 10x12 zoomed by 2 after pads -1/-2 is 13x17, OpenCV
#: gives 19x23); its Axpy scales the third bottom and adds the second, where SENet's layer
#: computes a * bottom[1] + bottom[2] (the SE block's residual branch scaled, plus the shortcut).
OPENCV_RUNS = {"convolution_depthwise", "interp_size", "interp_zoom", "pooling_ceil_mode",
               "psroi_pooling", "relu6", "roi_pooling", "shuffle_channel"}


@pytest.mark.parametrize("path", [p for p in FIXTURES if p.stem in OPENCV_RUNS],
                         ids=lambda p: p.stem)
def test_fork_layer_fixtures_agree_with_opencv(path, tmp_path):
    cv2 = pytest.importorskip("cv2")
    if not cv2.__version__.startswith("4."):
        pytest.skip("OpenCV 5 has no Caffe reader")
    net = Net(str(path), phase=TEST)
    inputs = fixture_inputs(net)
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    ours = net.forward()
    net.save(str(tmp_path / "w.caffemodel"))
    other = cv2.dnn.readNetFromCaffe(str(path), str(tmp_path / "w.caffemodel"))
    for name, value in inputs.items():
        other.setInput(value, name)
    for name, value in ours.items():         # each fixture's last layer is named as its top
        np.testing.assert_allclose(other.forward(name), value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer,expected", [
    ('layer { name: "up" type: "Interp" bottom: "data" top: "up" }',
     'net.prototxt:3: error: layer "up" (Interp): gives no output size'),
    ('layer { name: "up" type: "Upsample" bottom: "data" top: "up"\n'
     '  upsample_param { scale_h: 2 } }',
     'net.prototxt:3: error: layer "up" (Upsample): scale_h apply only to SegNet'),
    ('layer { name: "roi" type: "ROIPooling" bottom: "data" top: "r"\n'
     '  roi_pooling_param { pooled_h: 2 pooled_w: 2 } }',
     'net.prototxt:3: error: layer "roi" (ROIPooling): takes 2 bottoms, the features and the '
     'regions of interest'),
])
def test_cli_error_is_one_line_with_file_and_line(tmp_path, capsys, monkeypatch, layer, expected):
    from caffepar.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(
        'name: "bad"\nlayer { name: "data" type: "Input" top: "data" input_param { shape { '
        'dim: 1 dim: 2 dim: 4 dim: 4 } } }\n' + layer + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["time", "--model", "net.prototxt", "--iterations", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 1
    assert len(err.splitlines()) == 1 and expected in err, err


def test_fork_tables_name_only_types_and_fields_caffepar_lacks():
    """A fork type or field that caffepar runs must not be refused as unknown: the tables of
    refusals and the layer registry and schema never overlap."""
    from caffepar.nn.base import LAYERS
    from caffepar.proto import caffe_pb2, forks
    assert not set(forks.FORK_LAYER_TYPES) & set(LAYERS)
    assert not set(forks.FORK_LAYER_FIELDS) & set(caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name)
