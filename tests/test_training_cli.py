"""`caffepar train / test / data / plot` as a user runs them: Caffe's flags and log lines, the CSV,
a real SIGINT mid-run that snapshots and resumes to the uninterrupted result, a kill during a
snapshot write that leaves the previous snapshot intact."""
import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from caffepar.io.weights import read_caffemodel
from conftest import DATA, need_shared

ROOT = Path(__file__).resolve().parents[1]

NET = """
name: "tiny"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "train_list.txt" batch_size: 8 } }
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "train_list.txt" batch_size: 16 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

SOLVER = """
net: "net.prototxt"
test_iter: 2
test_interval: 50
base_lr: 0.05
momentum: 0.9
lr_policy: "fixed"
display: 10
max_iter: {max_iter}
snapshot: 0
snapshot_prefix: "snap/tiny"
random_seed: 3
"""


@pytest.fixture
def workdir(tmp_path):
    rng = np.random.RandomState(0)
    x = rng.randn(72, 10).astype(np.float32)
    y = (np.abs(x[:, 0]) * 2).astype(int).clip(0, 2).astype(np.float32)
    with h5py.File(tmp_path / "train.h5", "w") as f:
        f["data"], f["label"] = x, y
    (tmp_path / "train_list.txt").write_text("train.h5\n")
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "snap").mkdir()
    return tmp_path


def caffepar(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "caffepar.cli"] + [str(a) for a in args],
                          cwd=cwd, capture_output=True, text=True, timeout=120, **kw)


def final_weights(path):
    return {(n, i): v for n, _t, blobs in read_caffemodel(path).layers
            for i, (v, _s, _l) in enumerate(blobs)}


def test_train_logs_like_caffe_writes_csv_and_plots(workdir):
    (workdir / "solver.prototxt").write_text(SOLVER.format(max_iter=60))
    proc = caffepar(["train", "-solver", "solver.prototxt", "-gpu", "0", "--csv", "run.csv"],
                    workdir)
    assert proc.returncode == 0, proc.stderr
    log = proc.stderr
    assert "caffepar computes on the CPU" in log
    assert "Iteration 10 (" in log and "iter/s" in log and "), loss = " in log
    assert "Test net output #0: accuracy = " in log
    assert "Snapshotting to binary proto file snap/tiny_iter_60.caffemodel" in log
    assert "Optimization Done." in log
    rows = list(csv.DictReader(open(workdir / "run.csv")))
    assert len(rows) == 60 and rows[0]["iter"] == "0" and float(rows[5]["lr"]) == 0.05
    assert any(r.get("test/accuracy") for r in rows)
    (workdir / "train.log").write_text(log)
    for source in ("run.csv", "train.log"):
        plot = caffepar(["plot", source, f"{source}.png"], workdir)
        if "matplotlib" in plot.stderr:
            pytest.skip("matplotlib not installed")
        assert plot.returncode == 0, plot.stderr
        assert (workdir / f"{source}.png").stat().st_size > 1000
    test = caffepar(["test", "--model", "net.prototxt", "--weights",
                     "snap/tiny_iter_60.caffemodel", "--iterations", "3"], workdir)
    assert test.returncode == 0, test.stderr
    assert "Batch 2, accuracy = " in test.stderr
    assert "] accuracy = " in test.stderr and "] loss = " in test.stderr.splitlines()[-1]


def test_sigint_snapshots_and_resume_matches_uninterrupted_run(workdir):
    (workdir / "solver.prototxt").write_text(SOLVER.format(max_iter=100000))
    proc = subprocess.Popen([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                             "solver.prototxt"], cwd=workdir, stderr=subprocess.PIPE, text=True)
    seen = 0
    for line in proc.stderr:
        if "Iteration" in line and "loss" in line:
            seen += 1
            if seen == 5:
                proc.send_signal(signal.SIGINT)
                break
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0, rest
    assert "Optimization stopped early." in rest
    states = sorted(workdir.glob("snap/tiny_iter_*.solverstate"))
    assert len(states) == 1
    stopped_at = int(states[0].name.split("_iter_")[1].split(".")[0])
    assert stopped_at >= 40
    target = stopped_at + 37
    (workdir / "solver_b.prototxt").write_text(SOLVER.format(max_iter=target))
    resumed = caffepar(["train", "--solver", "solver_b.prototxt", "--snapshot", states[0]],
                       workdir)
    assert resumed.returncode == 0, resumed.stderr
    resumed_w = final_weights(workdir / f"snap/tiny_iter_{target}.caffemodel")
    os.rename(workdir / f"snap/tiny_iter_{target}.caffemodel", workdir / "resumed.caffemodel")
    straight = caffepar(["train", "--solver", "solver_b.prototxt"], workdir)
    assert straight.returncode == 0, straight.stderr
    straight_w = final_weights(workdir / f"snap/tiny_iter_{target}.caffemodel")
    for key in straight_w:
        assert np.array_equal(resumed_w[key], straight_w[key]), key


WRITER = """
import sys, time
import caffepar as caffe
from caffepar.io import weights
net = caffe.Net(sys.argv[1], caffe.TEST)
net.save(sys.argv[2])
print("first snapshot written", flush=True)
real = weights.iter_net_chunks
def slow_chunks(*a, **k):
    for i, chunk in enumerate(real(*a, **k)):
        if i == 3:
            print("writing second snapshot", flush=True)
            time.sleep(60)
        yield chunk
weights.iter_net_chunks = slow_chunks
for blobs in net.params.values():
    blobs[0].data[...] = 7
net.save(sys.argv[2])
"""


def test_kill_during_snapshot_write_keeps_previous_snapshot(workdir):
    model = ROOT / "tests/bad_inputs/small.prototxt"
    target = workdir / "snap.caffemodel"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(model), str(target)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first snapshot written"
    first = target.read_bytes()
    assert proc.stdout.readline().strip() == "writing second snapshot"
    proc.kill()
    proc.wait(timeout=30)
    assert target.read_bytes() == first
    assert all(v.max() != 7 for v in final_weights(target).values())


def test_data_tools_cli_build_a_trainable_lmdb(tmp_path):
    sample = need_shared(DATA / "cifar10_jpeg/sample")
    db = tmp_path / "sample_lmdb"
    proc = caffepar(["data", "imageset", sample, sample / "list.txt", db, "--resize_height",
                     "32", "--resize_width", "32", "--shuffle"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    mean = tmp_path / "mean.binaryproto"
    proc = caffepar(["data", "mean", db, mean], tmp_path)
    assert proc.returncode == 0, proc.stderr
    import caffepar as caffe
    arr = caffe.io.blobproto_to_array(caffe.proto.caffe_pb2.BlobProto.FromString(
        mean.read_bytes()))
    assert arr.shape == (1, 3, 32, 32) and 50 < arr.mean() < 200
