"""InnerProduct: a fully connected layer over the axes from `axis` on.

Its GEMMs go to BLAS, or with a small batch (up to ``SMALL_BATCH`` rows) to compiled kernels
that stream W through once (a BLAS tuned for big GEMMs packs all of W and runs well below the
memory bandwidth that bounds them): which of the ways (``ENGINES``) by measurement on the
machine at hand (`caffepar.nn.calibrate`); fixed rules take the kernels whenever they apply."""
from functools import partial

import numpy as np

from caffepar.blob import canonical_axis
from caffepar.nn import calibrate, native
from caffepar.nn.base import Layer, register, reshaped_by_shape
from caffepar.nn.blas import blas_threads, gemm, run_parts, scratch
from caffepar.nn.prepared import epilogue_call, sequence, view_as

#: Batches of at most this many rows may use the compiled kernels (the "wide" kernels hold a
#: column of the batch in two vectors at most).
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

    @reshaped_by_shape
    def reshape(self, bottom, top):
        axis = canonical_axis(self.param.inner_product_param.axis, bottom[0].num_axes)
        k = int(np.prod(bottom[0].shape[axis:]))
        if k != self.k:
            raise self.error(f"input size incompatible with inner product parameters: bottom "
                             f"{bottom[0].shape} gives {k} inputs after axis {axis}, the weights "
                             f"expect {self.k}")
        self.m = int(np.prod(bottom[0].shape[:axis]))
        top[0].reshape(bottom[0].shape[:axis] + (self.num_output,))

    def engine(self, bottom_shape):
        """The engines this layer's shape runs on, in words (`caffepar time` prints it)."""
        return calibrate.describe(self.engine_choices(bottom_shape))

    def engine_choices(self, bottom_shape):
        """{pass: (engine, its measured choice or None)} (`caffepar time --engines`)."""
        need_dx = bool((self.bottom_need_diff or [True])[0])
        need_dw = bool(self.param_propagate_down[0]) if self.param_propagate_down else True
        return {"forward": calibrate.with_entry(self._engine),
                "backward": calibrate.with_entry(
                    lambda: self._engine(calibrate.backward_pass(need_dx, need_dw)))}

    def _engine(self, passes="forward"):
        """How this shape's pass ("forward" or a calibrate.backward_pass) runs: "wide" or
        "rows" (the compiled kernels) or "blas"."""
        w = self.blobs[0].data
        if (self.transpose or self.m > SMALL_BATCH or not w.flags.c_contiguous
                or native.kernels(w.dtype) is None):
            return "blas"
        if calibrate.mode() != "measure" or calibrate.measuring():
            return "wide" if 2 * self.m >= 64 // w.dtype.itemsize else "rows"
        key = (f"ip {self.m}x{self.k} {self.num_output} {w.dtype.name} {passes} "
               f"t{blas_threads()}")
        return calibrate.choose(key, list(ENGINES), lambda: self._timing_run(passes), key)

    def _timing_run(self, passes):
        """run(engine): one pass of this shape on random data with that engine."""
        rng = np.random.default_rng(0)
        # The layer's own weights (only read): a copy of a big layer's (VGG-16's fc6: 392 MB)
        # would raise the peak memory of the first iteration by as much.
        w = self.blobs[0].data
        dt = w.dtype
        x = calibrate.random_array(rng, (self.m, self.k), dt)
        if passes == "forward":
            y = calibrate.written_array((self.m, self.num_output), dt)
            return lambda engine: _forward(engine, x, w, None, y)
        dy = calibrate.random_array(rng, (self.m, self.num_output), dt)
        dx = calibrate.written_array(x.shape, dt) if passes != "backward no dx" else None
        dw = calibrate.written_array(w.shape, dt) if passes != "backward dx" else None
        return lambda engine: _backward(engine, dy, x, w, dx, dw)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.m, self.k)
        w = self.blobs[0].data
        y = top[0].data.reshape(self.m, self.num_output)
        if self.transpose:
            gemm(x, w, y)
            if self.bias_term:
                y += self.blobs[1].data
            return
        _forward(self._engine(), x, w, self.blobs[1].data if self.bias_term else None, y)

    def prepare_forward(self, bottom, top, epilogue=None):
        """The forward with its engine chosen once; with an Epilogue (caffepar.nn.conv), its
        output finished per output (axis 1). An epilogue with a shift holds this layer's bias
        there (as conv_forward's does); without one, the layer adds its bias itself."""
        x = view_as(bottom[0].data, (self.m, self.k))
        y = view_as(top[0].data, (self.m, self.num_output))
        if x is None or y is None:
            return None
        w = self.blobs[0].data
        own_bias = epilogue is None or epilogue.shift is None
        bias = self.blobs[1].data if self.bias_term and own_bias else None
        if self.transpose:
            calls = [partial(gemm, x, w, y)]
            if bias is not None:
                calls.append(partial(np.add, y, bias, out=y))
        else:
            calls = [partial(_forward, self._engine(), x, w, bias, y)]
        if epilogue is not None:
            calls.append(epilogue_call(y, y, epilogue))
        return sequence(calls)

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(self.m, self.num_output)
        x = bottom[0].data.reshape(self.m, self.k)
        w = self.blobs[0]
        dx = bottom[0].diff.reshape(self.m, self.k) if propagate_down[0] else None
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)
        if self.transpose:
            if self.param_propagate_down[0]:
                gemm(x.T, dy, w.diff, beta=1.0)
            if dx is not None:
                gemm(dy, w.data.T, dx)
            return
        dw = w.diff if self.param_propagate_down[0] else None
        if dx is not None or dw is not None:
            _backward(self._engine(calibrate.backward_pass(dx is not None, dw is not None)),
                      dy, x, w.data, dx, dw)


#: The ways y = x W^T, dx = dy W and dW += dy^T x run: "wide" and "rows" are the compiled
#: kernels, which stream W (and dW) through once where a BLAS tuned for big GEMMs packs it
#: first. "wide" puts the batch in the vector lanes (every element of W loaded once and
#: multiplied into the whole batch, no horizontal sums): the fastest when the batch fills most
#: of a vector. "rows" keeps the batch's rows apart (dot products along K), for the smallest
#: batches, whose lanes "wide" would mostly leave empty.
ENGINES = ("wide", "rows", "blas")


def _lanes_first(a, key):
    """a (M, X) as (X, MV * VL), zero-padded to whole vectors of the kernels, and MV."""
    m, cols = a.shape
    vl = 64 // a.itemsize
    mv = -(-m // vl)
    t = scratch(key, (cols, mv * vl), a.dtype)
    t[:, m:] = 0
    t[:, :m] = a.T
    return t, mv


def _forward(engine, x, w, bias, y):
    """y = x W^T (+ bias)."""
    k = native.kernels(w.dtype) if engine != "blas" else None
    if k is None or not (x.flags.c_contiguous and y.flags.c_contiguous):
        gemm(x, w.T, y)
        if bias is not None:
            y += bias
        return
    m, n = y.shape
    bias_ptr = None if bias is None else native.ptr(bias)
    if engine == "wide":
        xt, mv = _lanes_first(x, "ip_xt")
        run_parts(lambda r: k.ipw_forward(native.ptr(xt), native.ptr(w), bias_ptr, native.ptr(y),
                                          m, mv, x.shape[1], n, *r), _ranges(n))
        return
    run_parts(lambda r: k.ip_forward(native.ptr(x), native.ptr(w), bias_ptr, native.ptr(y), m,
                                     x.shape[1], n, *r), _ranges(n))


def _backward(engine, dy, x, w, dx, dw):
    """dx = dy W (when dx is given) and dW += dy^T x (when dW is given)."""
    k = native.kernels(w.dtype) if engine != "blas" else None
    contiguous = all(a is None or a.flags.c_contiguous for a in (dy, x, dx, dw))
    if k is None or not contiguous or engine == "rows":
        if dw is not None:
            gemm(dy.T, x, dw, beta=1.0)
        if dx is not None:
            _backward_data(k if contiguous else None, dy, w, dx)
        return
    m, kk = x.shape
    n = w.shape[0]
    dyt, mv = _lanes_first(dy, "ip_dyt")
    if dw is not None:
        run_parts(lambda r: k.ipw_backward_weights(native.ptr(dyt), native.ptr(x), native.ptr(dw),
                                                   m, dyt.shape[1], kk, *r), _ranges(n))
    if dx is not None:
        dxt = scratch("ip_dxt", (kk, dyt.shape[1]), dx.dtype)
        run_parts(lambda r: k.ipw_backward_data(native.ptr(dyt), native.ptr(w), native.ptr(dxt),
                                                native.ptr(dx), m, mv, kk, n, *r), _ranges(kk))


def _backward_data(k, dy, w, dx):
    """dx = dy W: the "rows" kernel over runs of dx's columns side by side, or BLAS."""
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
