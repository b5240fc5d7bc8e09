"""InnerProduct: a fully connected layer over the axes from `axis` on.

Its GEMMs go to BLAS, or with a small batch (up to ``SMALL_BATCH`` rows) y = x W^T and
dx = dy W may go to compiled kernels that stream W through once (a BLAS tuned for big GEMMs
packs all of W and runs well below the memory bandwidth that bounds them): which of the two by
measurement on the machine at hand (`caffepar.nn.calibrate`), fixed thresholds taking the
kernels whenever they apply."""
import numpy as np

from caffepar.blob import canonical_axis
from caffepar.nn import calibrate, native
from caffepar.nn.base import Layer, register
from caffepar.nn.blas import blas_threads, gemm, run_parts

#: Batches of at most this many rows may use the compiled kernels (ip_forward's register
#: tiles hold that many rows).
SMALL_BATCH = 16


@register("InnerProduct")
class InnerProductLayer(Layer):
    """top (M, N) = bottom (M, K) . W^T + b, W stored (N, K), or (K, N) when `transpose`."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.inner_product_param
        self.num_output = self.positive(p.num_output, "num_output")
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        self.axis = canonical_axis(p.axis, bottom[0].num_axes)
        self.k = int(np.prod(bottom[0].shape[self.axis:]))
        if self.blobs_already_set(1 + self.bias_term):
            return
        shape = (self.k, self.num_output) if self.transpose else (self.num_output, self.k)
        self.add_param_blob(shape, p.weight_filler)
        if self.bias_term:
            self.add_param_blob((self.num_output,), p.bias_filler)

    def reshape(self, bottom, top):
        axis = canonical_axis(self.param.inner_product_param.axis, bottom[0].num_axes)
        k = int(np.prod(bottom[0].shape[axis:]))
        if k != self.k:
            raise self.error(f"input size incompatible with inner product parameters: bottom "
                             f"{bottom[0].shape} gives {k} inputs after axis {axis}, the weights "
                             f"expect {self.k}")
        self.m = int(np.prod(bottom[0].shape[:axis]))
        top[0].reshape(bottom[0].shape[:axis] + (self.num_output,))

    def _kernels(self):
        """The compiled kernels when this shape should use them, else None (BLAS)."""
        w = self.blobs[0].data
        if self.transpose or self.m > SMALL_BATCH or not w.flags.c_contiguous:
            return None
        k = native.kernels(w.dtype)
        if k is None or calibrate.mode() != "measure" or calibrate.measuring():
            return k
        key = f"ip {self.m}x{self.k} {self.num_output} {w.dtype.name} t{blas_threads()}"
        chosen = calibrate.choose(key, ["compiled", "blas"], self._timing_run, key)
        return k if chosen == "compiled" else None

    def _timing_run(self):
        """run(engine): forward and dx of this shape on random data with that engine."""
        rng = np.random.default_rng(0)
        dt = self.blobs[0].data.dtype
        x = rng.standard_normal((self.m, self.k)).astype(dt)
        w = rng.standard_normal((self.num_output, self.k)).astype(dt)
        y, dx = np.empty((self.m, self.num_output), dt), np.empty_like(x)
        k = native.kernels(dt)

        def run(engine):
            _forward(k if engine == "compiled" else None, x, w, None, y)
            _backward_data(k if engine == "compiled" else None, y, w, dx)

        return run

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.m, self.k)
        w = self.blobs[0].data
        y = top[0].data.reshape(self.m, self.num_output)
        if self.transpose:
            gemm(x, w, y)
            if self.bias_term:
                y += self.blobs[1].data
            return
        _forward(self._kernels(), x, w, self.blobs[1].data if self.bias_term else None, y)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.m, self.num_output)
        x = bottom[0].data.reshape(self.m, self.k)
        w = self.blobs[0]
        if self.param_propagate_down[0]:
            if self.transpose:
                gemm(x.T, dy, w.diff, beta=1.0)
            else:
                gemm(dy.T, x, w.diff, beta=1.0)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            dx = bottom[0].diff.reshape(self.m, self.k)
            if self.transpose:
                gemm(dy, w.data.T, dx)
            else:
                _backward_data(self._kernels(), dy, w.data, dx)


def _forward(k, x, w, bias, y):
    """y = x W^T (+ bias): the compiled kernel over runs of W's rows side by side, or BLAS."""
    if k is None or not (x.flags.c_contiguous and y.flags.c_contiguous):
        gemm(x, w.T, y)
        if bias is not None:
            y += bias
        return
    m, n = y.shape
    bias_ptr = None if bias is None else native.ptr(bias)
    run_parts(lambda r: k.ip_forward(native.ptr(x), native.ptr(w), bias_ptr, native.ptr(y), m,
                                     x.shape[1], n, *r), _ranges(n))


def _backward_data(k, dy, w, dx):
    """dx = dy W: the compiled kernel over runs of dx's columns side by side, or BLAS."""
    if k is None or not (dy.flags.c_contiguous and dx.flags.c_contiguous):
        gemm(dy, w, dx)
        return
    m, kk = dx.shape
    run_parts(lambda r: k.ip_backward_data(native.ptr(dy), native.ptr(w), native.ptr(dx), m, kk,
                                           w.shape[0], *r), _ranges(kk))


def _ranges(count):
    """(first, end) of about four runs per thread over range(count), in multiples of 16."""
    runs = max(1, min(4 * blas_threads(), count // 64))
    bounds = [count * i // runs // 16 * 16 for i in range(runs)] + [count]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
