"""`caffepar convert info`: what a net computes and what a weights file holds for it.

Built from a real Net (so shapes are the shapes caffepar runs), without copying weights into it:
a weights file is only compared layer by layer, which keeps `info` on a 553 MB model fast.
FLOPs count a multiply and an add as two operations, for one forward pass of the whole batch.
"""
import math
from dataclasses import dataclass, field

import numpy as np

from caffepar.io.weights import _shape_str
from caffepar.nn.vision import _ConvolutionBase

__all__ = ["LayerInfo", "NetInfo", "net_info", "format_info", "info_lines", "layer_flops"]


@dataclass(slots=True)
class LayerInfo:
    name: str
    type: str
    bottoms: list
    tops: list
    top_shapes: list
    params: int
    param_shapes: list
    flops: int


@dataclass
class NetInfo:
    name: str
    inputs: dict
    outputs: list
    layers: list
    params: int
    param_bytes: int
    activation_bytes: int
    flops: int
    plan: list = field(default_factory=list)
    weights_path: str = None
    # The report's column widths and the layer modes they were measured with (_measure), so
    # that info_lines goes over the layers once more, not twice.
    widths: list = field(default=None, repr=False, compare=False)
    widths_modes: dict = field(default=None, repr=False, compare=False)
    missing: list = field(default_factory=list)
    unused: list = field(default_factory=list)
    mismatched: list = field(default_factory=list)
    matched: list = field(default_factory=list)


def _count(shape):
    return math.prod(shape) if shape is not None else 0


_ELEMENTWISE = frozenset(("Scale", "Bias", "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal",
                          "Power", "Exp", "Log", "BNLL", "Threshold", "Clip", "Swish", "MVN",
                          "Reduction", "ReLU6"))
_NO_FLOPS = frozenset(("Input", "DummyData", "Data", "ImageData", "HDF5Data", "MemoryData",
                       "Split", "AnnotatedData", "WindowData", "Concat", "Slice", "Flatten",
                       "Reshape", "Dropout", "Silence", "Crop", "Tile", "Parameter", "Filter",
                       "BatchReindex", "Python", "ShuffleChannel"))


def layer_flops(layer, bottom_shapes, top_shapes):
    """Forward FLOPs of one layer (multiply-adds count 2); elementwise layers count one per
    output value, layers that only move data count nothing."""
    t = layer.type
    out = _count(top_shapes[0]) if top_shapes else 0
    if isinstance(layer, _ConvolutionBase):     # the forks' depthwise types too
        per_output = int(np.prod(layer.kernel)) * (layer.channels // layer.group)
        if not layer.transposed:
            macs = out * per_output
        else:
            # Deconvolution scatters each input value over kernel x outputs/group.
            macs = _count(bottom_shapes[0]) * int(np.prod(layer.kernel)) * \
                (layer.num_output // layer.group)
        return 2 * macs + (out if layer.bias_term else 0)
    if t == "InnerProduct":
        m = _count(bottom_shapes[0]) // max(layer.k, 1)
        return 2 * m * layer.k * layer.num_output + (m * layer.num_output if len(layer.blobs) > 1
                                                     else 0)
    if t == "Pooling":
        g = layer.geom
        return out * g.kh * g.kw
    if t == "LRN":
        return _count(bottom_shapes[0]) * (layer.size + 4)
    if t == "Eltwise":
        return out * max(len(bottom_shapes) - 1, 1)
    if t in ("Softmax", "SoftmaxWithLoss"):
        return 4 * _count(bottom_shapes[0])
    if t == "BatchNorm":
        return 2 * out
    if t in _ELEMENTWISE:
        return out * (2 if t == "Scale" and len(layer.blobs) > 1 else 1)
    if t in _NO_FLOPS:
        return 0
    return out


def _auto_split(net, layer):
    return layer.type == "Split" and layer.name not in net.source_map.by_name


def _compare(net, model):
    """(matched, missing, unused, mismatched) between net layers and a CaffeModel."""
    file_layers = {}
    for name, _t, blobs in model.layers:
        file_layers.setdefault(name, blobs)
    matched, missing, mismatched = [], [], []
    for layer in net.layers:
        if not layer.blobs:
            continue
        blobs = file_layers.get(layer.name)
        if not blobs:
            missing.append(layer.name)
            continue
        if len(blobs) != len(layer.blobs):
            mismatched.append(f'layer "{layer.name}": the file has {len(blobs)} blob(s), the '
                              f"net expects {len(layer.blobs)}")
            continue
        bad = False
        for j, ((values, shape, legacy), target) in enumerate(zip(blobs, layer.blobs)):
            full = tuple(target.shape)
            ok = tuple(shape) == full
            if not ok and legacy is not None and len(full) <= 4:
                ok = tuple(legacy) == (1,) * (4 - len(full)) + full
            if not ok or values.size != _count(full):
                mismatched.append(f'layer "{layer.name}" param {j}: the file has '
                                  f"{_shape_str(shape)}, the net expects {_shape_str(full)}")
                bad = True
        if not bad:
            matched.append(layer.name)
    names = {layer.name for layer in net.layers}
    unused = [name for name, _t, blobs in model.layers if blobs and name not in names]
    return matched, missing, unused, mismatched


class _LayerInfos:
    """NetInfo.layers: a LayerInfo for each layer the prototxt wrote (no automatic Split),
    made afresh at each iteration from the net, so that a net of millions of layers does not
    hold them all (net_info and info_lines go over them once each)."""

    def __init__(self, net):
        self.net = net

    def __iter__(self):
        net = self.net
        blobs, names = net.blob_list, net.blob_names
        for layer, bottom_ids, top_ids in zip(net.layers, net.bottom_ids, net.top_ids):
            if layer.type == "Split" and _auto_split(net, layer):
                continue
            bshapes = [blobs[b].data.shape for b in bottom_ids]
            tshapes = [blobs[t].data.shape for t in top_ids]
            params = layer.blobs
            # By position: two layers may share a name (Caffe allows it), not net.bottom_names.
            yield LayerInfo(layer.name, layer.type, [names[b] for b in bottom_ids],
                            [names[t] for t in top_ids], tshapes,
                            sum(b.count for b in params) if params else 0,
                            [tuple(b.shape) for b in params] if params else [],
                            layer_flops(layer, bshapes, tshapes))


def net_info(model, weights=None, phase=None, level=0, stages=()):
    """NetInfo for a prototxt (path or Net) and, optionally, a weights file of any format."""
    from caffepar.graph.net import TEST, Net
    from caffepar.parallel.plan import make_plan
    net = model if isinstance(model, Net) else \
        Net(model, phase=TEST if phase is None else phase, level=level, stages=stages)
    layers = _LayerInfos(net)
    plan = make_plan(net, source_map=net.source_map)
    modes = _modes(plan)
    flops, widths = _measure(layers, modes)
    # Shared parameters are stored once.
    params = sum(b.count for b in net.learnable_params)
    seen, activations = set(), 0
    for blob in net.blob_list:
        if id(blob) not in seen:
            seen.add(id(blob))
            activations += blob.count * blob.data.itemsize
    info = NetInfo(net.name, {n: tuple(net.blobs[n].shape) for n in net.inputs},
                   list(net.outputs), layers, params, params * np.dtype(net.dtype).itemsize,
                   activations, flops, plan, widths=widths, widths_modes=modes)
    if weights is not None:
        from caffepar.convert.npz import open_weights
        model_file = open_weights(weights)
        info.weights_path = str(weights)
        info.matched, info.missing, info.unused, info.mismatched = _compare(net, model_file)
    return info


def _human(n, unit=""):
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n} {unit}".rstrip()


def _shape_text(shapes):
    key = tuple(shapes)
    text = _SHAPE_TEXTS.get(key)
    if text is None:
        text = ", ".join("x".join(str(d) for d in s) if s else "scalar" for s in key)
        if len(_SHAPE_TEXTS) < 4096:
            _SHAPE_TEXTS[key] = text
    return text


_SHAPE_TEXTS = {}   # the shapes -> their text (a net's layers repeat a few shapes)


def format_info(info):
    """The report `caffepar convert info` prints."""
    return "\n".join(info_lines(info))


def _modes(plan):
    return {p.name: p.mode for p in plan}


def _measure(layers, modes):
    """(FLOPs of the layers, the report's column widths) in one pass over the layers."""
    flops, widths = 0, [0] * 8
    for lay, row in _rows(layers, modes, with_layers=True):
        if lay is not None:
            flops += lay.flops
        for c, cell in enumerate(row):
            if len(cell) > widths[c]:
                widths[c] = len(cell)
    return flops, widths


def _rows(layers, modes, with_layers=False):
    """The report's table: its header, then a row for each layer ((LayerInfo or None for the
    header, row) with_layers)."""
    header = ("layer", "type", "bottoms -> tops", "output shape", "params", "MB", "MFLOPs", "mode")
    yield (None, header) if with_layers else header
    for lay in layers:
        row = (lay.name, lay.type, f"{','.join(lay.bottoms) or '-'} -> {','.join(lay.tops) or '-'}",
               _shape_text(lay.top_shapes), f"{lay.params:,}" if lay.params else "",
               f"{lay.params * 4 / 2 ** 20:.2f}" if lay.params else "",
               f"{lay.flops / 1e6:.1f}" if lay.flops else "", modes.get(lay.name, ""))
        yield (lay, row) if with_layers else row


def info_lines(info):
    """format_info's lines, one at a time, the table never held whole: its column widths are
    net_info's, measured with the FLOPs (or measured here, for a NetInfo changed since)."""
    modes = _modes(info.plan)
    widths = info.widths
    if widths is None or info.widths_modes != modes:
        _flops, widths = _measure(info.layers, modes)
    # One format for the table's rows: numbers right-aligned, the rest left-aligned.
    row_format = "  ".join(f"{{{c}:{'>' if c in (4, 5, 6) else '<'}{w}}}"
                           for c, w in enumerate(widths)).format
    yield (f'net "{info.name}": inputs '
           + ", ".join(f"{n} {_shape_text([s])}" for n, s in info.inputs.items())
           + f"; outputs {', '.join(info.outputs)}")
    for row in _rows(info.layers, modes):
        yield row_format(*row).rstrip()
    yield (f"total: {info.params:,} parameters ({info.param_bytes / 2 ** 20:.1f} MB), "
           f"{info.activation_bytes / 2 ** 20:.1f} MB of activations, "
           f"{_human(info.flops, 'FLOPs')} per forward pass")
    if info.plan:
        model = [p.name for p in info.plan if p.mode == "MODEL"]
        yield ("parallel plan (hybrid default): " + (f"MODEL {', '.join(model)}; " if model else "")
               + "all other parameterised layers DATA")
    if info.weights_path is not None:
        yield f"weights {info.weights_path}: {len(info.matched)} layer(s) match"
        for label, items in (("missing (net layers with no weights in the file)", info.missing),
                             ("unused (file layers not in the net)", info.unused)):
            if items:
                yield f"  {label}: {', '.join(items)}"
        for m in info.mismatched:
            yield f"  shape mismatch: {m}"
