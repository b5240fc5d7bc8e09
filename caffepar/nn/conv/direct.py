"""The direct engine: compiled multiply-add kernels with images in the vector lanes, no im2col
and no GEMM (caffepar/nn/native/conv.inc).

A block of VL images (16 floats per 64-byte vector) is packed zero-padded as (C, Hp, Wp, VL);
every tap of every output pixel is then one vector load, and a tile of output channels x output
columns stays in registers through all channels and taps. The kernels are built for the host's
instruction set (AVX-512 where there is one), which a BLAS tuned for another CPU may not use:
this engine does not depend on how well the BLAS knows the CPU. Best with a batch of many
images (lanes past the batch are wasted) and thin layers, where GEMMs are short.

dx is the same forward kernel on dy (packed with the flipped kernel's padding) with flipped
weights, so the engine takes stride-1 layers whose flipped form exists. Work is split in parts
(image block x output rows or channels) run side by side with ``run_parts``; dw is summed per
image block and the blocks' sums are added in block order.
"""
import numpy as np

from caffepar.nn import native
from caffepar.nn.blas import blas_threads, run_parts, split_parts
from caffepar.nn.conv.geometry import flipped_geom, flipped_weights

#: Parts per thread the work is split in (a thread slowed by other load takes fewer).
PARTS_PER_THREAD = 4


def applicable(g, dtype):
    return (g.nd == 2 and g.stride == (1, 1) and flipped_geom(g) is not None
            and native.kernels(dtype) is not None)


class _Blocks:
    """The image blocks of a batch and the parts work on them is cut in."""

    def __init__(self, n, dt):
        self.n, self.dt = n, dt
        self.vl = 64 // dt.itemsize
        self.count = -(-n // self.vl)

    def images(self, b):
        return min(self.vl, self.n - b * self.vl)

    def parts(self, items):
        """(block, first, end) over each block's `items` (rows or channels), cut in pieces
        enough for every thread to take several."""
        want = PARTS_PER_THREAD * blas_threads()
        pieces = max(1, min(items, -(-want // self.count)))
        return [(b, r[0], r[-1] + 1) for b in range(self.count)
                for r in split_parts(range(items), pieces)]


def _run(fn, parts):
    run_parts(lambda part: [fn(*p) for p in part], split_parts(parts))


def _pack(k, blocks, a, first, channels, pad):
    """(blocks, channels, Hp, Wp, VL): channels first .. first + channels of a (N, C, H, W),
    zero-padded by pad, images in the lanes (zero past the batch)."""
    n, c_all, h, w = a.shape
    dt, vl = blocks.dt, blocks.vl
    hp, wp = h + 2 * pad[0], w + 2 * pad[1]
    packed = np.empty((blocks.count, channels, hp, wp, vl), dt)
    src, dst = native.ptr(a) + first * h * w * dt.itemsize, native.ptr(packed)
    image, block = c_all * h * w * dt.itemsize, packed.strides[0]

    def run(b, c0, c1):
        k.conv_pack(src + b * vl * image, dst + b * block, blocks.images(b), c_all, h, w,
                    pad[0], pad[1], hp, wp, c0, c1)

    _run(run, blocks.parts(channels))
    return packed


def _unpack(k, blocks, packed, out, first, bias):
    """Channels of packed (blocks, O, H, W, VL) into out[:, first:first + O] (N, C, H, W)."""
    n, c_all, h, w = out.shape
    dt, vl = blocks.dt, blocks.vl
    o = packed.shape[1]
    src, dst = native.ptr(packed), native.ptr(out) + first * h * w * dt.itemsize
    bias_ptr = None if bias is None else native.ptr(bias)
    image, block = c_all * h * w * dt.itemsize, packed.strides[0]

    def run(b, o0, o1):
        k.conv_unpack(src + b * block, dst + b * vl * image, bias_ptr, blocks.images(b),
                      c_all, h, w, o0, o1)

    _run(run, blocks.parts(o))


def _convolve(k, blocks, xp, wt, out_shape, g):
    """(blocks, O, Ho, Wo, VL) = the forward kernel over packed input, weights (C, KH, KW, O)."""
    c, hp, wp = xp.shape[1:4]
    o = wt.shape[-1]
    ho, wo = out_shape
    yp = np.empty((blocks.count, o, ho, wo, blocks.vl), blocks.dt)
    src, dst, wts = native.ptr(xp), native.ptr(yp), native.ptr(wt)

    def run(b, r0, r1):
        k.conv_direct_forward(src + b * xp.strides[0], wts, dst + b * yp.strides[0], c, hp, wp,
                              o, *g.kernel, ho, wo, *g.stride, *g.dilation, r0, r1)

    _run(run, blocks.parts(ho))
    return yp


def forward(g, x, w, bias, y, group, dt):
    k = native.kernels(dt)
    n = x.shape[0]
    o, cg = w.shape[:2]
    og = o // group
    blocks = _Blocks(n, dt)
    for gi in range(group):
        xp = _pack(k, blocks, x, gi * cg, cg, g.pad)
        wt = np.ascontiguousarray(w[gi * og:(gi + 1) * og].transpose(1, 2, 3, 0))
        yp = _convolve(k, blocks, xp, wt, g.out, g)
        b = None if bias is None else np.ascontiguousarray(bias[gi * og:(gi + 1) * og])
        _unpack(k, blocks, yp, y, gi * og, b)


def backward(g, dy, x, w, dx, group, need_dw, dt):
    """dw (or None), and dx written in full when dx is given."""
    k = native.kernels(dt)
    n = dy.shape[0]
    o, cg = w.shape[:2]
    og = o // group
    blocks = _Blocks(n, dt)
    gt = flipped_geom(g)
    dw = np.empty(w.shape, dt) if need_dw else None
    wf = flipped_weights(w, group) if dx is not None else None
    for gi in range(group):
        # dy padded for the flipped convolution; dw reads its interior.
        dyp = _pack(k, blocks, dy, gi * og, og, gt.pad)
        if need_dw:
            xp = _pack(k, blocks, x, gi * cg, cg, g.pad)
            dw[gi * og:(gi + 1) * og] = _weight_gradient(k, blocks, xp, dyp, gt.pad, g,
                                                         og, cg)
        if dx is not None:
            wt = np.ascontiguousarray(wf[gi * cg:(gi + 1) * cg].transpose(1, 2, 3, 0))
            dxp = _convolve(k, blocks, dyp, wt, g.in_sp, gt)
            _unpack(k, blocks, dxp, dx, gi * cg, None)
    return dw


def _weight_gradient(k, blocks, xp, dyp, dy_pad, g, og, cg):
    """(O, C, KH, KW): per image block, channel pieces side by side, then the blocks' sums
    added in block order."""
    hp, wp = xp.shape[2:4]
    dhp, dwp = dyp.shape[2:4]
    ho, wo = g.out
    parts = np.zeros((blocks.count, og, cg) + g.kernel, blocks.dt)
    origin = (dy_pad[0] * dwp + dy_pad[1]) * blocks.vl * blocks.dt.itemsize

    def run(b, c0, c1):
        k.conv_direct_dw(native.ptr(xp) + b * xp.strides[0],
                         native.ptr(dyp) + b * dyp.strides[0] + origin,
                         native.ptr(parts) + b * parts.strides[0], cg, hp, wp, og, *g.kernel,
                         ho, wo, *g.stride, *g.dilation, dwp, dhp * dwp, c0, c1)

    _run(run, blocks.parts(cg))
    total = parts[0]
    for part in parts[1:]:
        total += part
    return total
