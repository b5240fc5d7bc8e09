"""Element-wise (neuron) layers: one bottom, one top of the same shape.

Backward passes read `bottom[0].data` exactly where Caffe does, so in-place use gives Caffe's
results (for ReLU/ELU/Sigmoid/TanH/Swish/Dropout/PReLU the in-place result is the true
gradient; for the others it is whatever Caffe computes from the overwritten input)."""
import math
from functools import partial

import numpy as np

from caffepar import common
from caffepar.nn import native
from caffepar.nn.base import Layer, register
from caffepar.nn.blas import blas_threads, run_parts, scratch
from caffepar.nn.prepared import clip_call, prelu_call, relu_call
from caffepar.proto import caffe_pb2


CHUNK = 1 << 18


def _chunks(*arrays):
    """Flat, equally placed slices of same-sized arrays, small enough that the scratch a pass
    needs stays in cache instead of taking a full-size temporary."""
    flat = [a.reshape(-1) for a in arrays]
    for i in range(0, flat[0].size, CHUNK):
        yield tuple(f[i:i + CHUNK] for f in flat)


class NeuronLayer(Layer):
    exact_bottoms = 1
    exact_tops = 1
    allow_in_place = True

    def layer_setup(self, bottom, top):
        if not self.allow_in_place and top[0] is bottom[0]:
            raise self.error("does not allow in-place computation (top and bottom are the same "
                             f'blob "{self.param.top[0]}")')
        self.neuron_setup(bottom, top)

    def neuron_setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        if top[0] is not bottom[0]:          # in place: the shape is the bottom's already
            top[0].reshape(bottom[0].shape)

    def prepare_forward(self, bottom, top):
        """A neuron's reshape depends on shapes alone: its forward is the call."""
        return partial(self.forward, bottom, top)

    def scratch(self, name, size, dtype):
        """A chunk-sized buffer kept across calls, so no pass allocates."""
        size = min(CHUNK, size)
        buf = self.__dict__.get("_scratch_" + name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = np.empty(max(size, 1), dtype)
            setattr(self, "_scratch_" + name, buf)
        return buf


def _compiled(*arrays):
    """The compiled kernels when every array is C-contiguous (float ones of one dtype), else
    None."""
    for a in arrays:
        if not a.flags.c_contiguous:
            return None
    return native.kernels(arrays[0].dtype)


def _side_by_side(kernel, arrays, extra=()):
    """kernel(*pointers, count, *extra) over equal flat runs of the arrays, side by side."""
    n = arrays[0].size
    if n < 2 * CHUNK:           # one run, called here: a net of tiny layers pays no hand-out
        kernel(*[native.ptr(a) for a in arrays], n, *extra)
        return
    runs = max(1, min(4 * blas_threads(), n // CHUNK))
    bases = [(native.ptr(a), a.itemsize) for a in arrays]
    bounds = [n * i // runs for i in range(runs + 1)]
    run_parts(lambda r: kernel(*[b + r[0] * s for b, s in bases], r[1] - r[0], *extra),
              list(zip(bounds, bounds[1:])))


def _sigmoid(x, out):
    """Caffe's sigmoid, 0.5 * tanh(0.5 x) + 0.5: stable for large |x| without branches."""
    np.multiply(x, 0.5, out=out)
    np.tanh(out, out=out)
    out *= 0.5
    out += 0.5
    return out


def relu_forward(x, y, slope, scratch=None):
    """y = max(x, 0) + slope * min(x, 0), side by side on the cores; scratch(name, size,
    dtype) gives the NumPy path its chunk buffers (default: fresh ones). As Caffe's std::max
    and std::min compute it: x where x < 0 is false (-0 and NaN kept), else +0 + slope * x
    (NumPy's maximum turns -0 into +0)."""
    k = _compiled(x, y)
    if k is not None:       # 3-4x NumPy's np.maximum, which also checks for NaNs
        n = x.size
        if n < 2 * CHUNK:   # in place, one address read (a net of millions of tiny ReLUs)
            px = native.ptr(x)
            k.relu_forward(px, px if y is x else native.ptr(y), n, slope)
        else:
            _side_by_side(k.relu_forward, (x, y), (slope,))
        return
    scratch = scratch or (lambda name, size, dtype: np.empty(min(CHUNK, size), dtype))
    buf, below = scratch("neg", x.size, x.dtype), scratch("below", x.size, bool)
    for xc, yc in _chunks(x, y):
        t, m = buf[:len(xc)], below[:len(xc)]
        np.less(xc, 0, out=m)
        with np.errstate(invalid="ignore"):     # inf * 0, where x < 0 is false: unused
            np.multiply(xc, slope, out=t)
        t += 0
        if x is not y:
            np.copyto(yc, xc)
        np.copyto(yc, t, where=m)


def relu_backward(x, dy, dx, slope, scratch=None):
    """dx = dy where x > 0, else dy * slope (x: the ReLU's input, or its output in place)."""
    scratch = scratch or (lambda name, size, dtype: np.empty(min(CHUNK, size), dtype))
    k = _compiled(x, dy, dx)
    if k is not None:
        _side_by_side(k.relu_backward, (x, dy, dx), (slope,))
        return
    positive = scratch("positive", x.size, bool)
    if slope == 0:
        for xc, dyc, dxc in _chunks(x, dy, dx):
            m = positive[:len(xc)]
            np.greater(xc, 0, out=m)
            np.multiply(dyc, m, out=dxc)
        return
    one, s = dx.dtype.type(1), dx.dtype.type(slope)
    for xc, dyc, dxc in _chunks(x, dy, dx):
        m = positive[:len(xc)]
        np.greater(xc, 0, out=m)
        np.multiply(dyc, np.where(m, one, s), out=dxc)


@register("ReLU")
class ReLULayer(NeuronLayer):
    """max(x, 0) + negative_slope * min(x, 0)."""

    def neuron_setup(self, bottom, top):
        slope = self.param.relu_param.negative_slope
        self.slope = float(slope) if slope else 0.0     # one float object for every plain ReLU

    def forward(self, bottom, top):
        relu_forward(bottom[0].data, top[0].data, self.slope, self.scratch)

    def prepare_forward(self, bottom, top):
        return relu_call(bottom[0].data, top[0].data, self.slope)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            relu_backward(bottom[0].data, top[0].diff, bottom[0].diff, self.slope, self.scratch)


@register("PReLU")
class PReLULayer(NeuronLayer):
    """ReLU with a learned negative slope per channel (axis 1), or one shared slope."""

    def neuron_setup(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes, got shape {bottom[0].shape}")
        p = self.param.prelu_param
        self.channel_shared = p.channel_shared
        channels = bottom[0].shape[1]
        if not self.blobs_already_set(1):
            if p.HasField("filler"):
                filler = p.filler
            else:
                filler = caffe_pb2.FillerParameter(type="constant", value=0.25)
            self.add_param_blob(() if self.channel_shared else (channels,), filler)
        want = 1 if self.channel_shared else channels
        if self.blobs[0].count != want:
            raise self.error(f"negative slope blob has {self.blobs[0].count} values, the "
                             f"configuration needs {want}")
        self.saved_input = None

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes, got shape {bottom[0].shape}")
        top[0].reshape(bottom[0].shape)

    def _slope(self, x):
        s = self.blobs[0].data
        if self.channel_shared:
            return s.reshape(())
        return s.reshape((1, -1) + (1,) * (x.ndim - 2))

    def forward(self, bottom, top):
        x = bottom[0].data
        if top[0] is bottom[0]:
            self.saved_input = x.copy()
            x = self.saved_input
        np.multiply(np.minimum(x, 0), self._slope(x), out=top[0].data)
        top[0].data += np.maximum(x, 0)

    def prepare_forward(self, bottom, top):
        return prelu_call(bottom[0].data, top[0].data, self.blobs[0].data)

    def backward(self, top, propagate_down, bottom):
        x = self.saved_input if top[0] is bottom[0] else bottom[0].data
        dy = top[0].diff
        neg = x <= 0
        if self.param_propagate_down[0]:
            g = dy * x
            g *= neg
            if self.channel_shared:
                self.blobs[0].diff += g.sum()
            else:
                axes = (0,) + tuple(range(2, x.ndim))
                self.blobs[0].diff += g.sum(axis=axes)
        if propagate_down[0]:
            slope = self._slope(x)
            factor = np.where(neg, slope, np.ones((), self.dtype)).astype(self.dtype, copy=False)
            np.multiply(dy, factor, out=bottom[0].diff)


@register("ELU")
class ELULayer(NeuronLayer):
    """x for x > 0, alpha * (exp(x) - 1) otherwise."""

    def neuron_setup(self, bottom, top):
        self.alpha = float(self.param.elu_param.alpha)

    def forward(self, bottom, top):
        x = bottom[0].data
        neg = np.minimum(x, 0)
        np.exp(neg, out=neg)
        neg -= 1
        neg *= self.alpha
        np.maximum(x, 0, out=top[0].data)
        top[0].data += neg

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x, y = bottom[0].data, top[0].data
        factor = np.where(x > 0, np.ones((), self.dtype), y + self.dtype.type(self.alpha))
        np.multiply(top[0].diff, factor, out=bottom[0].diff)


@register("Sigmoid")
class SigmoidLayer(NeuronLayer):
    def forward(self, bottom, top):
        _sigmoid(bottom[0].data, top[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        factor = 1 - y
        factor *= y
        np.multiply(top[0].diff, factor, out=bottom[0].diff)


@register("TanH")
class TanHLayer(NeuronLayer):
    def forward(self, bottom, top):
        np.tanh(bottom[0].data, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y = top[0].data
        factor = np.square(y)
        np.subtract(1, factor, out=factor)
        np.multiply(top[0].diff, factor, out=bottom[0].diff)


@register("AbsVal")
class AbsValLayer(NeuronLayer):
    allow_in_place = False

    def forward(self, bottom, top):
        np.abs(bottom[0].data, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            np.multiply(top[0].diff, np.sign(bottom[0].data), out=bottom[0].diff)


@register("Power")
class PowerLayer(NeuronLayer):
    """(shift + scale * x) ^ power, with Caffe's special cases: a constant output when
    power * scale == 0, and the derivative shortcuts for power 1, power 2 and shift 0."""

    def neuron_setup(self, bottom, top):
        p = self.param.power_param
        t = self.dtype.type
        self.power, self.scale, self.shift = t(p.power), t(p.scale), t(p.shift)
        self.diff_scale = self.power * self.scale

    def forward(self, bottom, top):
        y = top[0].data
        if self.diff_scale == 0:
            y[...] = 1 if self.power == 0 else np.power(self.shift, self.power)
            return
        np.multiply(bottom[0].data, self.scale, out=y)
        if self.shift != 0:
            y += self.shift
        if self.power != 1:
            np.power(y, self.power, out=y)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx, dy = bottom[0].diff, top[0].diff
        if self.diff_scale == 0 or self.power == 1:
            np.multiply(dy, self.diff_scale, out=dx)
            return
        x = bottom[0].data
        if self.power == 2:
            g = x * (self.diff_scale * self.scale)
            if self.shift != 0:
                g += self.diff_scale * self.shift
        elif self.shift == 0:
            g = top[0].data / x
            g *= self.power
        else:
            g = x * self.scale
            g += self.shift
            np.divide(top[0].data, g, out=g)
            if self.diff_scale != 1:
                g *= self.diff_scale
        np.multiply(dy, g, out=dx)


def _log_base(layer, base):
    if base != -1 and base <= 0:
        raise layer.error(f"base must be strictly positive (or -1 for e), got {base}")
    log_base = 1.0 if base == -1 else math.log(base)
    if log_base == 0:
        raise layer.error("base 1 makes log(base) zero")
    return log_base


@register("Exp")
class ExpLayer(NeuronLayer):
    """base ^ (shift + scale * x); base -1 means e."""

    def neuron_setup(self, bottom, top):
        p = self.param.exp_param
        base = float(p.base)
        self.inner_scale = _log_base(self, base) * p.scale
        if p.shift == 0:
            self.outer_scale = 1.0
        else:
            self.outer_scale = math.exp(p.shift) if base == -1 else base ** p.shift

    def forward(self, bottom, top):
        y = top[0].data
        if self.inner_scale == 1:
            np.exp(bottom[0].data, out=y)
        else:
            np.multiply(bottom[0].data, self.inner_scale, out=y)
            np.exp(y, out=y)
        if self.outer_scale != 1:
            y *= self.outer_scale

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        np.multiply(top[0].data, top[0].diff, out=dx)
        if self.inner_scale != 1:
            dx *= self.inner_scale


@register("Log")
class LogLayer(NeuronLayer):
    """log_base(shift + scale * x); base -1 means e."""

    def neuron_setup(self, bottom, top):
        p = self.param.log_param
        log_base = _log_base(self, float(p.base))
        self.base_scale = 1.0 / log_base
        self.scale, self.shift = float(p.scale), float(p.shift)
        self.backward_scale = self.scale / log_base

    def _inner(self, x, out):
        np.multiply(x, self.scale, out=out)
        if self.shift != 0:
            out += self.shift
        return out

    def forward(self, bottom, top):
        y = top[0].data
        self._inner(bottom[0].data, y)
        np.log(y, out=y)
        if self.base_scale != 1:
            y *= self.base_scale

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        g = self._inner(bottom[0].data, np.empty(bottom[0].shape, self.dtype))
        np.reciprocal(g, out=g)
        if self.backward_scale != 1:
            g *= self.backward_scale
        np.multiply(top[0].diff, g, out=bottom[0].diff)


@register("BNLL")
class BNLLLayer(NeuronLayer):
    """log(1 + exp(x)), computed without overflow."""

    def forward(self, bottom, top):
        x = bottom[0].data
        t = np.abs(x)
        np.negative(t, out=t)
        np.exp(t, out=t)
        np.log1p(t, out=t)
        np.maximum(x, 0, out=top[0].data)
        top[0].data += t

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        e = np.minimum(bottom[0].data, 50)
        np.exp(e, out=e)
        denom = e + 1
        e /= denom
        np.multiply(top[0].diff, e, out=bottom[0].diff)


@register("Threshold")
class ThresholdLayer(NeuronLayer):
    """1 where x > threshold, else 0; Caffe has no backward for it."""

    def neuron_setup(self, bottom, top):
        self.threshold = self.param.threshold_param.threshold

    def forward(self, bottom, top):
        np.greater(bottom[0].data, self.threshold, out=top[0].data, casting="unsafe")


@register("Dropout")
class DropoutLayer(NeuronLayer):
    """TRAIN: keep each value with probability 1 - ratio and scale kept values by 1/(1 - ratio)
    (Caffe scales at train time so TEST is the identity). A `scale_train: false` field, where
    the schema has one, moves the scaling to TEST as (1 - ratio)."""

    def neuron_setup(self, bottom, top):
        p = self.param.dropout_param
        self.ratio = float(p.dropout_ratio)
        if not 0 < self.ratio < 1:
            raise self.error(f"dropout_ratio must be in (0, 1), got {self.ratio}")
        self.scale_train = bool(getattr(p, "scale_train", True))
        self.scale = 1.0 / (1.0 - self.ratio)
        self.mask = None

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        if self.phase == caffe_pb2.TRAIN:
            if self.mask is None or self.mask.shape != x.shape:
                self.mask = np.empty(x.shape, bool)
            k = _compiled(x, y)
            if k is not None:
                draws = scratch("dropout_draws", x.shape, np.float32)
                common.rng().random(dtype=np.float32, out=draws)
                _side_by_side(k.dropout_forward, (x, draws, y, self.mask),
                              (self.ratio, self.scale, self.scale_train))
                return
            draws = self.scratch("draws", x.size, np.float32)
            rng, ratio, scale = common.rng(), np.float32(self.ratio), self.dtype.type(self.scale)
            for xc, yc, keep in _chunks(x, y, self.mask):
                u = draws[:len(xc)]
                rng.random(dtype=np.float32, out=u)
                np.greater_equal(u, ratio, out=keep)
                np.multiply(xc, keep, out=yc)
                if self.scale_train:
                    yc *= scale
        elif self.scale_train:
            if y is not x:
                y[...] = x
        else:
            np.multiply(x, self.dtype.type(1.0 - self.ratio), out=y)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy, dx = top[0].diff, bottom[0].diff
        if self.phase == caffe_pb2.TRAIN:
            k = _compiled(dy, dx)
            if k is not None:
                _side_by_side(k.dropout_backward, (dy, self.mask, dx),
                              (self.scale, self.scale_train))
                return
            scale = self.dtype.type(self.scale)
            for dyc, dxc, keep in _chunks(dy, dx, self.mask):
                np.multiply(dyc, keep, out=dxc)
                if self.scale_train:
                    dxc *= scale
        elif self.scale_train:
            if dx is not dy:
                dx[...] = dy
        else:
            np.multiply(dy, self.dtype.type(1.0 - self.ratio), out=dx)


@register("Clip")
class ClipLayer(NeuronLayer):
    """min(max(x, min), max); the gradient passes where min <= x <= max."""

    def neuron_setup(self, bottom, top):
        p = self.param.clip_param
        self.lo, self.hi = float(p.min), float(p.max)
        if self.lo > self.hi:
            raise self.error(f"clip_param min must be <= max, got min {self.lo} max {self.hi}")

    def forward(self, bottom, top):
        np.clip(bottom[0].data, self.lo, self.hi, out=top[0].data)

    def prepare_forward(self, bottom, top):
        return clip_call(bottom[0].data, top[0].data, self.lo, self.hi)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        inside = (x >= self.lo) & (x <= self.hi)
        np.multiply(top[0].diff, inside, out=bottom[0].diff)


@register("Swish")
class SwishLayer(NeuronLayer):
    """x * sigmoid(beta * x)."""

    def neuron_setup(self, bottom, top):
        self.beta = float(self.param.swish_param.beta)
        self.sig = None

    def forward(self, bottom, top):
        x = bottom[0].data
        sig = np.multiply(x, self.beta, dtype=self.dtype)
        _sigmoid(sig, sig)
        self.sig = sig
        np.multiply(x, sig, out=top[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        by = top[0].data * self.dtype.type(self.beta)
        g = 1 - by
        g *= self.sig
        g += by
        np.multiply(top[0].diff, g, out=bottom[0].diff)
