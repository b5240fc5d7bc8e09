"""The pointwise engine: 1x1 unpadded convolutions, one GEMM per image read and written in
place (a strided layer's input subsampled into a work array first)."""
import math

import numpy as np

from caffepar.nn.blas import gemm_views as _gemm
from caffepar.nn.blas import prepare_gemm, run_parts, scratch, split_parts

#: 1x1 unpadded stride-1 convs on images this large are one GEMM per image.
POINTWISE_DIRECT_MIN = 1024


def applicable(g):
    return g.ntaps == 1 and all(p == 0 for p in g.pad)


def usable(g):
    """The rule: stride 1 on large images (small ones do better as one grid GEMM over a chunk
    of images)."""
    return (applicable(g) and all(s == 1 for s in g.stride)
            and g.qsize >= POINTWISE_DIRECT_MIN)


def _strided(g):
    return any(s != 1 for s in g.stride)


def _subsampled(g, x, key):
    """x (N, C, *S) read at the stride: x itself at stride 1, else a work array."""
    if not _strided(g):
        return x
    sub = scratch(key, x.shape[:2] + g.out, x.dtype)
    np.copyto(sub, x[(slice(None), slice(None))
                     + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(g.out, g.stride))])
    return sub


#: The images go to the threads in this many runs, each image's GEMMs single-threaded (a thin
#: GEMM keeps a core busier alone than split inside the BLAS); dw sums each run's images in
#: order, then the runs in order, so its sums do not depend on the threads.
IMAGE_RUNS = 4


def forward(x, w, y, group, g=None):
    """1x1 unpadded conv: one GEMM per image straight into y."""
    if g is not None:
        x = _subsampled(g, x, "pw_x")
    _in_runs(_gemms(x, w, y, group), x.shape[0])()


def _in_runs(calls, n):
    """A call running `calls` (each image's in turn) by runs of images side by side."""
    if n < 2:
        return lambda: [call() for call in calls]
    per = len(calls) // n
    runs = split_parts(range(n), IMAGE_RUNS)

    def run(images):
        for call in calls[images.start * per:images.stop * per]:
            call()
    return lambda: run_parts(run, runs)


def _gemms(x, w, y, group, prepared=False):
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    hw = math.prod(x.shape[2:])
    xs = x.reshape(n, c, hw)
    ys = y.reshape(n, o, hw)
    w2 = w.reshape(o, cg) if w.flags.c_contiguous else np.ascontiguousarray(w.reshape(o, cg))
    make = prepare_gemm if prepared else (lambda a, b, c: (lambda: _gemm(a, b, c)))
    return [make(w2[gi * og:(gi + 1) * og], xs[i, gi * cg:(gi + 1) * cg],
                 ys[i, gi * og:(gi + 1) * og]) for i in range(n) for gi in range(group)]


def prepare_forward(g, x, w, y, group):
    """The forward as a call with its GEMMs' arguments built once (w read in place: a user's
    edit of the weights is seen; a strided layer's input copied at each call)."""
    if not w.flags.c_contiguous:
        return lambda: forward(x, w, y, group, g)
    if not _strided(g):
        calls = _gemms(x, w, y, group, prepared=True)
        if len(calls) == 1:
            return calls[0]
        return _in_runs(calls, x.shape[0])
    sub = np.empty(x.shape[:2] + g.out, x.dtype)
    view = x[(slice(None), slice(None))
             + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(g.out, g.stride))]
    gemms = _in_runs(_gemms(sub, w, y, group, prepared=True), x.shape[0])

    def run():
        np.copyto(sub, view)
        gemms()
    return run


def backward(dy, x, w, dx, group, need_dw, g=None):
    n = dy.shape[0]
    o, cg = w.shape[:2]
    og = o // group
    c = cg * group
    hw = math.prod(dy.shape[2:])
    dys = dy.reshape(n, o, hw)
    w2 = np.ascontiguousarray(w.reshape(o, cg))
    strided = g is not None and _strided(g)
    xs = (_subsampled(g, x, "pw_x") if strided else x).reshape(n, c, hw) if need_dw else None
    dxs = None
    if dx is not None:
        dxs = (scratch("pw_dx", (n, c, hw), dy.dtype) if strided else dx.reshape(n, c, hw))
    runs = split_parts(range(n), IMAGE_RUNS)
    partial = np.empty((len(runs), o, cg), dy.dtype) if need_dw else None

    def run(j):
        """The images of run j: their share of dw, and their dx."""
        for i in runs[j]:
            for gi in range(group):
                dyi = dys[i, gi * og:(gi + 1) * og]
                if need_dw:
                    _gemm(dyi, xs[i, gi * cg:(gi + 1) * cg], partial[j, gi * og:(gi + 1) * og],
                          trans_b=True, beta=0.0 if i == runs[j].start else 1.0)
                if dxs is not None:
                    _gemm(w2[gi * og:(gi + 1) * og], dyi, dxs[i, gi * cg:(gi + 1) * cg],
                          trans_a=True)
    run_parts(run, range(len(runs)))
    if dx is not None and strided:
        np.copyto(dx[(slice(None), slice(None))
                     + tuple(slice(0, (o_ - 1) * s + 1, s) for o_, s in zip(g.out, g.stride))],
                  dxs.reshape((n, c) + g.out))
    if not need_dw:
        return None
    dw = partial[0]
    for j in range(1, len(runs)):
        dw += partial[j]
    return dw.reshape(w.shape)
