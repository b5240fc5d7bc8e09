"""The onnxruntime engine of TEST forwards (CAFFEPAR_INFERENCE=onnxruntime): onnxruntime runs
the forward, and every blob a user can read still holds what the layer-by-layer forward
computes: outputs and blobs read before come from onnxruntime, the others are computed when
first read, edited weights and inputs are seen, and a session that disagrees is dropped."""
import numpy as np
import pytest

from caffepar.graph import onnx_forward
from caffepar.graph.net import TEST, Net
from caffepar.graph.plan import InferencePlan
from caffepar.graph.tolerance import carried_allowances, own_allowance
from test_inference import (P, assert_same_blobs, bn_scale_act, conv, inp, inverted_residual,
                            layer, randomize, ssd_net)

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


def mobilenet_text():
    text = inp(1, 3, 16, 16) + conv("conv1", "data", "conv1", 8, 3, 2, 1, bias=False) + \
        bn_scale_act("conv1", "conv1", "ReLU6")
    blob = "conv1"
    for k, (c_in, c_out, stride, dw) in enumerate([(8, 8, 1, "Convolution"),
                                                  (8, 12, 2, "ConvolutionDepthwise")]):
        block, blob = inverted_residual(f"b{k}", blob, c_in, 3, c_out, stride, dw)
        text += block
    text += layer("pool", "Pooling", blob, "pool",
                  "pooling_param { pool: AVE global_pooling: true }")
    return text + conv("fc", "pool", "fc", 10, 1) + layer("prob", "Softmax", "fc", "prob")


def inception_text():
    """GoogLeNet's pieces: the LRN and the MAX poolings onnxruntime gets written for speed
    (one of them with padding and a last window Caffe clips), a Concat, a TEST Dropout."""
    text = inp(1, 6, 11, 11) + conv("c1", "data", "c1", 4) + layer("r1", "ReLU", "c1", "c1")
    text += conv("c3", "data", "c3", 5, 3, p=1) + layer("r3", "ReLU", "c3", "c3")
    text += layer("pool", "Pooling", "data", "pool",
                  "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    text += conv("cp", "pool", "cp", 2) + layer("rp", "ReLU", "cp", "cp")
    text += layer("cat", "Concat", ["c1", "c3", "cp"], "cat")
    text += layer("norm", "LRN", "cat", "norm", "lrn_param { local_size: 5 alpha: 0.1 "
                  "beta: 0.75 k: 2 }")
    text += layer("mp", "Pooling", "norm", "mp", "pooling_param { pool: MAX kernel_size: 2 "
                  "stride: 2 pad: 1 }")
    text += layer("mp2", "Pooling", "mp", "mp2", "pooling_param { pool: MAX kernel_size: 3 "
                  "stride: 2 }")
    text += layer("drop", "Dropout", "mp2", "mp2", "dropout_param { dropout_ratio: 0.4 }")
    text += layer("fc", "InnerProduct", "mp2", "fc", "inner_product_param { num_output: 5 }")
    return text + layer("prob", "Softmax", "fc", "prob")


def resnet_text():
    text = inp(2, 8, 8, 8) + conv("r/a", "data", "a", 4, bias=False) + bn_scale_act("a", "a")
    text += conv("r/b", "a", "b", 4, 3, p=1, bias=False) + bn_scale_act("b", "b")
    text += conv("r/c", "b", "c", 8, bias=False) + bn_scale_act("c", "c", None)
    text += layer("sum", "Eltwise", ["data", "c"], "sum") + layer("relu", "ReLU", "sum", "sum")
    return text + layer("fc", "InnerProduct", "sum", "fc", "inner_product_param { num_output: 6 }")


NETS = {"mobilenet_v2": mobilenet_text, "inception": inception_text, "resnet": resnet_text,
        "ssd": ssd_net}


class Counts:
    """How often onnxruntime and the net's own plan ran a forward."""

    def __init__(self, monkeypatch):
        self.ort = self.own = 0
        run, forward = onnx_forward._Session.run, InferencePlan.forward

        def counted_run(session, *args):
            self.ort += 1
            return run(session, *args)

        def counted_forward(plan):
            self.own += 1
            return forward(plan)
        monkeypatch.setattr(onnx_forward._Session, "run", counted_run)
        monkeypatch.setattr(InferencePlan, "forward", counted_forward)

    def reset(self):
        self.ort = self.own = 0


def twins(text, tmp_path, monkeypatch, seed=0):
    """(a net on the onnxruntime engine, its twin run layer by layer), the same weights (read
    from a file, so that no parameter of the engine's net has been touched)."""
    ref = randomize(Net(P(text), phase=TEST), seed)
    weights = tmp_path / "w.caffemodel"
    ref.save(str(weights))
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "onnxruntime")
    net = Net(P(text), phase=TEST, weights=str(weights))
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "on")
    assert net._onnx is not None and ref._onnx is None
    for name in net.inputs:
        net.blobs[name].data[...] = ref.blobs[name].data
    return net, ref


def reference(ref, **inputs):
    for name, value in inputs.items():
        ref.blobs[name].data[...] = value
    with ref.unfused():
        ref.forward()


@pytest.mark.parametrize("name", sorted(NETS))
def test_every_blob_holds_what_the_layer_by_layer_forward_computes(name, tmp_path, monkeypatch):
    net, ref = twins(NETS[name](), tmp_path, monkeypatch)
    counts = Counts(monkeypatch)
    reference(ref)
    net.forward()                   # the session's first forward: checked against the own
    assert net._onnx.failed is None and counts.ort == 1 and counts.own == 1
    assert net._onnx.tail is None   # onnxruntime's DetectionOutput agrees on the SSD head
    counts.reset()
    out = net.forward()
    assert (counts.ort, counts.own) == (1, 0)       # onnxruntime alone
    assert not net._onnx.exposed
    for o in net.outputs:
        scale = float(np.abs(ref.blobs[o].data).max())
        np.testing.assert_allclose(out[o], ref.blobs[o].data, rtol=1e-4, atol=1e-5 * scale)
    assert counts.own == 0
    assert_same_blobs(net, ref)     # the first other blob read runs the own forward, once
    assert (counts.ort, counts.own) == (1, 1)
    # Every blob has been read: from now on all are onnxruntime's outputs, and each must be
    # Caffe's (the LRN and poolings as written for speed included).
    rng = np.random.default_rng(3)
    x = {n: rng.standard_normal(net.blobs[n].shape).astype(np.float32) for n in net.inputs}
    for n, v in x.items():
        net.blobs[n].data[...] = v
    counts.reset()
    net.forward()                   # a new session (more outputs): checked once
    net.forward()
    assert net._onnx.failed is None and counts.ort == 2 and counts.own == 1
    reference(ref, **x)
    assert_same_blobs(net, ref)
    assert counts.own == 1


def test_detections_from_caffepar_where_onnxruntime_settles_ties_otherwise(tmp_path,
                                                                          monkeypatch):
    """An SSD whose onnxruntime DetectionOutput disagrees with Caffe's (tied scores): the
    DetectionOutput and what follows run in caffepar's own plan on the blobs onnxruntime hands
    over; every blob is still the layer-by-layer forward's."""
    net, ref = twins(ssd_net(), tmp_path, monkeypatch)
    run = onnx_forward._Session.run

    def ties_otherwise(session, names, feeds):
        return [r[..., ::-1].copy() if n == "det" else r
                for n, r in zip(names, run(session, names, feeds))]
    monkeypatch.setattr(onnx_forward._Session, "run", ties_otherwise)
    counts = Counts(monkeypatch)
    reference(ref)
    net.forward()                   # disagrees: the next session stops before the tail
    assert net._onnx.tail == net.layer_index("det") and net._onnx.failed is None
    net.forward()                   # checked
    counts.reset()
    out = net.forward()
    assert (counts.ort, counts.own) == (1, 1)       # the tail's own plan
    np.testing.assert_allclose(out["det"], ref.blobs["det"].data, rtol=1e-4, atol=1e-6)
    assert counts.own == 1
    assert_same_blobs(net, ref)
    assert net._onnx.failed is None


def test_held_blobs_arrays_and_inputs_changed_after_a_forward(tmp_path, monkeypatch):
    net, ref = twins(mobilenet_text(), tmp_path, monkeypatch)
    rng = np.random.default_rng(5)
    first, second = (rng.standard_normal(net.blobs["data"].shape).astype(np.float32)
                     for _ in range(2))
    held = net.blobs["b0/dwise"]                    # a Blob held across forwards
    array = net.blobs["conv1"].data                 # an array held across forwards
    for x in (first, second):
        net.blobs["data"].data[...] = x
        net.forward()
        net.forward()
        reference(ref, data=x)
        np.testing.assert_allclose(held.data, ref.blobs["b0/dwise"].data, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(array, ref.blobs["conv1"].data, rtol=1e-4, atol=1e-5)
    assert net.blobs["conv1"].data is array
    # Only the blobs read became outputs of onnxruntime's sessions.
    assert {net.blob_names[i] for i in net._onnx.observed} == {"conv1", "b0/dwise"}
    # The input changed after the forward: an unread blob still gets that forward's values,
    # and the input keeps what the user wrote.
    net.blobs["data"].data[...] = first
    net.forward()
    net.blobs["data"].data[...] = second
    reference(ref, data=first)
    np.testing.assert_allclose(net.blobs["b1/expand"].data, ref.blobs["b1/expand"].data,
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(net.blobs["data"].data, second)


def test_edited_weights_make_a_new_session(tmp_path, monkeypatch):
    net, ref = twins(mobilenet_text(), tmp_path, monkeypatch)
    net.forward()
    weights = net.params["b0/expand"][0].data       # read from outside: compared from now on
    assert net._onnx.exposed
    for edit in (2.0, 0.5):
        weights *= edit
        ref.params["b0/expand"][0].data[...] *= edit
        net.forward()
        reference(ref)
        np.testing.assert_allclose(net.blobs["prob"].data, ref.blobs["prob"].data,
                                   rtol=1e-4, atol=1e-6)
    # copy_from writes through the blobs as well.
    ref.params["conv1"][0].data[...] *= -1
    ref.save(str(tmp_path / "w2.caffemodel"))
    net.copy_from(str(tmp_path / "w2.caffemodel"))
    net.forward()
    reference(ref)
    assert_same_blobs(net, ref)


def test_a_session_that_disagrees_is_dropped_at_its_shapes(tmp_path, monkeypatch, caplog):
    """onnxruntime off by 1% at batch 2 only: batch 2 runs the own plan from then on (said in
    the log), batch 1 stays on onnxruntime."""
    net, ref = twins(resnet_text(), tmp_path, monkeypatch)
    run = onnx_forward._Session.run
    monkeypatch.setattr(onnx_forward._Session, "run", lambda s, names, feeds: [
        r * np.float32(1.01 if len(r) == 2 else 1.0) for r in run(s, names, feeds)])
    counts = Counts(monkeypatch)
    net.forward()
    assert "differs from the net's own forward" in net._onnx.runs_own_plan()
    assert net._onnx.failed is None
    assert "runs its own plan at input shape 2x8x8x8" in caplog.text
    reference(ref)
    assert_same_blobs(net, ref)
    counts.reset()
    net.forward()
    assert (counts.ort, counts.own) == (0, 1)
    assert_same_blobs(net, ref)
    x = np.random.default_rng(1).standard_normal((1, 8, 8, 8)).astype(np.float32)
    for n in (net, ref):
        n.blobs["data"].reshape(*x.shape)
        n.reshape()
    net.blobs["data"].data[...] = x
    net.forward()                   # checked: agrees
    counts.reset()
    net.forward()
    assert (counts.ort, counts.own) == (1, 0) and net._onnx.runs_own_plan() is None
    reference(ref, data=x)
    assert_same_blobs(net, ref)


def test_what_the_engine_does_not_run(tmp_path, monkeypatch):
    # A layer the export refuses: the net runs its own plan and says why.
    text = inp(1, 3, 8, 8) + conv("c", "data", "c", 4, 3, p=1) + \
        layer("spp", "SPP", "c", "spp", "spp_param { pyramid_height: 2 }")
    net, ref = twins(text, tmp_path, monkeypatch)
    net.forward()
    assert "SPP" in net._onnx.failed
    reference(ref)
    assert_same_blobs(net, ref)
    # Another batch: another session; partial forwards and a reshape keep the blobs right.
    net, ref = twins(inception_text(), tmp_path, monkeypatch)
    for batch in (3, 1):
        x = np.random.default_rng(batch).standard_normal((batch, 6, 11, 11)).astype(np.float32)
        for n in (net, ref):
            n.blobs["data"].reshape(*x.shape)
            n.reshape()
        net.blobs["data"].data[...] = x
        net.forward()
        net.forward()
        reference(ref, data=x)
        assert_same_blobs(net, ref)
        net.forward(start="norm")
        assert_same_blobs(net, ref)
    assert net._onnx.failed is None and len(net._onnx.sessions) >= 2
    # Parameters shared with another net (a solver's test net): the own plan.
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "onnxruntime")
    shared = Net(P(inception_text()), phase=TEST)
    shared.share_with(ref)
    shared.forward()
    assert "shared with another net" in shared._onnx.failed


@pytest.mark.parametrize("off, kept", [(0.9, True), (1.5, False)])
def test_a_sigmoid_of_large_logits_is_held_to_what_their_rounding_allows(
        off, kept, tmp_path, monkeypatch):
    """An SSD's class sigmoids over logits of scale ~46: onnxruntime's differ from the own
    forward's by what the logits' float32 rounding carries through the sigmoid -- kept -- or
    by more -- refused (graph/tolerance.py)."""
    text = inp(1, 32) + layer("fc", "InnerProduct", "data", "fc",
                              "inner_product_param { num_output: 48 }") + \
        layer("sig", "Sigmoid", "fc", "sig") + layer("flat", "Flatten", "sig", "flat")
    ref = randomize(Net(P(text), phase=TEST), 0)
    reference(ref)
    for p in ref.params["fc"]:
        p.data[...] *= 46 / np.abs(ref.blobs["fc"].data).max()
    ref.save(str(tmp_path / "w.caffemodel"))
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "onnxruntime")
    net = Net(P(text), phase=TEST, weights=str(tmp_path / "w.caffemodel"))
    monkeypatch.setenv("CAFFEPAR_INFERENCE", "on")
    net.blobs["data"].data[...] = ref.blobs["data"].data
    reference(ref)
    want = ref.blobs["flat"].data.copy()
    logits = ref.blobs["fc"].data
    assert 45 < np.abs(logits).max() < 47
    allowed = own_allowance(want) + carried_allowances(ref, lambda n: ref.blobs[n].data)["flat"]
    assert np.any(off * allowed > own_allowance(want))     # beyond the blob's own rounding
    signs = np.where(np.arange(want.size) % 2, 1, -1).reshape(want.shape)
    monkeypatch.setattr(onnx_forward._Session, "run", lambda s, names, feeds: [
        (want + off * allowed * signs).astype(np.float32)])
    net.forward()
    assert (net._onnx.runs_own_plan() is None) == kept
    np.testing.assert_array_equal(net.blobs["flat"].data, want)     # the first: the own values
