"""Reading prototxts: a long text is merged in parts with the same result as in one piece, its
errors keep their file:line, progress is logged, every layer's line is found, and a file over
the size limit is refused in one line."""
import json
import logging
import os
import subprocess
import sys

import pytest
from google.protobuf import text_format

from caffepar.errors import PrototxtError
from caffepar.proto import caffe_pb2
from caffepar.proto.text import _top_level_field_lines, parse_text, read_net_text

HEAD = """# a net written the many ways text format allows
name: "long"
input: "data"
input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
"""

LAYERS = [
    'layer {{\n  name: "conv{i}"  # a comment with {{ and "\n  type: "Convolution"\n'
    '  bottom: "{b}" top: "conv{i}"\n  convolution_param {{ num_output: 4 kernel_size: 3 '
    'pad: 1 weight_filler {{ type: "xavier" }} }}\n}}\n',
    'layer <\n  name: "relu{i}" type: "ReLU" bottom: "conv{i}" top: "conv{i}"\n>\n',
    'layer: {{ name: "pool{i}" type: "Pooling" bottom: "conv{i}" top: "pool{i}" '
    "pooling_param {{ pool: MAX kernel_size: 1 }} }} "
    'layer {{ name: "id{i}" type: "Split" bottom: "pool{i}" top: "s{i}" }}\n',
    "layer\n{{\n  name: 'drop{i}' type: 'Dropout' bottom: \"s{i}\" top: 's{i}'\n"
    '  dropout_param {{ dropout_ratio: 0.25 }}\n}}\n',
]


def long_text(blocks):
    parts, bottom = [HEAD], "data"
    for i in range(blocks):
        for piece in LAYERS:
            parts.append(piece.format(i=i, b=bottom))
        bottom = f"s{i}"
    return "".join(parts)


def test_merged_in_parts_equals_one_piece(caplog):
    text = long_text(300)
    whole = text_format.Merge(text, caffe_pb2.NetParameter())
    caplog.set_level(logging.INFO, logger="caffepar")
    parts = parse_text(text, caffe_pb2.NetParameter(), "long.prototxt", chunk_chars=2000)
    assert len(parts.layer) == 300 * 5
    assert parts.SerializeToString() == whole.SerializeToString()
    progress = [r.getMessage() for r in caplog.records if "Parsing long.prototxt" in
                r.getMessage()]
    assert progress[0].startswith("Parsing long.prototxt (0 MB) in ")
    assert int(progress[0].split(" in ")[1].split()[0]) > 50       # parts
    assert progress[-1] == "Parsing long.prototxt: 100%" and len(progress) <= 12


def test_every_layer_line_is_found():
    text = long_text(20)
    lines = _top_level_field_lines(text, ("layer", "layers"))["layer"]
    expected = []
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        if stripped.startswith("layer"):
            expected.append(number)
        if ' layer {' in line:          # two layers on one line
            expected.append(number)
    assert lines == expected


@pytest.mark.parametrize("chunk_chars", [2000, 1 << 30])
def test_an_error_deep_in_a_long_text_names_its_line(tmp_path, chunk_chars):
    text = long_text(200)
    lines = text.split("\n")
    target = len(lines) * 3 // 4
    while "type:" not in lines[target]:
        target += 1
    lines[target] = lines[target].replace("type:", "tpye:")
    path = tmp_path / "long.prototxt"
    path.write_text("\n".join(lines))
    with pytest.raises(PrototxtError) as info:
        read_net_text(path) if chunk_chars > 1e6 else \
            parse_text(path.read_text(), caffe_pb2.NetParameter(), str(path),
                       chunk_chars=chunk_chars)
    assert info.value.line == target + 1
    assert f"long.prototxt:{target + 1}: error: syntax error: column " in str(info.value)
    assert '"tpye"' in str(info.value)


PARALLEL_PARSE = r"""
import json, sys
from caffepar.proto import text
path = sys.argv[1]
text.CHUNK_CHARS = int(sys.argv[2])
found = {"pooled": 0}
pooled = text._pooled


def counted(pool, parts):
    for wired in pooled(pool, parts):
        found["pooled"] += wired is not None
        yield wired


text._pooled = counted
for label, parallel_chars in (("one", 1 << 40), ("many", 0)):
    text.PARALLEL_CHARS = parallel_chars
    try:
        net, smap = text.read_net_text(path)
    except Exception as e:
        found[label] = {"error": str(e), "line": getattr(e, "line", None)}
    else:
        found[label] = {"net": net.SerializeToString().hex(), "lines": list(smap.layer_lines),
                        "names": sorted(smap.by_name.items())}
found["workers"] = text._parse_workers(10 ** 6, 100)
print(json.dumps(found))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no parse workers")
def test_parse_workers_give_what_one_process_gives(tmp_path):
    """A long text turned into wire format by worker processes, a part each, gives the net,
    layer lines and names one process gives; a part with an error is read in the main
    process, which names its line."""
    def run(text):
        path = tmp_path / "long.prototxt"
        path.write_text(text)
        found = json.loads(subprocess.run(
            [sys.executable, "-c", PARALLEL_PARSE, str(path), "3000"], capture_output=True,
            text=True, check=True).stdout)
        assert found["workers"] >= 2
        return found["one"], found["many"], found["pooled"]

    text = 'name: "plain"\ninput: "data"\n' + "".join(
        f'layer {{\n  name: "conv{i}"\n  type: "Convolution"\n  bottom: "{b}"\n  top: "conv{i}"'
        f'\n  convolution_param {{ num_output: 8 kernel_size: 3 weight_filler {{ type: '
        f'"xavier" }} }}\n}}\nlayer {{ name: "relu{i}" type: "ReLU" bottom: "conv{i}" '
        f'top: "conv{i}" }}\n' for i, b in enumerate(["data"] + [f"conv{k}" for k in range(499)]))
    one, many, pooled = run(text)
    assert "net" in one and len(one["lines"]) == 1000
    assert many == one and pooled > 10      # parts text_wire takes, made by the workers
    text = long_text(300)                   # written the many ways text format allows
    one, many, _pooled = run(text)
    assert "net" in one and len(one["lines"]) == 300 * 5
    assert many == one
    lines = text.split("\n")
    target = len(lines) * 2 // 3
    while "type:" not in lines[target]:
        target += 1
    lines[target] = lines[target].replace("type:", "tpye:")
    one, many, _pooled = run("\n".join(lines))
    assert many == one and one["line"] == target + 1 and '"tpye"' in one["error"], many


def test_unbalanced_braces_are_left_to_the_parser(tmp_path):
    text = long_text(50)
    cut = text.rfind("}")
    broken = text[:cut] + text[cut + 1:] + "\n} }\n"
    with pytest.raises(PrototxtError, match="syntax error"):
        parse_text(broken, caffe_pb2.NetParameter(), "b.prototxt", chunk_chars=500)
    stray = "} " + text
    with pytest.raises(PrototxtError) as info:
        parse_text(stray, caffe_pb2.NetParameter(), "s.prototxt", chunk_chars=500)
    assert info.value.line == 1


def test_a_file_over_the_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "big.prototxt"
    path.write_text(long_text(200))         # about 0.1 MB
    monkeypatch.setenv("CAFFEPAR_MAX_PROTOTXT_MB", "0.05")
    with pytest.raises(PrototxtError) as info:
        read_net_text(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "more than the 0 MB" in message and "CAFFEPAR_MAX_PROTOTXT_MB" in message
    monkeypatch.setenv("CAFFEPAR_MAX_PROTOTXT_MB", "1")
    assert len(read_net_text(path)[0].layer) == 1000
    monkeypatch.setenv("CAFFEPAR_MAX_PROTOTXT_MB", "lots")
    with pytest.raises(PrototxtError, match="CAFFEPAR_MAX_PROTOTXT_MB='lots' is not a number"):
        read_net_text(path)


def test_a_fork_only_field_says_what_bvlc_caffe_writes_instead(tmp_path):
    path = tmp_path / "fork.prototxt"
    path.write_text('layer { name: "c" type: "Convolution" bottom: "x" top: "y"\n'
                    "  convolution_param { num_output: 3 kernel_size: 3 depthwise: true } }\n")
    with pytest.raises(PrototxtError) as info:
        read_net_text(path)
    text = str(info.value)
    assert text.startswith(f"{path}:2: error: syntax error: ")
    assert '"depthwise"; depthwise is a field of a Caffe fork, not of BVLC Caffe: BVLC Caffe ' \
           "runs a depthwise convolution as group equal to the channel count" in text


@pytest.mark.parametrize("field,fork", [
    ("reorg_param { stride: 2 }", "the YOLOv2 ports of Caffe"),
    ("smooth_l1_loss_param { sigma: 3 }", "Fast/Faster R-CNN (rbgirshick/caffe-fast-rcnn)"),
    ("dense_crf_param { max_iter: 10 }", "DeepLab v2 (deeplab-public-ver2)"),
])
def test_a_fork_layer_field_names_its_fork(tmp_path, field, fork):
    path = tmp_path / "fork.prototxt"
    path.write_text(f'layer {{ name: "l" type: "X" bottom: "x" top: "y"\n  {field} }}\n')
    with pytest.raises(PrototxtError) as info:
        read_net_text(path)
    text = str(info.value)
    assert text.startswith(f"{path}:2: error: syntax error: ")
    name = field.split()[0]
    assert f"{name} is a field of {fork}, a Caffe fork; caffepar does not read it" in text
