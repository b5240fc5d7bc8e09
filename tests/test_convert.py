"""`caffepar convert`: upgrading old files (same bytes as Caffe's tools, same outputs after),
`info`, weights between binary / HDF5 / npz / snapshots bit for bit, and loading by name with
precise errors and --allow-missing."""
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import CAFFE_REF, DATA, need_shared
from google.protobuf import text_format

from caffepar.cli import main
from caffepar.convert.info import format_info, net_info
from caffepar.convert.npz import (convert_weights, load_weights, open_weights, read_npz,
                                  save_npz)
from caffepar.convert.upgrade import detect_kind, upgrade_file
from caffepar.errors import WeightsError
from caffepar.graph.net import TEST, Net
from caffepar.io.weights import read_caffemodel
from caffepar.proto import caffe_pb2

ROOT = Path(__file__).resolve().parents[1]
UPGRADE = CAFFE_REF / "upgrade"

# (deploy prototxt, weights) of every model under shared/data/models.
MODELS = {
    "lenet": ("lenet/lenet.prototxt", "lenet/lenet_iter_10000.caffemodel"),
    "cifar10_quick": ("cifar10_quick/cifar10_quick.prototxt",
                      "cifar10_quick/cifar10_quick_iter_5000.caffemodel"),
    "cifar10_quick_hdf5": ("cifar10_quick_hdf5/cifar10_quick.prototxt",
                           "cifar10_quick_hdf5/cifar10_quick_iter_5000.caffemodel.h5"),
}


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def model_paths(key):
    base = need_shared(DATA / "models")
    proto, weights = MODELS[key]
    return base / proto, base / weights


def forward(model, weights, seed=0):
    net = Net(str(model), phase=TEST, weights=str(weights))
    rng = np.random.RandomState(seed)
    inputs = {n: rng.randn(*net.blobs[n].shape).astype(np.float32) for n in net.inputs}
    return net.forward(**inputs)


def blobs_of(model):
    return {name: [(v, tuple(s)) for v, s, _l in blobs] for name, _t, blobs in model.layers
            if blobs}


def assert_same_blobs(a, b):
    a, b = blobs_of(a), blobs_of(b)
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name])
        for (va, sa), (vb, sb) in zip(a[name], b[name]):
            assert sa == sb, name
            assert va.dtype == vb.dtype and np.array_equal(va, vb), name


# ---------------------------------------------------------------------------- upgrade
def test_v1_caffemodel_upgrade_is_byte_identical_to_caffes_tool(tmp_path):
    src = need_shared(UPGRADE) / "v1_small.caffemodel"
    out = tmp_path / "up.caffemodel"
    result = upgrade_file(src, out)
    assert result.kind == "caffemodel" and result.changed and result.written
    assert "V1LayerParameter" in result.notes[0]
    assert out.read_bytes() == (UPGRADE / "v1_small_upgraded.caffemodel").read_bytes()


@pytest.mark.parametrize("stem", ["v1_small", "v1_train"])
def test_v1_prototxt_upgrade_matches_caffe(stem, tmp_path):
    src = need_shared(UPGRADE) / f"{stem}.prototxt"
    out = tmp_path / "up.prototxt"
    result = upgrade_file(src, out)
    assert result.kind == "net" and result.changed
    mine = text_format.Merge(out.read_text(), caffe_pb2.NetParameter())
    golden = text_format.Merge((UPGRADE / f"{stem}_upgraded.prototxt").read_text(),
                               caffe_pb2.NetParameter())
    assert mine == golden


def test_solver_upgrade_matches_caffe(tmp_path):
    src = need_shared(UPGRADE) / "old_solver.prototxt"
    out = tmp_path / "solver.prototxt"
    result = upgrade_file(src, out)
    assert result.kind == "solver" and result.changed
    mine = text_format.Merge(out.read_text(), caffe_pb2.SolverParameter())
    golden = text_format.Merge((UPGRADE / "old_solver_upgraded.prototxt").read_text(),
                               caffe_pb2.SolverParameter())
    assert mine == golden


def test_v1_upgrade_then_load_gives_caffes_output(tmp_path):
    base = need_shared(UPGRADE)
    upgrade_file(base / "v1_small.prototxt", tmp_path / "net.prototxt")
    upgrade_file(base / "v1_small.caffemodel", tmp_path / "w.caffemodel")
    x = np.load(base / "forward_input.npy")
    expected = np.load(base / "forward_prob.npz")["prob"]
    for model, weights in ((base / "v1_small.prototxt", base / "v1_small.caffemodel"),
                           (tmp_path / "net.prototxt", tmp_path / "w.caffemodel"),
                           (tmp_path / "net.prototxt", base / "v1_small.caffemodel")):
        net = Net(str(model), phase=TEST, weights=str(weights))
        prob = net.forward(data=x)["prob"]
        np.testing.assert_allclose(prob, expected, rtol=1e-5, atol=1e-6)
    # Weights are carried bit for bit (legacy 4-D shapes included).
    assert_same_blobs(read_caffemodel(base / "v1_small.caffemodel"),
                      read_caffemodel(tmp_path / "w.caffemodel"))


@pytest.mark.parametrize("key", sorted(MODELS))
def test_every_shared_model_upgrades_and_gives_the_same_outputs(key, tmp_path):
    model, weights = model_paths(key)
    before = forward(model, weights)
    up_model = tmp_path / "net.prototxt"
    up_weights = tmp_path / ("w" + "".join(weights.suffixes))
    result = upgrade_file(model, up_model)
    assert result.written
    upgrade_file(weights, up_weights) if detect_kind(weights) != "hdf5" else \
        up_weights.write_bytes(weights.read_bytes())
    after = forward(up_model, up_weights)
    assert before.keys() == after.keys()
    for name in before:
        assert np.array_equal(before[name], after[name])


def test_current_files_are_copied_unchanged(tmp_path):
    model, weights = model_paths("lenet")
    result = upgrade_file(weights, tmp_path / "w.caffemodel")
    assert not result.changed and result.notes == []
    assert (tmp_path / "w.caffemodel").read_bytes() == weights.read_bytes()
    result = upgrade_file(model, tmp_path / "m.prototxt")
    assert not result.changed
    assert (tmp_path / "m.prototxt").read_text() == model.read_text()


def test_hdf5_has_nothing_to_upgrade():
    _model, weights = model_paths("cifar10_quick_hdf5")
    result = upgrade_file(weights, check=True)
    assert result.kind == "hdf5" and not result.changed


def test_upgrade_check_writes_nothing(tmp_path, capsys):
    src = need_shared(UPGRADE) / "v1_small.caffemodel"
    out = tmp_path / "never.caffemodel"
    code, stdout, err = run(["convert", "upgrade", str(src), str(out), "--check"], capsys)
    assert code == 0, err
    assert "V1LayerParameter" in stdout and not out.exists()
    code, stdout, err = run(["convert", "upgrade", str(UPGRADE / "v1_small_upgraded.prototxt"),
                             "--check"], capsys)
    assert code == 0 and "already in the current format" in stdout


def test_upgrade_cli_writes(tmp_path, capsys):
    src = need_shared(UPGRADE) / "v1_small.prototxt"
    out = tmp_path / "up.prototxt"
    code, stdout, err = run(["convert", "upgrade", str(src), str(out)], capsys)
    assert code == 0, err
    assert "Input layer" in stdout and out.exists()


def test_upgrade_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.prototxt"
    bad.write_text('layer { name: "a" type: "ReLU" bottom: "x" top: "x" }\nlayers { name: "b" }\n')
    code, _out, err = run(["convert", "upgrade", str(bad), str(tmp_path / "o")], capsys)
    assert code == 1 and err.count("\n") == 1 and "mixes" in err
    truncated = tmp_path / "t.caffemodel"
    truncated.write_bytes(need_shared(UPGRADE / "v1_small.caffemodel").read_bytes()[:-7])
    code, _out, err = run(["convert", "upgrade", str(truncated), str(tmp_path / "o")], capsys)
    assert code == 1 and "truncated" in err and err.count("\n") == 1


def test_big_v1_caffemodel_upgrades_without_protobuf_parsing_blobs(tmp_path):
    """A V1 model with a 64 MB blob (past protobuf's old default limit) upgrades in seconds
    and keeps the blob, legacy 4-D shape included, bit for bit."""
    from caffepar.io.weights import _encode_varint, _key
    w = np.random.RandomState(0).randn(4000, 4000).astype(np.float32)
    layer = caffe_pb2.V1LayerParameter(name="ip", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT,
                                       bottom=["data"], top=["ip"], blobs_lr=[1, 2])
    layer.inner_product_param.num_output = 4000
    header = caffe_pb2.BlobProto(num=1, channels=1, height=4000, width=4000).SerializeToString()
    payload = w.tobytes()
    blob = header + _key(5, 2) + _encode_varint(len(payload)) + payload
    body = layer.SerializeToString() + _key(6, 2) + _encode_varint(len(blob)) + blob
    net = caffe_pb2.NetParameter(name="big").SerializeToString()
    src = tmp_path / "v1.caffemodel"
    src.write_bytes(net + _key(2, 2) + _encode_varint(len(body)) + body)
    t0 = time.perf_counter()
    result = upgrade_file(src, tmp_path / "up.caffemodel")
    assert result.changed and time.perf_counter() - t0 < 10
    up = read_caffemodel(tmp_path / "up.caffemodel")
    assert up.layers[0][:2] == ("ip", "InnerProduct")
    values, shape, legacy = up.layers[0][2][0]
    assert shape == legacy == (1, 1, 4000, 4000) and np.array_equal(values, w.reshape(-1))
    assert up.net_param.layer[0].param[1].lr_mult == 2


# ---------------------------------------------------------------------------- info
def test_info_lenet_with_weights():
    model, weights = model_paths("lenet")
    info = net_info(model, weights)
    by_name = {lay.name: lay for lay in info.layers}
    assert by_name["conv1"].top_shapes == [(64, 20, 24, 24)]
    assert by_name["conv1"].params == 20 * 25 + 20
    # 2 * outputs * (channels * kernel) + bias adds
    assert by_name["conv1"].flops == 2 * 64 * 20 * 24 * 24 * 25 + 64 * 20 * 24 * 24
    assert by_name["ip1"].flops == 2 * 64 * 800 * 500 + 64 * 500
    assert info.params == 431080 and info.param_bytes == 431080 * 4
    assert info.missing == [] and info.unused == [] and info.mismatched == []
    assert sorted(info.matched) == ["conv1", "conv2", "ip1", "ip2"]
    assert {p.name: p.mode for p in info.plan} == dict.fromkeys(info.matched, "DATA")
    text = format_info(info)
    assert "431,080 parameters" in text and "4 layer(s) match" in text


def test_info_reports_missing_unused_and_mismatched(tmp_path):
    model, weights = model_paths("lenet")
    info = net_info(ROOT / "models/alexnet/deploy.prototxt", weights)
    assert info.missing == ["conv3", "conv4", "conv5", "fc6", "fc7", "fc8"]
    assert info.unused == ["ip1", "ip2"]
    assert 'layer "conv1" param 0: the file has 20 1 5 5 (500), the net expects 96 3 11 11 ' \
           "(34848)" in info.mismatched
    plan = {p.name: p.mode for p in info.plan}
    assert plan["fc6"] == "MODEL" and plan["conv1"] == "DATA"


def test_info_reads_v1_prototxt_and_cli(capsys):
    src = need_shared(UPGRADE) / "v1_small.prototxt"
    code, out, err = run(["convert", "info", str(src), str(UPGRADE / "v1_small.caffemodel")],
                         capsys)
    assert code == 0, err
    assert "conv1" in out and "2x4x8x8" in out and "2 layer(s) match" in out


# ---------------------------------------------------------------------------- npz, HDF5
@pytest.mark.parametrize("key", sorted(MODELS) + ["v1_small"])
def test_npz_and_hdf5_round_trips_are_bit_exact(key, tmp_path):
    if key == "v1_small":
        weights = need_shared(UPGRADE) / "v1_small.caffemodel"
    else:
        _model, weights = model_paths(key)
    original = open_weights(weights)
    for chain in (["a.npz", "b.caffemodel"], ["a.h5", "b.caffemodel", "c.h5"],
                  ["a.caffemodel", "b.npz", "c.h5", "d.npz"]):
        src = weights
        for name in chain:
            convert_weights(src, tmp_path / name)
            assert_same_blobs(original, open_weights(tmp_path / name))
            src = tmp_path / name


def test_npz_to_caffemodel_with_prototxt_loads_in_caffepar(tmp_path, capsys):
    model, weights = model_paths("cifar10_quick")
    npz = tmp_path / "w.npz"
    code, out, err = run(["convert", "npz", str(weights), str(npz)], capsys)
    assert code == 0, err and "8 arrays" in out
    assert set(np.load(npz).files) >= {"conv1/0", "conv1/1", "ip2/1"}
    out_model = tmp_path / "back.caffemodel"
    code, out, err = run(["convert", "caffemodel", str(npz), str(model), str(out_model)], capsys)
    assert code == 0, err
    assert_same_blobs(read_caffemodel(weights), read_caffemodel(out_model))
    before, after = forward(model, weights), forward(model, out_model)
    assert np.array_equal(before["prob"], after["prob"])
    # The written file carries the net's layer definitions, as a Caffe snapshot does.
    types = [t for _n, t, _b in read_caffemodel(out_model).layers]
    assert "Convolution" in types and "Pooling" in types


def test_snapshot_to_weights_only(tmp_path, capsys):
    base = need_shared(DATA / "models")
    state = base / "lenet/lenet_iter_10000.solverstate"
    out = tmp_path / "w.h5"
    code, _out, err = run(["convert", "weights", str(state), str(out)], capsys)
    assert code == 0, err
    assert_same_blobs(read_caffemodel(base / "lenet/lenet_iter_10000.caffemodel"),
                      read_caffemodel(out))
    h5_state = base / "cifar10_quick_hdf5/cifar10_quick_iter_5000.solverstate.h5"
    convert_weights(h5_state, tmp_path / "c.caffemodel")
    assert_same_blobs(read_caffemodel(base / "cifar10_quick_hdf5/"
                                      "cifar10_quick_iter_5000.caffemodel.h5"),
                      read_caffemodel(tmp_path / "c.caffemodel"))


# ---------------------------------------------------------------------------- loading
def test_missing_layers_refused_unless_allow_missing(tmp_path, capsys):
    model, weights = model_paths("cifar10_quick")
    full = read_caffemodel(weights)
    arrays = {f"{n}/{i}": v.reshape(s) for n, _t, b in full.layers for i, (v, s, _l) in
              enumerate(b) if n != "ip2"}
    npz = tmp_path / "partial.npz"
    np.savez(npz, **arrays, **{"extra/0": np.zeros(3, np.float32)})
    net = Net(str(model), phase=TEST)
    with pytest.raises(WeightsError, match=r"no weights for layer\(s\) ip2.*--allow-missing"):
        load_weights(net, npz)
    ip2_before = net.params["ip2"][0].data.copy()
    report = load_weights(net, npz, allow_missing=True)
    assert report.missing == ["ip2"] and report.unused == ["extra"]
    assert np.array_equal(net.params["ip2"][0].data, ip2_before)
    assert np.array_equal(net.params["conv1"][0].data, full.by_name()["conv1"][0][0].reshape(
        net.params["conv1"][0].data.shape))
    out = tmp_path / "o.caffemodel"
    code, _o, err = run(["convert", "caffemodel", str(npz), str(model), str(out)], capsys)
    assert code == 1 and "ip2" in err and err.count("\n") == 1
    code, stdout, err = run(["convert", "caffemodel", str(npz), str(model), str(out),
                             "--allow-missing"], capsys)
    assert code == 0, err
    assert "kept initial weights (not in the file): ip2" in stdout
    assert "ignored (not in the net): extra" in stdout


def test_shape_mismatch_names_layer_and_both_shapes(tmp_path, capsys):
    model, weights = model_paths("cifar10_quick")
    arrays = {f"{n}/{i}": v.reshape(s) for n, _t, b in read_caffemodel(weights).layers
              for i, (v, s, _l) in enumerate(b)}
    arrays["conv2/0"] = np.zeros((32, 16, 5, 5), np.float32)
    npz = tmp_path / "bad.npz"
    np.savez(npz, **arrays)
    code, _o, err = run(["convert", "caffemodel", str(npz), str(model),
                         str(tmp_path / "o.caffemodel")], capsys)
    assert code == 1 and err.count("\n") == 1
    assert 'layer "conv2" param 0: shape mismatch, the caffemodel has 32 16 5 5 (12800), ' \
           "the net expects 32 32 5 5 (25600)" in err


def test_bad_npz_keys_are_refused(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, weights=np.zeros(3))
    with pytest.raises(WeightsError, match="<layer>/<blob index>"):
        read_npz(bad)
    gap = tmp_path / "gap.npz"
    np.savez(gap, **{"a/0": np.zeros(1), "a/2": np.zeros(1)})
    with pytest.raises(WeightsError, match="indices"):
        read_npz(gap)


def test_layer_names_with_slashes_survive_npz(tmp_path):
    from caffepar.io.weights import CaffeModel
    model = CaffeModel(None, [("inception_3a/1x1", "Convolution",
                               [(np.arange(6, dtype=np.float32), (2, 3), None)])])
    save_npz(model, tmp_path / "s.npz")
    back = read_npz(tmp_path / "s.npz")
    assert back.layers[0][0] == "inception_3a/1x1"
    assert_same_blobs(model, back)


def test_vgg16_sized_caffemodel_info_and_load_take_seconds(tmp_path):
    """553 MB of random VGG-16 weights: `info` compares them and loading copies them fast."""
    deploy = ROOT / "models/vgg16/deploy.prototxt"
    net = Net(str(deploy), phase=TEST)
    path = tmp_path / "vgg16.caffemodel"
    net.save(str(path))
    assert path.stat().st_size > 550e6
    fc6 = net.params["fc6"][0].data.copy()
    net.params["fc6"][0].data[...] = 0
    t0 = time.perf_counter()
    report = load_weights(net, path)
    load_s = time.perf_counter() - t0
    assert np.array_equal(net.params["fc6"][0].data, fc6) and not report.missing
    t0 = time.perf_counter()
    info = net_info(net, path)
    info_s = time.perf_counter() - t0
    assert len(info.matched) == 16 and info.params == 138357544
    assert load_s < 30 and info_s < 30, (load_s, info_s)
