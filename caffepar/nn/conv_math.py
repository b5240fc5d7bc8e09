"""Convolution arithmetic with Caffe's semantics, built on BLAS GEMM.

Blobs are (N, C, *spatial); weights (O, C/group, *kernel). Any number of
spatial axes goes through the first two engines; which engine runs is chosen
per layer shape (``_forward_engine``):

* Per-tap GEMMs on a flat grid (many channels, large images). The padded
  input of a chunk of images is laid out channel-major as
  ``(C, phases, images, *Q)`` and flattened per channel. A stride-1 axis has
  one phase; a stride-s axis is split into its s polyphase components, which
  turns every kernel tap into a *unit-stride* shifted view of that buffer.
  The output over the grid is the sum over taps of ``W_tap @ B[:, off:off+L]``
  with operands that BLAS reads in place (leading dimension = row length),
  accumulated with beta=1: no im2col at all. Grid cells outside the real
  output are garbage, dropped when the result is copied back to NCHW.
* im2col with one deep GEMM (few channels per group, e.g. the RGB first
  layer, or small images where the grid's garbage share is large). Columns
  are built in bounded blocks and the bias rides along as a row of ones; for
  large images each image's GEMM writes y (and reads dy) in place.
* Band im2col for small 2-D images with few channels (e.g. CIFAR-sized
  layers): columns span a whole batch of images, so GEMMs are long however
  small the image; only the kw column taps are gathered from x, and the kh
  row taps are row-shifted views of (or block copies from) that buffer (see
  ``_BandPlan``). dx is the same path run on dy with flipped kernels.
* Winograd F(2x2, 3x3) for 3x3 stride-1 layers with many channels on both
  sides (VGG's conv2_2 onwards): 2.25x fewer multiplies, all transforms done
  as GEMMs; results differ from a direct convolution by float32 rounding.

The im2col and band engines run their blocks side by side, one Python
thread per core with single-threaded GEMMs (``run_parts``): their GEMMs have
a few dozen rows, which BLAS's own threads split poorly, and the copies
between them then run in parallel too.

``conv_engine`` tells which engine a layer shape gets. Temporary workspace is
bounded: images are processed in chunks (``WORKSPACE_BYTES``), column buffers
in blocks (``COLS_BYTES``, ``BAND_BYTES``), and the work arrays are reused
across calls (``blas.release_workspace`` frees them). Results can be written into
the caller's arrays (``out=``, ``dx_out=``), which saves the layer a copy.
GEMMs go through ``caffepar.nn.blas`` on strided views.
"""

import functools
import itertools
import math

import numpy as np

from caffepar.nn.blas import blas_threads, run_parts, split_parts
from caffepar.nn.blas import scratch as _scratch
from caffepar.nn.blas import gemm_views as _gemm

__all__ = [
    "conv_engine",
    "conv_forward",
    "conv_backward",
    "deconv_forward",
    "deconv_backward",
    "conv_output_shape",
    "im2col",
    "col2im",
]

#: Upper bound on the per-call scratch memory (image chunks are sized to it).
WORKSPACE_BYTES = 64 << 20
#: Per-tap GEMMs span max(BLOCK_MIN_COLS, BLOCK_BYTES / row bytes) grid
#: columns: wide, as BLAS call and thread start-up costs outweigh caching.
BLOCK_BYTES = 16 << 20
BLOCK_MIN_COLS = 8192
#: Layers with fewer input channels per group use im2col (one deep GEMM).
COLS_MAX_CHANNELS = 64
#: Relative im2col copy cost, times the GEMM rows (see _use_cols).
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
#: 1x1 unpadded stride-1 convs on images this large are one GEMM per image.
POINTWISE_DIRECT_MIN = 1024
#: Band im2col: layers with Cg * kw below this fold all taps into one deep GEMM.
BAND_FOLD_ALL = 64
#: Bound on the band path's column block.
BAND_BYTES = 8 << 20
#: 3x3 stride-1 layers with at least this many input and output channels
#: per group use Winograd F(2x2, 3x3).
WINOGRAD_MIN_CHANNELS = 128
#: ... and whose 2x2 tiles overhang the output by at most this share.
WINOGRAD_MAX_WASTE = 0.05
#: Blocks run side by side sum their dw in at most this many partial sums (bounded memory),
#: added in block order.
SUM_PARTS = 16
#: Threads running blocks side by side share the buffer bounds above, but never in more than
#: this many shares: on many cores, smaller blocks would make GEMMs too small to run well.
MAX_SHARES = 4


# --------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------

def _tuple(v, nd, name):
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
    kernel = _tuple(kernel, nd, "kernel")
    stride = _tuple(stride, nd, "stride")
    pad = _tuple(pad, nd, "pad")
    dilation = _tuple(dilation, nd, "dilation")
    return tuple((i + 2 * p - (d * (k - 1) + 1)) // s + 1
                 for i, k, s, p, d in zip(in_shape_spatial, kernel, stride, pad, dilation))


class _Geom:
    """Polyphase flat-grid layout of one convolution's input and taps."""

    def __init__(self, in_sp, kernel, stride, pad, dilation):
        nd = len(in_sp)
        self.nd = nd
        self.in_sp = tuple(int(v) for v in in_sp)
        self.kernel = _tuple(kernel, nd, "kernel")
        self.stride = _tuple(stride, nd, "stride")
        self.pad = _tuple(pad, nd, "pad")
        self.dilation = _tuple(dilation, nd, "dilation")
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


def _geom(in_sp, kernel, stride, pad, dilation):
    """The (read-only) _Geom of a shape, built once: a net runs the same shapes every pass."""
    hashable = [tuple(v) if isinstance(v, (list, tuple, np.ndarray)) else v
                for v in (in_sp, kernel, stride, pad, dilation)]
    return _cached_geom(*hashable)


_cached_geom = functools.lru_cache(maxsize=512)(_Geom)


def _workspace_chunk(per_image_bytes, n):
    return int(max(1, min(n, WORKSPACE_BYTES // max(per_image_bytes, 1))))


def _gather(g, xc, dtype, zero_fill=True):
    """Polyphase channel-major copy of a chunk of images: (C, P*nc*Qsize)."""
    nc, c = xc.shape[:2]
    p = len(g.phases)
    buf = _scratch("buf", (c, p * nc * g.qsize), dtype, zero_fill and not g.grid_full)
    view = buf.reshape((c, p, nc) + g.q)
    perm = (1, 0) + tuple(range(2, 2 + g.nd))
    for pi, (qsl, xsl) in enumerate(g.copies):
        np.copyto(view[(slice(None), pi, slice(None)) + qsl],
                  xc[(slice(None), slice(None)) + xsl].transpose(perm))
    return buf


def _scatter_add(g, buf, out, nc):
    """Adjoint of _gather: write a (C, P*nc*Qsize) buffer back to (nc, C, *S)."""
    c = buf.shape[0]
    view = buf[:, :len(g.phases) * nc * g.qsize].reshape((c, len(g.phases), nc) + g.q)
    perm = (1, 0) + tuple(range(2, 2 + g.nd))
    for pi, (qsl, xsl) in enumerate(g.copies):
        np.copyto(out[(slice(None), slice(None)) + xsl],
                  view[(slice(None), pi, slice(None)) + qsl].transpose(perm))


def _grid_view(g, buf, nc):
    """(rows, nc*Qsize) buffer -> (nc, rows, *out) view of the real outputs."""
    rows = buf.shape[0]
    v = buf[:, :nc * g.qsize].reshape((rows, nc) + g.q)
    v = v[(slice(None), slice(None)) + tuple(slice(0, o) for o in g.out)]
    return v.transpose((1, 0) + tuple(range(2, 2 + g.nd)))


def _col_block(rows_bytes):
    return int(max(BLOCK_MIN_COLS, BLOCK_BYTES // max(rows_bytes, 1)))


def _use_cols(g, cg, og, group):
    """im2col (one deep GEMM per block) or per-tap GEMMs on the flat grid?

    Per-tap GEMMs are too thin when channels per group are few. Otherwise
    they avoid im2col's copies (which cost about COLS_COPY_OPS / Og of the
    GEMM time) but also compute the grid's garbage cells, a large share for
    small images (14x14 -> 16x16 grid: 31%).
    """
    if g.ntaps == 1 or (cg == 1 and group > 1):
        return False
    waste = g.qsize / math.prod(g.out) - 1
    return cg < COLS_MAX_CHANNELS or waste > COLS_COPY_OPS / og


# --------------------------------------------------------------------------
# Per-tap GEMMs on the flat grid
# --------------------------------------------------------------------------

def _tap_weights(w, group):
    """(O, Cg, *K) -> (group, T, Og, Cg) contiguous per-tap matrices."""
    o, cg = w.shape[:2]
    t = math.prod(w.shape[2:])
    return np.ascontiguousarray(
        w.reshape(group, o // group, cg, t).transpose(0, 3, 1, 2))


def _tap_offsets(g, nc):
    pstride = nc * g.qsize
    return [ph * pstride + sh for ph, sh in zip(g.tap_phase, g.tap_shift)]


def _grid_forward(g, buf, wt, ybuf, nc, group, cg, og):
    """ybuf[:, :L] = sum over taps of W_tap @ shifted views of buf."""
    L = g.span(nc)
    offs = _tap_offsets(g, nc)
    if cg == 1 and group > 1:
        _depthwise_forward(buf, wt, ybuf, offs, L, group, og)
        return
    lb = min(L, _col_block((og + cg) * buf.itemsize))
    for gi in range(group):
        src = buf[gi * cg:(gi + 1) * cg]
        dst = ybuf[gi * og:(gi + 1) * og]
        for c0 in range(0, L, lb):
            n = min(lb, L - c0)
            d = dst[:, c0:c0 + n]
            for t, off in enumerate(offs):
                _gemm(wt[gi, t], src[:, off + c0:off + c0 + n], d, beta=1.0 if t else 0.0)


def _grid_backward(g, buf, dybuf, dbuf, wt, dwt, nc, group, cg, og, first):
    """Accumulate dW (into dwt) and d(buf) (into dbuf) for one chunk."""
    L = g.span(nc)
    offs = _tap_offsets(g, nc)
    if cg == 1 and group > 1:
        _depthwise_backward(buf, dybuf, dbuf, wt, dwt, offs, L, group, og, first)
        return
    lb = min(L, _col_block((og + 2 * cg) * dybuf.itemsize))
    for gi in range(group):
        dy = dybuf[gi * og:(gi + 1) * og]
        src = buf[gi * cg:(gi + 1) * cg] if buf is not None else None
        dst = dbuf[gi * cg:(gi + 1) * cg] if dbuf is not None else None
        for bi, c0 in enumerate(range(0, L, lb)):
            n = min(lb, L - c0)
            dyb = dy[:, c0:c0 + n]
            for t, off in enumerate(offs):
                if dwt is not None:
                    _gemm(dyb, src[:, off + c0:off + c0 + n], dwt[gi, t], trans_b=True,
                          beta=0.0 if (first and bi == 0) else 1.0)
                if dst is not None:
                    _gemm(wt[gi, t], dyb, dst[:, off + c0:off + c0 + n], trans_a=True,
                          beta=1.0)


# --------------------------------------------------------------------------
# im2col GEMMs for thin layers
# --------------------------------------------------------------------------

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
        shares = min(workers, MAX_SHARES)
        max_cols = max(1, COLS_BYTES // shares // ((self.k + 1) * group * isz))
        self.batch_last = False
        if self.hw >= COLS_DIRECT_MIN:
            nb = 1
        else:
            per_image = (2 * c * math.prod(self.sp) + o * self.hw) * isz
            nb = max(1, min(-(-n // shares), WORKSPACE_BYTES // shares // per_image,
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
        return _gather(g, xc, dt).reshape((xc.shape[1], len(g.phases), xc.shape[0]) + g.q)
    xt = _scratch("xt", plan.layout_shape(xc.shape[1], xc.shape[0], plan.sp), dt, True)
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
    cols = _scratch("cols", (group, plan.k + 1, plan.ncols), dt)
    cols[:, -1, :] = 1
    return cols


def _cols_forward(g, x, w, b, y, group, dt):
    n, c = x.shape[:2]
    o = w.shape[0]
    og = o // group
    workers = blas_threads()
    plan = _ColsPlan(g, n, c, o, group, dt.itemsize, workers)
    wa = _cols_weights(w, group, b)
    yf = y.reshape(n, o, plan.hw)

    def run(chunks):
        cols = _cols_buffer(plan, group, dt)
        ytmp = _scratch("ytmp", (o, plan.hw * plan.nb), dt) if plan.nb > 1 else None
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


def _flipped_geom(g):
    """Geometry of dx as a stride-1 convolution of dy with the flipped kernel,
    or None when the layer is strided or over-padded."""
    if any(s != 1 for s in g.stride):
        return None
    pads = tuple(d * (k - 1) - p for k, d, p in zip(g.kernel, g.dilation, g.pad))
    if min(pads) < 0:
        return None
    return _geom(g.out, g.kernel, (1,) * g.nd, pads, g.dilation)


def _flipped_weights(w, group):
    """(O, Cg, *K) -> (C, Og, *K) with every kernel flipped along all axes."""
    o, cg = w.shape[:2]
    nd = w.ndim - 2
    wf = w.reshape((group, o // group, cg) + w.shape[2:]).swapaxes(1, 2)
    wf = wf[(Ellipsis,) + (slice(None, None, -1),) * nd]
    return np.ascontiguousarray(wf).reshape((group * cg, o // group) + w.shape[2:])


def _cols_backward(g, dy, x, w, dx, group, need_dw, need_db, dt):
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
        dcols = _scratch("dcols", (plan.k, plan.ncols), dt) if dx is not None else None
        dyt = _scratch("ytmp", (o, plan.hw * plan.nb), dt) if plan.nb > 1 else None
        for n0, m in chunks:
            xt = _pad_chunk(g, plan, x[n0:n0 + m], dt) if need_dw else None
            dxt = _scratch("dxt", plan.layout_shape(c, m, plan.sp), dt, True) \
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

    parts = run_parts(run, split_parts(plan.chunks(n), SUM_PARTS), workers)
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
            db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)), dtype=dt)
    return dw, db


# --------------------------------------------------------------------------
# Band im2col for thin 2-D layers (rows x batch x columns layout)
# --------------------------------------------------------------------------

def _use_band(g, group):
    """Band im2col for small 2-D images (large ones are better off with a
    GEMM per image written straight into y): needs one group and unit row
    stride."""
    return (g.nd == 2 and group == 1 and g.stride[0] == 1
            and math.prod(g.out) < COLS_DIRECT_MIN)


class _BandPlan:
    """Blocking and layout of the band im2col path.

    Only the kw column taps are copied from x (k = kw * C rows per padded
    row); the kh row taps reuse those copies shifted by whole rows:

    * wide layers (C * kw >= BAND_FOLD_ALL, e.g. 32 channels 5x5): columns
      ordered (row, image, column), so a row shift is one offset for the whole
      block and each row tap is a depth-k GEMM on a shifted view, accumulated
      with beta=1 -- kh times fewer copies than a full im2col at about the
      same GEMM speed, and the batch makes GEMMs long even for 8x8 images;
    * thin layers (e.g. the RGB input), whose depth-k GEMMs would be too thin:
      columns ordered (image, row, column); the kh row-shifted slices are
      block-copied (runs of whole images) into one kh*k-deep matrix, and the
      output and dy move to and from NCHW in runs of whole images.

    Blocks hold nb images, or for large images a band of rows plus the
    kernel's halo, within BAND_BYTES shared by the threads that run blocks
    side by side (``workers``, at most MAX_SHARES shares); the block count is
    a multiple of the shares.
    """

    def __init__(self, g, n, c, isz, workers=1):
        kh, kw = g.kernel
        self.fold_all = c * kw < BAND_FOLD_ALL
        self.row_step = g.dilation[0]
        self.halo = (kh - 1) * self.row_step
        self.k = kw * c
        self.depth = self.k * (kh if self.fold_all else 1)
        self.nshifts = 1 if self.fold_all else kh
        ho, wo = g.out
        # Bytes per (image, output row) of the column buffers.
        per_row = (self.k + (self.depth if self.fold_all else 0)) * wo * isz
        whole = (ho + self.halo) * per_row
        shares = min(workers, MAX_SHARES)
        budget = BAND_BYTES // shares
        if whole <= budget:
            self.rows = ho
            nblocks = -(-n // max(1, min(n, budget // whole)))
            self.nb = -(-n // min(n, -(-nblocks // shares) * shares))
        else:
            self.nb = 1
            rows = max(1, min(ho, budget // per_row - self.halo))
            self.rows = -(-ho // -(-ho // rows))
        self.wo = wo

    def blocks(self, g, n):
        for n0 in range(0, n, self.nb):
            for r0 in range(0, g.out[0], self.rows):
                yield n0, min(self.nb, n - n0), r0, min(self.rows, g.out[0] - r0)

    def out_shape(self, o, m, rows):
        """Shape of a block's GEMM output (and of dy for it)."""
        return (o, m, rows, self.wo) if self.fold_all else (o, rows, m, self.wo)

    def to_nchw(self, a):
        """Block layout -> (m, O, rows, wo) view."""
        return a.swapaxes(0, 1) if self.fold_all else a.transpose(2, 0, 1, 3)


def _padded_ld(cols, isz):
    """A row length >= cols whose byte size is an odd multiple of 64.

    Rows a multiple of a large power of two apart (e.g. 1024 floats) map to
    the same cache sets, which can slow the GEMM's packing of the operand.
    """
    lines = -(-cols * isz // 64)
    lines += 1 - lines % 2
    return max(cols, lines * 64 // isz)


def _band_buffers(plan, dt):
    """(kw-tap copies, deep column matrix or None), per-thread scratch."""
    span = (plan.rows + plan.halo) * plan.nb * plan.wo
    taps = _scratch("btaps", (plan.k, _padded_ld(span, dt.itemsize)), dt)
    deep = None
    if plan.fold_all:
        # A last row of ones carries the bias (forward) and gives db (backward).
        deep = _scratch("bcols", (plan.depth + 1, _padded_ld(plan.rows * plan.nb * plan.wo,
                                                             dt.itemsize)), dt)
        deep[-1] = 1
    return taps, deep


def _band_fill(g, plan, x, n0, m, r0, rows, taps, deep):
    """Column operands of one block: taps[(j, c), ...] = zero-padded x under
    column tap j, over padded rows r0 .. r0+rows+halo of images n0 .. n0+m;
    for thin layers also deep[(i, j, c), image, row, col] from its row shifts."""
    c = x.shape[1]
    h, w = g.in_sp
    ph, pw = g.pad
    dh, dw = g.dilation
    sw = g.stride[1]
    wo = plan.wo
    prow = rows + plan.halo
    kw = g.kernel[1]
    if plan.fold_all:       # (tap, c, image, row, col)
        v = taps[:, :m * prow * wo].reshape(kw, c, m, prow, wo).transpose(0, 1, 3, 2, 4)
    else:                   # (tap, c, row, image, col)
        v = taps[:, :prow * m * wo].reshape(kw, c, prow, m, wo)
    first = r0 - ph
    p_lo, p_hi = max(0, -first), min(prow, h - first)
    for j in range(kw):
        d = v[j]            # (c, row, image, col) view
        c0 = j * dw - pw
        w_lo, w_hi = max(0, -(c0 // sw)), min(wo, (w - 1 - c0) // sw + 1)
        if p_lo >= p_hi or w_lo >= w_hi:
            d[...] = 0
            continue
        d[:, :p_lo] = 0
        d[:, p_hi:] = 0
        d[:, p_lo:p_hi, :, :w_lo] = 0
        d[:, p_lo:p_hi, :, w_hi:] = 0
        src = x[n0:n0 + m, :, first + p_lo:first + p_hi,
                c0 + w_lo * sw:c0 + (w_hi - 1) * sw + 1:sw]
        np.copyto(d[:, p_lo:p_hi, :, w_lo:w_hi], src.transpose(1, 2, 0, 3))
    if plan.fold_all:
        tv = taps[:, :m * prow * wo].reshape(plan.k, m, prow, wo)
        dv = deep[:-1, :m * rows * wo].reshape(g.kernel[0], plan.k, m, rows, wo)
        for i in range(g.kernel[0]):
            np.copyto(dv[i], tv[:, :, i * dh:i * dh + rows])


def _band_products(plan, taps, deep, m, rows):
    """(weight index, column operand) of each GEMM of a block; every one of
    them spans all the block's output columns (row taps accumulate)."""
    step = m * plan.wo
    L = rows * step
    if plan.fold_all:
        yield 0, deep[:, :L]        # with the ones row
    else:
        for s in range(plan.nshifts):
            off = s * plan.row_step * step
            yield s, taps[:, off:off + L]


def _band_weights(w, plan, bias=None):
    """(O, C, kh, kw) -> (shifts, O, depth) with depth ordered (i, j, c);
    thin layers get the bias as an extra last column."""
    o, c, kh, kw = w.shape
    wt = w.transpose(0, 2, 3, 1)                      # (O, kh, kw, C)
    if plan.fold_all:
        wb = np.empty((1, o, kh * kw * c + 1), w.dtype)
        wb[0, :, :-1] = wt.reshape(o, -1)
        wb[0, :, -1] = 0 if bias is None else bias
        return wb
    return np.ascontiguousarray(wt.transpose(1, 0, 2, 3)).reshape(kh, o, kw * c)


def _band_dw(dwb, plan, w_shape):
    o, c, kh, kw = w_shape
    if plan.fold_all:
        return np.ascontiguousarray(dwb[0, :, :-1].reshape(o, kh, kw, c).transpose(0, 3, 1, 2))
    return np.ascontiguousarray(dwb.reshape(kh, o, kw, c).transpose(1, 3, 0, 2))


def _band_forward(g, x, w, bias, y, dt):
    """y = conv(x, w) + bias through band im2col blocks, written into y."""
    n = x.shape[0]
    o = w.shape[0]
    workers = blas_threads()
    plan = _BandPlan(g, n, x.shape[1], dt.itemsize, workers)
    wb = _band_weights(w, plan, bias)
    if plan.fold_all:
        bias = None                                   # added by the GEMM
    bshape = (1, o, 1, 1)

    def run(blocks):
        taps, deep = _band_buffers(plan, dt)
        yb = _scratch("bout", (o, _padded_ld(plan.rows * plan.nb * plan.wo, dt.itemsize)), dt)
        for n0, m, r0, rows in blocks:
            _band_fill(g, plan, x, n0, m, r0, rows, taps, deep)
            d = yb[:, :rows * m * plan.wo]
            for s, operand in _band_products(plan, taps, deep, m, rows):
                _gemm(wb[s], operand, d, beta=1.0 if s else 0.0)
            src = plan.to_nchw(d.reshape(plan.out_shape(o, m, rows)))
            dst = y[n0:n0 + m, :, r0:r0 + rows]
            if bias is None:
                np.copyto(dst, src)
            else:
                np.add(src, bias.reshape(bshape), out=dst)

    run_parts(run, split_parts(plan.blocks(g, n)), workers)


def _band_backward(g, dy, x, w, need_db, dt):
    """(dw, db or None) through the same blocks as _band_forward; the blocks' dw is summed in
    up to SUM_PARTS runs of blocks, added in block order."""
    n = x.shape[0]
    o = w.shape[0]
    workers = blas_threads()
    plan = _BandPlan(g, n, x.shape[1], dt.itemsize, workers)
    sum_db = need_db and not plan.fold_all

    def run(blocks):
        taps, deep = _band_buffers(plan, dt)
        dyb = _scratch("bout", (o, _padded_ld(plan.rows * plan.nb * plan.wo, dt.itemsize)), dt)
        dwb = np.zeros((plan.nshifts, o, plan.depth + plan.fold_all), dt)
        db = np.zeros(o, dt) if sum_db else None
        for n0, m, r0, rows in blocks:
            _band_fill(g, plan, x, n0, m, r0, rows, taps, deep)
            d = dyb[:, :rows * m * plan.wo]
            np.copyto(plan.to_nchw(d.reshape(plan.out_shape(o, m, rows))),
                      dy[n0:n0 + m, :, r0:r0 + rows])
            for s, operand in _band_products(plan, taps, deep, m, rows):
                _gemm(d, operand, dwb[s], trans_b=True, beta=1.0)
            if sum_db:
                db += d.sum(axis=1)
        return dwb, db

    parts = run_parts(run, split_parts(plan.blocks(g, n), SUM_PARTS), workers)
    dwb, db = parts[0]
    for part_dw, part_db in parts[1:]:
        dwb += part_dw
        if sum_db:
            db += part_db
    if need_db and plan.fold_all:
        db = dwb[0, :, -1].copy()
    return _band_dw(dwb, plan, w.shape), db


def _depthwise_forward(buf, wt, ybuf, offs, L, group, og):
    """One input channel per group: elementwise multiply-adds beat 1-row GEMMs."""
    y = ybuf[:, :L].reshape(group, og, L)
    lb = _col_block(2 * og * buf.itemsize) * 4
    tmp = np.empty((group, og, min(lb, L)), buf.dtype)
    for c0 in range(0, L, lb):
        n = min(lb, L - c0)
        yb = y[:, :, c0:c0 + n]
        tb = tmp[:, :, :n]
        for t, off in enumerate(offs):
            xs = buf[:, None, off + c0:off + c0 + n]
            wv = wt[:, t, :, :]  # (group, og, 1)
            if t == 0:
                np.multiply(wv, xs, out=yb)
            else:
                np.multiply(wv, xs, out=tb)
                yb += tb


def _depthwise_backward(buf, dybuf, dbuf, wt, dwt, offs, L, group, og, first):
    dy = dybuf[:, :L].reshape(group, og, L)
    for t, off in enumerate(offs):
        if dwt is not None:
            xs = buf[:, off:off + L]
            part = np.matmul(dy, xs[:, :, None])  # (group, og, 1)
            if first:
                dwt[:, t] = part
            else:
                dwt[:, t] += part
        if dbuf is not None:
            d = dbuf[:, off:off + L]
            d += np.matmul(wt[:, t].transpose(0, 2, 1), dy)[:, 0, :]


# --------------------------------------------------------------------------
# Winograd F(2x2, 3x3) for wide 3x3 stride-1 layers
# --------------------------------------------------------------------------
#
# Each 2x2 output tile is A^T [(G g G^T) * (B^T d B)] A for the 4x4 input
# tile d around it (Lavin & Gray, 2015): 16 products per tile and channel
# pair instead of 36. With the row-major tile vectors, the three transforms
# are kron products, so every stage is a GEMM: V = B2 @ tiles (16, C*T),
# U = G2 @ w (16, O*Cg), then per transform position xi M[xi] = U[xi] @ V[xi]
# (16 GEMMs as deep as the layer's channels), and tiles of y = A2 @ M.
# Backward: dx is the same forward on dy with flipped kernels, and dw is
# G2^T (sum over tiles of (A2^T dy_tile)[xi] V[xi]^T), the exact adjoint.

_WINO_B = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
_WINO_G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
_WINO_A = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])
_WINO_MATS = {}


def _wino_mats(dt):
    """(B2, G2, A2) in dtype dt: the kron forms of B^T, G and A^T."""
    mats = _WINO_MATS.get(dt)
    if mats is None:
        mats = _WINO_MATS[dt] = tuple(np.kron(m, m).astype(dt)
                                      for m in (_WINO_B, _WINO_G, _WINO_A))
    return mats


def _use_winograd(g, cg, og):
    """Wide enough that 2.25x fewer multiplies pay for the transforms, and
    an output the 2x2 tiles cover without much waste (13x13 computes 14x14)."""
    if not (g.nd == 2 and g.kernel == (3, 3) and g.stride == (1, 1)
            and g.dilation == (1, 1) and max(g.pad) <= 2
            and min(cg, og) >= WINOGRAD_MIN_CHANNELS):
        return False
    tiled = math.prod(o + o % 2 for o in g.out)
    return tiled <= (1 + WINOGRAD_MAX_WASTE) * math.prod(g.out)


class _WinoTiles:
    """2x2 output tiles of a padded 3x3 stride-1 layer, and the polyphase
    (even/odd row and column) copy of the input they read."""

    def __init__(self, in_sp, pad):
        self.h, self.w = in_sp
        self.pad = pad
        self.oh, self.ow = self.h + 2 * pad[0] - 2, self.w + 2 * pad[1] - 2
        self.ty, self.tx = (self.oh + 1) // 2, (self.ow + 1) // 2
        self.tiles = self.ty * self.tx
        # Phase (a, b) row i, column j holds x[2i + a - pad_h, 2j + b - pad_w].
        self.copies = []
        for a in range(2):
            rows = _phase_span(a, pad[0], self.h, self.ty + 1)
            for b in range(2):
                cols = _phase_span(b, pad[1], self.w, self.tx + 1)
                if rows and cols:
                    self.copies.append((a, b, rows, cols))

    def per_image_bytes(self, c, o, isz):
        phases = 4 * c * (self.ty + 1) * (self.tx + 1)
        return (phases + 16 * max(c, o) + 16 * c + 4 * o) * self.tiles * isz

    def input_transform(self, xc, dt):
        """V (16, C, m * tiles) for a chunk of images xc (m, C, H, W)."""
        m, c = xc.shape[:2]
        ty, tx = self.ty, self.tx
        ph = _scratch("wino_ph", (2, 2, c, m, ty + 1, tx + 1), dt, zero=True)
        for a, b, (i0, i1, r0), (j0, j1, c0) in self.copies:
            np.copyto(ph[a, b, :, :, i0:i1, j0:j1],
                      xc[:, :, r0:r0 + 2 * (i1 - i0) - 1:2,
                         c0:c0 + 2 * (j1 - j0) - 1:2].transpose(1, 0, 2, 3))
        tiles = _scratch("wino_dm", (4, 4, c, m, ty, tx), dt)
        for ky in range(4):
            for kx in range(4):
                np.copyto(tiles[ky, kx], ph[ky % 2, kx % 2, :, :, ky // 2:ky // 2 + ty,
                                            kx // 2:kx // 2 + tx])
        v = _scratch("wino_v", (16, c * m * self.tiles), dt)
        _gemm(_wino_mats(dt)[0], tiles.reshape(16, -1), v)
        return v.reshape(16, c, m * self.tiles)

    def quads(self, out, z):
        """The four (a, b) pixel phases of a chunk of y or dy (m, O, OH, OW) as (O, m, ., .)
        views, each paired with its cells of the tile-layout z (2, 2, O, m, ty, tx)."""
        for a in range(2):
            for b in range(2):
                ny, nx = (self.oh - a + 1) // 2, (self.ow - b + 1) // 2
                yield (out[:, :, a::2, b::2].transpose(1, 0, 2, 3),
                       z[a, b, :, :, :ny, :nx])


def _phase_span(a, pad, size, n):
    """(first, end) phase index and first x index of phase a's rows inside
    the image, or None."""
    i0 = max(0, -((a - pad) // 2))
    i1 = min(n, (size - 1 + pad - a) // 2 + 1)
    return (i0, i1, 2 * i0 + a - pad) if i1 > i0 else None


def _wino_weights(w, dt):
    """U (16, O, Cg) = G2 applied to every 3x3 kernel."""
    o, cg = w.shape[:2]
    u = np.empty((16, o * cg), dt)
    _gemm(_wino_mats(dt)[1], np.ascontiguousarray(w, dt).reshape(o * cg, 9), u, trans_b=True)
    return u.reshape(16, o, cg)


def _wino_forward(x, w, bias, y, pad, group, dt):
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    wt = _WinoTiles(x.shape[2:], pad)
    u = _wino_weights(w, dt)
    a2 = _wino_mats(dt)[2]
    nc = _workspace_chunk(wt.per_image_bytes(c, o, dt.itemsize), n)
    for n0 in range(0, n, nc):
        m = min(nc, n - n0)
        t = m * wt.tiles
        v = wt.input_transform(x[n0:n0 + m], dt)
        prod = _scratch("wino_dm", (16, o, t), dt)
        for k in range(16):
            for gi in range(group):
                _gemm(u[k, gi * og:(gi + 1) * og], v[k, gi * cg:(gi + 1) * cg],
                      prod[k, gi * og:(gi + 1) * og])
        z = _scratch("wino_y", (4, o, t), dt)
        _gemm(a2, prod.reshape(16, -1), z.reshape(4, -1))
        if bias is not None:
            z += bias[:, None]
        for dst, src in wt.quads(y[n0:n0 + m], z.reshape(2, 2, o, m, wt.ty, wt.tx)):
            np.copyto(dst, src)


def _wino_backward(dy, x, w, dx, pad, group, need_dw, dt):
    """dx (written in full) and dw of a Winograd layer."""
    o, cg = w.shape[:2]
    og = o // group
    if dx is not None:
        _wino_forward(dy, _flipped_weights(w, group), None, dx, (2 - pad[0], 2 - pad[1]),
                      group, dt)
    if not need_dw:
        return None
    n, c = x.shape[:2]
    wt = _WinoTiles(x.shape[2:], pad)
    b2, g2, a2 = _wino_mats(dt)
    du = np.empty((16, o, cg), dt)
    odd = wt.oh % 2 or wt.ow % 2
    nc = _workspace_chunk(wt.per_image_bytes(c, o, dt.itemsize), n)
    for i, n0 in enumerate(range(0, n, nc)):
        m = min(nc, n - n0)
        t = m * wt.tiles
        v = wt.input_transform(x[n0:n0 + m], dt)
        z = _scratch("wino_y", (4, o, t), dt, zero=odd)
        for src, dst in wt.quads(dy[n0:n0 + m], z.reshape(2, 2, o, m, wt.ty, wt.tx)):
            np.copyto(dst, src)
        dprod = _scratch("wino_dm", (16, o, t), dt)
        _gemm(a2, z.reshape(4, -1), dprod.reshape(16, -1), trans_a=True)
        for k in range(16):
            for gi in range(group):
                _gemm(dprod[k, gi * og:(gi + 1) * og], v[k, gi * cg:(gi + 1) * cg],
                      du[k, gi * og:(gi + 1) * og], trans_b=True, beta=0.0 if i == 0 else 1.0)
    dw = np.empty(w.shape, dt)
    _gemm(du.reshape(16, -1), g2, dw.reshape(o * cg, 9), trans_a=True)
    return dw


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------

def _check(x, w, group, what):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise ValueError(f"{what}: expected x (N, C, *S) and w with as many axes, got "
                         f"{x.shape} and {w.shape}")
    if group < 1 or w.shape[0] % group:
        raise ValueError(f"{what}: {w.shape[0]} filters are not divisible by group {group}")


def _dtype(*arrays):
    dt = np.result_type(*[a.dtype for a in arrays if a is not None])
    if dt.kind != "f":
        dt = np.dtype(np.float64)
    return dt


def _bias_shape(nd):
    return (1, -1) + (1,) * nd


def _target(out, shape, dt, what):
    """(array to compute into, caller's array to copy to at the end or None).

    Results go straight into ``out`` when it is a C-contiguous array of the
    result's dtype; otherwise into a temporary copied over once.
    """
    if out is None:
        return np.empty(shape, dt), None
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype == dt and out.flags.c_contiguous and out.flags.writeable:
        return out, None
    return np.empty(shape, dt), out


def _deliver(result, final):
    if final is None:
        return result
    final[...] = result
    return final


def conv_forward(x, w, b, stride, pad, dilation, group, out=None):
    """x (N, C, *S), w (O, C//group, *K), b (O,) or None -> y (N, O, *S_out), C-contiguous.

    With ``out`` (shape (N, O, *S_out)) the result is written there and
    returned, saving the caller a copy.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    _check(x, w, group, "conv_forward")
    dt = _dtype(x, w, b)
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    if c != cg * group:
        raise ValueError(f"conv_forward: input has {c} channels, weights expect {cg * group}")
    g = _geom(x.shape[2:], w.shape[2:], stride, pad, dilation)
    x = x.astype(dt, copy=False)
    w = w.astype(dt, copy=False)
    y, final = _target(out, (n, o) + g.out, dt, "conv_forward")
    bias = None if b is None else np.asarray(b, dt).reshape(o)
    if n:
        _conv_forward_into(g, x, w, bias, y, group, dt)
    return _deliver(y, final)


def _forward_engine(g, cg, og, group):
    if _use_winograd(g, cg, og):
        return "winograd"
    if _is_pointwise(g) and g.qsize >= POINTWISE_DIRECT_MIN:
        return "pointwise"
    if _use_cols(g, cg, og, group):
        return "band" if _use_band(g, group) and cg < COLS_MAX_CHANNELS else "im2col"
    return "grid"


def conv_engine(in_spatial, w_shape, stride, pad, dilation, group):
    """Which engine runs a convolution's forward: winograd, pointwise, band,
    im2col or grid (per-tap GEMMs); benchmarks print it."""
    g = _geom(in_spatial, w_shape[2:], stride, pad, dilation)
    return _forward_engine(g, w_shape[1], w_shape[0] // group, group)


def _conv_forward_into(g, x, w, bias, y, group, dt):
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    engine = _forward_engine(g, cg, og, group)
    if engine == "winograd":
        _wino_forward(x, w, bias, y, g.pad, group, dt)
        return
    if engine == "pointwise":
        _pointwise_forward(x, w, y, group)
        if bias is not None:
            y += bias.reshape(_bias_shape(g.nd))
        return
    if engine == "band":
        _band_forward(g, x, w, bias, y, dt)
        return
    if engine == "im2col":
        _cols_forward(g, x, w, bias, y, group, dt)
        return
    wt = _tap_weights(w, group)
    per_image = (c * len(g.phases) + o) * g.qsize * dt.itemsize
    nc = _workspace_chunk(per_image, n)
    for n0 in range(0, n, nc):
        m = min(nc, n - n0)
        buf = _gather(g, x[n0:n0 + m], dt)
        ybuf = _scratch("ybuf", (o, m * g.qsize), dt)
        _grid_forward(g, buf, wt, ybuf, m, group, cg, og)
        del buf
        yv = _grid_view(g, ybuf, m)
        if bias is None:
            np.copyto(y[n0:n0 + m], yv)
        else:
            np.add(yv, bias.reshape(_bias_shape(g.nd)), out=y[n0:n0 + m])


def conv_backward(dy, x, w, stride, pad, dilation, group,
                  need_dx=True, need_dw=True, need_db=True, dx_out=None):
    """Gradients of conv_forward: (dx or None, dw or None, db or None).

    ``x`` is only read for dw; when need_dw is False it may be any object
    with the input's ``shape``. dw/db are this call's gradient alone. With
    ``dx_out`` (x's shape) dx is written there and returned.
    """
    dy = np.asarray(dy)
    w = np.asarray(w)
    x_shape = tuple(x.shape)
    if need_dw:
        x = np.asarray(x)
    dt = _dtype(dy, w, x if need_dw else None)
    return _conv_backward(dy.astype(dt, copy=False), x if need_dw else None, x_shape,
                          w.astype(dt, copy=False), stride, pad, dilation, group,
                          need_dx, need_dw, need_db, dt, dx_out)


def _conv_backward(dy, x, x_shape, w, stride, pad, dilation, group,
                   need_dx, need_dw, need_db, dt, dx_out=None):
    if len(x_shape) < 3 or w.ndim != len(x_shape):
        raise ValueError(f"conv_backward: expected x (N, C, *S) and w with as many axes, "
                         f"got {x_shape} and {w.shape}")
    if group < 1 or w.shape[0] % group:
        raise ValueError(f"conv_backward: {w.shape[0]} filters are not divisible by "
                         f"group {group}")
    n, c = x_shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    if c != cg * group:
        raise ValueError(f"conv_backward: input has {c} channels, weights expect {cg * group}")
    g = _geom(x_shape[2:], w.shape[2:], stride, pad, dilation)
    if dy.shape != (n, o) + g.out:
        raise ValueError(f"conv_backward: dy has shape {dy.shape}, expected {(n, o) + g.out}")
    if not (need_dx or need_dw or need_db):
        return None, None, None
    wino = _use_winograd(g, cg, og) and n > 0
    use_cols = _use_cols(g, cg, og, group) and n > 0 and (need_dx or need_dw)
    dx = final = None
    if need_dx:
        dx, final = _target(dx_out, x_shape, dt, "conv_backward")
        if not (g.x_full or use_cols or wino):
            dx.fill(0)
    if wino:
        dw = _wino_backward(dy, x, w, dx, g.pad, group, need_dw, dt)
        db = dy.sum(axis=(0, 2, 3), dtype=dt) if need_db else None
        return (None if dx is None else _deliver(dx, final)), dw, db
    dx, dw, db = _conv_backward_into(g, dy, x, w, dx, group, need_dw, need_db, dt, use_cols)
    return (None if dx is None else _deliver(dx, final)), dw, db


def _conv_backward_into(g, dy, x, w, dx, group, need_dw, need_db, dt, use_cols):
    n, c = dx.shape[:2] if dx is not None else (dy.shape[0], w.shape[1] * group)
    o, cg = w.shape[:2]
    og = o // group
    need_dx = dx is not None
    if use_cols:
        dy = np.ascontiguousarray(dy)
        band = _use_band(g, group) and cg < COLS_MAX_CHANNELS
        gt = _flipped_geom(g) if (need_dx and cg >= FLIP_MIN_CHANNELS) else None
        if gt is not None:
            # dx is a forward convolution in its own right (dy has og channels per group):
            # small images stay on the band path, others take the engine that shape suits.
            if band:
                _band_forward(gt, dy, _flipped_weights(w, group), None, dx, dt)
            else:
                _conv_forward_into(gt, dy, _flipped_weights(w, group), None, dx, group, dt)
        if not band:
            dw, db = _cols_backward(g, dy, x, w, dx if gt is None else None, group,
                                    need_dw, need_db, dt)
            return dx, dw, db
        dw = db = None
        if need_dw:
            dw, db = _band_backward(g, dy, x, w, need_db, dt)
        elif need_db:
            db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)), dtype=dt)
        if need_dx and gt is None:
            _cols_backward(g, dy, x, w, dx, group, False, False, dt)
        return dx, dw, db
    db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)), dtype=dt) if need_db else None
    if not (need_dx or need_dw):
        return None, None, db
    if n == 0:
        return dx, (np.zeros(w.shape, dt) if need_dw else None), db
    if _is_pointwise(g) and g.qsize >= POINTWISE_DIRECT_MIN:
        dw = _pointwise_backward(np.ascontiguousarray(dy), x, w, dx, group, need_dw)
        return dx, dw, db
    wt = _tap_weights(w, group)
    dwt = np.empty((group, g.ntaps, og, cg), dt) if need_dw else None
    planes = c * len(g.phases) * (int(need_dw) + int(need_dx)) + o
    nc = _workspace_chunk(planes * g.qsize * dt.itemsize, n)
    for i, n0 in enumerate(range(0, n, nc)):
        m = min(nc, n - n0)
        buf = _gather(g, x[n0:n0 + m], dt) if need_dw else None
        dybuf = _scratch("ybuf", (o, m * g.qsize), dt)
        _zero_garbage(g, dybuf, m)
        np.copyto(_grid_view(g, dybuf, m), dy[n0:n0 + m])
        dbuf = _scratch("dbuf", (c, len(g.phases) * m * g.qsize), dt, True) if need_dx else None
        _grid_backward(g, buf, dybuf, dbuf, wt, dwt, m, group, cg, og, first=(i == 0))
        del buf, dybuf
        if need_dx:
            _scatter_add(g, dbuf, dx[n0:n0 + m], m)
    dw = None
    if need_dw:
        dw = np.ascontiguousarray(dwt.transpose(0, 2, 3, 1)).reshape(w.shape)
    return dx, dw, db


def _zero_garbage(g, buf, nc):
    """Zero the grid cells outside the real output (each axis' tail)."""
    v = buf[:, :nc * g.qsize].reshape((buf.shape[0], nc) + g.q)
    for a, (q, o) in enumerate(zip(g.q, g.out)):
        if q > o:
            v[(slice(None),) * (2 + a) + (slice(o, None),)] = 0


def _is_pointwise(g):
    return (g.ntaps == 1 and all(s == 1 for s in g.stride) and all(p == 0 for p in g.pad))


def _pointwise_forward(x, w, y, group):
    """1x1 stride-1 unpadded conv: one GEMM per image straight into y."""
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    hw = math.prod(x.shape[2:])
    xs = x.reshape(n, c, hw)
    ys = y.reshape(n, o, hw)
    w2 = np.ascontiguousarray(w.reshape(o, cg))
    for i in range(n):
        for gi in range(group):
            _gemm(w2[gi * og:(gi + 1) * og], xs[i, gi * cg:(gi + 1) * cg],
                  ys[i, gi * og:(gi + 1) * og])


def _pointwise_backward(dy, x, w, dx, group, need_dw):
    n = dy.shape[0]
    o, cg = w.shape[:2]
    og = o // group
    c = cg * group
    hw = math.prod(dy.shape[2:])
    dys = dy.reshape(n, o, hw)
    w2 = np.ascontiguousarray(w.reshape(o, cg))
    dw = np.empty((o, cg), dy.dtype) if need_dw else None
    xs = x.reshape(n, c, hw) if need_dw else None
    dxs = dx.reshape(n, c, hw) if dx is not None else None
    for i in range(n):
        for gi in range(group):
            dyi = dys[i, gi * og:(gi + 1) * og]
            if need_dw:
                _gemm(dyi, xs[i, gi * cg:(gi + 1) * cg], dw[gi * og:(gi + 1) * og],
                      trans_b=True, beta=1.0 if i else 0.0)
            if dxs is not None:
                _gemm(w2[gi * og:(gi + 1) * og], dyi, dxs[i, gi * cg:(gi + 1) * cg],
                      trans_a=True)
    return None if dw is None else dw.reshape(w.shape)


def _deconv_geom_shape(x_shape, w, stride, pad, dilation, group):
    nd = len(x_shape) - 2
    kernel = w.shape[2:]
    stride = _tuple(stride, nd, "stride")
    pad = _tuple(pad, nd, "pad")
    dilation = _tuple(dilation, nd, "dilation")
    out = tuple(s * (i - 1) + d * (k - 1) + 1 - 2 * p
                for i, k, s, p, d in zip(x_shape[2:], kernel, stride, pad, dilation))
    if min(out, default=1) < 1:
        raise ValueError(f"deconvolution output would be empty: input {tuple(x_shape[2:])}")
    return (x_shape[0], w.shape[1] * group) + out


def deconv_forward(x, w, b, stride, pad, dilation, group, out=None):
    """Caffe Deconvolution: x (N, Cin, *S), w (Cin, Cout//group, *K), b (Cout,).

    With ``out`` the result is written there and returned.
    """
    x = np.asarray(x)
    w = np.asarray(w)
    _check(x, w, group, "deconv_forward")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"deconv_forward: input has {x.shape[1]} channels, weights expect "
                         f"{w.shape[0]}")
    dt = _dtype(x, w, b)
    y_shape = _deconv_geom_shape(x.shape, w, stride, pad, dilation, group)
    y, final = _target(out, y_shape, dt, "deconv_forward")
    _conv_backward(x.astype(dt, copy=False), None, y_shape, w.astype(dt, copy=False),
                   stride, pad, dilation, group, True, False, False, dt, y)
    if b is not None:
        y += np.asarray(b, dt).reshape(_bias_shape(len(y_shape) - 2))
    return _deliver(y, final)


def deconv_backward(dy, x, w, stride, pad, dilation, group,
                    need_dx=True, need_dw=True, need_db=True, dx_out=None):
    """Gradients of deconv_forward: (dx or None, dw or None, db or None)."""
    dy = np.asarray(dy)
    x = np.asarray(x)
    w = np.asarray(w)
    dt = _dtype(dy, x, w)
    dy = dy.astype(dt, copy=False)
    x = x.astype(dt, copy=False)
    w = w.astype(dt, copy=False)
    db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)), dtype=dt) if need_db else None
    dx = conv_forward(dy, w, None, stride, pad, dilation, group, out=dx_out) \
        if need_dx else None
    dw = None
    if need_dw:
        _, dw, _ = _conv_backward(x, dy, dy.shape, w, stride, pad, dilation, group,
                                  False, True, False, dt)
    return dx, dw, db


def im2col(x, kernel, stride, pad, dilation):
    """Caffe's Im2col layer: (N, C, *S) -> (N, C*prod(K), *S_out), rows ordered (c, *k)."""
    x = np.asarray(x)
    nd = x.ndim - 2
    g = _geom(x.shape[2:], _tuple(kernel, nd, "kernel"), stride, pad, dilation)
    n, c = x.shape[:2]
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
    g = _geom(x_shape[2:], _tuple(kernel, nd, "kernel"), stride, pad, dilation)
    n, c = x_shape[:2]
    cv = cols.reshape((n, c) + g.kernel + g.out)
    xp = np.zeros((n, c) + tuple(i + 2 * p for i, p in zip(g.in_sp, g.pad)), cols.dtype)
    for kidx in itertools.product(*[range(k) for k in g.kernel]):
        dst = tuple(slice(i * d, i * d + (o - 1) * s + 1, s)
                    for i, d, s, o in zip(kidx, g.dilation, g.stride, g.out))
        xp[(slice(None), slice(None)) + dst] += cv[(slice(None), slice(None)) + kidx]
    return np.ascontiguousarray(
        xp[(slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(g.pad, g.in_sp))])
