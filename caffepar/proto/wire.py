"""Protobuf's wire format walked by hand: fields of a serialized message as byte ranges, without
building messages (weights go to NumPy as buffers; fork fields are read by the layer's type)."""


class Truncated(Exception):
    """The bytes end inside a field, or hold a wire type protobuf does not have."""


def varint(buf, pos, end):
    result = shift = 0
    while True:
        if pos >= end:
            raise Truncated()
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise Truncated()


def _skip_group(buf, pos, end, number):
    """The position after the end-group key that closes group `number` (nested groups too)."""
    for n, wire, _v, _s, stop, _f in fields(buf, pos, end, _group=number):
        if wire == 4:
            if n != number:
                raise Truncated()
            return stop
    raise Truncated()


def fields(buf, start, end, _group=None):
    """Yield (field number, wire type, value, payload start, stop, field start) for each field
    in buf[start:end]; value is the integer for varints, else None. buf[field start:stop] is
    the whole field, key included (a group's from its start key to its end key)."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise Truncated()
        if wire == 0:
            value_start = pos
            value, pos = varint(buf, pos, end)
            yield number, wire, value, value_start, pos, field_start
        elif wire == 2:
            length, pos = varint(buf, pos, end)
            if pos + length > end:
                raise Truncated()
            yield number, wire, None, pos, pos + length, field_start
            pos += length
        elif wire == 5:
            if pos + 4 > end:
                raise Truncated()
            yield number, wire, None, pos, pos + 4, field_start
            pos += 4
        elif wire == 1:
            if pos + 8 > end:
                raise Truncated()
            yield number, wire, None, pos, pos + 8, field_start
            pos += 8
        elif wire == 3:
            inner = pos
            pos = _skip_group(buf, pos, end, number)
            yield number, wire, None, inner, pos, field_start
        elif wire == 4 and _group is not None:
            yield number, wire, None, pos, pos, field_start
            return
        else:
            raise Truncated()


def packed_varints(buf, start, end):
    out, pos = [], start
    while pos < end:
        v, pos = varint(buf, pos, end)
        out.append(v)
    return out


def encode_varint(value):
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(number, wire):
    return encode_varint((number << 3) | wire)


def length_delimited(number, payload):
    return key(number, 2) + encode_varint(len(payload)) + payload
