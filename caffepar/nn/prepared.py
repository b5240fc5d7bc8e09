"""Pieces of the prepared calls an inference plan runs (caffepar.graph.plan): a forward bound
once to its arrays, so that a call does no lookups, no shape checks and no allocation -- NumPy
ufuncs writing with out= into the blobs' own arrays, or a compiled kernel with its arguments
made once.

A layer offers such a call through Layer.prepare_forward(bottom, top). The arrays are bound by
identity: the plan that holds the call keeps the shapes and arrays it was made for, and makes
it again when they change."""
from functools import partial

import numpy as np

from caffepar.nn import native

#: Runs of at most this many values take a compiled kernel in one call on this thread; longer
#: ones go through the layers' own code, which splits them over the cores.
SMALL = 1 << 16


def view_as(a, shape):
    """A view of `a` with `shape`, or None where that would need a copy."""
    try:
        return np.reshape(a, shape, copy=False)
    except ValueError:
        return None


def per_channel(v, ndim):
    """A 1-D per-channel array as a view broadcasting along axis 1 of an ndim-D array."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def kernel_call(kernel, arrays, *args):
    """kernel(addresses of `arrays`..., *args) as a call that keeps the arrays alive."""
    call = partial(kernel, *[native.ptr(a) for a in arrays], *args)
    call.arrays = arrays
    return call


def relu_call(x, y, slope):
    """y = ReLU(x) with negative_slope `slope`, as neuron.relu_forward computes it."""
    k = native.kernels(x.dtype) if x.dtype == y.dtype else None
    if k is not None and x.flags.c_contiguous and y.flags.c_contiguous and x.size <= SMALL:
        return kernel_call(k.relu_forward, (x, y), x.size, float(slope))
    from caffepar.nn.neuron import relu_forward
    return partial(relu_forward, x, y, float(slope))


def clip_call(x, y, lo, hi):
    """y = min(max(x, lo), hi) (NaN stays NaN, as np.clip and Caffe's ReLU6 give)."""
    lo, hi = x.dtype.type(lo), x.dtype.type(hi)

    def run():
        np.maximum(x, lo, out=y)
        np.minimum(y, hi, out=y)
    return run


def prelu_call(x, y, slopes):
    """y = max(x, 0) + slopes * min(x, 0); slopes one value (any shape of size 1) or one per
    channel (axis 1)."""
    s = slopes.reshape(()) if slopes.size == 1 else per_channel(slopes, x.ndim)
    t = np.empty(x.shape, x.dtype)

    def run():
        np.minimum(x, 0, out=t)
        np.multiply(t, s, out=t)
        np.maximum(x, 0, out=y)
        np.add(t, y, out=y)
    return run


def activation_call(y, ep):
    """The activation of an Epilogue on y in place, or None."""
    if ep is None or ep.act is None:
        return None
    if ep.act == "relu":
        return relu_call(y, y, ep.slope)
    if ep.act == "clip":
        return clip_call(y, y, ep.lo, ep.hi)
    return prelu_call(y, y, np.asarray(ep.slopes))


def epilogue_call(x, y, ep):
    """y = act(x * scale + shift) per channel along axis 1 (x may be y), as one call: the
    compiled epilogue of caffepar.nn.conv (one pass from x to y), else NumPy's passes."""
    from caffepar.nn.conv.epilogue import EpilogueArgs, prepare_epilogue
    if ep is None or ep.is_identity:
        return None if x is y else partial(np.copyto, y, x)
    if native.kernels(y.dtype) is not None and y.flags.c_contiguous and y.ndim >= 2 \
            and x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous:
        return prepare_epilogue(y, EpilogueArgs(ep, y.shape[1], y.dtype), x)
    calls = []
    src = x
    if ep.scale is not None:
        calls.append(partial(np.multiply, src, per_channel(ep.scale, x.ndim), out=y))
        src = y
    if ep.shift is not None:
        calls.append(partial(np.add, src, per_channel(ep.shift, x.ndim), out=y))
        src = y
    if src is not y:
        calls.append(partial(np.copyto, y, x))
    act = activation_call(y, ep)
    if act is not None:
        calls.append(act)
    return sequence(calls)


def sequence(calls):
    """One call running `calls` in order (None: nothing to run)."""
    calls = [c for c in calls if c is not None]
    if not calls:
        return None
    if len(calls) == 1:
        return calls[0]
    if len(calls) == 2:
        a, b = calls

        def run():
            a()
            b()
        return run
    calls = tuple(calls)

    def run():
        for c in calls:
            c()
    return run
