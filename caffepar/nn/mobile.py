"""Layers of the mobile-net forks of Caffe: depthwise convolutions, ReLU6 and ShuffleChannel.

Both depthwise types are a Convolution whose group equals its channel count, so they run on the
convolution engines. ConvolutionDepthwise (the MobileNet forks) reads only the geometry of
convolution_param and outputs one channel per input channel; DepthwiseConvolution (the
DepthwiseConvolution fork) is a Convolution with num_output as given, its group defaulting to
the channel count."""
from functools import partial

import numpy as np

from caffepar.nn.base import register
from caffepar.nn.neuron import NeuronLayer
from caffepar.nn.prepared import clip_call, view_as
from caffepar.nn.vision import ConvolutionLayer


class _Depthwise(ConvolutionLayer):
    exact_bottoms = 1
    exact_tops = 1

    def conv_group(self, p):
        if not p.HasField("group"):
            return self.channels
        if p.group != self.channels:
            raise self.error(f"a depthwise convolution has group equal to its input channels "
                             f"({self.channels}), got group {p.group}")
        return p.group


@register("ConvolutionDepthwise")
class ConvolutionDepthwiseLayer(_Depthwise):
    """Weights (C, 1, kh, kw), bias (C); num_output and group, when given, must be C."""

    def conv_num_output(self, p):
        if p.HasField("num_output") and p.num_output != self.channels:
            raise self.error(f"outputs one channel per input channel ({self.channels}); "
                             f"num_output {p.num_output} differs")
        return self.channels


@register("DepthwiseConvolution")
class DepthwiseConvolutionLayer(_Depthwise):
    pass


@register("ReLU6")
class ReLU6Layer(NeuronLayer):
    """min(max(x, 0), 6); the gradient passes where 0 < x < 6."""

    def forward(self, bottom, top):
        np.clip(bottom[0].data, 0, 6, out=top[0].data)

    def prepare_forward(self, bottom, top):
        return clip_call(bottom[0].data, top[0].data, 0, 6)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = bottom[0].data
        np.multiply(top[0].diff, (x > 0) & (x < 6), out=bottom[0].diff)


@register("ShuffleChannel")
class ShuffleChannelLayer(NeuronLayer):
    """ShuffleNet's channel shuffle: the channels, read as a (group, C / group) matrix, are
    written out transposed."""

    allow_in_place = False

    def neuron_setup(self, bottom, top):
        self.group = self.positive(self.param.shuffle_channel_param.group, "group")

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 2 or shape[1] % self.group:
            raise self.error(f"channels ({shape[1] if len(shape) > 1 else 'none'}) must be "
                             f"divisible by group ({self.group})")
        top[0].reshape(shape)

    def _shuffle(self, src, dst, rows):
        n, c = src.shape[:2]
        dst.reshape(n, c // rows, rows, -1)[...] = \
            src.reshape(n, rows, c // rows, -1).transpose(0, 2, 1, 3)

    def forward(self, bottom, top):
        self._shuffle(bottom[0].data, top[0].data, self.group)

    def prepare_forward(self, bottom, top):
        x, y, rows = bottom[0].data, top[0].data, self.group
        n, c = x.shape[:2]
        src = view_as(x, (n, rows, c // rows, -1))
        dst = view_as(y, (n, c // rows, rows, -1))
        if src is None or dst is None:
            return None
        return partial(np.copyto, dst, src.transpose(0, 2, 1, 3))

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            self._shuffle(top[0].diff, bottom[0].diff, top[0].shape[1] // self.group)
