"""The band engine: im2col for small 2-D images with few channels (e.g. CIFAR-sized layers).

Columns span a whole batch of images, so GEMMs are long however small the image; only the kw
column taps are gathered from x, and the kh row taps are row-shifted views of (or block copies
from) that buffer (see ``_BandPlan``). dx is the same path run on dy with flipped kernels.
Blocks run side by side as in the im2col engine.
"""
import math

import numpy as np

from caffepar.nn.blas import blas_threads, run_parts, scratch, split_parts
from caffepar.nn.blas import gemm_views as _gemm
from caffepar.nn.conv import cols, geometry

#: Layers with Cg * kw below this fold all taps into one deep GEMM.
BAND_FOLD_ALL = 64
#: Bound on the band path's column block.
BAND_BYTES = 8 << 20


def applicable(g, group):
    """Band im2col needs 2-D images, one group and unit row stride."""
    return g.nd == 2 and group == 1 and g.stride[0] == 1


def usable(g, group):
    """The rule: band im2col for small 2-D images (large ones are better off with a GEMM per
    image written straight into y)."""
    return applicable(g, group) and math.prod(g.out) < cols.COLS_DIRECT_MIN


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
        shares = min(workers, geometry.MAX_SHARES)
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
    taps = scratch("btaps", (plan.k, _padded_ld(span, dt.itemsize)), dt)
    deep = None
    if plan.fold_all:
        # A last row of ones carries the bias (forward) and gives db (backward).
        deep = scratch("bcols", (plan.depth + 1, _padded_ld(plan.rows * plan.nb * plan.wo,
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


def forward(g, x, w, bias, y, dt):
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
        yb = scratch("bout", (o, _padded_ld(plan.rows * plan.nb * plan.wo, dt.itemsize)), dt)
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


def backward(g, dy, x, w, need_db, dt):
    """(dw, db or None) through the same blocks as forward; the blocks' dw is summed in
    up to SUM_PARTS runs of blocks, added in block order."""
    n = x.shape[0]
    o = w.shape[0]
    workers = blas_threads()
    plan = _BandPlan(g, n, x.shape[1], dt.itemsize, workers)
    sum_db = need_db and not plan.fold_all

    def run(blocks):
        taps, deep = _band_buffers(plan, dt)
        dyb = scratch("bout", (o, _padded_ld(plan.rows * plan.nb * plan.wo, dt.itemsize)), dt)
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

    parts = run_parts(run, split_parts(plan.blocks(g, n), geometry.SUM_PARTS), workers)
    dwb, db = parts[0]
    for part_dw, part_db in parts[1:]:
        dwb += part_dw
        if sum_db:
            db += part_db
    if need_db and plan.fold_all:
        db = dwb[0, :, -1].copy()
    return _band_dw(dwb, plan, w.shape), db

