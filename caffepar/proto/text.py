"""Reading Caffe's text and binary protobuf files, keeping where each layer was written.

Protobuf's text parser reports syntax errors with line and column but forgets where a message came
from once parsed; the source map kept here lets later, semantic errors (unknown bottom, bad
kernel size) name the file and line of the offending layer.
"""
import os
from dataclasses import dataclass, field

from google.protobuf import message as pb_message
from google.protobuf import text_format

from caffepar.errors import MissingFileError, PrototxtError
from caffepar.proto import caffe_pb2


@dataclass
class SourceMap:
    """Where a parsed net came from: its path and the line of each top-level layer."""

    path: str = None
    layer_lines: list = field(default_factory=list)
    v1_layer_lines: list = field(default_factory=list)
    by_name: dict = field(default_factory=dict)

    def line_of(self, layer_name):
        return self.by_name.get(layer_name)


def _top_level_field_lines(text, names):
    """Line numbers (1-based) of each top-level occurrence of the named message fields."""
    found = {name: [] for name in names}
    depth = 0
    line = 1
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    line += 1
                j += 1
            i = j + 1
        elif c in "{<":
            depth += 1
            i += 1
        elif c in "}>":
            depth -= 1
            i += 1
        elif depth == 0 and (c.isalpha() or c == "_"):
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            if word in found:
                found[word].append(line)
            i = j
        else:
            i += 1
    return found


def read_text(path):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path)
    if os.path.isdir(path):
        raise PrototxtError("is a directory, expected a prototxt file", path=path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PrototxtError("is not a text prototxt (binary content)", path=path)


def parse_text(text, message, path="<string>"):
    """Merge prototxt `text` into `message`; syntax errors become PrototxtError with file:line."""
    try:
        text_format.Merge(text, message, allow_unknown_field=False)
    except text_format.ParseError as e:
        line = getattr(e, "_line", None)
        col = getattr(e, "_column", None)
        msg = str(e)
        # ParseError's text starts with "line:col : " when it knows the position.
        head, sep, rest = msg.partition(" : ")
        if sep and ":" in head and head.replace(":", "").isdigit():
            msg = rest
        if line is not None and col is not None:
            msg = f"column {col}: {msg}"
        raise PrototxtError(f"syntax error: {msg}", path=path, line=line) from None
    return message


def read_net_text(source, is_text=None):
    """Parse a NetParameter from a prototxt path (or from text when is_text) with its SourceMap."""
    if is_text:
        text, path = source, "<string>"
    else:
        path = os.fspath(source)
        text = read_text(path)
    net = parse_text(text, caffe_pb2.NetParameter(), path)
    lines = _top_level_field_lines(text, ("layer", "layers"))
    smap = SourceMap(path=path, layer_lines=lines["layer"], v1_layer_lines=lines["layers"])
    for lp, ln in zip(net.layer, smap.layer_lines):
        smap.by_name.setdefault(lp.name, ln)
    for lp, ln in zip(net.layers, smap.v1_layer_lines):
        smap.by_name.setdefault(lp.name, ln)
    return net, smap


def read_solver_text(path):
    text = read_text(path)
    return parse_text(text, caffe_pb2.SolverParameter(), os.fspath(path))


def read_binary(path, message):
    """Parse a binary protobuf file (caffemodel, solverstate, binaryproto) into `message`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        message.ParseFromString(data)
    except pb_message.DecodeError as e:
        raise PrototxtError(f"cannot decode as binary {message.DESCRIPTOR.name} "
                            f"(truncated or not a Caffe file): {e}", path=path) from None
    return message


def read_blob_proto(path):
    return read_binary(path, caffe_pb2.BlobProto())
