"""The pointwise engine: 1x1 stride-1 unpadded convolutions on large images, one GEMM per image
read and written in place."""
import math

import numpy as np

from caffepar.nn.blas import gemm_views as _gemm

#: 1x1 unpadded stride-1 convs on images this large are one GEMM per image.
POINTWISE_DIRECT_MIN = 1024


def applicable(g):
    return g.ntaps == 1 and all(s == 1 for s in g.stride) and all(p == 0 for p in g.pad)


def usable(g):
    """The rule: large images (small ones do better as one grid GEMM over a chunk)."""
    return applicable(g) and g.qsize >= POINTWISE_DIRECT_MIN


def forward(x, w, y, group):
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


def backward(dy, x, w, dx, group, need_dw):
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
