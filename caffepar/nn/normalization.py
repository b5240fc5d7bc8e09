"""Normalisation layers: LRN, BatchNorm and MVN, as BVLC Caffe computes them."""
import math

import numpy as np

from caffepar.nn import native
from caffepar.nn.base import Layer, register
from caffepar.nn.blas import channel_parts, run_parts, scratch, split_parts
from caffepar.proto import caffe_pb2

LRNP = caffe_pb2.LRNParameter
LRN_BLOCK_BYTES = 1 << 20


def window_sum(a, axis, size, out=None):
    """Sum over a centred window of odd `size` along `axis`, zero beyond the edges."""
    half = (size - 1) // 2
    if out is None:
        out = a.copy()
    else:
        np.copyto(out, a)
    n = a.shape[axis]

    def part(start, stop):
        idx = [slice(None)] * a.ndim
        idx[axis] = slice(start, stop)
        return tuple(idx)

    for d in range(1, min(half, n - 1) + 1):
        out[part(d, n)] += a[part(0, n - d)]
        out[part(0, n - d)] += a[part(d, n)]
    return out


def neg_power(s, beta, out):
    """s ** -beta (`out` must not be `s`); AlexNet's beta 0.75 as s^(1/4) / s, through square
    roots, which is much faster than pow."""
    if beta == 0.75:
        np.sqrt(s, out=out)
        np.sqrt(out, out=out)
        np.divide(out, s, out=out)
    elif beta == 0.5:
        np.sqrt(s, out=out)
        np.reciprocal(out, out=out)
    elif beta == 1:
        np.reciprocal(s, out=out)
    else:
        np.power(s, -beta, out=out)
    return out


def _image_blocks(x):
    """Runs of images whose scratch stays in cache; NumPy's per-call cost caps how small."""
    step = max(1, LRN_BLOCK_BYTES // max(1, x[0].nbytes)) if len(x) else 1
    return step, [(i, min(len(x), i + step)) for i in range(0, len(x), step)]




def _run_images(kernel, arrays, shape, extra):
    """A compiled kernel over the images side by side (arrays (N, C, H, W)), each thread with a
    work array of C + 1 planes."""
    n, c = shape[:2]
    hw = math.prod(shape[2:])
    bases = [(native.ptr(a), a.strides[0]) for a in arrays]

    def run(images):
        work = scratch("lrn_a", ((c + 1) * hw,), arrays[0].dtype)
        kernel(*[b + images[0] * s for b, s in bases], native.ptr(work), len(images), c, hw,
               *extra)

    run_parts(run, split_parts(range(n), n))


@register("LRN")
class LRNLayer(Layer):
    """Local response normalisation.

    ACROSS_CHANNELS: y = x (k + alpha/n sum_{local_size channels} x^2)^-beta.
    WITHIN_CHANNEL: Caffe builds it from Power/Pooling layers that ignore `k`:
    y = x (1 + alpha avgpool_{n x n}(x^2))^-beta, the average counting the zero padding.
    """

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.lrn_param
        self.size = p.local_size
        if self.size % 2 != 1:
            raise self.error(f"LRN only supports odd values for local_size, got {self.size}")
        self.alpha, self.beta, self.k = p.alpha, p.beta, p.k
        self.region = p.norm_region
        if self.region not in (LRNP.ACROSS_CHANNELS, LRNP.WITHIN_CHANNEL):
            raise self.error(f"unknown normalization region {self.region}")

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"input must have 4 axes (num, channels, height, width), got shape "
                             f"{bottom[0].shape}")
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        y = top[0].data
        if self.region == LRNP.ACROSS_CHANNELS:
            self._across_forward(x, y)
        else:
            pooled = window_sum(window_sum(np.square(x), 2, self.size), 3, self.size)
            pooled *= self.alpha / (self.size * self.size)
            pooled += 1
            self.base = pooled
            self.factor = neg_power(pooled, self.beta, np.empty_like(pooled))
            np.multiply(x, self.factor, out=y)

    def _across_forward(self, x, y):
        """scale = k + alpha/n * window sum of x^2, kept for backward with scale^-beta; a
        block of images at a time so the passes run in cache, the blocks spread over the
        cores."""
        if getattr(self, "scale", None) is None or self.scale.shape != x.shape \
                or self.scale.dtype != x.dtype:
            self.scale = np.empty_like(x)
            self.power = np.empty_like(x)
        k = native.kernels_for(x, y, self.scale)
        if k is not None:
            _run_images(k.lrn_forward, (x, y, self.scale, self.power), x.shape,
                        (self.size, self.alpha / self.size, self.k, self.beta))
            return
        step, blocks = _image_blocks(x)
        half = (self.size - 1) // 2
        c = x.shape[1]

        block = (min(step, len(x)),) + x.shape[1:]

        def run(blocks):
            sq = scratch("lrn_a", block, x.dtype)
            for i, j in blocks:
                xb, sc, q = x[i:j], self.scale[i:j], sq[:j - i]
                np.multiply(xb, xb, out=q)
                q *= self.alpha / self.size
                np.add(q, self.k, out=sc)
                for d in range(1, min(half, c - 1) + 1):
                    sc[:, d:] += q[:, :c - d]
                    sc[:, :c - d] += q[:, d:]
                neg_power(sc, self.beta, self.power[i:j])
                np.multiply(xb, self.power[i:j], out=y[i:j])

        run_parts(run, split_parts(blocks))

    def _across_backward(self, x, y, dy, dx):
        """dx = dy scale^-beta - 2 alpha beta / n * x * window sum of dy y / scale."""
        factor = -2.0 * self.alpha * self.beta / self.size
        k = native.kernels_for(x, y, dy, dx, self.scale)
        if k is not None:
            _run_images(k.lrn_backward, (x, y, dy, dx, self.scale, self.power), x.shape,
                        (self.size, factor))
            return
        step, blocks = _image_blocks(x)

        block = (min(step, len(x)),) + x.shape[1:]

        def run(blocks):
            ratio, acc = scratch("lrn_a", block, x.dtype), scratch("lrn_b", block, x.dtype)
            for i, j in blocks:
                r, a = ratio[:j - i], acc[:j - i]
                np.multiply(dy[i:j], y[i:j], out=r)
                r /= self.scale[i:j]
                r *= factor
                window_sum(r, 1, self.size, out=a)
                a *= x[i:j]
                np.multiply(dy[i:j], self.power[i:j], out=dx[i:j])
                dx[i:j] += a

        run_parts(run, split_parts(blocks))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        x = bottom[0].data
        dx = bottom[0].diff
        if self.region == LRNP.ACROSS_CHANNELS:
            self._across_backward(x, top[0].data, dy, dx)
        else:
            # d/d(pooled sum): -beta * alpha / n^2 * factor / base, times dy * x
            g = dy * x
            g *= self.factor
            g /= self.base
            g *= -self.beta * self.alpha / (self.size * self.size)
            g = window_sum(window_sum(g, 2, self.size), 3, self.size)
            g *= 2 * x
            np.multiply(dy, self.factor, out=dx)
            dx += g


@register("BatchNorm")
class BatchNormLayer(Layer):
    """Normalise each channel by batch statistics (TRAIN) or stored ones (TEST by default).

    Blobs (kept unscaled, as Caffe does): 0 = running mean sum, 1 = running variance sum
    (unbiased, m/(m-1)), 2 = the scale factor dividing both. Their lr_mult is forced to 0.

    In a P-rank run the batch statistics are those of the whole batch (sums over the ranks
    through `replica_sum`), so that P ranks at batch B train as one process at batch P*B.
    """

    exact_bottoms = 1
    exact_tops = 1
    uses_replica_sum = True
    replica_sum = None
    # Training's in-place BatchNorm -> Scale chain (Net.scale_of_norm): the Scale whose map
    # this forward may apply as it normalizes (scale_top; `scaled` says whether it did), and
    # the sums and scale a Scale backward left for this backward to finish its diff with.
    scale_top = None
    scaled = False
    deferred_scale = None

    def layer_setup(self, bottom, top):
        p = self.param.batch_norm_param
        self.fraction = p.moving_average_fraction
        self.use_global = p.use_global_stats if p.HasField("use_global_stats") \
            else self.phase == caffe_pb2.TEST
        self.channels = 1 if bottom[0].num_axes == 1 else bottom[0].shape[1]
        self.eps = p.eps
        if not self.blobs_already_set(3):
            for shape in ((self.channels,), (self.channels,), (1,)):
                self.add_param_blob(shape)
        specs = self.param.param
        for i in range(len(self.blobs)):
            if len(specs) == i:
                specs.add().lr_mult = 0.0
            elif specs[i].lr_mult != 0:
                raise self.error("cannot configure batch normalization statistics as layer "
                                 f"parameters (param {i} has lr_mult {specs[i].lr_mult}; it "
                                 "must be 0 or left out)")

    def reshape(self, bottom, top):
        if bottom[0].num_axes > 1 and bottom[0].shape[1] != self.channels:
            raise self.error(f"bottom has {bottom[0].shape[1]} channels, the layer was set up "
                             f"for {self.channels}")
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def _view(self, a):
        n = a.shape[0] if a.ndim else 1
        return a.reshape(n, self.channels, -1)

    def forward(self, bottom, top):
        if self.scaled:
            self.scaled = False
        x = self._view(bottom[0].data)
        y = self._view(top[0].data)
        if self.use_global:
            s = self.blobs[2].data.flat[0]
            factor = 0 if s == 0 else 1 / s
            mean = self.blobs[0].data * factor
            var = self.blobs[1].data * factor
            np.subtract(x, mean[:, None].astype(self.dtype), out=y)
            self.std = np.sqrt(var + self.eps).astype(self.dtype)
            y /= self.std[:, None]
            self.x_norm = None
            return
        k = native.kernels_for(x, y)
        mean, var, m = self._statistics(x, y) if k is None else \
            self._compiled_statistics(k, x)
        b = self.blobs
        b[2].data[...] = b[2].data * self.fraction + 1
        b[0].data[...] = mean + self.fraction * b[0].data
        correction = m / (m - 1) if m > 1 else 1
        b[1].data[...] = correction * var + self.fraction * b[1].data
        self.std = np.sqrt(var + self.eps).astype(self.dtype)
        if k is None:
            y /= self.std[:, None]
            self.x_norm = y.copy()
            return
        norm = getattr(self, "x_norm", None)
        if norm is None or norm.shape != y.shape:
            norm = self.x_norm = np.empty_like(y)
        n, c, size = x.shape
        ptr = native.ptr
        affine = self._scale_map(top, x.shape) if self.scale_top is not None else None
        if affine is not None:
            g, b = affine
            slope = self.scale_top.relu_top
            run_parts(lambda r: k.bn_normalize_affine(
                ptr(x), ptr(mean), ptr(self.std), ptr(g), 0 if b is None else ptr(b), ptr(y),
                ptr(norm), slope or 0.0, slope is not None, n, c, size, r.start, r.stop),
                channel_parts(c))
            self.scale_top.borrow_input(norm)
            self.scaled = True
            return
        run_parts(lambda r: k.bn_normalize(ptr(x), ptr(mean), ptr(self.std), ptr(y), ptr(norm),
                                           n, c, size, r.start, r.stop), channel_parts(c))

    def _scale_map(self, top, shape):
        """(scale, bias or None) of scale_top where its map is one value per channel of this
        layer's top, as compiled kernels take them; else None (the Scale runs itself)."""
        scale = self.scale_top
        scale.reshape(top, top)
        if scale.dims != shape or (scale.bias_term and scale.bias_dims != shape):
            return None
        g = scale.blobs[0].data
        b = scale.blobs[-1].data if scale.bias_term else None
        if native.kernels_for(top[0].data, g, *(() if b is None else (b,))) is None:
            return None
        return g, b

    def _statistics(self, x, y):
        """(mean, variance, values a channel averages) of the batch, y = x - mean."""
        if self.replica_sum is not None:
            total = self.replica_sum(np.append(x.sum(axis=(0, 2), dtype=np.float64),
                                               x.size // self.channels), "BatchNorm mean")
            self.count = int(total[-1])
            mean = (total[:-1] / self.count).astype(self.dtype)
        else:
            mean = x.mean(axis=(0, 2))
        np.subtract(x, mean[:, None].astype(self.dtype), out=y)
        if self.replica_sum is not None:
            var = (self.replica_sum(np.square(y).sum(axis=(0, 2), dtype=np.float64),
                                    "BatchNorm variance") / self.count).astype(self.dtype)
            return mean, var, self.count
        return mean, np.square(y).mean(axis=(0, 2)), x.size // self.channels

    def _compiled_statistics(self, k, x):
        """_statistics' mean, variance and count from one read of x: the sums of the values and
        of their squares in double (the variance is theirs, not the sum of rounded squared
        deviations, within a few float roundings of it); y is written by the normalization
        that follows."""
        n, c, size = x.shape
        ptr = native.ptr
        sums, squares = np.empty(c), np.empty(c)
        run_parts(lambda r: k.bn_sums_squares(ptr(x), ptr(sums), ptr(squares), n, c, size,
                                              r.start, r.stop), channel_parts(c))
        count = n * size
        if self.replica_sum is not None:
            total = self.replica_sum(np.concatenate([sums, squares, [count]]),
                                     "BatchNorm statistics")
            sums, squares, count = total[:c], total[c:2 * c], int(total[-1])
            self.count = count
        mean = sums / count
        var = np.maximum(squares / count - mean * mean, 0.0)
        return mean.astype(self.dtype), var.astype(self.dtype), count

    def backward(self, top, propagate_down, bottom):
        deferred, self.deferred_scale = self.deferred_scale, None
        if not propagate_down[0]:
            return
        dy = self._view(top[0].diff)
        dx = self._view(bottom[0].diff)
        if self.use_global:
            np.divide(dy, self.std[:, None], out=dx)
            return
        y = self.x_norm
        k = native.kernels_for(dy, y, dx)
        n = y.shape[0] * y.shape[2]
        if deferred is not None:
            self._backward_after_scale(k, dy, y, dx, n, *deferred)
            return
        if k is not None:
            images, c, size = y.shape
            ptr, parts = native.ptr, channel_parts(c)
            a, b = np.empty(c), np.empty(c)
            # Scale's sums (dy * y and dy, no diff): the same read
            run_parts(lambda r: k.scale_backward(ptr(dy), ptr(y), 0, ptr(a), ptr(b), 0, images,
                                                 c, size, r.start, r.stop), parts)
            if self.replica_sum is not None:
                total = self.replica_sum(np.concatenate([a, b]), "BatchNorm diff")
                a, b, n = total[:c], total[c:], self.count
            a, b = a.astype(self.dtype), b.astype(self.dtype)
            run_parts(lambda r: k.bn_backward(ptr(dy), ptr(y), ptr(a), ptr(b), ptr(self.std),
                                              ptr(dx), -1.0 / n, images, c, size, r.start,
                                              r.stop), parts)
            return
        a = np.einsum("ncs,ncs->c", dy, y)[:, None]
        b = dy.sum(axis=(0, 2))[:, None]
        if self.replica_sum is not None:
            total = self.replica_sum(np.concatenate([a[:, 0], b[:, 0]]), "BatchNorm diff")
            a = total[:self.channels, None].astype(self.dtype)
            b = total[self.channels:, None].astype(self.dtype)
            n = self.count
        t = y * a
        t += b
        t *= -1.0 / n
        t += dy
        t /= self.std[:, None]
        dx[...] = t

    def _backward_after_scale(self, k, dy, y, dx, n, a, b, gamma):
        """The diff through an in-place Scale whose backward left its top's diff dy as it was
        and the sums a = sum(dy * norm), b = sum(dy) (Scale's own, ScaleLayer.defer_to):
        with the Scale's diff gamma * dy, the sums are gamma * a and gamma * b, so that dx =
        (dy - (norm * a + b) / n) / (std / gamma): one pass, none for the Scale's diff nor
        for this layer's sums."""
        c = self.channels
        if self.replica_sum is not None:
            total = self.replica_sum(np.concatenate([a, b]), "BatchNorm diff")
            a, b, n = total[:c], total[c:], self.count
        a, b = a.astype(self.dtype), b.astype(self.dtype)
        with np.errstate(divide="ignore"):
            std = (self.std / gamma.reshape(-1)).astype(self.dtype)
        if k is not None:
            images, c, size = y.shape
            ptr = native.ptr
            run_parts(lambda r: k.bn_backward(ptr(dy), ptr(y), ptr(a), ptr(b), ptr(std),
                                              ptr(dx), -1.0 / n, images, c, size, r.start,
                                              r.stop), channel_parts(c))
            return
        t = y * a[:, None]
        t += b[:, None]
        t *= -1.0 / n
        t += dy
        t /= std[:, None]
        dx[...] = t


@register("MVN")
class MVNLayer(Layer):
    """Subtract the mean (and divide by std + eps) per sample and channel, or per sample when
    across_channels. The top takes Caffe's 4-D (num, channels, height, width) shape."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.mvn_param
        self.normalize_variance = p.normalize_variance
        self.across = p.across_channels
        self.eps = p.eps

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) > 4:
            raise self.error(f"MVN takes at most 4 axes, got shape {shape}")
        legacy = tuple(shape) + (1,) * (4 - len(shape))
        top[0].reshape(legacy)

    def _groups(self, a):
        shape = a.shape + (1,) * (4 - a.ndim)
        rows = shape[0] if self.across else shape[0] * shape[1]
        return a.reshape(rows, -1)

    def forward(self, bottom, top):
        x = self._groups(bottom[0].data)
        y = self._groups(top[0].data)
        mean = x.mean(axis=1, keepdims=True)
        np.subtract(x, mean, out=y)
        if self.normalize_variance:
            var = np.square(y).mean(axis=1, keepdims=True)
            self.std = np.sqrt(var) + self.eps
            y /= self.std

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = self._groups(top[0].diff)
        dx = self._groups(bottom[0].diff)
        dim = dy.shape[1]
        if self.normalize_variance:
            y = self._groups(top[0].data)
            a = np.einsum("ij,ij->i", y, dy)[:, None]
            b = dy.sum(axis=1, keepdims=True)
            t = y * a
            t += b
            t *= -1.0 / dim
            t += dy
            t /= self.std
            dx[...] = t
        else:
            dx[...] = dy - dy.mean(axis=1, keepdims=True)
