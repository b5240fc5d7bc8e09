"""The im2col engine: one deep GEMM per block of columns, for layers with few channels per group
(e.g. the RGB first layer) or small images, where the grid engine's garbage share is large.

Columns are built in bounded blocks and the bias rides along as a row of ones; for large images
each image's GEMM writes y (and reads dy) in place. Blocks run side by side, one Python thread
per core with single-threaded GEMMs (``run_parts``): their GEMMs have a few dozen rows, which
BLAS's own threads split poorly, and the copies between them then run in parallel too.

Also Caffe's Im2col layer (``im2col``/``col2im``; 2-D ones on the compiled kernels).
"""
import itertools
import math

import numpy as np

from caffepar.nn import native
from caffepar.nn.blas import blas_threads, run_parts, scratch, split_parts
from caffepar.nn.blas import gemm_views as _gemm
from caffepar.nn.conv import geometry
from caffepar.nn.conv.geometry import expand, gather, geom

#: Layers with fewer input channels per group use im2col (one deep GEMM).
COLS_MAX_CHANNELS = 64
#: Relative im2col copy cost, times the GEMM rows (see usable).
COLS_COPY_OPS = 32
#: Bound on the im2col column buffer.
COLS_BYTES = 16 << 20
#: im2col layers with at least this many channels per group get dx as a
#: flipped-kernel convolution of dy (a deep GEMM) instead of col2im, whose
#: scatter-adds cost more than the GEMM once channels are many.
FLIP_MIN_CHANNELS = 8
#: An image with at least this many output pixels is its own GEMM, written
#: straight into y; smaller images are batched.
COLS_DIRECT_MIN = 4096
#: Below this output row length, small images are laid out batch-innermost.
COLS_SHORT_ROW = 32


def applicable(g, cg, group):
    """Anything with more than one tap; one channel per group (depthwise) goes to the grid
    engine's elementwise path."""
    return g.ntaps > 1 and not (cg == 1 and group > 1)


def usable(g, cg, og, group):
    """The rule: im2col (one deep GEMM per block) or per-tap GEMMs on the flat grid?

    Per-tap GEMMs are too thin when channels per group are few. Otherwise
    they avoid im2col's copies (which cost about COLS_COPY_OPS / Og of the
    GEMM time) but also compute the grid's garbage cells, a large share for
    small images (14x14 -> 16x16 grid: 31%).
    """
    if not applicable(g, cg, group):
        return False
    waste = g.qsize / math.prod(g.out) - 1
    return cg < COLS_MAX_CHANNELS or waste > COLS_COPY_OPS / og


class _ColsPlan:
    """Blocking and layout of the im2col path.

    Images are processed nb at a time. Long rows use an image-major layout
    (C, nb, *S_padded): gathers copy row-long runs and the output needs only
    a block copy. Short rows (small images) use batch-innermost
    (C, *S_padded, nb) so that gathers copy runs of rows times nb instead of
    a few pixels. Columns are blocked along the first spatial axis to bound
    the column buffer. With nb == 1 (large images) the GEMMs read and write
    y and dy in place, without any transposition. The buffers' bounds are
    shared by the threads that run chunks side by side (``workers``, at most
    MAX_SHARES shares), and there are chunks enough for each share.
    """

    def __init__(self, g, n, c, o, group, isz, workers=1):
        self.k = g.ntaps * (c // group)
        self.rest = math.prod(g.out[1:])
        self.hw = g.out[0] * self.rest
        self.sp = tuple(i + 2 * p for i, p in zip(g.in_sp, g.pad))
        shares = min(workers, geometry.MAX_SHARES)
        max_cols = max(1, COLS_BYTES // shares // ((self.k + 1) * group * isz))
        self.batch_last = False
        if self.hw >= COLS_DIRECT_MIN:
            nb = 1
        else:
            per_image = (2 * c * math.prod(self.sp) + o * self.hw) * isz
            nb = max(1, min(-(-n // shares), geometry.WORKSPACE_BYTES // shares // per_image,
                            max_cols // self.rest))
            self.batch_last = g.out[-1] < COLS_SHORT_ROW and nb > 1
            if not self.batch_last:
                nb = max(1, min(nb, max_cols // self.hw))
        self.nb = int(nb)
        self.rows = int(min(g.out[0], max(1, max_cols // (self.rest * self.nb))))
        self.ncols = self.rows * self.rest * self.nb
        self.taps = list(itertools.product(*[range(k) for k in g.kernel]))
        # Strided layers gather x into its polyphase grid first (as the grid engine does), so
        # that every tap reads unit-stride runs instead of every s-th value.
        self.phased = not self.batch_last and any(st > 1 for st in g.stride)

    def chunks(self, n):
        return [(n0, min(self.nb, n - n0)) for n0 in range(0, n, self.nb)]

    def row_blocks(self, g):
        for r0 in range(0, g.out[0], self.rows):
            yield r0, min(self.rows, g.out[0] - r0)

    def layout_shape(self, c, m, spatial):
        return (c,) + spatial + (m,) if self.batch_last else (c, m) + spatial

    def to_layout(self, a):
        """(m, C, *S) -> the chunk layout."""
        return np.moveaxis(a, 0, -1) if self.batch_last else a.swapaxes(0, 1)

    def from_layout(self, a):
        return np.moveaxis(a, -1, 0) if self.batch_last else a.swapaxes(0, 1)

    def spatial_index(self, sl):
        lead = (slice(None),) if self.batch_last else (slice(None), slice(None))
        return lead + tuple(sl)

    def interior(self, g):
        return self.spatial_index(slice(p, p + i) for p, i in zip(g.pad, g.in_sp))

    def tap_index(self, g, kidx, r0, rows):
        first = kidx[0] * g.dilation[0] + r0 * g.stride[0]
        sl = [slice(first, first + (rows - 1) * g.stride[0] + 1, g.stride[0])]
        for i, d, s, o in zip(kidx[1:], g.dilation[1:], g.stride[1:], g.out[1:]):
            sl.append(slice(i * d, i * d + (o - 1) * s + 1, s))
        return self.spatial_index(sl)


def _pad_chunk(g, plan, xc, dt):
    """(m, C, *S) -> zero-padded chunk layout (for strided layers: the polyphase grid,
    (C, phases, m, *Q))."""
    if plan.phased:
        return gather(g, xc, dt).reshape((xc.shape[1], len(g.phases), xc.shape[0]) + g.q)
    xt = scratch("xt", plan.layout_shape(xc.shape[1], xc.shape[0], plan.sp), dt, True)
    np.copyto(xt[plan.interior(g)], plan.to_layout(xc))
    return xt


def _phased_tap_index(g, kidx, r0, rows):
    """Index of tap kidx's input over output rows r0 .. r0+rows in the polyphase grid."""
    phase = g.phases.index(tuple((i * d) % st for i, d, st in
                                 zip(kidx, g.dilation, g.stride)))
    shift = [(i * d) // st for i, d, st in zip(kidx, g.dilation, g.stride)]
    sl = [slice(shift[0] + r0, shift[0] + r0 + rows)]
    sl += [slice(sh, sh + o) for sh, o in zip(shift[1:], g.out[1:])]
    return (slice(None), phase, slice(None)) + tuple(sl)


def _fill_cols(plan, g, xt, cols, group, r0, rows):
    """cols[gi, t*cg + c, columns] = padded input under tap t."""
    c = xt.shape[0]
    cg = c // group
    ncol = rows * plan.rest * (xt.shape[-1] if plan.batch_last else xt.shape[-g.nd - 1])
    for t, kidx in enumerate(plan.taps):
        if plan.phased:
            src = xt[_phased_tap_index(g, kidx, r0, rows)]
        else:
            src = xt[plan.tap_index(g, kidx, r0, rows)]
        src = src.reshape((group, cg) + src.shape[1:])
        np.copyto(cols[:, t * cg:(t + 1) * cg, :ncol].reshape(src.shape), src)


def _cols_weights(w, group, bias):
    """(O, Cg, *K) -> (group, Og, T*Cg + 1): (tap, channel) order, bias last."""
    o, cg = w.shape[:2]
    t = math.prod(w.shape[2:])
    wa = np.empty((group, o // group, t * cg + 1), w.dtype)
    wa[:, :, :-1].reshape(group, o // group, t, cg)[...] = \
        w.reshape(group, o // group, cg, t).transpose(0, 1, 3, 2)
    wa[:, :, -1] = 0 if bias is None else bias.reshape(group, o // group)
    return wa


def _cols_buffer(plan, group, dt):
    """Column buffer whose last row per group is ones (it carries the bias)."""
    cols = scratch("cols", (group, plan.k + 1, plan.ncols), dt)
    cols[:, -1, :] = 1
    return cols


def forward(g, x, w, b, y, group, dt):
    n, c = x.shape[:2]
    o = w.shape[0]
    og = o // group
    workers = blas_threads()
    plan = _ColsPlan(g, n, c, o, group, dt.itemsize, workers)
    wa = _cols_weights(w, group, b)
    yf = y.reshape(n, o, plan.hw)

    def run(chunks):
        cols = _cols_buffer(plan, group, dt)
        ytmp = scratch("ytmp", (o, plan.hw * plan.nb), dt) if plan.nb > 1 else None
        for n0, m in chunks:
            xt = _pad_chunk(g, plan, x[n0:n0 + m], dt)
            for r0, rows in plan.row_blocks(g):
                _fill_cols(plan, g, xt, cols, group, r0, rows)
                ncol = rows * plan.rest * m
                c0 = r0 * plan.rest * m
                for gi in range(group):
                    if ytmp is None:
                        dst = yf[n0, gi * og:(gi + 1) * og, c0:c0 + ncol]
                    else:
                        dst = ytmp[gi * og:(gi + 1) * og, c0:c0 + ncol]
                    _gemm(wa[gi], cols[gi, :, :ncol], dst)
            if ytmp is not None:
                yt = ytmp[:, :plan.hw * m].reshape(plan.layout_shape(o, m, (plan.hw,)))
                np.copyto(yf[n0:n0 + m], plan.from_layout(yt))

    run_parts(run, split_parts(plan.chunks(n)), workers)


def backward(g, dy, x, w, dx, group, need_dw, need_db, dt):
    """(dw, db) of the im2col path, and dx by col2im when dx is given; the chunks' dw is summed
    in up to SUM_PARTS runs of chunks, added in chunk order."""
    n, o = dy.shape[:2]
    cg = w.shape[1]
    c = cg * group
    og = o // group
    workers = blas_threads()
    plan = _ColsPlan(g, n, c, o, group, dt.itemsize, workers)
    dyf = dy.reshape(n, o, plan.hw)
    wk = _cols_weights(w, group, None)[:, :, :-1] if dx is not None else None

    def run(chunks):
        cols = _cols_buffer(plan, group, dt) if need_dw else None
        dwa = np.zeros((group, og, plan.k + 1), dt) if need_dw else None
        dcols = scratch("dcols", (plan.k, plan.ncols), dt) if dx is not None else None
        dyt = scratch("ytmp", (o, plan.hw * plan.nb), dt) if plan.nb > 1 else None
        for n0, m in chunks:
            xt = _pad_chunk(g, plan, x[n0:n0 + m], dt) if need_dw else None
            dxt = scratch("dxt", plan.layout_shape(c, m, plan.sp), dt, True) \
                if dx is not None else None
            if dyt is None:
                dyc = dyf[n0]
            else:
                dyc = dyt[:, :plan.hw * m]
                np.copyto(dyc.reshape(plan.layout_shape(o, m, (plan.hw,))),
                          plan.to_layout(dyf[n0:n0 + m]))
            for r0, rows in plan.row_blocks(g):
                ncol = rows * plan.rest * m
                c0 = r0 * plan.rest * m
                if need_dw:
                    _fill_cols(plan, g, xt, cols, group, r0, rows)
                for gi in range(group):
                    dyg = dyc[gi * og:(gi + 1) * og, c0:c0 + ncol]
                    if need_dw:
                        _gemm(dyg, cols[gi, :, :ncol], dwa[gi], trans_b=True, beta=1.0)
                    if dx is not None:
                        _gemm(wk[gi], dyg, dcols[:, :ncol], trans_a=True)
                        for t, kidx in enumerate(plan.taps):
                            dst = dxt[(slice(gi * cg, (gi + 1) * cg),)
                                      + plan.tap_index(g, kidx, r0, rows)[1:]]
                            dst += dcols[t * cg:(t + 1) * cg, :ncol].reshape(dst.shape)
            if dx is not None:
                np.copyto(dx[n0:n0 + m], plan.from_layout(dxt[plan.interior(g)]))
        return dwa

    parts = run_parts(run, split_parts(plan.chunks(n), geometry.SUM_PARTS), workers)
    dw = db = None
    if need_dw:
        dwa = parts[0]
        for part in parts[1:]:
            dwa += part
        dw = np.ascontiguousarray(
            dwa[:, :, :-1].reshape(group, og, g.ntaps, cg).transpose(0, 1, 3, 2)
        ).reshape(w.shape)
    if need_db:
        if need_dw:
            db = np.ascontiguousarray(dwa[:, :, -1]).reshape(o)
        else:
            db = geometry.bias_diff(dy, dt)
    return dw, db


def _compiled_planes(kernel, src, out_shape, g):
    """The compiled im2col or col2im of src into a new array of out_shape, runs of the N * C
    planes side by side; None when they do not apply (not 2-D, not a C-contiguous float
    array)."""
    if g.nd != 2 or src.dtype.kind != "f" or not src.flags.c_contiguous:
        return None
    k = native.kernels(src.dtype)
    if k is None:
        return None
    out = np.empty(out_shape, src.dtype)
    fn = getattr(k, kernel)
    dims = (*g.in_sp, *g.kernel, *g.stride, *g.pad, *g.dilation, *g.out)
    run_parts(lambda part: fn(native.ptr(src), native.ptr(out), part[0], part[-1] + 1, *dims),
              split_parts(range(out_shape[0] * (src.shape[1] if kernel == "im2col"
                                                else out_shape[1])), 4 * blas_threads()))
    return out


def im2col(x, kernel, stride, pad, dilation):
    """Caffe's Im2col layer: (N, C, *S) -> (N, C*prod(K), *S_out), rows ordered (c, *k)."""
    x = np.asarray(x)
    nd = x.ndim - 2
    g = geom(x.shape[2:], expand(kernel, nd, "kernel"), stride, pad, dilation)
    n, c = x.shape[:2]
    out = _compiled_planes("im2col", x, (n, c * g.ntaps) + g.out, g)
    if out is not None:
        return out
    xp = np.zeros((n, c) + tuple(i + 2 * p for i, p in zip(g.in_sp, g.pad)), x.dtype)
    xp[(slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(g.pad, g.in_sp))] = x
    cols = np.empty((n, c) + g.kernel + g.out, x.dtype)
    for kidx in itertools.product(*[range(k) for k in g.kernel]):
        src = tuple(slice(i * d, i * d + (o - 1) * s + 1, s)
                    for i, d, s, o in zip(kidx, g.dilation, g.stride, g.out))
        cols[(slice(None), slice(None)) + kidx] = xp[(slice(None), slice(None)) + src]
    return cols.reshape((n, c * g.ntaps) + g.out)


def col2im(cols, x_shape, kernel, stride, pad, dilation):
    """Adjoint of im2col: sums every column entry back onto its input pixel."""
    cols = np.asarray(cols)
    nd = len(x_shape) - 2
    g = geom(x_shape[2:], expand(kernel, nd, "kernel"), stride, pad, dilation)
    n, c = x_shape[:2]
    out = _compiled_planes("col2im", cols, tuple(x_shape), g)
    if out is not None:
        return out
    cv = cols.reshape((n, c) + g.kernel + g.out)
    xp = np.zeros((n, c) + tuple(i + 2 * p for i, p in zip(g.in_sp, g.pad)), cols.dtype)
    for kidx in itertools.product(*[range(k) for k in g.kernel]):
        dst = tuple(slice(i * d, i * d + (o - 1) * s + 1, s)
                    for i, d, s, o in zip(kidx, g.dilation, g.stride, g.out))
        xp[(slice(None), slice(None)) + dst] += cv[(slice(None), slice(None)) + kidx]
    return np.ascontiguousarray(
        xp[(slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(g.pad, g.in_sp))])
