"""The layer library. Each module registers its layers with `register`; importing this package
imports them all, so the registry is complete."""
from caffepar.nn import (common, data, inner_product, loss, neuron,  # noqa: F401
                         normalization, pooling, python_layer, recurrent, ssd, vision,
                         window_data)
from caffepar.nn import detection, mobile, segmentation, senet  # noqa: F401  (Caffe forks')
from caffepar.nn import annotated_data, ssd_train  # noqa: F401  (SSD's training layers)
from caffepar.nn.base import LAYERS, Layer, _known, layer_class, register


def create_layer(param, phase, dtype, where=None):
    if where is None:
        where = {}
    cls = _known(param.type) or layer_class(param.type, param.name, where.get("line"),
                                            where.get("path"))
    return cls(param, phase, dtype, where)


__all__ = ["LAYERS", "Layer", "create_layer", "layer_class", "register"]
