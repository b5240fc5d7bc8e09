"""Gradient communication options, end to end under mpiexec and in one process: overlap,
fixed buckets, hierarchical allreduce (also as simulated nodes) and dense top-k give the plain
run's weights at P=2 and P=4; top-k's reduced gradient is the sum of every rank's NumPy top-k;
a top-k snapshot resumes exactly as the uninterrupted run; a P=2 timeline is a Chrome trace of
every layer and collective; bad option values are one-line errors."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

from caffepar.cli import cli
from caffepar.graph.net import TRAIN, Net
from caffepar.parallel.buckets import (detect_alexnet_like, fixed_buckets, gradient_units,
                                       split_buckets)
from caffepar.parallel.options import CommOptions
from caffepar.parallel.topk import TopK

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "mpi"))
from nets import NETS, solver_param, write_data  # noqa: E402
from test_parallel import MPIEXEC, run_mpi, weights  # noqa: E402
from train_comm import ITERATIONS, NET_MODES, NO_MOMENTUM, RESUMED, comm_configs  # noqa: E402

M = 4
RTOL, ATOL = 1e-5, 1e-6
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec installed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("comm")
    for name in NETS:
        write_data(folder, name)
    summaries = {}
    for ranks in (2, 4):
        proc = run_mpi(ranks, [HERE / "mpi" / "train_comm.py", folder, M])
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[ranks] = json.loads((folder / f"comm_p{ranks}.json").read_text())
    return folder, summaries


def final(folder, ranks, name, label):
    return weights(folder / f"p{ranks}_{name}_{label}_iter_{ITERATIONS}.caffemodel")


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("label", [c for c in comm_configs(2) if c != "plain"])
def test_option_gives_the_plain_weights(runs, ranks, name, label):
    folder = runs[0]
    got, want = final(folder, ranks, name, label), final(folder, ranks, name, "plain")
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name} {label} P={ranks}: {key}")


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(NETS))
def test_overlap_with_iter_size_gives_the_plain_weights(runs, ranks, name):
    folder = runs[0]
    got = final(folder, ranks, name, "iter_size_overlap")
    want = final(folder, ranks, name, "iter_size_plain")
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name} iter_size 2 P={ranks}: {key}")


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", [n for n in sorted(NETS) if NET_MODES[n] == "data"])
@pytest.mark.parametrize("label", sorted(NO_MOMENTUM))
def test_dense_momentum_correction_is_sgd_without_momentum(runs, ranks, name, label):
    folder = runs[0]
    got = final(folder, ranks, name, label)
    want = final(folder, ranks, name, NO_MOMENTUM[label][1])
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name} {label} P={ranks}: {key}")


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(NETS))
def test_topk_sums_every_ranks_top_k(runs, ranks, name):
    summary = runs[1][ranks]
    assert summary[f"{name}/topk_check"] < 1e-6
    # Exact thresholds send k = ceil(0.05 n) (index, value) pairs per layer (fewer only on ties
    # at zero); reused thresholds let the residuals through as they grow.
    assert 0.9 < summary[f"{name}/topk_bytes"] <= 1.0
    assert summary["bytes"][f"{name}/topk"] < 0.25 * summary["bytes"][f"{name}/overlap"]


@needs_mpi
@pytest.mark.parametrize("name", sorted(NETS))
@pytest.mark.parametrize("variant", sorted(RESUMED))
def test_topk_snapshot_resumes_exactly(runs, name, variant):
    folder = runs[0]
    ext = ".caffemodel.h5" if variant.endswith("h5") else ".caffemodel"
    straight = weights(folder / f"p2_{name}_{variant}_iter_{ITERATIONS}{ext}")
    resumed = weights(folder / f"p2_{name}_{variant}_resumed_iter_{ITERATIONS}{ext}")
    plain = final(folder, 2, name, "plain")
    assert any(not np.array_equal(straight[k], plain[k]) for k in plain), \
        "top-k at ratio 0.05 should train differently from exact SGD"
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=f"{name}: {key}")


# ---------------------------------------------------------------- timeline, CLI


def _solver_file(folder, name, mode, prefix, max_iter=4):
    param = solver_param(folder, name, M, mode, prefix, max_iter=max_iter)
    path = folder / f"{prefix.name}_solver.prototxt"
    path.write_text(text_format.MessageToString(param))
    return path


@needs_mpi
def test_timeline_of_a_p2_run_is_a_chrome_trace(tmp_path):
    name = "alexnet_small"
    write_data(tmp_path, name)
    solver = _solver_file(tmp_path, name, "mixed", tmp_path / "tl")
    trace = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver", solver,
                           "--np", "2", "--overlap", "--timeline", trace],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    layers = [l.name for l in Net(solver_param(tmp_path, name, M, "mixed", tmp_path / "x")
                                  .net_param, phase=TRAIN).layers]
    for pid in (0, 1):
        mine = [e for e in spans if e["pid"] == pid]
        for kind in ("forward", "backward"):
            seen = {e["args"]["layer"] for e in mine if e["cat"] == kind}
            assert seen == set(layers), (pid, kind)
        comm = [e for e in mine if e["cat"] == "comm"]
        # Every replicated layer's gradient in a bucket; the model-parallel layers' exchanges.
        reduced = {l for e in comm if e["name"].startswith("allreduce ")
                   for l in e["args"].get("layers", [])}
        assert reduced == {"conv1", "conv2", "fc7"}, (pid, reduced)
        names = {e["name"] for e in comm}
        for wanted in ("allgather fc6", "alltoall fc6", "reduce_scatter fc6", "allgather fc8",
                       "allreduce outputs"):
            assert wanted in names, (pid, wanted, names)
        assert sum(e["cat"] == "iteration" for e in mine) == 4
        assert sum(e["name"] == "update" for e in mine) == 4


def _train(args):
    return CliRunner().invoke(cli, ["train"] + [str(a) for a in args],
                              obj={"argv": ["train"] + [str(a) for a in args]})


@pytest.mark.parametrize("args, message", [
    (["--topk", "0"], "top-k ratio must be in (0, 1], got 0"),
    (["--topk", "1.5"], "top-k ratio must be in (0, 1], got 1.5"),
    (["--topk", "-0.01"], "top-k ratio must be in (0, 1]"),
    (["--bucket-mb", "0"], "bucket size must be > 0 MiB, got 0"),
    (["--bucket-mb", "-25"], "bucket size must be > 0 MiB, got -25"),
    (["--topk", "0.01", "--topk-refresh", "0"], "refresh interval must be >= 1"),
    (["--np", "4", "--hierarchical", "--ranks-per-node", "3"],
     "ranks per node (3) must divide the number of ranks (4)"),
    (["--hierarchical", "--ranks-per-node", "0"], "ranks per node must be >= 1, got 0"),
    (["--ranks-per-node", "2"], "--ranks-per-node needs --hierarchical"),
    (["--topk-refresh", "5"], "--topk-refresh needs --topk"),
    (["--momentum-correction"], "--momentum-correction needs --topk"),
    (["--bucket-mb", "25", "--merge", "auto"], "not both"),
    (["--topk", "0.01", "--hierarchical"], "does not combine"),
    (["--merge", "manual"], "'manual' is not 'auto'"),
])
def test_bad_option_values_are_usage_errors(tmp_path, args, message):
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "missing.prototxt"\n')
    result = _train(["--solver", solver] + args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("setting, line, message", [
    ("topk_ratio: 1.5", 4, "comm_param.topk_ratio: top-k ratio must be in (0, 1], got 1.5"),
    ("bucket_mb: 0", 4, "comm_param.bucket_mb: bucket size must be > 0 MiB, got 0"),
    ("topk_ratio: 0.1\n  topk_refresh: -3", 5, "comm_param.topk_refresh: top-k refresh"),
    ("hierarchical: true\n  ranks_per_node: 3", 5,
     "ranks per node (3) must divide the number of ranks (2)"),
    ("bucket_mb: 4\n  merge: AUTO", 4, "give a fixed bucket size or --merge auto, not both"),
    ("topk_ratio: 0.01\n  momentum_correction: true", None,
     "momentum correction needs the SGD solver with momentum > 0 (this one: SGD, momentum 0)"),
])
def test_bad_prototxt_values_name_file_and_line(tmp_path, monkeypatch, capsys, setting, line,
                                                message):
    from caffepar.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "solver.prototxt").write_text(
        f'net: "missing.prototxt"\nbase_lr: 0.01\ncomm_param {{\n  {setting}\n}}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--solver", "solver.prototxt", "--np", "2"])
    assert exit_.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    where = f"solver.prototxt:{line}:" if line else "solver.prototxt:"
    assert lines[0].startswith(f"caffepar: {where} error: ")
    assert message in lines[0]


# ---------------------------------------------------------------- one process

SHARED_NET = """
layer { name: "data" type: "DummyData" top: "x" top: "label"
        dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 }
                           data_filler { type: "gaussian" } } }
layer { name: "a" type: "InnerProduct" bottom: "x" top: "a"
        param { name: "shared_w" } inner_product_param { num_output: 3 } }
layer { name: "b" type: "InnerProduct" bottom: "a" top: "b"
        param { name: "shared_w" } inner_product_param { num_output: 3 } }
layer { name: "c" type: "InnerProduct" bottom: "b" top: "c"
        inner_product_param { num_output: 4 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "c" bottom: "label" top: "loss" }
"""


def test_units_follow_backward_and_shared_parameters():
    net = Net(_net_param(SHARED_NET), phase=TRAIN)
    units = gradient_units(net)
    assert [u.layer for u in units] == ["c", "b", "a"]
    by_name = {u.layer: u for u in units}
    # b's own bias is complete after b; "a" owns the shared weight, which b also uses.
    assert by_name["c"].ready == 3 and by_name["b"].ready == 2 and by_name["a"].ready == 1
    assert by_name["c"].count == 4 * 3 + 4 and by_name["a"].count == 9 + 3
    assert by_name["b"].count == 3      # bias only: the shared weight belongs to "a"
    assert units[0].hi == net.replicated_count and units[-1].lo == 0


def _net_param(text):
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import parse_text
    return parse_text(text, caffe_pb2.NetParameter())


def test_fixed_buckets_fill_to_the_size_in_backward_order():
    net = Net(_net_param(SHARED_NET), phase=TRAIN)
    units = gradient_units(net)
    buckets = fixed_buckets(units, 17 * 4)
    assert [[u.layer for u in b.units] for b in buckets] == [["c", "b"], ["a"]]
    assert [(b.lo, b.hi) for b in buckets] == [(units[1].lo, units[0].hi),
                                               (units[2].lo, units[2].hi)]
    assert [[u.layer for u in b.units] for b in split_buckets(units, 2)] == [["c", "b"], ["a"]]


def test_alexnet_like_rule():
    names = ["data", "conv1", "conv2", "fc6", "fc7", "loss"]
    params = [0, 1000, 3000, 50000, 40000, 0]
    got = detect_alexnet_like(names, [0, 40, 45, 5, 3, 0.5], params)
    # From the top: 0.5 + 3 + 5 = 8.5 of 93.5 ms, then conv2 passes 10% (layer p, the last of
    # the FC part); the layers below it, conv1, hold 1%.
    assert got.alexnet_like and got.split == "conv2"
    assert got.top_layers == ["conv2", "fc6", "fc7"]
    assert got.bottom_param_share == pytest.approx(1000 / 94000)
    heavy_bottom = detect_alexnet_like(names, [0, 40, 45, 5, 3, 0.5],
                                       [0, 20000, 3000, 50000, 40000, 0])
    assert not heavy_bottom.alexnet_like


def test_topk_selection_against_numpy():
    from caffepar.parallel.buckets import Bucket, Unit
    rng = np.random.default_rng(3)
    units = [Unit("b", 1, 40, 100, 1), Unit("a", 0, 0, 40, 0)]
    topk = TopK(units, 100, 0.1, refresh=2)
    residual = rng.normal(size=100).astype(np.float32)
    topk.residual[...] = residual
    grad = rng.normal(size=100).astype(np.float32)
    acc = grad + residual
    bucket = Bucket(units)
    count, pairs = topk.select(grad.copy(), bucket, iteration=0)
    index, values = pairs[:count], pairs[count:].view(np.float32)
    want = []
    for u in units:
        k = math.ceil(0.1 * u.count)
        want += sorted(u.lo + np.argsort(-np.abs(acc[u.lo:u.hi]))[:k])
    assert sorted(index) == sorted(want)
    np.testing.assert_array_equal(values, acc[index])
    kept = acc.copy()
    kept[index] = 0
    np.testing.assert_array_equal(topk.residual, kept)
    dense = np.full(100, 7, np.float32)
    topk.scatter(dense, bucket, np.concatenate([pairs, pairs]), [count, count])
    want_dense = np.zeros(100, np.float32)
    want_dense[index] = 2 * acc[index]
    np.testing.assert_array_equal(dense, want_dense)
    # Between refreshes the thresholds are reused: all values below them stay in the residual.
    assert topk.select(np.zeros(100, np.float32), bucket, iteration=1)[0] == 0


def test_options_merge_flags_over_the_prototxt():
    from caffepar.parallel.options import options_from_solver
    from caffepar.proto import caffe_pb2
    param = caffe_pb2.SolverParameter()
    assert options_from_solver(param).plain
    param.comm_param.bucket_mb = 25
    param.comm_param.topk_ratio = 0.01
    options = options_from_solver(param).with_flags(merge="auto", overlap=False)
    assert options.merge == "auto" and options.overlap and options.bucket_mb is None
    assert options.topk == pytest.approx(0.01) and options.topk_refresh == 10
    assert CommOptions().with_flags(overlap=None).plain


def test_modelled_iteration_by_hand():
    from caffepar.parallel.buckets import Bucket, Unit
    from caffepar.parallel.schedule import model_iteration
    # Layers 0..3; units on layers 3 (top) and 1; backward 1 ms per layer, forward 2 ms.
    top, low = Unit("top", 3, 10, 20, 3), Unit("low", 1, 0, 10, 1)
    backward = [0.001] * 4
    per_layer = [Bucket([top]), Bucket([low])]
    comm = {"top": 0.0025, "low": 0.0005, "top+low": 0.0027}

    def comm_s(bucket):
        return comm["+".join(u.layer for u in bucket.units)]

    # top ready at 3 ms, sent 3..5.5; low ready at 5 ms, sent 5.5..6; backward ends at 6.
    got = model_iteration(0.002, backward, 0.0001, per_layer, comm_s)
    assert got.iteration_s == pytest.approx(0.0061)
    assert got.comm_s == pytest.approx(0.003) and got.exposed_s == pytest.approx(0.0)
    # Without overlap both follow backward: 6 + 2.5 + 0.5.
    got = model_iteration(0.002, backward, 0.0001, per_layer, comm_s, overlap=False)
    assert got.iteration_s == pytest.approx(0.0091) and got.exposed_s == pytest.approx(0.003)
    # One bucket: sent after layer 1, 5 + 2.7 = 7.7 ms.
    got = model_iteration(0.002, backward, 0.0001, [Bucket([top, low])], comm_s)
    assert got.iteration_s == pytest.approx(0.0078) and got.exposed_s == pytest.approx(0.0017)
    # A 0.5 ms preparation per bucket delays the layers below it.
    got = model_iteration(0.002, backward, 0.0001, per_layer, comm_s,
                          prepare_s=lambda b: 0.0005)
    assert got.iteration_s == pytest.approx(0.0071)


def test_optimal_merge_merges_only_when_it_pays():
    from caffepar.parallel.buckets import Unit
    from caffepar.parallel.schedule import model_iteration, optimal_merge
    units = [Unit(f"l{i}", i, 100 * i, 100 * (i + 1), i) for i in range(5, -1, -1)]
    backward = [0.001] * 6

    def costs(latency):
        return lambda b: latency + 1e-6 * b.count

    # Big startup latency: sending everything at once is best.
    merged = optimal_merge(units, 0.0, backward, 0.0, costs(0.01))
    assert len(merged) == 1
    # No latency and bandwidth slower than backward: nothing to gain by merging.
    apart = optimal_merge(units, 0.0, backward, 0.0, costs(0.0))
    assert len(apart) == len(units)
    # In between, never worse than either extreme.
    cost = costs(0.0004)
    mid = optimal_merge(units, 0.0, backward, 0.0, cost)
    t = model_iteration(0.0, backward, 0.0, mid, cost).iteration_s
    assert t <= model_iteration(0.0, backward, 0.0, merged, cost).iteration_s
    assert t <= model_iteration(0.0, backward, 0.0, apart, cost).iteration_s
    assert [u.layer for b in mid for u in b.units] == [u.layer for u in units]


def test_with_batch_sets_every_input_and_data_layer():
    from caffepar.graph.passes import with_batch
    net = _net_param("""
        input: "x" input_shape { dim: 5 dim: 3 }
        layer { name: "in" type: "Input" top: "y" input_param { shape { dim: 5 dim: 2 } } }
        layer { name: "d" type: "DummyData" top: "z" dummy_data_param { shape { dim: 5 } } }
        layer { name: "db" type: "Data" top: "w" data_param { source: "s" batch_size: 5 } }
    """)
    out = with_batch(net, 12)
    assert out.input_shape[0].dim[:] == [12, 3]
    assert out.layer[0].input_param.shape[0].dim[:] == [12, 2]
    assert out.layer[1].dummy_data_param.shape[0].dim[:] == [12]
    assert out.layer[2].data_param.batch_size == 12
    assert net.layer[2].data_param.batch_size == 5 and with_batch(out, 12) == out


def test_plan_profile_reports_the_alexnet_rule(capsys):
    from caffepar.cli import main
    model = Path(__file__).resolve().parents[1] / "models/cifar10_quick/train_val_dummy.prototxt"
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", str(model), "--profile", "1", "--batch", "4"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("Backward profile (1 iteration(s) in this process at batch 4, ")
    assert "AlexNet-like: backward from the top passes 10% of its time at " in out


@needs_mpi
def test_time_np2_with_options_reports_and_traces(tmp_path):
    name = "cifar10_quick"
    write_data(tmp_path, name)
    net = tmp_path / "net.prototxt"
    net.write_text(text_format.MessageToString(
        solver_param(tmp_path, name, M, "data", tmp_path / "x").net_param))
    trace = tmp_path / "time.json"
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", "time", "--model", net,
                           "--np", "2", "--iterations", "2", "--hierarchical",
                           "--ranks-per-node", "1", "--timeline", trace],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Average gradient reduction: " in proc.stdout
    assert "(hierarchical (nodes of 1 rank(s)): " in proc.stdout
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):
        assert sum(e["cat"] == "iteration" and e["pid"] == pid for e in events) == 2
        assert any(e["cat"] == "comm" and e["pid"] == pid and
                   e["name"].startswith("hierarchical ") for e in events)
