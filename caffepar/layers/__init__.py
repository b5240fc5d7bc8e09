"""The layer library. Each module registers its layers with `register`; importing this package
imports them all, so the registry is complete."""
import importlib

from caffepar.layers.base import LAYERS, Layer, layer_class, register

_FAMILIES = ("data", "vision", "pooling", "inner_product", "neuron", "common", "loss", "normalization",
             "recurrent")
for _name in _FAMILIES:
    try:
        importlib.import_module(f"caffepar.layers.{_name}")
    except ModuleNotFoundError as e:
        if e.name != f"caffepar.layers.{_name}":
            raise


def create_layer(param, phase, dtype, where=None):
    where = where or {}
    cls = layer_class(param.type, param.name, where.get("line"), where.get("path"))
    return cls(param, phase, dtype, where)


__all__ = ["LAYERS", "Layer", "create_layer", "layer_class", "register"]
