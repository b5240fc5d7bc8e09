"""Prototxt text straight to protobuf's wire format, for long nets.

Protobuf's text parser is pure Python and takes about 90 us a layer of a one-line net (a
3-million-layer prototxt: minutes). Here one regular expression cuts the text into tokens and
a loop writes the wire bytes of the message, which protobuf's C parser then reads: a few us a
layer. It takes the text format as nets are written: fields, nested messages in { } or < >,
scalars of every type caffe.proto uses, lists in [ ], comments, adjacent strings and C escapes,
separators. Values are read by protobuf's own text functions, so each means what it means
there. Anything else, and every error, raises Unsupported: the caller then gives the text to
protobuf's parser, which reads it or reports where it is wrong.
"""
import math
import re
import struct
from array import array

from google.protobuf import descriptor, text_encoding, text_format

__all__ = ["Unsupported", "to_wire"]


class Unsupported(Exception):
    """The text is not in the form this reader takes (or is wrong): protobuf's parser decides."""


# Protobuf's tokens (text_format.Tokenizer._TOKEN), led by spaces and comments, and line ends
# as tokens of their own so that lines can be counted.
_TOKEN = re.compile(r"""[ \t\r\f\v]*(?:\#[^\n]*)?(
    \n
  | [a-zA-Z_][0-9a-zA-Z_+-]*
  | (?:[0-9+-]|\.[0-9])[0-9a-zA-Z_.+-]*
  | "[^"\n\\]*(?:\\.[^"\n\\]*)*"
  | '[^'\n\\]*(?:\\.[^'\n\\]*)*'
  | [^ \t\r\f\v\n])""", re.X)
_END = "\0end"

_FD = descriptor.FieldDescriptor
_MESSAGE, _VARINT, _SIGNED, _FLOAT, _DOUBLE, _BOOL, _STRING, _BYTES, _ENUM = range(9)
_KINDS = {_FD.TYPE_MESSAGE: _MESSAGE, _FD.TYPE_INT32: _SIGNED, _FD.TYPE_INT64: _SIGNED,
          _FD.TYPE_UINT32: _VARINT, _FD.TYPE_UINT64: _VARINT, _FD.TYPE_FLOAT: _FLOAT,
          _FD.TYPE_DOUBLE: _DOUBLE, _FD.TYPE_BOOL: _BOOL, _FD.TYPE_STRING: _STRING,
          _FD.TYPE_BYTES: _BYTES, _FD.TYPE_ENUM: _ENUM}
_WIRE = {_MESSAGE: 2, _VARINT: 0, _SIGNED: 0, _FLOAT: 5, _DOUBLE: 1, _BOOL: 0, _STRING: 2,
         _BYTES: 2, _ENUM: 0}
_FLOAT_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def _varint(value):
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [_varint(n) for n in range(1 << 14)]


def _length(n):
    return _SMALL[n] if n < 16384 else _varint(n)


class _Table:
    """A message type's fields by name: (kind, key bytes, table or field descriptor)."""

    _made = {}

    def __init__(self, desc):
        self.fields = {}
        _Table._made[desc.full_name] = self
        for fd in desc.fields:
            kind = _KINDS.get(fd.type)
            if kind is None:
                continue                    # a type caffe.proto does not use: Unsupported
            key = _varint(fd.number << 3 | _WIRE[kind])
            sub = (_Table.of(fd.message_type) if kind == _MESSAGE else fd)
            self.fields[fd.name] = (kind, key, sub, fd.is_repeated)

    @classmethod
    def of(cls, desc):
        return cls._made.get(desc.full_name) or cls(desc)


_values = {}


def _scalar(kind, fd, token):
    """The wire bytes of one scalar value (key excluded), by protobuf's own text functions."""
    cached = _values.get((fd, token))
    if cached is not None:
        return cached
    try:
        if kind == _VARINT or kind == _SIGNED:
            is_long = fd.type in (_FD.TYPE_INT64, _FD.TYPE_UINT64)
            out = _varint(text_format.ParseInteger(token, kind == _SIGNED, is_long))
        elif kind == _FLOAT or kind == _DOUBLE:
            value = text_format.ParseFloat(token)
            if not math.isfinite(value) or kind == _FLOAT and abs(value) > _FLOAT_MAX:
                raise Unsupported(token)    # protobuf's own conversion decides these
            out = struct.pack("<f" if kind == _FLOAT else "<d", value)
        elif kind == _BOOL:
            out = b"\x01" if text_format.ParseBool(token) else b"\x00"
        else:
            out = _varint(text_format.ParseEnum(fd, token))
    except ValueError:
        raise Unsupported(token) from None
    if len(_values) < 100000:
        _values[fd, token] = out
    return out


def _string(token, kind):
    if token[0] != token[-1] or len(token) < 2:
        raise Unsupported(token)
    if "\\" not in token:
        return token[1:-1].encode("utf-8")
    try:
        raw = text_encoding.CUnescape(token[1:-1])
        if kind == _STRING:
            raw.decode("utf-8")
    except ValueError:
        raise Unsupported(token) from None
    return raw


class _Reader:
    """The state of one text's reading: its tokens, where it is, the line."""

    def __init__(self, text):
        # A comment is always followed by a line end: one at the text's end too (else the
        # expression would take a comment's last letters for a token).
        self.tokens = _TOKEN.findall(text if text.endswith("\n") else text + "\n")
        self.tokens.append(_END)
        self.i = 0
        self.line = 1

    def next(self):
        tokens, i = self.tokens, self.i
        token = tokens[i]
        while token == "\n":
            self.line += 1
            i += 1
            token = tokens[i]
        self.i = i + 1
        return token

    def message(self, table, end, name_of=None, record=None):
        """The wire bytes of the fields up to `end` (a closing brace or bracket, or _END).
        `name_of`: a list to append the message's `name` field to (a layer's name);
        `record`: {field: (array of lines, list of names)} for the top-level message fields
        whose lines and names a source map keeps. The loop reads tokens in place (a call a
        token would double its time)."""
        out = []
        append = out.append
        fields = table.fields
        tokens = self.tokens
        i = self.i
        name = None
        separated = True
        while True:
            token = tokens[i]
            i += 1
            if token == "\n":
                self.line += 1
                continue
            if token == end:
                self.i = i
                if name_of is not None:
                    name_of.append(name or "")
                return b"".join(out)
            if (token == "," or token == ";") and not separated:
                separated = True
                continue
            field = fields.get(token)
            if field is None:
                raise Unsupported(token)
            field_name, field_line = token, self.line
            kind, key, sub, repeated = field
            token = tokens[i]
            i += 1
            if token == "\n":
                self.i = i - 1
                token = self.next()
                i = self.i
            if kind == _MESSAGE:
                if token == ":":
                    self.i = i
                    token = self.next()
                    i = self.i
                if token == "{":
                    close = "}"
                elif token == "<":
                    close = ">"
                else:
                    raise Unsupported(token)
                kept = record.get(field_name) if record is not None else None
                if kept is not None:
                    kept[0].append(field_line)
                self.i = i
                payload = self.message(sub, close, kept[1] if kept is not None else None)
                i = self.i
                append(key)
                append(_length(len(payload)))
                append(payload)
                separated = False
                continue
            if token != ":":
                raise Unsupported(token)
            token = tokens[i]
            i += 1
            if token == "\n":
                self.i = i - 1
                token = self.next()
                i = self.i
            if kind == _STRING and token[0] == '"' and "\\" not in token and len(token) > 1 \
                    and token[-1] == '"' and tokens[i][0] not in "\n\"'":
                value = token[1:-1].encode("utf-8")       # the common case, in line
            elif token == "[" and repeated:
                self.i = i
                self._list(kind, key, sub, append)
                i = self.i
                separated = False
                continue
            else:
                self.i = i
                value = self._value(kind, sub, token)
                i = self.i
            if name_of is not None and field_name == "name" and kind == _STRING:
                name = value.decode("utf-8")
            append(key)
            if kind == _STRING or kind == _BYTES:
                append(_length(len(value)))
            append(value)
            separated = False

    def _value(self, kind, fd, token):
        if kind != _STRING and kind != _BYTES:
            if token in _PUNCTUATION:
                raise Unsupported(token)
            return _scalar(kind, fd, token)
        if token[0] not in "\"'":
            raise Unsupported(token)
        value = _string(token, kind)
        while True:                              # adjacent strings are one
            token = self.next()
            if token[0] not in "\"'":
                self.i -= 1
                return value
            value += _string(token, kind)

    def _list(self, kind, key, fd, append):
        if kind == _MESSAGE:
            raise Unsupported("[")
        token = self.next()
        if token == "]":
            return
        while True:
            value = self._value(kind, fd, token)
            append(key)
            if kind == _STRING or kind == _BYTES:
                append(_length(len(value)))
            append(value)
            token = self.next()
            if token == "]":
                return
            if token != ",":
                raise Unsupported(token)
            token = self.next()


_PUNCTUATION = frozenset("{}<>[]:,;" + _END)


def to_wire(text, desc, record=()):
    """(wire bytes of `text` as a message of type `desc`, {field: array of the lines where
    each top-level message field named in `record` starts}, {field: their `name` fields}).
    Raises Unsupported for anything it does not take (protobuf's parser decides then)."""
    reader = _Reader(text)
    kept = {name: (array("l"), []) for name in record}
    wire = reader.message(_Table.of(desc), _END, record=kept)
    return (wire, {name: lines for name, (lines, _n) in kept.items()},
            {name: names for name, (_l, names) in kept.items()})
