"""Parallel jobs end cleanly: signals to the `--np` launcher (or its whole process group) mean
what they mean to one process, with the same exit status; killing the launcher, a rank or the
process manager, a hung rank (the watchdog), a rank killed by a signal (named with it) and a
rank that exits on its own end every process of the job, each reported once as one line naming
the rank, with none of the process manager's own lines; a SIGTERM ends the job before a
scheduler's SIGKILL, and no job folder outlives its job."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from caffepar.parallel.launch import find_mpiexec
from caffepar.parallel.ranks import process_alive

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec installed"),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="finds a job's processes through /proc")]

NET = """
name: "tiny"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "train_list.txt" batch_size: 8 } }
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "train_list.txt" batch_size: 16 } }
layer { name: "fault" type: "Python" bottom: "data" top: "x"
        python_param { module: "faults" layer: "Fault" param_str: 'FAULT' } }
layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "ip1"
        inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""

SOLVER = """
net: "net.prototxt"
test_iter: 2
test_interval: 50
base_lr: 0.05
lr_policy: "fixed"
display: 10
max_iter: {max_iter}
snapshot_prefix: "snap/tiny"
random_seed: 3
"""


def workdir(folder, fault=None, max_iter=100000, sleep=0.01):
    """A net whose every forward waits `sleep` s (a run a signal catches mid-way without
    burning the machine's cores) and does `fault` on one rank."""
    rng = np.random.RandomState(0)
    with h5py.File(folder / "train.h5", "w") as f:
        f["data"] = rng.randn(72, 10).astype(np.float32)
        f["label"] = rng.randint(0, 3, 72).astype(np.float32)
    (folder / "train_list.txt").write_text("train.h5\n")
    conf = dict(fault or {}, sleep=sleep, pids=str(folder / "pids"))
    (folder / "pids").mkdir(exist_ok=True)
    (folder / "net.prototxt").write_text(NET.replace("FAULT", json.dumps(conf)))
    (folder / "solver.prototxt").write_text(SOLVER.format(max_iter=max_iter))
    (folder / "snap").mkdir(exist_ok=True)
    return folder


class Run:
    """`caffepar train` in its own process group, its merged output collected as it comes."""

    def __init__(self, folder, ranks=2, args=(), command=None):
        path = os.pathsep.join(filter(None, [str(HERE / "mpi"), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "caffepar.cli", "train", "--solver", "solver.prototxt"]
        cmd += (["--np", str(ranks)] if ranks > 1 else []) + [str(a) for a in args]
        cmd = command or cmd
        self.folder, self.ranks = folder, ranks
        self.proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.seen = set()

    def _read(self):
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    @property
    def output(self):
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, text, count=1, timeout=60):
        """Until `count` lines contain `text`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while sum(text in line for line in self.lines) < count:
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None or \
                    sum(text in line for line in self.lines) >= count, \
                    f"no {count} line(s) with {text!r}:\n{''.join(self.lines)[-3000:]}"
                self.changed.wait(min(left, 0.5))

    def processes(self):
        """The launcher's processes (mpiexec, proxies, ranks), remembered for cleaning up."""
        found = descendants(self.proc.pid)
        self.seen.update(found)
        return found

    def rank_pids(self, timeout=60):
        """{rank: (pid, parent pid)} written by the fault layer."""
        deadline = time.monotonic() + timeout
        while True:
            files = {int(p.stem[4:]): p for p in (self.folder / "pids").glob("rank*.pid")}
            if len(files) == self.ranks:
                pids = {r: tuple(map(int, p.read_text().split())) for r, p in files.items()}
                self.seen.update(pid for pid, _ in pids.values())
                return pids
            assert time.monotonic() < deadline, "the ranks did not start:\n" + self.output
            time.sleep(0.1)

    def finish(self, timeout):
        """The exit status, waiting at most `timeout` s (then the run is killed and fails)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-3000:]}")
        self.reader.join(timeout)
        return code

    def kill(self):
        for pid in [self.proc.pid] + sorted(self.seen):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def descendants(pid):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def wait_until(fn, timeout):
    """fn()'s first true value within `timeout` s (else its last, false, one)."""
    deadline = time.monotonic() + timeout
    while not (value := fn()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def all_ended(pids, timeout):
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return [p for p in pids if process_alive(p)]
        time.sleep(0.1)
    return []


@pytest.fixture
def run(tmp_path):
    """Start runs with run(folder, ...); whatever they leave behind is killed afterwards."""
    started = []

    def start(*args, **kwargs):
        started.append(Run(*args, **kwargs))
        return started[-1]

    yield start
    for r in started:
        if r.proc.poll() is None or any(process_alive(p) for p in r.seen):
            r.kill()


def snapshots(folder):
    return sorted(int(p.name.split("_iter_")[1].split(".")[0])
                  for p in (folder / "snap").glob("tiny_iter_*.solverstate"))


#: A log line, in glog's format (Caffe's): I1128 08:41:50.403989 23998 file.py:156] ...
LOG_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ ]+:\d+\] ")


def error_lines(output):
    """The lines a user reads as the job's verdict (log lines, warnings among them, aside)."""
    return [line for line in output.splitlines()
            if ("caffepar:" in line and not LOG_LINE.match(line)) or line == "aborted"]


#: What the process manager prints of its own: never in a job's output.
RAW_MPI = re.compile(r"^\[(proxy|mpiexec)[:@]|^YOUR APPLICATION TERMINATED|^=+$|"
                     r"BAD TERMINATION|^Please see the FAQ page", re.M)


def raw_mpi_lines(output):
    return [m.group(0) for m in RAW_MPI.finditer(output)]


def job_folders(launcher_pid):
    """The job folders of the launcher with this pid."""
    import tempfile
    return list(Path(tempfile.gettempdir()).glob(f"caffepar-job-{launcher_pid}-*"))


# ------------------------------------------------------------------------ signals
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("how", ["launcher", "group"])
def test_sigint_twice_snapshots_and_stops_as_one_process(tmp_path, run, ranks, how):
    """Ctrl-C (to the launcher, or to its whole process group as a terminal sends it), twice:
    one snapshot, "stopped early", exit status 0, as one process."""
    job = run(workdir(tmp_path), ranks)
    job.wait_for("Iteration 20,")
    send = (lambda s: os.killpg(job.proc.pid, s)) if how == "group" else job.proc.send_signal
    send(signal.SIGINT)
    job.wait_for("Signal SIGINT received")
    send(signal.SIGINT)
    assert job.finish(60) == 0, job.output
    assert "Optimization stopped early." in job.output
    assert len(snapshots(tmp_path)) == 1
    assert error_lines(job.output) == []


@pytest.mark.parametrize("ranks", [1, 2])
def test_sighup_snapshots_and_goes_on_as_one_process(tmp_path, run, ranks):
    job = run(workdir(tmp_path), ranks)
    job.wait_for("Iteration 20,")
    job.proc.send_signal(signal.SIGHUP)
    job.wait_for("Signal SIGHUP received: snapshot")
    first = wait_until(lambda: snapshots(tmp_path), 30)
    assert len(first) == 1
    job.wait_for(f"Iteration {first[0] + 20 - first[0] % 10},")    # still training
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(60) == 0, job.output
    assert len(snapshots(tmp_path)) == 2


def test_one_signal_reaching_ranks_at_different_iterations_is_one_snapshot(tmp_path, run):
    job = run(workdir(tmp_path))
    pids = job.rank_pids()
    job.wait_for("Iteration 20,")
    os.kill(pids[0][0], signal.SIGHUP)
    first = wait_until(lambda: snapshots(tmp_path), 30)
    assert len(first) == 1
    job.wait_for(f"Iteration {first[0] + 20 - first[0] % 10},")
    os.kill(pids[1][0], signal.SIGHUP)      # the same signal, late on rank 1
    job.wait_for(f"Iteration {first[0] + 40 - first[0] % 10},")
    assert snapshots(tmp_path) == first
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(60) == 0, job.output
    assert len(snapshots(tmp_path)) == 2


def test_sigterm_to_launcher_ends_every_process_with_a_snapshot(tmp_path, run):
    job = run(workdir(tmp_path))
    job.wait_for("Iteration 20,")
    processes = job.processes()
    assert len(processes) >= 3      # mpiexec, its proxy, two ranks
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(10) == 0, job.output
    assert all_ended(processes, 10 - (time.monotonic() - t0)) == []
    assert len(snapshots(tmp_path)) == 1 and "Optimization stopped early." in job.output


def test_sigkill_to_launcher_leaves_nothing_running(tmp_path, run):
    """The launcher cannot act on SIGKILL: mpiexec gets SIGTERM from the kernel and the ranks
    snapshot and stop; their output still comes (the relay outlives the launcher), and the
    relay removes the job folder the launcher could not."""
    job = run(workdir(tmp_path))
    job.wait_for("Iteration 20,")
    processes = job.processes()
    assert job_folders(job.proc.pid)
    job.proc.kill()
    assert all_ended(processes, 20) == []
    assert len(snapshots(tmp_path)) == 1
    job.reader.join(10)
    assert "Signal SIGTERM received" in job.output and not raw_mpi_lines(job.output)
    assert job_folders(job.proc.pid) == []


# ------------------------------------------------------------------------ failures
KILLED = {
    "kill": (137, r"\[rank 1\] caffepar: killed by SIGKILL \(kill -9, or the kernel's "
                  r"out-of-memory killer\)"),
    "segv": (139, r"\[rank 1\] caffepar: killed by SIGSEGV \(segmentation fault\) at "
                  r"faults\.py:\d+, in forward, calling string_at"),
}


@pytest.mark.parametrize("how", sorted(KILLED))
def test_killed_rank_ends_the_job_naming_it_and_the_signal(tmp_path, run, how):
    """kill -9 of rank 1, or a segmentation fault in its layer: one line naming the rank and
    the signal (and, for a fault, where), status 128 + the signal's number; nothing of the
    process manager's (its banner would blame the SIGKILL that ended the other rank)."""
    job = run(workdir(tmp_path, {"rank": 1, "at": 25, "do": "segv"} if how == "segv" else None))
    pids = job.rank_pids()
    job.wait_for("Iteration 20,")
    processes = job.processes()
    t0 = time.monotonic()
    if how == "kill":
        os.kill(pids[1][0], signal.SIGKILL)
    code, expected = KILLED[how]
    assert job.finish(30) == code, job.output[-3000:]
    assert time.monotonic() - t0 < 30
    assert all_ended(processes, 10) == []
    lines = error_lines(job.output)
    assert len(lines) == 1 and re.fullmatch(expected, lines[0]), job.output[-3000:]
    assert raw_mpi_lines(job.output) == [] and "Fatal Python error" not in job.output
    assert job_folders(job.proc.pid) == []


def test_killed_process_manager_ends_the_job(tmp_path, run):
    job = run(workdir(tmp_path))
    pids = job.rank_pids()
    job.wait_for("Iteration 20,")
    processes = job.processes()
    os.kill(pids[1][1], signal.SIGKILL)     # the proxy that started the ranks
    assert job.finish(30) != 0
    assert all_ended(processes, 10) == []
    lines = error_lines(job.output)
    assert len(lines) == 1 and re.fullmatch(r"\[ranks? [0-9, ]+\] caffepar: lost its process "
                                            r"manager \(its parent process ended\); stopped",
                                            lines[0]), job.output[-3000:]
    assert raw_mpi_lines(job.output) == [], job.output[-3000:]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_hung_rank_ends_within_the_watchdog_time(tmp_path, run):
    """One line for the job naming the rank that did not come; the rank that waits for it
    sleeps meanwhile (MPICH's own wait spins a core)."""
    job = run(workdir(tmp_path, {"rank": 1, "at": 25, "do": "hang"}), args=["--watchdog", 5])
    pids = job.rank_pids()
    job.wait_for("Iteration 20,")
    processes = job.processes()
    t0 = time.monotonic()
    time.sleep(1.5)
    used = cpu_seconds(pids[0][0])
    time.sleep(2)
    share = (cpu_seconds(pids[0][0]) - used) / 2
    assert share < 0.2, f"the waiting rank used {share:.0%} of a core"
    assert job.finish(60) == 1
    assert time.monotonic() - t0 < 5 + 30
    assert all_ended(processes, 10) == []
    lines = error_lines(job.output)
    assert len(lines) == 1, job.output
    assert re.fullmatch(r"caffepar: rank 1 \(is at #\d+\) stopped before collective #\d+ "
                        r"\(\w+ .*\); rank 0 waited \d+ s there; ended the job", lines[0]), lines[0]


@pytest.mark.parametrize("fault", ["hang", "frozen"])
def test_sigterm_ends_a_job_blocked_by_a_hung_rank_before_a_schedulers_sigkill(tmp_path, run,
                                                                                fault):
    """As a batch scheduler at its time limit (`timeout -k 10`): SIGTERM to the launcher's
    process group while rank 1 hangs in a layer (`frozen`: stopped by SIGSTOP, so that its
    watchdog cannot answer either) and rank 0 waits for it. No rank can stop at an iteration's
    end; the job ends anyway, in one line (from the ranks' watchdog, else from the launcher),
    before the SIGKILL that would follow 10 s later, leaving no process and no job folder."""
    sigkill_after = 10                      # timeout -k 10, docker stop
    job = run(workdir(tmp_path, {"rank": 1, "at": 25, "do": "hang"} if fault == "hang" else None))
    pids = job.rank_pids()
    job.wait_for("Iteration 20,")
    if fault == "frozen":
        os.kill(pids[1][0], signal.SIGSTOP)
        time.sleep(2)                       # rank 0 comes to wait for it
    else:
        assert wait_until(lambda: (tmp_path / "pids/rank1.hangs").exists(), 30)
        time.sleep(0.5)                     # rank 0 comes to wait for it
    processes = job.processes()
    t0 = time.monotonic()
    os.killpg(job.proc.pid, signal.SIGTERM)
    assert job.finish(sigkill_after) == 1, job.output[-3000:]
    assert time.monotonic() - t0 < sigkill_after
    assert all_ended(processes, 5) == [], job.output
    lines = error_lines(job.output)
    assert len(lines) == 1 and "SIGTERM" in lines[0], lines
    assert re.search(r"\brank 1\b" if fault == "hang" else r"\branks 0, 1\b", lines[0]), lines
    assert raw_mpi_lines(job.output) == [] and job_folders(job.proc.pid) == []


def test_rank_stuck_holding_the_interpreter_lock_ends(tmp_path, run):
    """Every rank stuck in a C call that holds the interpreter lock: no watchdog thread can
    run, and no rank ends, so nothing ends the job but the last resort that needs no lock. It
    ends within its time (--watchdog 2, plus the grace), reported in one line naming where."""
    from caffepar.parallel.comm import Watchdog
    job = run(workdir(tmp_path, {"rank": "all", "at": 25, "do": "gil", "seconds": 120}),
              args=["--watchdog", 2])
    job.rank_pids()
    job.wait_for("Iteration 20,")
    processes = job.processes()
    t0 = time.monotonic()
    assert job.finish(60) == 1
    assert time.monotonic() - t0 < 2 + Watchdog.GRACE + 10
    assert all_ended(processes, 10) == []
    lines = error_lines(job.output)
    assert len(lines) == 1, job.output[-3000:]
    assert re.fullmatch(r"\[ranks? [0-9, ]+\] caffepar: stuck 12 s in compiled code that holds "
                        r"the interpreter lock \(faults\.py:\d+, in forward\); ended",
                        lines[0]), lines[0]
    assert "Traceback" not in job.output and "Timeout" not in job.output


def test_snapshot_slower_than_the_watchdog_is_waited_for(tmp_path, run):
    """Rank 0 writes the snapshot (made slower than --watchdog here) while rank 1 waits at the
    barrier after it: rank 0 says it is busy, so rank 1 waits on; the run ends 0 with a whole
    snapshot."""
    from caffepar.io.weights import read_caffemodel
    from caffepar.solvers.snapshot import read_binary
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import time\n"
        "import caffepar.solvers.solver as s\n"
        "_save = s.save_caffemodel\n"
        "def slow(*args, **kwargs):\n"
        "    time.sleep(5)\n"
        "    return _save(*args, **kwargs)\n"
        "s.save_caffemodel = slow\n")
    folder = workdir(tmp_path, max_iter=12)
    os.environ["PYTHONPATH"], before = os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")])), os.environ.get("PYTHONPATH")
    try:
        job = run(folder, args=["--watchdog", 2])
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    assert job.finish(60) == 0, job.output[-3000:]
    assert error_lines(job.output) == [], job.output[-3000:]
    assert snapshots(folder) == [12]
    model = read_caffemodel(str(folder / "snap/tiny_iter_12.caffemodel")).by_name()
    assert [b[0].size for b in model["ip1"] + model["ip2"]] == [160, 16, 48, 3]
    assert read_binary(str(folder / "snap/tiny_iter_12.solverstate")).iter == 12


def test_watchdog_limit_adapts_to_the_job():
    """Without --watchdog: FIRST seconds in the first iteration, then FACTOR times the longest
    computation between two collectives, never below FLOOR."""
    from types import SimpleNamespace
    from caffepar.parallel.comm import Watchdog
    dog = Watchdog.__new__(Watchdog)
    dog.timeout, dog.comm = None, SimpleNamespace(warm=False, longest_gap=0.0)
    assert dog.limit() == Watchdog.FIRST >= 120
    dog.comm.warm = True
    dog.comm.longest_gap = 0.05                 # cifar10_quick: ends within 2 minutes
    assert dog.limit() == Watchdog.FLOOR < 120 - 2 * Watchdog.GRACE
    dog.comm.longest_gap = 10.0
    assert dog.limit() == 10.0 * Watchdog.FACTOR
    dog.timeout = 0
    assert dog.limit() is None
    dog.timeout = 30
    assert dog.limit() == 30


def test_watchdog_leaves_a_slow_rank_alone(tmp_path, run):
    job = run(workdir(tmp_path, {"rank": 1, "at": 5, "do": "slow", "seconds": 2}, max_iter=12),
              args=["--watchdog", 4])
    assert job.finish(60) == 0, job.output
    assert snapshots(tmp_path) == [12]


@pytest.mark.parametrize("fault, expected", [
    ("memory", r"\[rank 1\] caffepar: error: out of memory$"),
    ("sys.exit", r"\[rank 1\] caffepar: exited \(status 0\) before the job finished$"),
    ("exit0", r"\[rank 1\] caffepar: exited \(os._exit\(0\)\) before the job finished$"),
])
def test_rank_failure_is_one_line_naming_the_rank(tmp_path, run, fault, expected):
    job = run(workdir(tmp_path, {"rank": 1, "at": 3, "do": fault}))
    job.rank_pids()
    processes = job.processes()
    assert job.finish(60) == 1
    assert all_ended(processes, 10) == []
    lines = error_lines(job.output)
    assert len(lines) == 1 and re.match(expected, lines[0]), job.output
    assert "Traceback" not in job.output


# ------------------------------------------------------------------------ one prefix, one run
def test_second_run_on_a_prefix_is_refused(tmp_path, run):
    first = run(workdir(tmp_path), ranks=1)
    first.wait_for("Iteration 20,")
    second = run(tmp_path, ranks=1)
    assert second.finish(60) == 1
    lines = error_lines(second.output)
    assert len(lines) == 1 and "snap/tiny.lock: error: caffepar run " in lines[0], lines
    assert f"run {first.proc.pid} " in lines[0] and "wait for it to end" in lines[0]
    assert first.proc.poll() is None
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish(60) == 0
    assert not (tmp_path / "snap/tiny.lock").exists()


# ------------------------------------------------------------------------ signals at startup
@pytest.mark.parametrize("ranks, sig, after", [(1, "SIGINT", 0.3), (2, "SIGINT", 0.3),
                                               (2, "SIGHUP", 1.2)])
def test_signal_while_starting_is_honoured(tmp_path, run, ranks, sig, after):
    """A signal that comes while the command imports, starts MPI or builds the net is kept
    until the solver runs, then acted on as ever: no traceback, and no transport taking
    SIGHUP as its own (UCX's debug logging)."""
    job = run(workdir(tmp_path), ranks)
    time.sleep(after)
    job.proc.send_signal(getattr(signal, sig))
    job.wait_for(f"Signal {sig} received")
    first = wait_until(lambda: snapshots(tmp_path), 30)
    assert len(first) == 1
    if sig == "SIGHUP":
        job.wait_for(f"Iteration {first[0] + 20 - first[0] % 10},")    # still training
        job.proc.send_signal(signal.SIGTERM)
    assert job.finish(60) == 0, job.output
    assert "Optimization stopped early." in job.output
    assert "Traceback" not in job.output and "UCX" not in job.output, job.output[-3000:]
    assert error_lines(job.output) == []


def test_stale_job_folders_are_removed(tmp_path):
    """A launcher killed by SIGKILL leaves its job folder; the next launch removes it (and
    not the folder of a launcher still running)."""
    from caffepar.parallel import launch
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"caffepar-job-{gone}-abc"
    live = tmp_path / f"caffepar-job-{os.getpid()}-def"
    old = tmp_path / "caffepar-job-x1y2z3"                  # named without a pid
    for folder in (stale, live, old):
        folder.mkdir()
        (folder / "rank0.pid").write_text(f"{gone} host\n")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    launch.remove_stale_job_folders(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def test_relay_passes_the_ranks_lines_and_drops_the_process_managers(tmp_path):
    """The relay between mpiexec and the launcher's output: every line of the ranks as it came
    (a line cut across reads, an unfinished line at the end, blank lines), none of hydra's
    (its diagnostics, its banner and the blank lines before it), from both streams."""
    from caffepar.parallel import relay
    ranks = (b"I1128 solver.py:1] Iteration 0, loss = 2.3\n\n"
             b"[rank 1] caffepar: killed by SIGKILL\n  indented\n= not a banner\n")
    hydra = (b"\n\n" + b"=" * 83 + b"\n=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n"
             b"=   PID 1 RUNNING AT vm\n" + b"=" * 83 + b"\n"
             b"YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n"
             b"This typically refers to a problem with your application.\n"
             b"Please see the FAQ page for debugging suggestions\n"
             b"[proxy:0@vm] HYD_pmcd_pmip_control_cmd_cb (proxy/pmip_cb.c:1): assert failed\n"
             b"[mpiexec@node-1] control_cb (pmiserv_cb.c:280): assert (!closed) failed\n")
    written = {}
    for name, data in (("out", ranks + hydra + b"last, unfinished"), ("err", hydra + ranks)):
        r, w = os.pipe()
        target = tmp_path / name
        with open(target, "wb") as f:
            pid = os.fork()
            if pid == 0:                        # the writer, in pieces cut mid-line
                os.close(r)
                for i in range(0, len(data), 7):
                    os.write(w, data[i:i + 7])
                os._exit(0)
            os.close(w)
            relay.relay([relay.Stream(r, f.fileno())])
            os.waitpid(pid, 0)
            os.close(r)
        written[name] = target.read_bytes()
    assert written == {"out": ranks + b"last, unfinished", "err": ranks}


def test_line_for_a_rank_killed_by_a_signal_names_where():
    """From the stacks Python's faulthandler writes at a fatal signal: the innermost frame of
    the user's or caffepar's code, and the call into a library it was in."""
    from caffepar.parallel.supervise import death_line
    stacks = ('Fatal Python error: Segmentation fault\n\nThread 0x7f01 (most recent call '
              'first):\n  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
              'Current thread 0x7f02 (most recent call first):\n'
              f'  File "{os.path.dirname(os.__file__)}/ctypes/__init__.py", line 519 in '
              'string_at\n  File "/home/u/net/layers.py", line 12 in forward\n'
              f'  File "{HERE.parent}/caffepar/nn/python_layer.py", line 30 in forward\n\n'
              'Extension modules: numpy.core._multiarray_umath\n')
    assert death_line(1, signal.SIGSEGV, stacks) == (
        "[rank 1] caffepar: killed by SIGSEGV (segmentation fault) at layers.py:12, in "
        "forward, calling string_at")
    assert death_line(0, signal.SIGBUS) == "[rank 0] caffepar: killed by SIGBUS (bus error)"
    assert death_line(3, signal.SIGKILL) == ("[rank 3] caffepar: killed by SIGKILL (kill -9, or "
                                             "the kernel's out-of-memory killer)")


@pytest.mark.parametrize("fault", ["memory", "hang", "kill", "segv", "sys.exit", "exit0",
                                   "nan", "sigterm"])
def test_plain_mpiexec_status_tells_the_failure(tmp_path, fault):
    """Under a plain `mpiexec -n 2 caffepar train` (a cluster's launch) a job that ends badly
    exits non-zero, with one line naming the rank, also when a rank ends its process with
    status 0 (MPICH's mpiexec would exit 0), and when it is killed by a signal: its supervising
    parent names the signal and ends the job with status 128 + its number, before hydra's
    clean-up and without its banner. SIGTERM to mpiexec snapshots and stops: status 0, as one
    process."""
    own = fault in ("kill", "sigterm")
    folder = workdir(tmp_path, None if own else {"rank": 1, "at": 12, "do": fault})
    path = os.pathsep.join(filter(None, [str(HERE / "mpi"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    debug = ["--debug"] if fault == "segv" else []      # the crash's stacks in full too
    proc = subprocess.Popen([find_mpiexec(), "-n", "2", sys.executable, "-m", "caffepar.cli"] +
                            debug + ["train", "--solver", "solver.prototxt", "--watchdog", "2"],
                            cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if own:
            assert wait_until(lambda: (folder / "pids/rank1.pid").exists(), 60)
            time.sleep(1)
            if fault == "kill":
                os.kill(int((folder / "pids/rank1.pid").read_text().split()[0]),
                        signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if fault == "sigterm":
        assert proc.returncode == 0 and len(snapshots(folder)) == 1, out[-2000:]
        assert error_lines(out) == [], out[-2000:]
        return
    lines = error_lines(out)
    if fault in KILLED:
        assert proc.returncode == KILLED[fault][0], out[-2000:]
        assert len(lines) == 1 and re.fullmatch(KILLED[fault][1], lines[0]), out[-2000:]
        assert ("Fatal Python error: Segmentation fault" in out) == bool(debug), out[-2000:]
    elif fault == "nan":      # every rank sees the loss; each names its first non-finite top
        assert proc.returncode == 1, out[-2000:]
        assert all("the loss is nan" in line for line in lines), out[-2000:]
        assert any(line.startswith("[rank 1]") and '"fault"' in line for line in lines)
    else:
        assert proc.returncode == 1, out[-2000:]
        assert len(lines) == 1 and "rank 1" in lines[0], out[-2000:]
    assert "Traceback" not in out and raw_mpi_lines(out) == [], out[-2000:]


@pytest.mark.parametrize("record, killed, grace", [
    (None, True, False), ("1\n[rank 1] caffepar: error\n", True, True), ("0\n", False, False)])
def test_launcher_ends_the_others_once_it_saw_which_rank_ended(tmp_path, record, killed, grace):
    """hydra's clean-up is off under the launcher (it killed the other ranks before the
    launcher could see which ended first): a rank that ended without finishing, with no end
    record or a failure's, has the launcher end the others (after a grace that lets them report
    the same error, when the first gave one); one that finished does not."""
    from caffepar.parallel.launch import Job, _own_cleanup, find_mpiexec
    assert _own_cleanup(find_mpiexec()) == ["-disable-auto-cleanup"]       # the mpich wheel's
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        job = Job(["mpiexec"], {}, str(tmp_path), 2)
        job.pids = {0: other.pid, 1: 1 << 22}
        job.gone = [1]
        if record:
            (tmp_path / "rank1.end").write_text(record)
        job._end_after_failure()
        if grace:
            assert other.poll() is None and not job.ending
            job.failed_since -= Job.FAILURE_GRACE
            job._end_after_failure()
        ended = other.wait(10) if killed else other.poll()
        assert (ended == -signal.SIGKILL) if killed else ended is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("gone", [[1, 0], [0, 1]])
def test_rank_that_vanished_first_is_blamed_not_the_one_whose_mpi_failed(tmp_path, capsys, gone):
    """kill -9 of rank 1: rank 0's MPI then fails too and reports it, in one line (not MPICH's
    error stack); the job's line names rank 1, which ended without a word, also when the
    launcher saw both end at once (in either order)."""
    from mpi4py import MPI
    from caffepar.cli import failure
    from caffepar.parallel.launch import Job
    stack = MPI.Exception(MPI.ERR_OTHER)
    code, line = failure(stack)
    assert code == 1 and line == ("caffepar: MPI failed (Other MPI error): another rank, or the "
                                  "link to it, is gone?")
    job = Job(["mpiexec"], {}, str(tmp_path), 2)
    (tmp_path / "rank0.end").write_text(f"1\n[rank 0] {line}\n")
    job.proc = subprocess.Popen(["true"])
    job.proc.wait()
    job.gone = gone
    assert job._report() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[rank 1] caffepar: ended before the job finished")


def test_parallel_package_imports_have_no_circle():
    """Every import between caffepar.parallel's modules (also those inside functions) points one
    way: the package reads top-down (ranks.py under both launch.py and comm.py)."""
    import ast
    folder = HERE.parent / "caffepar" / "parallel"
    graph = {}
    for path in folder.glob("*.py"):
        mine = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            mine.update(n.split(".")[2] for n in names
                        if n.startswith("caffepar.parallel.") and n.count(".") >= 2)

    def reaches(start, goal, seen=()):
        return any(m == goal or (m not in seen and reaches(m, goal, seen + (m,)))
                   for m in graph.get(start, ()))
    circles = sorted(m for m in graph if reaches(m, m))
    assert not circles, f"modules on an import circle: {circles}"
    assert {"launch", "comm"} & graph["ranks"] == set() and "ranks" in graph["comm"] & \
        graph["launch"]
