"""Layers of the segmentation forks of Caffe: Interp (DeepLab v2, PSPNet), Upsample (SegNet's
unpooling by a max-pooling mask, and the nearest-neighbour form of the YOLO ports) and BN (PSPNet's
and SegNet's batch normalisation)."""
import numpy as np

from caffepar.nn.base import Layer, register
from caffepar.proto import caffe_pb2


def interp_matrix(size_in, size_out, dtype):
    """The (size_out, size_in) matrix of DeepLab's bilinear interpolation along one axis: corners
    aligned, the source position rounded through float32 as DeepLab computes it."""
    a = np.zeros((size_out, size_in), dtype)
    if size_in == size_out:
        np.fill_diagonal(a, 1)
        return a
    ratio = np.float32(size_in - 1) / np.float32(size_out - 1) if size_out > 1 else np.float32(0)
    pos = ratio * np.arange(size_out, dtype=np.float32)
    low = pos.astype(np.int64)
    step = (low < size_in - 1).astype(np.int64)
    frac = (pos - low.astype(np.float32)).astype(dtype)
    rows = np.arange(size_out)
    np.add.at(a, (rows, low), 1 - frac)
    np.add.at(a, (rows, low + step), frac)
    return a


@register("Interp")
class InterpLayer(Layer):
    """Bilinear resize of each channel with DeepLab's rules for the output size: zoom_factor,
    shrink_factor, both, height and width, or the size of a second bottom; pad_beg/pad_end
    (<= 0) crop the input first."""

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.interp_param
        self.pad_beg, self.pad_end = p.pad_beg, p.pad_end
        if self.pad_beg > 0 or self.pad_end > 0:
            raise self.error(f"pad_beg and pad_end must be <= 0 (they crop), got "
                             f"{self.pad_beg} and {self.pad_end}")
        for name in ("zoom_factor", "shrink_factor"):
            if p.HasField(name) and getattr(p, name) < 1:
                raise self.error(f"{name} must be >= 1, got {getattr(p, name)}")
        sized = (p.HasField("zoom_factor") or p.HasField("shrink_factor")
                 or (p.HasField("height") and p.HasField("width")) or len(bottom) == 2)
        if not sized:
            raise self.error("gives no output size: set zoom_factor, shrink_factor, height and "
                             "width, or a second bottom of the wanted size")

    def _out_size(self, size, other):
        p = self.param.interp_param
        eff = size + self.pad_beg + self.pad_end
        zoom, shrink = p.HasField("zoom_factor"), p.HasField("shrink_factor")
        if shrink:
            eff = (eff - 1) // p.shrink_factor + 1
        if zoom:
            return eff + (eff - 1) * (p.zoom_factor - 1)
        if shrink:
            return eff
        return other

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"bottom must have 4 axes (num, channels, height, width), got "
                             f"shape {bottom[0].shape}")
        p = self.param.interp_param
        n, c, h, w = bottom[0].shape
        if p.HasField("height") and p.HasField("width"):
            size = (p.height, p.width)
        elif len(bottom) == 2:
            size = bottom[1].shape[2:4]
        else:
            size = (None, None)
        self.h_in = h + self.pad_beg + self.pad_end
        self.w_in = w + self.pad_beg + self.pad_end
        self.h_out, self.w_out = self._out_size(h, size[0]), self._out_size(w, size[1])
        if self.h_in <= 0 or self.w_in <= 0 or self.h_out <= 0 or self.w_out <= 0:
            raise self.error(f"input {h}x{w} cropped by pads {self.pad_beg}/{self.pad_end} "
                             f"gives {self.h_in}x{self.w_in} -> {self.h_out}x{self.w_out}; "
                             f"sizes must be positive")
        top[0].reshape((n, c, self.h_out, self.w_out))
        self.ah = interp_matrix(self.h_in, self.h_out, self.dtype)
        self.aw = interp_matrix(self.w_in, self.w_out, self.dtype)

    def _crop(self, array):
        o = -self.pad_beg
        return array[:, :, o:o + self.h_in, o:o + self.w_in]

    def forward(self, bottom, top):
        top[0].data[...] = self.ah @ self._crop(bottom[0].data) @ self.aw.T

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        bottom[0].diff[...] = 0
        self._crop(bottom[0].diff)[...] = self.ah.T @ top[0].diff @ self.aw

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0


@register("Upsample")
class UpsampleLayer(Layer):
    """With two bottoms, SegNet's unpooling: each value goes to the position its max-pooling
    mask (the second bottom) names, the rest is zero. With one bottom, the YOLO ports'
    nearest-neighbour upsampling by an integer scale."""

    min_bottoms = 1
    max_bottoms = 2
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.upsample_param
        self.unpool = len(bottom) == 2
        if not self.unpool:
            extra = [f for f in ("scale_h", "scale_w", "pad_out_h", "pad_out_w", "upsample_h",
                                 "upsample_w") if p.HasField(f)]
            if extra:
                raise self.error(f"{', '.join(extra)} apply only to SegNet's form (a pooling "
                                 f"mask as second bottom); with one bottom only scale applies")
            self.scale = p.scale if p.HasField("scale") else 1
            if self.scale < 1:
                raise self.error(f"scale must be >= 1, got {self.scale}")
            return
        self.size = None
        if p.HasField("upsample_h") or p.HasField("upsample_w"):
            if not (p.HasField("upsample_h") and p.HasField("upsample_w")):
                raise self.error("give both upsample_h and upsample_w")
            if p.upsample_h <= 1 or p.upsample_w <= 1:
                raise self.error(f"upsample_h and upsample_w must be > 1, got "
                                 f"{p.upsample_h} and {p.upsample_w}")
            self.size = (p.upsample_h, p.upsample_w)
            return
        if p.HasField("scale_h") != p.HasField("scale_w") or \
                (p.HasField("scale_h") and p.HasField("scale")):
            raise self.error("give upsample_h and upsample_w, or scale, or scale_h and scale_w")
        if p.HasField("scale_h"):
            self.scales = (p.scale_h, p.scale_w)
        else:
            s = p.scale if p.HasField("scale") else 2
            self.scales = (s, s)
        if min(self.scales) <= 1:
            raise self.error(f"scale must be > 1, got {self.scales[0]}x{self.scales[1]}")
        self.pad_out = (int(p.pad_out_h), int(p.pad_out_w))
        for s, pad, axis in zip(self.scales, self.pad_out, "hw"):
            if pad and s != 2:
                raise self.error(f"pad_out_{axis} needs scale_{axis} 2, got {s}")

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.num_axes != 4:
            raise self.error(f"bottom must have 4 axes (num, channels, height, width), got "
                             f"shape {x.shape}")
        n, c, h, w = x.shape
        if not self.unpool:
            top[0].reshape((n, c, h * self.scale, w * self.scale))
            return
        if bottom[1].shape != x.shape:
            raise self.error(f"the mask bottom must have the shape of the data bottom "
                             f"{x.shape}, got {bottom[1].shape}")
        if self.size is not None:
            oh, ow = self.size
        else:
            oh = h * self.scales[0] - self.pad_out[0]
            ow = w * self.scales[1] - self.pad_out[1]
        top[0].reshape((n, c, oh, ow))

    def _mask(self, bottom, top):
        n, c = bottom[0].shape[:2]
        idx = bottom[1].data.reshape(n, c, -1).astype(np.int64)
        plane = top[0].shape[2] * top[0].shape[3]
        if idx.size and (idx.min() < 0 or idx.max() >= plane):
            raise self.error(f"mask index {int(idx.max() if idx.max() >= plane else idx.min())}"
                             f" is outside the {top[0].shape[2]}x{top[0].shape[3]} top: the "
                             f"scale must match the pooling layer that made the mask")
        return idx

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        if not self.unpool:
            s = self.scale
            n, c, h, w = x.shape
            y.reshape(n, c, h, s, w, s)[...] = x[:, :, :, None, :, None]
            return
        n, c = x.shape[:2]
        y[...] = 0
        np.put_along_axis(y.reshape(n, c, -1), self._mask(bottom, top), x.reshape(n, c, -1),
                          axis=2)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        n, c, h, w = dx.shape
        if not self.unpool:
            s = self.scale
            dx[...] = dy.reshape(n, c, h, s, w, s).sum(axis=(3, 5))
            return
        dx.reshape(n, c, -1)[...] = np.take_along_axis(dy.reshape(n, c, -1),
                                                        self._mask(bottom, top), axis=2)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0


def _segnet_fields(p):
    return [f for f in ("scale_filler", "shift_filler", "bn_mode") if p.HasField(f)]


def bn_uses_fixed_statistics(layer_param, phase):
    """Whether a BN layer (either fork's) is a fixed per-channel affine map in this phase:
    SegNet's in INFERENCE mode, PSPNet's frozen or in TEST."""
    p = layer_param.bn_param
    if _segnet_fields(p):
        return p.bn_mode != p.LEARN
    return p.frozen or phase != caffe_pb2.TRAIN


@register("BN")
class BNLayer(Layer):
    """BN of the segmentation forks, two layers under one name, told apart by their fields:

    * PSPNet's (hszhao/PSPNet, after yjxiong/caffe): blobs slope, bias, moving mean, moving
      variance, each (1, C, 1, 1). TEST or frozen: slope * (x - mean) / sqrt(var + eps) + bias.
      TRAIN: batch mean and (biased) variance, the moving ones updated as
      momentum * old + (1 - momentum) * batch. The moving blobs never learn (lr_mult 0), nor
      slope and bias when frozen.
    * SegNet's (alexgkendall/caffe-segnet; its prototxts give scale_filler, shift_filler and
      bn_mode, which tell it apart): blobs scale and shift. bn_mode LEARN normalises by the batch's statistics in every
      phase (eps 1e-9; tops 2 and 3, if present, are the batch mean and variance); INFERENCE is
      scale * x + shift, the statistics having been folded into the blobs."""

    exact_bottoms = 1
    min_tops = 1
    max_tops = 3

    def layer_setup(self, bottom, top):
        p = self.param.bn_param
        segnet = _segnet_fields(p)
        pspnet = [f for f in ("slope_filler", "bias_filler", "momentum", "eps", "frozen")
                  if p.HasField(f)]
        if segnet and pspnet:
            raise self.error(f"mixes SegNet's BN fields ({', '.join(segnet)}) with PSPNet's "
                             f"({', '.join(pspnet)})")
        self.segnet = bool(segnet)
        if len(top) > 1 and not (self.segnet and p.bn_mode == p.LEARN):
            raise self.error("only SegNet's BN in LEARN mode has batch mean and variance tops")
        if bottom[0].num_axes != 4:
            raise self.error(f"bottom must have 4 axes, got shape {bottom[0].shape}")
        c = bottom[0].shape[1]
        shape = (1, c, 1, 1)
        if self.segnet:
            self.batch_stats = not bn_uses_fixed_statistics(self.param, self.phase)
            self.eps = 1e-9
            if not self.blobs_already_set(2):
                self.add_param_blob(shape, p.scale_filler)
                self.add_param_blob(shape, p.shift_filler)
        else:
            self.frozen, self.momentum, self.eps = p.frozen, p.momentum, p.eps
            self.batch_stats = not bn_uses_fixed_statistics(self.param, self.phase)
            if not self.blobs_already_set(4):
                self.add_param_blob(shape, p.slope_filler)
                self.add_param_blob(shape, p.bias_filler)
                self.add_param_blob(shape)
                self.add_param_blob(shape).data[...] = 1 if self.frozen else 0
            specs = self.param.param
            while len(specs) < 4:
                specs.add()
            for i in (0, 1, 2, 3) if self.frozen else (2, 3):
                specs[i].lr_mult = 0
                specs[i].decay_mult = 0
        for b in self.blobs:
            if b.shape != shape:
                raise self.error(f"blob shape {b.shape}, expected {shape}")

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4 or bottom[0].shape[1] != self.blobs[0].shape[1]:
            raise self.error(f"bottom shape {bottom[0].shape} does not have the layer's "
                             f"{self.blobs[0].shape[1]} channels")
        top[0].reshape(bottom[0].shape)
        for t in top[1:]:
            t.reshape(self.blobs[0].shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        scale, shift = self.blobs[0].data, self.blobs[1].data
        if self.segnet and not self.batch_stats:
            top[0].data[...] = scale * x + shift
            return
        if self.batch_stats:
            mean = x.mean(axis=(0, 2, 3), keepdims=True)
            var = np.square(x - mean).mean(axis=(0, 2, 3), keepdims=True)
            if not self.segnet:
                m = self.dtype.type(self.momentum)
                self.blobs[2].data[...] = (1 - m) * mean + m * self.blobs[2].data
                self.blobs[3].data[...] = (1 - m) * var + m * self.blobs[3].data
            for t, stat in zip(top[1:], (mean, var)):
                t.data[...] = stat
        else:
            mean, var = self.blobs[2].data.copy(), self.blobs[3].data.copy()
        self.inv_std = 1 / np.sqrt(var + self.dtype.type(self.eps))
        self.x_hat = (x - mean) * self.inv_std
        top[0].data[...] = scale * self.x_hat + shift

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        x_hat = bottom[0].data if self.segnet and not self.batch_stats else self.x_hat
        if self.param_propagate_down[0]:
            self.blobs[0].diff += (dy * x_hat).sum(axis=(0, 2, 3), keepdims=True)
        if self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=(0, 2, 3), keepdims=True)
        if not propagate_down[0]:
            return
        scale = self.blobs[0].data
        if self.segnet and not self.batch_stats:
            bottom[0].diff[...] = scale * dy
            return
        g = dy * scale
        if self.batch_stats:
            g = g - g.mean(axis=(0, 2, 3), keepdims=True) - \
                x_hat * (g * x_hat).mean(axis=(0, 2, 3), keepdims=True)
        bottom[0].diff[...] = g * self.inv_std
