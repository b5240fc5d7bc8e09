"""ONNX export: every exportable Caffe golden layer case and the real/bundled nets run in
onnxruntime and agree with Caffe's recorded outputs and with caffepar's forward pass."""
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import CAFFE_REF, DATA, need_shared

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from caffepar.cli import main  # noqa: E402
from caffepar.convert.onnx_export import CONVERTERS, OnnxExportError, export_onnx  # noqa: E402
from caffepar.convert.verify import verify_onnx  # noqa: E402
from caffepar.errors import WeightsError  # noqa: E402
from caffepar.graph.net import TEST, Net  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYERS = CAFFE_REF / "layers"


def _layer_cases():
    """Golden single-layer cases run in TEST phase whose layers all have converters."""
    if not (LAYERS / "index.json").exists():
        return []
    cases = []
    for case in sorted(p.name for p in LAYERS.iterdir() if (p / "meta.json").exists()):
        meta = json.loads((LAYERS / case / "meta.json").read_text())
        if meta["phase"] != "TEST" or not set(meta["net_outputs"]) <= set(meta["outputs"]):
            continue
        if all(t == "Input" or t in CONVERTERS for t in meta["layer_types"]):
            cases.append(case)
    return cases


LAYER_CASES = _layer_cases()
REFUSED = {
    "argmax_axis1_outmax": "ArgMax with an axis, top_k 1 and out_max_val false",
    "argmax_axis1_top2": "ArgMax with an axis, top_k 1",
    "argmax_top3_outmax": "ArgMax with an axis",
    "batchnorm_batchstats_testphase": "use_global_stats: false",
    "silence": "the net has no outputs",
}
"""Golden cases with settings ONNX cannot express: refused with a message naming them."""


def check(result, inputs=None, all_blobs=True, tolerance=1e-4):
    v = verify_onnx(result, inputs=inputs, all_blobs=all_blobs, tolerance=tolerance)
    assert v.ok, v.lines()
    return v


@pytest.mark.parametrize("case", LAYER_CASES or ["none"])
def test_golden_layer_case_matches_caffe_in_onnxruntime(case, tmp_path):
    if case == "none":
        need_shared(LAYERS)
    d = LAYERS / case
    if case in REFUSED:
        with pytest.raises(OnnxExportError, match=REFUSED[case]):
            export_onnx(d / "net.prototxt", None)
        return
    weights = d / "params.npz"
    result = export_onnx(d / "net.prototxt", weights if weights.exists() else None,
                         tmp_path / "m.onnx")
    inputs = {k: v.astype(np.float32) for k, v in np.load(d / "inputs.npz").items()}
    v = check(result, inputs=inputs)
    # The batch is free: one more sample, and caffepar at that batch agrees too.
    assert result.note is None and result.other_inputs
    more = {k: x if result.other_inputs[k] == x.shape else
            np.concatenate([x, 0.5 * x[:1] + 0.25]) for k, x in inputs.items()}
    check(result, inputs=more)
    # And against BVLC Caffe's own recorded outputs.
    import onnxruntime as ort
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, inputs)))
    expected = np.load(d / "outputs.npz")
    meta = json.loads((d / "meta.json").read_text())
    for name, blob in zip(names, meta["net_outputs"]):
        ref = expected[blob]
        np.testing.assert_allclose(got[name], ref, rtol=1e-4, atol=1e-4 * max(1, np.abs(ref).max()))
    assert v.max_abs


POOL_CLIP_CASES = ["pool_ave_k2s2_p1_clip", "pool_ave_k3s2_ceil", "pool_ave_k3s2_p1",
                   "pool_max_k3s2_ceil", "pool_max_k3s1_p1", "pool_max_nonsquare", "lrn_across",
                   "lrn_within", "lrn_within_k2", "batchnorm_scale", "batchnorm_global_test",
                   "eltwise_sum_coeff", "conv_group2_dil2_s2_p1", "deconv_k4_s2_p1", "prelu",
                   "ip_axis2", "ip_transpose", "concat_axis1", "flatten_axis1_end2"]


def test_the_tricky_golden_cases_are_covered():
    if not LAYER_CASES:
        need_shared(LAYERS)
    assert set(POOL_CLIP_CASES) <= set(LAYER_CASES)


def _pool_net(tmp_path, pool, kernel, stride, pad, size, round_mode=""):
    text = f"""name: "p"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 2 dim: 3 dim: {size} dim: {size} }} }} }}
layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool"
  pooling_param {{ pool: {pool} kernel_size: {kernel} stride: {stride} pad: {pad} {round_mode} }} }}
"""
    path = tmp_path / f"pool_{pool}_{kernel}_{stride}_{pad}_{size}{round_mode.split(':')[-1].strip()}.prototxt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_pooling_geometries_match_caffepar(pool, tmp_path):
    """Ceil rounding, windows dropped for starting in the padding, AVE divisors clipped at
    H + pad, floor rounding with unreached rows, strides larger than kernels."""
    rng = np.random.RandomState(0)
    for kernel, stride, pad, size, mode in [(2, 2, 1, 5, ""), (3, 2, 0, 6, ""), (3, 2, 1, 7, ""),
                                            (3, 3, 2, 8, ""), (2, 3, 0, 10, ""),
                                            (3, 2, 1, 8, "round_mode: FLOOR"),
                                            (2, 5, 0, 10, "round_mode: FLOOR"),
                                            (5, 3, 2, 9, ""), (3, 1, 1, 4, "")]:
        path = _pool_net(tmp_path, pool, kernel, stride, pad, size, mode)
        result = export_onnx(path, None)
        x = {"data": rng.randn(2, 3, size, size).astype(np.float32)}
        check(result, inputs=x, tolerance=1e-6)


def test_lenet_real_weights(tmp_path, capsys):
    base = need_shared(DATA / "models" / "lenet")
    out = tmp_path / "lenet.onnx"
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(base / "lenet.prototxt"),
              str(base / "lenet_iter_10000.caffemodel"), str(out), "--verify"])
    stdout, err = capsys.readouterr()
    assert e.value.code == 0, err
    assert "verified" in stdout
    import onnx
    model = onnx.load(str(out))
    assert [i.name for i in model.graph.input] == ["data"]
    assert [o.name for o in model.graph.output] == ["prob"]
    assert not any(n.op_type == "Dropout" for n in model.graph.node)


def test_cifar10_quick_real_weights(tmp_path):
    base = need_shared(DATA / "models" / "cifar10_quick")
    result = export_onnx(base / "cifar10_quick.prototxt",
                         base / "cifar10_quick_iter_5000.caffemodel", batch=4)
    assert result.inputs == {"data": (4, 3, 32, 32)}
    check(result)


def _random_weights(deploy, tmp_path):
    """Bundled deploy nets come with fillers only: save the filled net as their weights."""
    net = Net(str(deploy), phase=TEST)
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    return path


def test_alexnet_random_weights_groups_and_lrn(tmp_path):
    deploy = ROOT / "models/alexnet/deploy.prototxt"
    weights = _random_weights(deploy, tmp_path)
    result = export_onnx(deploy, weights, batch=2)
    ops = {n.op_type for n in result.model.graph.node}
    assert {"LRN", "Conv", "MaxPool", "Gemm", "Softmax"} <= ops
    assert any(a.name == "group" and a.i == 2 for n in result.model.graph.node
               if n.op_type == "Conv" for a in n.attribute)
    check(result)


def test_vgg16_random_weights(tmp_path):
    deploy = ROOT / "models/vgg16/deploy.prototxt"
    weights = _random_weights(deploy, tmp_path)
    out = tmp_path / "vgg16.onnx"
    result = export_onnx(deploy, weights, out, batch=1)
    assert out.stat().st_size > 550e6
    check(result, all_blobs=False)


BN_NET = """name: "resblock"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 11 dim: 11 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 group: 8 bias_term: false
                      weight_filler { type: "msra" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" batch_norm_param { eps: 0.001 } }
layer { name: "scale2" type: "Scale" bottom: "conv2" top: "conv2" scale_param { bias_term: false } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum"
  eltwise_param { operation: SUM coeff: 1 coeff: -0.5 } }
layer { name: "prelu" type: "PReLU" bottom: "sum" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "cat" type: "Concat" bottom: "pool" bottom: "pool" top: "cat" }
layer { name: "drop" type: "Dropout" bottom: "cat" top: "cat" }
layer { name: "fc" type: "InnerProduct" bottom: "cat" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 }
                        bias_filler { type: "constant" value: 0.2 } } }
layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }
"""


def test_batchnorm_scale_eltwise_net(tmp_path):
    path = tmp_path / "bn.prototxt"
    path.write_text(BN_NET)
    net = Net(str(path), phase=TEST)
    rng = np.random.RandomState(3)
    for name, factor in (("bn1", 7.5), ("bn2", 0.0)):
        mean, var, s = net.params[name]
        c = mean.data.size
        mean.data[...] = rng.randn(c) * factor
        var.data[...] = (rng.rand(c) + 0.5) * factor
        s.data[...] = factor  # blob 2: the stored sums' scale factor (0 means "no statistics")
    for name in ("scale1", "scale2"):
        for b in net.params[name]:
            b.data[...] = rng.randn(*b.shape) * 0.5 + (1 if b is net.params[name][0] else 0)
    net.params["prelu"][0].data[...] = rng.rand(8) * 0.3
    weights = tmp_path / "bn.caffemodel"
    net.save(str(weights))
    result = export_onnx(path, weights)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("BatchNormalization") == 2 and "Dropout" not in ops and "PRelu" in ops
    init = {i.name: i for i in result.model.graph.initializer}
    from onnx import numpy_helper
    mean1 = numpy_helper.to_array(init["bn1/mean"])
    np.testing.assert_allclose(mean1, net.params["bn1"][0].data / 7.5, rtol=1e-6)
    assert not numpy_helper.to_array(init["bn2/mean"]).any()
    check(result)


def test_a_deploy_nets_silence_layer_exports_as_no_node(tmp_path):
    """MobileNetV2-SSDLite's deploy silences a Slice's unused top: nothing to compute."""
    path = tmp_path / "silence.prototxt"
    path.write_text("""name: "s"
input: "data"
input_shape { dim: 1 dim: 4 dim: 3 dim: 3 }
layer { name: "slice" type: "Slice" bottom: "data" top: "a" top: "b"
        slice_param { slice_point: 1 axis: 1 } }
layer { name: "silence" type: "Silence" bottom: "a" }
layer { name: "relu" type: "ReLU" bottom: "b" top: "out" }
""")
    result = export_onnx(path, None)
    assert [n.op_type for n in result.model.graph.node].count("Relu") == 1
    assert [o.name for o in result.model.graph.output] == ["out"]
    check(result)


def test_unsupported_layers_are_all_named(tmp_path):
    base = need_shared(DATA / "models" / "lenet")
    with pytest.raises(OnnxExportError) as e:
        export_onnx(base / "lenet_train_test.prototxt", base / "lenet_iter_10000.caffemodel")
    text = str(e.value)
    assert '"mnist" (Data)' in text and '"loss" (SoftmaxWithLoss)' in text
    assert '"accuracy" (Accuracy)' in text and "deploy" in text
    lstm = need_shared(LAYERS / "lstm") / "net.prototxt"
    with pytest.raises(OnnxExportError, match=r'"lstm" \(LSTM\): recurrent'):
        export_onnx(lstm, None)


def test_missing_weights_refused_unless_allowed(tmp_path, capsys):
    base = need_shared(DATA / "models")
    deploy = base / "cifar10_quick/cifar10_quick.prototxt"
    from caffepar.io.weights import read_caffemodel
    full = read_caffemodel(base / "cifar10_quick/cifar10_quick_iter_5000.caffemodel")
    partial = tmp_path / "partial.npz"
    np.savez(partial, **{f"{n}/{i}": v.reshape(s) for n, _t, b in full.layers
                         for i, (v, s, _l) in enumerate(b) if n != "ip2"})
    with pytest.raises(WeightsError, match=r"no weights for layer\(s\) ip2"):
        export_onnx(deploy, partial)
    result = export_onnx(deploy, partial, allow_missing=True)
    check(result)
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(ROOT / "models/alexnet/deploy.prototxt"),
              str(base / "lenet/lenet_iter_10000.caffemodel"), str(tmp_path / "x.onnx")])
    _out, err = capsys.readouterr()
    assert e.value.code == 1 and err.count("\n") == 1
    assert 'layer "conv1" param 0: shape mismatch, the caffemodel has 20 1 5 5 (500), the net ' \
           "expects 96 3 11 11 (34848)" in err


STAGED_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 6 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 4 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        include { stage: "extra" } inner_product_param { num_output: 3 } }
"""


def test_verify_says_when_caffepars_output_is_not_finite(tmp_path, capsys):
    net_path = tmp_path / "net.prototxt"
    net_path.write_text(STAGED_NET)
    weights = tmp_path / "w.npz"
    np.savez(weights, **{"ip1/0": np.full((4, 6), np.nan, np.float32),
                         "ip1/1": np.zeros(4, np.float32)})
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(net_path), str(weights), str(tmp_path / "x.onnx"),
              "--verify"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err.count("\n") == 1
    assert "caffepar's own output 'ip1' is not finite (NaN or infinite) on random input" in err


def test_convert_commands_take_the_net_state(tmp_path, capsys):
    net_path = tmp_path / "net.prototxt"
    net_path.write_text(STAGED_NET)
    weights = tmp_path / "w.npz"
    rng = np.random.RandomState(0)
    np.savez(weights, **{"ip1/0": rng.randn(4, 6).astype(np.float32),
                         "ip1/1": np.zeros(4, np.float32),
                         "ip2/0": rng.randn(3, 4).astype(np.float32),
                         "ip2/1": np.zeros(3, np.float32)})
    main_ok = []
    for args in (["convert", "onnx", str(net_path), str(weights), str(tmp_path / "s.onnx"),
                  "--stage", "extra", "--verify"],
                 ["convert", "caffemodel", str(weights), str(net_path),
                  str(tmp_path / "s.caffemodel"), "--stage", "extra", "--phase", "TEST"],
                 ["convert", "weights", str(weights), str(tmp_path / "w.caffemodel"),
                  "--model", str(net_path), "--level", "0", "--stage", "extra"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        main_ok.append(e.value.code)
    out, err = capsys.readouterr()
    assert main_ok == [0, 0, 0], err
    assert "outputs ip2" in out and "verified: onnxruntime matches caffepar" in out
    from caffepar.io.weights import read_caffemodel
    for name in ("s.caffemodel", "w.caffemodel"):
        assert [n for n, _t, _b in read_caffemodel(tmp_path / name).layers][-2:] == ["ip1", "ip2"]


# ------------------------------------------------------------------------ free batch / size
FCN = """
name: "tiny_fcn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 21 dim: 19 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" }
                            bias_filler { type: "uniform" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "pool2" type: "Pooling" bottom: "pool1" top: "pool2"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "score" type: "Convolution" bottom: "pool2" top: "score"
        convolution_param { num_output: 5 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "up" type: "Deconvolution" bottom: "score" top: "up"
        convolution_param { num_output: 5 kernel_size: 8 stride: 4 bias_term: false
                            weight_filler { type: "bilinear" } } }
layer { name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "crop"
        crop_param { axis: 2 offset: 2 } }
layer { name: "flat" type: "Reshape" bottom: "crop" top: "flat"
        reshape_param { shape { dim: 0 dim: 0 dim: -1 } } }
layer { name: "prob" type: "Softmax" bottom: "flat" top: "prob" }
"""


def _dims(value_info):
    return [d.dim_param or d.dim_value or None for d in value_info.type.tensor_type.shape.dim]


def test_batch_is_free_by_default_and_any_batch_matches_caffepar(tmp_path):
    result = export_onnx(ROOT / "models/cifar10_quick/deploy.prototxt", None, tmp_path / "c.onnx",
                         allow_missing=True)
    graph = result.model.graph
    assert _dims(graph.input[0]) == ["batch", 3, 32, 32]
    assert _dims(graph.output[0]) == ["batch", 10]
    assert result.note is None
    for batch in (1, 3, 7):
        check(result, all_blobs=True, inputs={"data": np.random.RandomState(batch).randn(
            batch, 3, 32, 32).astype(np.float32)})
    assert result.net.blobs["data"].shape == (1, 3, 32, 32)     # put back after each check


def test_batch_option_fixes_the_batch(tmp_path):
    result = export_onnx(ROOT / "models/cifar10_quick/deploy.prototxt", None, tmp_path / "c.onnx",
                         allow_missing=True, batch=4)
    assert _dims(result.model.graph.input[0]) == [4, 3, 32, 32]
    assert _dims(result.model.graph.output[0]) == [4, 10]
    assert result.other_inputs == {}
    import onnxruntime as ort
    session = ort.InferenceSession(str(tmp_path / "c.onnx"), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        session.run(None, {"data": np.zeros((2, 3, 32, 32), np.float32)})


def test_dynamic_spatial_fully_convolutional_net_at_two_sizes(tmp_path):
    path = tmp_path / "fcn.prototxt"
    path.write_text(FCN)
    result = export_onnx(path, None, tmp_path / "fcn.onnx", allow_missing=True,
                         dynamic_spatial=True)
    assert _dims(result.model.graph.input[0]) == ["batch", 3, "data_height", "data_width"]
    out = _dims(result.model.graph.output[0])
    assert out[0] == "batch" and out[1] == 5 and out[2] is None
    rng = np.random.RandomState(0)
    for shape in [(2, 3, 21, 19), (1, 3, 32, 32), (3, 3, 17, 26), (1, 3, 40, 9)]:
        check(result, all_blobs=True, inputs={"data": rng.randn(*shape).astype(np.float32)},
              tolerance=1e-5)
    nodes = {n.op_type for n in result.model.graph.node}
    assert {"Shape", "Gather"} <= nodes           # Crop's size read from the data blob
    # Without the flag the height and width stay fixed.
    fixed = export_onnx(path, None, allow_missing=True)
    assert _dims(fixed.model.graph.input[0]) == ["batch", 3, 21, 19]


def test_dynamic_spatial_refuses_a_net_with_fixed_size_naming_the_layer(tmp_path, capsys):
    with pytest.raises(OnnxExportError) as info:
        export_onnx(ROOT / "models/cifar10_quick/deploy.prototxt", None, allow_missing=True,
                    dynamic_spatial=True)
    assert 'layer "ip1" (InnerProduct)' in str(info.value)
    assert "height and width free" in str(info.value) and "\n" not in str(info.value)
    narrow = tmp_path / "narrow.prototxt"
    narrow.write_text(FCN.replace("pool: AVE kernel_size: 3 stride: 2", "pool: AVE kernel_size: 1 stride: 2"))
    with pytest.raises(OnnxExportError, match='"pool2".*narrower than their stride'):
        export_onnx(narrow, None, allow_missing=True, dynamic_spatial=True)


def test_a_net_that_ties_its_batch_is_exported_at_its_own_saying_why(tmp_path, capsys):
    path = tmp_path / "tied.prototxt"
    path.write_text(FCN.replace("shape { dim: 0 dim: 0 dim: -1 }", "shape { dim: 2 dim: 5 dim: -1 }"))
    result = export_onnx(path, None, allow_missing=True)
    assert _dims(result.model.graph.input[0]) == [2, 3, 21, 19]
    assert result.note.startswith("the batch size is fixed at 2: ") and '"flat"' in result.note
    check(result)
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(path), str(_zero_weights(tmp_path, result.net)),
              str(tmp_path / "t.onnx"), "--verify"])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    assert "note: the batch size is fixed at 2" in out and "at both sizes" not in out


def _zero_weights(tmp_path, net):
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    return path


def test_cli_dynamic_spatial_verifies_two_sizes(tmp_path, capsys):
    path = tmp_path / "fcn.prototxt"
    path.write_text(FCN)
    net = Net(str(path), TEST)
    weights = _zero_weights(tmp_path, net)
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(path), str(weights), str(tmp_path / "f.onnx"),
              "--dynamic-spatial", "--verify"])
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    assert "inputs data batchx3xdata_heightxdata_width" in out
    assert "at data 2x3x21x19:" in out and "at data 3x3x42x38:" in out
    assert "verified: onnxruntime matches caffepar at both sizes" in out
    with pytest.raises(SystemExit) as e:
        main(["convert", "onnx", str(path), str(weights), str(tmp_path / "f.onnx"),
              "--batch", "1"])
    out, _err = capsys.readouterr()
    assert e.value.code == 0 and "inputs data 1x3x21x19" in out


def test_dummydata_refusal_says_what_it_is(tmp_path):
    net = tmp_path / "dummy.prototxt"
    net.write_text('layer { name: "d" type: "DummyData" top: "x" dummy_data_param { '
                   'shape { dim: 1 dim: 3 } } }\n'
                   'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                   'inner_product_param { num_output: 2 } }\n')
    with pytest.raises(OnnxExportError) as info:
        export_onnx(str(net), None, allow_missing=True)
    assert "dataset" not in str(info.value) and "fillers" in str(info.value)


BN_CHAIN = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 1 } } }
""" + "".join(f'layer {{ name: "bn{i}" type: "BatchNorm" bottom: "conv1" top: "conv1" '
              'batch_norm_param { eps: 1e-30 } }\n' for i in (1, 2, 3))


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_verify_names_batchnorm_layers_without_statistics(tmp_path, capsys):
    """--allow-missing left the BatchNorm statistics at their defaults (variance 0, factor 0):
    the non-finite output is put down to them, without NumPy's overflow warnings."""
    import caffepar as caffe
    plain = tmp_path / "plain.prototxt"
    plain.write_text(BN_CHAIN.split('layer { name: "bn1"')[0])
    caffe.Net(str(plain), caffe.TEST).save(str(tmp_path / "w.caffemodel"))
    (tmp_path / "bn.prototxt").write_text(BN_CHAIN)
    with pytest.raises(SystemExit) as ended:
        main(["convert", "onnx", str(tmp_path / "bn.prototxt"), str(tmp_path / "w.caffemodel"),
              str(tmp_path / "bn.onnx"), "--verify", "--allow-missing"])
    err = capsys.readouterr().err
    assert ended.value.code == 1
    assert "BatchNorm layer(s) bn1, bn2, bn3 have no statistics" in err
    assert "diverged" not in err and err.count("\n") == 1
