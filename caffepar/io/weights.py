"""Reading and writing .caffemodel files (binary NetParameter or HDF5) fast and at any size.

Python protobuf turns every float of a packed `repeated float` into a Python object, which takes
minutes for VGG-16's 138 M weights. Here the wire format is walked by hand down to each BlobProto,
and its packed data is handed to NumPy as one buffer; only the small, blob-free rest of each layer
goes through protobuf.
"""
import os
import re
import stat
import struct
import tempfile
import threading

import numpy as np

from caffepar.errors import MissingFileError, WeightsError
from caffepar.proto import caffe_pb2
from caffepar.logs import note
from caffepar.proto.forks import (BVLC_LAYER_NUMBERS, COLLIDING_FIELDS, fork_field_note,
                                  read_colliding_fields, read_fork_fields)
from caffepar.proto.upgrade import upgrade_net
from caffepar.proto.wire import (Truncated, encode_varint, fields, key, length_delimited,
                                 packed_varints, varint)

# Field numbers of Caffe's schema that the walker needs.
NET_LAYER, NET_LAYERS = 100, 2
LAYER_BLOBS, V1_LAYER_BLOBS, V1_LAYER_V0 = 7, 6, 1
BLOB_NUM, BLOB_CHANNELS, BLOB_HEIGHT, BLOB_WIDTH = 1, 2, 3, 4
BLOB_DATA, BLOB_DIFF, BLOB_SHAPE, BLOB_DOUBLE_DATA, BLOB_DOUBLE_DIFF = 5, 6, 7, 8, 9
SHAPE_DIM = 1


_Truncated = Truncated
_varint, _fields, _packed_varints = varint, fields, packed_varints


def decode_blob(buf, start, end, want_diff=False):
    """One BlobProto -> (ndarray of its data, legacy 4-D shape or None). Shape from `shape`, or
    from num/channels/height/width as Caffe's LegacyShape."""
    shape = None
    legacy = {}
    chunks, single = [], []
    dchunks, dsingle = [], []
    want_data = (BLOB_DIFF, BLOB_DOUBLE_DIFF) if want_diff else (BLOB_DATA, BLOB_DOUBLE_DATA)
    for number, wire, value, s, e, _ in _fields(buf, start, end):
        if number == BLOB_SHAPE and wire == 2:
            dims = []
            for n2, w2, v2, s2, e2, _ in _fields(buf, s, e):
                if n2 == SHAPE_DIM:
                    if w2 == 2:
                        dims.extend(_packed_varints(buf, s2, e2))
                    else:
                        dims.append(v2)
            shape = tuple(int(d) for d in dims)
        elif number in (BLOB_NUM, BLOB_CHANNELS, BLOB_HEIGHT, BLOB_WIDTH) and wire == 0:
            legacy[number] = value
        elif number == want_data[0]:
            if wire == 2:
                chunks.append(np.frombuffer(buf, "<f4", (e - s) // 4, s))
            else:
                single.append(struct.unpack_from("<f", buf, s)[0])
        elif number == want_data[1]:
            if wire == 2:
                dchunks.append(np.frombuffer(buf, "<f8", (e - s) // 8, s))
            else:
                dsingle.append(struct.unpack_from("<d", buf, s)[0])
    if single:
        chunks.append(np.asarray(single, "<f4"))
    if dsingle:
        dchunks.append(np.asarray(dsingle, "<f8"))
    if dchunks and not chunks:
        values = np.concatenate(dchunks) if len(dchunks) > 1 else dchunks[0]
    elif chunks:
        values = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    else:
        values = np.zeros(0, np.float32)
    legacy_shape = None
    if legacy:
        legacy_shape = tuple(legacy.get(k, 1) for k in
                             (BLOB_NUM, BLOB_CHANNELS, BLOB_HEIGHT, BLOB_WIDTH))
    if shape is None:
        # No shape and no legacy dimensions: Caffe reads a 0-axis blob (one value).
        shape = legacy_shape if legacy_shape is not None else ()
    return values, shape, legacy_shape


class CaffeModel:
    """A caffemodel's layers: `layers[i]` is (name, type, [(array, shape, legacy_shape), ...]);
    `net_param` its blob-free NetParameter (binary files), `unread` {index in net_param.layer:
    bytes of the fields of that layer kept unread, which a rewrite of the file keeps}."""

    def __init__(self, path, layers, net_param=None, unread=None):
        self.path = path
        self.layers = layers
        self.net_param = net_param
        self.unread = unread or {}

    def by_name(self):
        return {name: blobs for name, _type, blobs in self.layers}


class V0Model(Exception):
    """A V0 net: its layers nest their blobs one level deeper, so callers parse it whole."""


def split_layers(buf, path=None):
    """Walk a binary NetParameter once: (bytes of every field but the layers,
    [(layer field number, the layer's bytes without its blobs and without the fields BVLC
    Caffe does not number (a V2 layer's), [(start, stop) of each blob's BlobProto in buf],
    [(number, bytes) of each such field])]). Raises V0Model for a V0 net."""
    head = bytearray()
    layers = []
    try:
        for number, wire, _value, s, e, fstart in _fields(buf, 0, len(buf)):
            if not (wire == 2 and number in (NET_LAYER, NET_LAYERS)):
                head += buf[fstart:e]
                continue
            blob_field = LAYER_BLOBS if number == NET_LAYER else V1_LAYER_BLOBS
            body, blobs, extras = bytearray(), [], []
            for n2, w2, _v2, s2, e2, f2 in _fields(buf, s, e):
                if number == NET_LAYERS and n2 == V1_LAYER_V0:
                    raise V0Model()
                if n2 == blob_field and w2 == 2:
                    blobs.append((s2, e2))
                elif number == NET_LAYER and n2 not in BVLC_LAYER_NUMBERS:
                    extras.append((n2, bytes(buf[f2:e2])))
                else:
                    body += buf[f2:e2]
            layers.append((number, bytes(body), blobs, extras))
    except _Truncated:
        raise WeightsError("truncated or corrupt caffemodel (the protobuf stream ends inside a "
                           "field)", path=path) from None
    return bytes(head), layers


def read_layer_params(head, layers, path=None):
    """The NetParameter of a split model (split_layers), parsed as BVLC Caffe parses it, with
    the forks' fields read by each layer's type (proto/forks.py); returns it with {index in
    its `layer`: bytes of the fields left unread}, which a writer puts back as Caffe's tools
    do. At most one note per file says what was left unread."""
    stripped = head + b"".join(_length_delimited(n, body) for n, body, _b, _x in layers)
    net = caffe_pb2.NetParameter()
    try:
        net.ParseFromString(stripped)
    except Exception as e:  # protobuf's DecodeError and friends
        raise WeightsError(f"not a Caffe NetParameter: {e}", path=path) from None
    v2 = [(body, extras) for n, body, _b, extras in layers if n == NET_LAYER]
    unread, first, count = {}, None, 0
    for i, (layer, (body, extras)) in enumerate(zip(net.layer, v2)):
        _read_colliding(layer, body + b"".join(raw for _n, raw in extras))
        if not extras:
            continue
        kept, odd = read_fork_fields(layer, extras)
        if kept:
            unread[i] = kept
        if odd:
            count += 1
            first = first or (layer, odd)
    if first:
        note(f"{os.path.basename(path) if path else 'caffemodel'}: "
             f"{fork_field_note(*first, count)}")
    return net, unread


def _read_colliding(layer, body):
    """Fork fields under a number BVLC Caffe gave to another field (or, SegNet's bn_param, to
    none, with another numbering than ours), read by the layer's type from the layer's bytes."""
    if layer.type in _COLLIDING_TYPES:
        raw = {n: body[s:e] for n, w, _v, s, e, _f in _fields(body, 0, len(body))
               if w == 2 and n in _COLLIDING_NUMBERS}
        read_colliding_fields(layer, raw)


_COLLIDING_TYPES = {entry[0] for entry in COLLIDING_FIELDS}
_COLLIDING_NUMBERS = {entry[1] for entry in COLLIDING_FIELDS}


def _read_binary(path):
    with open(path, "rb") as f:
        buf = f.read()
    try:
        head, layers = split_layers(buf, path)
    except V0Model:
        return _read_binary_slow(path, buf)
    try:
        layer_blobs = [[decode_blob(buf, s, e) for s, e in blobs]
                       for _n, _b, blobs, _x in layers]
    except _Truncated:
        raise WeightsError("truncated or corrupt caffemodel (a blob ends early)",
                           path=path) from None
    net, unread = read_layer_params(head, layers, path)
    if not net.layer and not net.layers and buf:
        raise WeightsError("holds no layers; not a caffemodel", path=path)
    has_v1 = bool(net.layers)
    names = [lp.name for lp in (net.layers if has_v1 else net.layer)]
    types = [lp.type for lp in (net.layers if has_v1 else net.layer)]
    if has_v1:
        upgraded, _ = upgrade_net(net, source=path)
        if len(upgraded.layer) == len(names):
            names = [lp.name for lp in upgraded.layer]
            types = [lp.type for lp in upgraded.layer]
        net = upgraded
    return CaffeModel(path, [(n, t, b) for n, t, b in zip(names, types, layer_blobs)], net,
                      unread)


def _read_binary_slow(path, buf):
    """V0 models nest layers one level deeper; they are small, so protobuf parses them whole."""
    net = caffe_pb2.NetParameter()
    try:
        net.ParseFromString(buf)
    except Exception as e:  # protobuf's DecodeError and friends
        raise WeightsError(f"not a Caffe NetParameter: {e}", path=path) from None
    net, _ = upgrade_net(net, source=path)
    layers = []
    for lp in net.layer:
        blobs = []
        for bp in lp.blobs:
            raw = bp.SerializeToString()
            blobs.append(decode_blob(raw, 0, len(raw)))
        layers.append((lp.name, lp.type, blobs))
        del lp.blobs[:]
    return CaffeModel(path, layers, net)


def _read_hdf5(path):
    import h5py
    layers = []
    try:
        with h5py.File(path, "r") as f:
            if "data" not in f:
                raise WeightsError('HDF5 file has no "data" group; not a Caffe HDF5 caffemodel',
                                   path=path)
            group = f["data"]
            for name in group:
                blobs = []
                g = group[name]
                for i in range(len(g)):
                    arr = np.asarray(g[str(i)])
                    blobs.append((arr.reshape(-1), arr.shape, None))
                layers.append((name, None, blobs))
    except OSError as e:
        raise WeightsError(f"cannot read HDF5 caffemodel: {e}", path=path) from None
    return CaffeModel(path, layers)


def is_hdf5(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89HDF\r\n\x1a\n"


def read_caffemodel_hdf5(path):
    """An HDF5 caffemodel (data/<layer>/<blob index>), refusing any other file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path, "weights file")
    if not is_hdf5(path):
        raise WeightsError("not an HDF5 file (a binary caffemodel loads with copy_from)",
                           path=path)
    return _read_hdf5(path)


def read_caffemodel(path):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path, "weights file")
    if os.path.isfile(path) and os.path.getsize(path) == 0:     # protobuf reads it as no layers
        raise WeightsError("empty file (0 bytes: cut short while being written or copied?)",
                           path=path)
    if is_hdf5(path):
        return _read_hdf5(path)
    return _read_binary(path)


def _shape_str(shape):
    return " ".join(str(d) for d in shape) + f" ({int(np.prod(shape))})"


RENAME_HINT = "rename the layer to learn it from scratch instead of copying it"
MISSING_HINT = "pass --allow-missing to keep their initial (filler) values, as when " \
    "fine-tuning new layers"


def _mismatches(net, model):
    """What of `model` does not fit the net: [(layer name, message)] for wrong blob counts and
    shapes (layers absent from the net are ignored, as Caffe does)."""
    found = []
    for name, _type, blobs in model.layers:
        layer = net.layer_dict.get(name)
        if layer is None:
            continue
        if len(blobs) != len(layer.blobs):
            found.append(f'layer "{name}": the caffemodel has {len(blobs)} blob(s), the net '
                         f"expects {len(layer.blobs)}")
            continue
        for j, ((values, shape, legacy), target) in enumerate(zip(blobs, layer.blobs)):
            full = layer.full_shape(j) if hasattr(layer, "full_shape") else target.shape
            ok = tuple(shape) == full
            if not ok and legacy is not None and len(full) <= 4:
                ok = legacy == (1,) * (4 - len(full)) + full
            if not ok or values.size != int(np.prod(full)):
                found.append(f'layer "{name}" param {j}: shape mismatch, the caffemodel has '
                             f"{_shape_str(shape)}, the net expects {_shape_str(full)}")
    return found


def copy_weights_into(net, path, strict_names=False):
    """Caffe's CopyTrainedLayersFrom: copy blobs by layer name; layers absent from the net are
    ignored; a present layer must match in blob count and every shape (every mismatch is
    named at once)."""
    model = read_caffemodel(path) if not isinstance(path, CaffeModel) else path
    problems = _mismatches(net, model)
    if problems:
        raise WeightsError("; ".join(problems), path=model.path, hint=RENAME_HINT)
    copied = []
    for name, _type, blobs in model.layers:
        layer = net.layer_dict.get(name)
        if layer is None:
            continue
        for j, ((values, _shape, _legacy), target) in enumerate(zip(blobs, layer.blobs)):
            full = layer.full_shape(j) if hasattr(layer, "full_shape") else target.shape
            values = values.reshape(full)
            if hasattr(layer, "local_part"):
                values = layer.local_part(j, values)
            target.data[...] = values
        copied.append(name)
    return copied


def layers_without_weights(net, models):
    """Names of the net's layers with parameters of their own that none of `models` holds
    weights for (layers whose every blob is shared from an earlier one get theirs through it)."""
    in_files = {name for model in models for name, _type, blobs in model.layers if blobs}
    owned = {i for n, (i, _k) in enumerate(net.param_layer_index) if net.param_owner[n] < 0}
    return [layer.name for i, layer in enumerate(net.layers)
            if layer.blobs and layer.name not in in_files and i in owned]


def copy_weights_files(net, paths, allow_missing=True):
    """Caffe's `--weights a.caffemodel,b.caffemodel`: each file copied by layer name, in turn.
    Unless `allow_missing`, a layer with parameters that no file holds is an error: a model cut
    short (or the wrong file) would otherwise train or score with filler weights. Every problem
    is reported in one message, shape mismatches first (--allow-missing cannot fix those)."""
    models = [p if isinstance(p, CaffeModel) else read_caffemodel(p) for p in paths]
    problems = [m for model in models for m in _mismatches(net, model)]
    missing = [] if allow_missing else layers_without_weights(net, models)
    if missing:
        hint = MISSING_HINT if not problems else \
            f"--allow-missing keeps the filler values of the missing; {RENAME_HINT}"
        raise WeightsError("; ".join(problems + [f"no weights for layer(s) {', '.join(missing)}"]),
                           path=",".join(str(m.path) for m in models), hint=hint)
    for model in models:
        copy_weights_into(net, model)
    return models


# ------------------------------------------------------------------------------- writing
_encode_varint, _key, _length_delimited = encode_varint, key, length_delimited


def _float_payload(array):
    """A float32 little-endian view of `array` that file.write takes without a copy."""
    a = np.ascontiguousarray(array, "<f4")
    return memoryview(a.reshape(-1)).cast("B")


def _blob_chunks(data, diff=None):
    """A BlobProto as (header bytes, payload) pieces: shape, then packed float32 data (and diff)."""
    dims = b"".join(_encode_varint(int(d)) for d in data.shape)
    pieces = [_length_delimited(BLOB_SHAPE, _length_delimited(SHAPE_DIM, dims) if dims else b"")]
    for number, values in ((BLOB_DATA, data), (BLOB_DIFF, diff)):
        if values is None:
            continue
        payload = _float_payload(values)
        pieces += [_key(number, 2) + _encode_varint(len(payload)), payload]
    return pieces


def iter_net_chunks(net, write_diff=False, blob_arrays=None):
    """Caffe's Net::ToProto, serialized piece by piece so that no copy of the weights is made:
    every layer's parameter followed by its blobs. `blob_arrays(layer)` may supply the arrays
    (a model-parallel run passes the gathered full-size ones)."""
    head = caffe_pb2.NetParameter()
    head.name = net.name
    yield head.SerializeToString()
    for layer in net.layers:
        lp = caffe_pb2.LayerParameter()
        lp.CopyFrom(layer.param)
        del lp.blobs[:]
        pieces = [lp.SerializeToString()]
        arrays = blob_arrays(layer) if blob_arrays else [(b.data, b.diff) for b in layer.blobs]
        for data, diff in arrays:
            blob = _blob_chunks(data, diff if write_diff else None)
            size = sum(len(p) for p in blob)
            pieces += [_key(LAYER_BLOBS, 2) + _encode_varint(size)] + blob
        size = sum(len(p) for p in pieces)
        yield _key(NET_LAYER, 2) + _encode_varint(size)
        yield from pieces


def net_to_bytes(net, write_diff=False):
    return b"".join(bytes(c) for c in iter_net_chunks(net, write_diff))


def net_to_proto(net, write_diff=False):
    proto = caffe_pb2.NetParameter()
    proto.ParseFromString(net_to_bytes(net, write_diff))
    return proto


TEMP_SUFFIX = ".tmp"


def temp_name_pattern(stem):
    """A regex for the temp files atomic_write makes for files whose names start with `stem`:
    `.<name>.<random>.tmp`, hidden and ending in .tmp, so `*.caffemodel` never matches them."""
    return re.compile(re.escape(f".{stem}") + r".*\.[A-Za-z0-9_]+" + re.escape(TEMP_SUFFIX))


def file_mode(path):
    """The permission bits a file written to `path` gets: the existing file's, else those
    open() would give a new file (0666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask():
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o22)
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def _write_error(error, path):
    """An error raised while writing `path`, as an OSError naming `path` (write errors carry
    no file name; HDF5's carry an errno inside their text)."""
    if isinstance(error, OSError) and error.errno:     # h5py's strerror is HDF5's whole text
        return OSError(error.errno, os.strerror(error.errno), path)
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    found = re.search(r"errno = (\d+)", str(error))      # after a line break in HDF5's text
    if found:
        number = int(found.group(1))
        return OSError(number, os.strerror(number), path)
    return OSError(None, text, path)


def atomic_write(path, writer, binary=True):
    """Write through a temp file in the same folder and rename, so a crash never leaves a
    half-written file under `path`. `writer` gets an open file, or the temp path when
    binary is False (for libraries such as h5py that open files themselves). The file gets
    the permissions open() would give it; a failed write (disk full) raises an OSError naming
    `path`."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TEMP_SUFFIX, dir=folder)
    except OSError as e:        # named as the user knows it: the file, or its missing folder
        missing = isinstance(e, FileNotFoundError)
        raise OSError(e.errno, e.strerror, os.path.dirname(path) or "." if missing else path) \
            from None
    try:
        os.fchmod(fd, file_mode(path))
        if binary:
            with os.fdopen(fd, "wb") as f:
                writer(f)
                f.flush()
                os.fsync(f.fileno())
        else:
            os.close(fd)
            writer(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and getattr(e, "filename", None) is None \
                or not binary and isinstance(e, (OSError, RuntimeError)):
            raise _write_error(e, path) from e
        raise


def save_caffemodel(net, path, write_diff=False, blob_arrays=None):
    def write(f):
        for chunk in iter_net_chunks(net, write_diff, blob_arrays):
            f.write(chunk)

    atomic_write(path, write)


def save_caffemodel_hdf5(net, path, write_diff=False, blob_arrays=None):
    """Caffe's HDF5 snapshot layout: data/<layer>/<blob index> (and diff/... when asked)."""
    import h5py

    def write(tmp):
        with h5py.File(tmp, "w") as h5:
            groups = [("data", "data")] + ([("diff", "diff")] if write_diff else [])
            for group_name, attr in groups:
                group = h5.create_group(group_name)
                for layer in net.layers:
                    if layer.blobs:
                        g = group.create_group(layer.name)
                        arrays = blob_arrays(layer) if blob_arrays else \
                            [(b.data, b.diff) for b in layer.blobs]
                        for i, pair in enumerate(arrays):
                            g.create_dataset(str(i), data=np.asarray(pair[attr == "diff"],
                                                                     np.float32))

    atomic_write(path, write, binary=False)
