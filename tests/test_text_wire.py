"""Prototxt text straight to the wire format (caffepar/proto/text_wire.py): whatever it reads it
reads as protobuf's text parser does, field for field, line for line; what it does not take it
leaves to that parser."""
from pathlib import Path

import pytest
from google.protobuf import text_format

from caffepar.proto import caffe_pb2
from caffepar.proto.text import _top_level_field_lines, parse_text, read_net_text
from caffepar.proto.text_wire import Unsupported, to_wire
from conftest import SHARED

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for folder in (ROOT / "models", ROOT / "tests", SHARED)
               for p in folder.rglob("*.prototxt"))

SNIPPETS = [
    'layer { name: "a" type: "ReLU" bottom: "x" top: "x" }',
    'layer { name: "a" convolution_param { num_output: 0x10 kernel_size: 010 pad: 1 } }',
    "layer { name: 'a\\n\\x41\\101' \"b\" type: \"t\"; bottom: \"x\", top: \"y\" }",
    'layer < name: "a" > layer: { name: "b" }',
    "layer { loss_weight: [1, 2.5, 1e-3, .5, 5., 1.5f, -0] }",
    'layer { loss_weight: [] name: "q" }',
    "layer { propagate_down: t propagate_down: False propagate_down: 1 propagate_down: True }",
    "layer { phase: TEST } layer { phase: 1 } layer { pooling_param { pool: AVE round_mode: 1 } }",
    '# comment\nlayer {# c\n name: "x" # c\n}\n#end',
    'name: "n" name: "m" input: "a" input_dim: 1 input_dim: 2 force_backward: true',
    'layer { name: "é\\303\\251" }',
    "layer { blobs { data: [1, 2] shape { dim: [1, 2] } double_data: 1e300 } }",
    'layer {\n\n name:\n "x"\n "y"\n}\nlayer { name: "z" }',
    'state { stage: ["a", "b"] level: -3 }',
    'layer { name: "a" } ; layer { name: "b" }',
    "layer { transform_param { mean_value: 104 mean_value: 1_0 } }",
    'layer { name: "a" top: "a" }\r\nlayer { name: "b" }\r\n',
    'layer\n{\nname\n:\n"a"\n}\n',
    'layer { name: "a" type: "b" } layers { name: "v1" type: CONVOLUTION }',
    "layer { dropout_param { dropout_ratio: 0.5 scale_train: false } }",
    # Protobuf's parser reads these; text_wire hands them over (and must not differ).
    "layer { loss_weight: inf loss_weight: -inf loss_weight: nan loss_weight: 1e39 }",
    "layer { include [ { phase: TEST } ] }",
    # Errors: text_wire hands them over; protobuf's parser says where.
    'layer { name: "unterminated }', 'layer { name: "a" ', 'layer { name: "a" } }',
    'layer { nme: "a" }', "layer { convolution_param { num_output: -1 } }",
    "layer { convolution_param { num_output: 4294967296 } }", 'layer { name: "\\xff" }',
    "layer { name: b }", "layer { convolution_param { num_output: 1.0 } }",
    "layer { loss_weight: 0x10 }", "layer { propagate_down: yes }", "layer { phase: 7 }",
    'layer { name: "a",, }', ", layer { }", "layer { [caffe.x]: 1 }",
]


def _protobuf(text):
    message = caffe_pb2.NetParameter()
    try:
        text_format.Merge(text, message)
    except text_format.ParseError:
        return None
    return message


@pytest.mark.parametrize("text", [p.read_text() for p in FILES] + SNIPPETS,
                         ids=[p.name for p in FILES] + [f"snippet{i}" for i in range(len(SNIPPETS))])
def test_reads_as_protobuf_does_or_hands_over(text):
    want = _protobuf(text)
    try:
        wire, lines, names = to_wire(text, caffe_pb2.NetParameter.DESCRIPTOR, ("layer", "layers"))
    except Unsupported:
        return
    assert want is not None, "read text protobuf's parser refuses"
    got = caffe_pb2.NetParameter.FromString(wire)
    assert got.SerializeToString() == want.SerializeToString()
    found = _top_level_field_lines(text, ("layer", "layers"))
    assert list(lines["layer"]) == found["layer"] and list(lines["layers"]) == found["layers"]
    assert names["layer"] == [lp.name for lp in want.layer]
    assert names["layers"] == [lp.name for lp in want.layers]


def test_every_real_prototxt_is_read_without_protobufs_parser():
    """The fast way takes every net and solver prototxt of the repository and the shared data
    (a fallback there would make long nets as slow as protobuf's parser)."""
    handed_over = []
    for path in FILES:
        for message in (caffe_pb2.NetParameter, caffe_pb2.SolverParameter):
            text = path.read_text()
            if _parses(text, message):
                try:
                    to_wire(text, message.DESCRIPTOR)
                except Unsupported as e:
                    handed_over.append(f"{path.name}: {e}")
    assert FILES and not handed_over


def _parses(text, message):
    try:
        text_format.Merge(text, message())
    except text_format.ParseError:
        return False
    return True


def test_a_long_net_in_parts_keeps_its_lines_and_names(tmp_path):
    """Read in parts (cut at layer lines), a net keeps every layer's line and name, and an
    error deep in it still names its line."""
    layers = "".join(f'layer {{ name: "r{i}" type: "ReLU"\n  bottom: "x" top: "x" }}\n'
                     for i in range(3000))
    path = tmp_path / "long.prototxt"
    path.write_text('name: "long"\n' + layers)
    net, smap = read_net_text(path)
    assert len(net.layer) == 3000 and smap.line_of("r2999") == 2 + 2 * 2999
    small = caffe_pb2.NetParameter()
    parse_text(path.read_text(), small, chunk_chars=10000)
    assert small == net
    path.write_text('name: "long"\n' + layers + 'layer { name: "bad" type: "ReLU" bottom: 3 }\n')
    from caffepar.errors import PrototxtError
    with pytest.raises(PrototxtError, match=f"{path}:{2 + 2 * 3000}: error: syntax error"):
        parse_text(path.read_text(), caffe_pb2.NetParameter(), str(path), chunk_chars=10000)
