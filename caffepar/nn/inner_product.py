"""InnerProduct: a fully connected layer over the axes from `axis` on."""
import numpy as np

from caffepar.blob import canonical_axis
from caffepar.nn.base import Layer, register
from caffepar.nn.blas import gemm


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

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.m, self.k)
        w = self.blobs[0].data
        y = top[0].data.reshape(self.m, self.num_output)
        gemm(x, w if self.transpose else w.T, y)
        if self.bias_term:
            y += self.blobs[1].data

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
            gemm(dy, w.data.T if self.transpose else w.data, dx)
