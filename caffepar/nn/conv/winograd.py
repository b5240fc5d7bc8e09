"""The Winograd engine, F(2x2, 3x3), for 3x3 stride-1 layers with many channels on both sides
(VGG's conv2_2 onwards): 2.25x fewer multiplies, all transforms done as GEMMs; results differ
from a direct convolution by float32 rounding.

Each 2x2 output tile is A^T [(G g G^T) * (B^T d B)] A for the 4x4 input tile d around it (Lavin &
Gray, 2015): 16 products per tile and channel pair instead of 36. With the row-major tile
vectors, the three transforms are kron products, so every stage is a GEMM: V = B2 @ tiles
(16, C*T), U = G2 @ w (16, O*Cg), then per transform position xi M[xi] = U[xi] @ V[xi] (16 GEMMs
as deep as the layer's channels), and tiles of y = A2 @ M. Backward: dx is the same forward on
dy with flipped kernels, and dw is G2^T (sum over tiles of (A2^T dy_tile)[xi] V[xi]^T), the
exact adjoint.

With the compiled kernels the input transform, the output transform and its adjoint each run in
one pass straight from x, into y and from dy (caffepar/nn/native/winograd.inc), a vector of tiles
at a time, channel pieces side by side.

The 16 (times groups) products are independent GEMMs, run side by side as parts, each on one
thread: as fast as BLAS splitting each one over the cores on a quiet machine, and 2-6x faster
beside other busy processes, where BLAS's threads wait for their slowest one 16 times a chunk.
"""
import math

import numpy as np

from caffepar.nn import native
from caffepar.nn.blas import blas_threads, run_parts, scratch, split_parts
from caffepar.nn.blas import gemm_views as _gemm
from caffepar.nn.conv.geometry import flipped_weights, workspace_chunk

#: 3x3 stride-1 layers with at least this many input and output channels
#: per group use Winograd F(2x2, 3x3).
WINOGRAD_MIN_CHANNELS = 128
#: ... and whose 2x2 tiles overhang the output by at most this share.
WINOGRAD_MAX_WASTE = 0.05

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


def applicable(g):
    """2-D 3x3 stride-1 undilated layers with pads up to 2."""
    return (g.nd == 2 and g.kernel == (3, 3) and g.stride == (1, 1) and g.dilation == (1, 1)
            and max(g.pad) <= 2)


def usable(g, cg, og):
    """The rule: wide enough that 2.25x fewer multiplies pay for the transforms, and
    an output the 2x2 tiles cover without much waste (13x13 computes 14x14)."""
    if not (applicable(g) and min(cg, og) >= WINOGRAD_MIN_CHANNELS):
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
        k = _kernels(xc, dt, tx)
        if k is not None:
            v = scratch("wino_v", (16, c, m * self.tiles), dt)
            _side_by_side(c, lambda c0, c1: k.wino_input(
                native.ptr(xc), native.ptr(v), m, c, self.h, self.w, *self.pad, ty, tx, c0, c1))
            return v
        ph = scratch("wino_ph", (2, 2, c, m, ty + 1, tx + 1), dt, zero=True)
        for a, b, (i0, i1, r0), (j0, j1, c0) in self.copies:
            np.copyto(ph[a, b, :, :, i0:i1, j0:j1],
                      xc[:, :, r0:r0 + 2 * (i1 - i0) - 1:2,
                         c0:c0 + 2 * (j1 - j0) - 1:2].transpose(1, 0, 2, 3))
        tiles = scratch("wino_dm", (4, 4, c, m, ty, tx), dt)
        for ky in range(4):
            for kx in range(4):
                np.copyto(tiles[ky, kx], ph[ky % 2, kx % 2, :, :, ky // 2:ky // 2 + ty,
                                            kx // 2:kx // 2 + tx])
        v = scratch("wino_v", (16, c * m * self.tiles), dt)
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


def _kernels(a, dt, tx):
    """The compiled transforms for a C-contiguous array, or None: the NumPy ones. They take a
    vector of tiles at a time, so rows of fewer tiles than a vector holds stay with NumPy's
    copies and GEMMs, which are faster there."""
    if not (a.flags.c_contiguous and a.dtype == dt and tx >= 64 // dt.itemsize):
        return None
    return native.kernels(dt)


def _side_by_side(count, fn):
    """fn(first, end) over pieces of range(count), side by side."""
    pieces = split_parts(range(count), 4 * blas_threads())
    run_parts(lambda piece: fn(piece[0], piece[-1] + 1), pieces)


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


def forward(x, w, bias, y, pad, group, dt):
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    og = o // group
    wt = _WinoTiles(x.shape[2:], pad)
    u = _wino_weights(w, dt)
    a2 = _wino_mats(dt)[2]
    nc = workspace_chunk(wt.per_image_bytes(c, o, dt.itemsize), n)
    for n0 in range(0, n, nc):
        m = min(nc, n - n0)
        t = m * wt.tiles
        v = wt.input_transform(x[n0:n0 + m], dt)
        prod = scratch("wino_dm", (16, o, t), dt)
        run_parts(lambda args: _gemm(*args),
                  [(u[k, gi * og:(gi + 1) * og], v[k, gi * cg:(gi + 1) * cg],
                    prod[k, gi * og:(gi + 1) * og]) for k in range(16) for gi in range(group)])
        k = _kernels(y, dt, wt.tx)
        if k is not None:
            _side_by_side(o, lambda o0, o1: k.wino_output(
                native.ptr(prod), native.ptr(y[n0:n0 + m]),
                None if bias is None else native.ptr(bias), m, o, wt.oh, wt.ow, wt.ty, wt.tx,
                o0, o1))
            continue
        z = scratch("wino_y", (4, o, t), dt)
        _gemm(a2, prod.reshape(16, -1), z.reshape(4, -1))
        if bias is not None:
            z += bias[:, None]
        for dst, src in wt.quads(y[n0:n0 + m], z.reshape(2, 2, o, m, wt.ty, wt.tx)):
            np.copyto(dst, src)


def backward(dy, x, w, dx, pad, group, need_dw, dt):
    """dx (written in full) and dw of a Winograd layer."""
    o, cg = w.shape[:2]
    og = o // group
    if dx is not None:
        forward(dy, flipped_weights(w, group), None, dx, (2 - pad[0], 2 - pad[1]), group, dt)
    if not need_dw:
        return None
    n, c = x.shape[:2]
    wt = _WinoTiles(x.shape[2:], pad)
    b2, g2, a2 = _wino_mats(dt)
    du = np.empty((16, o, cg), dt)
    odd = wt.oh % 2 or wt.ow % 2
    nc = workspace_chunk(wt.per_image_bytes(c, o, dt.itemsize), n)
    for i, n0 in enumerate(range(0, n, nc)):
        m = min(nc, n - n0)
        t = m * wt.tiles
        v = wt.input_transform(x[n0:n0 + m], dt)
        dprod = scratch("wino_dm", (16, o, t), dt)
        k = _kernels(dy, dt, wt.tx)
        if k is not None:
            _side_by_side(o, lambda o0, o1: k.wino_output_adjoint(
                native.ptr(dy[n0:n0 + m]), native.ptr(dprod), m, o, wt.oh, wt.ow, wt.ty,
                wt.tx, o0, o1))
        else:
            z = scratch("wino_y", (4, o, t), dt, zero=odd)
            for src, dst in wt.quads(dy[n0:n0 + m], z.reshape(2, 2, o, m, wt.ty, wt.tx)):
                np.copyto(dst, src)
            _gemm(a2, z.reshape(4, -1), dprod.reshape(16, -1), trans_a=True)
        run_parts(lambda args: _gemm(*args),
                  [(dprod[k, gi * og:(gi + 1) * og], v[k, gi * cg:(gi + 1) * cg],
                    du[k, gi * og:(gi + 1) * og], False, True, 0.0 if i == 0 else 1.0)
                   for k in range(16) for gi in range(group)])
    dw = np.empty(w.shape, dt)
    _gemm(du.reshape(16, -1), g2, dw.reshape(o * cg, 9), trans_a=True)
    return dw

