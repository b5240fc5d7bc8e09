"""Geometry shared by the convolution engines: output sizes, the polyphase flat-grid layout of
an input and its taps, the flipped-kernel form of dx, and the workspace bounds."""
import functools
import itertools
import math

import numpy as np

from caffepar.nn.blas import scratch

#: Upper bound on the per-call scratch memory (image chunks are sized to it).
WORKSPACE_BYTES = 64 << 20
#: Blocks run side by side sum their dw in at most this many partial sums (bounded memory),
#: added in block order.
SUM_PARTS = 16
#: Threads running blocks side by side share the engines' buffer bounds, but never in more than
#: this many shares: on many cores, smaller blocks would make GEMMs too small to run well.
MAX_SHARES = 4


def expand(v, nd, name):
    if np.isscalar(v):
        return (int(v),) * nd
    v = tuple(int(e) for e in v)
    if len(v) == 1 and nd != 1:
        v = v * nd
    if len(v) != nd:
        raise ValueError(f"{name} has {len(v)} entries, expected {nd}")
    return v


def conv_output_shape(in_shape_spatial, kernel, stride, pad, dilation):
    """Caffe's output size per spatial axis."""
    nd = len(in_shape_spatial)
    kernel = expand(kernel, nd, "kernel")
    stride = expand(stride, nd, "stride")
    pad = expand(pad, nd, "pad")
    dilation = expand(dilation, nd, "dilation")
    return tuple((i + 2 * p - (d * (k - 1) + 1)) // s + 1
                 for i, k, s, p, d in zip(in_shape_spatial, kernel, stride, pad, dilation))


class Geom:
    """Polyphase flat-grid layout of one convolution's input and taps."""

    def __init__(self, in_sp, kernel, stride, pad, dilation):
        nd = len(in_sp)
        self.nd = nd
        self.in_sp = tuple(int(v) for v in in_sp)
        self.kernel = expand(kernel, nd, "kernel")
        self.stride = expand(stride, nd, "stride")
        self.pad = expand(pad, nd, "pad")
        self.dilation = expand(dilation, nd, "dilation")
        if min(self.kernel, default=1) < 1 or min(self.stride, default=1) < 1 \
                or min(self.dilation, default=1) < 1 or min(self.pad, default=0) < 0:
            raise ValueError("kernel, stride and dilation must be >= 1 and pad >= 0")
        self.out = conv_output_shape(self.in_sp, self.kernel, self.stride, self.pad,
                                     self.dilation)
        if min(self.out, default=1) < 1:
            raise ValueError(f"convolution output would be empty: input {self.in_sp}, "
                             f"kernel {self.kernel}, stride {self.stride}, pad {self.pad}, "
                             f"dilation {self.dilation}")
        axis_phases, q = [], []
        for k, s, d, o in zip(self.kernel, self.stride, self.dilation, self.out):
            axis_phases.append(sorted({(i * d) % s for i in range(k)}))
            q.append(o + ((k - 1) * d) // s)
        self.q = tuple(q)
        self.qsize = math.prod(q)
        qstr = [1] * nd
        for a in range(nd - 2, -1, -1):
            qstr[a] = qstr[a + 1] * q[a + 1]
        self.phases = list(itertools.product(*axis_phases))
        index = {p: i for i, p in enumerate(self.phases)}
        self.tap_phase, self.tap_shift = [], []
        for kidx in itertools.product(*[range(k) for k in self.kernel]):
            ph = tuple((i * d) % s for i, d, s in zip(kidx, self.dilation, self.stride))
            self.tap_phase.append(index[ph])
            self.tap_shift.append(sum(((i * d) // s) * qs for i, d, s, qs in
                                      zip(kidx, self.dilation, self.stride, qstr)))
        self.ntaps = len(self.tap_phase)
        self.last = sum((o - 1) * qs for o, qs in zip(self.out, qstr))
        # Per phase: slices of the phase grid and of x that correspond.
        self.copies = []
        covered = [0] * nd
        self.grid_full = True
        for ph in self.phases:
            qsl, xsl = [], []
            for a, (aa, s, p, n, qa) in enumerate(zip(ph, self.stride, self.pad, self.in_sp,
                                                      self.q)):
                lo = max(0, -((aa - p) // s))
                hi = min(qa, (n - 1 + p - aa) // s + 1)
                cnt = max(0, hi - lo)
                x0 = lo * s + aa - p
                qsl.append(slice(lo, lo + cnt))
                xsl.append(slice(x0, x0 + (cnt - 1) * s + 1 if cnt else x0, s))
                if lo > 0 or lo + cnt < qa:
                    self.grid_full = False
            self.copies.append((tuple(qsl), tuple(xsl)))
        # x is fully covered iff every x position lies in some phase's grid.
        for a in range(nd):
            ph_a = axis_phases[a]
            tot = 0
            for aa in ph_a:
                lo = max(0, -((aa - self.pad[a]) // self.stride[a]))
                hi = min(self.q[a], (self.in_sp[a] - 1 + self.pad[a] - aa) // self.stride[a] + 1)
                tot += max(0, hi - lo)
            covered[a] = tot == self.in_sp[a]
        self.x_full = all(covered)

    def span(self, nc):
        """Number of grid columns computed for a chunk of nc images."""
        return (nc - 1) * self.qsize + self.last + 1


def geom(in_sp, kernel, stride, pad, dilation):
    """The (read-only) Geom of a shape, built once: a net runs the same shapes every pass."""
    hashable = [tuple(v) if isinstance(v, (list, tuple, np.ndarray)) else v
                for v in (in_sp, kernel, stride, pad, dilation)]
    return _cached_geom(*hashable)


_cached_geom = functools.lru_cache(maxsize=512)(Geom)


def workspace_chunk(per_image_bytes, n):
    return int(max(1, min(n, WORKSPACE_BYTES // max(per_image_bytes, 1))))


def gather(g, xc, dtype, zero_fill=True):
    """Polyphase channel-major copy of a chunk of images: (C, P*nc*Qsize)."""
    nc, c = xc.shape[:2]
    p = len(g.phases)
    buf = scratch("buf", (c, p * nc * g.qsize), dtype, zero_fill and not g.grid_full)
    view = buf.reshape((c, p, nc) + g.q)
    perm = (1, 0) + tuple(range(2, 2 + g.nd))
    for pi, (qsl, xsl) in enumerate(g.copies):
        np.copyto(view[(slice(None), pi, slice(None)) + qsl],
                  xc[(slice(None), slice(None)) + xsl].transpose(perm))
    return buf


def scatter_add(g, buf, out, nc):
    """Adjoint of gather: write a (C, P*nc*Qsize) buffer back to (nc, C, *S)."""
    c = buf.shape[0]
    view = buf[:, :len(g.phases) * nc * g.qsize].reshape((c, len(g.phases), nc) + g.q)
    perm = (1, 0) + tuple(range(2, 2 + g.nd))
    for pi, (qsl, xsl) in enumerate(g.copies):
        np.copyto(out[(slice(None), slice(None)) + xsl],
                  view[(slice(None), pi, slice(None)) + qsl].transpose(perm))


def grid_view(g, buf, nc):
    """(rows, nc*Qsize) buffer -> (nc, rows, *out) view of the real outputs."""
    rows = buf.shape[0]
    v = buf[:, :nc * g.qsize].reshape((rows, nc) + g.q)
    v = v[(slice(None), slice(None)) + tuple(slice(0, o) for o in g.out)]
    return v.transpose((1, 0) + tuple(range(2, 2 + g.nd)))


def flipped_geom(g):
    """Geometry of dx as a stride-1 convolution of dy with the flipped kernel,
    or None when the layer is strided or over-padded."""
    if any(s != 1 for s in g.stride):
        return None
    pads = tuple(d * (k - 1) - p for k, d, p in zip(g.kernel, g.dilation, g.pad))
    if min(pads) < 0:
        return None
    return geom(g.out, g.kernel, (1,) * g.nd, pads, g.dilation)


def flipped_weights(w, group):
    """(O, Cg, *K) -> (C, Og, *K) with every kernel flipped along all axes."""
    o, cg = w.shape[:2]
    nd = w.ndim - 2
    wf = w.reshape((group, o // group, cg) + w.shape[2:]).swapaxes(1, 2)
    wf = wf[(Ellipsis,) + (slice(None, None, -1),) * nd]
    return np.ascontiguousarray(wf).reshape((group * cg, o // group) + w.shape[2:])


def bias_diff(dy, dt):
    """The bias gradient, dy (N, O, *S) summed over images and positions: a matrix-vector
    product with ones over each image's channel planes, run by BLAS on every thread, then the
    images' sums added (2.5-5x faster than NumPy's single-threaded strided reduction)."""
    if not dy.flags.c_contiguous or dy.size == 0:
        return dy.sum(axis=(0,) + tuple(range(2, dy.ndim)), dtype=dt)
    n, o = dy.shape[:2]
    planes = dy.reshape(n * o, -1).astype(dt, copy=False)
    return (planes @ np.ones(planes.shape[1], dt)).reshape(n, o).sum(axis=0)
