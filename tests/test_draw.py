"""pycaffe's caffe.draw: a dot graph of the net with pydot, images with Graphviz, and a clear
error when either is missing (the module itself imports without them)."""
import shutil
import subprocess
import sys

import pytest

import caffepar as caffe
from caffepar import draw
from caffepar.proto import caffe_pb2
from caffepar.proto.text import read_net_text

NET = """
name: "small"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "x" batch_size: 64 } }
layer { name: "input" type: "Input" top: "data" include { phase: TEST }
        input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 16 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip"
        inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
        exclude { phase: TEST } }
"""


@pytest.fixture
def net_param(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    return read_net_text(str(path))[0]


def test_graph_has_every_layer_and_blob(net_param):
    pytest.importorskip("pydot")
    graph = draw.get_pydot_graph(net_param, "LR", display_lrm=True)
    nodes = {n.get_name().strip('"'): n for n in graph.get_nodes()}
    assert set(nodes) == {"data_Data", "input_Input", "conv1_Convolution", "relu1_ReLU",
                          "pool1_Pooling", "ip_InnerProduct", "loss_SoftmaxWithLoss",
                          "data_blob", "label_blob", "conv1_blob", "pool1_blob", "ip_blob",
                          "loss_blob"}
    conv = nodes["conv1_Convolution"]
    assert conv.get("label") == ('"conv1\\n(Convolution)\\nkernel size: 3\\nstride: 2\\npad: 1'
                                 '\\nlr mult: 1.0, 2.0"')
    assert conv.get("fillcolor").strip('"') == "#FF5050"
    assert nodes["relu1_ReLU"].get("fillcolor").strip('"') == "#90EE90"
    assert "(Pooling AVE)" in nodes["pool1_Pooling"].get("label")
    edges = {(e.get_source().strip('"'), e.get_destination().strip('"')): e.get("label")
             for e in graph.get_edges()}
    assert edges[("conv1_Convolution", "conv1_blob")] == '"16"'
    assert edges[("data_Data", "data_blob")] == '"Batch 64"'
    assert ("conv1_blob", "relu1_ReLU") in edges and ("relu1_ReLU", "conv1_blob") in edges
    assert ("label_blob", "loss_SoftmaxWithLoss") in edges


def test_phase_keeps_that_phase_only(net_param):
    pytest.importorskip("pydot")
    names = {n.get_name().strip('"')
             for n in draw.get_pydot_graph(net_param, "TB", phase=caffe.TEST).get_nodes()}
    assert "input_Input" in names and "data_Data" not in names
    assert "loss_SoftmaxWithLoss" not in names
    both = caffe_pb2.NetParameter()
    both.layer.add(name="x", type="ReLU").include.add(phase=caffe.TEST)
    both.layer[0].exclude.add(phase=caffe.TRAIN)
    with pytest.raises(ValueError, match="both include and exclude"):
        draw.get_pydot_graph(both, "LR", phase=caffe.TEST)


def test_raw_file_is_dot_source_and_v1_nets_are_upgraded(tmp_path):
    pytest.importorskip("pydot")
    v1 = caffe_pb2.NetParameter(name="old")
    layer = v1.layers.add(name="ip", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
    layer.bottom.append("data")
    layer.top.append("ip")
    layer.inner_product_param.num_output = 3
    out = tmp_path / "old.raw"
    draw.draw_net_to_file(v1, str(out))
    text = out.read_text()
    assert text.startswith('digraph "old" {')
    assert '"data_blob" -> "ip_InnerProduct"' in text and '"ip_InnerProduct" -> "ip_blob"' in text


def test_image_needs_graphviz(net_param, tmp_path, monkeypatch):
    pytest.importorskip("pydot")
    if shutil.which("dot"):
        out = tmp_path / "net.png"
        draw.draw_net_to_file(net_param, str(out), "TB")
        assert out.read_bytes().startswith(b"\x89PNG")
    monkeypatch.setattr(draw.shutil, "which", lambda name: None)
    with pytest.raises(draw.DrawError, match="Graphviz's dot program"):
        draw.draw_net(net_param, "LR", ext="svg")


def test_without_pydot_the_module_imports_and_drawing_says_why():
    code = ("import sys; sys.modules['pydot'] = None\n"
            "import caffepar.draw as d\n"
            "from caffepar.proto import caffe_pb2\n"
            "try:\n"
            "    d.draw_net(caffe_pb2.NetParameter(), 'LR')\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "drawing a net needs pydot: pip install 'caffepar[draw]'" in out.stdout
