"""The direct engine: compiled multiply-add kernels, no im2col and no GEMM
(caffepar/nn/native/conv.inc).

Output channels go in the vector lanes: the result is built in a "lanes" layout (N, Ho, Wo, CP),
each pixel's channels contiguous (padded to CP, a multiple of 64 bytes), by tiles of output
pixels x two vectors of output channels held in registers (8 x 2 zmm with AVX-512, 6 x 2 ymm
with AVX2) while every input channel and tap adds one broadcast input value times a vector of
weights. The input is read zero-padded in place of NCHW (or, image by image, as it is where the
kernel skips every tap that would read padding). The kernels are built for the host's
instruction set (AVX-512 where there is one), which a BLAS tuned for another CPU may not use,
so this engine does not depend on how well the BLAS knows the CPU; it does best on thin layers, where GEMMs are short. Taps that would read only zero
padding are left out: on cifar10_quick's 8x8 conv3 (5x5, pad 2) that is 28% of the
multiply-adds, which an im2col GEMM or a padded direct loop spends on zeros (oneDNN's kernels
skip them too: counting every tap, they would run faster than the FMA units can).

dw uses the same layouts (a tile of taps x channel vectors summed over images and pixels); dx
is the forward kernel on dy, padded for the flipped kernel (for a strided layer, spread over the
stride grid first: a cost that grows with the stride, which the engine measurement weighs), with
flipped weights. The forward and stride-1 dx passes share the images out between the threads
one at a time (each thread makes one call; the kernel takes the next image from a shared
counter). dw is cut in runs of images run side by side with ``run_parts``, each summing its own
dw, and db from the same dy, and the runs' sums are added in order (``geometry.SUM_PARTS`` runs
at most), so they round the same way whichever thread ran which run. On a batch of under two
images per thread the passes go step by step over the whole batch, in runs of images x output
rows, or x input channels for dw.
"""
import functools

import numpy as np

from caffepar.nn import native
from caffepar.nn.blas import blas_threads, run_parts, scratch, split_parts
from caffepar.nn.conv import geometry

#: Parts per thread the work is cut in (a thread slowed by other load takes fewer).
PARTS_PER_THREAD = 4
#: dw runs over images enough for this many output pixels at a time (on small images a tile of
#: taps set up for one image's pixels alone spends a fifth of its time setting up).
DW_PIXELS = 256
#: Stride-1 layers with at most this many input channels per group (an RGB or grey input),
#: and output rows of whole vectors, run forward and dw on the rows kernels
#: (caffepar/nn/native/conv_rows.inc): pixels in the lanes, no transposes, which on such a
#: layer cost a third as much as its multiply-adds.
ROWS_MAX_CHANNELS = 4
#: Images each tile of the rows kernels' weight gradient sums before adding to the run's
#: sums: a tile's setup and its adds then weigh less against its multiply-adds (an image of
#: cifar10_quick's conv1 gives a tile 60 vectors of pixels).
ROWS_DW_IMAGES = 4


def applicable(g, dtype):
    """2-D layers on the compiled kernels whose dilated kernel fits in the unpadded input
    (dx is a convolution over the input's own extent: a 3x3 kernel on a 2x2 input, as
    MobileNet-SSD's conv17_2, has none)."""
    return (g.nd == 2 and _dx_pad(g) is not None
            and all(d * (k - 1) < i for i, k, d in zip(g.in_sp, g.kernel, g.dilation))
            and native.kernels(dtype) is not None)


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
    return _cut(n, items, most, PARTS_PER_THREAD * blas_threads())


@functools.lru_cache(maxsize=256)
def _cut(n, items, most, want):
    """_parts, kept: a pass cuts the same shapes every iteration, and cutting took about as
    long as the Python of a part."""
    runs = max(1, min(n, want if most is None else min(want, most)))
    pieces = max(1, min(items, -(-want // runs)))
    return tuple((r[0], len(r), i[0], i[-1] + 1) for r in split_parts(range(n), runs)
                 for i in split_parts(range(items), pieces))


def _run(fn, parts):
    """[fn(*part) for part in parts], run side by side."""
    return [r for chunk in run_parts(lambda chunk: [fn(*p) for p in chunk], split_parts(parts))
            for r in chunk]


def _shared_out(fn, n, runs=(), run=None):
    """fn(claim) once per thread, the n images shared out between the calls one at a time
    through the counter claim (the kernels' claim_first): the threads end within an image of
    each other, where runs of images handed out whole left one thread idle for up to a run
    at the end. The runs of images `runs` ((first, count, ...) as _parts cuts them) are handed
    out first, each to run(first, count): a thread done with them goes on to images. Returns
    the calls' results."""
    claim = np.zeros(1, np.int64)
    address = native.ptr(claim)
    threads = max(1, min(blas_threads(), n))
    return run_parts(lambda p: fn(address) if p is None else run(*p[:2]),
                     list(runs) + [None] * threads, threads)


def _by_images(n):
    """Whether a pass runs as one part per run of images doing all its steps (copies and
    kernels, in cache), rather than step by step over the whole batch: when there are images
    enough for every thread to take two runs or more."""
    return n >= 2 * blas_threads()


class _Layout:
    """The kernels of one dtype and the copies between NCHW, padded NCHW and lanes layouts,
    each over a run of images (i, m: the first and how many) of whole-batch arrays."""

    def __init__(self, dt):
        self.k = native.kernels(dt)
        self.dt = dt
        self.isz = dt.itemsize

    def image(self, a, i):
        """Address of image i of a (N, ...) C-contiguous array."""
        return native.ptr(a) + i * a.strides[0]

    def pad(self, out, a, i, m, first, channels, pad):
        """out[i:i + m] (N, channels, Hp, Wp) = channels first .. of a (N, C, H, W),
        zero-padded."""
        _, c_all, h, w = a.shape
        self.k.conv_pad(self.image(a, i), self.image(out, i), m, c_all, first, channels, h, w,
                        *pad)

    def to_lanes(self, out, a, i, m, first, channels):
        """out[i:i + m] (N, H, W, CP) = channels first .. of a (N, C, H, W)."""
        _, c_all, h, w = a.shape
        self.k.conv_to_lanes(self.image(a, i), self.image(out, i), m, c_all, first, channels,
                             h * w, out.shape[-1])

    def from_lanes(self, lanes, out, i, m, first, channels, bias):
        """out[i:i + m, first:first + channels] (N, C, H, W) = lanes (N, H, W, CP) + bias."""
        _, c_all, h, w = out.shape
        self.k.conv_from_lanes(self.image(lanes, i), self.image(out, i),
                               None if bias is None else native.ptr(bias), m, c_all, first,
                               channels, h * w, lanes.shape[-1])

    def convolve(self, out, xp, wt, i, m, g, inside, r0, r1):
        """Rows r0 .. r1 of out[i:i + m] (N, Ho, Wo, CP) = the forward kernel over padded
        x (N, C, Hp, Wp), zero outside the rows and columns `inside` (the kernel skips what
        reads only there), and weights from `weights`."""
        _, c, hp, wp = xp.shape
        _, ho, wo, cp = out.shape
        self.k.conv_direct_forward(self.image(xp, i), native.ptr(wt), self.image(out, i), m, c,
                                   hp, wp, 0, cp, *g.kernel, ho, wo, *g.stride, *g.dilation,
                                   *inside, r0, r1)

    def forward_nchw(self, x, wt, y, bias, i, m, g, pad, ci0, channels, co0, och, buf,
                     claim=None, relu=None, gate=None, after=None):
        """y[i:i + m] channels co0 .. co0 + och (+ bias) = the forward kernel over channels
        ci0 .. ci0 + channels of x[i:i + m], image by image through one image's buffers (with
        claim, a counter shared with other threads' calls: the images they have not taken).
        With relu (a negative_slope) a folded ReLU follows on each image: its forward, or with
        gate (its output, y's shape) its backward, y being its diff; then with after (a
        native.ImageStep on y's images) that step. Returns the kernel's result (negative: the
        step failed)."""
        _, c_in, h, w = x.shape
        _, c_out, ho, wo = y.shape
        return self.k.conv_direct_forward_nchw(
            self.image(x, i), native.ptr(buf["x"]), native.ptr(wt), native.ptr(buf["y"]),
            self.image(y, i), None if bias is None else native.ptr(bias), m, c_in, ci0,
            channels, h, w, *pad, buf["y"].shape[-1], *g.kernel, ho, wo, *g.stride,
            *g.dilation, c_out, co0, och, claim, None if gate is None else native.ptr(gate),
            0.0 if relu is None else relu, int(relu is not None and gate is None),
            *_step(after))

    def weight_gradient_nchw(self, out, db, x, dy, i, m, g, ci0, channels, co0, och, buf):
        """out (C, KH, KW, CP) += the weight gradient of images i .. i + m (channels ci0 ..
        of x, co0 .. of dy), a few images at a time through buffers for as many
        (`dw_group`); db (och) += their bias gradient unless db is None."""
        _, c_in, h, w = x.shape
        _, c_out, ho, wo = dy.shape
        self.k.conv_direct_dw_nchw(
            self.image(x, i), native.ptr(buf["x"]), self.image(dy, i), native.ptr(buf["dyl"]),
            native.ptr(out), None if db is None else native.ptr(db), m, len(buf["x"]), c_in,
            ci0, channels, h, w, *g.pad, buf["dyl"].shape[-1], *g.kernel, ho, wo, *g.stride,
            *g.dilation, c_out, co0, och)

    def weight_gradient(self, out, xp, dyl, i, m, g, c0, c1):
        """out (C, KH, KW, CP) += input channels c0 .. c1 of the weight gradient of images
        i .. i + m."""
        _, c, hp, wp = xp.shape
        _, ho, wo, cp = dyl.shape
        self.k.conv_direct_dw(self.image(xp, i), self.image(dyl, i), native.ptr(out), m, c, hp,
                              wp, cp, *g.kernel, ho, wo, *g.stride, *g.dilation,
                              *_inside(g.pad, g.in_sp, (1, 1)), c0, c1)

    def from_runs(self, sums, out, lanes=1):
        """out (O, ...) = the runs' partial sums (runs, ..., CP) added in run order, or with
        lanes (runs, ..., OP, lanes) and their lanes added too, for the O output channels:
        (runs, C, KH, KW, CP) -> dw (O, C, KH, KW), (runs, CP) -> db (O,)."""
        cp = sums.shape[-1 if lanes == 1 else -2]
        self.k.conv_dw_from_runs(native.ptr(sums), native.ptr(out), len(sums),
                                 sums[0].size // (cp * lanes), cp, lanes, len(out))

    def rows(self, g, cg):
        """Whether a layer with cg input channels per group takes the rows kernels."""
        vl = self.k.vector_bytes // self.isz
        return g.stride == (1, 1) and cg <= ROWS_MAX_CHANNELS and g.out[1] % vl == 0

    def rows_forward(self, x, wt, y, bias, i, m, g, ci0, channels, co0, och, xp, claim=None,
                     relu=None, after=None):
        """y[i:i + m] channels co0 .. co0 + och (+ bias) = the rows kernel over channels
        ci0 .. of x[i:i + m], each image padded into xp (with claim and relu: as
        forward_nchw); with after (a native.ImageStep on y's images) that step on each
        image. Returns the kernel's result (negative: the step failed)."""
        _, c_in, h, w = x.shape
        _, c_out, ho, wo = y.shape
        return self.k.conv_rows_forward(
            self.image(x, i), native.ptr(xp), native.ptr(wt),
            None if bias is None else native.ptr(bias), self.image(y, i), m, c_in, ci0,
            channels, h, w, *g.pad, *g.kernel, *g.dilation, ho, wo, c_out, co0, och,
            wt.shape[-1], claim, 0.0 if relu is None else relu, int(relu is not None),
            *_step(after))

    def rows_weight_gradient(self, out, db, x, dy, i, m, g, ci0, channels, co0, och, xp,
                             before=None):
        """out (C, KH, KW, OP, VL) += the rows kernel's weight gradient of images i .. i + m,
        lane by lane; db (och) += their bias gradient unless db is None. With before (a
        native.ImageStep on dy's images), that step first makes each tile's dy. Returns the
        kernel's result: the step's, summed (negative: it failed)."""
        _, c_in, h, w = x.shape
        _, c_out, ho, wo = dy.shape
        return self.k.conv_rows_dw(
            self.image(x, i), native.ptr(xp), self.image(dy, i), native.ptr(out),
            None if db is None else native.ptr(db), m, c_in,
            ci0, channels, h, w, *g.pad, *g.kernel, *g.dilation, ho, wo, c_out, co0, och,
            out.shape[-2], len(xp), *_step(before), i)

    def rows_weights(self, w):
        """(O, C, KH, KW) -> (C, KH, KW, OP): the rows kernel's weights, each tap's output
        channels contiguous, zero-padded to whole blocks."""
        block = self.k.conv_rows_block()
        return self._blocks(w, -(-w.shape[0] // block) * block, 1)[0]

    def weights(self, w):
        """(O, C, KH, KW) -> (OP / B, C, KH, KW, B): blocks of B output channels (the forward
        kernel's register tile: 2 vectors of the width the kernels are built for),
        zero-padded. w may be any view (dx's flipped kernels are one)."""
        block = self.k.conv_block()
        return self._blocks(w, block, -(-_lanes(w.shape[0], self.dt) // block))

    def _blocks(self, w, block, blocks):
        """(blocks, C, KH, KW, block) from w (O, C, KH, KW) read through its strides, in one
        pass (NumPy's zeros, copy and transpose took 4-5x as long in a training step)."""
        wt = np.empty((blocks,) + w.shape[1:] + (block,), self.dt)
        self.k.conv_weights(native.ptr(w), native.ptr(wt), w.shape[0], *w.shape[1:], block,
                            blocks, *(s // self.isz for s in w.strides))
        return wt


def _step(step):
    """A kernel's (address, arguments) of a native.ImageStep, or of none."""
    return (None, None) if step is None else (step.address, step.args_address)


def _runs_on(step, group, images):
    """Whether `step` (a native.ImageStep, or None) is compiled, on the array `images`, of a
    layer of one group: one the kernels can run in their loop over its images."""
    return (step is not None and step.address is not None and group == 1
            and step.images == native.ptr(images))


def _takes_step(lay, g, cg, group, step, images):
    """Whether the rows kernels run `step` (a native.ImageStep, or None) in their loop over
    the array `images`."""
    return lay.rows(g, cg) and _runs_on(step, group, images)


def takes_dy_step(g, w, group, need_dw, dt, step, dy):
    """Whether backward runs `step` (a native.ImageStep that makes dy) inside its weight
    gradient; where not, the caller must run it before anything reads dy."""
    return need_dw and _takes_step(_Layout(dt), g, w.shape[1], group, step, dy)


def _ran(step, results):
    """Record that the kernels ran `step`, with their results."""
    if min(results) < 0:
        raise MemoryError("convolution: no memory for a work buffer of the folded step")
    step.counted, step.ran = sum(results), True


def _inside(pad, extent, step):
    """(first row, end row, first column, end column) of a padded array holding `extent`
    values `step` apart after `pad` zeros: where it is not zero padding."""
    (ph, pw), (h, w), (sh, sw) = pad, extent, step
    return ph, ph + (h - 1) * sh + 1, pw, pw + (w - 1) * sw + 1


def dw_group(g, n):
    """Images per step of the weight gradient: enough for DW_PIXELS output pixels."""
    return max(1, min(n, -(-DW_PIXELS // (g.out[0] * g.out[1]))))


def _buffers(shapes, dt, n=None):
    """Work arrays by role: the calling thread's (whole batch), or with n a run's (n images)."""
    return {key: scratch("direct_" + key, ((n or shape[0]),) + shape[1:], dt)
            for key, shape in shapes.items()}


def forward(g, x, w, bias, y, group, dt, relu=None, after=None):
    """y = the convolution of x; with relu (a negative_slope) a folded ReLU on y too, where
    the kernels take it (returns whether they did); with after (a native.ImageStep on y's
    images), that step on each image as it is written, where the kernels take it (after.ran
    says whether they did)."""
    lay = _Layout(dt)
    n = x.shape[0]
    o, cg = w.shape[:2]
    og = o // group
    hp, wp = (i + 2 * p for i, p in zip(g.in_sp, g.pad))
    shapes = {"x": (n, cg, hp, wp), "y": (n,) + g.out + (_lanes(og, dt),)}
    if lay.rows(g, cg):
        step = after if _takes_step(lay, g, cg, group, after, y) else None
        for gi in range(group):
            wt = lay.rows_weights(w[gi * og:(gi + 1) * og])
            b = None if bias is None else np.ascontiguousarray(bias[gi * og:(gi + 1) * og])
            results = _shared_out(lambda claim: lay.rows_forward(
                x, wt, y, b, 0, n, g, gi * cg, cg, gi * og, og,
                scratch("direct_x", (1, cg, hp, wp), dt), claim, relu, step), n)
        if step is not None:
            _ran(step, results)
        return True
    step = after if _by_images(n) and _runs_on(after, group, y) else None
    for gi in range(group):
        wt = lay.weights(w[gi * og:(gi + 1) * og])
        b = None if bias is None else np.ascontiguousarray(bias[gi * og:(gi + 1) * og])
        if _by_images(n):
            results = _shared_out(lambda claim: lay.forward_nchw(
                x, wt, y, b, 0, n, g, g.pad, gi * cg, cg, gi * og, og, _buffers(shapes, dt, 1),
                claim, relu, after=step), n)
            if step is not None:
                _ran(step, results)
            continue
        buf = _buffers(shapes, dt)
        _run(lambda i, m, _a, _b: lay.pad(buf["x"], x, i, m, gi * cg, cg, g.pad), _parts(n, 1))
        _run(lambda i, m, r0, r1: lay.convolve(buf["y"], buf["x"], wt, i, m, g,
                                               _inside(g.pad, g.in_sp, (1, 1)), r0, r1),
             _parts(n, g.out[0]))
        _run(lambda i, m, _a, _b: lay.from_lanes(buf["y"], y, i, m, gi * og, og, b),
             _parts(n, 1))
    return _by_images(n)


def backward(g, dy, x, w, dx, group, need_dw, dt, need_db=False, dx_relu=None, before=None):
    """(dw or None, db or None, whether dx_relu was applied), and dx written in full when dx
    is given. With need_dw and need_db, the runs of images that sum dw sum db too, while their
    dy is in cache (a pass of its own over dy took 0.9 ms of cifar10_quick's step on one
    thread); db is None where the caller must take it itself (dw not needed, or a batch too
    small for runs of images). dx_relu, (gate, negative_slope): a folded ReLU's backward on
    dx, gate its output (x's shape), where the kernels take it. before, a native.ImageStep
    that makes dy, which takes_dy_step allows: run on each run of images just before the
    weight gradient reads them."""
    lay = _Layout(dt)
    if need_dw and lay.rows(g, w.shape[1]):
        dw, db = _rows_weight_gradient(lay, g, dy, x, w, group, need_db, dt, before)
        if before is not None and before.counted:
            before.finish()     # dy's last values came after the weight gradient read it
            dw, db = _rows_weight_gradient(lay, g, dy, x, w, group, need_db, dt)
        done = False
        if dx is not None:
            done = _lanes_backward(lay, g, dy, x, w, dx, group, False, False, dt, dx_relu)[2]
        return dw, db, done
    return _lanes_backward(lay, g, dy, x, w, dx, group, need_dw, need_db, dt, dx_relu)


def _rows_weight_gradient(lay, g, dy, x, w, group, need_db, dt, before=None):
    """(dw, db or None) on the rows kernels: each run of images sums its own lanes (and
    bias), the runs' sums added in order, then the lanes. With before (a native.ImageStep,
    group 1 alone), each tile's dy is made by that step first."""
    n = dy.shape[0]
    o, cg = w.shape[:2]
    og = o // group
    hp, wp = (i + 2 * p for i, p in zip(g.in_sp, g.pad))
    vl = lay.k.vector_bytes // lay.isz
    runs = _parts(n, 1, geometry.SUM_PARTS)
    starts = [r[0] for r in runs]
    dw = np.empty(w.shape, dt)
    db = np.empty(o, dt) if need_db else None
    for gi in range(group):
        sums = scratch("direct_sums", (len(runs), cg) + g.kernel + (og, vl), dt)
        bsums = scratch("direct_bias_sums", (len(runs), _lanes(og, dt)), dt) \
            if need_db else None

        def run(i, m, _a, _b):
            r = starts.index(i)
            _zero(sums[r], None if bsums is None else bsums[r])
            return lay.rows_weight_gradient(
                sums[r], None if bsums is None else bsums[r], x, dy, i, m, g, gi * cg, cg,
                gi * og, og, scratch("direct_x", (ROWS_DW_IMAGES, cg, hp, wp), dt), before)

        results = _run(run, runs)
        if before is not None:
            _ran(before, results)
        lay.from_runs(sums, dw[gi * og:(gi + 1) * og], vl)
        if need_db:
            lay.from_runs(bsums, db[gi * og:(gi + 1) * og])
    return dw, db


def _zero(*arrays):
    """A run's partial sums zeroed by the run itself (in its thread, into its cache), in work
    arrays kept between passes (fresh zeros took page faults every pass)."""
    for a in arrays:
        if a is not None:
            a.fill(0)


def _lanes_backward(lay, g, dy, x, w, dx, group, need_dw, need_db, dt, dx_relu=None):
    n = dy.shape[0]
    gate, slope = dx_relu or (None, None)
    done = dx is not None and _by_images(n) and g.stride == (1, 1)
    o, cg = w.shape[:2]
    og = o // group
    dw = np.empty(w.shape, dt) if need_dw else None
    need_db = need_db and need_dw and _by_images(n)
    db = np.empty(o, dt) if need_db else None
    gt = geometry.geom(g.in_sp, g.kernel, (1, 1), (0, 0), g.dilation)
    spread = tuple(i + d * (k - 1) for i, k, d in zip(g.in_sp, g.kernel, g.dilation))
    hp, wp = (i + 2 * p for i, p in zip(g.in_sp, g.pad))
    shapes = {"x": (n, cg, hp, wp), "dyl": (n,) + g.out + (_lanes(og, dt),),
              "dyp": (n, og) + spread, "dxl": (n,) + g.in_sp + (_lanes(cg, dt),)}
    dx_shapes = {"x": shapes["dyp"], "y": shapes["dxl"]}   # dx as the forward kernel on dy
    dy_inside = _inside(_dx_pad(g), g.out, g.stride)
    dw_shapes = {"x": shapes["x"], "dyl": shapes["dyl"]}
    for gi in range(group):
        wt = lay.weights(_flipped(w[gi * og:(gi + 1) * og])) if dx is not None else None
        if _by_images(n):
            runs = _parts(n, 1, geometry.SUM_PARTS)
            starts = [r[0] for r in runs]
            sums = scratch("direct_sums", (len(runs), cg) + g.kernel + (_lanes(og, dt),), dt) \
                if need_dw else None
            bsums = scratch("direct_bias_sums", (len(runs), _lanes(og, dt)), dt) \
                if need_db else None

            def dw_run(i, m):
                r = starts.index(i)
                _zero(sums[r], None if bsums is None else bsums[r])
                lay.weight_gradient_nchw(sums[r], None if bsums is None else bsums[r], x, dy,
                                         i, m, g, gi * cg, cg, gi * og, og,
                                         _buffers(dw_shapes, dt, dw_group(g, m)))

            def run(i, m, _r0, _r1):
                if need_dw:
                    dw_run(i, m)
                if dx is not None:
                    buf = _buffers(shapes, dt, m)
                    _spread(lay, buf["dyp"], dy[i:i + m], gi * og, og, g)
                    lay.convolve(buf["dxl"], buf["dyp"], wt, 0, m, gt, dy_inside, 0,
                                 g.in_sp[0])
                    lay.from_lanes(buf["dxl"], dx[i:i + m], 0, m, gi * cg, cg, None)

            if dx is not None and g.stride == (1, 1):
                # dx image by image after the dw runs (whose count the sums' rounding fixes)
                _shared_out(lambda claim: lay.forward_nchw(
                    dy, wt, dx, None, 0, n, gt, _dx_pad(g), gi * og, og, gi * cg, cg,
                    _buffers(dx_shapes, dt, 1), claim, slope, gate),
                    n, runs if need_dw else (), dw_run)
            else:
                _run(run, runs)
        else:
            buf = _buffers(shapes, dt)
            if need_dw:
                _run(lambda i, m, _a, _b: (
                    lay.pad(buf["x"], x, i, m, gi * cg, cg, g.pad),
                    lay.to_lanes(buf["dyl"], dy, i, m, gi * og, og)), _parts(n, 1))
                parts = _parts(n, cg, geometry.SUM_PARTS)
                starts = sorted({p[0] for p in parts})
                sums = np.zeros((len(starts), cg) + g.kernel + (_lanes(og, dt),), dt)
                _run(lambda i, m, c0, c1: lay.weight_gradient(
                    sums[starts.index(i)], buf["x"], buf["dyl"], i, m, g, c0, c1), parts)
            if dx is not None:
                _run(lambda i, m, _a, _b: _spread(lay, buf["dyp"][i:i + m], dy[i:i + m],
                                                  gi * og, og, g), _parts(n, 1))
                _run(lambda i, m, r0, r1: lay.convolve(buf["dxl"], buf["dyp"], wt, i, m, gt,
                                                       dy_inside, r0, r1),
                     _parts(n, g.in_sp[0]))
                _run(lambda i, m, _a, _b: lay.from_lanes(buf["dxl"], dx, i, m, gi * cg, cg,
                                                         None), _parts(n, 1))
        if need_dw:
            lay.from_runs(sums, dw[gi * og:(gi + 1) * og])
        if need_db:
            lay.from_runs(bsums, db[gi * og:(gi + 1) * og])
    return dw, db, done


def _flipped(w):
    """w (O, C, KH, KW) as dx's weights: (C, O, KH, KW), every kernel flipped (a view)."""
    return w.swapaxes(0, 1)[:, :, ::-1, ::-1]


def _spread(lay, out, dy, first, channels, g):
    """out (N, channels, H + d(k-1), W + d(k-1)) = dy's channels padded so that dx is a
    stride-1 unpadded convolution of it with the flipped kernel. A strided layer's dy is
    spread over its stride grid (zeros between), with the rows and columns of x that no window
    reached getting zeros at the end."""
    pads = _dx_pad(g)
    if g.stride == (1, 1):
        lay.pad(out, dy, 0, len(dy), first, channels, pads)
        return
    out.fill(0)
    out[(slice(None), slice(None)) + tuple(slice(p, p + (o - 1) * s + 1, s) for p, o, s in
                                           zip(pads, g.out, g.stride))] = \
        dy[:, first:first + channels]
