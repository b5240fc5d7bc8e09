"""What an inference forward runs on a convolution's (or InnerProduct's) output as it is written:
a per-channel affine map (a BatchNorm and Scale folded in, the layer's own bias with them) and an
activation (ReLU with its negative_slope, a clip such as ReLU6, or PReLU's per-channel slopes).

One description for every engine: those that can apply it on each tile while the tile is in cache
do; the others finish with `apply_epilogue` over the output. The result is
``act(conv * scale + shift)`` per output channel, which is the unfused chain's value to rounding.
"""
from dataclasses import dataclass

import numpy as np

ACTIVATIONS = (None, "relu", "clip", "prelu")


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
    """Apply `ep` to y (N, C, ...) in place, as its own pass over memory."""
    if ep is None or ep.is_identity:
        return y
    dt = y.dtype
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
