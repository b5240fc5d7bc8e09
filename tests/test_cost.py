"""The communication cost model, AUTO, calibration files and the cluster-scale plan."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from caffepar.parallel.cost import (DATA, MODEL, NETWORKS, OPS, CostModel, choose_mode,
                                    fit_alpha_beta, hops, inner_product_calls,
                                    iteration_comm_ms, layer_comm_ms, traffic)
from caffepar.parallel.launch import find_mpiexec

ROOT = Path(__file__).resolve().parents[1]
VGG = ROOT / "models/vgg16/train_val_dummy.prototxt"


def test_collective_forms_by_hand():
    assert [hops("allreduce", p) for p in (1, 2, 3, 4, 8)] == [0, 2, 4, 4, 6]
    assert hops("alltoall", 8) == 7 and hops("allgather", 5) == 3
    assert traffic("allreduce", 4, 1000) == 1500
    assert traffic("alltoall", 4, 1000) == 750
    model = CostModel.from_alpha_beta(10e-6, 1e-9)
    # allreduce of 8 MB on 4 ranks: 4 hops x 10 us + 2 * 3/4 * 8e6 B x 1 ns = 0.04 + 12 ms
    assert model.collective_ms("allreduce", 4, 8e6) == pytest.approx(12.04)
    assert model.collective_ms("allreduce", 1, 8e6) == 0


def test_inner_product_volumes_and_layer_time_by_hand():
    k, n, m, p = 4096, 1000, 8, 2
    assert inner_product_calls(k, n, m, p, DATA) == [("allreduce", (k * n + n) * 4)]
    calls = inner_product_calls(k, n, m, p, MODEL)
    assert calls == [("allgather", p * m * k * 4), ("alltoall", m * n * 4),
                     ("alltoall", m * n * 4), ("reduce_scatter", p * m * k * 4)]
    # Each rank's buffers: the bottoms of all ranks twice (gathered, then the partial bottom
    # diffs reduce-scattered), its own outputs and top diffs once each.
    assert sum(b for _, b in calls) == (2 * p * m * k + 2 * m * n) * 4
    assert len(inner_product_calls(k, n, m, p, MODEL, bottom_diff=False)) == 3
    model = CostModel.from_alpha_beta(2e-6, 0.5e-9)
    data = 2 * 2e-6 + 0.5e-9 * 2 * 0.5 * (k * n + n) * 4
    mp = (1 + 1 + 1 + 1) * 2e-6 + 0.5e-9 * 0.5 * (2 * p * m * k + 2 * m * n) * 4
    assert layer_comm_ms(model, k, n, m, p, DATA) == pytest.approx(1e3 * data)
    assert layer_comm_ms(model, k, n, m, p, MODEL) == pytest.approx(1e3 * mp)


def test_auto_choice_on_synthetic_calibrations_and_a_tie():
    bandwidth_bound = CostModel.from_alpha_beta(0.0, 1e-9)
    assert choose_mode(bandwidth_bound, 25088, 4096, 1, 2)[0] == MODEL       # fc6, batch 1
    assert choose_mode(bandwidth_bound, 64, 10, 100, 2)[0] == DATA            # cifar ip2
    # Latency-bound: MODEL's four collectives lose against DATA's one for a small layer.
    latency_bound = CostModel.from_alpha_beta(1.0, 1e-15)
    assert choose_mode(latency_bound, 4096, 1000, 1, 8)[0] == DATA
    # K=1, N=2, M=1, P=2, alpha 0, beta 1: both modes cost exactly 16 s -> DATA.
    tie = CostModel.from_alpha_beta(0.0, 1.0)
    mode, data, model = choose_mode(tie, 1, 2, 1, 2)
    assert data == model == 16000.0 and mode == DATA


def test_planner_auto_reasons():
    from caffepar.parallel.plan import Planner
    from caffepar.proto import caffe_pb2
    ip = caffe_pb2.LayerParameter(name="fc6", type="InnerProduct")
    shape = {"fan_in": 25088, "num_output": 4096, "batch": 1}
    params = 25088 * 4096 + 4096
    mode, why = Planner("auto", cost_model=CostModel.preset("25gbe"), ranks=2).decide(
        ip, params, **shape)
    assert mode == MODEL and "predicted comm DATA" in why and "P=2" in why
    mode, why = Planner("auto", ranks=2).decide(ip, params, **shape)
    assert mode == MODEL and "no calibration or network given, threshold rule" in why
    ip.parallel_mode = caffe_pb2.LayerParameter.AUTO
    mode, why = Planner("data", cost_model=CostModel.from_alpha_beta(1.0, 1e-15),
                        ranks=8).decide(ip, params, fan_in=4096, num_output=1000, batch=1)
    assert mode == DATA and why.startswith("parallel_mode: AUTO; predicted comm")


def test_rules_leave_a_transposed_inner_product_data_parallel():
    """MODEL splits the weight by output rows: hybrid's threshold and AUTO run a big
    transpose: true layer DATA and say why; asking for MODEL stays an error."""
    from caffepar.errors import NetError
    from caffepar.parallel.plan import Planner
    from caffepar.proto import caffe_pb2
    ip = caffe_pb2.LayerParameter(name="fc", type="InnerProduct")
    ip.inner_product_param.transpose = True
    shape = {"fan_in": 25088, "num_output": 4096, "batch": 1}
    for planner in (Planner("hybrid"), Planner("auto", ranks=2),
                    Planner("auto", cost_model=CostModel.preset("10gbe"), ranks=2)):
        mode, why = planner.decide(ip, 25088 * 4096 + 4096, **shape)
        assert mode == DATA and "MODEL needs transpose: false" in why, why
    ip.parallel_mode = caffe_pb2.LayerParameter.MODEL
    planner = Planner("hybrid")
    mode, _why = planner.decide(ip, 25088 * 4096 + 4096, **shape)
    with pytest.raises(NetError, match="needs transpose: false"):
        planner.check(ip, mode, transpose=True)


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 3e-6, 0.25e-9
    samples = [(p, n, alpha * hops("allgather", p) + beta * traffic("allgather", p, n))
               for p in (2, 4) for n in (4, 4096, 2 ** 20, 2 ** 24)]
    a, b = fit_alpha_beta("allgather", samples)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_calibration_file_round_trip(tmp_path):
    fits = {p: {op: (1e-6 * p, 1e-10 * (i + 1)) for i, op in enumerate(OPS)} for p in (2, 8)}
    model = CostModel(fits, "here", "tcp", {"P2": {"load_before": 0.5}})
    path = tmp_path / "c.json"
    model.save(path)
    back = CostModel.load(path)
    assert back.fits == fits and back.transport == "tcp" and back.info == model.info
    assert back.fit_for(4) == fits[2] and back.fit_for(6) == fits[8]
    assert back.fit_for(1000) == fits[8]
    more = back.merged(CostModel({4: fits[2]}, "four", "tcp"))
    assert sorted(more.fits) == [2, 4, 8]


def test_presets_are_the_cited_figures():
    for name, (alpha, beta, _source) in NETWORKS.items():
        model = CostModel.preset(name)
        assert model.alpha_beta("alltoall", 64) == (alpha, beta)
    assert 1 / NETWORKS["100gb-ib"][1] > 1 / NETWORKS["25gbe"][1] > 1 / NETWORKS["10gbe"][1]


def _run(args, capsys):
    from caffepar.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(args)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


@pytest.mark.parametrize("content, message", [
    ("{", "not a calibration file (bad JSON"),
    ('{"format": "other"}', "not a valid calibration file"),
    ('{"format": "caffepar-calibration/1", "fits": {"2": {"allreduce": {}}}}',
     "not a valid calibration file (missing"),
    ('{"format": "caffepar-calibration/1", "fits": {"2": ' + json.dumps(
        {op: {"alpha_s": -1, "beta_s_per_byte": 1e-9} for op in OPS}) + "}}",
     "alpha and beta must be finite and >= 0"),
    (None, "cannot read calibration"),
])
def test_bad_calibration_file_is_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    code, _out, err = _run(["plan", "--model", str(VGG), "--np", "4", "--calibration",
                            str(path)], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_lab_presets_are_the_lab_calibrations():
    """The lab's presets are the allreduce fits `caffepar calibrate` made on the lab's links."""
    for rate in ("100mbit", "1gbit"):
        path = ROOT / "results" / f"calibration_netlab_{rate}.json"
        alpha, beta = CostModel.load(path).alpha_beta("allreduce", 2)
        preset_alpha, preset_beta, _ = NETWORKS[f"lab-{rate}"]
        assert abs(preset_beta / beta - 1) < 0.01 and abs(preset_alpha - alpha) < 0.1e-6, rate


def test_unknown_network_is_one_line(capsys):
    code, _out, err = _run(["plan", "--model", str(VGG), "--np", "4", "--network", "5g"],
                           capsys)
    assert code == 1
    assert err.strip().splitlines() == [
        "caffepar: error: unknown network '5g': expected one of 10gbe, 25gbe, 100gb-ib, "
        "lab-100mbit, lab-1gbit "
        "(or --alpha/--beta, --calibration)"]


def test_plan_at_4096_ranks_is_quick_and_predicts_every_plan(tmp_path):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", "plan", "--model", str(VGG),
                           "--np", "4096", "--network", "25gbe", "--parallel", "auto"],
                          capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert seconds < 5, f"plan --np 4096 took {seconds:.1f} s"
    out = proc.stdout
    assert "Predicted per iteration at P=4096, batch 4 per rank" in out
    for plan in ("DATA", "HYBRID", "AUTO"):
        assert f"\n  {plan} " in out
    assert "fc6, fc7" in out           # HYBRID's threshold rule splits fc6 and fc7


def test_predicted_iteration_comm_by_hand():
    from caffepar.parallel.plan import LayerPlan
    plans = [LayerPlan("conv", "Convolution", 1000, DATA, ""),
             LayerPlan("fc", "InnerProduct", 2000, MODEL, "", 100, 20, 4)]
    model = CostModel.from_alpha_beta(1e-6, 1e-9)
    modes = {"conv": DATA, "fc": MODEL}
    want = model.collective_ms("allreduce", 4, 4000) + layer_comm_ms(model, 100, 20, 4, 4,
                                                                      MODEL)
    assert iteration_comm_ms(plans, modes, model, 4) == pytest.approx(want)
    modes["fc"] = DATA
    assert iteration_comm_ms(plans, modes, model, 4) == pytest.approx(
        model.collective_ms("allreduce", 4, 12000))


def test_profile_file_gives_the_compute(tmp_path, capsys):
    from caffepar.timing import PROFILE_FORMAT
    net = tmp_path / "net.prototxt"
    net.write_text("""
layer { name: "data" type: "DummyData" top: "x" dummy_data_param { shape { dim: 8 dim: 16 } } }
layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 4 } }
""")
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"format": PROFILE_FORMAT, "batch": 4, "cpus": 2,
                                   "forward_ms": {"data": 1.0, "fc": 2.0},
                                   "backward_ms": {"data": 0.0, "fc": 3.0}}))
    code, out, _err = _run(["plan", "--model", str(net), "--np", "16", "--alpha", "0",
                            "--beta", "1e-9", "--profile-file", str(profile)], capsys)
    assert code == 0
    # 6 ms at batch 4, scaled to the net's batch 8: 12 ms.
    assert "forward + backward 12.0 ms at batch 8 per rank" in out
    data_line = next(l for l in out.splitlines() if l.startswith("  DATA "))
    assert data_line.split()[1] == "12.0"
    options = {l.split()[0]: l.split()[1:] for l in out.split("Gradient options")[1].splitlines()
               if l.startswith("  ") and not l.startswith("  option")}
    assert list(options) == ["plain", "overlap", "overlap+merge", "top-k", "hierarchical"]
    # One small layer: plain = compute 12 ms + its allreduce, as the DATA plan above.
    assert float(options["plain"][0]) == pytest.approx(float(data_line.split()[3]), abs=0.05)
    assert "Optimal merge (--merge auto): buckets [fc: 0.3 KiB]" in out
    profile.write_text("{}")
    code, _out, err = _run(["plan", "--model", str(net), "--profile-file", str(profile),
                            "--network", "10gbe"], capsys)
    assert code == 1 and "not a caffepar profile" in err


def test_time_saves_the_profile_plan_reads(tmp_path, capsys):
    """`caffepar time --save-profile` writes the per-layer ms it printed; plan takes its
    compute from them."""
    from caffepar.timing import load_profile
    net = tmp_path / "net.prototxt"
    net.write_text("""
layer { name: "data" type: "DummyData" top: "x" dummy_data_param { shape { dim: 8 dim: 64 } } }
layer { name: "fc" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 32 } }
""")
    profile = tmp_path / "p.json"
    code, out, _err = _run(["time", "--model", str(net), "--iterations", "2",
                            "--save-profile", str(profile)], capsys)
    assert code == 0 and f"Wrote the profile to {profile}" in out
    doc = load_profile(profile)
    assert doc["batch"] == 8 and doc["iterations"] == 2
    assert list(doc["forward_ms"]) == ["data", "fc"]
    printed = {l.split()[0]: float(l.split()[2]) for l in out.splitlines()
               if "\tforward:" in l}
    assert printed == {k: pytest.approx(v, abs=5e-5) for k, v in doc["forward_ms"].items()}
    code, out, _err = _run(["plan", "--model", str(net), "--np", "8", "--network", "25gbe",
                            "--profile-file", str(profile)], capsys)
    total = sum(doc["forward_ms"].values()) + sum(doc["backward_ms"].values())
    assert code == 0 and f"forward + backward {total:.1f} ms at batch 8 per rank" in out
    code, _out, err = _run(["time", "--model", str(net), "--np", "2", "--save-profile",
                            str(profile)], capsys)
    assert code == 2 and "--save-profile times one process" in err


MPIEXEC = find_mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec installed")


@needs_mpi
def test_calibrate_writes_a_file_plan_reads(tmp_path):
    out = tmp_path / "cal.json"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    command = [sys.executable, "-m", "caffepar.cli", "calibrate", "--np", "2", "--max-mb",
               "0.25", "--repeats", "3", "-o", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    model = CostModel.load(out)
    assert set(model.fits) == {2} and model.transport == "shm"
    assert set(model.fits[2]) == set(OPS)
    assert all(b > 0 for _a, b in model.fits[2].values())
    samples = model.info["P2"]["samples"]["allreduce"]
    assert [b for b, _s in samples][:3] == [8, 16, 64]       # 4 B rounds up to one per rank
    from mpi4py import MPI        # the MPI library in use is named, in the output and the file
    library = " ".join(MPI.Get_library_version().replace("\0", " ").splitlines()[0].split())
    assert f"MPI: {library} (MPI " in proc.stdout and "; launched by mpiexec" in proc.stdout
    assert model.info["P2"]["mpi"].startswith(f"MPI: {library}")
    proc = subprocess.run(command[:-2] + ["--transport", "tcp", "-o", str(out)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "holds a shm calibration" in proc.stderr


@needs_mpi
def test_calibrate_on_one_rank_is_one_line(tmp_path):
    proc = subprocess.run([MPIEXEC, "-n", "1", sys.executable, "-m", "caffepar.cli",
                           "calibrate", "-o", str(tmp_path / "c.json")],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, CAFFEPAR_MPI="1"))
    assert proc.returncode == 1 and not (tmp_path / "c.json").exists()
    assert "it needs 2 or more" in proc.stderr.strip().splitlines()[-1]


@needs_mpi
@pytest.mark.parametrize("batch, beta, split", [(1, 1e-9, True), (64, 1e-15, False)])
def test_auto_run_takes_the_cost_models_choice(tmp_path, batch, beta, split):
    """`time --np 2 --parallel auto`: fc runs MODEL (its comm shows on its line) where the
    model predicts MODEL cheaper, DATA otherwise."""
    net = tmp_path / "net.prototxt"
    net.write_text(f"""
layer {{ name: "data" type: "DummyData" top: "x" top: "label"
        dummy_data_param {{ shape {{ dim: {batch} dim: 512 }} shape {{ dim: {batch} }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param {{ num_output: 512 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }}
""")
    alpha = "0" if beta > 1e-12 else "1"
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", "time", "--model", str(net),
                           "--np", "2", "--iterations", "1", "--parallel", "auto",
                           "--alpha", alpha, "--beta", str(beta)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    fc_backward = next(l for l in proc.stdout.splitlines() if "fc\tbackward" in l)
    assert ("comm:" in fc_backward) == split, proc.stdout


def test_merge_auto_plans_with_the_cost_model():
    """Latency-bound: every layer's gradients travel in one bucket; bandwidth-bound with
    backward slower than communication: a bucket per layer, each sent while the layers below
    run backward."""
    from caffepar.parallel.buckets import Unit
    from caffepar.parallel.schedule import merge_buckets
    units = [Unit(f"l{i}", i, i * 1000, (i + 1) * 1000, i) for i in (3, 2, 1, 0)]
    backward_ms = [10.0, 10.0, 10.0, 10.0]
    latency = CostModel.from_alpha_beta(1e-2, 1e-15)
    buckets, (before, after) = merge_buckets(units, backward_ms, latency, 8)
    assert len(buckets) == 1 and after < before
    bandwidth = CostModel.from_alpha_beta(0.0, 1e-9)
    buckets, (before, after) = merge_buckets(units, backward_ms, bandwidth, 8)
    assert len(buckets) == 4 and after == before
