"""Pooling and SPP (spatial pyramid pooling), with Caffe's output-size and window-clipping rules.

NumPy is fast on long contiguous runs and slow on strided ones, so the input is first split, a
block of channel planes at a time, into its stride phases (phase (a, b) holds the padded-frame
cells (a + r * stride_h, b + c * stride_w)). In that layout every kernel offset is one
contiguous 1-D slice at a fixed offset, and the per-offset loop runs on whole blocks sized to stay
in cache. Cells a window reaches outside the image hold the fill value (-inf for MAX, 0 for
AVE), set once when a block buffer is made. The blocks are independent, so they are spread over
the process's cores (`run_parts`), each thread with its own block buffers.

With the compiled kernels (`caffepar.nn.native`) the same phase layout is made one plane at a
time, so it stays in cache (stride-2 rows split by vector permutes, the cells outside the image
filled once per call), a run of planes per call, the runs side by side; they keep the NumPy
code's winner layout and order of sums (for MAX's backward, Caffe's order).
"""
import math
import threading
from functools import partial

import numpy as np

from caffepar.nn import native
from caffepar.nn.base import Layer, register
from caffepar.nn.blas import blas_threads, run_parts, split_parts
from caffepar.nn.neuron import relu_backward, relu_forward
from caffepar.nn.prepared import kernel_call, view_as
from caffepar.proto import caffe_pb2

PP = caffe_pb2.PoolingParameter
NEG_FLT_MAX = -float(np.finfo(np.float32).max)
BLOCK_BYTES = 1 << 21
#: A prepared pooling over fewer input bytes runs on one thread (handing parts to the others
#: costs more than they save).
ONE_THREAD_BYTES = 1 << 17


def pooled_size(size, kernel, pad, stride, ceil_mode=True, padded=None):
    """Caffe's output extent: ceil (or floor) division, then, when the layer pads at all (either
    axis: `padded`, else this axis's pad), drop a last window that would start in the
    bottom/right padding (or past the image, when this axis has no pad)."""
    span = float(np.float32(size + 2 * pad - kernel) / np.float32(stride))
    out = (math.ceil(span) if ceil_mode else math.floor(span)) + 1
    if (pad if padded is None else padded) and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _index_dtype(n):
    return np.int8 if n < 127 else np.int16 if n < 32767 else np.int32


def _phase_span(a, stride, pad, size, n):
    """The phase rows of phase `a` that hold image rows, and those image rows."""
    r0 = max(0, -((a - pad) // stride))
    r1 = max(r0, min(n, (size - 1 + pad - a) // stride + 1))
    if r1 == r0:
        return slice(0, 0), slice(0, 0)
    i0 = a + r0 * stride - pad
    return slice(r0, r1), slice(i0, i0 + (r1 - r0 - 1) * stride + 1, stride)


class PoolGeometry:
    """Kernel, pad, stride and output size along the two spatial axes, and the phase layout."""

    def __init__(self, kh, kw, ph, pw, sh, sw, ceil_mode=True):
        self.kh, self.kw, self.ph, self.pw, self.sh, self.sw = kh, kw, ph, pw, sh, sw
        self.ceil_mode = ceil_mode

    def reshape(self, h, w):
        """Work out the layout for an h x w input; a repeat of the last size keeps the block
        buffers (nets reshape every layer before each forward)."""
        key = (h, w, self.kh, self.kw)
        if getattr(self, "_key", None) == key:
            return
        self._key = key
        self.h, self.w = h, w
        padded = bool(self.ph or self.pw)
        self.oh = pooled_size(h, self.kh, self.ph, self.sh, self.ceil_mode, padded)
        self.ow = pooled_size(w, self.kw, self.pw, self.sw, self.ceil_mode, padded)
        self.rows = self.oh + (self.kh - 1) // self.sh
        self.cols = self.ow + (self.kw - 1) // self.sw
        self.span = self.rows * self.cols
        self.direct = self.rows == self.oh and self.cols == self.ow
        phases = [(a, b) for a in range(min(self.sh, self.kh))
                  for b in range(min(self.sw, self.kw))]
        self.fills = []
        covered_h = covered_w = 0
        for a, b in phases:
            rs, xr = _phase_span(a, self.sh, self.ph, h, self.rows)
            cs, xc = _phase_span(b, self.sw, self.pw, w, self.cols)
            self.fills.append((rs, cs, xr, xc))
            covered_h += (rs.stop - rs.start) * (b == 0)
            covered_w += (cs.stop - cs.start) * (a == 0)
        self.covers = covered_h == h and covered_w == w
        self.taps = [(i * self.kw + j, phases.index((i % self.sh, j % self.sw)),
                      (i // self.sh) * self.cols + j // self.sw, i < self.sh and j < self.sw)
                     for i in range(self.kh) for j in range(self.kw)]
        self.max_offset = max(t[2] for t in self.taps)
        self.block = max(1, BLOCK_BYTES // (4 * self.span * (len(phases) + 2)))
        self._buffers = {}

    def buffers(self, kind, dtype, fill):
        """Per-block scratch, made once: the phases (fill outside the image), then in the padded
        output layout a zeroed float buffer, a boolean mask, and float and index temporaries."""
        key = (kind, np.dtype(dtype), fill, threading.get_ident())
        if key not in self._buffers:
            shape = (self.block, self.rows, self.cols)
            self._buffers[key] = (np.full((len(self.fills),) + shape, fill, dtype),
                                  np.zeros(shape, dtype), np.empty(shape, bool),
                                  np.empty(shape, dtype),
                                  np.empty(shape, _index_dtype(self.kh * self.kw)))
        return self._buffers[key]

    def blocks(self, n_planes, workers=1):
        """(first, end) plane of each block: at most `block` planes, in a multiple of `workers`
        blocks where there are planes enough."""
        count = -(-n_planes // self.block)
        size = -(-n_planes // max(1, min(n_planes, -(-count // workers) * workers)))
        return [(p0, min(n_planes, p0 + size)) for p0 in range(0, n_planes, size)]

    def run(self, fn, n_planes):
        """fn(blocks) over this layer's blocks, spread over the cores."""
        workers = blas_threads()
        run_parts(fn, split_parts(self.blocks(n_planes, workers)), workers)

    def run_native(self, kernel, arrays, n_planes, extra=(), after=None):
        """A compiled kernel over runs of planes side by side; `arrays` are C-contiguous with
        planes first. Returns the sum of the kernel's results (negative: out of memory).
        after(p0, p1), if given, follows the kernel on each run of planes (a folded ReLU)."""
        dims = (self.h, self.w, self.oh, self.ow, self.kh, self.kw, self.sh, self.sw,
                self.ph, self.pw) + tuple(extra)
        bases = [(native.ptr(a), a.strides[0]) for a in arrays]

        def run(runs):
            done = 0
            for p0, p1 in runs:
                done += kernel(*[b + p0 * s for b, s in bases], p1 - p0, *dims)
                if after is not None:
                    after(p0, p1)
            return done

        workers = blas_threads()
        runs = [(p[0], p[-1] + 1) for p in split_parts(range(n_planes), 4 * workers)] \
            if workers > 1 else [(0, n_planes)]
        results = run_parts(run, split_parts(runs), workers)
        if min(results) < 0:
            raise MemoryError("pooling: no memory for a work buffer")
        return sum(results)

    def split(self, phases, xb):
        """Copy a block of image planes into its phases."""
        for p, (rs, cs, xr, xc) in enumerate(self.fills):
            phases[p, :len(xb), rs, cs] = xb[:, xr, xc]

    def merge(self, grads, dxb):
        """Gather phase gradients back into a block of image planes (cells no window reaches
        get zero)."""
        if not self.covers:
            dxb.fill(0)
        for p, (rs, cs, xr, xc) in enumerate(self.fills):
            dxb[:, xr, xc] = grads[p, :len(dxb), rs, cs]

    def planes(self, a, h, w):
        return a.reshape(-1, h, w)

    def compact(self, arg, shape):
        """The (N, C, OH, OW) view of a padded-layout array."""
        return arg[:, :self.oh, :self.ow].reshape(shape)

    def ave_divisor(self, dtype):
        """Caffe's AVE pool_size: the window clipped to H + pad (padding counts, overhang not)."""
        def extent(o, k, p, s, size):
            start = np.arange(o) * s - p
            return np.minimum(start + k, size + p) - start
        dh = extent(self.oh, self.kh, self.ph, self.sh, self.h)
        dw = extent(self.ow, self.kw, self.pw, self.sw, self.w)
        return np.outer(dh, dw).astype(dtype)


def _kernels(a, b):
    """The compiled kernels for a pair of same-dtype C-contiguous arrays, or None."""
    if a.dtype != b.dtype or not (a.flags.c_contiguous and b.flags.c_contiguous):
        return None
    return native.kernels(a.dtype)


def _relu_on_planes(k, y3, slope):
    """after(p0, p1) for run_native: a folded ReLU's forward on planes p0 .. p1 of y3, in
    place (None without a ReLU)."""
    if slope is None:
        return None
    base, stride, size = native.ptr(y3), y3.strides[0], y3[0].size
    return lambda p0, p1: k.relu_forward(base + p0 * stride, base + p0 * stride,
                                         (p1 - p0) * size, slope)


def _relu_diff_on_planes(k, g, gate, dx3, slope):
    """after(p0, p1) for run_native: a folded ReLU's backward on planes p0 .. p1 of dx3 in
    place, gate (the bottom's shape) holding the ReLU's output (None without a ReLU)."""
    if slope is None:
        return None
    gate3 = g.planes(gate, g.h, g.w)
    if gate3.dtype != dx3.dtype or not gate3.flags.c_contiguous:
        gate3 = np.ascontiguousarray(gate3, dx3.dtype)
    gate, base = native.ptr(gate3), native.ptr(dx3)
    gs, ds, size = gate3.strides[0], dx3.strides[0], dx3[0].size
    return lambda p0, p1: k.relu_backward(gate + p0 * gs, base + p0 * ds, base + p0 * ds,
                                          (p1 - p0) * size, slope)


def max_pool_forward(g, x, out, relu=None):
    """Max pooling into `out`; returns the winning kernel offset per output (-1: none) in the
    padded (planes, rows, cols) layout that max_pool_backward reads (g.compact gives the
    (N, C, OH, OW) view). Like Caffe's strict '>' scan from -FLT_MAX: NaNs never win and ties
    keep the first cell in row-major window order. Offsets grow along the scan, so the last
    strict improvement is the largest offset that improved: arg = max_k(k * improved_k).
    With relu (a negative_slope), a folded ReLU follows on `out`."""
    x3, y3 = g.planes(x, g.h, g.w), g.planes(out, g.oh, g.ow)
    args = np.empty((len(x3), g.rows, g.cols), _index_dtype(g.kh * g.kw))
    k = _kernels(x, out)
    if k is not None:
        g.run_native(k.max_pool_forward, (x3, y3, args), len(x3),
                     (g.rows, g.cols, args.itemsize), _relu_on_planes(k, y3, relu))
        return args

    def run(blocks):
        phases, best, hit, _, step = g.buffers("max", x.dtype, -np.inf)
        flat = phases.reshape(len(phases), -1)
        for p0, p1 in blocks:
            n = p1 - p0
            g.split(phases, x3[p0:p1])
            size = n * g.span - g.max_offset
            o = y3[p0:p1].reshape(-1) if g.direct else best.reshape(-1)[:size]
            a = args[p0:p1].reshape(-1)[:size]
            m, t = hit.reshape(-1)[:size], step.reshape(-1)[:size]
            if t.dtype == np.int8:
                t = src = m.view(np.int8)
            else:
                src = m
            for k, p, off, _ in g.taps:
                v = flat[p, off:off + size]
                if k == 0:
                    np.fmax(v, NEG_FLT_MAX, out=o)
                    a.fill(0)
                    continue
                np.greater(v, o, out=m)
                np.copyto(o, v, where=m)    # the winner's own value: fmax may pick either zero
                np.multiply(src, t.dtype.type(k), out=t)
                np.maximum(a, t, out=a)
            if not g.direct:
                y3[p0:p1] = best[:n, :g.oh, :g.ow]

    g.run(run, len(x3))
    none = out == NEG_FLT_MAX
    if none.any():
        np.copyto(g.compact(args, out.shape), -1, where=none)
    if relu is not None:
        relu_forward(out, out, relu)
    return args


def _step_dims(g, arg=None):
    """An image step's geometry arguments (h .. cols), then the winners' index size."""
    dims = (g.h, g.w, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.rows, g.cols)
    return dims if arg is None else dims + (arg.itemsize,)


def max_pool_forward_step(g, x, out, relu, run):
    """(step, winners): max_pool_forward as a native.ImageStep on runs of whole images of x
    (N, C, H, W), whose `run` (the pass over the whole batch, where the kernels cannot take
    the step) must fill the same winners; the winners as max_pool_forward returns them, each
    image's filled as the step runs on it."""
    n, c = x.shape[:2]
    arg = np.empty((n * c, g.rows, g.cols), _index_dtype(g.kh * g.kw))
    k = _kernels(x, out)
    if k is None or x.ndim != 4:
        return native.ImageStep(None, (), native.ptr(x), run), arg
    slope = np.float64(0.0 if relu is None else relu).view(np.int64)
    args = (native.ptr(x), native.ptr(out), native.ptr(arg), x.strides[0], out.strides[0],
            c * arg.strides[0], c) + _step_dims(g, arg) + (int(relu is not None), slope)
    return native.ImageStep(k.steps["max_pool_forward_images"], args, native.ptr(x), run), arg


def ave_pool_forward_step(g, x, out, relu, run):
    """ave_pool_forward as a native.ImageStep on runs of whole images of x (N, C, H, W); `run`
    the pass over the whole batch, where the kernels cannot take it."""
    k = _kernels(x, out)
    if k is None or x.ndim != 4:
        return native.ImageStep(None, (), native.ptr(x), run)
    slope = np.float64(0.0 if relu is None else relu).view(np.int64)
    args = (native.ptr(x), native.ptr(out), x.strides[0], out.strides[0],
            x.shape[1]) + _step_dims(g) + (int(relu is not None), slope)
    return native.ImageStep(k.steps["ave_pool_forward_images"], args, native.ptr(x), run)


def max_pool_backward_step(g, arg, dy, dx, run):
    """max_pool_backward (no ReLU folded) as a native.ImageStep on runs of whole images of dx
    (N, C, H, W); `run` the pass over the whole batch, where the kernels cannot take it."""
    k = _kernels(dy, dx)
    if k is None or dx.ndim != 4:
        return native.ImageStep(None, (), native.ptr(dx), run)
    c = dx.shape[1]
    args = (native.ptr(dy), native.ptr(dx), native.ptr(arg), dy.strides[0], dx.strides[0],
            c * arg.strides[0], c) + _step_dims(g, arg)
    return native.ImageStep(
        k.steps["max_pool_backward_images"], args, native.ptr(dx), run,
        lambda: _scatter_unassigned(g.compact(arg, dy.shape) < 0, dy, dx))


def max_pool_mask(g, arg):
    """The flat index h * W + w of each winner inside its (unpadded) channel plane, -1 if none;
    `arg` in the (N, C, OH, OW) layout."""
    oi = np.arange(g.oh)[:, None] * g.sh - g.ph
    oj = np.arange(g.ow)[None, :] * g.sw - g.pw
    a = arg.astype(np.int64)
    idx = (oi + a // g.kw) * g.w + oj + a % g.kw
    return np.where(arg < 0, -1, idx)


def max_pool_backward(g, arg, dy, dx, relu=None, gate=None):
    """Route dy to the winners; `arg` as max_pool_forward returned it. As Caffe's loop does: dx
    from +0, each dy added to its winner only (selected, its bits and not its value multiplied
    by the winner mask: a NaN dy reaches no other cell), and a cell winning several windows
    adds them in Caffe's window order, which is the reverse of the kernel-offset order (a later
    window along an axis holds the cell at an earlier offset). The +0 added for the windows a
    cell did not win changes no sum that starts from +0. With relu (a negative_slope of 0:
    applied twice where windows have no winner), a folded ReLU's backward follows on dx, gate
    holding its output."""
    dy3, dx3 = g.planes(dy, g.oh, g.ow), g.planes(dx, g.h, g.w)
    k = _kernels(dy, dx)
    if k is not None:
        after = _relu_diff_on_planes(k, g, gate, dx3, relu)
        if g.run_native(k.max_pool_backward, (dy3, dx3, arg), len(dx3),
                        (g.rows, g.cols, arg.itemsize), after):
            _scatter_unassigned(g.compact(arg, dy.shape) < 0, dy, dx)
            if relu is not None:
                relu_backward(gate, dx, dx, relu)
        return

    bits = np.dtype(f"u{dx.dtype.itemsize}")

    def run(blocks):
        grads, dys, hit, tmp, _ = g.buffers("max_grad", dx.dtype, 0)
        flat = grads.reshape(len(grads), -1)
        for p0, p1 in blocks:
            n = p1 - p0
            size = n * g.span - g.max_offset
            # +0 + dy, Caffe's first add to a cell (a -0 dy becomes +0), so the first tap of a
            # phase can set the cells it reaches and the rest add to them
            np.add(dy3[p0:p1], 0, out=dys[:n, :g.oh, :g.ow])
            d = dys.reshape(-1)[:size].view(bits)
            a = arg[p0:p1].reshape(-1)[:size]
            m, t = hit.reshape(-1)[:size], tmp.reshape(-1)[:size]
            started = set()
            for k, p, off, _ in reversed(g.taps):
                # dy where the tap won, +0 elsewhere: dy's bits times the 0/1 winner mask, a
                # select at the speed of the float product, which would make NaN * 0 a NaN
                np.equal(a, k, out=m)
                if p in started:
                    np.multiply(d, m, out=t.view(bits))
                    flat[p, off:off + size] += t
                    continue
                started.add(p)
                np.multiply(d, m, out=flat[p, off:off + size].view(bits))
                flat[p, :off] = 0
                flat[p, off + size:n * g.span] = 0
            g.merge(grads, dx3[p0:p1])

    g.run(run, len(dx3))
    none = g.compact(arg, dy.shape) < 0
    if none.any():
        _scatter_unassigned(none, dy, dx)
    if relu is not None:
        relu_backward(gate, dx, dx, relu)


def _scatter_unassigned(none, dy, dx):
    """A window without a winner has Caffe index -1, which lands on the last cell of the
    previous channel plane (nothing for the very first plane), added one by one in window order
    after that plane's own (np.add.at adds in index order)."""
    windows = np.flatnonzero(none)
    plane = windows // (none.size // (dx.shape[0] * dx.shape[1]))
    windows = windows[plane > 0]
    cells = plane[plane > 0] * (dx.shape[2] * dx.shape[3]) - 1
    np.add.at(dx.reshape(-1), cells, dy.reshape(-1)[windows])


def max_pool_backward_from_mask(g, mask, dy, dx):
    """Scatter through an explicit mask top (flat h * W + w per plane), as Caffe does: from +0,
    each dy added to its cell in window order and in dx's dtype (np.add.at adds in index
    order)."""
    planes = dx.shape[0] * dx.shape[1]
    m = mask.reshape(planes, -1).astype(np.int64)
    base = (np.arange(planes) * g.h * g.w)[:, None]
    flat = (m + base).reshape(-1)
    ok = flat >= 0
    acc = np.zeros(dx.size, dx.dtype)
    np.add.at(acc, flat[ok], dy.reshape(-1)[ok])
    dx[...] = acc.reshape(dx.shape)


def global_max_forward(x, y):
    """MAX over each whole plane as Caffe's scan: the first cell above -FLT_MAX that is largest
    (NaN never wins); a plane with none gives -FLT_MAX and winner -1. Returns the winners'
    flat indices, shaped as y."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    v = np.where(flat > NEG_FLT_MAX, flat, -np.inf)
    arg = v.argmax(axis=2)
    best = np.take_along_axis(v, arg[..., None], 2)[..., 0]
    none = best == -np.inf
    y.reshape(best.shape)[...] = np.where(none, NEG_FLT_MAX, best)
    arg[none] = -1
    return arg.reshape(y.shape).astype(np.int32)


def global_max_backward(arg, dy, dx):
    """dx = +0, then +0 + dy on each plane's winner (Caffe's one add: a -0 dy gives +0)."""
    dx[...] = 0
    planes = dx.shape[0] * dx.shape[1]
    flat = dx.reshape(planes, -1)
    a = arg.reshape(planes, 1)
    np.put_along_axis(flat, np.maximum(a, 0), np.where(a < 0, 0, dy.reshape(planes, 1) + 0), 1)
    none = arg < 0
    if none.any():
        _scatter_unassigned(none, dy, dx)


def ave_pool_forward(g, x, out, relu=None):
    """Average pooling into `out`, then a folded ReLU of negative_slope relu if given."""
    x3, y3 = g.planes(x, g.h, g.w), g.planes(out, g.oh, g.ow)
    k = _kernels(x, out)
    if k is not None:
        g.run_native(k.ave_pool_forward, (x3, y3), len(x3), (g.rows, g.cols),
                     _relu_on_planes(k, y3, relu))
        return
    divisor = g.ave_divisor(out.dtype)

    def run(blocks):
        phases, total = g.buffers("ave", x.dtype, 0)[:2]
        flat = phases.reshape(len(phases), -1)
        for p0, p1 in blocks:
            n = p1 - p0
            g.split(phases, x3[p0:p1])
            size = n * g.span - g.max_offset
            o = total.reshape(-1)[:size]
            for k, p, off, _ in g.taps:
                if k == 0:
                    np.copyto(o, flat[p, off:off + size])
                else:
                    o += flat[p, off:off + size]
            np.divide(total[:n, :g.oh, :g.ow], divisor, out=y3[p0:p1])

    g.run(run, len(x3))
    if relu is not None:
        relu_forward(out, out, relu)


def ave_pool_backward(g, dy, dx, relu=None, gate=None):
    """dy spread over the windows into dx, then with relu a folded ReLU's backward on dx, gate
    holding its output."""
    dy3, dx3 = g.planes(dy, g.oh, g.ow), g.planes(dx, g.h, g.w)
    k = _kernels(dy, dx)
    if k is not None:
        after = _relu_diff_on_planes(k, g, gate, dx3, relu)
        g.run_native(k.ave_pool_backward, (dy3, dx3), len(dx3), (g.rows, g.cols), after)
        return
    divisor = g.ave_divisor(dx.dtype)

    def run(blocks):
        grads, dys = g.buffers("ave_grad", dx.dtype, 0)[:2]
        flat = grads.reshape(len(grads), -1)
        for p0, p1 in blocks:
            n = p1 - p0
            np.divide(dy3[p0:p1], divisor, out=dys[:n, :g.oh, :g.ow])
            size = n * g.span - g.max_offset
            d = dys.reshape(-1)[:size]
            for k, p, off, first in g.taps:
                if first:           # +0 + d: Caffe's sum starts at +0 (-0 alone gives +0)
                    np.add(d, 0, out=flat[p, :size])
                    flat[p, size:n * g.span] = 0
                else:
                    flat[p, off:off + size] += d
            g.merge(grads, dx3[p0:p1])

    g.run(run, len(dx3))
    if relu is not None:
        relu_backward(gate, dx, dx, relu)


@register("Pooling")
class PoolingLayer(Layer):
    """MAX (optional second top: argmax mask), AVE; STOCHASTIC has no CPU implementation in
    Caffe and is refused."""

    exact_bottoms = 1
    min_tops = 1
    max_tops = 2

    def layer_setup(self, bottom, top):
        p = self.param.pooling_param
        self.method = p.pool
        if self.method not in (PP.MAX, PP.AVE, PP.STOCHASTIC):
            raise self.error(f"unknown pooling method {self.method}")
        if len(top) > 1 and self.method != PP.MAX:
            raise self.error(f"only MAX pooling can output a mask top, got {len(top)} tops")
        self.global_pooling = p.global_pooling
        has_k = p.HasField("kernel_size")
        has_hw = p.HasField("kernel_h") and p.HasField("kernel_w")
        if self.global_pooling:
            if has_k or p.HasField("kernel_h") or p.HasField("kernel_w"):
                raise self.error("with global_pooling: true the filter size cannot be specified")
        else:
            if has_k and (p.HasField("kernel_h") or p.HasField("kernel_w")):
                raise self.error("filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not has_k and not has_hw:
                raise self.error("for non-square filters both kernel_h and kernel_w are required")
        if p.HasField("pad") and (p.HasField("pad_h") or p.HasField("pad_w")) or \
                p.HasField("pad_h") != p.HasField("pad_w"):
            raise self.error("pad is pad OR pad_h and pad_w are required")
        if p.HasField("stride") and (p.HasField("stride_h") or p.HasField("stride_w")) or \
                p.HasField("stride_h") != p.HasField("stride_w"):
            raise self.error("stride is stride OR stride_h and stride_w are required")
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got shape "
                             f"{bottom[0].shape}")
        if self.global_pooling:
            kh, kw = bottom[0].shape[2], bottom[0].shape[3]
        elif has_k:
            kh = kw = p.kernel_size
        else:
            kh, kw = p.kernel_h, p.kernel_w
        if kh <= 0 or kw <= 0:
            raise self.error(f"filter dimensions cannot be zero, got {kh}x{kw}")
        ph, pw = (p.pad_h, p.pad_w) if p.HasField("pad_h") else (p.pad, p.pad)
        sh, sw = (p.stride_h, p.stride_w) if p.HasField("stride_h") else (p.stride, p.stride)
        if sh <= 0 or sw <= 0:
            raise self.error(f"stride must be > 0, got {sh}x{sw}")
        if self.global_pooling and (ph or pw or sh != 1 or sw != 1):
            raise self.error("with global_pooling: true only pad = 0 and stride = 1 are allowed")
        if (ph or pw) and self.method == PP.STOCHASTIC:
            raise self.error("padding is implemented only for average and max pooling")
        if (ph or pw) and (ph >= kh or pw >= kw):
            raise self.error(f"pad must be smaller than the kernel, got pad {ph}x{pw} for kernel "
                             f"{kh}x{kw}")
        if p.HasField("ceil_mode") and p.HasField("round_mode"):
            raise self.error("sets both ceil_mode (a field of Caffe forks) and round_mode "
                             "(BVLC Caffe's); give one")
        ceil = p.ceil_mode if p.HasField("ceil_mode") else p.round_mode == PP.CEIL
        self.geom = PoolGeometry(kh, kw, ph, pw, sh, sw, ceil)

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got shape "
                             f"{bottom[0].shape}")
        n, c, h, w = bottom[0].shape
        g = self.geom
        if self.global_pooling:
            g.kh, g.kw = h, w
        g.reshape(h, w)
        if g.oh <= 0 or g.ow <= 0:
            raise self.error(f"kernel {g.kh}x{g.kw} with pad {g.ph}x{g.pw} does not fit the "
                             f"{h}x{w} input")
        top[0].reshape((n, c, g.oh, g.ow))
        if len(top) > 1:
            top[1].reshape((n, c, g.oh, g.ow))
        self.arg = None

    def forward(self, bottom, top):
        g = self.geom
        x, y = bottom[0].data, top[0].data
        if self.method == PP.STOCHASTIC:
            raise self.error("STOCHASTIC pooling is not implemented on the CPU (as in Caffe)")
        if self.method == PP.MAX:
            if self.global_pooling:
                self.arg = global_max_forward(x, y)
            else:
                self.arg = max_pool_forward(g, x, y, self.relu_top)
            if len(top) > 1:
                arg = self.arg if self.global_pooling else g.compact(self.arg, y.shape)
                top[1].data[...] = max_pool_mask(g, arg)
        elif self.global_pooling:
            y.reshape(y.shape[:2])[...] = x.mean(axis=(2, 3))
        else:
            ave_pool_forward(g, x, y, self.relu_top)

    def prepare_forward(self, bottom, top):
        """MAX and AVE with one top on the compiled kernels, their arguments made once (the
        MAX winners go to a buffer of the call's own: a plan runs no backward); a global AVE
        as one mean."""
        if len(top) > 1 or self.method not in (PP.MAX, PP.AVE):
            return None
        g, x, y = self.geom, bottom[0].data, top[0].data
        if self.global_pooling:
            x3, y2 = view_as(x, x.shape[:2] + (-1,)), view_as(y, y.shape[:2])
            if self.method != PP.AVE or x3 is None or y2 is None:
                return None
            return partial(np.mean, x3, axis=2, out=y2)
        k = _kernels(x, y)
        if k is None:
            return None
        x3, y3 = g.planes(x, g.h, g.w), g.planes(y, g.oh, g.ow)
        if self.method == PP.MAX:
            args = np.empty((len(x3), g.rows, g.cols), _index_dtype(g.kh * g.kw))
            kernel, arrays = k.max_pool_forward, (x3, y3, args)
            extra = (g.rows, g.cols, args.itemsize)
        else:
            kernel, arrays, extra = k.ave_pool_forward, (x3, y3), (g.rows, g.cols)
        dims = (g.h, g.w, g.oh, g.ow, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw) + extra
        workers = blas_threads()
        runs = [(p[0], p[-1] + 1) for p in split_parts(range(len(x3)), 4 * workers)] \
            if workers > 1 and x.nbytes > ONE_THREAD_BYTES else [(0, len(x3))]
        calls = [kernel_call(kernel, [a[p0:p1] for a in arrays], p1 - p0, *dims)
                 for p0, p1 in runs]

        def run_one(part):
            return min(call() for call in part)

        if len(calls) == 1:
            call = calls[0]

            def run():
                if call() < 0:
                    raise MemoryError("pooling: no memory for a work buffer")
            return run
        parts = split_parts(calls)

        def run():
            if min(run_parts(run_one, parts, workers)) < 0:
                raise MemoryError("pooling: no memory for a work buffer")
        return run

    def folds_relu(self, top, slope):
        """MAX and AVE pooling, not global: a ReLU after it in forward, or before it in backward
        (for MAX, negative_slope 0 alone: max_pool_backward)."""
        if self.method not in (PP.MAX, PP.AVE) or self.global_pooling:
            return False
        return top or self.method == PP.AVE or slope == 0

    def gives_image_steps(self):
        """MAX and AVE pooling with one top, not global: its passes run on the images of the
        layer before it, as that layer writes them (forward) and, for MAX, just before it
        reads their diff (backward), while they are in cache."""
        return (self.method in (PP.MAX, PP.AVE) and not self.global_pooling
                and len(self.param.top) == 1)

    def image_step(self, bottom, top, forward):
        g = self.geom
        if forward:
            run = lambda: self.forward(bottom, top)     # noqa: E731
            if self.method == PP.AVE:
                return ave_pool_forward_step(g, bottom[0].data, top[0].data, self.relu_top, run)
            step, self.arg = max_pool_forward_step(g, bottom[0].data, top[0].data,
                                                   self.relu_top, run)
            return step
        run = lambda: self.backward(top, [True], bottom)     # noqa: E731
        if self.relu_bottom is not None or self.method == PP.AVE:
            return native.ImageStep(None, (), native.ptr(bottom[0].diff), run)
        return max_pool_backward_step(g, self.arg, top[0].diff, bottom[0].diff, run)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        if self.method == PP.STOCHASTIC:
            raise self.error("STOCHASTIC pooling is not implemented on the CPU (as in Caffe)")
        g = self.geom
        dy, dx = top[0].diff, bottom[0].diff
        if self.method == PP.MAX:
            if len(top) > 1:
                max_pool_backward_from_mask(g, top[1].data, dy, dx)
                if self.relu_bottom is not None:
                    relu_backward(bottom[0].data, dx, dx, self.relu_bottom)
            elif self.global_pooling:
                global_max_backward(self.arg, dy, dx)
            else:
                max_pool_backward(g, self.arg, dy, dx, self.relu_bottom, bottom[0].data)
        elif self.global_pooling:
            dx[...] = (dy / (g.h * g.w)).reshape(dy.shape[0], dy.shape[1], 1, 1)
        else:
            ave_pool_backward(g, dy, dx, self.relu_bottom, bottom[0].data)


def spp_level_geometry(level, h, w):
    """Kernel, pad and stride Caffe's SPP uses for pyramid level `level` (2^level bins)."""
    bins = 2 ** level
    kh = math.ceil(h / bins)
    kw = math.ceil(w / bins)
    ph = (kh * bins - h + 1) // 2
    pw = (kw * bins - w + 1) // 2
    return kh, kw, ph, pw


@register("SPP")
class SPPLayer(Layer):
    """Spatial pyramid pooling: level l pools into 2^l x 2^l bins; levels are flattened and
    concatenated along axis 1 (a single level keeps the pooled (N, C, 1, 1) shape, as Caffe)."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.spp_param
        self.height = p.pyramid_height
        if self.height <= 0:
            raise self.error(f"pyramid_height must be > 0, got {self.height}")
        self.method = {caffe_pb2.SPPParameter.MAX: PP.MAX, caffe_pb2.SPPParameter.AVE: PP.AVE,
                       caffe_pb2.SPPParameter.STOCHASTIC: PP.STOCHASTIC}.get(p.pool)
        if self.method is None:
            raise self.error(f"unknown pooling method {p.pool}")

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got shape "
                             f"{bottom[0].shape}")
        n, c, h, w = bottom[0].shape
        if h <= 0 or w <= 0:
            raise self.error("input dimensions cannot be zero")
        self.levels = []
        total = 0
        for level in range(self.height):
            kh, kw, ph, pw = spp_level_geometry(level, h, w)
            if (ph or pw) and self.method == PP.STOCHASTIC:
                raise self.error("padding is implemented only for average and max pooling")
            if (ph or pw) and (ph >= kh or pw >= kw):
                raise self.error(f"pyramid level {level} needs pad {ph}x{pw} >= kernel {kh}x{kw} "
                                 f"for a {h}x{w} input, which Caffe's pooling refuses")
            g = PoolGeometry(kh, kw, ph, pw, kh, kw)
            g.reshape(h, w)
            self.levels.append(g)
            total += c * g.oh * g.ow
        if self.height == 1:
            g = self.levels[0]
            top[0].reshape((n, c, g.oh, g.ow))
        else:
            top[0].reshape((n, total))
        self.args = [None] * self.height

    def _slices(self, n, c):
        start = 0
        for g in self.levels:
            size = c * g.oh * g.ow
            yield g, slice(start, start + size)
            start += size

    def forward(self, bottom, top):
        if self.method == PP.STOCHASTIC:
            raise self.error("STOCHASTIC pooling is not implemented on the CPU (as in Caffe)")
        x = bottom[0].data
        n, c = x.shape[:2]
        y = top[0].data.reshape(n, -1)
        for k, (g, sl) in enumerate(self._slices(n, c)):
            out = np.empty((n, c, g.oh, g.ow), self.dtype)
            if self.method == PP.MAX:
                self.args[k] = max_pool_forward(g, x, out)
            else:
                ave_pool_forward(g, x, out)
            y[:, sl] = out.reshape(n, -1)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        n, c = dx.shape[:2]
        dy = top[0].diff.reshape(n, -1)
        part = np.empty(dx.shape, dx.dtype)
        for k, (g, sl) in enumerate(self._slices(n, c)):
            d = np.ascontiguousarray(dy[:, sl]).reshape(n, c, g.oh, g.ow)
            if self.method == PP.MAX:
                max_pool_backward(g, self.args[k], d, part)
            else:
                ave_pool_backward(g, d, part)
            if k == 0:
                dx[...] = part
            else:
                dx += part
