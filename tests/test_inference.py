"""The inference path of TEST nets: the rewrite pass (text in, text out), then every blob of a
fused forward against the layer-by-layer forward (CAFFEPAR_INFERENCE=off) on nets written in
the patterns of the published ones, then what the plan must survive (partial forwards,
reshaped inputs, edited weights, observers, layers it does not know, backward after it)."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from caffepar.fillers import shapes_only
from caffepar.graph import inference
from caffepar.graph.inference import describe, fold_for_inference, graph_of, inference_graph
from caffepar.graph.net import TEST, Net
from caffepar.graph.passes import filter_net, insert_splits
from caffepar.proto import caffe_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_plan_overhead import shrunk  # noqa: E402  (the published nets at a small input)


def P(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def folded(text):
    """The pass on a net as Net builds it (TEST phase, filtered, Splits inserted)."""
    net = P(text)
    net.state.phase = TEST
    return describe(inference_graph(insert_splits(filter_net(net))))


def lines(text):
    return "".join(line.strip() + "\n" for line in text.strip().splitlines())


# ---------------------------------------------------------------- net text
def inp(*shape, top="data"):
    dims = " ".join(f"dim: {d}" for d in shape)
    return (f'layer {{ name: "{top}" type: "Input" top: "{top}" '
            f'input_param {{ shape {{ {dims} }} }} }}\n')


def layer(name, kind, bottoms, tops, extra=""):
    b = " ".join(f'bottom: "{x}"' for x in ([bottoms] if isinstance(bottoms, str) else bottoms))
    t = " ".join(f'top: "{x}"' for x in ([tops] if isinstance(tops, str) else tops))
    return f'layer {{ name: "{name}" type: "{kind}" {b} {t} {extra} }}\n'


def conv(name, bottom, top, n, k=1, s=1, p=0, g=1, bias=True, kind="Convolution"):
    group = f"group: {g} " if kind == "Convolution" else ""
    return layer(name, kind, bottom, top, f"convolution_param {{ num_output: {n} "
                 f"kernel_size: {k} stride: {s} pad: {p} {group}"
                 f"bias_term: {str(bias).lower()} }}")


def bn_scale_act(name, blob, act="ReLU", top=None):
    """BatchNorm (in place unless `top`), Scale and an activation in place, as published."""
    out = top or blob
    text = layer(f"{name}/bn", "BatchNorm", blob, out) + \
        layer(f"{name}/scale", "Scale", out, out, "scale_param { bias_term: true }")
    return text + (layer(f"{name}/act", act, out, out) if act else "")


# ---------------------------------------------------------------- the pass, text in, text out
def test_in_place_chain_folds_into_the_convolution():
    text = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4, 3, p=1) + bn_scale_act("c", "c") + \
        layer("pool", "Pooling", "c", "pool", "pooling_param { pool: MAX kernel_size: 2 }")
    assert folded(text) == lines("""
        free data
        epilogue conv + c/bn + c/scale + c/act
        layer pool
    """)


def test_a_blob_a_user_can_read_is_not_folded_over():
    """BatchNorm not in place: the convolution's top holds its own output after forward, so
    the BatchNorm starts its own epilogue; a blob read by a second layer (a Split) stops the
    chain where the Split reads it."""
    text = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + bn_scale_act("c", "c", top="cb")
    assert folded(text) == lines("""
        free data
        layer conv
        epilogue c/bn + c/scale + c/act
    """)
    text = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + \
        layer("side", "Sigmoid", "c", "side") + bn_scale_act("c", "c")
    assert folded(text) == lines("""
        free data
        layer conv
        share c_conv_0_split
        layer side
        epilogue c/bn + c/scale + c/act
    """)


def test_one_activation_last_and_what_stops_a_chain():
    text = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + \
        layer("act", "ReLU6", "c", "c") + layer("bn", "BatchNorm", "c", "c") + \
        layer("act2", "ReLU", "c", "c")
    assert folded(text) == lines("""
        free data
        epilogue conv + act
        epilogue bn + act2
    """)
    prelu = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + layer("p", "PReLU", "c", "c") + \
        layer("loss", "EuclideanLoss", ["c", "c"], "l")
    assert "epilogue conv + p\n" in folded(prelu)
    weighted = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + \
        layer("act", "ReLU", "c", "c", "loss_weight: 1")
    assert folded(weighted).splitlines()[1:] == ["layer conv", "layer act"]
    train_bn = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + \
        layer("bn", "BatchNorm", "c", "c", "batch_norm_param { use_global_stats: false }")
    assert folded(train_bn).splitlines()[1:] == ["layer conv", "layer bn"]
    ip = inp(2, 6) + layer("ip", "InnerProduct", "data", "f", "inner_product_param "
                          "{ num_output: 5 }") + bn_scale_act("f", "f")
    assert "epilogue ip + f/bn + f/scale + f/act\n" in folded(ip)


def test_free_and_shared_layers():
    text = inp(1, 3, 4, 4) + conv("conv", "data", "c", 4) + \
        layer("d1", "Dropout", "c", "c") + layer("flat", "Flatten", "c", "f") + \
        layer("d2", "Dropout", "f", "g") + layer("r", "Reshape", "g", "h",
                                               "reshape_param { shape { dim: 0 dim: -1 } }") + \
        layer("s", "Silence", "h", [])
    assert folded(text) == lines("""
        free data
        layer conv
        free d1
        share flat
        share d2
        share r
        free s
    """)
    # A Dropout top written after it (an in-place ReLU) keeps its own data.
    written = inp(1, 3, 4, 4) + layer("d", "Dropout", "data", "y") + layer("r", "ReLU", "y", "y")
    assert "layer d\n" in folded(written)


def test_concat_producers_write_into_it():
    text = inp(1, 3, 8, 8) + conv("a", "data", "a", 4) + layer("ra", "ReLU", "a", "a") + \
        layer("p", "Pooling", "data", "p", "pooling_param { pool: MAX kernel_size: 3 pad: 1 }") + \
        layer("cat", "Concat", ["a", "p", "data"], "cat") + conv("b", "cat", "b", 2)
    assert folded(text) == lines("""
        free data
        share data_data_0_split
        epilogue a + ra
        layer p
        concat cat <- a, p
        layer b
    """)
    # Its top written again after it (in place): no part of it may be another blob's data.
    again = text.replace(conv("b", "cat", "b", 2), layer("rc", "ReLU", "cat", "cat"))
    assert "layer cat\n" in folded(again)
    # A part read by another layer too: through the Split that shares its data. (A layer
    # in place on it after the Concat cannot be: the Split would make it not in place.)
    part = text + layer("sp", "Sigmoid", "p", "sp")
    assert "concat cat <- a, p_p_0_split_0\n" in folded(part)


def test_concat_chain_nests():
    """DenseNet: each block's Concat is a part of the next one's top."""
    text = inp(1, 4, 4, 4)
    prev = "data"
    for k in range(3):
        text += layer(f"bn{k}", "BatchNorm", prev, f"x{k}") + conv(f"conv{k}", f"x{k}", f"y{k}", 2)
        text += layer(f"cat{k}", "Concat", [prev, f"y{k}"], f"cat{k}")
        prev = f"cat{k}"
    got = folded(text)
    assert "concat cat0 <- y0\n" in got
    assert "concat cat1 <- cat0_cat0_0_split_1, y1\n" in got
    assert "concat cat2 <- cat1_cat1_0_split_1, y2\n" in got


def test_the_pass_is_pure_and_running_it_twice_changes_nothing():
    text = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4) + bn_scale_act("c", "c") + \
        layer("d", "Dropout", "c", "e") + layer("cat", "Concat", ["e", "data"], "cat")
    net = insert_splits(filter_net(P(text)))
    before = net.SerializeToString()
    once = inference_graph(net)
    assert net.SerializeToString() == before
    assert fold_for_inference(once) == once
    assert describe(fold_for_inference(once)) == describe(once)
    assert fold_for_inference(graph_of(net)) == once


# ---------------------------------------------------------------- blob by blob
def randomize(net, seed=0):
    """Random weights scaled by their fan-in (so that values stay near 1 through a deep net,
    as a trained net's do: a softmax of huge values would turn rounding into large
    differences), BatchNorm statistics with positive variances and factor."""
    rng = np.random.default_rng(seed)
    for layer in net.layers:
        for k, b in enumerate(layer.blobs):
            fan_in = int(np.prod(b.shape[1:])) if k == 0 and b.data.ndim > 1 else 1
            b.data[...] = rng.standard_normal(b.shape, np.float32) * np.float32(
                1.5 / np.sqrt(fan_in) if fan_in > 1 else 0.5)
        if layer.type == "BatchNorm":
            layer.blobs[1].data[...] = rng.uniform(0.2, 2.0, layer.blobs[1].shape)
            layer.blobs[2].data[...] = rng.uniform(0.5, 2.0)
        if layer.type == "BN" and len(layer.blobs) == 4:
            layer.blobs[3].data[...] = rng.uniform(0.2, 2.0, layer.blobs[3].shape)
    for name in net.inputs:
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    return net


def assert_same_blobs(net, ref, skip=()):
    """Every blob of `net` as in `ref` (rtol 1e-4, and an absolute 1e-5 of the blob's largest
    value: a folded BatchNorm subtracts its mean after the scale, not before)."""
    for name, blob in ref.blobs.items():
        if name in skip:
            continue
        want, got = blob.data, net.blobs[name].data
        assert got.shape == want.shape, name
        scale = float(np.abs(want).max()) if want.size else 0.0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def fused_vs_unfused(text, seed=0, **forward):
    """The fused forward of a net and the layer-by-layer one of a twin with the same weights."""
    net = randomize(Net(P(text), phase=TEST), seed)
    ref = randomize(Net(P(text), phase=TEST), seed)
    with ref.unfused():
        ref.forward(**forward)
    net.forward(**forward)
    assert net._plan is not None
    assert_same_blobs(net, ref)
    return net, ref


def inverted_residual(name, bottom, c_in, expand, c_out, stride, dw="Convolution"):
    """MobileNet v2's block: 1x1 expand, 3x3 depthwise, 1x1 linear, each with in-place
    BatchNorm, Scale (and ReLU6), and the residual Eltwise when the shape allows."""
    e = c_in * expand
    text = conv(f"{name}/expand", bottom, f"{name}/expand", e, bias=False)
    text += bn_scale_act(f"{name}/expand", f"{name}/expand", "ReLU6")
    text += conv(f"{name}/dwise", f"{name}/expand", f"{name}/dwise", e, 3, stride, 1,
                 e if dw == "Convolution" else 1, False, dw)
    text += bn_scale_act(f"{name}/dwise", f"{name}/dwise", "ReLU6")
    text += conv(f"{name}/linear", f"{name}/dwise", f"{name}/linear", c_out, bias=False)
    text += bn_scale_act(f"{name}/linear", f"{name}/linear", None)
    if stride == 1 and c_in == c_out:
        text += layer(f"{name}/sum", "Eltwise", [bottom, f"{name}/linear"], f"{name}/sum")
        return text, f"{name}/sum"
    return text, f"{name}/linear"


def test_mobilenet_v2_blocks():
    text = inp(1, 3, 16, 16) + conv("conv1", "data", "conv1", 8, 3, 2, 1, bias=False) + \
        bn_scale_act("conv1", "conv1", "ReLU6")
    blob = "conv1"
    for k, (c_in, c_out, stride, dw) in enumerate([(8, 8, 1, "Convolution"),
                                                  (8, 12, 2, "ConvolutionDepthwise"),
                                                  (12, 12, 1, "DepthwiseConvolution")]):
        block, blob = inverted_residual(f"b{k}", blob, c_in, 3, c_out, stride, dw)
        text += block
    text += layer("pool", "Pooling", blob, "pool",
                  "pooling_param { pool: AVE global_pooling: true }")
    text += conv("fc", "pool", "fc", 10, 1) + layer("prob", "Softmax", "fc", "prob")
    net, _ = fused_vs_unfused(text)
    # The plan ran the in-place chains inside the convolutions.
    assert net.forward_host(net.layer_index("b0/dwise/act")) == net.layer_index("b0/dwise")


def test_resnet_bottleneck_and_inner_product():
    text = inp(2, 8, 8, 8) + conv("r/a", "data", "a", 4, bias=False) + bn_scale_act("a", "a")
    text += conv("r/b", "a", "b", 4, 3, p=1, bias=False) + bn_scale_act("b", "b")
    text += conv("r/c", "b", "c", 8, bias=False) + bn_scale_act("c", "c", None)
    text += conv("r/proj", "data", "proj", 8, bias=False) + bn_scale_act("proj", "proj", None)
    text += layer("sum", "Eltwise", ["proj", "c"], "sum") + layer("relu", "ReLU", "sum", "sum")
    text += layer("pool", "Pooling", "sum", "pool", "pooling_param { pool: MAX kernel_size: 2 "
                  "stride: 2 }")
    text += layer("fc", "InnerProduct", "pool", "fc", "inner_product_param { num_output: 6 }")
    text += bn_scale_act("fc", "fc", "PReLU")
    text += layer("fc2", "InnerProduct", "fc", "fc2", "inner_product_param { num_output: 3 }")
    text += layer("r2", "ReLU", "fc2", "fc2", "relu_param { negative_slope: 0.1 }")
    fused_vs_unfused(text)


def test_inception_with_concat_lrn_and_dropout():
    text = inp(1, 6, 12, 12) + conv("c1", "data", "c1", 4) + layer("r1", "ReLU", "c1", "c1")
    text += conv("c3r", "data", "c3r", 3) + layer("r3r", "ReLU", "c3r", "c3r")
    text += conv("c3", "c3r", "c3", 5, 3, p=1) + layer("r3", "ReLU", "c3", "c3")
    text += layer("pool", "Pooling", "data", "pool",
                  "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    text += conv("cp", "pool", "cp", 2) + layer("rp", "ReLU", "cp", "cp")
    text += layer("cat", "Concat", ["c1", "c3", "cp"], "cat")
    text += layer("norm", "LRN", "cat", "norm", "lrn_param { local_size: 5 alpha: 0.0001 "
                  "beta: 0.75 }")
    text += layer("ave", "Pooling", "norm", "ave", "pooling_param { pool: AVE kernel_size: 3 "
                  "stride: 2 }")
    text += layer("drop", "Dropout", "ave", "ave", "dropout_param { dropout_ratio: 0.4 }")
    text += layer("fc", "InnerProduct", "ave", "fc", "inner_product_param { num_output: 5 }")
    text += layer("prob", "Softmax", "fc", "prob")
    net, ref = fused_vs_unfused(text)
    cat = net.blobs["cat"].data
    assert np.shares_memory(net.blobs["c3"].data, cat)      # c3 wrote straight into it
    # forward_all: inputs of any length, by the net's batch, through the same plan.
    images = np.random.default_rng(4).standard_normal((3, 6, 12, 12)).astype(np.float32)
    got = net.forward_all(blobs=["cat"], data=images)
    with ref.unfused():
        want = ref.forward_all(blobs=["cat"], data=images)
    for name in ("cat", "prob"):
        assert got[name].shape[0] == 3
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)


def test_shufflenet_v2_unit():
    text = inp(1, 8, 8, 8)
    text += layer("slice", "Slice", "data", ["a", "b"], "slice_param { axis: 1 slice_point: 4 }")
    text += conv("b1", "b", "b1", 4, bias=False) + bn_scale_act("b1", "b1")
    text += conv("b2", "b1", "b2", 4, 3, 1, 1, bias=False, kind="ConvolutionDepthwise")
    text += bn_scale_act("b2", "b2", None)
    text += conv("b3", "b2", "b3", 4, bias=False) + bn_scale_act("b3", "b3")
    text += layer("cat", "Concat", ["a", "b3"], "cat")
    text += layer("shuffle", "ShuffleChannel", "cat", "shuffle", "shuffle_channel_param "
                  "{ group: 2 }")
    text += conv("g", "shuffle", "g", 6, g=2) + layer("sig", "Sigmoid", "g", "g")
    text += layer("pw", "Power", "g", "pw", "power_param { power: 2 scale: 0.5 shift: 1 }")
    fused_vs_unfused(text)


SSD_HEAD = """
layer { name: "ploc" type: "Permute" bottom: "loc" top: "ploc" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "floc" type: "Flatten" bottom: "ploc" top: "floc" flatten_param { axis: 1 } }
layer { name: "pconf" type: "Permute" bottom: "conf" top: "pconf" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "fconf" type: "Flatten" bottom: "pconf" top: "fconf" flatten_param { axis: 1 } }
layer { name: "prior" type: "PriorBox" bottom: "feat" bottom: "data" top: "prior"
        prior_box_param { min_size: 8 max_size: 16 aspect_ratio: 2 flip: true clip: false
                          variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 } }
layer { name: "ploc2" type: "Permute" bottom: "loc2" top: "ploc2" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "floc2" type: "Flatten" bottom: "ploc2" top: "floc2" flatten_param { axis: 1 } }
layer { name: "pconf2" type: "Permute" bottom: "conf2" top: "pconf2" permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "fconf2" type: "Flatten" bottom: "pconf2" top: "fconf2" flatten_param { axis: 1 } }
layer { name: "prior2" type: "PriorBox" bottom: "feat2" bottom: "data" top: "prior2"
        prior_box_param { min_size: 16 aspect_ratio: 2 flip: true clip: true variance: 0.1 } }
layer { name: "mloc" type: "Concat" bottom: "floc" bottom: "floc2" top: "mloc" concat_param { axis: 1 } }
layer { name: "mconf" type: "Concat" bottom: "fconf" bottom: "fconf2" top: "mconf" concat_param { axis: 1 } }
layer { name: "mprior" type: "Concat" bottom: "prior" bottom: "prior2" top: "mprior" concat_param { axis: 2 } }
layer { name: "rconf" type: "Reshape" bottom: "mconf" top: "rconf" reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "sconf" type: "Softmax" bottom: "rconf" top: "sconf" softmax_param { axis: 2 } }
layer { name: "fsconf" type: "Flatten" bottom: "sconf" top: "fsconf" flatten_param { axis: 1 } }
layer { name: "det" type: "DetectionOutput" bottom: "mloc" bottom: "fsconf" bottom: "mprior" top: "det"
        detection_output_param { num_classes: 3 share_location: true background_label_id: 0
          nms_param { nms_threshold: 0.45 top_k: 20 } code_type: CENTER_SIZE keep_top_k: 10
          confidence_threshold: 0.3 } }
"""


def ssd_net(batch=1):
    text = inp(batch, 3, 16, 16) + conv("c", "data", "feat", 4, 3, 2, 1) + \
        bn_scale_act("feat", "feat")
    text += conv("c2", "feat", "feat2", 4, 3, 2, 1) + bn_scale_act("feat2", "feat2")
    text += conv("loc", "feat", "loc", 16, 3, p=1) + conv("conf", "feat", "conf", 12, 3, p=1)
    text += conv("loc2", "feat2", "loc2", 12, 3, p=1) + conv("conf2", "feat2", "conf2", 9, 3, p=1)
    return text + SSD_HEAD


def test_ssd_head():
    net, _ = fused_vs_unfused(ssd_net())
    assert net.blobs["det"].data.shape[-1] == 7
    # The permuted convolution outputs were written straight into the Concat's top.
    assert np.shares_memory(net.blobs["ploc"].data, net.blobs["mloc"].data)


def test_densenet_chain_and_forks_bn():
    text = inp(1, 4, 6, 6)
    prev = "data"
    for k in range(3):
        text += layer(f"bn{k}", "BatchNorm", prev, f"x{k}")
        text += layer(f"sc{k}", "Scale", f"x{k}", f"x{k}", "scale_param { bias_term: true }")
        text += layer(f"re{k}", "ReLU", f"x{k}", f"x{k}")
        text += conv(f"conv{k}", f"x{k}", f"y{k}", 3, 3, p=1, bias=False)
        text += layer(f"drop{k}", "Dropout", f"y{k}", f"y{k}")
        text += layer(f"cat{k}", "Concat", [prev, f"y{k}"], f"cat{k}")
        prev = f"cat{k}"
    text += conv("t", prev, "t", 5) + layer("tbn", "BN", "t", "t", "bn_param { eps: 1e-4 }")
    text += conv("u", "t", "u", 4) + layer("ubn", "BN", "u", "u", "bn_param { bn_mode: INFERENCE }")
    text += layer("ub", "Bias", "u", "u") + layer("uc", "Clip", "u", "u",
                                                 "clip_param { min: -0.5 max: 0.7 }")
    text += conv("v", "u", "v", 3) + layer("vs", "Scale", "v", "v") + \
        layer("vb", "BatchNorm", "v", "v")        # a Scale without bias, then a BatchNorm
    net, _ = fused_vs_unfused(text)
    assert "epilogue v + vs + vb\n" in describe(net.inference_graph())
    assert np.shares_memory(net.blobs["cat0"].data, net.blobs["cat2"].data)
    assert describe(net.inference_graph()).count("epilogue") >= 5


def test_folds_that_must_not_happen_leave_the_blobs_readable():
    """A BatchNorm not in place after a convolution, and a blob read by two layers: the
    convolution's own output stays in its blob."""
    text = inp(1, 3, 6, 6) + conv("conv", "data", "c", 4, 3, p=1) + \
        bn_scale_act("c", "c", top="cb") + layer("side", "TanH", "c", "side")
    net, ref = fused_vs_unfused(text)
    assert not np.allclose(net.blobs["c"].data, net.blobs["cb"].data)


def test_the_comparison_fails_when_a_fold_is_wrong(monkeypatch):
    """Folding over a blob a user can read changes what it holds: the blob-by-blob check
    sees it (so the tests above would fail on a wrong rule)."""
    text = inp(1, 3, 6, 6) + conv("conv", "data", "c", 4, 3, p=1) + \
        bn_scale_act("c", "c", top="cb")
    monkeypatch.setattr(inference, "_in_place", lambda lp: len(lp.bottom) == len(lp.top) == 1)
    monkeypatch.setattr(inference, "_joins", lambda graph, node, m, producer, readers:
                        graph.layers[m].type in ("BatchNorm", "Scale", "ReLU"))
    net = randomize(Net(P(text), phase=TEST))
    ref = randomize(Net(P(text), phase=TEST))
    with ref.unfused():
        ref.forward()
    net.forward()
    with pytest.raises(AssertionError):
        assert_same_blobs(net, ref)


def test_edited_weights_take_effect_at_the_next_forward():
    text = inp(1, 3, 6, 6) + conv("conv", "data", "c", 4, 3, p=1) + bn_scale_act("c", "c") + \
        layer("fc", "InnerProduct", "c", "fc", "inner_product_param { num_output: 3 }") + \
        bn_scale_act("fc", "fc", "PReLU")
    net, ref = fused_vs_unfused(text)
    plan = net._plan
    for n in (net, ref):
        n.params["c/bn"][0].data[1] += 0.5
        n.params["c/bn"][2].data[...] = 0.0          # Caffe's factor 0: mean and variance 0
        n.params["c/scale"][1].data[:] = 2.0
        n.params["conv"][0].data *= -1
        n.params["fc/act"][0].data[:] = 0.3
        n.params["fc/bn"][1].data[...] = 4.0
    with ref.unfused():
        ref.forward()
    net.forward()
    assert net._plan is plan
    assert_same_blobs(net, ref)
    # A parameter blob given a new array (as share_with does) makes a new plan.
    for n in (net, ref):
        n.params["c/scale"][0].data = np.full(4, 3.0, np.float32)
    with ref.unfused():
        ref.forward()
    net.forward()
    assert net._plan is not plan
    assert_same_blobs(net, ref)


def test_partial_forwards_reshapes_and_repeats():
    text = ssd_net()
    net = randomize(Net(P(text), phase=TEST))
    ref = randomize(Net(P(text), phase=TEST))
    for start, end in (("c", "feat/bn"), ("c", "feat/scale"), ("feat/scale", "conf"),
                       ("c2", "mloc"), ("ploc", None), (None, None)):
        for n in (net, ref):
            with n.unfused() if n is ref else _nothing():
                n.forward(start=start, end=end)
        assert_same_blobs(net, ref)
    plan = net._plan
    net.forward()
    assert net._plan is plan            # a repeat reuses it
    for n in (net, ref):
        n.blobs["data"].reshape(2, 3, 24, 20)
        n.blobs["data"].data[...] = np.random.default_rng(3).standard_normal((2, 3, 24, 20))
    with ref.unfused():
        ref.forward()
    net.forward()
    assert net._plan is not plan
    assert_same_blobs(net, ref)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_switched_off_by_the_environment(monkeypatch):
    text = inp(1, 3, 4, 4) + conv("conv", "data", "c", 2) + bn_scale_act("c", "c")
    net = randomize(Net(P(text), phase=TEST))
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "off")
    net.forward()
    assert net._plan is None
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "on")
    net.forward()
    assert net._plan is not None
    train = Net(P(text.replace("BatchNorm\"", "BatchNorm\" include { phase: TRAIN }")),
                phase=caffe_pb2.TRAIN)
    train.forward()
    assert train._plan is None


class Recorder:
    def __init__(self):
        self.events = []

    def layer_start(self, kind, i):
        self.events.append(("start", kind, i))

    def layer_end(self, kind, i):
        self.events.append(("end", kind, i))


def test_observers_hear_of_every_layer_and_backward_after_a_fused_forward():
    text = inp(2, 3, 6, 6) + conv("conv", "data", "c", 4, 3, p=1) + bn_scale_act("c", "c") + \
        layer("pool", "Pooling", "c", "p",
              "pooling_param { pool: MAX kernel_size: 2 stride: 2 }") + \
        layer("fc", "InnerProduct", "p", "fc", "inner_product_param { num_output: 3 }") + \
        inp(2, 3, top="label") + layer("loss", "EuclideanLoss", ["fc", "label"], "loss")
    net = randomize(Net(P(text), phase=TEST))
    ref = randomize(Net(P(text), phase=TEST))
    rec = Recorder()
    net.observers.append(rec)
    net.forward()
    starts = [i for what, kind, i in rec.events if what == "start"]
    assert starts == list(range(len(net.layers)))
    # A backward after a fused forward runs the forward again layer by layer first, so that
    # every layer has what its backward reads: the same gradients as without the plan.
    with ref.unfused():
        ref.forward()
    assert_same_blobs(net, ref)
    for n in (net, ref):
        n.backward()
    for name in ("conv", "c/scale", "fc"):
        for a, b in zip(net.params[name], ref.params[name]):
            np.testing.assert_allclose(a.diff, b.diff, rtol=1e-4, atol=1e-6)


PY_LAYER = '''
import numpy as np
import caffe

class Doubler(caffe.Layer):
    """Doubles its bottom; gives its top a new array at every forward."""
    def setup(self, bottom, top):
        pass
    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)
    def forward(self, bottom, top):
        top[0].data = bottom[0].data * 2
'''


def test_layers_the_plan_does_not_know_run_inside_it(tmp_path, monkeypatch):
    (tmp_path / "user_plan_layers.py").write_text(PY_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = inp(1, 3, 4, 4) + conv("conv", "data", "c", 2) + bn_scale_act("c", "c") + \
        layer("py", "Python", "c", "d", 'python_param { module: "user_plan_layers" '
              'layer: "Doubler" }') + conv("after", "d", "e", 2) + layer("r", "ReLU", "e", "e")
    net = randomize(Net(P(text), phase=TEST))
    ref = randomize(Net(P(text), phase=TEST))
    # Its new top array ends each plan at it; the rest runs layer by layer. After a few
    # forwards like that, the net runs layer by layer.
    for k in range(4):
        for n in (net, ref):
            n.blobs["data"].data[...] += 1
        with ref.unfused():
            ref.forward()
        net.forward()
        assert_same_blobs(net, ref)
        assert net.inference_enabled() == (k < 2)


def test_time_shows_layers_folded_into_their_host(tmp_path):
    from click.testing import CliRunner

    from caffepar.cli import cli
    text = inp(1, 3, 8, 8) + conv("conv", "data", "c", 4, 3, p=1) + bn_scale_act("c", "c") + \
        layer("split_me", "Pooling", "c", "p", "pooling_param { pool: AVE kernel_size: 2 }")
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["time", "--model", str(path), "--phase", "TEST",
                                      "--iterations", "2"])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if "forward:" in line]
    assert any("c/bn" in r and "(runs inside conv)" in r for r in rows)
    assert any("c/act" in r and "(runs inside conv)" in r for r in rows)
    assert not any(r.split()[0] == "conv" and "runs inside" in r for r in rows)


# ---------------------------------------------------------------- published nets
def published_dir():
    """Published deploy prototxts: $CAFFEPAR_PUBLISHED_NETS, else the published_nets folder
    of the cache (scripts/bench_inference.py --fetch fills it); never in the repository."""
    from caffepar.nn import native
    return Path(os.environ.get("CAFFEPAR_PUBLISHED_NETS") or native.cache_dir() /
                "published_nets")


def published():
    folder = published_dir()
    return sorted(folder.glob("*.prototxt")) if folder.is_dir() else []


def same_detections(got, want):
    """DetectionOutput rows: the same (image, label, score)s; boxes the same but where NMS
    chose between candidates of equal scores (to rounding), which a folded forward may
    order the other way."""
    g, w = got.reshape(-1, 7), want.reshape(-1, 7)
    assert g.shape == w.shape
    order = lambda a: a[np.lexsort((-a[:, 2], a[:, 1], a[:, 0]))]     # noqa: E731
    np.testing.assert_allclose(order(g)[:, :3], order(w)[:, :3], rtol=1e-4, atol=1e-5)
    matched = [np.any(np.all(np.abs(w - r) <= 1e-4 + 1e-4 * np.abs(w), axis=1)) for r in g]
    assert np.mean(matched) >= 0.9 if len(g) else True


@pytest.mark.parametrize("name", [p.name for p in published()] or ["(none)"])
def test_published_nets_blob_by_blob(name):
    """Every blob of each published deploy net (random weights) equals the layer-by-layer
    forward. To keep the suite quick, at a small input: the height and width divided by 8
    (else 4, 2, at the first that builds), a last pooling with a window of 7 or more made
    global, as the net's own at its own size is; the layers and their patterns are the
    net's."""
    path = published_dir() / name
    if not path.is_file():
        pytest.skip(f"no published nets in {published_dir()} (set CAFFEPAR_PUBLISHED_NETS, or "
                    "fetch them with scripts/bench_inference.py --fetch)")
    param = P(path.read_text())
    for shrink in (8, 4, 2, 1):
        try:
            small = shrunk(param, shrink)
            with shapes_only():
                net = Net(small, phase=TEST)
            break
        except Exception:       # a net whose layers need a larger input
            continue
    macs = _conv_macs(net)
    if macs > MAX_MACS:
        pytest.skip(f"{macs / 1e9:.1f} G multiply-adds at its smallest input: checked by "
                    "scripts/check_inference_nets.py, not in the suite")
    randomize(net)
    with shapes_only():
        ref = Net(small, phase=TEST)
    ref.param_data[...] = net.param_data
    for name in net.inputs:
        ref.blobs[name].data[...] = net.blobs[name].data
    with ref.unfused():
        ref.forward()
    net.forward()
    detections = [ref.top_names[n][0] for n, l in zip(ref._layer_names, ref.layers)
                  if l.type == "DetectionOutput"]
    assert_same_blobs(net, ref, skip=detections)
    for blob in detections:
        same_detections(net.blobs[blob].data, ref.blobs[blob].data)


#: Published nets costing more than this at their smallest input are left to the script.
MAX_MACS = 5e8


def _conv_macs(net):
    """Multiply-adds of the net's convolutions and InnerProducts."""
    total = 0
    for i, layer in enumerate(net.layers):
        if layer.blobs and layer.type in ("Convolution", "ConvolutionDepthwise",
                                          "DepthwiseConvolution", "Deconvolution",
                                          "InnerProduct"):
            w = layer.blobs[0]
            if layer.type == "Deconvolution":       # each input spread over its window
                total += net.blob_list[net.bottom_ids[i][0]].count * w.count // w.shape[0]
            else:
                total += net.blob_list[net.top_ids[i][0]].count * w.count // w.shape[0]
    return total


def test_caffepar_test_scores_as_without_the_plan(tmp_path, monkeypatch):
    """`caffepar test` (run_test) on a TEST net with data, losses and accuracy: the same
    scores with and without the plan."""
    from caffepar.training import run_test
    text = ('layer { name: "data" type: "DummyData" top: "data" top: "label" '
            'dummy_data_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } '
            'data_filler { type: "constant" value: 0.7 } data_filler { type: "constant" '
            'value: 2 } } }\n') + conv("conv", "data", "c", 4, 3, p=1) + bn_scale_act("c", "c") + \
        layer("fc", "InnerProduct", "c", "fc", "inner_product_param { num_output: 5 }") + \
        layer("loss", "SoftmaxWithLoss", ["fc", "label"], "loss") + \
        layer("acc", "Accuracy", ["fc", "label"], "acc", "include { phase: TEST }")
    model = tmp_path / "net.prototxt"
    model.write_text(text)
    net = randomize(Net(P(text), phase=TEST))
    net.save(str(tmp_path / "w.caffemodel"))
    fused = run_test(str(model), str(tmp_path / "w.caffemodel"), 2)
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "off")
    plain = run_test(str(model), str(tmp_path / "w.caffemodel"), 2)
    assert set(fused) == {"loss", "acc"}
    for name in fused:
        np.testing.assert_allclose(fused[name], plain[name], rtol=1e-5)


def test_a_blob_reshaped_by_hand_makes_a_new_plan():
    text = inp(1, 3, 6, 6) + conv("conv", "data", "c", 4, 3, p=1) + bn_scale_act("c", "c") + \
        layer("pool", "Pooling", "c", "p", "pooling_param { pool: MAX kernel_size: 2 }")
    net, ref = fused_vs_unfused(text)
    plan = net._plan
    for n in (net, ref):
        n.blobs["c"].reshape(1, 1, 2, 2)     # a forward reshapes it back, as a net's does
    with ref.unfused():
        ref.forward()
    net.forward()
    assert net._plan is not plan
    assert_same_blobs(net, ref)


def test_time_of_a_net_whose_layer_replaces_its_tops(tmp_path, monkeypatch):
    """Timed layer by layer (caffepar time --phase test), a layer that replaces its top array
    ends the plan mid-pass: the next layer makes a new one, and the values stay right."""
    from caffepar.timing import benchmark
    (tmp_path / "user_plan_layers.py").write_text(PY_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = inp(1, 3, 4, 4) + conv("conv", "data", "c", 2) + bn_scale_act("c", "c") + \
        layer("py", "Python", "c", "d", 'python_param { module: "user_plan_layers" '
              'layer: "Doubler" }') + conv("after", "d", "e", 2) + layer("r", "ReLU", "e", "e")
    net = randomize(Net(P(text), phase=TEST))
    ref = randomize(Net(P(text), phase=TEST))
    benchmark(net, 2)
    with ref.unfused():
        ref.forward()
    assert_same_blobs(net, ref)


def test_layers_with_prepared_calls_as_their_forward():
    """Each layer type's prepared call (Layer.prepare_forward) against its forward, in
    the configurations the nets above do not use."""
    text = inp(2, 4, 6, 6) + inp(2, 4, top="w") + conv("c", "data", "c", 4, 3, p=1)
    text += layer("prod", "Eltwise", ["c", "data", "c"], "prod",
                  "eltwise_param { operation: PROD }")
    text += layer("coef", "Eltwise", ["c", "data"], "coef",
                  "eltwise_param { operation: SUM coeff: 0.5 coeff: -2 }")
    text += layer("max", "Eltwise", ["c", "data"], "max", "eltwise_param { operation: MAX }")
    text += layer("small", "Pooling", "max", "small",
                  "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
    text += layer("crop", "Crop", ["coef", "small"], "crop", "crop_param { axis: 2 offset: 1 }")
    text += layer("se", "Scale", ["coef", "w"], "se", "scale_param { axis: 0 }")
    text += layer("sb", "Bias", ["se", "w"], "sb", "bias_param { axis: 0 }")
    text += layer("s0", "Scale", "sb", "s0",
                  "scale_param { axis: 0 num_axes: 0 bias_term: true }")
    text += layer("r6", "ReLU6", "s0", "r6") + layer("cl", "Clip", "s0", "cl",
                                                   "clip_param { min: -1 max: 0.5 }")
    text += layer("lk", "ReLU", "s0", "lk", "relu_param { negative_slope: -0.3 }")
    text += layer("sig", "Sigmoid", "lk", "sig") + layer("th", "TanH", "lk", "th")
    text += layer("abs", "AbsVal", "th", "abs") + layer("pr", "PReLU", "th", "pr",
                                                       "prelu_param { channel_shared: true }")
    text += layer("sm", "Softmax", "pr", "sm", "softmax_param { axis: 2 }")
    text += layer("mp", "Pooling", "sm", ["mp", "mask"], "pooling_param { pool: MAX "
                  "kernel_size: 3 stride: 2 pad: 1 }")
    text += layer("dc", "Deconvolution", "mp", "dc", "convolution_param { num_output: 2 "
                  "kernel_size: 2 stride: 2 }")
    fused_vs_unfused(text)


def test_a_net_of_more_layers_than_a_plan_takes_runs_layer_by_layer(monkeypatch):
    """Past Net.PLAN_MAX_LAYERS a TEST net makes no plan (its cost a layer would not be won
    back on millions of tiny layers) and computes what the layer-by-layer forward does."""
    text = inp(1, 3, 4, 4) + conv("conv", "data", "c", 2) + bn_scale_act("c", "c") + \
        conv("after", "c", "e", 2) + layer("r", "ReLU", "e", "e")
    ref = randomize(Net(P(text), phase=TEST))
    with ref.unfused():
        ref.forward()
    monkeypatch.setattr(Net, "PLAN_MAX_LAYERS", 3)
    net = randomize(Net(P(text), phase=TEST))
    assert not net.inference_enabled()
    net.forward()
    assert net._plan is None
    assert_same_blobs(net, ref)
