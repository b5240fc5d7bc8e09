"""Solvers: learning-rate policies and update rules against float64 transcriptions of Caffe's
formulas, the training loop's semantics on a tiny net, and 30-iteration trajectories of every
solver type against real BVLC Caffe (loss per iteration, weights after every update, history)."""
import logging
import math
import os

import numpy as np
import pytest

import caffepar as caffe
from caffepar.errors import SolverError
from caffepar.proto import caffe_pb2
from caffepar.solvers import get_solver, learning_rate, load_solver_param, rules, solver as solver_mod
from conftest import CAFFE_REF, need_shared

pytestmark = pytest.mark.usefixtures("kernel_path")

SOLVERS_DIR = CAFFE_REF / "solvers"
GOLDEN_RUNS = ["sgd_fixed", "sgd_nomomentum_nodecay", "sgd_step", "sgd_multistep_lrmult",
               "nesterov_inv", "adagrad_poly", "rmsprop_sigmoid", "adadelta_fixed", "adam_fixed"]


def solver_param(**fields):
    p = caffe_pb2.SolverParameter()
    for k, v in fields.items():
        if isinstance(v, (list, tuple)):
            getattr(p, k).extend(v)
        else:
            setattr(p, k, v)
    return p


# ------------------------------------------------------------------------ learning-rate policies
@pytest.mark.parametrize("policy, fields, expect", [
    ("fixed", {}, lambda it: 0.1),
    ("step", {"gamma": 0.5, "stepsize": 10}, lambda it: 0.1 * 0.5 ** (it // 10)),
    ("exp", {"gamma": 0.9}, lambda it: 0.1 * 0.9 ** it),
    ("inv", {"gamma": 0.01, "power": 0.75}, lambda it: 0.1 * (1 + 0.01 * it) ** -0.75),
    ("poly", {"power": 2.0, "max_iter": 30}, lambda it: 0.1 * (1 - it / 30) ** 2),
    ("sigmoid", {"gamma": 0.2, "stepsize": 15},
     lambda it: 0.1 / (1 + math.exp(-0.2 * (it - 15)))),
])
def test_lr_policies(policy, fields, expect):
    p = solver_param(base_lr=0.1, lr_policy=policy, **fields)
    for it in (0, 1, 9, 10, 11, 15, 29):
        rate, _ = learning_rate(p, it, 0)
        assert rate == pytest.approx(expect(it), rel=1e-5)  # Caffe rounds to float
        assert rate == float(np.float32(rate))


def test_multistep_advances_current_step_one_value_per_call():
    p = solver_param(base_lr=1.0, lr_policy="multistep", gamma=0.1, stepvalue=[3, 5])
    step, seen = 0, []
    for it in range(8):
        rate, step = learning_rate(p, it, step)
        seen.append((step, rate))
    assert [s for s, _ in seen] == [0, 0, 0, 1, 1, 2, 2, 2]
    assert seen[-1][1] == pytest.approx(0.01)
    # A restored current_step is honoured, not recomputed from the iteration.
    assert learning_rate(p, 7, 0)[1] == 1


def test_lr_policy_errors():
    with pytest.raises(SolverError, match="unknown lr_policy"):
        learning_rate(solver_param(base_lr=0.1, lr_policy="cosine"), 0)
    with pytest.raises(SolverError, match="stepsize"):
        learning_rate(solver_param(base_lr=0.1, lr_policy="step", gamma=0.1), 0)


# ------------------------------------------------------------------------ update rules
def reference_update(kind, g, hist, lr, it, p):
    """Caffe's ComputeUpdateValue written out in float64 (returns step, new histories)."""
    g = g.astype(np.float64)
    hist = [h.astype(np.float64) for h in hist]
    if kind == "SGD":
        h = lr * g + p.momentum * hist[0]
        return h, [h]
    if kind == "Nesterov":
        h = lr * g + p.momentum * hist[0]
        return (1 + p.momentum) * h - p.momentum * hist[0], [h]
    if kind == "AdaGrad":
        h = hist[0] + g * g
        return lr * g / (np.sqrt(h) + p.delta), [h]
    if kind == "RMSProp":
        h = (1 - p.rms_decay) * g * g + p.rms_decay * hist[0]
        return lr * g / (np.sqrt(h) + p.delta), [h]
    if kind == "AdaDelta":
        hg = (1 - p.momentum) * g * g + p.momentum * hist[0]
        u = g * np.sqrt((hist[1] + p.delta) / (hg + p.delta))
        hu = (1 - p.momentum) * u * u + p.momentum * hist[1]
        return lr * u, [hg, hu]
    if kind == "Adam":
        b1, b2, t = p.momentum, p.momentum2, it + 1
        m = (1 - b1) * g + b1 * hist[0]
        v = (1 - b2) * g * g + b2 * hist[1]
        corr = math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        return lr * corr * m / (np.sqrt(v) + p.delta), [m, v]
    raise AssertionError(kind)


RULE_PARAMS = {
    "SGD": dict(momentum=0.9), "Nesterov": dict(momentum=0.9), "AdaGrad": dict(delta=1e-8),
    "RMSProp": dict(rms_decay=0.98, delta=1e-8), "AdaDelta": dict(momentum=0.95, delta=1e-6),
    "Adam": dict(momentum=0.9, momentum2=0.999, delta=1e-8),
}


@pytest.mark.parametrize("kind", list(RULE_PARAMS))
def test_rule_matches_float64_transcription(kind):
    p = solver_param(**RULE_PARAMS[kind])
    rule = rules.make_rule(kind, p)
    rs = np.random.default_rng(7)
    g = rs.standard_normal(1000).astype(np.float32)
    hist = [np.abs(rs.standard_normal(1000)).astype(np.float32) * 0.1
            for _ in range(rule.num_history)]
    if kind in ("SGD", "Nesterov", "Adam"):
        hist[0] = rs.standard_normal(1000).astype(np.float32) * 0.1
    want_step, want_hist = reference_update(kind, g, hist, 0.01, 4, p)
    scratch = [np.empty(1000, np.float32) for _ in range(max(1, rule.num_scratch))]
    rule.update(g, hist, np.float32(0.01), 4, scratch)
    np.testing.assert_allclose(g, want_step, rtol=2e-5, atol=1e-9)
    for h, w in zip(hist, want_hist):
        np.testing.assert_allclose(h, w, rtol=2e-5, atol=1e-12)


def test_momentum_rejected_by_adagrad_and_rmsprop():
    with pytest.raises(SolverError, match="Momentum cannot be used with AdaGrad"):
        rules.make_rule("AdaGrad", solver_param(momentum=0.9))
    with pytest.raises(SolverError, match="rms_decay"):
        rules.make_rule("RMSProp", solver_param(rms_decay=1.5))
    with pytest.raises(SolverError, match="unknown solver type"):
        rules.make_rule("LBFGS", solver_param())


def test_regularize_normalize_clip():
    rs = np.random.default_rng(1)
    w = rs.standard_normal(50).astype(np.float32)
    g = rs.standard_normal(50).astype(np.float32)
    s = np.empty(50, np.float32)
    g2 = g.copy()
    rules.regularize(g2, w, np.float32(0.01), "L2", s)
    np.testing.assert_allclose(g2, g + 0.01 * w, rtol=1e-6)
    g1 = g.copy()
    rules.regularize(g1, w, np.float32(0.01), "L1", s)
    np.testing.assert_allclose(g1, g + 0.01 * np.sign(w), rtol=1e-6)
    with pytest.raises(SolverError, match="regularization_type"):
        rules.regularize(g.copy(), w, 0.01, "L3", s)
    gn = g.copy()
    rules.normalize(gn, 4)
    np.testing.assert_array_equal(gn, g / np.float32(4))
    a, b = g[:20].copy(), g[20:].copy()
    norm = math.sqrt(float(np.sum(g.astype(np.float64) ** 2)))
    assert rules.clip_gradients([a, b], -1) is None
    assert rules.clip_gradients([a, b], norm * 2) is None
    got = rules.clip_gradients([a, b], 1.0)
    assert got[0] == pytest.approx(norm, rel=1e-5)
    np.testing.assert_allclose(np.concatenate([a, b]), g / norm, rtol=1e-5)


# ------------------------------------------------------------------------ golden trajectories
def _golden_solver(run, tmp_path, snapshot=0):
    p = load_solver_param(f"{run}/solver.prototxt")
    p.snapshot = snapshot
    p.snapshot_after_train = False
    p.snapshot_prefix = str(tmp_path / "snap")
    p.display = 0
    return get_solver(p)


def _params(net):
    return {f"{name}/{i}": b.data.copy() for name, blobs in net.params.items()
            for i, b in enumerate(blobs)}


def _close(got, want):
    want = np.asarray(want)
    scale = float(np.abs(want).max()) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("run", GOLDEN_RUNS)
def test_golden_trajectory(run, tmp_path, monkeypatch):
    need_shared(SOLVERS_DIR)
    monkeypatch.chdir(SOLVERS_DIR)
    solver = _golden_solver(run, tmp_path)
    solver.net.copy_from("init.caffemodel")
    losses, trajectory = [], [_params(solver.net)]
    solver.add_callback(lambda info: (losses.append(info["loss"]),
                                      trajectory.append(_params(solver.net))))
    solver.step(30)
    ref = np.loadtxt(f"{run}/loss.csv", delimiter=",", skiprows=1)
    assert solver.iter == 30
    np.testing.assert_allclose(losses, ref[:, 1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([r["lr"] for r in solver.history_rows], ref[:, 2], rtol=1e-5)
    final = np.load(f"{run}/final_params.npz")
    for key in final.files:
        _close(trajectory[-1][key], final[key])
    history = np.load(f"{run}/final_history.npz")
    assert len(solver.history) == len(history.files)
    for key in history.files:
        _close(solver.history[int(key.split("/")[1])], history[key])
    per_iter = np.load(f"{run}/per_iter_params.npz")
    for key in final.files:
        _close(np.stack([t[key] for t in trajectory]), per_iter[key])


@pytest.mark.parametrize("run, at", [("sgd_step_resume16", 16), ("sgd_step_resume15", 15)])
def test_resume_from_caffe_snapshot(run, at, tmp_path, monkeypatch):
    """Caffe's state has no data position: the data restarts at record 0 (resume15 then differs
    from an uninterrupted run, and must match what Caffe did)."""
    need_shared(SOLVERS_DIR)
    monkeypatch.chdir(SOLVERS_DIR)
    solver = _golden_solver(run, tmp_path)
    losses = []
    solver.add_callback(lambda info: losses.append(info["loss"]))
    solver.solve(f"{run}/snap_iter_{at}.solverstate")
    assert solver.iter == 30
    ref = np.loadtxt(f"{run}/loss.csv", delimiter=",", skiprows=1)
    ref = ref[ref[:, 0] >= at]
    np.testing.assert_allclose(losses, ref[:, 1], rtol=1e-4, atol=1e-6)
    final = np.load(f"{run}/final_params.npz")
    got = _params(solver.net)
    for key in final.files:
        _close(got[key], final[key])
    history = np.load(f"{run}/final_history.npz")
    for key in history.files:
        _close(solver.history[int(key.split("/")[1])], history[key])


def test_own_snapshot_resumes_exactly(tmp_path, monkeypatch):
    """Our state carries the data position and RNG: resuming mid-epoch equals not stopping."""
    need_shared(SOLVERS_DIR)
    monkeypatch.chdir(SOLVERS_DIR)
    straight = _golden_solver("sgd_step", tmp_path)
    straight.net.copy_from("init.caffemodel")
    straight.step(30)

    first = _golden_solver("sgd_step", tmp_path)
    first.net.copy_from("init.caffemodel")
    first.step(15)
    _model, state = first.snapshot()
    assert os.path.basename(state) == "snap_iter_15.solverstate"

    resumed = _golden_solver("sgd_step", tmp_path)
    resumed.restore(state)
    assert resumed.iter == 15 and resumed.current_step == 1
    resumed.step(15)
    for key, value in _params(straight.net).items():
        assert np.array_equal(_params(resumed.net)[key], value), key
    for a, b in zip(straight.history, resumed.history):
        assert np.array_equal(a, b)


# ------------------------------------------------------------------------ the loop on a tiny net
TINY_NET = """
name: "tiny"
layer {
  name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param {
    shape { dim: 8 dim: 5 } shape { dim: 8 }
    data_filler { type: "%s" std: 1 value: 0.5 } data_filler { type: "constant" value: 1 }
  }
}
layer {
  name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } }
}
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer {
  name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc"
  include { phase: TEST }
}
"""


def write_tiny(folder, filler="gaussian", solver_text="", name="solver.prototxt"):
    (folder / "net.prototxt").write_text(TINY_NET % filler)
    text = ('net: "net.prototxt"\nbase_lr: 0.1\nmomentum: 0.9\nlr_policy: "fixed"\n'
            'max_iter: 6\nrandom_seed: 5\n' + solver_text)
    path = folder / name
    path.write_text(text)
    return path


def test_loop_tests_displays_snapshots_and_reports(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="caffepar")
    path = write_tiny(tmp_path, solver_text='test_iter: 2\ntest_interval: 3\ndisplay: 2\n'
                                            'snapshot: 4\naverage_loss: 2\n')
    monkeypatch.chdir(tmp_path)
    solver = caffe.get_solver(path.name)
    assert isinstance(solver, caffe.SGDSolver) and solver.type == "SGD"
    assert solver.param.snapshot_prefix == "solver"
    assert len(solver.test_nets) == 1 and "acc" in solver.test_nets[0].outputs
    assert solver.test_nets[0].params["ip"][0].data is not None
    order, infos = [], []
    solver.on_gradients_ready = lambda: order.append(("grads", solver.iter))
    solver.add_callback(lambda: order.append(("start", solver.iter)),
                        lambda: order.append(("pycaffe_grads", solver.iter)))
    solver.add_callback(infos.append)
    solver.solve()
    assert order[:3] == [("start", 0), ("grads", 0), ("pycaffe_grads", 0)]
    assert [i["iter"] for i in infos] == list(range(6))
    assert set(infos[0]) >= {"iter", "loss", "smoothed_loss", "lr", "seconds", "data_wait", "test"}
    assert set(infos[0]["test"]) == {"acc", "loss"} and "test" in infos[3] and "test" not in infos[1]
    # average_loss 2: the smoothed loss is the mean of this and the previous iteration's loss.
    assert infos[1]["smoothed_loss"] == pytest.approx((infos[0]["loss"] + infos[1]["loss"]) / 2,
                                                      rel=1e-6)
    assert solver.history_rows[-1]["iter"] == 6 and "test" in solver.history_rows[-1]
    names = sorted(os.listdir(tmp_path))
    assert "solver_iter_4.caffemodel" in names and "solver_iter_4.solverstate" in names
    assert "solver_iter_6.caffemodel" in names  # snapshot_after_train
    text = caplog.text
    for line in ["Iteration 0, Testing net (#0)", "Iteration 3, Testing net (#0)",
                 "Iteration 6, Testing net (#0)", "    Test net output #0: acc = 1",
                 "Iteration 2, lr = 0.1", "    Train net output #0: loss = ",
                 "Snapshotting to binary proto file solver_iter_4.caffemodel",
                 "Snapshotting solver state to binary proto file solver_iter_4.solverstate",
                 "Optimization Done."]:
        assert line in text, line
    assert " iter/s, " in text and "s/2 iters), loss = " in text
    # test nets share the train net's weights
    assert np.shares_memory(solver.test_nets[0].params["ip"][0].data,
                            solver.net.params["ip"][0].data)


def test_actions_stop_and_snapshot(tmp_path, monkeypatch):
    path = write_tiny(tmp_path, solver_text="max_iter: 100\nsnapshot_after_train: false\n")
    monkeypatch.chdir(tmp_path)
    solver = caffe.SGDSolver(str(path))
    requests = iter(["none", "snapshot", "none", "stop"])
    solver.action_request = lambda: next(requests, "none")
    solver.solve()
    assert solver.iter == 4 and solver.requested_early_exit
    assert sorted(f for f in os.listdir(tmp_path) if "_iter_" in f) == [
        "solver_iter_2.caffemodel", "solver_iter_2.solverstate"]
    solver.action_request = lambda: "jump"
    with pytest.raises(SolverError, match="action_request"):
        solver.step(1)


def test_iter_size_averages_gradients(tmp_path, monkeypatch):
    """With identical batches, iter_size 2 (gradients summed, then halved) equals iter_size 1."""
    monkeypatch.chdir(tmp_path)
    results = []
    for iter_size in (1, 2):
        path = write_tiny(tmp_path, "constant", f"iter_size: {iter_size}\nweight_decay: 0.01\n"
                                                f"snapshot_after_train: false\n")
        solver = caffe.get_solver(str(path))
        solver.step(3)
        results.append((solver.net.params["ip"][0].data.copy(),
                        [r["loss"] for r in solver.history_rows]))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


def test_chunked_update_is_identical(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = []
    for chunk in (solver_mod.CHUNK, 4):
        monkeypatch.setattr(solver_mod, "CHUNK", chunk)
        path = write_tiny(tmp_path, solver_text='type: "Adam"\nweight_decay: 0.01\n'
                                                'regularization_type: "L1"\nclip_gradients: 0.5\n'
                                                'snapshot_after_train: false\n')
        solver = caffe.get_solver(str(path))
        solver.step(3)
        out.append([b.data.copy() for b in solver.net.learnable_params] + solver.history)
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_paths_fall_back_to_solver_folder_and_prefix_rules(tmp_path, monkeypatch):
    sub = tmp_path / "model"
    sub.mkdir()
    (sub / "snaps").mkdir()
    path = write_tiny(sub, solver_text='snapshot_prefix: "snaps"\nsnapshot: 2\n')
    monkeypatch.chdir(tmp_path)
    solver = caffe.get_solver(str(path))
    # prefix "snaps" is not a directory here, so it stays a plain prefix: Caffe's rule
    assert solver.param.snapshot_prefix == "snaps"
    monkeypatch.chdir(sub)
    solver = caffe.get_solver("solver.prototxt")
    assert solver.param.snapshot_prefix == os.path.join("snaps", "solver")
    solver.step(2)
    assert os.path.exists(sub / "snaps" / "solver_iter_2.solverstate")


def test_solver_type_upgrade_and_class_choice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_tiny(tmp_path, solver_text="solver_type: NESTEROV\n")
    solver = caffe.get_solver(str(path))
    assert isinstance(solver, caffe.NesterovSolver) and solver.type == "Nesterov"
    assert solver.param.type == "Nesterov" and not solver.param.HasField("solver_type")
    # pycaffe's explicit classes use their own rule whatever the file says
    assert caffe.AdamSolver(str(path)).type == "Adam"
    assert len(caffe.AdaDeltaSolver(str(path)).history) == 2 * len(solver.net.learnable_params)
    path = write_tiny(tmp_path, solver_text='type: "Adam"\nsolver_type: ADAM\n')
    with pytest.raises(Exception, match="solver_type"):
        caffe.get_solver(str(path))


def test_pycaffe_solver_api(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_tiny(tmp_path, solver_text="test_iter: 1\ntest_interval: 100\n")
    solver = caffe.SGDSolver(path.name)
    assert isinstance(solver.net, caffe.Net) and len(solver.test_nets) == 1
    assert solver.iter == 0 and solver.param.base_lr == pytest.approx(0.1)
    assert solver.lr == pytest.approx(0.1)
    before = solver.net.params["ip"][0].data.copy()
    solver.step(2)
    assert solver.iter == 2 and not np.array_equal(before, solver.net.params["ip"][0].data)
    model, state = solver.snapshot()
    assert model == "solver_iter_2.caffemodel" and state == "solver_iter_2.solverstate"
    other = caffe.SGDSolver(path.name)
    other.restore(state)
    assert other.iter == 2
    np.testing.assert_array_equal(other.net.params["ip"][0].data,
                                  solver.net.params["ip"][0].data)
    solver.net.forward()
    solver.apply_update()
    assert solver.iter == 3
    # the solver's `weights` field fine-tunes both nets from a caffemodel
    p = load_solver_param(path.name)
    p.weights.append(f" {model} ")
    tuned = caffe.get_solver(p, source=path.name)
    for net in [tuned.net] + tuned.test_nets:
        np.testing.assert_array_equal(net.params["ip"][0].data, other.net.params["ip"][0].data)


def test_train_and_test_states(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text("""
name: "staged"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "deep" type: "Accuracy" bottom: "ip" bottom: "label" top: "deep"
  include { min_level: 2 } }
layer { name: "staged" type: "Accuracy" bottom: "ip" bottom: "label" top: "staged"
  include { stage: "val" } }
""")
    p = solver_param(net="net.prototxt", base_lr=0.1, lr_policy="fixed", test_iter=[1, 1],
                     test_interval=10)
    p.train_state.level = 2
    p.test_state.add().stage.append("val")
    p.test_state.add()
    solver = caffe.get_solver(p)
    assert "deep" in solver.net.outputs and "staged" not in solver.net.outputs
    assert solver.net.phase == caffe.TRAIN
    assert "staged" in solver.test_nets[0].outputs and "staged" not in solver.test_nets[1].outputs
    assert all(n.phase == caffe.TEST for n in solver.test_nets)


def test_solver_parameter_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_tiny(tmp_path)
    with pytest.raises(SolverError, match="must specify a train net"):
        caffe.get_solver(solver_param(base_lr=0.1))
    with pytest.raises(SolverError, match="more than one"):
        caffe.get_solver(solver_param(net="net.prototxt", train_net="net.prototxt"))
    with pytest.raises(SolverError, match="test_iter must be specified"):
        caffe.get_solver(solver_param(train_net="net.prototxt", test_net=["net.prototxt"]))
    with pytest.raises(SolverError, match="snapshot_prefix"):
        caffe.get_solver(solver_param(net="net.prototxt", snapshot=10))
    with pytest.raises(SolverError, match=r'^no/such/dir: error: no such folder, for '
                                          r'snapshot_prefix "no/such/dir/x"; create it'):
        caffe.get_solver(solver_param(net="net.prototxt", snapshot=10,
                                      snapshot_prefix="no/such/dir/x"))
    with pytest.raises(SolverError, match="unknown solver type"):
        caffe.get_solver(solver_param(net="net.prototxt", type="Fancy"))


def test_debug_info_logs_and_changes_nothing(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="caffepar")
    monkeypatch.chdir(tmp_path)
    weights = []
    for extra in ("", "debug_info: true\n"):
        path = write_tiny(tmp_path, solver_text="display: 1\nsnapshot_after_train: false\n" + extra)
        solver = caffe.get_solver(path.name)
        solver.step(2)
        weights.append(solver.net.params["ip"][0].data.copy())
    np.testing.assert_array_equal(*weights)
    assert "    [Forward] Layer ip, top blob ip data: " in caplog.text
    assert "    [Backward] Layer ip, param blob 0 diff: " in caplog.text
    assert "    [Backward] All net params (data, diff): L1 norm = (" in caplog.text


def test_restoring_a_caffe_state_restarts_the_data(tmp_path, monkeypatch):
    """A Caffe state has no data position: the data layers go back to their first record."""
    need_shared(SOLVERS_DIR)
    monkeypatch.chdir(SOLVERS_DIR)
    fresh = _golden_solver("sgd_step_resume15", tmp_path)
    fresh.restore("sgd_step_resume15/snap_iter_15.solverstate")
    fresh.step(3)
    used = _golden_solver("sgd_step_resume15", tmp_path)
    used.step(5)
    used.restore("sgd_step_resume15/snap_iter_15.solverstate")
    used.step(3)
    for key, value in _params(fresh.net).items():
        assert np.array_equal(_params(used.net)[key], value), key
