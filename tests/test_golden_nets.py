"""Whole nets (cifar10_quick, and AlexNet / VGG-16 where their data is present) against BVLC
Caffe: forward outputs, then every blob's data and diff and every parameter gradient after one
backward from the loss, at the stored sample indices (and in full where Caffe stored them)."""
import json

import numpy as np
import pytest

import caffepar as caffe
from conftest import CAFFE_REF

pytestmark = pytest.mark.usefixtures("kernel_path")

NET_DIR = CAFFE_REF / "nets"
CASES = sorted(p.name for p in NET_DIR.iterdir() if (p / "net.prototxt").exists()) \
    if NET_DIR.exists() else []
RTOL, ATOL = 1e-4, 1e-5


def recipe_weights(case_dir):
    """Regenerate the weights from the recipe Caffe's run used (RandomState per blob)."""
    recipe = json.loads((case_dir / "weights_recipe.json").read_text())
    out = {}
    for b in recipe["blobs"]:
        w = (np.random.RandomState(b["seed"]).standard_normal(b["shape"]) * b["std"])
        w = w.astype(np.float32)
        assert np.isclose(w.astype(np.float64).sum(), b["sum"], rtol=1e-6, atol=1e-6)
        out[(b["layer"], b["index"])] = w
    return out


def _scaled_atol(want):
    # Deep nets' diffs span many orders of magnitude; judge each sample against its blob's scale.
    return max(ATOL, 1e-4 * float(np.max(np.abs(want))) if want.size else ATOL)


@pytest.mark.skipif(not CASES, reason="caffe_ref/nets not available beside the repository")
@pytest.mark.parametrize("case", CASES)
def test_net_case(case):
    d = NET_DIR / case
    net = caffe.Net(str(d / "net.prototxt"), caffe.TEST)
    for (layer, idx), w in recipe_weights(d).items():
        net.params[layer][idx].data[...] = w
    inputs = dict(np.load(d / "inputs.npz"))
    net.forward(**inputs)
    outputs = dict(np.load(d / "outputs.npz"))
    last_ip = [l.name for l in net.layers if l.type == "InnerProduct"][-1]
    np.testing.assert_allclose(net.blobs[net.top_names[last_ip][0]].data, outputs["logits"],
                               rtol=RTOL, atol=1e-4, err_msg="logits")
    np.testing.assert_allclose(net.blobs["prob"].data, outputs["prob"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(net.blobs["loss"].data, outputs["loss"], rtol=RTOL, atol=ATOL)
    net.backward()
    samples = np.load(d / "samples.npz")
    checked = 0
    for key in samples.files:
        if not key.endswith("/idx"):
            continue
        base = key[:-4]
        parts = base.split("/")
        if parts[0] == "blob":
            name, which = "/".join(parts[1:-1]), parts[-1]
            if name not in net.blobs:
                continue
            arr = getattr(net.blobs[name], which)
        else:
            layer, i = parts[1], int(parts[2])
            arr = net.params[layer][i].diff
        want = samples[base + "/val"]
        got = arr.reshape(-1)[samples[key]]
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=_scaled_atol(want), err_msg=base)
        checked += 1
    assert checked > 0
    for fname, which in (("blobs.npz", "data"), ("blob_diffs.npz", "diff")):
        if (d / fname).exists():
            for name, want in np.load(d / fname).items():
                if name in net.blobs:
                    np.testing.assert_allclose(getattr(net.blobs[name], which), want, rtol=1e-3,
                                               atol=_scaled_atol(want), err_msg=f"{name} {which}")
    if (d / "param_diffs.npz").exists():
        for key, want in np.load(d / "param_diffs.npz").items():
            layer, i = key.rsplit("/", 1)
            np.testing.assert_allclose(net.params[layer][int(i)].diff, want, rtol=1e-3,
                                       atol=_scaled_atol(want), err_msg=key)
