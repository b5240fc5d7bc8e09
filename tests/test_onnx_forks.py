"""ONNX export of the layers of Caffe's forks (mobile, segmentation, detection): onnxruntime
agrees with caffepar's forward, every blob."""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from caffepar.convert.onnx_export import OnnxExportError, export_onnx  # noqa: E402
from caffepar.convert.verify import verify_onnx  # noqa: E402

RNG = np.random.default_rng(5)


def _export(tmp_path, text, **kw):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return export_onnx(path, None, **kw)


def _check(result, inputs=None, tolerance=1e-5):
    v = verify_onnx(result, inputs=inputs, all_blobs=True, tolerance=tolerance)
    assert v.ok, v.lines()


MOBILE_SEGMENTATION = """name: "forks"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 4 dim: 9 dim: 7 } } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw"
  convolution_param { kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.5 }
                      bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "dw2" type: "DepthwiseConvolution" bottom: "dw" top: "dw2"
  convolution_param { num_output: 4 group: 4 kernel_size: 3 stride: 2
                      weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu6" type: "ReLU6" bottom: "dw2" top: "dw2" }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "dw2" top: "shuffle"
  shuffle_channel_param { group: 2 } }
layer { name: "zoom" type: "Interp" bottom: "shuffle" top: "zoom" interp_param { zoom_factor: 3 } }
layer { name: "crop" type: "Interp" bottom: "zoom" top: "crop"
  interp_param { shrink_factor: 2 pad_beg: -1 pad_end: -2 } }
layer { name: "size" type: "Interp" bottom: "crop" top: "size" interp_param { height: 13 width: 5 } }
layer { name: "like" type: "Interp" bottom: "size" bottom: "data" top: "like" }
layer { name: "up" type: "Upsample" bottom: "like" top: "up" upsample_param { scale: 2 } }
"""


def test_mobile_and_segmentation_layers_agree_in_onnxruntime(tmp_path):
    result = _export(tmp_path, MOBILE_SEGMENTATION)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Conv") == 2 and "Clip" in ops and "Transpose" in ops
    assert ops.count("Resize") == 5
    _check(result)
    x = RNG.standard_normal((3, 4, 9, 7)).astype(np.float32)   # the batch is free
    _check(result, inputs={"data": x})


SEGNET = """name: "segnet"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 7 dim: 8 } } }
layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" top: "mask"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "up" type: "Upsample" bottom: "pool" bottom: "mask" top: "up"
  upsample_param { scale: 2 upsample_h: 7 upsample_w: 8 } }
"""


def test_segnet_upsample_is_maxunpool(tmp_path):
    """The mask is a graph input here (ONNX has no Caffe-layout pooling mask to make it)."""
    text = SEGNET.replace('layer { name: "pool"', 'layer { name: "mask" type: "Input" top: "mask" '
                          'input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }\n'
                          'layer { name: "pool"').replace(' top: "mask"\n', "\n")
    result = _export(tmp_path, text)
    assert "MaxUnpool" in [n.op_type for n in result.model.graph.node]
    rows = np.minimum(np.arange(4)[:, None] * 2 + RNG.integers(0, 2, (2, 3, 4, 4)), 6)
    cols = np.arange(4)[None, :] * 2 + RNG.integers(0, 2, (2, 3, 4, 4))
    mask = (rows * 8 + cols).astype(np.float32)
    _check(result, inputs={"data": RNG.standard_normal((2, 3, 7, 8)).astype(np.float32),
                           "mask": mask}, tolerance=0)


def test_segnet_pooling_mask_and_upsample_export(tmp_path):
    """The pooling mask top is MaxPool's Indices in Caffe's layout; the unpooling undoes it.
    With the batch fixed too: onnxruntime then folds the image offsets into constants, whose
    Range needs scalar bounds."""
    result = _export(tmp_path, SEGNET)
    _check(result, tolerance=0)
    x = RNG.standard_normal((3, 3, 7, 8)).astype(np.float32)
    _check(result, inputs={"data": x}, tolerance=0)
    _check(_export(tmp_path, SEGNET, batch=2), tolerance=0)


@pytest.mark.parametrize("kernel,stride,pad,size,mode", [
    (2, 2, 0, 7, ""), (3, 2, 1, 8, ""), (3, 2, 0, 9, "round_mode: FLOOR"), (2, 3, 0, 10, ""),
    (3, 1, 1, 5, ""), (2, 2, 0, 6, "global_pooling: true")])
def test_pooling_mask_top_is_caffes(tmp_path, kernel, stride, pad, size, mode):
    window = "" if "global" in mode else f"kernel_size: {kernel} stride: {stride} pad: {pad}"
    result = _export(tmp_path, f"""name: "mask"
layer {{ name: "data" type: "Input" top: "data"
  input_param {{ shape {{ dim: 2 dim: 3 dim: {size} dim: {size + 1} }} }} }}
layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool" top: "mask"
  pooling_param {{ pool: MAX {window} {mode} }} }}
""")
    _check(result, tolerance=0)
    # Ties (zeros after a ReLU, repeated values): Caffe keeps each window's first maximum.
    ties = RNG.integers(0, 3, (2, 3, size, size + 1)).astype(np.float32)
    _check(result, inputs={"data": ties}, tolerance=0)


DETECTION = """name: "rois"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 8 dim: 10 dim: 12 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 5 dim: 5 } } }
layer { name: "pool" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }
"""

ROIS = np.array([[0, 0, 0, 15, 15], [1, 4, 2, 13, 9], [0, 6, 6, 6, 7], [1, 10, 12, 30, 30],
                 [0, 3.3, 1.7, 20.2, 11.5]], np.float32)


def test_roi_pooling_is_maxroipool(tmp_path):
    result = _export(tmp_path, DETECTION)
    assert "MaxRoiPool" in [n.op_type for n in result.model.graph.node]
    _check(result, inputs={"data": RNG.standard_normal((2, 8, 10, 12)).astype(np.float32),
                           "rois": ROIS}, tolerance=0)


def test_psroi_pooling_is_refused_by_name(tmp_path):
    text = DETECTION.replace('type: "ROIPooling"', 'type: "PSROIPooling"').replace(
        "roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 }",
        "psroi_pooling_param { spatial_scale: 0.5 output_dim: 2 group_size: 2 }")
    with pytest.raises(OnnxExportError, match=r'"pool" \(PSROIPooling\): position-sensitive'):
        _export(tmp_path, text)


def test_interp_over_free_size_by_zoom_is_refused(tmp_path):
    text = MOBILE_SEGMENTATION.split('layer { name: "crop"')[0]
    with pytest.raises(OnnxExportError, match=r'layer "zoom".*export with a fixed size'):
        _export(tmp_path, text, dynamic_spatial=True)


def test_axpy_is_mul_add(tmp_path):
    text = """name: "se"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 dim: 3 dim: 5 } } }
layer { name: "pool" type: "Pooling" bottom: "x" top: "pool" pooling_param { pool: AVE global_pooling: true } }
layer { name: "gate" type: "Sigmoid" bottom: "pool" top: "gate" }
layer { name: "axpy" type: "Axpy" bottom: "gate" bottom: "x" bottom: "x" top: "out" }
"""
    result = _export(tmp_path, text)
    _check(result)


FIXTURES = sorted((Path(__file__).parent / "fork_layers").glob("*.prototxt"))
NOT_EXPORTED = {"psroi_pooling": "position-sensitive"}


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_fork_layer_fixtures_export(path):
    from test_layers_forks import fixture_inputs
    if path.stem in NOT_EXPORTED:
        with pytest.raises(OnnxExportError, match=NOT_EXPORTED[path.stem]):
            export_onnx(path, None)
        return
    result = export_onnx(path, None)
    _check(result, inputs=fixture_inputs(result.net))


def test_bn_exports_and_segnet_learn_mode_is_refused(tmp_path):
    """PSPNet's BN at TEST (moving statistics, made non-trivial) is BatchNormalization."""
    from caffepar.graph.net import TEST, Net
    path = Path(__file__).parent / "fork_layers" / "bn_pspnet.prototxt"
    net = Net(str(path), phase=TEST)
    net.params["bn"][2].data[...] = RNG.standard_normal((1, 8, 1, 1))
    net.params["bn"][3].data[...] = RNG.uniform(0.5, 2, (1, 8, 1, 1))
    weights = tmp_path / "bn.caffemodel"
    net.save(str(weights))
    result = export_onnx(path, weights)
    assert "BatchNormalization" in [n.op_type for n in result.model.graph.node]
    _check(result)
    text = (Path(__file__).parent / "fork_layers" / "bn_segnet.prototxt").read_text()
    with pytest.raises(OnnxExportError, match=r'"bn" \(BN\): SegNet.s BN in LEARN mode'):
        _export(tmp_path, text.replace("INFERENCE", "LEARN"))


def _cli(tmp_path, text, capsys, weights=None, extra=()):
    """`caffepar convert onnx --verify` on `text` (weights: the fillers' values, or a file):
    (exit status, stdout, stderr)."""
    import caffepar as caffe
    from caffepar.cli import main
    net_path = tmp_path / "net.prototxt"
    net_path.write_text(text)
    if weights is None:
        weights = tmp_path / "w.caffemodel"
        caffe.set_random_seed(3)
        caffe.Net(str(net_path), caffe.TEST).save(str(weights))
    with pytest.raises(SystemExit) as ended:
        main(["convert", "onnx", str(net_path), str(weights), str(tmp_path / "n.onnx"),
              "--verify", *extra])
    out, err = capsys.readouterr()
    return ended.value.code, out, err


ROI_NET = """name: "fast_rcnn_head"
input: "data" input_shape { dim: 2 dim: 3 dim: 32 dim: 40 }
input: "rois" input_shape { dim: 6 dim: 5 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1
                      weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "pool" type: "ROIPooling" bottom: "conv" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_h: 2 pooled_w: 3 spatial_scale: 0.5 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc"
  dropout_param { dropout_ratio: 0.4 scale_train: false } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_verify_feeds_valid_regions_to_a_roi_input(tmp_path, capsys):
    """--verify on a Fast R-CNN head whose regions are a net input: regions with a batch
    index in range, x1 <= x2, y1 <= y2, inside the image (the features' size over
    spatial_scale), at both batch sizes; caffepar and onnxruntime agree (scale_train: false
    exported as the multiplication by 1 - ratio)."""
    from caffepar.convert.verify import random_inputs
    result = export_onnx(_write(tmp_path, ROI_NET), None)
    for shapes in (result.inputs, result.other_inputs):
        result.net.blobs["data"].reshape(shapes["data"])
        result.net.blobs["rois"].reshape(shapes["rois"])
        result.net.reshape()
        rois = random_inputs(result.net, seed=7)["rois"]
        assert rois.shape == tuple(shapes["rois"])
        batch, x1, y1, x2, y2 = rois.T
        assert np.array_equal(batch, np.round(batch))
        assert batch.min() >= 0 and batch.max() < shapes["data"][0]
        assert (x1 <= x2).all() and (y1 <= y2).all() and x1.min() >= 0 and y1.min() >= 0
        assert x2.max() < 40 and y2.max() < 32          # the image: 20 x 16 features / 0.5
        assert len(set(batch)) > 1 or shapes["data"][0] == 1
    code, out, err = _cli(tmp_path, ROI_NET, capsys)
    assert code == 0 and not err, err
    assert "verified: onnxruntime matches caffepar at both sizes" in out


def _write(tmp_path, text):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    return path


def test_an_onnxruntime_failure_is_one_line(tmp_path, capsys, monkeypatch):
    """Whatever onnxruntime refuses (here regions of an image the batch lacks) ends in one
    line naming the inputs and onnxruntime's reason, not its traceback."""
    from caffepar.convert import verify

    def bad_regions(net, seed=0):
        inputs = random_inputs(net, seed)
        inputs["rois"][:, 0] = 7
        return inputs
    random_inputs = verify.random_inputs
    monkeypatch.setattr(verify, "random_inputs", bad_regions)
    code, out, err = _cli(tmp_path, ROI_NET, capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert "error: onnxruntime cannot run the exported model on the inputs data (2, 3, 32, " \
           "40), rois (6, 5): " in err
    assert "Status Message: roi_batch_id < batch_size was false." in err
    assert "Traceback" not in err and "onnxruntime_src" not in err


def test_silence_is_dropped(tmp_path, capsys):
    """Silence (MobileNetV2-SSDLite's deploy file has one) does nothing at inference."""
    text = ROI_NET.replace('layer { name: "prob"', 'layer { name: "mute" type: "Silence" '
                           'bottom: "pool" }\nlayer { name: "prob"')
    result = export_onnx(_write(tmp_path, text), None)
    assert result.outputs == ["prob"]
    code, out, err = _cli(tmp_path, text, capsys)
    assert code == 0 and "verified" in out, err
