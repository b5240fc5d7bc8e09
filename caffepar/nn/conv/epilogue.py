"""What an inference forward runs on a convolution's (or InnerProduct's) output as it is written:
a per-channel affine map (a BatchNorm and Scale folded in, the layer's own bias with them) and an
activation (ReLU with its negative_slope, a clip such as ReLU6, or PReLU's per-channel slopes).

One description for every engine: those that can apply it on each tile while the tile is in cache
do; the others finish with `apply_epilogue` over the output. The result is
``act(conv * scale + shift)`` per output channel, which is the unfused chain's value to rounding.
"""
from dataclasses import dataclass

import numpy as np

from caffepar.nn import native

ACTIVATIONS = (None, "relu", "clip", "prelu")
#: The kernels' codes of the activations and the count of an epilogue's fields (group.inc's
#: ACT_* and EP_*).
ACT_CODES = {None: 0, "relu": 1, "clip": 2, "prelu": 3}
EP_FIELDS = 8
#: A compiled epilogue over more values than this runs on every thread.
THREAD_MIN_VALUES = 1 << 17


@dataclass
class Epilogue:
    """scale, shift: per-channel arrays (or None: 1 and 0); act: None, "relu" (negative_slope
    `slope`), "clip" (to [lo, hi]) or "prelu" (per-channel `slopes`, or one shared slope)."""
    scale: np.ndarray = None
    shift: np.ndarray = None
    act: str = None
    slope: float = 0.0
    lo: float = 0.0
    hi: float = 0.0
    slopes: np.ndarray = None

    def __post_init__(self):
        if self.act not in ACTIVATIONS:
            raise ValueError(f"epilogue activation must be one of {ACTIVATIONS}, got {self.act!r}")

    @property
    def is_identity(self):
        return self.scale is None and self.shift is None and self.act is None


def _per_channel(v, ndim, dtype):
    return np.asarray(v, dtype).reshape((1, -1) + (1,) * (ndim - 2))


def apply_epilogue(y, ep):
    """Apply `ep` to y (N, C, ...) in place, as its own pass over memory (compiled where the
    kernels are)."""
    if ep is None or ep.is_identity:
        return y
    dt = y.dtype
    if native.kernels(dt) is not None and y.flags.c_contiguous and y.ndim >= 2:
        prepare_epilogue(y, EpilogueArgs(ep, y.shape[1], dt))()
        return y
    if ep.scale is not None:
        y *= _per_channel(ep.scale, y.ndim, dt)
    if ep.shift is not None:
        y += _per_channel(ep.shift, y.ndim, dt)
    if ep.act == "relu":
        if ep.slope:
            np.copyto(y, y * dt.type(ep.slope), where=y < 0)
        else:
            np.maximum(y, 0, out=y)
    elif ep.act == "clip":
        np.clip(y, ep.lo, ep.hi, out=y)
    elif ep.act == "prelu":
        slopes = np.asarray(ep.slopes, dt)
        s = slopes.reshape(()) if slopes.size == 1 else _per_channel(slopes, y.ndim, dt)
        np.copyto(y, y * s, where=y < 0)
    return y


def prepare_epilogue(y, epi, x=None):
    """A call setting y (N, C, ...), C-contiguous, to the EpilogueArgs `epi` applied to x (of
    y's shape, dtype and layout; by default y itself) on the compiled kernels, in one pass:
    planes split between the threads where there are values enough."""
    from caffepar.nn.blas import blas_threads, run_parts, split_parts
    x = y if x is None else x
    k = native.kernels(y.dtype)
    planes = y.shape[0] * y.shape[1]
    hw = y.size // max(planes, 1)
    address, source, fields = native.ptr(y), native.ptr(x), native.ptr(epi.fields)
    fn, channels, refresh = k.apply_epilogue, y.shape[1], epi.refresh
    parts = [(r[0], r[-1] + 1) for r in split_parts(range(planes), blas_threads())] \
        if y.size >= THREAD_MIN_VALUES and planes > 1 else [(0, planes)]

    def run(epi=epi, y=y, x=x):      # (keeps the arrays whose addresses it passes)
        if refresh is not None:
            refresh()
        if len(parts) == 1:
            fn(address, source, fields, channels, hw, *parts[0])
        else:
            run_parts(lambda p: fn(address, source, fields, channels, hw, *p), parts)
    return run


def _bits(v):
    return int(np.array(float(v), np.float64).view(np.int64))


class EpilogueArgs:
    """An epilogue's fields for the kernels, built once: per-channel arrays bound by identity
    where they are already contiguous arrays of the kernels' dtype and size (a caller that
    rewrites them in place is seen at every call); otherwise copies, made again by
    ``refresh()`` at every call."""

    def __init__(self, ep, channels, dt, bias=None):
        self.ep, self.channels, self.dt = ep, channels, dt
        self.fields = np.zeros(EP_FIELDS, np.int64)
        self.keep = {}
        self.stale = []     # (field, source) to copy again at each call
        scale = None if ep is None else ep.scale
        shift = bias if ep is None else ep.shift
        self._bind(0, scale, channels)
        self._bind(1, shift, channels)
        act = None if ep is None else ep.act
        self.fields[2] = ACT_CODES[act]
        if ep is not None:
            self.fields[3] = _bits(ep.slope)
            self.fields[4] = _bits(ep.lo)
            self.fields[5] = _bits(ep.hi)
            if act == "prelu":
                slopes = np.asarray(ep.slopes)
                self._bind(6, ep.slopes, slopes.size)
                self.fields[7] = slopes.size
        self.refresh = self._refresh if self.stale else None

    def _bind(self, field, values, size):
        if values is None:
            return
        if (type(values) is np.ndarray and values.dtype == self.dt and values.size == size
                and values.flags.c_contiguous):
            self.keep[field] = values
            self.fields[field] = native.ptr(values)
            return
        copy = np.ascontiguousarray(np.asarray(values, self.dt).reshape(-1))
        if copy.size != size:
            raise ValueError(f"epilogue: {copy.size} values for {size} channels")
        self.keep[field] = copy
        self.fields[field] = native.ptr(copy)
        self.stale.append((field, values))

    def _refresh(self):
        for field, values in self.stale:
            self.keep[field][...] = np.asarray(values, self.dt).reshape(-1)


