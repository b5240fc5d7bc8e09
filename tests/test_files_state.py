"""Files and state a run leaves or reads: weights and solver states cut short are refused, stale
temp files of a killed write are cleaned, a resumed run keeps the log CSV and the test nets'
data positions, written files get the umask's permissions, and write errors (disk full, HDF5)
are one line naming the file."""
import csv
import errno
import os

import h5py
import numpy as np
import pytest

import caffepar as caffe
from caffepar.cli import main
from caffepar.errors import SolverError, WeightsError
from caffepar.io import weights as weights_io
from caffepar.proto import caffe_pb2

NET = """
name: "small"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "list.txt" batch_size: 4 } }
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "list.txt" batch_size: 5 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

SOLVER = """net: "net.prototxt"
base_lr: 0.1
momentum: 0.9
lr_policy: "fixed"
max_iter: {max_iter}
test_iter: 2
test_interval: 3
display: 1
snapshot: {snapshot}
snapshot_prefix: "snap/small"
random_seed: 11
"""


def workdir(folder, max_iter=8, snapshot=4):
    """37 samples: test batches of 5 never line up with the set, so where the test net's reader
    stands after each test matters."""
    rng = np.random.RandomState(1)
    with h5py.File(folder / "d.h5", "w") as f:
        f["data"] = rng.randn(37, 7).astype(np.float32)
        f["label"] = rng.randint(0, 3, 37).astype(np.float32)
    (folder / "list.txt").write_text("d.h5\n")
    (folder / "net.prototxt").write_text(NET)
    (folder / "solver.prototxt").write_text(SOLVER.format(max_iter=max_iter, snapshot=snapshot))
    (folder / "snap").mkdir(exist_ok=True)
    return folder


def train(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--solver", "solver.prototxt"] + [str(a) for a in argv])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def read_csv(path):
    with open(path, newline="") as f:
        return [{k: v for k, v in row.items() if k != "seconds" and k != "data_wait_s"}
                for row in csv.DictReader(f)]


def one_line(err):
    """The error report among the log lines (which go to stderr as Caffe's do)."""
    lines = [line for line in err.splitlines() if "error" in line and not line.startswith("I")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------ cut short
def test_weights_cut_between_layers_are_refused_unless_allow_missing(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(workdir(tmp_path))
    assert train(["--iterations", 2], capsys)[0] == 0
    whole = caffe_pb2.NetParameter.FromString((tmp_path / "snap/small_iter_2.caffemodel")
                                              .read_bytes())
    cut = caffe_pb2.NetParameter()
    cut.CopyFrom(whole)
    names = [lp.name for lp in cut.layer]
    del cut.layer[names.index("ip2"):]      # a file cut at the boundary before layer ip2
    (tmp_path / "cut.caffemodel").write_bytes(cut.SerializeToString())
    code, _out, err = train(["--iterations", 1, "--weights", "cut.caffemodel"], capsys)
    assert code == 1
    line = one_line(err)
    assert "cut.caffemodel" in line and "no weights for layer(s) ip2" in line
    assert "--allow-missing" in line
    code, _out, err = train(["--iterations", 1, "--weights", "cut.caffemodel",
                             "--allow-missing"], capsys)
    assert code == 0, err
    net = caffe.Net("net.prototxt", caffe.TEST)
    with pytest.raises(WeightsError, match="ip2"):
        weights_io.copy_weights_files(net, ["cut.caffemodel"], allow_missing=False)
    # a file that holds everything is fine, and so is weights from two files between them
    rest = caffe_pb2.NetParameter()
    rest.layer.extend(lp for lp in whole.layer if lp.name == "ip2")
    (tmp_path / "rest.caffemodel").write_bytes(rest.SerializeToString())
    weights_io.copy_weights_files(net, ["cut.caffemodel", "rest.caffemodel"],
                                  allow_missing=False)
    np.testing.assert_array_equal(net.params["ip2"][0].data,
                                  np.array(rest.layer[0].blobs[0].data).reshape(3, 6))


@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_solver_state_cut_anywhere_is_refused(tmp_path, monkeypatch, fmt):
    monkeypatch.chdir(workdir(tmp_path))
    with open("solver.prototxt", "a") as f:
        f.write(f"snapshot_format: {fmt}\n")
    solver = caffe.get_solver("solver.prototxt")
    solver.step(3)
    _model, state_path = solver.snapshot()
    data = open(state_path, "rb").read()
    caffe.get_solver("solver.prototxt").restore(state_path)
    if fmt == "HDF5":
        with h5py.File(state_path, "a") as f:
            del f["history/3"]
        with pytest.raises(SolverError, match="truncated solver state: it holds 3 of its 4 "
                                              "history blobs"):
            caffe.get_solver("solver.prototxt").restore(state_path)
        return
    # One solver for every cut: restore reads and checks the whole file before it sets
    # anything (a solver built per cut took 90% of the test's time).
    solver = caffe.get_solver("solver.prototxt")
    for n in range(0, len(data)):
        with open("cut.solverstate", "wb") as f:
            f.write(data[:n])
        with pytest.raises(SolverError, match="cut short|cannot decode"):
            solver.restore("cut.solverstate")


def test_truncated_state_on_the_command_line_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(workdir(tmp_path))
    assert train(["--iterations", 4], capsys)[0] == 0
    data = (tmp_path / "snap/small_iter_4.solverstate").read_bytes()
    (tmp_path / "cut.solverstate").write_bytes(data[:len(data) * 2 // 3])
    code, _out, err = train(["--snapshot", "cut.solverstate"], capsys)
    assert code == 1
    assert one_line(err).startswith("caffepar: cut.solverstate: error: ")


def test_empty_weights_file_is_one_line_saying_so(tmp_path, monkeypatch, capsys):
    """A 0-byte --weights parses as a caffemodel of no layers: said as what it is, not as every
    layer missing."""
    monkeypatch.chdir(workdir(tmp_path))
    (tmp_path / "empty.caffemodel").write_bytes(b"")
    code, _out, err = train(["--iterations", 1, "--weights", "empty.caffemodel"], capsys)
    assert code == 1
    assert one_line(err) == ("caffepar: empty.caffemodel: error: empty file (0 bytes: cut short "
                             "while being written or copied?)")


def test_missing_snapshot_folder_is_named_before_training(tmp_path, monkeypatch, capsys):
    """snapshot_prefix in a folder that does not exist: refused before the first iteration,
    naming that folder (not a temp file of the CSV written in it), also without `snapshot:`;
    a folder removed mid-run is named too."""
    monkeypatch.chdir(workdir(tmp_path))
    (tmp_path / "solver.prototxt").write_text(
        SOLVER.format(max_iter=3, snapshot=0).replace("snap/small", "gone/small"))
    code, _out, err = train([], capsys)
    assert code == 1
    assert one_line(err) == ('caffepar: gone: error: no such folder, for snapshot_prefix '
                             '"gone/small"; create it, or change snapshot_prefix in '
                             'solver.prototxt')
    assert "Iteration" not in err
    with pytest.raises(OSError) as info:
        weights_io.atomic_write("gone/small_log.csv", lambda f: f.write(b"x"))
    assert info.value.errno == errno.ENOENT and info.value.filename == "gone"


# ------------------------------------------------------------------------ temp files
def test_stale_temp_files_of_the_prefix_are_removed_at_start(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(workdir(tmp_path))
    snap = tmp_path / "snap"
    stale = [".small_iter_8.caffemodel.k2j4x9_a.tmp", ".small_iter_8.solverstate.q0w8e7r6.tmp",
             ".small_log.csv.abcd1234.tmp", ".tmp_a1b2c3d4small_iter_4.caffemodel"]
    others = [".other_iter_8.caffemodel.k2j4x9_a.tmp", "notes.tmp", "small_iter_2.caffemodel"]
    for name in stale + others:
        (snap / name).write_bytes(b"x" * 1000)
    code, _out, err = train(["--iterations", 1], capsys)
    assert code == 0, err
    left = set(os.listdir(snap))
    assert not left & set(stale) and set(others) <= left
    assert "Removed 4 temp file(s)" in err


def test_temp_files_are_hidden_from_snapshot_globs(tmp_path, monkeypatch):
    """kill -9 mid-write leaves the temp file: `*.caffemodel` must not pick it up."""
    seen = []

    def writer(f):
        seen.extend(os.listdir(tmp_path))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        weights_io.atomic_write(tmp_path / "m_iter_5.caffemodel", writer)
    [name] = seen
    assert name.startswith(".m_iter_5.caffemodel.") and name.endswith(".tmp")
    assert weights_io.temp_name_pattern("m_iter_").fullmatch(name)
    assert not list(tmp_path.glob("*.caffemodel")) and not list(tmp_path.glob("*"))


# ------------------------------------------------------------------------ resume
def test_resume_keeps_the_csv_and_the_test_outputs(tmp_path, monkeypatch, capsys):
    (tmp_path / "straight").mkdir()
    (tmp_path / "resumed").mkdir()
    straight = workdir(tmp_path / "straight")
    monkeypatch.chdir(straight)
    assert train([], capsys)[0] == 0
    whole = read_csv(straight / "snap/small_log.csv")
    assert [int(r["iter"]) for r in whole] == list(range(8))

    resumed = workdir(tmp_path / "resumed")
    monkeypatch.chdir(resumed)
    assert train(["--iterations", 5], capsys)[0] == 0      # snapshots at 4 and 5
    assert train(["--snapshot", "snap/small_iter_4.solverstate"], capsys)[0] == 0
    again = read_csv(resumed / "snap/small_log.csv")
    assert [int(r["iter"]) for r in again] == list(range(8))
    tests = [k for k in whole[0] if k.startswith("test/")]
    assert tests and any(r[tests[0]] for r in whole[4:])    # tests after the resume point
    assert again == whole


# ------------------------------------------------------------------------ permissions
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_umask_permissions(tmp_path, monkeypatch, capsys, umask):
    monkeypatch.chdir(workdir(tmp_path))
    old = os.umask(umask)
    try:
        assert train(["--iterations", 4], capsys)[0] == 0
        with pytest.raises(SystemExit) as exit_info:
            main(["convert", "npz", "snap/small_iter_4.caffemodel", "small.npz"])
        assert exit_info.value.code == 0, capsys.readouterr()
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    for name in ["snap/small_iter_4.caffemodel", "snap/small_iter_4.solverstate",
                 "snap/small_log.csv", "small.npz"]:
        assert oct(os.stat(name).st_mode & 0o777) == oct(expected), name
    # rewriting a file keeps the mode its owner gave it
    os.chmod("small.npz", 0o600)
    weights_io.atomic_write("small.npz", lambda f: f.write(b"x"))
    assert os.stat("small.npz").st_mode & 0o777 == 0o600


# ------------------------------------------------------------------------ write errors
def test_disk_full_names_the_file_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(workdir(tmp_path))

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as info:
        weights_io.atomic_write(tmp_path / "snap/x.caffemodel", full)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(tmp_path / "snap/x.caffemodel")
    assert os.listdir(tmp_path / "snap") == []

    real = weights_io.atomic_write

    def full_disk(path, writer, binary=True):
        if str(path).endswith(".caffemodel"):
            return real(path, full, binary)
        return real(path, writer, binary)

    monkeypatch.setattr(weights_io, "atomic_write", full_disk)
    code, _out, err = train(["--iterations", 4], capsys)
    assert code == 1
    line = one_line(err)
    assert line == (f"caffepar: {os.path.abspath('snap/small_iter_4.caffemodel')}: error: "
                    "No space left on device") or \
        line == "caffepar: snap/small_iter_4.caffemodel: error: No space left on device", line


def test_hdf5_write_errors_are_one_line_naming_the_file(tmp_path, monkeypatch):
    def broken(tmp):
        with h5py.File(tmp, "w") as f:
            f["x"] = np.zeros(3)
        raise RuntimeError("Can't write data (file write failed: time = Tue Nov 24, "
                           "filename = 'x', file descriptor = 5, errno = 28, error message = "
                           "'No space left on device')\nmore HDF5 detail")

    with pytest.raises(OSError) as info:
        weights_io.atomic_write(tmp_path / "m.caffemodel.h5", broken, binary=False)
    assert info.value.errno == errno.ENOSPC and info.value.strerror == os.strerror(errno.ENOSPC)
    assert info.value.filename == str(tmp_path / "m.caffemodel.h5")
    assert os.listdir(tmp_path) == []

    def odd(tmp):
        raise RuntimeError("Unable to create dataset (name already exists)\nstack")

    with pytest.raises(OSError) as info:
        weights_io.atomic_write(tmp_path / "m.caffemodel.h5", odd, binary=False)
    assert str(info.value.strerror) == "Unable to create dataset (name already exists)"

    def full(tmp):      # h5py's error on a full disk: HDF5's text, whose time stamp ends a line
        raise OSError(errno.ENOSPC, "Can't synchronously write data (file write failed: time = Wed Nov "
                           "25 21:10:24 2026\n, filename = 'x', file descriptor = 4, errno = "
                           "28, error message = 'No space left on device', buf = 0x5582)")

    with pytest.raises(OSError) as info:
        weights_io.atomic_write(tmp_path / "m.caffemodel.h5", full, binary=False)
    assert info.value.errno == errno.ENOSPC and info.value.strerror == os.strerror(errno.ENOSPC)
