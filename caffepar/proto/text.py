"""Reading Caffe's text and binary protobuf files, keeping where each layer was written.

Protobuf's text parser reports syntax errors with line and column but forgets where a message came
from once parsed; the source map kept here lets later, semantic errors (unknown bottom, bad
kernel size) name the file and line of the offending layer.
"""
import os
import re
from array import array
from collections.abc import Mapping

from google.protobuf import message as pb_message
from google.protobuf import text_format

from caffepar.errors import MissingFileError, PrototxtError
from caffepar.proto import caffe_pb2, forks
from caffepar.proto.text_wire import Unsupported, to_wire


class SourceMap:
    """Where a parsed net came from: its path and the line of each top-level layer (`layer`
    and V1 `layers`, as compact arrays). The map from a layer's name to its line is made the
    first time a line is asked for (an error): a net of millions of layers keeps only its
    names, joined in one string."""

    def __init__(self, path=None, layer_lines=(), v1_layer_lines=(), names=(), v1_names=()):
        self.path = path
        self.layer_lines = array("l", layer_lines)
        self.v1_layer_lines = array("l", v1_layer_lines)
        self._names = [_joined(names), _joined(v1_names)]
        self._by_name = None

    @property
    def by_name(self):
        if self._by_name is None:
            self._by_name = {}
            for names, lines in zip(self._names, (self.layer_lines, self.v1_layer_lines)):
                for name, line in zip(_split(names), lines):
                    self._by_name.setdefault(name, line)
        return self._by_name

    def line_of(self, layer_name):
        return self.by_name.get(layer_name)

    def where(self, layer_name):
        """Where the layer is written, looked up only if an error asks (keyword arguments of
        the errors: `path`, `line`)."""
        return LayerPlace(self, layer_name)


def _joined(names):
    """Names as one string (about a byte a name beyond its text), or the list when a name
    holds the separator."""
    names = list(names)
    joined = "\n".join(names)
    return (joined, len(names)) if joined.count("\n") == max(len(names) - 1, 0) else names


def _split(names):
    if isinstance(names, tuple):
        joined, count = names
        return joined.split("\n") if count else []
    return names


class LayerPlace(Mapping):
    """Where a layer of a parsed file is written (`path`, `line`), as errors take it: the
    line is looked up when asked for."""

    __slots__ = ("source_map", "name")

    def __init__(self, source_map, name):
        self.source_map, self.name = source_map, name

    def __getitem__(self, key):
        if key == "path":
            return self.source_map.path
        if key == "line":
            return self.source_map.line_of(self.name)
        raise KeyError(key)

    def __iter__(self):
        return iter(("path", "line"))

    def __len__(self):
        return 2


# Braces, strings (to the line's end when unterminated) and comments: all a scan needs to know
# the nesting depth.
_DEPTH_TOKEN = re.compile(r"""[{}<>]|"(?:[^"\\\n]|\\.)*"?|'(?:[^'\\\n]|\\.)*'?|#[^\n]*""")
_SPACE = " \t\r\n"
_WORD = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"


def _top_level_messages(text):
    """(field name, offset, line) of each message-valued field at the top level, in order, from
    one regex pass; stops early (returning what it found, and False) at a brace that does not
    balance, leaving that text to the parser to report."""
    found, depth, line, counted = [], 0, 1, 0
    for token in _DEPTH_TOKEN.finditer(text):
        c = token.group()
        if c in "{<":
            if depth == 0:
                window = max(0, token.start() - 200)
                before = text[window:token.start()].rstrip(_SPACE)
                before = before[:-1].rstrip(_SPACE) if before.endswith(":") else before
                name = before[len(before.rstrip(_WORD)):]
                if name and not name[0].isdigit():
                    offset = window + len(before) - len(name)
                    line += text.count("\n", counted, offset)
                    counted = offset
                    found.append((name, offset, line))
            depth += 1
        elif c in "}>":
            depth -= 1
            if depth < 0:
                return found, False
    return found, depth == 0


def _top_level_field_lines(text, names):
    """Line numbers (1-based) of each top-level occurrence of the named message fields."""
    out = {name: [] for name in names}
    for name, _offset, line in _top_level_messages(text)[0]:
        if name in out:
            out[name].append(line)
    return out


#: The largest prototxt read, in MB ($CAFFEPAR_MAX_PROTOTXT_MB overrides). A parsed net takes
#: about 0.9 KB a layer, 4 to 14 times its text (a 200 MB text of 3 million one-line layers:
#: 2.7 GB); beyond this a file is far more likely a mistake than a net.
MAX_PROTOTXT_MB = 512


def max_prototxt_bytes():
    value = os.environ.get("CAFFEPAR_MAX_PROTOTXT_MB")
    try:
        return int(float(value) * 2 ** 20) if value else MAX_PROTOTXT_MB * 2 ** 20
    except ValueError:
        raise PrototxtError(f"CAFFEPAR_MAX_PROTOTXT_MB={value!r} is not a number") from None


def read_text(path):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path)
    if os.path.isdir(path):
        raise PrototxtError("is a directory, expected a prototxt file", path=path)
    size, limit = os.path.getsize(path), max_prototxt_bytes()
    if size > limit:
        raise PrototxtError(f"{size / 2 ** 20:.0f} MB is more than the {limit / 2 ** 20:.0f} MB "
                            "a prototxt may have (a parsed net takes 4 to 14 times its text in "
                            "memory); set CAFFEPAR_MAX_PROTOTXT_MB to read it anyway", path=path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PrototxtError("is not a text prototxt (binary content)", path=path)


#: Texts longer than this are parsed a part at a time (see parse_text).
CHUNK_CHARS = 4 << 20


def parse_text(text, message, path="<string>", chunk_chars=CHUNK_CHARS):
    """Merge prototxt `text` into `message`; syntax errors become PrototxtError with file:line.

    Text goes straight to protobuf's wire format (text_wire) and protobuf's C parser reads
    that: protobuf's own text parser, pure Python, takes minutes for a net of millions of
    layers. What text_wire does not take, and every error, goes to protobuf's text parser,
    which reads it or says where it is wrong. A long text is read a few MB at a time, cut
    where a top-level message field starts a line, so memory stays that of the text and the
    message, and the log shows progress."""
    _parse(text, message, path, chunk_chars)
    return message


def _parse(text, message, path, chunk_chars=None, record=()):
    """parse_text, returning ({field in record: array of the lines its top-level messages
    start at}, {field: their names})."""
    chunk_chars = chunk_chars or CHUNK_CHARS
    lines = {name: array("l") for name in record}
    names = {name: [] for name in record}
    if len(text) <= chunk_chars:
        parts = [(0, len(text), 1)]
    else:
        parts = _parts(text, chunk_chars, message)
        from caffepar.logs import progress
        progress("Parsing %s (%.0f MB) in %d parts", path, len(text) / 1e6, len(parts))
    shown = 0
    wired_parts = _wired_parts(text, parts, message, record)
    try:
        for (start, end, line), wired in zip(parts, wired_parts):
            if wired is None:
                part_lines, part_names = _merge_part(
                    text[start:end] if len(parts) > 1 else text, message, path, line, record)
            else:
                message.MergeFromString(wired[0])
                part_lines, part_names = wired[1], wired[2]
                wired = None
            for name in record:
                _extend_shifted(lines[name], part_lines[name], line - 1)
                names[name] += part_names[name]
            if len(parts) > 1 and 10 * end // len(text) > shown:
                shown = 10 * end // len(text)
                progress("Parsing %s: %d%%", path, 10 * shown)
    finally:
        if hasattr(wired_parts, "close"):     # the workers end with the parse, however it ends
            wired_parts.close()
    return lines, names


def _extend_shifted(lines, part_lines, shift):
    """lines += part_lines, each plus shift (a part's lines counted from the file's start)."""
    if shift and part_lines:
        import numpy as np
        part_lines = (np.frombuffer(part_lines, np.dtype("l")) + shift).tobytes()
        lines.frombytes(part_lines)
    else:
        lines.extend(part_lines)


#: Texts of at least this many characters are turned into wire format by several processes,
#: a part each, where the machine has more than one core (the 200 MB text of a net of 3
#: million layers: about half the time).
PARALLEL_CHARS = 32 << 20


def _wired_parts(text, parts, message, record):
    """For each part in order: to_wire's answer made by a worker process, or None (a part
    text_wire does not take, or no workers: _merge_part reads it here)."""
    workers = _parse_workers(len(text), len(parts))
    if workers < 2:
        return [None] * len(parts)
    import multiprocessing
    try:
        pool = multiprocessing.get_context("fork").Pool(
            workers, initializer=_keep_for_workers,
            initargs=(text, type(message).__name__, record))
    except OSError:
        return [None] * len(parts)
    return _pooled(pool, parts)


def _pooled(pool, parts):
    with pool:
        yield from pool.imap(_wire_of_part, [(start, end) for start, end, _line in parts])


def _parse_workers(chars, parts):
    """How many processes turn a text of `chars` characters in `parts` parts into wire format:
    1 below PARALLEL_CHARS, on one core, or where forking is unsafe (other threads, or MPI
    started in this process)."""
    import sys
    import threading
    if chars < PARALLEL_CHARS or parts < 2 or threading.active_count() > 1 or \
            "mpi4py.MPI" in sys.modules:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(cores, parts, 4)


_worker_task = None     # (text, message type name, record) in a parse worker


def _keep_for_workers(text, type_name, record):
    global _worker_task
    _worker_task = (text, type_name, record)


def _wire_of_part(bounds):
    """to_wire of text[start:end] in a worker; None where text_wire does not take it."""
    text, type_name, record = _worker_task
    try:
        return to_wire(text[bounds[0]:bounds[1]], getattr(caffe_pb2, type_name).DESCRIPTOR,
                       record)
    except Unsupported:
        return None


def _merge_part(text, message, path, first_line, record):
    """Merge one part (starting at `first_line` of the file) into `message`: text_wire's way,
    else protobuf's. Returns the lines and names of its `record` fields, as _parse."""
    try:
        wire, lines, names = to_wire(text, message.DESCRIPTOR, record)
    except Unsupported:
        pass
    else:
        message.MergeFromString(wire)
        return lines, names
    if not record:
        _merge(text, message, path, first_line)
        return {}, {}
    part = _merge(text, type(message)(), path, first_line)
    found = _top_level_field_lines(text, record)
    lines = {name: array("l", found[name]) for name in record}
    names = {name: [m.name for m in getattr(part, name)] for name in record}
    message.MergeFrom(part)
    return lines, names


#: A line where a top-level `layer` or V1 `layers` field starts: a NetParameter's only fields of
#: those names, so a cut there is at the top level (lines cannot start inside a string).
_LAYER_LINE = re.compile(r"^[ \t]*layers?[ \t]*[{<:]", re.M)


def _parts(text, chunk_chars, message=None):
    """(start, end, first line) of consecutive pieces of about chunk_chars each, each cut at the
    start of a line where a top-level message field begins (a top-level field is merged the
    same whether it comes alone or with the rest). A NetParameter is cut at its layer lines,
    found by one search each; other messages after a scan of their nesting."""
    if not isinstance(message, caffe_pb2.NetParameter):
        return _scanned_parts(text, chunk_chars)
    parts, start, line = [], 0, 1
    while len(text) - start > chunk_chars:
        found = _LAYER_LINE.search(text, start + chunk_chars)
        if found is None:
            break
        parts.append((start, found.start(), line))
        line += text.count("\n", start, found.start())
        start = found.start()
    parts.append((start, len(text), line))
    return parts


def _scanned_parts(text, chunk_chars):
    fields, _balanced = _top_level_messages(text)
    parts, start, line = [], 0, 1
    for _name, offset, field_line in fields:
        begin = text.rfind("\n", 0, offset) + 1
        if offset - start < chunk_chars or text[begin:offset].strip():
            continue
        parts.append((start, begin, line))
        start, line = begin, field_line
    parts.append((start, len(text), line))
    return parts


#: Fields that Caffe forks added and BVLC Caffe (hence caffepar) does not have, with what
#: BVLC Caffe says instead.
FORK_FIELDS = {
    ("ConvolutionParameter", "depthwise"): "BVLC Caffe runs a depthwise convolution as group "
                                           "equal to the channel count",
}


def _fork_field_hint(message):
    match = re.search(r'"caffe\.(\w+)" has no field named "(\w+)"', message)
    if not match:
        return None
    owner, name = match.groups()
    if (owner, name) in FORK_FIELDS:
        return f"{name} is a field of a Caffe fork, not of BVLC Caffe: {FORK_FIELDS[owner, name]}"
    return forks.fork_of_field(name, owner)


def _merge(text, message, path, first_line):
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
        if line is not None:
            line += first_line - 1
        hint = _fork_field_hint(msg)
        raise PrototxtError(f"syntax error: {msg.rstrip('.') if hint else msg}", path=path,
                            line=line, hint=hint) from None
    return message


def read_net_text(source, is_text=None):
    """Parse a NetParameter from a prototxt path (or from text when is_text) with its SourceMap."""
    if is_text:
        text, path = source, "<string>"
    else:
        path = os.fspath(source)
        text = read_text(path)
    net = caffe_pb2.NetParameter()
    lines, names = _parse(text, net, path, record=("layer", "layers"))
    del text
    smap = SourceMap(path, lines["layer"], lines["layers"], names["layer"], names["layers"])
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
