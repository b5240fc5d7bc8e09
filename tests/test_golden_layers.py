"""Every single-layer case BVLC Caffe recorded in caffe_ref/layers, run through the pycaffe API:
forward outputs, bottom diffs and parameter diffs must match at rtol 1e-4, atol 1e-5."""
import json

import numpy as np
import pytest

import caffepar as caffe
from conftest import CAFFE_REF

pytestmark = pytest.mark.usefixtures("kernel_path")

LAYER_DIR = CAFFE_REF / "layers"
CASES = sorted(json.loads((LAYER_DIR / "index.json").read_text())["cases"]) \
    if (LAYER_DIR / "index.json").exists() else []
RTOL, ATOL = 1e-4, 1e-5


def _load(path):
    return dict(np.load(path)) if path.exists() else {}


def _close(what, got, want):
    got = np.asarray(got)
    assert got.shape == want.shape or got.size == want.size == 1, \
        f"{what}: shape {got.shape}, Caffe {want.shape}"
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=RTOL, atol=ATOL, err_msg=what)


@pytest.mark.skipif(not CASES, reason="caffe_ref/layers not available beside the repository")
@pytest.mark.parametrize("case", CASES)
def test_layer_case(case, monkeypatch):
    d = LAYER_DIR / case
    meta = json.loads((d / "meta.json").read_text())
    monkeypatch.chdir(d)
    phase = caffe.TRAIN if meta["phase"] == "TRAIN" else caffe.TEST
    net = caffe.Net(str(d / "net.prototxt"), phase)
    params = _load(d / "params.npz")
    for key, value in params.items():
        layer, idx = key.rsplit("/", 1)
        net.params[layer][int(idx)].data[...] = value
    inputs = _load(d / "inputs.npz")
    for name, value in inputs.items():
        net.blobs[name].data[...] = value
    net.forward()
    for name, want in _load(d / "outputs.npz").items():
        _close(f"{case}: forward {name}", net.blobs[name].data, want)
    for key, want in _load(d / "params_after.npz").items():
        layer, idx = key.rsplit("/", 1)
        _close(f"{case}: {key} after forward", net.params[layer][int(idx)].data, want)
    top_diffs = _load(d / "top_diffs.npz")
    if not top_diffs:
        return
    for blob in net.blobs.values():
        blob.diff[...] = 0
    for blobs in net.params.values():
        for b in blobs:
            b.diff[...] = 0
    for name, value in top_diffs.items():
        net.blobs[name].diff[...] = value
    net.backward()
    for name, want in _load(d / "bottom_diffs.npz").items():
        _close(f"{case}: bottom diff {name}", net.blobs[name].diff, want)
    for key, want in _load(d / "param_diffs.npz").items():
        layer, idx = key.rsplit("/", 1)
        _close(f"{case}: param diff {key}", net.params[layer][int(idx)].diff, want)


MAX_POOL_CASES = [c for c in CASES if c.startswith("pool_max")]


@pytest.mark.skipif(not MAX_POOL_CASES,
                    reason="caffe_ref/layers not available beside the repository")
@pytest.mark.parametrize("case", MAX_POOL_CASES)
def test_max_pooling_bottom_diff_bit_for_bit(case, monkeypatch):
    """MAX pooling's backward adds the same numbers in the same order as Caffe's: its bottom
    diff equals Caffe's bit for bit (the sign of zero included)."""
    d = LAYER_DIR / case
    monkeypatch.chdir(d)
    net = caffe.Net(str(d / "net.prototxt"), caffe.TEST)
    for name, value in _load(d / "inputs.npz").items():
        net.blobs[name].data[...] = value
    net.forward()
    for name, value in _load(d / "top_diffs.npz").items():
        net.blobs[name].diff[...] = value
    net.backward()
    for name, want in _load(d / "bottom_diffs.npz").items():
        got = net.blobs[name].diff
        assert got.dtype == want.dtype == np.float32
        differ = got.view(np.uint32) != want.view(np.uint32)
        assert not differ.any(), f"{case}: {differ.sum()} of {got.size} cells differ from Caffe"
