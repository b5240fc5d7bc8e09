"""Upgrade old Caffe files on disk: V0/V1 prototxt nets, old solvers, V0/V1 binary caffemodels.

The message rewrites live in caffepar.proto.upgrade (pure functions); this module only reads and
writes files, as Caffe's upgrade_net_proto_text / upgrade_net_proto_binary /
upgrade_solver_proto_text tools do. A binary caffemodel is rewritten without handing its weights
to Python protobuf: each layer is parsed with its blobs cut out, upgraded, and the original
BlobProto bytes are spliced back in where protobuf would serialize them. The result is the same
bytes Caffe's tool writes, and a VGG-sized V1 model upgrades in seconds.
"""
import os
from dataclasses import dataclass, field

from google.protobuf import text_format

from caffepar.errors import PrototxtError, WeightsError
from caffepar.io.weights import (LAYER_BLOBS, NET_LAYER, NET_LAYERS, V0Model, _encode_varint,
                                 _fields, _key, atomic_write, is_hdf5, split_layers)
from caffepar.proto import caffe_pb2
from caffepar.proto.text import read_text, parse_text
from caffepar.proto.upgrade import (net_needs_upgrade, solver_needs_upgrade, upgrade_net,
                                    upgrade_solver)

__all__ = ["UpgradeResult", "upgrade_file", "upgrade_caffemodel_bytes", "detect_kind"]


@dataclass
class UpgradeResult:
    """What `upgrade_file` found: the kind of file, whether it changed, and Caffe's notes."""

    kind: str
    changed: bool
    notes: list = field(default_factory=list)
    written: bool = False


def detect_kind(path):
    """"net", "solver", "caffemodel" or "hdf5" from the file's content, not its name."""
    path = os.fspath(path)
    if is_hdf5(path):
        return "hdf5"
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        # A multi-byte character cut at the 64 KiB boundary is still text.
        if e.start < len(head) - 4:
            return "caffemodel"
    if b"\x00" in head:
        return "caffemodel"
    text = read_text(path)
    try:
        text_format.Merge(text, caffe_pb2.NetParameter())
        return "net"
    except text_format.ParseError:
        pass
    try:
        text_format.Merge(text, caffe_pb2.SolverParameter())
        return "solver"
    except text_format.ParseError:
        pass
    parse_text(text, caffe_pb2.NetParameter(), path)  # raises with file:line
    return "net"


def _split_at_blobs(serialized):
    """Where protobuf would put field 7 (blobs) in a serialized LayerParameter: after every
    field numbered below 7, since protobuf writes known fields in field-number order."""
    for number, _wire, _v, _s, _e, last in _fields(serialized, 0, len(serialized)):
        if number > LAYER_BLOBS:
            return last
    return len(serialized)


def _layer_bytes(layer_param, blob_payloads, unread=b""):
    """A serialized `layer { ... }` entry (field 100) with raw BlobProto payloads spliced in,
    and the fields read as unknown (`unread`, whole fields) after the rest, where Caffe's
    protobuf writes unknown fields."""
    body = layer_param.SerializeToString()
    cut = _split_at_blobs(body)
    blobs = b"".join(_key(LAYER_BLOBS, 2) + _encode_varint(len(p)) + p for p in blob_payloads)
    inner = body[:cut] + blobs + body[cut:] + unread
    return _key(NET_LAYER, 2) + _encode_varint(len(inner)) + inner


def upgrade_caffemodel_bytes(buf, source=None):
    """(upgraded bytes or None when nothing changes, notes) for a binary caffemodel."""
    try:
        head, layers = split_layers(buf, source)
    except V0Model:
        return _upgrade_small_model(buf, source)
    kinds = {number for number, _body, _blobs, _x in layers}
    if len(kinds) > 1:
        raise PrototxtError("caffemodel mixes 'layer' (V2) and 'layers' (V1) entries; Caffe "
                            "refuses to upgrade it", path=source)
    v1 = kinds == {NET_LAYERS}
    stripped_layers = [body for _n, body, _b, _x in layers]
    payloads = [[memoryview(buf)[s:e] for s, e in blobs] for _n, _b, blobs, _x in layers]
    # Fields BVLC Caffe does not number stay as they are, unknown fields to its tool too.
    unread = [b"".join(raw for _number, raw in extras) for _n, _b, _bl, extras in layers]
    net = caffe_pb2.NetParameter()
    try:
        net.ParseFromString(bytes(head))
        for body in stripped_layers:
            target = net.layers.add() if v1 else net.layer.add()
            target.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError and friends
        raise WeightsError(f"not a Caffe NetParameter: {e}", path=source) from None
    if not net_needs_upgrade(net):
        return None, []
    upgraded, notes = upgrade_net(net, source=source)
    # V1 -> V2 maps layer i to layer i; an Input layer may have been put in front.
    offset = len(upgraded.layer) - len(payloads)
    if offset < 0:
        raise WeightsError("upgrade changed the number of layers unexpectedly", path=source)
    layers = list(upgraded.layer)
    upgraded.ClearField("layer")
    out = [upgraded.SerializeToString()]
    for i, lp in enumerate(layers):
        out.append(_layer_bytes(lp, payloads[i - offset] if i >= offset else [],
                                unread[i - offset] if i >= offset else b""))
    return b"".join(out), notes


def _upgrade_small_model(buf, source):
    """V0 models nest blobs one level deeper and may fold layers away; they predate big nets,
    so protobuf parses them whole."""
    net = caffe_pb2.NetParameter()
    try:
        net.ParseFromString(bytes(buf))
    except Exception as e:
        raise WeightsError(f"not a Caffe NetParameter: {e}", path=source) from None
    upgraded, notes = upgrade_net(net, source=source)
    return upgraded.SerializeToString(), notes


def _write_bytes(path, data):
    atomic_write(path, lambda f: f.write(data))


def upgrade_file(src, dst=None, check=False):
    """Upgrade `src` (net prototxt, solver prototxt or binary caffemodel) into `dst`.

    With `check`, or without `dst`, nothing is written: the result tells what would change.
    A current file is copied unchanged, so scripts can run this on every model they hold.
    """
    src = os.fspath(src)
    if not os.path.exists(src):
        from caffepar.errors import MissingFileError
        raise MissingFileError(src)
    kind = detect_kind(src)
    name = os.path.basename(src)
    if kind == "hdf5":
        return UpgradeResult(kind, False, [f"{name}: HDF5 caffemodels hold only blobs; "
                                           "there is nothing to upgrade"])
    if kind == "caffemodel":
        with open(src, "rb") as f:
            buf = f.read()
        data, notes = upgrade_caffemodel_bytes(buf, source=name)
        result = UpgradeResult(kind, data is not None, notes)
        if dst and not check:
            _write_bytes(dst, buf if data is None else data)
            result.written = True
        return result
    text = read_text(src)
    if kind == "solver":
        msg = parse_text(text, caffe_pb2.SolverParameter(), src)
        changed = solver_needs_upgrade(msg)
        out, notes = upgrade_solver(msg, source=name)
    else:
        msg = parse_text(text, caffe_pb2.NetParameter(), src)
        changed = net_needs_upgrade(msg)
        out, notes = upgrade_net(msg, source=name)
    result = UpgradeResult(kind, changed, notes)
    if dst and not check:
        payload = text_format.MessageToString(out) if changed else text
        atomic_write(dst, lambda f: f.write(payload.encode("utf-8")))
        result.written = True
    return result
