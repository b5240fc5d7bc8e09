"""Export a Caffe deploy net (TEST phase, with its weights) to ONNX.

One small function per Caffe layer type, in `CONVERTERS` keyed by Caffe's type string. Each
reproduces Caffe's arithmetic rather than the nearest ONNX operator's, where they differ:

- Pooling: Caffe rounds the output size up, drops a last window that would start in the padding,
  and divides AVE windows by their size clipped to H + pad. ONNX's ceil_mode and
  count_include_pad do not say the same thing, so the input is padded explicitly (or cropped)
  to exactly the cells Caffe's windows reach, pooled with no padding, and AVE results are
  multiplied by a constant k*k / Caffe's divisor where that differs from 1.
- BatchNorm: Caffe stores running sums and a scale factor (blob 2); the exported mean and
  variance are divided by it (a factor of 0 gives 0, as in Caffe).
- LRN WITHIN_CHANNEL has no ONNX operator; it is built from Mul/Pad/AveragePool/Pow, with
  Caffe's quirk of ignoring `k`.

The batch dimension is free by default (`batch=N` fixes it), and with `dynamic_spatial` so are
height and width, for fully convolutional nets. Which dimension of each blob follows the input's
is found by reshaping the caffepar Net once at another input size (batch + 1, spatial size
doubled) and seeing which dimensions change: a Reshape then copies (0) or infers (-1) exactly
those; Crop takes its size from the reference blob's runtime shape; pooling over a free size
uses ONNX's ceil mode, whose window count and AVE divisors are Caffe's. A layer that ties a free
dimension to a fixed one (an InnerProduct over height and width) is refused by name. Layers ONNX
cannot express (losses, data readers, recurrent, Python) are all named in one error before
anything is written.
"""
import math
import os
from dataclasses import dataclass, field

import numpy as np

from caffepar.errors import CaffeparError, LayerError
from caffepar.proto import caffe_pb2

__all__ = ["CONVERTERS", "DEFAULT_OPSET", "ExportResult", "export_onnx", "net_to_onnx",
           "UNSUPPORTED"]

DEFAULT_OPSET = 17
FLT_MAX = float(np.finfo(np.float32).max)
PP = caffe_pb2.PoolingParameter
LRNP = caffe_pb2.LRNParameter
EP = caffe_pb2.EltwiseParameter
RP = caffe_pb2.ReductionParameter


class OnnxExportError(LayerError):
    """A net (or layer setting) that has no faithful ONNX form."""


def _need_onnx():
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise CaffeparError("ONNX export needs the onnx package: pip install 'caffepar[onnx]'") \
            from None


class _Graph:
    """Nodes and initializers being built, with unique tensor names."""

    def __init__(self, net):
        from onnx import helper, numpy_helper
        self.helper, self.numpy_helper = helper, numpy_helper
        self.net = net
        self.nodes, self.initializers, self.used = [], [], set()
        self.layer_name = ""
        self.fast = False           # steps that run faster than the plain ops (onnx_forward)

    def fresh(self, base):
        name, i = base, 1
        while name in self.used:
            name = f"{base}_{i}"
            i += 1
        self.used.add(name)
        return name

    def const(self, base, array, dtype=np.float32):
        name = self.fresh(f"{self.layer_name}/{base}")
        arr = np.ascontiguousarray(np.asarray(array, dtype))
        self.initializers.append(self.numpy_helper.from_array(arr, name))
        return name

    def scalar(self, base, value, dtype=np.int64):
        """A 0-d initializer (const keeps at least one axis), as Range's bounds must be."""
        name = self.fresh(f"{self.layer_name}/{base}")
        self.initializers.append(self.numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def ints(self, base, values):
        return self.const(base, np.asarray(values, np.int64).reshape(-1), np.int64)

    def node(self, op, inputs, out=None, **attrs):
        """Add one node; returns its (single) output name, `out` if given."""
        out = out or self.fresh(f"{self.layer_name}/{op}")
        return self.node_outputs(op, inputs, [out], **attrs)[0]

    def node_outputs(self, op, inputs, outs, **attrs):
        """Add one node with the given output names (None: a fresh one); returns them."""
        outs = [o or self.fresh(f"{self.layer_name}/{op}") for o in outs]
        self.used.update(outs)
        self.nodes.append(self.helper.make_node(op, list(inputs), outs,
                                                name=self.fresh(f"{self.layer_name}/{op}_node"),
                                                **attrs))
        return outs


@dataclass
class _Ctx:
    """What a converter gets: the caffepar layer, its bottoms' ONNX names and Caffe shapes,
    its tops' Caffe shapes and the names its outputs should take; the `probe_` shapes are the
    same blobs at another input size (equal to the others where nothing is free)."""

    layer: object
    inputs: list
    bottom_shapes: list
    top_shapes: list
    outs: list
    probe_bottom_shapes: list = None
    probe_top_shapes: list = None

    def __post_init__(self):
        self.probe_bottom_shapes = self.probe_bottom_shapes or self.bottom_shapes
        self.probe_top_shapes = self.probe_top_shapes or self.top_shapes

    @property
    def p(self):
        return self.layer.param

    def error(self, message):
        return OnnxExportError(message, layer=self.layer.name, layer_type=self.layer.type)

    def free_axes(self, bottom=0):
        """Axes of a bottom whose size follows the graph input's."""
        return [a for a, (b, q) in enumerate(zip(self.bottom_shapes[bottom],
                                                 self.probe_bottom_shapes[bottom])) if b != q]


def _target_shape(ctx, top, source, probe_source):
    """The Reshape shape giving top `top` from a tensor of shape `source` (`probe_source` at
    the probe size): fixed sizes as they are, a free one copied (0) where the source has it at
    the same axis, else inferred (-1), which ONNX allows once."""
    out, inferred = [], []
    for a, (b, q) in enumerate(zip(ctx.top_shapes[top], ctx.probe_top_shapes[top])):
        if b == q:
            out.append(int(b))
        elif a < len(source) and source[a] == b and probe_source[a] == q:
            out.append(0)
        else:
            out.append(-1)
            inferred.append(a)
    if len(inferred) > 1:
        raise ctx.error(f"top shape {tuple(ctx.top_shapes[top])} has {len(inferred)} "
                        "dimensions that follow the input size in different ways; export with "
                        "a fixed size (--batch, without --dynamic-spatial)")
    return out


def _blob(ctx, i):
    return np.asarray(ctx.layer.blobs[i].data, np.float32)


def _axis(axis, ndim):
    return axis + ndim if axis < 0 else axis


# ------------------------------------------------------------------------ vision layers
def _conv_attrs(ctx):
    layer = ctx.layer
    if layer.axis != 1:
        raise ctx.error(f"convolution over axis {layer.axis} (only axis 1, the channel axis, "
                        "maps to ONNX)")
    return dict(kernel_shape=list(layer.kernel), strides=list(layer.stride),
                pads=list(layer.pad) * 2, dilations=list(layer.dilation), group=layer.group)


def _convolution(g, ctx):
    inputs = [ctx.inputs[0], g.const("weight", _blob(ctx, 0))]
    if ctx.layer.bias_term:
        inputs.append(g.const("bias", _blob(ctx, 1).reshape(-1)))
    return [g.node("Conv", inputs, ctx.outs[0], **_conv_attrs(ctx))]


def _deconvolution(g, ctx):
    # Caffe's deconv weight is (C_in, C_out / group, k...), ONNX ConvTranspose's too; the
    # output size stride*(in-1) + dilated kernel - 2*pad is ONNX's with output_padding 0.
    inputs = [ctx.inputs[0], g.const("weight", _blob(ctx, 0))]
    if ctx.layer.bias_term:
        inputs.append(g.const("bias", _blob(ctx, 1).reshape(-1)))
    return [g.node("ConvTranspose", inputs, ctx.outs[0], **_conv_attrs(ctx))]


def _caffe_ave_divisors(size, k, pad, stride, out):
    """Caffe's AVE divisor along one axis: window clipped to [.., size + pad)."""
    starts = np.arange(out) * stride - pad
    ends = np.minimum(starts + k, size + pad)
    return (ends - starts).astype(np.float64)


def _pooling(g, ctx):
    layer, p = ctx.layer, ctx.p.pooling_param
    method = p.pool
    if method == PP.STOCHASTIC:
        raise ctx.error("STOCHASTIC pooling (random at TRAIN, weighted at TEST) has no ONNX form")
    mask = len(ctx.outs) > 1
    n, c, h, w = ctx.bottom_shapes[0]
    geom = layer.geom
    kh, kw, ph, pw, sh, sw = geom.kh, geom.kw, geom.ph, geom.pw, geom.sh, geom.sw
    oh, ow = ctx.top_shapes[0][2], ctx.top_shapes[0][3]
    free = set(ctx.free_axes()) & {2, 3}
    if mask and free:
        raise ctx.error("the MAX pooling mask top over a free height or width is not exported")
    if not mask and (p.global_pooling or (not free and kh == h and kw == w and ph == pw == 0
                                          and oh == ow == 1)):
        op = "GlobalMaxPool" if method == PP.MAX else "GlobalAveragePool"
        return [g.node(op, [ctx.inputs[0]], ctx.outs[0])]
    if free:
        return _pooling_free_size(g, ctx, method, geom)
    # The padded frame Caffe's windows reach: rows -ph .. (oh-1)*sh + kh - ph.
    need_h, need_w = (oh - 1) * sh + kh, (ow - 1) * sw + kw
    end_h, end_w = need_h - h - ph, need_w - w - pw
    x = ctx.inputs[0]
    if end_h < 0 or end_w < 0:
        # Trailing rows no window reaches (floor rounding): crop them off.
        x = g.node("Slice", [x, g.ints("starts", [0, 0]),
                             g.ints("ends", [h + min(end_h, 0), w + min(end_w, 0)]),
                             g.ints("axes", [2, 3])])
        end_h, end_w = max(end_h, 0), max(end_w, 0)
    if g.fast and method == PP.MAX and not mask:
        # Padding as the op's own (cells it never takes): no padded copy of the input.
        return [g.node("MaxPool", [x], ctx.outs[0], kernel_shape=[kh, kw], strides=[sh, sw],
                       pads=[ph, pw, end_h, end_w])]
    if ph or pw or end_h or end_w:
        fill = -FLT_MAX if method == PP.MAX else 0.0
        x = g.node("Pad", [x, g.ints("pads", [0, 0, ph, pw, 0, 0, end_h, end_w]),
                           g.const("fill", np.array(fill, np.float32))], mode="constant")
    op = "MaxPool" if method == PP.MAX else "AveragePool"
    attrs = dict(kernel_shape=[kh, kw], strides=[sh, sw])
    if mask:
        return _caffe_mask(g, ctx, x, attrs, need_w, ph, pw, h, w)
    if method == PP.MAX:
        return [g.node(op, [x], ctx.outs[0], **attrs)]
    div = np.outer(_caffe_ave_divisors(h, kh, ph, sh, oh), _caffe_ave_divisors(w, kw, pw, sw, ow))
    correction = (kh * kw) / div
    if np.all(correction == 1):
        return [g.node(op, [x], ctx.outs[0], **attrs)]
    pooled = g.node(op, [x], **attrs)
    return [g.node("Mul", [pooled, g.const("ave_divisor_fix", correction.reshape(1, 1, oh, ow))],
                   ctx.outs[0])]


def _caffe_mask(g, ctx, x, attrs, padded_w, ph, pw, h, w):
    """The MAX pooling mask in Caffe's layout: for each window, the index within the unpadded
    plane of its first maximum in row-major order (Caffe's scan; ties are common after a ReLU,
    and an unpooling places values by them). Each window's cells are gathered from the padded
    plane and ArgMax takes the first maximum."""
    (kh, kw), (sh, sw) = attrs["kernel_shape"], attrs["strides"]
    oh, ow = ctx.top_shapes[0][2:]
    rows = (np.arange(oh) * sh)[:, None, None, None] + np.arange(kh)[None, None, :, None]
    cols = (np.arange(ow) * sw)[None, :, None, None] + np.arange(kw)[None, None, None, :]
    cells = (rows * padded_w + cols).reshape(oh * ow, kh * kw)
    caffe = ((rows - ph) * w + cols - pw).reshape(-1)
    pooled = g.node("MaxPool", [x], ctx.outs[0], **attrs)
    windows = g.node("Gather", [g.node("Reshape", [x, g.ints("planes", [0, 0, -1])]),
                                g.const("window_cells", cells, np.int64)], axis=2)
    first = g.node("ArgMax", [windows], axis=3, keepdims=0, select_last_index=0)
    cell = g.node("Add", [first, g.const("window_start", np.arange(oh * ow) * kh * kw, np.int64)])
    index = g.node("Gather", [g.const("caffe_index", caffe, np.int64), cell], axis=0)
    index = g.node("Reshape", [index, g.ints("mask_shape", [0, 0, oh, ow])])
    return [pooled, g.node("Cast", [index], ctx.outs[1], to=1)]


def _pooling_free_size(g, ctx, method, geom):
    """Pooling over a height or width known only at run time: ONNX's ceil mode counts Caffe's
    windows (ceil, then one fewer when the last starts in the padding) and, counting the
    padding, divides AVE windows as Caffe does. Windows narrower than their stride can start
    past the input, where the two differ: refused."""
    if geom.kh < geom.sh or geom.kw < geom.sw:
        raise ctx.error(f"a {geom.kh}x{geom.kw} window with stride {geom.sh}x{geom.sw} over a "
                        "free height or width (windows narrower than their stride are not "
                        "exported with --dynamic-spatial)")
    op = "MaxPool" if method == PP.MAX else "AveragePool"
    attrs = dict(kernel_shape=[geom.kh, geom.kw], strides=[geom.sh, geom.sw],
                 pads=[geom.ph, geom.pw, geom.ph, geom.pw], ceil_mode=1)
    if method != PP.MAX:
        attrs["count_include_pad"] = 1
    return [g.node(op, [ctx.inputs[0]], ctx.outs[0], **attrs)]


def _lrn(g, ctx):
    layer = ctx.layer
    x = ctx.inputs[0]
    if layer.region == LRNP.ACROSS_CHANNELS and g.fast and len(ctx.bottom_shapes[0]) == 4 \
            and not ctx.free_axes():
        return [_lrn_by_steps(g, ctx)]
    if layer.region == LRNP.ACROSS_CHANNELS:
        # ONNX LRN: x / (bias + alpha/size * sum of squares over `size` channels)^beta = Caffe's.
        return [g.node("LRN", [x], ctx.outs[0], size=layer.size, alpha=layer.alpha,
                       beta=layer.beta, bias=layer.k)]
    pad = (layer.size - 1) // 2
    sq = g.node("Mul", [x, x])
    if pad:
        sq = g.node("Pad", [sq, g.ints("pads", [0, 0, pad, pad, 0, 0, pad, pad])],
                    mode="constant")
    avg = g.node("AveragePool", [sq], kernel_shape=[layer.size, layer.size], strides=[1, 1])
    scaled = g.node("Mul", [avg, g.const("alpha", np.array(layer.alpha, np.float32))])
    base = g.node("Add", [scaled, g.const("one", np.array(1.0, np.float32))])
    factor = g.node("Pow", [base, g.const("neg_beta", np.array(-layer.beta, np.float32))])
    return [g.node("Mul", [x, factor], ctx.outs[0])]


def _lrn_by_steps(g, ctx):
    """Caffe's LRN across channels as elementwise steps and a sum of the squares' channel-shifted
    slices (zeros beyond the channels, as Caffe sums): onnxruntime's own LRN takes 12 ms on
    GoogLeNet's 192 x 56 x 56 map, these steps about two."""
    layer = ctx.layer
    x = ctx.inputs[0]
    n, c, h, w = ctx.bottom_shapes[0]
    pad = (layer.size - 1) // 2
    sq = g.node("Mul", [x, x])
    if pad:
        sq = g.node("Pad", [sq, g.ints("pads", [0, pad, 0, 0, 0, pad, 0, 0])], mode="constant")
    axis = g.ints("axis", [1])
    parts = [g.node("Slice", [sq, g.ints("start", [j]), g.ints("end", [j + c]), axis])
             for j in range(layer.size)] if pad else [sq]
    total = g.node("Sum", parts) if len(parts) > 1 else parts[0]
    base = g.node("Add", [g.node("Mul", [total, g.const("alpha_n", np.array(
        layer.alpha / layer.size, np.float32))]), g.const("k", np.array(layer.k, np.float32))])
    factor = g.node("Exp", [g.node("Mul", [g.node("Log", [base]),
                                           g.const("neg_beta", np.array(-layer.beta, np.float32))])])
    return g.node("Mul", [x, factor], ctx.outs[0])


def _inner_product(g, ctx):
    layer = ctx.layer
    flat = g.node("Flatten", [ctx.inputs[0]], axis=layer.axis)
    inputs = [flat, g.const("weight", _blob(ctx, 0))]
    if len(layer.blobs) > 1:
        inputs.append(g.const("bias", _blob(ctx, 1).reshape(-1)))
    axis = _axis(layer.axis, len(ctx.bottom_shapes[0]))
    if set(ctx.free_axes()) - set(range(axis)):
        raise ctx.error("an InnerProduct over a free height or width (its weights fix the "
                        "input size): export with a fixed size (without --dynamic-spatial)")
    out_shape = ctx.top_shapes[0]
    direct = len(out_shape) == 2
    y = g.node("Gemm", inputs, ctx.outs[0] if direct else None,
               transB=0 if layer.transpose else 1)
    if direct:
        return [y]
    flat = [int(np.prod(ctx.bottom_shapes[0][:axis])), out_shape[-1]]
    probe_flat = [int(np.prod(ctx.probe_bottom_shapes[0][:axis])), out_shape[-1]]
    return [g.node("Reshape", [y, g.ints("shape", _target_shape(ctx, 0, flat, probe_flat))],
                   ctx.outs[0])]


def _batch_norm(g, ctx):
    layer = ctx.layer
    if not layer.use_global:
        raise ctx.error("use_global_stats: false normalises with the batch's own statistics; "
                        "export a TEST-phase net that uses the stored ones")
    if len(ctx.bottom_shapes[0]) < 2:
        raise ctx.error("BatchNorm on a 1-D blob has no channel axis for ONNX")
    s = float(_blob(ctx, 2).reshape(-1)[0])
    factor = 0.0 if s == 0 else 1.0 / s
    mean = (_blob(ctx, 0).reshape(-1) * np.float32(factor)).astype(np.float32)
    var = (_blob(ctx, 1).reshape(-1) * np.float32(factor)).astype(np.float32)
    c = mean.size
    return [g.node("BatchNormalization",
                   [ctx.inputs[0], g.const("gamma", np.ones(c)), g.const("beta", np.zeros(c)),
                    g.const("mean", mean), g.const("var", var)], ctx.outs[0],
                   epsilon=float(layer.eps))]


def _broadcast_shape(shape, axis, ndim):
    """A parameter covering bottom axes axis..axis+len(shape) as an ONNX-broadcastable shape."""
    return tuple(shape) + (1,) * (ndim - axis - len(shape))


def _scale_or_bias(g, ctx, op, param, learned_index):
    ndim = len(ctx.bottom_shapes[0])
    axis = _axis(param.axis, ndim)
    x = ctx.inputs[0]
    if len(ctx.inputs) > 1:
        # Each of the second bottom's axes copied (0), trailing 1s to broadcast.
        other_shape = ctx.bottom_shapes[1]
        other = g.node("Reshape", [ctx.inputs[1], g.ints(
            "shape", _broadcast_shape([0] * len(other_shape), axis, ndim))])
    else:
        arr = _blob(ctx, learned_index)
        other = g.const(op.lower(), arr.reshape(_broadcast_shape(arr.shape, axis, ndim)))
    return x, other, axis, ndim


def _scale(g, ctx):
    p = ctx.p.scale_param
    x, scale, axis, ndim = _scale_or_bias(g, ctx, "Scale", p, 0)
    has_bias = p.bias_term
    y = g.node("Mul", [x, scale], None if has_bias else ctx.outs[0])
    if not has_bias:
        return [y]
    bias = _blob(ctx, 1 if len(ctx.inputs) == 1 else 0)
    b = g.const("bias", bias.reshape(_broadcast_shape(bias.shape, axis, ndim)))
    return [g.node("Add", [y, b], ctx.outs[0])]


def _bias(g, ctx):
    x, bias, _axis_, _n = _scale_or_bias(g, ctx, "Bias", ctx.p.bias_param, 0)
    return [g.node("Add", [x, bias], ctx.outs[0])]


# ------------------------------------------------------------------------ neurons
def _simple(op, **attrs):
    def convert(g, ctx):
        return [g.node(op, [ctx.inputs[0]], ctx.outs[0], **attrs)]
    convert.__name__ = f"_{op.lower()}"
    return convert


def _relu(g, ctx):
    slope = ctx.p.relu_param.negative_slope
    if slope:
        return [g.node("LeakyRelu", [ctx.inputs[0]], ctx.outs[0], alpha=float(slope))]
    return [g.node("Relu", [ctx.inputs[0]], ctx.outs[0])]


def _prelu(g, ctx):
    slope = _blob(ctx, 0).reshape(-1)
    ndim = len(ctx.bottom_shapes[0])
    if slope.size > 1:
        slope = slope.reshape((slope.size,) + (1,) * max(ndim - 2, 0))
    return [g.node("PRelu", [ctx.inputs[0], g.const("slope", slope)], ctx.outs[0])]


def _elu(g, ctx):
    return [g.node("Elu", [ctx.inputs[0]], ctx.outs[0], alpha=float(ctx.p.elu_param.alpha))]


def _affine(g, ctx, x, scale, shift):
    if scale != 1:
        x = g.node("Mul", [x, g.const("scale", np.array(scale, np.float32))])
    if shift != 0:
        x = g.node("Add", [x, g.const("shift", np.array(shift, np.float32))])
    return x


def _finish(g, ctx, x):
    """Make sure the layer's last tensor carries its wanted output name."""
    return [g.node("Identity", [x], ctx.outs[0])] if x == ctx.inputs[0] else \
        [_rename(g, x, ctx.outs[0])]


def _rename(g, tensor, name):
    for node in reversed(g.nodes):
        if list(node.output) == [tensor]:
            node.output[0] = name
            g.used.add(name)
            return name
    return g.node("Identity", [tensor], name)


def _power(g, ctx):
    p = ctx.p.power_param
    x = _affine(g, ctx, ctx.inputs[0], p.scale, p.shift)
    if p.power != 1:
        x = g.node("Pow", [x, g.const("power", np.array(p.power, np.float32))])
    return _finish(g, ctx, x)


def _exp(g, ctx):
    p = ctx.p.exp_param
    log_base = 1.0 if p.base == -1 else math.log(p.base)
    x = _affine(g, ctx, ctx.inputs[0], p.scale * log_base, p.shift * log_base)
    return [g.node("Exp", [x], ctx.outs[0])]


def _log(g, ctx):
    p = ctx.p.log_param
    x = _affine(g, ctx, ctx.inputs[0], p.scale, p.shift)
    y = g.node("Log", [x])
    if p.base != -1:
        y = g.node("Mul", [y, g.const("inv_log_base", np.array(1 / math.log(p.base),
                                                                np.float32))])
    return _finish(g, ctx, y)


def _threshold(g, ctx):
    t = g.const("threshold", np.array(ctx.p.threshold_param.threshold, np.float32))
    above = g.node("Greater", [ctx.inputs[0], t])
    return [g.node("Cast", [above], ctx.outs[0], to=1)]


def _clip(g, ctx):
    p = ctx.p.clip_param
    return [g.node("Clip", [ctx.inputs[0], g.const("min", np.array(p.min, np.float32)),
                            g.const("max", np.array(p.max, np.float32))], ctx.outs[0])]


def _swish(g, ctx):
    beta = ctx.p.swish_param.beta
    x = ctx.inputs[0]
    inner = x if beta == 1 else g.node("Mul", [x, g.const("beta", np.array(beta, np.float32))])
    return [g.node("Mul", [x, g.node("Sigmoid", [inner])], ctx.outs[0])]


def _dropout(g, ctx):
    layer = ctx.layer
    if layer.scale_train:
        return list(ctx.inputs[:1])  # the identity at TEST time: no node at all
    return [g.node("Mul", [ctx.inputs[0], g.const("keep", np.array(1 - layer.ratio,
                                                                   np.float32))], ctx.outs[0])]


def _split(g, ctx):
    return [ctx.inputs[0]] * len(ctx.outs)


def _silence(g, ctx):
    """Silence only takes blobs nobody reads (so Caffe does not print them): nothing to do at
    inference."""
    return []


# ------------------------------------------------------------------------ shape layers
def _reshape_to_top(g, ctx):
    shape = _target_shape(ctx, 0, ctx.bottom_shapes[0], ctx.probe_bottom_shapes[0])
    return [g.node("Reshape", [ctx.inputs[0], g.ints("shape", shape)], ctx.outs[0])]


def _concat(g, ctx):
    p = ctx.p.concat_param
    axis = p.concat_dim if p.HasField("concat_dim") else p.axis
    axis = _axis(axis, len(ctx.bottom_shapes[0]))
    if len(ctx.inputs) == 1:
        return list(ctx.inputs)
    return [g.node("Concat", ctx.inputs, ctx.outs[0], axis=axis)]


def _slice(g, ctx):
    p = ctx.p.slice_param
    ndim = len(ctx.bottom_shapes[0])
    axis = _axis(p.slice_dim if p.HasField("slice_dim") else p.axis, ndim)
    sizes = [s[axis] for s in ctx.top_shapes]
    if len(sizes) == 1:
        return list(ctx.inputs)
    if axis in ctx.free_axes():
        raise ctx.error(f"slicing axis {axis}, whose size follows the input's, into fixed "
                        "sizes: export with a fixed size")
    node = g.helper.make_node("Split", [ctx.inputs[0], g.ints("split", sizes)], list(ctx.outs),
                              name=g.fresh(f"{g.layer_name}/Split_node"), axis=axis)
    g.nodes.append(node)
    g.used.update(ctx.outs)
    return list(ctx.outs)


def _crop(g, ctx):
    p = ctx.p.crop_param
    ndim = len(ctx.bottom_shapes[0])
    axis = _axis(p.axis, ndim)
    offsets = list(p.offset)
    axes = list(range(axis, ndim))
    if len(offsets) == 1:
        offsets = offsets * len(axes)
    elif not offsets:
        offsets = [0] * len(axes)
    starts = offsets
    if not set(ctx.free_axes(1)) & set(axes):
        ends = g.ints("ends", [o + ctx.top_shapes[0][a] for o, a in zip(offsets, axes)])
    else:   # the reference blob's size is known at run time: ends = offset + its size
        size = g.node("Gather", [g.node("Shape", [ctx.inputs[1]]), g.ints("axes_of_ref", axes)])
        ends = g.node("Add", [size, g.ints("offsets", offsets)])
    return [g.node("Slice", [ctx.inputs[0], g.ints("starts", starts), ends,
                             g.ints("axes", axes)], ctx.outs[0])]


def _softmax(g, ctx):
    axis = _axis(ctx.p.softmax_param.axis, len(ctx.bottom_shapes[0]))
    return [g.node("Softmax", [ctx.inputs[0]], ctx.outs[0], axis=axis)]


def _eltwise(g, ctx):
    p = ctx.p.eltwise_param
    xs = list(ctx.inputs)
    if p.operation == EP.PROD:
        y = xs[0]
        for i, x in enumerate(xs[1:]):
            y = g.node("Mul", [y, x], ctx.outs[0] if i == len(xs) - 2 else None)
        return [y]
    if p.operation == EP.MAX:
        return [g.node("Max", xs, ctx.outs[0])]
    coeffs = list(p.coeff) or [1.0] * len(xs)
    if len(coeffs) != len(xs):
        raise ctx.error(f"{len(coeffs)} coefficients for {len(xs)} bottoms")
    terms = [x if c == 1 else g.node("Mul", [x, g.const("coeff", np.array(c, np.float32))])
             for x, c in zip(xs, coeffs)]
    return [g.node("Sum", terms, ctx.outs[0])]


def _mvn(g, ctx):
    p = ctx.p.mvn_param
    ndim = len(ctx.bottom_shapes[0])
    axes = list(range(1 if p.across_channels else 2, ndim))
    x = ctx.inputs[0]
    mean = g.node("ReduceMean", [x], axes=axes, keepdims=1)
    centred = g.node("Sub", [x, mean], None if p.normalize_variance else ctx.outs[0])
    if not p.normalize_variance:
        return [centred]
    # Caffe: divide by sqrt(E[x^2] - E[x]^2) + eps.
    var = g.node("ReduceMean", [g.node("Mul", [centred, centred])], axes=axes, keepdims=1)
    std = g.node("Add", [g.node("Sqrt", [var]), g.const("eps", np.array(p.eps, np.float32))])
    return [g.node("Div", [centred, std], ctx.outs[0])]


def _reduction(g, ctx):
    p = ctx.p.reduction_param
    ndim = len(ctx.bottom_shapes[0])
    axis = _axis(p.axis, ndim)
    axes = list(range(axis, ndim))
    x = ctx.inputs[0]
    if not axes:
        y = x
    elif p.operation == RP.SUM:
        y = g.node("ReduceSum", [x, g.ints("axes", axes)], keepdims=0)
    elif p.operation == RP.MEAN:
        y = g.node("ReduceMean", [x], axes=axes, keepdims=0)
    elif p.operation == RP.ASUM:
        y = g.node("ReduceL1", [x], axes=axes, keepdims=0)
    else:
        y = g.node("ReduceSumSquare", [x], axes=axes, keepdims=0)
    if p.coeff != 1:
        y = g.node("Mul", [y, g.const("coeff", np.array(p.coeff, np.float32))])
    kept = ctx.bottom_shapes[0][:axis]
    y = g.node("Reshape", [y, g.ints("shape", _target_shape(
        ctx, 0, kept, ctx.probe_bottom_shapes[0][:axis]))])
    return [_rename(g, y, ctx.outs[0])]


def _tile(g, ctx):
    p = ctx.p.tile_param
    ndim = len(ctx.bottom_shapes[0])
    reps = [1] * ndim
    reps[_axis(p.axis, ndim)] = p.tiles
    return [g.node("Tile", [ctx.inputs[0], g.ints("repeats", reps)], ctx.outs[0])]


def _argmax(g, ctx):
    p = ctx.p.argmax_param
    if not p.HasField("axis") or p.out_max_val or p.top_k != 1:
        raise ctx.error("only ArgMax with an axis, top_k 1 and out_max_val false maps to ONNX")
    axis = _axis(p.axis, len(ctx.bottom_shapes[0]))
    idx = g.node("ArgMax", [ctx.inputs[0]], axis=axis, keepdims=1)
    return [g.node("Cast", [idx], ctx.outs[0], to=1)]


# ------------------------------------------------------------------------ Caffe forks' layers
def _relu6(g, ctx):
    return [g.node("Clip", [ctx.inputs[0], g.const("min", np.array(0, np.float32)),
                            g.const("max", np.array(6, np.float32))], ctx.outs[0])]


def _shuffle_channel(g, ctx):
    x, group = ctx.inputs[0], ctx.layer.group
    c = ctx.bottom_shapes[0][1]
    grouped = g.node("Reshape", [x, g.ints("grouped", [0, group, c // group, -1])])
    moved = g.node("Transpose", [grouped], perm=[0, 2, 1, 3])
    return [g.node("Reshape", [moved, g.node("Shape", [x])], ctx.outs[0])]


def _sizes(g, ctx, spatial):
    """Resize/MaxUnpool's output shape: the bottom's batch and channels (free or not) and the
    given spatial sizes (a tensor of two int64, or a list)."""
    head = g.node("Slice", [g.node("Shape", [ctx.inputs[0]]), g.ints("first", [0]),
                            g.ints("second", [2])])
    tail = spatial if isinstance(spatial, str) else g.ints("spatial", spatial)
    return g.node("Concat", [head, tail], axis=0)


def _interp(g, ctx):
    """DeepLab's Interp is bilinear with corners aligned: Resize linear, align_corners, after
    Slice for the (negative) pads."""
    layer, x = ctx.layer, ctx.inputs[0]
    if len(ctx.inputs) == 2:
        spatial = g.node("Slice", [g.node("Shape", [ctx.inputs[1]]), g.ints("from", [2]),
                                   g.ints("to", [4])])
    else:
        if {2, 3} & set(ctx.free_axes()):
            raise ctx.error("Interp's output size follows a free height or width by its zoom "
                            "or shrink rule; export with a fixed size")
        spatial = [layer.h_out, layer.w_out]
    if layer.pad_beg or layer.pad_end:
        h, w = ctx.bottom_shapes[0][2:]
        o = -layer.pad_beg
        x = g.node("Slice", [x, g.ints("starts", [o, o]),
                             g.ints("ends", [o + layer.h_in, o + layer.w_in]),
                             g.ints("axes", [2, 3])])
    return [g.node("Resize", [x, "", "", _sizes(g, ctx, spatial)], ctx.outs[0], mode="linear",
                   coordinate_transformation_mode="align_corners")]


def _upsample(g, ctx):
    layer, x = ctx.layer, ctx.inputs[0]
    if not layer.unpool:        # the YOLO ports' nearest-neighbour form
        s = float(layer.scale)
        return [g.node("Resize", [x, "", g.const("scales", [1, 1, s, s])], ctx.outs[0],
                       mode="nearest", coordinate_transformation_mode="asymmetric",
                       nearest_mode="floor")]
    # SegNet's: Caffe's mask holds indices within each (H, W) plane, ONNX's MaxUnpool indices
    # into the whole tensor, so each plane's offset is added.
    c = ctx.bottom_shapes[0][1]
    oh, ow = ctx.top_shapes[0][2:]
    if {2, 3} & set(ctx.free_axes()):
        raise ctx.error("SegNet's Upsample over a free height or width is not exported")
    plane = oh * ow
    n = g.node("Slice", [g.node("Shape", [x]), g.ints("first", [0]), g.ints("one", [1])])
    images = g.node("Range", [g.scalar("zero", 0), g.node("Squeeze", [n, g.ints("axis", [0])]),
                              g.scalar("step", 1)])
    image_offset = g.node("Mul", [g.node("Reshape", [images, g.ints("column", [-1, 1, 1, 1])]),
                                  g.const("image", np.array(c * plane, np.int64), np.int64)])
    channel_offset = g.const("channel", (np.arange(c) * plane).reshape(1, c, 1, 1), np.int64)
    index = g.node("Add", [g.node("Add", [g.node("Cast", [ctx.inputs[1]], to=7), image_offset]),
                           channel_offset])
    # The scatter follows the indices alone; kernel and stride only bound the output size,
    # which onnxruntime wants at least (in - 1) * stride + kernel: stride 1 and the kernel
    # that makes that the top's size.
    h, w = ctx.bottom_shapes[0][2:]
    return [g.node("MaxUnpool", [x, index, _sizes(g, ctx, [oh, ow])], ctx.outs[0],
                   kernel_shape=[oh - h + 1, ow - w + 1], strides=[1, 1])]


def _axpy(g, ctx):
    a, x, y = ctx.inputs
    rank = len(ctx.bottom_shapes[1])
    a = g.node("Reshape", [a, g.ints("scale_shape", [0, 0] + [1] * (rank - 2))])
    return [g.node("Add", [g.node("Mul", [a, x]), y], ctx.outs[0])]


def _bn(g, ctx):
    layer, x = ctx.layer, ctx.inputs[0]
    if len(ctx.outs) > 1 or layer.batch_stats:
        raise ctx.error("SegNet's BN in LEARN mode normalises by each batch's own statistics; "
                        "fold them into the weights (bn_mode: INFERENCE) to export")
    c = ctx.bottom_shapes[0][1]
    scale, shift = (_blob(ctx, i).reshape(-1) for i in (0, 1))
    if layer.segnet:
        scaled = g.node("Mul", [x, g.const("scale", scale.reshape(1, c, 1, 1))])
        return [g.node("Add", [scaled, g.const("shift", shift.reshape(1, c, 1, 1))],
                       ctx.outs[0])]
    inputs = [x, g.const("slope", scale), g.const("bias", shift),
              g.const("mean", _blob(ctx, 2).reshape(-1)), g.const("var", _blob(ctx, 3).reshape(-1))]
    return [g.node("BatchNormalization", inputs, ctx.outs[0], epsilon=float(layer.eps))]


def _roi_pooling(g, ctx):
    layer = ctx.layer
    rois = g.node("Reshape", [ctx.inputs[1], g.ints("rows", [-1, 5])])
    return [g.node("MaxRoiPool", [ctx.inputs[0], rois], ctx.outs[0],
                   pooled_shape=list(layer.pooled), spatial_scale=float(layer.scale))]


CONVERTERS = {
    "Convolution": _convolution,
    "Deconvolution": _deconvolution,
    "Pooling": _pooling,
    "LRN": _lrn,
    "InnerProduct": _inner_product,
    "BatchNorm": _batch_norm,
    "Scale": _scale,
    "Bias": _bias,
    "ReLU": _relu,
    "PReLU": _prelu,
    "ELU": _elu,
    "Sigmoid": _simple("Sigmoid"),
    "TanH": _simple("Tanh"),
    "AbsVal": _simple("Abs"),
    "BNLL": _simple("Softplus"),
    "Power": _power,
    "Exp": _exp,
    "Log": _log,
    "Threshold": _threshold,
    "Clip": _clip,
    "Swish": _swish,
    "Dropout": _dropout,
    "Split": _split,
    "Silence": _silence,
    "Flatten": _reshape_to_top,
    "Reshape": _reshape_to_top,
    "Concat": _concat,
    "Slice": _slice,
    "Crop": _crop,
    "Softmax": _softmax,
    "Eltwise": _eltwise,
    "MVN": _mvn,
    "Reduction": _reduction,
    "Tile": _tile,
    "ArgMax": _argmax,
    # Caffe forks' layers
    "ConvolutionDepthwise": _convolution,
    "DepthwiseConvolution": _convolution,
    "ReLU6": _relu6,
    "ShuffleChannel": _shuffle_channel,
    "Interp": _interp,
    "Upsample": _upsample,
    "ROIPooling": _roi_pooling,
    "Axpy": _axpy,
    "BN": _bn,
}
"""Caffe type string -> converter(graph, ctx) returning the ONNX names of the layer's tops."""

# Fork layers' converters live beside this module, one module per fork family.
from caffepar.convert.onnx_ssd import SSD_CONVERTERS  # noqa: E402

CONVERTERS.update(SSD_CONVERTERS)

_DATA_TYPES = {"Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "AnnotatedData"}
_LOSS_TYPES = {"SoftmaxWithLoss", "SigmoidCrossEntropyLoss", "EuclideanLoss", "HingeLoss",
               "InfogainLoss", "MultinomialLogisticLoss", "ContrastiveLoss", "Accuracy",
                "HDF5Output", "MultiBoxLoss", "DetectionEvaluate"}
UNSUPPORTED = {
    **{t: "reads a dataset; export the deploy net, whose Input layer becomes the graph input"
       for t in _DATA_TYPES},
    "DummyData": "makes its tops from fillers (constant, gaussian, ...), which is no model "
                 "input; export the deploy net, whose Input layer becomes the graph input",
    **{t: "is a training/scoring layer; export the deploy net without it" for t in _LOSS_TYPES},
    "Python": "runs arbitrary Python code",
    "RNN": "recurrent layers are not exported",
    "LSTM": "recurrent layers are not exported",
    "LSTMUnit": "recurrent layers are not exported",
    "Embed": "Embed is not exported",
    "SPP": "spatial pyramid pooling is not exported",
    "Im2col": "Im2col has no ONNX operator",
    "Filter": "Filter's output size depends on the data",
    "BatchReindex": "BatchReindex is not exported",
    "Parameter": "Parameter is not exported",
    "Input": "",
    "PSROIPooling": "position-sensitive ROI pooling (R-FCN) has no standard ONNX operator",
}
"""Caffe types refused, with the reason the error gives."""


@dataclass
class ExportResult:
    """The exported model and the net it came from (with its weights), for verification."""

    model: object
    net: object
    inputs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    path: str = None
    blob_tensors: dict = field(default_factory=dict)
    other_inputs: dict = field(default_factory=dict)
    """Input shapes of another size the graph takes (empty when every size is fixed)."""
    note: str = None
    """Why the batch size stayed fixed, when it could not be made free."""


def _check_exportable(layers):
    problems = []
    for layer in layers:
        t = layer.type
        if t == "Input":
            continue
        if t not in CONVERTERS:
            why = UNSUPPORTED.get(t, "has no ONNX converter")
            problems.append(f'"{layer.name}" ({t}): {why}')
    if problems:
        raise OnnxExportError("cannot export to ONNX: " + "; ".join(problems))


def net_to_onnx(net, opset=DEFAULT_OPSET, name=None, dynamic_batch=False,
                dynamic_spatial=False):
    """An onnx.ModelProto computing `net`'s forward pass (its current weights; its current
    shapes, but for the batch and/or spatial sizes made free)."""
    return _build(net, opset, name, probe_shapes(net, dynamic_batch, dynamic_spatial))[0]


def probe_input_shapes(net, dynamic_batch, dynamic_spatial):
    """The net's input shapes at the probe size: batch + 1 where the batch is free, height and
    width doubled where they are (doubling keeps whatever divisibility a net relies on)."""
    shapes = {}
    first = [tuple(net.blobs[n].shape) for n in net.inputs][:1]
    batch = first[0][0] if first and first[0] else None
    for name in net.inputs:
        shape = list(net.blobs[name].shape)
        # Inputs share the first one's batch; one of another length there (a table, a
        # parameter fed as an input) has no batch axis.
        batched = bool(shape) and shape[0] == batch
        if dynamic_batch and batched:
            shape[0] += 1
        if dynamic_spatial and len(shape) >= 3 and batched:
            shape[2:] = [2 * d for d in shape[2:]]
        shapes[name] = tuple(shape)
    return shapes


def probe_shapes(net, dynamic_batch, dynamic_spatial):
    """Every blob's shape (by blob id) with the inputs at the probe size; the net is put back
    to its own shapes afterwards. A layer that cannot take the probe size is refused by name."""
    if not dynamic_batch and not dynamic_spatial:
        return None
    own = {name: tuple(net.blobs[name].shape) for name in net.inputs}
    what = " and ".join(w for w, on in (("batch size", dynamic_batch),
                                        ("height and width", dynamic_spatial)) if on)
    try:
        for name, shape in probe_input_shapes(net, dynamic_batch, dynamic_spatial).items():
            net.blobs[name].reshape(shape)
        for i, layer in enumerate(net.layers):
            try:
                layer.reshape(net._blobs_of(net.bottom_ids[i]), net._blobs_of(net.top_ids[i]))
            except (CaffeparError, ValueError, IndexError) as e:
                raise OnnxExportError(f"cannot make the {what} free: at another input "
                                      f"size, {_first_line(e)}", layer=layer.name,
                                      layer_type=layer.type) from None
        return [tuple(b.shape) for b in net.blob_list]
    finally:
        for name, shape in own.items():
            net.blobs[name].reshape(shape)
        net.reshape()


def _first_line(error):
    text = getattr(error, "message", None) or str(error) or type(error).__name__
    return text.splitlines()[0]


def _value_info(helper, name, shape, probe, input_name=None):
    """A graph input/output's type: fixed sizes as numbers, the batch as "batch" and the free
    sizes of an input as <input>_height / _width (an output's other free sizes left unnamed)."""
    from onnx import TensorProto
    dims = []
    for a, (b, q) in enumerate(zip(shape, probe)):
        if b == q:
            dims.append(int(b))
        elif a == 0 and q == b + 1:
            dims.append("batch")
        elif input_name is not None and a >= 2:
            dims.append(f"{input_name}_{('height', 'width', 'depth')[min(a - 2, 2)]}"
                        if a < 5 else f"{input_name}_dim{a}")
        else:
            dims.append(None)
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _build(net, opset, name, probe=None, fast=False, end=None, outputs=None):
    """(model, {Caffe blob: ONNX tensor holding its final value}); `probe`: every blob's shape
    at another input size (None: all sizes fixed); `fast`: written for onnxruntime's speed
    rather than as Caffe's layers read (an LRN as the steps it takes); `end`, `outputs`: the
    layers before `end` only, with these blobs (names) as the graph's outputs."""
    _need_onnx()
    import onnx
    from onnx import helper
    layers = net.layers[:end]
    _check_exportable(layers)
    shapes = [tuple(b.shape) for b in net.blob_list]
    probe = probe or shapes
    g = _Graph(net)
    g.fast = fast
    outputs = list(net.outputs if outputs is None else outputs)
    last_writer = {}
    for i, ids in enumerate(net.top_ids[:len(layers)]):
        for t in ids:
            last_writer[net.blob_names[t]] = i
    current, graph_inputs = {}, []
    for i, layer in enumerate(layers):
        g.layer_name = layer.name
        tops = [net.blob_names[t] for t in net.top_ids[i]]
        if layer.type == "Input":
            for t, tid in zip(tops, net.top_ids[i]):
                g.used.add(t)
                current[t] = t
                graph_inputs.append(_value_info(helper, t, shapes[tid], probe[tid], t))
            continue
        inputs = [current[net.blob_names[b]] for b in net.bottom_ids[i]]
        outs = []
        for t in tops:
            # Graph outputs keep their Caffe names: only the blob's last writer may use it.
            plain = t not in g.used and (t not in outputs or last_writer[t] == i)
            outs.append(g.fresh(t if plain else f"{t}/{layer.name}"))
        ctx = _Ctx(layer, inputs, [shapes[b] for b in net.bottom_ids[i]],
                   [shapes[t] for t in net.top_ids[i]], outs,
                   [probe[b] for b in net.bottom_ids[i]], [probe[t] for t in net.top_ids[i]])
        try:
            produced = CONVERTERS[layer.type](g, ctx)
        except CaffeparError:
            raise
        except (ValueError, TypeError, IndexError) as e:
            raise OnnxExportError(f"cannot export to ONNX: {e}", layer=layer.name,
                                  layer_type=layer.type) from None
        for t, name_ in zip(tops, produced):
            current[t] = name_
    if not outputs:
        raise OnnxExportError("cannot export to ONNX: the net has no outputs (every top is "
                              "consumed, e.g. by Silence): nothing to compute")
    graph_outputs = []
    input_names = {i.name for i in graph_inputs}
    for o in outputs:
        name_ = o
        if current[o] != o:
            # A blob changed in place from a graph input cannot reuse the input's name.
            name_ = g.fresh(f"{o}_out") if o in input_names else o
            g.node("Identity", [current[o]], name_)
        oid = net.blob_names.index(o)
        # An axis whose size the data decide (DetectionOutput's row count) is left unnamed.
        free = getattr(net.layers[last_writer[o]], "data_dependent_axes", ()) \
            if o in last_writer else ()
        probe_o = tuple(-1 if a in free else d for a, d in enumerate(probe[oid]))
        graph_outputs.append(_value_info(helper, name_, shapes[oid], probe_o))
    graph = helper.make_graph(g.nodes, name or net.name or "caffe_net", graph_inputs,
                              graph_outputs, g.initializers)
    model = helper.make_model(graph, producer_name="caffepar",
                              opset_imports=[helper.make_opsetid("", opset)])
    if opset <= 17:
        model.ir_version = 8  # the IR version that introduced opset 17: older runtimes load it
    if model.ByteSize() < 2 ** 31 - 1:
        onnx.checker.check_model(model)
    return model, current


def export_onnx(model, weights, out=None, batch=None, allow_missing=False, opset=DEFAULT_OPSET,
                level=0, stages=(), dynamic_spatial=False):
    """Build `model` (a deploy prototxt) in TEST phase with `weights` and export it; writes
    `out` when given. The batch size is free unless `batch` fixes it; `dynamic_spatial` frees
    height and width too. Returns an ExportResult."""
    _need_onnx()
    from caffepar.convert.npz import load_weights
    from caffepar.graph.net import TEST, Net, load_net_param
    from caffepar.graph.passes import filter_net
    param, smap = load_net_param(model)
    param.state.phase = TEST
    param.state.level = level
    del param.state.stage[:]
    param.state.stage.extend(stages)
    # Refuse before building: a train_val net's data layers would look for their datasets.
    _check_exportable(filter_net(param, smap).layer)
    net = Net(model, phase=TEST, level=level, stages=stages)
    if weights is not None:
        load_weights(net, weights, allow_missing=allow_missing)
    if batch is not None:
        for name in net.inputs:
            shape = net.blobs[name].shape
            net.blobs[name].reshape((batch,) + tuple(shape[1:]))
        net.reshape()
    dynamic_batch, note = batch is None, None
    try:
        onnx_model, tensors = _build(net, opset, None,
                                     probe_shapes(net, dynamic_batch, dynamic_spatial))
    except OnnxExportError as e:
        if dynamic_spatial or not dynamic_batch:
            raise
        # A free batch is the default, not a request: a net that ties its batch size (a
        # Reshape written with it) is exported at its own, saying why.
        onnx_model, tensors = _build(net, opset, None)
        dynamic_batch = False
        note = f"the batch size is fixed at {net.blobs[net.inputs[0]].shape[0]}: {e}"
    result = ExportResult(onnx_model, net, {n: tuple(net.blobs[n].shape) for n in net.inputs},
                          list(net.outputs), blob_tensors=tensors,
                          other_inputs=probe_input_shapes(net, dynamic_batch, dynamic_spatial)
                          if dynamic_batch or dynamic_spatial else {}, note=note)
    if out is not None:
        from caffepar.io.weights import atomic_write
        out = os.fspath(out)
        atomic_write(out, lambda f: f.write(onnx_model.SerializeToString()))
        result.path = out
    return result
