"""The depthwise engine: depthwise and grouped convolutions with few channels per group on the
compiled kernels (caffepar/nn/native/group.inc), pixels in the vector lanes; dense layers too,
where measurement finds it faster (small maps above all).

A per-group GEMM is a poor fit for these: one input channel per group (MobileNet's 3x3
depthwise layers) makes every GEMM one row deep, and a loop over hundreds of groups costs more
in calls than in arithmetic (the grid engine's NumPy path took 4.5 ms on a 384x14x14 map that
holds 0.68M multiply-adds). Here each (image, group) is one item of one kernel call: its input
planes are laid out as the polyphase flat grid (every tap a fixed offset), and a register tile
of output channels x vectors of pixels sums the taps and channels. Stride, dilation, any
kernel size and channel multipliers above 1 are the same loop. dx is the same kernel on dy
spread over the stride grid, with the kernels flipped through the weight strides; dw sums
each group's images in order in one thread, so the result does not depend on the threads.

The forward applies the epilogue (a folded BatchNorm and Scale, the bias, ReLU, leaky ReLU,
ReLU6 or PReLU) to each vector of sums before it is stored. The kernels read their arguments
from one int64 array, which a prepared forward builds once (``Prepared``), so a call costs
one ctypes call per thread.
"""
import math

import numpy as np

from caffepar.nn import native
from caffepar.nn.blas import blas_threads, run_parts
from caffepar.nn.conv.epilogue import EP_FIELDS, EpilogueArgs

#: The rule: groups with at most this many input channels run here (depthwise layers, and
#: grouped layers of a few channels per group); wider groups are left to the GEMM engines.
MAX_GROUP_CHANNELS = 16
#: Dense layers (group 1) are a candidate while an image's input is at most this big.
DENSE_MAX_BYTES = 2 << 20
#: Dense layers (group 1) are a backward candidate up to this many output pixels (32x32).
DENSE_BACKWARD_PIXELS = 1024
#: Work below this many multiply-adds runs on the calling thread alone: waking a second
#: thread costs more than it saves on a small layer.
THREAD_MIN_MACS = 400_000

# The argument fields (group.inc's GF_*, EP_* and GW_* enums, in order).
GF = {name: i for i, name in enumerate(
    "x w y n cin hi wi groups cg og kh kw sh sw dh dw ph pw uh uw ho wo wgroup wo_s wc_s "
    "wh_s ww_s wbase cout".split())}
GF_EPI = len(GF)
GW = {name: i for i, name in enumerate(
    "x dy dw n cin hi wi groups cg og kh kw sh sw dh dw ph pw ho wo cout".split())}


#: Strides up to this: dx runs on dy spread over the stride grid, stride^2 the work (an FCN's
#: stride-32 upsampling Deconvolution, a dx pass, would do 1024x its multiply-adds).
MAX_STRIDE = 2


def applicable(g, cg, group, dt):
    """2-D layers of strides up to MAX_STRIDE, on the compiled kernels: grouped ones, and dense
    ones (one group of every channel) as a measured candidate. On small maps a dense layer's
    GEMM engines cost tens of microseconds in calls and copies where this kernel takes a few
    (a 3x3 layer of 8 channels on 4x4: 1.4 us against 73), and on 7x7 to 19x19 maps its
    register tile outruns a GEMM of the same multiply-adds -- while an image's input, which
    the kernel lays out whole, stays within DENSE_MAX_BYTES (VGG-16's 224x224x64 layers ran
    far slower here, and timing them made a first run a minute longer); backward_applicable
    bounds its backward."""
    return (g.nd == 2 and max(g.stride) <= MAX_STRIDE and native.kernels(dt) is not None
            and (group > 1 or cg * math.prod(g.in_sp) * dt.itemsize <= DENSE_MAX_BYTES))


def backward_applicable(g, group):
    """Whether a backward pass may be measured here: grouped layers, and dense ones on maps of
    up to DENSE_BACKWARD_PIXELS output pixels (dw runs each group in one thread: on a large
    dense layer it is slow, and timing it costs a first run seconds)."""
    return group > 1 or math.prod(g.out) <= DENSE_BACKWARD_PIXELS


def usable(g, cg, group, dt):
    """The rule: grouped layers of few input channels per group (a dense layer comes here only
    when measured faster)."""
    return group > 1 and applicable(g, cg, group, dt) and cg <= MAX_GROUP_CHANNELS


def forward_args(g, x, w, y, group, epi_fields):
    """The forward kernel's fields for x (N, C, H, W), w (O, C/group, KH, KW) C-contiguous,
    y (N, O, HO, WO)."""
    n, c = x.shape[:2]
    o, cg, kh, kw = w.shape
    a = np.zeros(GF_EPI + EP_FIELDS, np.int64)
    a[:GF_EPI] = (native.ptr(x), native.ptr(w), native.ptr(y), n, c, *g.in_sp, group, cg,
                  o // group, kh, kw, *g.stride, *g.dilation, *g.pad, 1, 1, *g.out,
                  (o // group) * cg * kh * kw, cg * kh * kw, kh * kw, kw, 1, 0, o)
    a[GF_EPI:] = epi_fields
    return a


def dx_args(g, dy, w, dx, group):
    """The forward kernel's fields computing dx (N, C, H, W) from dy (N, O, HO, WO): dy spread
    over the stride grid and padded by d (k - 1) - p (negative: cropped), stride 1, the
    kernels flipped and their roles swapped through the weight strides."""
    n, o = dy.shape[:2]
    _, cg, kh, kw = w.shape
    og = o // group
    (sh, sw), (dh, dw), (ph, pw) = g.stride, g.dilation, g.pad
    a = np.zeros(GF_EPI + EP_FIELDS, np.int64)
    a[:GF_EPI] = (native.ptr(dy), native.ptr(w), native.ptr(dx), n, o, *g.out, group, og, cg,
                  kh, kw, 1, 1, dh, dw, dh * (kh - 1) - ph, dw * (kw - 1) - pw, sh, sw,
                  *g.in_sp, og * cg * kh * kw, kh * kw, cg * kh * kw, -kw, -1,
                  (kh - 1) * kw + kw - 1, cg * group)
    return a


def dw_args(g, x, dy, dw, group):
    n, c = x.shape[:2]
    o, cg, kh, kw = dw.shape
    return np.array((native.ptr(x), native.ptr(dy), native.ptr(dw), n, c, *g.in_sp, group, cg,
                     o // group, kh, kw, *g.stride, *g.dilation, *g.pad, *g.out, o), np.int64)


class Call:
    """One kernel over its int64 fields, on as many threads as its work pays for, each thread
    taking items from a shared claim counter."""

    def __init__(self, fn, args, macs, items, keep=()):
        self.fn, self.args, self.keep = fn, args, keep
        self.address = native.ptr(args)
        self.claim = np.zeros(1, np.int64)
        self.claim_address = native.ptr(self.claim)
        self.items, self.macs = items, macs

    def __call__(self):
        if self.macs < 2 * THREAD_MIN_MACS:
            if self.fn(self.address, None) < 0:
                raise MemoryError("depthwise convolution: no memory for a work buffer")
            return
        threads = min(blas_threads(), self.items, self.macs // THREAD_MIN_MACS)
        if threads <= 1:
            result = [self.fn(self.address, None)]
        else:
            self.claim[0] = 0
            fn, address, claim = self.fn, self.address, self.claim_address
            result = run_parts(lambda _: fn(address, claim), [None] * threads, threads)
        if min(result) < 0:
            raise MemoryError("depthwise convolution: no memory for a work buffer")


def _macs(g, n, o, cg):
    return n * o * cg * g.ntaps * math.prod(g.out)


def forward_call(g, x, w, y, group, dt, epi):
    """A Call running the forward of x, w into y with the EpilogueArgs `epi`."""
    k = native.kernels(dt)
    return Call(k.conv_group_forward, forward_args(g, x, w, y, group, epi.fields),
                _macs(g, x.shape[0], w.shape[0], w.shape[1]), x.shape[0] * group,
                (x, w, y, epi))


def forward(g, x, w, bias, y, group, dt, epilogue=None):
    """y = the convolution of x, plus bias, then the epilogue (given one, bias is None)."""
    w = np.ascontiguousarray(w)
    epi = EpilogueArgs(epilogue, w.shape[0], dt, bias)
    forward_call(g, x, w, y, group, dt, epi)()


def backward(g, dy, x, w, dx, group, need_dw, dt):
    """dw (or None), and dx written in full when given."""
    k = native.kernels(dt)
    dy = np.ascontiguousarray(dy)
    w = np.ascontiguousarray(w)
    n = dy.shape[0]
    o, cg = w.shape[:2]
    macs = _macs(g, n, o, cg)
    dw = None
    if need_dw:
        dw = np.empty(w.shape, dt)
        Call(k.conv_group_dw, dw_args(g, np.ascontiguousarray(x), dy, dw, group), macs,
             group)()
    if dx is not None:
        # spread over the stride grid, dx's pixels each take every tap: stride^2 the work
        spread = macs * math.prod(g.stride)
        Call(k.conv_group_forward, dx_args(g, dy, w, dx, group), spread, n * group)()
    return dw
