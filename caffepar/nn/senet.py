"""Axpy, the layer of the Squeeze-and-Excitation nets' Caffe (hujie-frank/SENet): the channel
weights of an SE block times the features, plus the shortcut, in one layer."""
import numpy as np

from caffepar.nn.base import Layer, register


@register("Axpy")
class AxpyLayer(Layer):
    """top = a * x + y, with a of shape (N, C) or (N, C, 1, 1) (bottom 0), x and y of one shape
    (N, C, ...) (bottoms 1 and 2)."""

    exact_bottoms = 3
    exact_tops = 1

    def reshape(self, bottom, top):
        a, x, y = (b.shape for b in bottom)
        if len(x) < 2 or a[:2] != x[:2] or any(d != 1 for d in a[2:]):
            raise self.error(f"the scale bottom must be (N, C) or (N, C, 1, 1) of the features' "
                             f"{x[:2]}, got {a}")
        if x != y:
            raise self.error(f"the two feature bottoms must have one shape, got {x} and {y}")
        top[0].reshape(x)

    def _scale(self, blob, like):
        return blob.reshape(blob.shape[:2] + (1,) * (like.ndim - 2))

    def forward(self, bottom, top):
        a = self._scale(bottom[0].data, bottom[1].data)
        np.multiply(a, bottom[1].data, out=top[0].data)
        top[0].data += bottom[2].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff
        if propagate_down[0]:
            n, c = dy.shape[:2]
            bottom[0].diff[...] = np.einsum("ncs,ncs->nc", dy.reshape(n, c, -1),
                                            bottom[1].data.reshape(n, c, -1)
                                            ).reshape(bottom[0].shape)
        if propagate_down[1]:
            np.multiply(dy, self._scale(bottom[0].data, dy), out=bottom[1].diff)
        if propagate_down[2]:
            bottom[2].diff[...] = dy
