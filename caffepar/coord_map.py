"""pycaffe's coordinate mapping between the tops of a NetSpec, to align and crop feature maps
(as FCN's skip connections do).

A map is (axis, a, b): output coordinate x_out = a * x_in + b along every axis from `axis` on
(a and b per axis when the layer's kernel differs per axis). Pointwise layers map as
(None, 1, 0), which fits any axis. Convolution-like layers with kernel k, stride s, pad p (and
dilation d, effective kernel (k - 1) d + 1) map as (1/s, (p - (k - 1)/2) / s); Deconvolution
as (s, (k - 1)/2 - p); Crop with offset o as (1, -o).
"""
import numpy as np

from caffepar.net_spec import layers as L

__all__ = ["coord_map", "coord_map_from_to", "crop", "compose", "inverse",
           "UndefinedMapException", "AxisMismatchException", "PASS_THROUGH_LAYERS"]

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU",
                       "Log", "LRN", "Exp", "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid",
                       "Split", "TanH", "Threshold"]


class UndefinedMapException(Exception):
    """A layer type with no coordinate mapping (InnerProduct, ...)."""


class AxisMismatchException(Exception):
    """Two maps over different axes cannot be composed."""


def _fields(fn, message):
    """The layer's fields, from its `<message>` dict when given that way, else its keywords."""
    return fn.params.get(message, fn.params)


def conv_params(fn):
    """(axis, stride, effective kernel, pad) of a Convolution, Deconvolution, Im2col or Pooling."""
    message = "pooling_param" if fn.type_name == "Pooling" else "convolution_param"
    p = _fields(fn, message)
    legacy = {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"} & set(p)
    if legacy:
        raise AssertionError(f"cropping does not support legacy _h/_w params "
                             f"({', '.join(sorted(legacy))}) of {fn.type_name}")
    kernel = np.array(p["kernel_size"], ndmin=1)
    dilation = np.array(p.get("dilation", 1), ndmin=1)
    return (p.get("axis", 1), np.array(p.get("stride", 1), ndmin=1),
            (kernel - 1) * dilation + 1, np.array(p.get("pad", 0), ndmin=1))


def crop_params(fn):
    """(axis, offset) of a Crop layer, with Caffe's defaults (axis 2, offset 0)."""
    p = _fields(fn, "crop_param")
    return p.get("axis", 2), np.array(p.get("offset", 0), ndmin=1)


def coord_map(fn):
    """The map from a layer's bottom coordinates to its top coordinates."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col"):
        axis, stride, kernel, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (kernel - 1) / 2) / stride
    if fn.type_name == "Deconvolution":
        axis, stride, kernel, pad = conv_params(fn)
        return axis, stride, (kernel - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset
    raise UndefinedMapException(fn.type_name)


def compose(base, then):
    """The map of `base` followed by `then`: scales multiply, then's shift scaled by base's."""
    ax1, a1, b1 = base
    ax2, a2, b2 = then
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException(f"axis {ax1} vs axis {ax2}")
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(cmap):
    ax, a, b = cmap
    return ax, 1 / a, -b / a


def _mapped_bottoms(top):
    """Bottoms whose coordinates a top's follow; a Crop's second bottom only gives a size."""
    bottoms = top.fn.inputs
    return bottoms[:1] if top.fn.type_name == "Crop" else bottoms


def _ancestors(start):
    """Every top reachable backwards from `start` through mapped layers, with the map from it
    to `start`, in breadth-first order."""
    maps = {start: (None, 1, 0)}
    frontier = [start]
    while frontier:
        top = frontier.pop(0)
        try:
            step = coord_map(top.fn)
        except UndefinedMapException:
            continue
        for bottom in _mapped_bottoms(top):
            if bottom not in maps:
                maps[bottom] = compose(maps[top], step)
                frontier.append(bottom)
    return maps


def coord_map_from_to(top_from, top_to):
    """The map from top_from's coordinates to top_to's, through a common ancestor top."""
    from_maps = _ancestors(top_from)
    to_maps = _ancestors(top_to)
    for top, to_map in to_maps.items():
        if top in from_maps:
            return compose(to_map, inverse(from_maps[top]))
    raise RuntimeError("Could not compute map between tops; are they connected by spatial "
                       "layers?")


def crop(top_from, top_to):
    """A Crop layer cutting top_from to the extent of top_to, its offsets from the map."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.asarray(a), np.asarray(b)
    if not (a == 1).all():
        raise AssertionError(f"scale mismatch on crop (a = {a})")
    if not (b <= 0).all():
        raise AssertionError(f"cannot crop negative offset (b = {b})")
    if not (np.round(b) == b).all():
        raise AssertionError(f"cannot crop noninteger offset (b = {b})")
    return L.Crop(top_from, top_to,
                  crop_param=dict(axis=ax + 1, offset=[int(o) for o in -np.round(b)]))
