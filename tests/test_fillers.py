"""Fillers against BVLC Caffe's: Caffe draws from its own RNG, so random fillers are compared by
distribution (two-sample KS test against Caffe's draw, plus the statistics Caffe recorded over 8
seeds); deterministic fillers (constant, bilinear) must match exactly."""
import json

import numpy as np
import pytest
from scipy import stats

import caffepar as caffe
from conftest import CAFFE_REF

FILLERS = CAFFE_REF / "fillers"
CASES = sorted(p.stem for p in (FILLERS / "protos").glob("*.prototxt")) if FILLERS.exists() else []


@pytest.mark.skipif(not CASES, reason="caffe_ref/fillers not available beside the repository")
@pytest.mark.parametrize("case", CASES)
def test_filler_matches_caffe_distribution(case):
    caffe.set_random_seed(1701)
    net = caffe.Net(str(FILLERS / "protos" / f"{case}.prototxt"), caffe.TEST)
    ours = net.params["l"][0].data
    theirs = np.load(FILLERS / "samples_seed1701.npz")[case]
    assert ours.shape == theirs.shape
    summary = json.loads((FILLERS / "filler_stats.json").read_text())["results"][case]
    want = summary["mean_over_seeds"]
    if case.startswith(("constant", "bilinear")):
        np.testing.assert_array_equal(ours, theirs)
        return
    ks = stats.ks_2samp(ours.ravel(), theirs.ravel())
    assert ks.pvalue > 1e-3, f"{case}: KS p={ks.pvalue:.2g} (distribution differs from Caffe's)"
    assert abs(np.mean(ours != 0) - want["frac_nonzero"]) < 0.05
    assert ours.min() >= want["min"] - 4 * want["std"] and ours.max() <= want["max"] + 4 * want["std"]
    assert np.isclose(ours.std(), want["std"], rtol=0.1)
    if case.startswith("positive_unitball"):
        np.testing.assert_allclose(ours.reshape(ours.shape[0], -1).sum(axis=1), 1.0, rtol=1e-5)
    if case.startswith(("uniform", "xavier")):
        assert ours.min() >= theirs.min() - 1e-3 * abs(theirs.min()) - 1e-6
        assert ours.max() <= theirs.max() + 1e-3 * abs(theirs.max()) + 1e-6


def test_same_seed_same_weights():
    proto = next((FILLERS / "protos").glob("gaussian*ip*"), None) if FILLERS.exists() else None
    if proto is None:
        pytest.skip("caffe_ref/fillers not available beside the repository")
    draws = []
    for seed in (5, 5, 6):
        caffe.set_random_seed(seed)
        draws.append(caffe.Net(str(proto), caffe.TEST).params["l"][0].data.copy())
    assert np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])


@pytest.mark.parametrize("shape", [(3, 1000), (16, 3, 227, 227), (1 << 20,)])
def test_big_normal_draws_depend_on_seed_and_shape_only(shape, monkeypatch):
    """Big blobs are drawn in pieces side by side: the same values on any thread count, still
    standard normal, pieces not repeating one another."""
    from caffepar import fillers
    from caffepar.nn import blas
    from caffepar.proto import caffe_pb2
    param = caffe_pb2.FillerParameter(type="gaussian", mean=0.5, std=2.0)
    draws = []
    for threads in (1, 2):
        monkeypatch.setattr(blas, "blas_threads", lambda: threads)
        caffe.set_random_seed(7)
        draws.append(fillers.fill(param, shape))
    assert draws[0].shape == shape and np.array_equal(draws[0], draws[1])
    flat = draws[0].reshape(-1)
    tolerance = 10.0 / np.sqrt(flat.size)
    assert abs(flat.mean() - 0.5) < tolerance and abs(flat.std() - 2.0) < tolerance
    piece = fillers.NORMAL_PIECE
    if flat.size >= 2 * piece:
        assert not np.array_equal(flat[:1000], flat[piece:piece + 1000])
        assert stats.kstest((flat - 0.5) / 2.0, "norm").pvalue > 1e-3
