"""SSD's fork layers exported to ONNX: onnxruntime agrees with caffepar's forward, and a small
SSD net (and the published MobileNet-SSD when its prototxt is in the cache) runs end to end:
`caffepar test`/`time`, pycaffe's Net, `caffepar convert onnx`."""
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import caffepar as caffe  # noqa: E402
from caffepar.cli import main  # noqa: E402
from caffepar.convert.onnx_export import OnnxExportError, net_to_onnx  # noqa: E402
from caffepar.graph.net import TEST, Net  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_layers_ssd import DET_CASES, detection_net, one_layer, run, ssd_inputs  # noqa: E402


def onnx_run(model, feed):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def caffepar_run(net, feed):
    """The net's tops for `feed` (export probes other sizes and leaves the inputs zeroed)."""
    for name, value in feed.items():
        net.blobs[name].reshape(value.shape)
        net.blobs[name].data[...] = value
    net.reshape()
    net.forward()
    return {name: net.blobs[name].data.copy() for name in net.outputs}


@pytest.mark.parametrize("layer,shape,params", [
    ("Permute", (2, 3, 4, 5), "permute_param { order: 0 order: 2 order: 3 order: 1 }"),
    ("Normalize", (2, 3, 4, 5), "norm_param { across_spatial: false channel_shared: false "
                                'scale_filler { type: "gaussian" std: 3 } }'),
    ("Normalize", (2, 3, 4, 5), "norm_param { eps: 0.01 }"),
])
def test_permute_and_normalize_in_onnxruntime(layer, shape, params):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    net = run(one_layer(layer, [shape], params), {"x": x}, dtype=np.float32)
    model = net_to_onnx(net, dynamic_batch=True)
    for batch in (2, 3):
        feed = {"x": np.resize(x, (batch,) + shape[1:])}
        np.testing.assert_allclose(onnx_run(model, feed)[0], caffepar_run(net, feed)["y"],
                                   rtol=1e-6, atol=1e-7)


def test_priorbox_is_a_constant():
    text = one_layer("PriorBox", [(1, 2, 5, 4), (1, 3, 40, 32)],
                     "prior_box_param { min_size: 8 max_size: 16 aspect_ratio: 2 clip: true }",
                     bottoms=("f", "img"))
    net = run(text, {}, dtype=np.float32)
    model = net_to_onnx(net)
    assert [n.op_type for n in model.graph.node] == ["Identity"]
    feed = {"f": np.zeros((1, 2, 5, 4), np.float32), "img": np.zeros((1, 3, 40, 32), np.float32)}
    np.testing.assert_array_equal(onnx_run(model, feed)[0], caffepar_run(net, feed)["y"])
    with pytest.raises(OnnxExportError, match="height and width"):
        net_to_onnx(net, dynamic_spatial=True)


EXTRA = [("confidence_threshold: 0.999", {}, 1), ("nms_param { top_k: 0 }", {}, 1),
         ("keep_top_k: 0", {}, 1), ("nms_param { top_k: 3 } keep_top_k: 4", {}, 1)]


@pytest.mark.parametrize("params,_ref,cl", [c for c in DET_CASES if "eta" not in c[0]] + EXTRA)
def test_detection_output_in_onnxruntime(params, _ref, cl):
    n, p, c = 2, 40, 4
    cl = c if cl > 1 else 1
    # Small offsets: no decoded box is inverted (see onnx_ssd on CORNER's inverted boxes).
    loc, conf, prior = ssd_inputs(n, p, c, cl, seed=3, spread=0.1)
    net = run(detection_net(n, p, c, params, cl), {"loc": loc, "conf": conf, "prior": prior},
              dtype=np.float32)
    model = net_to_onnx(net, dynamic_batch=True)
    for batch in (2, 3, 1):
        rows = np.arange(batch) % n
        feed = {"loc": loc[rows], "conf": conf[rows], "prior": prior}
        got, = onnx_run(model, feed)
        want = caffepar_run(net, feed)["y"]
        assert got.shape == want.shape
        np.testing.assert_array_equal(got[..., :3], want[..., :3])
        np.testing.assert_allclose(got[..., 3:], want[..., 3:], rtol=1e-6, atol=1e-7)


def test_detection_output_threshold_is_strict_in_both():
    """Caffe keeps scores above confidence_threshold, not equal to it."""
    loc, conf, prior = ssd_inputs(1, 12, 3, seed=4, spread=0.1)
    conf = conf.reshape(1, 12, 3)
    conf[0, :6, 1] = np.float32(0.25)
    conf = conf.reshape(1, -1)
    net = run(detection_net(1, 12, 3, "confidence_threshold: 0.25 nms_param { "
                                      "nms_threshold: 1 }"),
              {"loc": loc, "conf": conf, "prior": prior}, dtype=np.float32)
    want = caffepar_run(net, {"loc": loc, "conf": conf, "prior": prior})["y"]
    assert not np.any(want[0, 0, :, 2] == np.float32(0.25))
    got, = onnx_run(net_to_onnx(net), {"loc": loc, "conf": conf, "prior": prior})
    np.testing.assert_array_equal(got[..., :3], want[..., :3])


def test_keep_top_k_ties_across_classes_settle_as_caffepar():
    """Classes 1 and 2 score the same priors alike: keep_top_k 5 cuts between a tied pair,
    and both keep the lower label (the earlier row)."""
    loc, _, prior = ssd_inputs(1, 12, 3, seed=5, spread=0.1)
    conf = np.zeros((1, 12, 3), np.float32)
    conf[0, :, 1] = conf[0, :, 2] = np.linspace(0.9, 0.35, 12, dtype=np.float32)
    conf[0, :, 0] = 0.05
    feed = {"loc": loc, "conf": conf.reshape(1, -1), "prior": prior}
    net = run(detection_net(1, 12, 3, "nms_param { nms_threshold: 1 } keep_top_k: 5"), feed,
              dtype=np.float32)
    want = caffepar_run(net, feed)["y"]
    assert want.shape == (1, 1, 5, 7) and list(want[0, 0, :, 1]) == [1, 1, 1, 2, 2]
    for opset in (13, 17):
        got, = onnx_run(net_to_onnx(net, opset=opset), feed)
        np.testing.assert_array_equal(got, want)


def test_adaptive_nms_is_refused_by_name():
    net = run(detection_net(1, 10, 3, "nms_param { eta: 0.9 }"), {}, dtype=np.float32)
    with pytest.raises(OnnxExportError, match=r'"l".*eta 0.9'):
        net_to_onnx(net)


# A small SSD: two feature maps, a Normalize, Permute/Flatten heads, PriorBox, Softmax and
# DetectionOutput, wired as the published SSD deploy nets are.
SSD_NET = """name: "tiny_ssd"
input: "data"
input_shape { dim: 1 dim: 3 dim: 32 dim: 32 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 group: 8 weight_filler { type: "msra" } } }
layer { name: "conv1_norm" type: "Normalize" bottom: "conv1" top: "conv1_norm"
  norm_param { across_spatial: false channel_shared: false scale_filler { type: "constant" value: 20 } } }
"""
HEADS = [("conv1_norm", 2, "min_size: 4 max_size: 10 aspect_ratio: 2", 4),
         ("conv2", 4, "min_size: 10 max_size: 20 aspect_ratio: 2 aspect_ratio: 3", 6)]
for _src, _step, _pb, _k in HEADS:
    SSD_NET += f"""layer {{ name: "{_src}_loc" type: "Convolution" bottom: "{_src}" top: "{_src}_loc"
  convolution_param {{ num_output: {_k * 4} kernel_size: 3 pad: 1 weight_filler {{ type: "gaussian" std: 0.01 }} }} }}
layer {{ name: "{_src}_loc_perm" type: "Permute" bottom: "{_src}_loc" top: "{_src}_loc_perm"
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "{_src}_loc_flat" type: "Flatten" bottom: "{_src}_loc_perm" top: "{_src}_loc_flat" }}
layer {{ name: "{_src}_conf" type: "Convolution" bottom: "{_src}" top: "{_src}_conf"
  convolution_param {{ num_output: {_k * 3} kernel_size: 3 pad: 1 weight_filler {{ type: "gaussian" std: 0.03 }} }} }}
layer {{ name: "{_src}_conf_perm" type: "Permute" bottom: "{_src}_conf" top: "{_src}_conf_perm"
  permute_param {{ order: 0 order: 2 order: 3 order: 1 }} }}
layer {{ name: "{_src}_conf_flat" type: "Flatten" bottom: "{_src}_conf_perm" top: "{_src}_conf_flat" }}
layer {{ name: "{_src}_priorbox" type: "PriorBox" bottom: "{_src}" bottom: "data" top: "{_src}_priorbox"
  prior_box_param {{ {_pb} flip: true clip: false variance: 0.1 variance: 0.1 variance: 0.2
                    variance: 0.2 step: {_step} offset: 0.5 }} }}
"""
SSD_NET += """layer { name: "mbox_loc" type: "Concat" bottom: "conv1_norm_loc_flat" bottom: "conv2_loc_flat" top: "mbox_loc" }
layer { name: "mbox_conf" type: "Concat" bottom: "conv1_norm_conf_flat" bottom: "conv2_conf_flat" top: "mbox_conf" }
layer { name: "mbox_priorbox" type: "Concat" bottom: "conv1_norm_priorbox" bottom: "conv2_priorbox"
  top: "mbox_priorbox" concat_param { axis: 2 } }
layer { name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf" top: "mbox_conf_reshape"
  reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
layer { name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape" top: "mbox_conf_softmax"
  softmax_param { axis: 2 } }
layer { name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax" top: "mbox_conf_flatten" }
layer { name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc" bottom: "mbox_conf_flatten"
  bottom: "mbox_priorbox" top: "detection_out" include { phase: TEST }
  detection_output_param { num_classes: 3 share_location: true background_label_id: 0
    nms_param { nms_threshold: 0.45 top_k: 50 } code_type: CENTER_SIZE keep_top_k: 30
    confidence_threshold: 0.2 } }
"""


def random_weights(net, conf_gain=4.0):
    """The net's filler values, with BatchNorm statistics of mean 0 and variance 1 (fillers
    leave them at 0, a variance that blows the activations up) and the class-score
    convolutions (*_mbox_conf) times `conf_gain`, so that some scores of a random net pass a
    published confidence threshold."""
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1
        if layer.type == "Convolution" and layer.name.endswith("mbox_conf"):
            layer.blobs[0].data[...] *= conf_gain
    return net


def end_to_end(deploy, tmp_path, size, min_rows, conf_gain=4.0):
    """`caffepar time`/`test`, pycaffe's Net and `caffepar convert onnx` on one deploy net
    with random weights; onnxruntime's detections equal pycaffe's."""
    caffe.set_random_seed(5)
    weights = tmp_path / "w.caffemodel"
    random_weights(Net(str(deploy), phase=TEST), conf_gain).save(str(weights))
    for args in (["time", "--model", str(deploy), "--weights", str(weights), "--iterations", "1"],
                 ["test", "--model", str(deploy), "--weights", str(weights), "--iterations", "1"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0, args
    net = caffe.Net(str(deploy), str(weights), caffe.TEST)
    image = np.random.default_rng(6).uniform(-1, 1, (1, 3, size, size)).astype(np.float32)
    net.blobs["data"].data[...] = image
    dets = net.forward()["detection_out"].copy()
    assert dets.shape[:2] == (1, 1) and dets.shape[3] == 7 and dets.shape[2] >= min_rows
    assert np.all(dets[0, 0, :, 1] >= 1)
    out = tmp_path / "ssd.onnx"
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(deploy), str(weights), str(out), "--verify"])
    assert e.value.code == 0
    import onnx
    model = onnx.load(str(out))
    rows = model.graph.output[0].type.tensor_type.shape.dim[2]
    assert not rows.HasField("dim_value"), "the row count is the data's"
    got, = onnx_run(model, {"data": image})
    # The net before DetectionOutput differs from caffepar's by float rounding (onnxruntime's
    # convolutions and softmax): same detections, scores and boxes to that rounding.
    assert got.shape == dets.shape
    np.testing.assert_array_equal(got[..., :2], dets[..., :2])
    np.testing.assert_allclose(got[..., 2:], dets[..., 2:], rtol=1e-5, atol=1e-6)


def test_small_ssd_end_to_end(tmp_path):
    deploy = tmp_path / "deploy.prototxt"
    deploy.write_text(SSD_NET)
    end_to_end(deploy, tmp_path, 32, 3)


def _fork_model(name):
    from caffepar.nn.native import cache_dir
    root = cache_dir() / "fork_models"
    path = root / name
    if not path.exists():
        pytest.skip(f"{name} not in {root} (scripts/check_fork_models.py --fetch puts it there)")
    return path


def test_published_mobilenet_ssd_end_to_end(tmp_path):
    end_to_end(_fork_model("MobileNetSSD_deploy.prototxt"), tmp_path, 300, 1)


def test_published_res10_face_detector_end_to_end(tmp_path):
    """OpenCV's sample face detector (its DetectionOutput sets OpenCV's clip); two classes, so
    the class scores are left as the fillers make them."""
    end_to_end(_fork_model("res10_300x300_ssd_deploy.prototxt"), tmp_path, 300, 1, 1.0)
