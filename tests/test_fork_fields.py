"""Reading stays BVLC-tolerant whatever the forks add: a field under a number caffepar gives a
fork's field, in a file BVLC Caffe reads, is read by the layer's type and kept as an unknown
field where it is not ours, so the file loads with the meaning BVLC Caffe gives it, and a
rewrite keeps what Caffe's own tools keep."""
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from caffepar.convert.npz import write_caffemodel
from caffepar.convert.upgrade import upgrade_caffemodel_bytes
from caffepar.io.weights import read_caffemodel
from caffepar.proto import caffe_pb2, forks, wire
from caffepar.proto.text import read_net_text
from conftest import DATA, need_shared

@pytest.fixture(autouse=True)
def _notes_on_stderr(monkeypatch):
    """Notes go to stderr as in a fresh process with no log set up (an earlier test's log may
    still hold its stream)."""
    from caffepar import logs
    monkeypatch.setattr(logs.LOGGER, "disabled", True)


LAYER = caffe_pb2.LayerParameter.DESCRIPTOR
#: BVLC Caffe's LayerParameter numbers (its caffe.proto: 1-11, 100-148).
BVLC_NUMBERS = set(range(1, 12)) | set(range(100, 149))
#: Every number of a LayerParameter at which caffepar reads something BVLC Caffe does not (the
#: forks' fields, ours, and SegNet's bn_param read by type), and a few numbers nobody uses.
FORK_NUMBERS = sorted({f.number for f in LAYER.fields} - BVLC_NUMBERS
                      | {number for _type, number, _name, _msg in forks.COLLIDING_FIELDS
                         if number not in BVLC_NUMBERS})
UNUSED = [12, 99, 999, 5000, 10000, 2 ** 29 - 1]
#: Inside a BVLC message: PoolingParameter's ceil_mode (a fork's) and numbers nobody uses.
POOLING_NUMBERS = [1013, 14, 99, 10001]


def payloads(number, kind):
    """One field of each wire type: a varint, 8 and 4 fixed bytes, bytes that parse as no
    message, bytes that parse as a message (field 1, varint 1), and a group."""
    key = wire.key
    return {
        "varint": key(number, 0) + b"\x01",
        "fixed64": key(number, 1) + bytes(range(8)),
        "fixed32": key(number, 5) + b"\x00\x00\x80\x3f",
        "bytes": wire.length_delimited(number, b"\xff\xfe not a message"),
        "message": wire.length_delimited(number, b"\x08\x01"),
        "group": key(number, 3) + key(1, 0) + b"\x05" + key(number, 4),
    }[kind]


KINDS = ["varint", "fixed64", "fixed32", "bytes", "message", "group"]


def _split(buf, start=0, end=None):
    return [bytes(buf[f:e]) for _n, _w, _v, _s, e, f in wire.fields(buf, start,
                                                                       len(buf) if end is None
                                                                       else end)]


def _inserted(fields, extra, rng):
    out = list(fields)
    for field in extra:
        out.insert(int(rng.integers(0, len(out) + 1)), field)
    return out


def inject(buf, kind, seed=0):
    """`buf` (a binary NetParameter) with, in every V2 layer, one `kind` field at each of
    FORK_NUMBERS and UNUSED, and in every pooling_param one at each of POOLING_NUMBERS, each
    at a random place among the layer's fields. Returns (bytes, [(layer index, field)])."""
    rng = np.random.default_rng(seed)
    out, added, index = [], [], 0
    for number, _w, _v, s, e, f in wire.fields(buf, 0, len(buf)):
        if number != 100:
            out.append(bytes(buf[f:e]))
            continue
        fields = []
        for n2, _w2, _v2, s2, e2, f2 in wire.fields(buf, s, e):
            if n2 == 121:
                inner = _inserted(_split(buf, s2, e2),
                                  [payloads(n, kind) for n in POOLING_NUMBERS], rng)
                fields.append(wire.length_delimited(121, b"".join(inner)))
            else:
                fields.append(bytes(buf[f2:e2]))
        extra = [payloads(n, kind) for n in FORK_NUMBERS + UNUSED]
        added += [(index, field) for field in extra]
        out.append(wire.length_delimited(100, b"".join(_inserted(fields, extra, rng))))
        index += 1
    return b"".join(out), added


def bvlc_view(layer):
    """What BVLC Caffe sees of a layer: its BVLC-numbered fields, without fork fields nested in
    them or unknown fields."""
    view = caffe_pb2.LayerParameter()
    view.CopyFrom(layer)
    for field, _value in view.ListFields():
        if field.number not in BVLC_NUMBERS:
            view.ClearField(field.name)
    if view.HasField("pooling_param"):
        view.pooling_param.ClearField("ceil_mode")
    view.DiscardUnknownFields()
    return text_format.MessageToString(view)


def _layer_fields(buf):
    """Each V2 layer's fields but its blobs, as a sorted list of whole fields (pooling_param's
    as the sorted list of its own: protobuf writes unknown fields after the known ones)."""
    def field(n2, s2, e2, f2):
        return (121, sorted(_split(buf, s2, e2))) if n2 == 121 else (n2, bytes(buf[f2:e2]))
    return [sorted(field(n2, s2, e2, f2) for n2, _w2, _v2, s2, e2, f2 in wire.fields(buf, s, e)
                   if n2 != 7)
            for n, _w, _v, s, e, _f in wire.fields(buf, 0, len(buf)) if n == 100]


def _prototxt_as_binary(path):
    """A net prototxt as the binary NetParameter Caffe's tools read and write."""
    net, _smap = read_net_text(path)
    return net.SerializeToString()


def _sources():
    data = need_shared(DATA)
    models = [data / "models/lenet/lenet_iter_10000.caffemodel",
              data / "models/cifar10_quick/cifar10_quick_iter_5000.caffemodel"]
    texts = sorted(p for p in (data / "models").rglob("*.prototxt") if "solver" not in p.name)
    return [(p.name, p.read_bytes()) for p in models] + \
        [(p.name, _prototxt_as_binary(p)) for p in texts]


def test_fork_numbers_are_the_schemas():
    """The numbers injected below are every one caffepar reads beyond BVLC Caffe's; every fork
    field of the schema names the layer types that read it (so that another type leaves it
    unread), but caffepar's own parallel_mode, which any layer has."""
    assert {202, 10001, 8266711, 149, 152, 2143, 1000, 45} <= set(FORK_NUMBERS)
    unlisted = [f.name for f in LAYER.fields if f.number not in BVLC_NUMBERS
                and f.name not in forks.FIELD_LAYER_TYPES]
    assert unlisted == ["parallel_mode"]
    assert forks.BVLC_LAYER_NUMBERS == BVLC_NUMBERS


@pytest.mark.parametrize("kind", KINDS)
def test_injected_fields_leave_what_bvlc_caffe_sees_unchanged(tmp_path, kind, capsys):
    """Real caffemodels, and real prototxts as binary nets, with a field of one wire type at
    every fork number in every layer: they load; every layer reads as BVLC Caffe reads it and
    every blob is the same; a rewrite keeps every field Caffe's tools keep, byte for byte."""
    for name, buf in _sources():
        original = tmp_path / f"{name}.orig"
        original.write_bytes(buf)
        injected_bytes, added = inject(buf, kind)
        injected = tmp_path / f"{name}.{kind}"
        injected.write_bytes(injected_bytes)
        want, got = read_caffemodel(original), read_caffemodel(injected)
        assert [bvlc_view(lp) for lp in got.net_param.layer] == \
            [bvlc_view(lp) for lp in want.net_param.layer], name
        # No layer of these nets is of a fork's type: no fork field was read into any.
        assert not [(lp.name, field.name) for lp in got.net_param.layer
                    for field, _v in lp.ListFields() if field.name in forks.FIELD_LAYER_TYPES]
        for (n1, t1, b1), (n2, t2, b2) in zip(want.layers, got.layers):
            assert (n1, t1, len(b1)) == (n2, t2, len(b2))
            for (v1, s1, _l1), (v2, s2, _l2) in zip(b1, b2):
                assert s1 == s2 and np.array_equal(v1, v2)
        # `caffepar convert weights` (binary to binary) and `convert upgrade` write each
        # layer's fields again: the injected ones all come back (BVLC Caffe's tools keep
        # unknown fields), and nothing else changes.
        rewritten = tmp_path / f"{name}.{kind}.out"
        write_caffemodel(got, rewritten)
        assert _layer_fields(rewritten.read_bytes()) == _layer_fields(injected_bytes), name
        data, _notes = upgrade_caffemodel_bytes(injected_bytes)
        if data is not None:            # an Input layer put in front of an old net's layers
            upgraded = _layer_fields(data)
            assert upgraded[len(upgraded) - len(want.layers):] == _layer_fields(injected_bytes)
        assert added
    # At most one note per file (here: the fields under fork numbers that other layers hold).
    notes = [line for line in capsys.readouterr().err.splitlines() if "kept as an unknown" in line]
    assert len(notes) <= len(_sources())


def test_open_nsfw_shaped_model_loads_and_keeps_its_fields(tmp_path, capsys):
    """Yahoo's open_nsfw caffemodel has, in its first V2 layer, field 10000 (a varint) and
    10001 (bytes) of the Caffe it was trained with; 10001 is R-FCN's psroi_pooling_param here.
    It loads as in BVLC Caffe, with one note, and a rewrite keeps both fields."""
    from caffepar.graph.net import Net
    prototxt = tmp_path / "net.prototxt"
    prototxt.write_text(
        'layer { name: "data" type: "Input" top: "data" top: "rois" input_param { shape { '
        'dim: 1 dim: 3 dim: 6 dim: 6 } shape { dim: 1 dim: 5 } } }\n'
        'layer { name: "conv_1" type: "Convolution" bottom: "data" top: "conv_1" '
        'convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "gaussian" } } }\n'
        'layer { name: "psroi" type: "PSROIPooling" bottom: "conv_1" bottom: "rois" top: "p" '
        'psroi_pooling_param { spatial_scale: 1 output_dim: 2 group_size: 2 } }\n')
    net = Net(str(prototxt))
    saved = tmp_path / "w.caffemodel"
    net.save(str(saved))
    buf = saved.read_bytes()
    fork_fields = wire.key(10000, 0) + wire.encode_varint(7) + \
        wire.length_delimited(10001, b"\x0a\x04sgd\x00 a string, not PSROIPooling's")
    out, layer = [], 0
    for number, _w, _v, s, e, f in wire.fields(buf, 0, len(buf)):
        body = buf[s:e]
        if number == 100 and layer == 1:            # conv_1, a V2 layer
            body = body + fork_fields
        out.append(wire.length_delimited(number, body) if number == 100 else buf[f:e])
        layer += number == 100
    model = tmp_path / "open_nsfw_shaped.caffemodel"
    model.write_bytes(b"".join(out))
    with pytest.raises(Exception, match="Wire format was corrupt"):
        caffe_pb2.NetParameter.FromString(model.read_bytes())    # protobuf alone fails
    loaded = Net(str(prototxt), weights=str(model))
    np.testing.assert_array_equal(loaded.params["conv_1"][0].data, net.params["conv_1"][0].data)
    err = capsys.readouterr().err
    assert err.count("open_nsfw_shaped.caffemodel:") == 1, err
    assert ('layer "conv_1" (Convolution): field 10001 is read here as psroi_pooling_param of '
            "PSROIPooling layers only; kept as an unknown field, as BVLC Caffe does") in err
    read = read_caffemodel(model)
    conv = read.net_param.layer[1]
    assert not conv.HasField("psroi_pooling_param")
    assert read.net_param.layer[2].psroi_pooling_param.group_size == 2     # its own: read
    rewritten = tmp_path / "rewritten.caffemodel"
    write_caffemodel(read, rewritten)
    assert _layer_fields(rewritten.read_bytes()) == _layer_fields(model.read_bytes())


def test_a_fork_field_that_is_not_ours_on_its_own_layer_type_stays_unread(tmp_path, capsys):
    """On the layer type that reads it, a field that does not parse as ours (another fork's
    bytes under the number) stays an unknown field too, with one note for the file however
    many layers hold one."""
    layers = [caffe_pb2.LayerParameter(name=f"roi{i}", type="ROIPooling") for i in range(3)]
    body = [lp.SerializeToString() + wire.length_delimited(8266711, b"\xff\xff") for lp in layers]
    good = caffe_pb2.LayerParameter(name="good", type="ROIPooling")
    good.roi_pooling_param.pooled_h = 6
    body.append(good.SerializeToString())
    path = tmp_path / "m.caffemodel"
    path.write_bytes(b"".join(wire.length_delimited(100, b) for b in body))
    model = read_caffemodel(path)
    assert [lp.HasField("roi_pooling_param") for lp in model.net_param.layer] == \
        [False, False, False, True]
    assert model.net_param.layer[3].roi_pooling_param.pooled_h == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['m.caffemodel: layer "roi0" (ROIPooling): field 8266711 does not hold '
                   "roi_pooling_param, as it does here; kept as an unknown field, as BVLC Caffe "
                   "does (3 such fields in the file)"]
    assert model.unread[1] == wire.length_delimited(8266711, b"\xff\xff")


def test_solverstate_with_other_fields_under_our_numbers(tmp_path, capsys):
    """A BVLC solverstate with fields of every wire type under caffepar's own numbers
    (1000-1004) and unused ones, after its first field: iteration, step and history read as
    in BVLC Caffe, with one note."""
    from caffepar.solvers.snapshot import read_binary
    data = need_shared(DATA)
    buf = (data / "models/lenet/lenet_iter_10000.solverstate").read_bytes()
    want = read_binary(data / "models/lenet/lenet_iter_10000.solverstate")
    fields = _split(buf)
    for i, kind in enumerate(KINDS):
        rng = np.random.default_rng(i)
        extra = [payloads(n, kind) for n in (1000, 1001, 1002, 1003, 1004, 5, 99, 10001)]
        out = fields[:1] + _inserted(fields[1:], extra, rng)
        path = tmp_path / f"{kind}.solverstate"
        path.write_bytes(b"".join(out))
        got = read_binary(path)
        assert (got.iter, got.learned_net, got.current_step) == \
            (want.iter, want.learned_net, want.current_step)
        assert len(got.history) == len(want.history)
        for (v1, s1, _l1), (v2, s2, _l2) in zip(want.history, got.history):
            assert s1 == s2 and np.array_equal(v1, v2)
    notes = [l for l in capsys.readouterr().err.splitlines() if "kept as an unknown" in l]
    assert 1 <= len(notes) <= len(KINDS)


def test_a_nested_fork_field_named_by_its_fork(tmp_path):
    """A field another fork added to a BVLC message is refused naming that fork."""
    from caffepar.errors import PrototxtError
    path = tmp_path / "net.prototxt"
    path.write_text('layer { name: "d" type: "Dropout" bottom: "x" top: "x"\n'
                    "  dropout_param { sample_weights_test: true } }\n")
    with pytest.raises(PrototxtError) as info:
        read_net_text(path)
    assert str(info.value).startswith(f"{path}:2: error: syntax error: ")
    assert ("sample_weights_test is a field of Gal's Bayesian dropout "
            "(yaringal/DropoutUncertaintyCaffeModels), a Caffe fork; caffepar does not read "
            "it") in str(info.value)
