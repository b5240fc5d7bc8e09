"""Layers that provide blobs without reading a dataset: Input and DummyData."""
import numpy as np

from caffepar.fillers import fill
from caffepar.layers.base import Layer, register
from caffepar.proto import caffe_pb2


def _shape_of(blob_shape):
    return tuple(int(d) for d in blob_shape.dim)


@register("Input")
class InputLayer(Layer):
    """Net inputs the caller fills; one shape given for all tops or one per top."""

    exact_bottoms = 0
    min_tops = 1

    def layer_setup(self, bottom, top):
        shapes = self.param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.error(f"input_param must give 0, 1 or {len(top)} shapes, got {len(shapes)}")
        for i, t in enumerate(top):
            if shapes:
                t.reshape(_shape_of(shapes[0] if len(shapes) == 1 else shapes[i]))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass


@register("DummyData")
class DummyDataLayer(Layer):
    """Tops filled by fillers: constant fillers once, others refilled every forward."""

    exact_bottoms = 0
    min_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.dummy_data_param
        n = len(top)
        if p.shape:
            shapes = [_shape_of(s) for s in p.shape]
        else:
            legacy = [p.num, p.channels, p.height, p.width]
            counts = {len(v) for v in legacy}
            if counts - {1, n}:
                raise self.error(f"num/channels/height/width must be given 1 or {n} times")
            shapes = [tuple(v[0] if len(v) == 1 else v[i] for v in legacy) for i in range(n)]
        if len(shapes) not in (1, n):
            raise self.error(f"dummy_data_param must give 1 or {n} shapes, got {len(shapes)}")
        fillers = list(p.data_filler)
        if len(fillers) not in (0, 1, n):
            raise self.error(f"dummy_data_param must give 0, 1 or {n} data_fillers")
        if not fillers:
            f = caffe_pb2.FillerParameter(type="constant", value=0)
            fillers = [f]
        self.fillers = [fillers[0] if len(fillers) == 1 else fillers[i] for i in range(n)]
        self.refill = [f.type != "constant" for f in self.fillers]
        for i, t in enumerate(top):
            t.reshape(shapes[0] if len(shapes) == 1 else shapes[i])
            t.data[...] = fill(self.fillers[i], t.shape, self.dtype)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        for f, again, t in zip(self.fillers, self.refill, top):
            if again:
                t.data[...] = fill(f, t.shape, self.dtype)

    def backward(self, top, propagate_down, bottom):
        pass
