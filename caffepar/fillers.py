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


def _standard_normal(gen, out):
    """out (1-D, float32) = standard normal draws from `gen`: Box-Muller on float32 uniforms
    (pairs r cos t, r sin t), three times as fast as NumPy's own float32 normals, whose cost
    made a DummyData top refilled every iteration dearer than Caffe's."""
    from caffepar.nn.blas import scratch
    count = len(out)
    half = -(-count // 2)
    u = scratch("normal_uniforms", (2 * half,), np.float32)
    gen.random(out=u, dtype=np.float32)
    r, t = u[:half], u[half:]
    np.subtract(np.float32(1), r, out=r)
    np.log(r, out=r)
    r *= np.float32(-2)
    np.sqrt(r, out=r)
    t *= np.float32(2 * np.pi)
    rest = count - half
    np.cos(t, out=out[:half])
    out[:half] *= r
    np.sin(t[:rest], out=out[half:])
    out[half:] *= r[:rest]


def _normal(mean, std, shape, rng, out=None):
    """Normal draws made in float32 (into `out` when given, a C-contiguous float32 array). A
    big blob is drawn in pieces of NORMAL_PIECE values, each from its own generator seeded
    from `rng`, side by side on the BLAS threads (NumPy draws without the GIL): a DummyData top
    refilled every iteration or an fc6 weight draws in a fraction of the time, and the values
    depend only on the seed and the shape, never on the thread count."""
    from caffepar.nn.blas import run_parts
    count = int(np.prod(shape)) if shape else 1
    values = np.empty(shape, np.float32) if out is None else out
    flat = values.reshape(-1)
    if count < 2 * NORMAL_PIECE:
        _standard_normal(rng, flat)
    else:
        starts = range(0, count, NORMAL_PIECE)
        seeds = rng.integers(0, 2 ** 63, size=len(starts))
        run_parts(lambda piece: _standard_normal(np.random.default_rng(piece[1]),
                                                 flat[piece[0]:piece[0] + NORMAL_PIECE]),
                  list(zip(starts, seeds.tolist())))
    if std != 1:
        values *= np.float32(std)
    if mean != 0:
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


def fill(filler_param, shape, dtype=np.float32, rng=None, out=None):
    """A new array of `shape` filled as `filler_param` (a caffe FillerParameter) says; or
    `out` filled in place (the values are the same)."""
    kind = filler_param.type
    if kind not in FILLERS:
        raise LayerError(f'unknown filler type "{kind}" (known: {", ".join(sorted(FILLERS))})')
    shape = tuple(int(d) for d in shape)
    if (out is not None and kind == "gaussian" and filler_param.sparse < 0
            and out.dtype == np.float32 and out.flags.c_contiguous and out.shape == shape):
        return _normal(filler_param.mean, filler_param.std, shape, rng or common.rng(), out)
    try:
        values = FILLERS[kind](filler_param, shape, rng or common.rng())
    except ValueError as e:
        raise LayerError(f"{kind} filler: {e}") from None
    if out is not None:
        out[...] = values
        return out
    return np.ascontiguousarray(values, dtype=dtype)
