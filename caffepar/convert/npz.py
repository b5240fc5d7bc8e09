"""Weights between formats: binary caffemodel, HDF5 caffemodel, NumPy .npz, solver snapshots.

Every path goes through `CaffeModel` (name, type, blobs) from caffepar.io.weights, so a 553 MB
model never passes through Python protobuf and every value is copied bit for bit. npz keys are
`<layer name>/<blob index>` (the convention of Caffe's own test data); layer names may contain
slashes, so the index is taken after the last one.
"""
import os

import numpy as np

from caffepar.errors import MissingFileError, WeightsError
from caffepar.io.weights import (CaffeModel, _blob_chunks, atomic_write, copy_weights_into,
                                 is_hdf5, layers_without_weights, read_caffemodel)
from caffepar.proto import caffe_pb2

__all__ = ["open_weights", "save_npz", "read_npz", "write_caffemodel", "write_hdf5",
           "save_weights", "convert_weights", "load_weights", "LoadReport", "weight_format"]


def weight_format(path):
    """Output format from a file name, as Caffe picks snapshot formats: .h5 means HDF5."""
    name = os.fspath(path).lower()
    if name.endswith(".npz"):
        return "npz"
    if name.endswith(".h5") or name.endswith(".hdf5"):
        return "hdf5"
    return "binary"


def _is_solverstate(path):
    name = os.fspath(path)
    return name.endswith(".solverstate") or name.endswith(".solverstate.h5")


def read_npz(path):
    """A CaffeModel from an npz written by `save_npz` (or any `<layer>/<index>` npz)."""
    path = os.fspath(path)
    layers, order = {}, []
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise WeightsError(f"cannot read npz: {e}", path=path) from None
    with archive:
        for key in archive.files:
            name, sep, index = key.rpartition("/")
            if not sep or not index.isdigit():
                raise WeightsError(f'npz key "{key}" is not of the form <layer>/<blob index>',
                                   path=path)
            if name not in layers:
                layers[name] = {}
                order.append(name)
            arr = archive[key]
            layers[name][int(index)] = arr
    out = []
    for name in order:
        blobs = layers[name]
        if sorted(blobs) != list(range(len(blobs))):
            raise WeightsError(f'layer "{name}": npz blob indices {sorted(blobs)} are not '
                               f"0..{len(blobs) - 1}", path=path)
        entries = []
        for i in range(len(blobs)):
            arr = blobs[i]
            shape = tuple(int(d) for d in arr.shape)
            # A 4-D array may be a V1 model's legacy shape; let the loader match it as Caffe does.
            entries.append((arr.reshape(-1), shape, shape if len(shape) == 4 else None))
        out.append((name, None, entries))
    return CaffeModel(path, out)


def open_weights(path):
    """CaffeModel from a binary or HDF5 caffemodel, an npz, or a solver snapshot (whose
    `learned_net` is followed: a snapshot's weights live in the caffemodel beside it)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path, "weights file")
    if _is_solverstate(path):
        from caffepar.solvers.snapshot import find_learned_net, read_solverstate
        state = read_solverstate(path)
        if not state.learned_net:
            raise WeightsError("solver state names no learned_net (weights file)", path=path)
        return read_caffemodel(find_learned_net(state.learned_net, path))
    if weight_format(path) == "npz" and not is_hdf5(path):
        return read_npz(path)
    return read_caffemodel(path)


def save_npz(model, path):
    """Every parameter blob as `<layer>/<index>`, in the blob's own shape and dtype."""
    arrays = {}
    for name, _type, blobs in model.layers:
        for i, (values, shape, _legacy) in enumerate(blobs):
            key = f"{name}/{i}"
            if key in arrays:
                raise WeightsError(f'layer name "{name}" appears twice; npz keys would clash',
                                   path=model.path)
            arrays[key] = np.asarray(values).reshape(shape)

    def write(f):
        np.savez(f, **arrays)

    atomic_write(path, write)
    return len(arrays)


def _layer_params(model):
    """The blob-free LayerParameters a binary model carried, one per layer of model.layers
    (None where there is none), with the bytes of the fields each kept unread; matched by
    position when the file's layers are model.layers (V2 files: layers of one name keep
    theirs), else by name (V1 models come upgraded), so that a binary -> binary conversion
    keeps each layer's definition."""
    net = model.net_param
    if net is None:
        return [(None, b"")] * len(model.layers)
    if [lp.name for lp in net.layer] == [name for name, _t, _b in model.layers]:
        return [(lp, model.unread.get(i, b"")) for i, lp in enumerate(net.layer)]
    params = {}
    for lp in net.layer:
        params.setdefault(lp.name, lp)
    return [(params.get(name), b"") for name, _t, _b in model.layers]


def write_caffemodel(model, path):
    """A binary NetParameter: every layer's definition (or just name and type when the source
    had none, as HDF5 and npz do), then its blobs as packed float32 with an N-D shape, then the
    fields the source's layer had that caffepar kept unread (as Caffe's tools keep them)."""
    from caffepar.convert.upgrade import _layer_bytes
    params = _layer_params(model)
    head = caffe_pb2.NetParameter()
    if model.net_param is not None and model.net_param.HasField("name"):
        head.name = model.net_param.name

    def write(f):
        f.write(head.SerializeToString())
        for (name, type_, blobs), (lp, unread) in zip(model.layers, params):
            if lp is None:
                lp = caffe_pb2.LayerParameter(name=name)
                if type_:
                    lp.type = type_
            payloads = []
            for values, shape, _legacy in blobs:
                pieces = _blob_chunks(np.asarray(values).reshape(shape))
                payloads.append(b"".join(bytes(p) for p in pieces))
            f.write(_layer_bytes(lp, payloads, unread))

    atomic_write(path, write)


def write_hdf5(model, path):
    """Caffe's HDF5 caffemodel layout: data/<layer>/<blob index>, a group for every layer."""
    import h5py

    def write(tmp):
        with h5py.File(tmp, "w") as h5:
            group = h5.create_group("data")
            h5.create_group("diff")
            for name, _type, blobs in model.layers:
                if name in group:
                    continue
                g = group.create_group(name)
                for i, (values, shape, _legacy) in enumerate(blobs):
                    g.create_dataset(str(i), data=np.asarray(values).reshape(shape))

    atomic_write(path, write, binary=False)


def save_weights(model, path):
    """Write a CaffeModel in the format `path`'s name asks for; returns that format."""
    fmt = weight_format(path)
    if fmt == "npz":
        save_npz(model, path)
    elif fmt == "hdf5":
        write_hdf5(model, path)
    else:
        write_caffemodel(model, path)
    return fmt


class LoadReport:
    """Which net layers got weights, which had none in the file, which file layers went unused."""

    def __init__(self, copied, missing, unused):
        self.copied, self.missing, self.unused = copied, missing, unused

    def lines(self):
        out = [f"copied weights of {len(self.copied)} layer(s)"]
        if self.missing:
            out.append(f"kept initial weights (not in the file): {', '.join(self.missing)}")
        if self.unused:
            out.append(f"ignored (not in the net): {', '.join(self.unused)}")
        return out


def load_weights(net, source, allow_missing=False):
    """Copy weights by layer name, as Caffe's `--weights`; a layer whose blobs differ fails
    naming the layer, the blob and both shapes. Without `allow_missing`, a net layer with
    parameters but no weights in the file is an error too (a conversion that silently keeps
    random weights is worse than none); with it, such layers keep their fillers, as when
    fine-tuning."""
    model = source if isinstance(source, CaffeModel) else open_weights(source)
    missing = layers_without_weights(net, [model])
    copied = copy_weights_into(net, model)  # shape mismatches first: they are the precise ones
    if missing and not allow_missing:
        raise WeightsError(f"no weights for layer(s) {', '.join(missing)}", path=model.path,
                           hint="pass --allow-missing to keep their initial (filler) values, "
                                "as Caffe's --weights does when fine-tuning")
    layer_names = set(net.layer_dict)
    unused = [name for name, _t, blobs in model.layers if blobs and name not in layer_names]
    return LoadReport(copied, missing, unused)


def net_model(net):
    """The net's current parameters as a CaffeModel (layers without blobs included)."""
    layers = []
    for layer in net.layers:
        blobs = [(b.data.reshape(-1), tuple(b.shape), None) for b in layer.blobs]
        layers.append((layer.name, layer.type, blobs))
    return CaffeModel(None, layers)


def convert_weights(src, dst, model=None, allow_missing=False, phase=None, level=0, stages=()):
    """Convert weights `src` -> `dst` (format by `dst`'s name). Without `model` the blobs are
    carried over as they are; with a prototxt, they are loaded into that net first (shapes
    checked, missing layers refused unless `allow_missing`) and the net is written, so the
    output carries the net's layer definitions as a Caffe snapshot does."""
    weights = open_weights(src)
    if model is None:
        return save_weights(weights, dst), None
    from caffepar.graph.net import TEST, Net
    from caffepar.io.weights import save_caffemodel, save_caffemodel_hdf5
    net = Net(model, phase=TEST if phase is None else phase, level=level, stages=stages)
    report = load_weights(net, weights, allow_missing=allow_missing)
    fmt = weight_format(dst)
    if fmt == "binary":
        save_caffemodel(net, dst)
    elif fmt == "hdf5":
        save_caffemodel_hdf5(net, dst)
    else:
        save_npz(net_model(net), dst)
    return fmt, report
