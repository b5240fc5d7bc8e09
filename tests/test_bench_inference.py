"""The correctness logic of scripts/bench_inference.py and of bench_train.py's published nets:
how blobs and outputs are compared, how ratios and goals are read, how a resumed results file
keeps its rows, and how a deploy prototxt becomes a training net (for caffepar and for BVLC
Caffe). No timing here: speed lives in the scripts' results."""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_inference as bi  # noqa: E402


def test_blob_diff_is_relative_with_a_floor_from_the_blobs_magnitude():
    want = np.array([1000.0, -2.0, 0.0, 1e-9], np.float32)
    assert bi.blob_diff(want.copy(), want) == (0.0, True)
    # 1e-5 of the largest magnitude (0.01) is allowed anywhere, however small the element.
    d, ok = bi.blob_diff(want + np.float32(0.009), want)
    assert ok and d == pytest.approx(9e-6, rel=1e-2)
    d, ok = bi.blob_diff(want + np.array([0, 0, 0.05, 0], np.float32), want)
    assert not ok and d == pytest.approx(5e-5, rel=1e-2)
    # rtol 1e-4 on the element itself: 0.05 on 1000 passes, 0.2 does not.
    assert bi.blob_diff(want + np.array([0.05, 0, 0, 0], np.float32), want)[1]
    assert not bi.blob_diff(want + np.array([0.2, 0, 0, 0], np.float32), want)[1]
    assert bi.blob_diff(np.zeros(3), np.zeros(4)) == (math.inf, False)
    assert bi.blob_diff(np.zeros(0), np.zeros(0)) == (0.0, True)


def test_compare_blobs_names_what_differs_or_is_missing():
    plain = {"a": np.ones(4), "b": np.arange(4.0), "c": np.zeros(2)}
    assert bi.compare_blobs(dict(plain), plain).startswith("all 3 blobs equal")
    fused = {"a": np.ones(4), "b": np.arange(4.0) + 1}
    said = bi.compare_blobs(fused, plain)
    assert said.startswith("2 of 3 blobs differ") and "b (" in said and "c missing" in said

    # A dump's carried allowance (a sigmoid's, from its logits) widens that blob's alone.
    plain = {"sig": np.full(4, 0.5), "b": np.zeros(4) + 1, bi.CARRIED + "sig": np.full(4, 2e-4)}
    fused = {"sig": np.full(4, 0.5 + 1.5e-4), "b": np.zeros(4) + 1 + 1.5e-4}
    said = bi.compare_blobs(fused, plain)
    assert said.startswith("1 of 2 blobs differ: b (")


def test_detections_compare_as_sorted_rows():
    rows = np.array([[0, 1, 0.9, .1, .1, .5, .5], [0, 3, 0.5, .2, .2, .4, .4]], np.float32)
    want = {"detection_out": rows.reshape(1, 1, 2, 7)}
    swapped = {"detection_out": rows[::-1].reshape(1, 1, 2, 7)}
    det = {"detection_out": True}
    assert bi.compare_outputs(swapped, want, det).startswith("agrees (2 detections")
    fewer = {"detection_out": rows[:1].reshape(1, 1, 1, 7)}
    assert bi.compare_outputs(fewer, want, det) == "differs: 1 detections, caffepar 2"
    # Dense outputs: reshaped to caffepar's shape when the sizes match.
    dense = {"prob": np.arange(6.0).reshape(1, 6, 1, 1)}
    assert bi.compare_outputs({"prob": np.arange(6.0).reshape(1, 6)}, dense, {}).startswith(
        "agrees")
    assert bi.compare_outputs({"other": np.zeros(6)}, dense, {}) == "differs: no output prob"


def test_ratios_read_below_one_as_caffepar_faster_and_nan_where_missing():
    row = bi.fill_ratios({"caffepar_ms": 5.0, "opencv_ms": 10.0, "ort_ms": float("nan"),
                          "caffepar_ips": 100.0, "opencv_ips": 50.0})
    assert row["lat_vs_opencv"] == 0.5 and math.isnan(row["lat_vs_ort"])
    assert row["thr_vs_opencv"] == 0.5 and math.isnan(row["thr_vs_ort"])
    assert math.isnan(bi.ratio(None, 3.0)) and math.isnan(bi.ratio(0.0, 3.0))
    assert bi.best_median([[3, 1, 2], [0.5, 9, 9], []]) == 2
    assert math.isnan(bi.best_median([]))


def test_goals_follow_the_issue():
    nan = float("nan")
    marks = bi.goal_marks({"net": "resnet50", "lat_vs_opencv": 0.9, "lat_vs_ort": 1.2,
                           "thr_vs_opencv": 1.1})
    assert marks == {"latency <= 1.0x OpenCV": True, "latency <= 1.0x onnxruntime": False,
                     "throughput >= OpenCV": False}
    marks = bi.goal_marks({"net": "mobilenet_v2", "lat_vs_opencv": nan, "lat_vs_ort": 1.4,
                           "thr_vs_opencv": nan})
    assert marks == {"latency <= 1.5x onnxruntime": True}
    assert bi.goal_marks({"net": "fcn8s", "lat_vs_ort": 3.0}) == {}


def test_a_resumed_results_file_keeps_its_rows_in_the_nets_order(tmp_path, monkeypatch):
    monkeypatch.setattr(bi, "plot", lambda out, rows: None)
    out = tmp_path / "inference_x"
    first = bi.fill_ratios({"net": "resnet50", "label": "ResNet-50", "caffepar_ms": 30.0,
                            "opencv_ms": 60.0, "ort_ms": 25.0, "caffepar_check": "all",
                            "load": "0.10-2.00", "started": "then"})
    info = {"cpu": "a CPU", "threads": 2, "rounds": 1}
    bi.write_results(out, [first], info)
    old = bi.read_rows(out.with_suffix(".csv"))
    assert old[0]["net"] == "resnet50" and old[0]["caffepar_ms"] == 30.0
    assert math.isnan(old[0]["caffepar_ips"])
    second = bi.fill_ratios({"net": "mobilenet_v1", "label": "MobileNet v1",
                             "caffepar_ms": 4.0, "opencv_ms": 8.0, "load": "3.0-4.0"})
    rows = bi.merged(old, [second])
    assert [r["net"] for r in rows] == ["mobilenet_v1", "resnet50"]
    bi.write_results(out, rows, info)
    text = out.with_suffix(".md").read_text()
    assert "| MobileNet v1 | 4.0 | 8.0 |  | **0.50** |" in text
    assert "| ResNet-50 | 30.0 | 60.0 | 25.0 | **0.50** | **1.20** |" in text
    assert "**missed: latency <= 1.0x onnxruntime**" in text
    assert "MobileNet v1 measured , load 3.0-4.0 **loaded**" in text
    # Redoing a net replaces its row.
    rows = bi.merged(rows, [dict(second, caffepar_ms=2.0)])
    assert [r["caffepar_ms"] for r in rows] == [2.0, 30.0]


def test_every_net_names_its_source_and_hash():
    assert len(bi.NETS) >= 12 and len(bi.BY_KEY) == len(bi.NETS)
    for n in bi.NETS:
        assert len(n.commit) == 40 and len(n.sha256) == 64, n.key
        assert n.url.startswith("https://raw.githubusercontent.com/") and n.url.endswith(n.path)


DEPLOY = """name: "tiny"
input: "data"
input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "c1" top: "c1"
        batch_norm_param { use_global_stats: true } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "c1" top: "dw"
        convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "fc" type: "InnerProduct" bottom: "dw" top: "fc"
        inner_product_param { num_output: 5 } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_a_deploy_net_becomes_a_training_net_for_caffepar_and_for_bvlc_caffe():
    import bench_train
    from caffepar.proto.text import read_net_text
    deploy, _ = read_net_text(DEPLOY, is_text=True)
    net = bench_train.training_net(deploy, 16)
    types = [lp.type for lp in net.layer]
    assert types == ["DummyData", "Convolution", "BatchNorm", "ConvolutionDepthwise",
                     "InnerProduct", "SoftmaxWithLoss"]
    data = net.layer[0].dummy_data_param
    assert [list(s.dim) for s in data.shape] == [[16, 3, 8, 8], [16]]
    assert not net.layer[2].batch_norm_param.HasField("use_global_stats")
    assert list(net.layer[-1].bottom) == ["fc", "label"]
    bvlc = bench_train.training_net(deploy, 16, bvlc=True)
    assert bvlc.layer[3].type == "Convolution" and bvlc.layer[3].convolution_param.group == 4
    shuffled = DEPLOY.replace('layer { name: "fc"', 'layer { name: "sh" type: "ShuffleChannel" '
                              'bottom: "dw" top: "dw" shuffle_channel_param { group: 2 } }\n'
                              'layer { name: "fc"')
    deploy, _ = read_net_text(shuffled, is_text=True)
    with pytest.raises(ValueError, match="BVLC Caffe has no ShuffleChannel layer"):
        bench_train.training_net(deploy, 16, bvlc=True)


def test_caffepar_runs_the_made_training_net(tmp_path):
    import bench_train
    from caffepar.graph.net import TRAIN, Net
    from caffepar.proto.text import read_net_text
    from google.protobuf import text_format
    deploy, _ = read_net_text(DEPLOY, is_text=True)
    path = tmp_path / "train.prototxt"
    path.write_text(text_format.MessageToString(bench_train.training_net(deploy, 2)))
    net = Net(str(path), phase=TRAIN)
    loss = net.forward()["loss"]
    assert np.isfinite(loss).all()
