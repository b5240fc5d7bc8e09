"""Caffe's weight fillers, drawn from caffepar's RNG (same distributions, not Caffe's bits)."""
import contextlib
import math

import numpy as np

from caffepar import common
from caffepar.errors import LayerError


def _fans(shape):
    count = int(np.prod(shape)) if shape else 1
    fan_in = count // shape[0] if shape and shape[0] else count
    fan_out = count // shape[1] if len(shape) > 1 and shape[1] else count
    return fan_in, fan_out


def _variance_n(filler, shape):
    fan_in, fan_out = _fans(shape)
    norm = filler.variance_norm
    if norm == filler.FAN_OUT:
        return fan_out
    if norm == filler.AVERAGE:
        return (fan_in + fan_out) / 2.0
    return fan_in


def _constant(f, shape, rng):
    return np.full(shape, f.value)


def _uniform(f, shape, rng):
    values = rng.random(shape, dtype=np.float32)
    values *= np.float32(f.max - f.min)
    values += np.float32(f.min)
    return values


#: Values per piece of a big blob's normal draws (see _normal).
NORMAL_PIECE = 1 << 19


def _normal(mean, std, shape, rng):
    """Normal draws made in float32 (twice as fast as float64 for big blobs). A big blob is
    drawn in pieces of NORMAL_PIECE values, each from its own generator seeded from `rng`, side
    by side on the BLAS threads (NumPy draws without the GIL): a DummyData top refilled every
    iteration or an fc6 weight draws in a fraction of the time, and the values depend only on
    the seed and the shape, never on the thread count."""
    count = int(np.prod(shape)) if shape else 1
    if count < 2 * NORMAL_PIECE:
        values = rng.standard_normal(shape, dtype=np.float32)
    else:
        from caffepar.nn.blas import run_parts
        values = np.empty(shape, np.float32)
        flat = values.reshape(-1)
        starts = range(0, count, NORMAL_PIECE)
        seeds = rng.integers(0, 2 ** 63, size=len(starts))

        def draw(piece):
            start, seed = piece
            np.random.default_rng(seed).standard_normal(
                out=flat[start:start + NORMAL_PIECE], dtype=np.float32)

        run_parts(draw, list(zip(starts, seeds.tolist())))
    values *= np.float32(std)
    values += np.float32(mean)
    return values


def _gaussian(f, shape, rng):
    values = _normal(f.mean, f.std, shape, rng)
    if f.sparse >= 0:
        if len(shape) < 1 or shape[0] == 0:
            raise ValueError("sparse gaussian filler needs a blob with at least one axis")
        keep = f.sparse / float(shape[0])
        values *= rng.random(shape) < keep
    return values


def _positive_unitball(f, shape, rng):
    values = rng.uniform(0.0, 1.0, shape)
    rows = values.reshape(shape[0], -1)
    rows /= rows.sum(axis=1, keepdims=True)
    return values


def _xavier(f, shape, rng):
    scale = math.sqrt(3.0 / _variance_n(f, shape))
    values = rng.random(shape, dtype=np.float32)
    values *= np.float32(2 * scale)
    values -= np.float32(scale)
    return values


def _msra(f, shape, rng):
    std = math.sqrt(2.0 / _variance_n(f, shape))
    return _normal(0.0, std, shape, rng)


def _bilinear(f, shape, rng):
    """Upsampling kernel for Deconvolution, computed in float32 as Caffe does."""
    if len(shape) != 4 or shape[2] != shape[3]:
        raise ValueError("bilinear filler needs a 4-D blob with square kernels")
    size = shape[3]
    factor = math.ceil(size / 2.0)
    center = np.float32((size - 1) / (2.0 * factor))
    ramp = np.float32(1) - np.abs(np.arange(size, dtype=np.float32) / np.float32(factor) - center)
    kernel = np.outer(ramp, ramp).astype(np.float32)
    return np.broadcast_to(kernel, shape).copy()


FILLERS = {
    "constant": _constant,
    "uniform": _uniform,
    "gaussian": _gaussian,
    "positive_unitball": _positive_unitball,
    "xavier": _xavier,
    "msra": _msra,
    "bilinear": _bilinear,
}


_shapes_only = False


@contextlib.contextmanager
def shapes_only():
    """Parameter blobs made meanwhile keep their zeros: for building a net whose shapes alone
    are needed (`caffepar plan` on VGG-16 need not draw 138 M random weights)."""
    global _shapes_only
    saved, _shapes_only = _shapes_only, True
    try:
        yield
    finally:
        _shapes_only = saved


def filling():
    return not _shapes_only


def fill(filler_param, shape, dtype=np.float32, rng=None):
    """A new array of `shape` filled as `filler_param` (a caffe FillerParameter) says."""
    kind = filler_param.type
    if kind not in FILLERS:
        raise LayerError(f'unknown filler type "{kind}" (known: {", ".join(sorted(FILLERS))})')
    shape = tuple(int(d) for d in shape)
    try:
        values = FILLERS[kind](filler_param, shape, rng or common.rng())
    except ValueError as e:
        raise LayerError(f"{kind} filler: {e}") from None
    return np.ascontiguousarray(values, dtype=dtype)
