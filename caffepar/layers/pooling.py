"""Pooling and SPP (spatial pyramid pooling), with Caffe's output-size and window-clipping rules.

The work is done per kernel offset on strided views of a padded copy, so the Python loop runs
kernel_h * kernel_w times whatever the image size.
"""
import math

import numpy as np

from caffepar.layers.base import Layer, register
from caffepar.proto import caffe_pb2

PP = caffe_pb2.PoolingParameter
NEG_FLT_MAX = -float(np.finfo(np.float32).max)


def pooled_size(size, kernel, pad, stride, ceil_mode=True):
    """Caffe's output extent: ceil (or floor) division, then drop a last window that would start
    in the bottom/right padding."""
    span = float(np.float32(size + 2 * pad - kernel) / np.float32(stride))
    out = (math.ceil(span) if ceil_mode else math.floor(span)) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _index_dtype(n):
    return np.int8 if n < 127 else np.int16 if n < 32767 else np.int32


class PoolGeometry:
    """Kernel, pad, stride and output size along the two spatial axes."""

    def __init__(self, kh, kw, ph, pw, sh, sw, ceil_mode=True):
        self.kh, self.kw, self.ph, self.pw, self.sh, self.sw = kh, kw, ph, pw, sh, sw
        self.ceil_mode = ceil_mode

    def reshape(self, h, w):
        self.h, self.w = h, w
        self.oh = pooled_size(h, self.kh, self.ph, self.sh, self.ceil_mode)
        self.ow = pooled_size(w, self.kw, self.pw, self.sw, self.ceil_mode)
        # Rows/cols of the padded frame that windows reach (may exceed h + 2 pad with ceil).
        self.fh = max((self.oh - 1) * self.sh + self.kh, h + self.ph)
        self.fw = max((self.ow - 1) * self.sw + self.kw, w + self.pw)

    def frame(self, x, fill):
        """x (N, C, H, W) placed in a frame starting at (-pad_h, -pad_w), other cells = fill;
        x itself when no window reaches outside the image (read only)."""
        if self.fh == self.h and self.fw == self.w:
            return x
        f = np.full((x.shape[0], x.shape[1], self.fh, self.fw), fill, x.dtype)
        f[:, :, self.ph:self.ph + self.h, self.pw:self.pw + self.w] = x
        return f

    def grad_frame(self, dx):
        """A zeroed frame to scatter gradients into (dx itself when the frame is the image)."""
        if self.fh == self.h and self.fw == self.w:
            dx.fill(0)
            return dx
        return np.zeros((dx.shape[0], dx.shape[1], self.fh, self.fw), dx.dtype)

    def view(self, frame, i, j):
        return frame[:, :, i:i + (self.oh - 1) * self.sh + 1:self.sh,
                     j:j + (self.ow - 1) * self.sw + 1:self.sw]

    def crop(self, frame):
        return frame[:, :, self.ph:self.ph + self.h, self.pw:self.pw + self.w]

    def ave_divisor(self, dtype):
        """Caffe's AVE pool_size: the window clipped to H + pad (padding counts, overhang not)."""
        def extent(o, k, p, s, size):
            start = np.arange(o) * s - p
            return np.minimum(start + k, size + p) - start
        dh = extent(self.oh, self.kh, self.ph, self.sh, self.h)
        dw = extent(self.ow, self.kw, self.pw, self.sw, self.w)
        return np.outer(dh, dw).astype(dtype)


def max_pool_forward(g, x, out):
    """Max pooling into `out`; returns the winning kernel offset per output (-1: none).
    Like Caffe's strict '>' scan from -FLT_MAX: NaNs never win and ties keep the first cell in
    row-major window order (offsets are marked last to first, so the first one stays)."""
    frame = g.frame(x, -np.inf)
    out.fill(NEG_FLT_MAX)
    for i in range(g.kh):
        for j in range(g.kw):
            np.fmax(out, g.view(frame, i, j), out=out)
    arg = np.full(out.shape, -1, _index_dtype(g.kh * g.kw))
    hit = np.empty(out.shape, bool)
    for o in range(g.kh * g.kw - 1, -1, -1):
        np.equal(g.view(frame, o // g.kw, o % g.kw), out, out=hit)
        np.putmask(arg, hit, o)
    return arg


def max_pool_mask(g, arg):
    """The flat index h * W + w of each winner inside its (unpadded) channel plane, -1 if none."""
    oi = np.arange(g.oh)[:, None] * g.sh - g.ph
    oj = np.arange(g.ow)[None, :] * g.sw - g.pw
    a = arg.astype(np.int64)
    idx = (oi + a // g.kw) * g.w + oj + a % g.kw
    return np.where(arg < 0, -1, idx)


def max_pool_backward(g, arg, dy, dx):
    frame = g.grad_frame(dx)
    tmp = np.empty(dy.shape, dx.dtype)
    for i in range(g.kh):
        for j in range(g.kw):
            np.multiply(dy, arg == i * g.kw + j, out=tmp)
            g.view(frame, i, j)[...] += tmp
    if frame is not dx:
        dx[...] = g.crop(frame)
    none = arg < 0
    if none.any():
        _scatter_unassigned(none, dy, dx)


def _scatter_unassigned(none, dy, dx):
    """A window with no cell in the image has Caffe index -1, which lands on the last cell of the
    previous channel plane (nothing for the very first plane)."""
    planes = dx.shape[0] * dx.shape[1]
    per_plane = (dy * none).reshape(planes, -1).sum(axis=1)
    flat = dx.reshape(planes, -1)
    flat[:-1, -1] += per_plane[1:]


def max_pool_backward_from_mask(g, mask, dy, dx):
    """Scatter through an explicit mask top (flat h * W + w per plane), as Caffe does."""
    planes = dx.shape[0] * dx.shape[1]
    m = mask.reshape(planes, -1).astype(np.int64)
    base = (np.arange(planes) * g.h * g.w)[:, None]
    flat = (m + base).reshape(-1)
    ok = flat >= 0
    acc = np.bincount(flat[ok], weights=dy.reshape(-1)[ok], minlength=dx.size)
    dx[...] = acc[:dx.size].reshape(dx.shape)


def ave_pool_forward(g, x, out):
    frame = g.frame(x, 0)
    out.fill(0)
    for i in range(g.kh):
        for j in range(g.kw):
            out += g.view(frame, i, j)
    out /= g.ave_divisor(out.dtype)


def ave_pool_backward(g, dy, dx):
    frame = g.grad_frame(dx)
    scaled = dy / g.ave_divisor(dy.dtype)
    for i in range(g.kh):
        for j in range(g.kw):
            g.view(frame, i, j)[...] += scaled
    if frame is not dx:
        dx[...] = g.crop(frame)


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
        self.geom = PoolGeometry(kh, kw, ph, pw, sh, sw, p.round_mode == PP.CEIL)

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
                flat = x.reshape(x.shape[0], x.shape[1], -1)
                a = flat.argmax(axis=2)
                y.reshape(a.shape)[...] = np.take_along_axis(flat, a[..., None], 2)[..., 0]
                self.arg = a.reshape(y.shape).astype(np.int32)
            else:
                self.arg = max_pool_forward(g, x, y)
            if len(top) > 1:
                top[1].data[...] = max_pool_mask(g, self.arg)
        elif self.global_pooling:
            y.reshape(y.shape[:2])[...] = x.mean(axis=(2, 3))
        else:
            ave_pool_forward(g, x, y)

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
            elif self.global_pooling:
                dx[...] = 0
                flat = dx.reshape(dx.shape[0], dx.shape[1], -1)
                np.put_along_axis(flat, self.arg.reshape(flat.shape[0], flat.shape[1], 1),
                                  dy.reshape(flat.shape[0], flat.shape[1], 1), 2)
            else:
                max_pool_backward(g, self.arg, dy, dx)
        elif self.global_pooling:
            dx[...] = (dy / (g.h * g.w)).reshape(dy.shape[0], dy.shape[1], 1, 1)
        else:
            ave_pool_backward(g, dy, dx)


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
