"""The direct engine: compiled multiply-add kernels, no im2col and no GEMM
(caffepar/nn/native/conv.inc).

Output channels go in the vector lanes: the result is built in a "lanes" layout (N, Ho, Wo, CP),
each pixel's channels contiguous (padded to CP, a multiple of the 64-byte vector), by tiles of
8 output pixels x 32 output channels held in registers while every input channel and tap adds
one broadcast input value times a vector of weights. The input is read zero-padded in place of
NCHW. The kernels are built for the host's instruction set (AVX-512 where there is one), which a
BLAS tuned for another CPU may not use, so this engine does not depend on how well the BLAS knows
the CPU; it does best on thin layers, where GEMMs are short.

dw uses the same layouts (a tile of taps x channel vectors summed over images and pixels); dx
is the forward kernel on dy, padded for the flipped kernel (for a strided layer, spread over the
stride grid first: a cost that grows with the stride, which the engine measurement weighs), with
flipped weights. Work is cut in parts (runs of images x output
rows, or x input channels for dw) run side by side with ``run_parts``; each run of images sums
its own dw, and the runs' sums are added in order (``geometry.SUM_PARTS`` runs at most).
"""
import numpy as np

from caffepar.nn import native
from caffepar.nn.blas import blas_threads, run_parts, scratch, split_parts
from caffepar.nn.conv import geometry
from caffepar.nn.conv.geometry import flipped_weights

#: Parts per thread the work is cut in (a thread slowed by other load takes fewer).
PARTS_PER_THREAD = 4


def applicable(g, dtype):
    return (g.nd == 2 and _dx_pad(g) is not None and native.kernels(dtype) is not None)


def _dx_pad(g):
    """The padding of dy (for a strided layer: of dy spread over the stride grid) that makes
    dx a stride-1 convolution with the flipped kernel, or None when the layer is over-padded."""
    pads = tuple(d * (k - 1) - p for k, d, p in zip(g.kernel, g.dilation, g.pad))
    return pads if min(pads) >= 0 else None


def _lanes(channels, dt):
    vl = 64 // dt.itemsize
    return -(-channels // vl) * vl


def _parts(n, items, most=None):
    """(first image, images, first item, end item) cutting n images x `items` (rows or
    channels) in about PARTS_PER_THREAD parts per thread (`most` image runs at most)."""
    want = PARTS_PER_THREAD * blas_threads()
    runs = max(1, min(n, want if most is None else min(want, most)))
    pieces = max(1, min(items, -(-want // runs)))
    return [(r[0], len(r), i[0], i[-1] + 1) for r in split_parts(range(n), runs)
            for i in split_parts(range(items), pieces)]


def _images(parts):
    """Parts over runs of images alone, for the layout copies."""
    return [(i, m, 0, 0) for i, m in {(p[0], p[1]) for p in parts}]


def _run(fn, parts):
    run_parts(lambda chunk: [fn(*p) for p in chunk], split_parts(parts))


class _Layout:
    """The kernels of one dtype and the copies between NCHW, padded NCHW and lanes layouts."""

    def __init__(self, dt):
        self.k = native.kernels(dt)
        self.dt = dt
        self.isz = dt.itemsize

    def pad(self, key, a, first, channels, pad):
        """(N, channels, Hp, Wp): channels first .. of a (N, C, H, W), zero-padded."""
        n, c_all, h, w = a.shape
        out = scratch(key, (n, channels, h + 2 * pad[0], w + 2 * pad[1]), self.dt)
        image_in, image_out = c_all * h * w * self.isz, out.strides[0]

        def run(i, m, _a, _b):
            self.k.conv_pad(native.ptr(a) + i * image_in, native.ptr(out) + i * image_out, m,
                            c_all, first, channels, h, w, *pad)

        _run(run, _images(_parts(n, 1)))
        return out

    def to_lanes(self, key, a, first, channels):
        """(N, H, W, CP): channels first .. of a (N, C, H, W) in the lanes layout."""
        n, c_all, h, w = a.shape
        cp = _lanes(channels, self.dt)
        out = scratch(key, (n, h, w, cp), self.dt)

        def run(i, m, _a, _b):
            self.k.conv_to_lanes(native.ptr(a) + i * c_all * h * w * self.isz,
                                 native.ptr(out) + i * out.strides[0], m, c_all, first,
                                 channels, h * w, cp)

        _run(run, _images(_parts(n, 1)))
        return out

    def from_lanes(self, lanes, out, first, channels, bias):
        """out[:, first:first + channels] (N, C, H, W) = lanes (N, H, W, CP) + bias."""
        n, c_all, h, w = out.shape
        bias_ptr = None if bias is None else native.ptr(bias)

        def run(i, m, _a, _b):
            self.k.conv_from_lanes(native.ptr(lanes) + i * lanes.strides[0],
                                   native.ptr(out) + i * c_all * h * w * self.isz, bias_ptr, m,
                                   c_all, first, channels, h * w, lanes.shape[-1])

        _run(run, _images(_parts(n, 1)))

    def convolve(self, key, xp, wt, out_shape, g):
        """(N, Ho, Wo, CP) = the forward kernel over padded x (N, C, Hp, Wp) and weights
        (C, KH, KW, CP)."""
        n, c, hp, wp = xp.shape
        cp = wt.shape[-1]
        ho, wo = out_shape
        y = scratch(key, (n, ho, wo, cp), self.dt)

        def run(i, m, r0, r1):
            self.k.conv_direct_forward(native.ptr(xp) + i * xp.strides[0], native.ptr(wt),
                                       native.ptr(y) + i * y.strides[0], m, c, hp, wp, cp,
                                       *g.kernel, ho, wo, *g.stride, *g.dilation, r0, r1)

        _run(run, _parts(n, ho))
        return y

    def weights(self, w):
        """(O, C, KH, KW) -> (C, KH, KW, OP), output channels zero-padded to the lanes."""
        o = w.shape[0]
        wt = np.zeros(w.shape[1:] + (_lanes(o, self.dt),), self.dt)
        wt[..., :o] = w.transpose(1, 2, 3, 0)
        return wt


def forward(g, x, w, bias, y, group, dt):
    lay = _Layout(dt)
    o, cg = w.shape[:2]
    og = o // group
    for gi in range(group):
        xp = lay.pad("direct_x", x, gi * cg, cg, g.pad)
        yl = lay.convolve("direct_y", xp, lay.weights(w[gi * og:(gi + 1) * og]), g.out, g)
        b = None if bias is None else np.ascontiguousarray(bias[gi * og:(gi + 1) * og])
        lay.from_lanes(yl, y, gi * og, og, b)


def backward(g, dy, x, w, dx, group, need_dw, dt):
    """dw (or None), and dx written in full when dx is given."""
    lay = _Layout(dt)
    o, cg = w.shape[:2]
    og = o // group
    gt = geometry.geom(g.in_sp, g.kernel, (1, 1), (0, 0), g.dilation) \
        if dx is not None else None
    dw = np.empty(w.shape, dt) if need_dw else None
    wf = flipped_weights(w, group) if dx is not None else None
    for gi in range(group):
        if need_dw:
            xp = lay.pad("direct_x", x, gi * cg, cg, g.pad)
            dyl = lay.to_lanes("direct_y", dy, gi * og, og)
            dw[gi * og:(gi + 1) * og] = _weight_gradient(lay, xp, dyl, g, og)
        if dx is not None:
            dyp = _spread(lay, dy, gi * og, og, g)
            dxl = lay.convolve("direct_y", dyp, lay.weights(wf[gi * cg:(gi + 1) * cg]),
                               g.in_sp, gt)
            lay.from_lanes(dxl, dx, gi * cg, cg, None)
    return dw


def _spread(lay, dy, first, channels, g):
    """dy's channels padded so that dx is a stride-1 unpadded convolution of it with the
    flipped kernel: (N, channels, H + d(k-1), W + d(k-1)). A strided layer's dy is spread
    over its stride grid (zeros between), with the rows and columns of x that no window
    reached getting zeros at the end."""
    pads = _dx_pad(g)
    if g.stride == (1, 1):
        return lay.pad("direct_x", dy, first, channels, pads)
    n = dy.shape[0]
    size = tuple(i + d * (k - 1) for i, k, d in zip(g.in_sp, g.kernel, g.dilation))
    out = scratch("direct_x", (n, channels) + size, lay.dt)
    out.fill(0)
    out[(slice(None), slice(None)) + tuple(slice(p, p + (o - 1) * s + 1, s) for p, o, s in
                                           zip(pads, g.out, g.stride))] = \
        dy[:, first:first + channels]
    return out


def _weight_gradient(lay, xp, dyl, g, og):
    """(O, C, KH, KW): each run of images sums its own (input channel pieces side by side),
    then the runs' sums are added in order."""
    n, c, hp, wp = xp.shape
    cp = dyl.shape[-1]
    ho, wo = g.out
    parts = _parts(n, c, geometry.SUM_PARTS)
    runs = sorted({p[0] for p in parts})
    sums = np.zeros((len(runs), c) + g.kernel + (cp,), lay.dt)

    def run(i, m, c0, c1):
        lay.k.conv_direct_dw(native.ptr(xp) + i * xp.strides[0],
                             native.ptr(dyl) + i * dyl.strides[0],
                             native.ptr(sums) + runs.index(i) * sums.strides[0], m, c, hp, wp,
                             cp, *g.kernel, ho, wo, *g.stride, *g.dilation, c0, c1)

    _run(run, parts)
    total = sums[0]
    for part in sums[1:]:
        total += part
    return np.ascontiguousarray(np.moveaxis(total[..., :og], -1, 0))
