"""The grid engine: per-tap GEMMs on a flat grid, for layers with many channels.

The padded input of a chunk of images is laid out channel-major as ``(C, phases, images, *Q)``
and flattened per channel (``geometry.gather``). A stride-1 axis has one phase; a stride-s axis
is split into its s polyphase components, which turns every kernel tap into a *unit-stride*
shifted view of that buffer. The output over the grid is the sum over taps of
``W_tap @ B[:, off:off+L]`` with operands that BLAS reads in place (leading dimension = row
length), accumulated with beta=1: no im2col at all. Grid cells outside the real output are
garbage, dropped when the result is copied back to NCHW. One input channel per group
(depthwise) uses elementwise multiply-adds instead of 1-row GEMMs.
"""
import math

import numpy as np

from caffepar.nn.blas import gemm_views as _gemm
from caffepar.nn.blas import scratch
from caffepar.nn.conv.geometry import gather, grid_view, scatter_add, workspace_chunk

#: Per-tap GEMMs span max(BLOCK_MIN_COLS, BLOCK_BYTES / row bytes) grid
#: columns: wide, as BLAS call and thread start-up costs outweigh caching.
BLOCK_BYTES = 16 << 20
BLOCK_MIN_COLS = 8192


def forward(g, x, w, bias, y, group, dt):
    """y = conv(x, w) + bias, a workspace chunk of images at a time."""
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    wt = _tap_weights(w, group)
    per_image = (c * len(g.phases) + o) * g.qsize * dt.itemsize
    nc = workspace_chunk(per_image, n)
    for n0 in range(0, n, nc):
        m = min(nc, n - n0)
        buf = gather(g, x[n0:n0 + m], dt)
        ybuf = scratch("ybuf", (o, m * g.qsize), dt)
        _grid_forward(g, buf, wt, ybuf, m, group, cg, og)
        del buf
        yv = grid_view(g, ybuf, m)
        if bias is None:
            np.copyto(y[n0:n0 + m], yv)
        else:
            np.add(yv, bias.reshape((1, -1) + (1,) * g.nd), out=y[n0:n0 + m])


def backward(g, dy, x, w, dx, group, need_dw, dt):
    """dw (or None), and dx accumulated into the given (zeroed or fully covered) dx."""
    n, o = dy.shape[:2]
    cg = w.shape[1]
    c = cg * group
    og = o // group
    need_dx = dx is not None
    wt = _tap_weights(w, group)
    dwt = np.empty((group, g.ntaps, og, cg), dt) if need_dw else None
    planes = c * len(g.phases) * (int(need_dw) + int(need_dx)) + o
    nc = workspace_chunk(planes * g.qsize * dt.itemsize, n)
    for i, n0 in enumerate(range(0, n, nc)):
        m = min(nc, n - n0)
        buf = gather(g, x[n0:n0 + m], dt) if need_dw else None
        dybuf = scratch("ybuf", (o, m * g.qsize), dt)
        _zero_garbage(g, dybuf, m)
        np.copyto(grid_view(g, dybuf, m), dy[n0:n0 + m])
        dbuf = scratch("dbuf", (c, len(g.phases) * m * g.qsize), dt, True) if need_dx else None
        _grid_backward(g, buf, dybuf, dbuf, wt, dwt, m, group, cg, og, first=(i == 0))
        del buf, dybuf
        if need_dx:
            scatter_add(g, dbuf, dx[n0:n0 + m], m)
    if not need_dw:
        return None
    return np.ascontiguousarray(dwt.transpose(0, 2, 3, 1)).reshape(w.shape)


def _zero_garbage(g, buf, nc):
    """Zero the grid cells outside the real output (each axis' tail)."""
    v = buf[:, :nc * g.qsize].reshape((buf.shape[0], nc) + g.q)
    for a, (q, o) in enumerate(zip(g.q, g.out)):
        if q > o:
            v[(slice(None),) * (2 + a) + (slice(o, None),)] = 0


def _col_block(rows_bytes):
    return int(max(BLOCK_MIN_COLS, BLOCK_BYTES // max(rows_bytes, 1)))


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

