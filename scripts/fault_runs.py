#!/usr/bin/env python
"""Fault runs: caffepar under signals at every phase, killed, crashed and hung ranks with
default settings, a killed process manager or launcher, a scheduler's SIGTERM then SIGKILL,
files cut short or empty, a missing snapshot folder, a full disk and huge nets; each way a few
times, checking that it ends as the README says.

    python scripts/fault_runs.py [--out results/reliability] [--runs 3] [--resume] [--only ROW]

Each row is a kind of run: how many runs, how many ended as documented (exit status, snapshot,
the one line; for every run of MPI ranks also none of the process manager's own lines), the
seconds from the fault to the end (median and largest), the message a user reads, and the raw
MPI lines counted in the runs' output. Runs are small (a tiny net of two InnerProduct layers,
cifar10_quick on DummyData) and use the test suite's fault layer (tests/mpi/faults.py). Writes
OUT.csv (one line per run, kept by --resume) and OUT.md. The disk-full and network lab rows
need root.
"""
import argparse
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_jobs import (Run, all_ended, error_lines, job_folders, raw_mpi_lines,  # noqa: E402
                       snapshots, wait_until, workdir)

FIELDS = ["row", "run", "documented", "seconds", "message", "detail", "raw_mpi_lines"]


def verdict(text):
    """The lines a user reads as the verdict (log lines, warnings among them, aside)."""
    return error_lines(text)


def raw(out):
    """How many of the process manager's own lines (hydra's [proxy:...], [mpiexec@...], its
    banner) the output holds."""
    return len(raw_mpi_lines(out))


def cifar_workdir(folder, fault):
    """cifar10_quick on DummyData with the fault layer after the data layer."""
    text = (ROOT / "models/cifar10_quick/train_val_dummy.prototxt").read_text()
    layer = ('layer { name: "fault" type: "Python" bottom: "data" top: "fdata" python_param { '
             f"module: \"faults\" layer: \"Fault\" param_str: '{json.dumps(fault)}' }} }}\n")
    text = text.replace('  bottom: "data"\n  top: "conv1"', '  bottom: "fdata"\n  top: "conv1"')
    first = text.index("layer {", text.index("layer {") + 1)
    (folder / "net.prototxt").write_text(text[:first] + layer + text[first:])
    (folder / "solver.prototxt").write_text(
        'net: "net.prototxt"\nbase_lr: 0.001\nmomentum: 0.9\nlr_policy: "fixed"\ndisplay: 10\n'
        'max_iter: 100000\nsnapshot_prefix: "snap/tiny"\nrandom_seed: 1\n')
    (folder / "snap").mkdir(exist_ok=True)
    (folder / "pids").mkdir(exist_ok=True)
    return folder


# ------------------------------------------------------------------------ the rows
def signal_at(sig, ranks, when):
    """`sig` to the launcher at a phase: startup (a delay), first iteration, steady state or
    during a snapshot; SIGHUP snapshots and goes on (then SIGTERM ends the run), others snapshot
    and stop. Documented: exit 0, the snapshots, no traceback nor UCX lines."""
    def run(folder):
        sleep = 0.05 if when == "snapshot" else 0.01
        workdir(folder, sleep=sleep)
        if when == "snapshot":      # a snapshot every 10 iterations, of a wider net
            text = (folder / "net.prototxt").read_text().replace("num_output: 16",
                                                                 "num_output: 4096")
            (folder / "net.prototxt").write_text(text)
            with open(folder / "solver.prototxt", "a") as f:
                f.write("snapshot: 10\n")
        job = Run(folder, ranks)
        if isinstance(when, float):
            time.sleep(when)
        elif when == "first iteration":
            job.wait_for("Iteration 0,", timeout=120)
        elif when == "steady":
            job.wait_for("Iteration 30,", timeout=120)
        else:
            job.wait_for("Snapshotting to", timeout=120)
        before = len(snapshots(folder))
        t0 = time.monotonic()
        job.proc.send_signal(getattr(signal, sig))
        try:
            job.wait_for(f"Signal {sig} received", timeout=120)
            if sig == "SIGHUP":
                wait_until(lambda: len(snapshots(folder)) > before, 60)
                job.proc.send_signal(signal.SIGTERM)
            code = job.finish(120)
        except AssertionError as e:
            job.kill()
            return False, time.monotonic() - t0, "no sign of the signal", str(e)[-300:]
        seconds = time.monotonic() - t0
        out = job.output
        ok = (code == 0 and len(snapshots(folder)) > before and "Traceback" not in out
              and "UCX" not in out and not verdict(out) and not raw(out))
        message = f"exit {code}; {len(snapshots(folder)) - before} snapshot(s)" + \
            ("; Optimization stopped early." if "stopped early" in out else "")
        return ok, seconds, message, "", raw(out)
    return run


def killed_rank(folder):
    """kill -9 of rank 1 under --np: status 137, one line naming rank 1 and SIGKILL."""
    workdir(folder)
    job = Run(folder, 2)
    pids = job.rank_pids(120)
    job.wait_for("Iteration 20,", timeout=120)
    processes = job.processes()
    t0 = time.monotonic()
    os.kill(pids[1][0], signal.SIGKILL)
    code = job.finish(120)
    seconds = time.monotonic() - t0
    lines = verdict(job.output)
    ok = code == 137 and len(lines) == 1 and lines[0].startswith("[rank 1]") and \
        "killed by SIGKILL" in lines[0] and not all_ended(processes, 10) and \
        "error stack" not in job.output and not raw(job.output) and \
        not job_folders(job.proc.pid)
    return ok, seconds, lines[0] if lines else f"exit {code}", \
        f"exit {code}, {len(lines)} line(s)", raw(job.output)


def killed_process_manager(folder):
    """SIGKILL to hydra's proxy, the process manager of both ranks, under --np: the ranks
    snapshot and stop and the job ends non-zero in one line; hydra's complaints (4 lines from
    mpiexec) are not shown."""
    workdir(folder)
    job = Run(folder, 2)
    pids = job.rank_pids(120)
    job.wait_for("Iteration 20,", timeout=120)
    processes = job.processes()
    t0 = time.monotonic()
    os.kill(pids[1][1], signal.SIGKILL)
    code = job.finish(120)
    seconds = time.monotonic() - t0
    lines = verdict(job.output)
    ok = code == 1 and len(lines) == 1 and "lost its process manager" in lines[0] and \
        not all_ended(processes, 10) and not raw(job.output) and not job_folders(job.proc.pid)
    return ok, seconds, lines[0] if lines else f"exit {code}", \
        f"exit {code}, {len(lines)} line(s)", raw(job.output)


def scheduler_timeout(folder):
    """`timeout -k 10 600 caffepar train --np 2` told to stop (SIGTERM to timeout, as at its
    time limit) while rank 1 hangs in a layer and rank 0 waits: the job ends in one line
    before timeout's SIGKILL 10 s later, every process and the job folder gone."""
    workdir(folder, {"rank": 1, "at": 25, "do": "hang"})
    cmd = ["timeout", "-k", "10", "600", sys.executable, "-m", "caffepar.cli", "train",
           "--solver", "solver.prototxt", "--np", "2"]
    job = Run(folder, 2, command=cmd)
    job.rank_pids(120)
    job.wait_for("Iteration 20,", timeout=120)
    time.sleep(2)
    launcher = [p for p in job.processes() if _cmdline(p).startswith(sys.executable)][0]
    processes = job.processes()
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    code = job.finish(60)
    seconds = time.monotonic() - t0
    lines = verdict(job.output)
    left = all_ended(processes, 10)
    ok = code == 1 and seconds < 10 and len(lines) == 1 and "SIGTERM" in lines[0] and \
        not left and not raw(job.output) and not job_folders(launcher)
    return ok, seconds, lines[0] if lines else f"exit {code}", \
        f"exit {code}; job folder left: {bool(job_folders(launcher))}", raw(job.output)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def hung_rank(net):
    """Rank 1 hangs in a layer; no --watchdog: the default ends the job within 2 minutes."""
    def run(folder):
        fault = {"rank": 1, "at": 25, "do": "hang", "pids": str(folder / "pids")}
        if net == "cifar10_quick":
            cifar_workdir(folder, fault)
        else:
            workdir(folder, {"rank": 1, "at": 25, "do": "hang"})
        job = Run(folder, 2)
        pids = job.rank_pids(180)
        job.wait_for("Iteration 20," if net == "tiny" else "Iteration 10,", timeout=300)
        processes = job.processes()
        t0 = time.monotonic()
        time.sleep(5)
        usage = _cpu(pids[0][0])
        time.sleep(10)
        share = (_cpu(pids[0][0]) - usage) / 10
        code = job.finish(240)
        seconds = time.monotonic() - t0
        lines = verdict(job.output)
        ok = code == 1 and len(lines) == 1 and "rank 1" in lines[0] and seconds < 120 and \
            not all_ended(processes, 10) and not raw(job.output)
        return ok, seconds, lines[0] if lines else f"exit {code}", \
            f"waiting rank used {100 * share:.1f}% of a core", raw(job.output)
    return run


def lost_launcher(folder):
    """A batch scheduler at its time limit, with a short grace: SIGTERM to the launcher,
    SIGKILL 4 s later, while rank 1 hangs and rank 0 waits: every process gone within seconds,
    the job folder too (removed by the relay the launcher leaves)."""
    workdir(folder, {"rank": 1, "at": 25, "do": "hang"})
    job = Run(folder, 2)
    job.rank_pids(120)
    job.wait_for("Iteration 20,", timeout=120)
    time.sleep(2)
    processes = job.processes()
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    time.sleep(4)
    job.proc.kill()
    left = all_ended(processes, 60)
    seconds = time.monotonic() - t0
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    job.reader.join(10)
    folders = wait_until(lambda: not job_folders(job.proc.pid), 10)
    ok = not left and folders and not raw(job.output)
    return ok, seconds, "every process ended" if not left else \
        f"{len(left)} process(es) still running after 60 s", \
        f"job folder removed: {folders}", raw(job.output)


def cut_file(kind, ranks=1):
    """A weights file, solver state or prototxt cut short (or `empty`: a 0-byte weights file):
    refused in one line naming it; with --np 2, naming every rank that read it."""
    def run(folder):
        workdir(folder)
        subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                        "solver.prototxt", "--iterations", "10"], cwd=folder, env=_env(),
                       capture_output=True, timeout=300)
        (folder / "solver.prototxt").write_text(
            (folder / "solver.prototxt").read_text().replace("max_iter: 100000", "max_iter: 20"))
        target = {"caffemodel": folder / "snap/tiny_iter_10.caffemodel",
                  "empty": folder / "snap/tiny_iter_10.caffemodel",
                  "solverstate": folder / "snap/tiny_iter_10.solverstate",
                  "prototxt": folder / "net.prototxt"}[kind]
        data = target.read_bytes()
        target.write_bytes(b"" if kind == "empty" else data[:len(data) * 2 // 3])
        args = {"caffemodel": ["--weights", "snap/tiny_iter_10.caffemodel"],
                "empty": ["--weights", "snap/tiny_iter_10.caffemodel"],
                "solverstate": ["--snapshot", "snap/tiny_iter_10.solverstate"],
                "prototxt": []}[kind] + (["--np", str(ranks)] if ranks > 1 else [])
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                               "solver.prototxt"] + args, cwd=folder, env=_env(),
                              capture_output=True, text=True, timeout=300)
        lines = verdict(done.stderr)
        ok = done.returncode == 1 and len(lines) == 1 and target.name in lines[0] and \
            "Traceback" not in done.stderr and not raw(done.stdout + done.stderr) and \
            ("empty file" in lines[0] if kind == "empty" else True) and \
            (lines[0].startswith("[ranks 0, 1] ") if ranks > 1 else True)
        return ok, time.monotonic() - t0, lines[0] if lines else f"exit {done.returncode}", "", \
            raw(done.stdout + done.stderr)
    return run


def missing_snapshot_folder(folder):
    """snapshot_prefix in a folder that does not exist: refused before the first iteration in
    one line naming that folder (not a temp file written in it)."""
    workdir(folder)
    (folder / "solver.prototxt").write_text(
        (folder / "solver.prototxt").read_text().replace('"snap/tiny"', '"gone/tiny"'))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                           "solver.prototxt"], cwd=folder, env=_env(), capture_output=True,
                          text=True, timeout=300)
    lines = verdict(done.stderr)
    ok = done.returncode == 1 and len(lines) == 1 and lines[0].startswith("caffepar: gone: ") \
        and ".tmp" not in lines[0] and "Iteration" not in done.stderr
    return ok, time.monotonic() - t0, lines[0] if lines else f"exit {done.returncode}", ""


def lab_run(killed):
    """`netlab run` of 2 nodes (a lab made for the run), to its end, or (killed) SIGKILLed
    mid-run and followed by `netlab down`: no job folder of its launcher is left, nor a
    namespace of the lab."""
    def run(folder):
        from caffepar import netlab
        if netlab.missing_privileges():
            return None
        workdir(folder, max_iter=40 if not killed else 100000, sleep=0.02)
        name = f"fr{os.getpid() % 10000}"
        cmd = [sys.executable, "-m", "caffepar.cli", "netlab", "run", "--name", name,
               "--nodes", "2", "--", "train", "--solver", "solver.prototxt"]
        job = Run(folder, 2, command=cmd)
        t0 = time.monotonic()
        try:
            if killed:
                job.wait_for("Iteration 20,", timeout=180)
                t0 = time.monotonic()
                job.kill()
                subprocess.run([sys.executable, "-m", "caffepar.cli", "netlab", "down",
                                "--name", name], env=_env(), capture_output=True, timeout=120)
                code = "killed"
            else:
                code = job.finish(300)
        finally:
            netlab.down(name)
        seconds = time.monotonic() - t0
        folders = job_folders(job.proc.pid)
        ok = (killed or code == 0) and not folders and not netlab.lab_namespaces(name) and \
            (killed or not raw(job.output))
        return ok, seconds, f"exit {code}; job folders left: {len(folders)}", "", \
            None if killed else raw(job.output)
    return run


def disk_full(fmt):
    """Snapshots onto a 64 KB tmpfs: one line naming the file, no partial file left."""
    def run(folder):
        if os.geteuid() != 0:
            return None
        mount = Path(tempfile.mkdtemp(prefix="caffepar-full-"))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                       check=True)
        try:
            workdir(folder)
            text = (folder / "net.prototxt").read_text().replace("num_output: 16",
                                                                 "num_output: 8000")
            (folder / "net.prototxt").write_text(text)
            (folder / "solver.prototxt").write_text(
                (folder / "solver.prototxt").read_text()
                .replace("max_iter: 100000", "max_iter: 2")
                .replace('snapshot_prefix: "snap/tiny"', f'snapshot_prefix: "{mount}/tiny"')
                + ("snapshot_format: HDF5\n" if fmt == "HDF5" else ""))
            t0 = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                                   "solver.prototxt"], cwd=folder, env=_env(),
                                  capture_output=True, text=True, timeout=300)
            lines = verdict(done.stderr)
            left = [p.name for p in mount.iterdir() if not p.name.endswith(".csv")]
            ok = done.returncode == 1 and len(lines) == 1 and \
                "No space left on device" in lines[0] and not left
            return ok, time.monotonic() - t0, \
                lines[0].replace(str(mount), "<tmpfs>") if lines else f"exit {done.returncode}", \
                f"left: {left}"
        finally:
            subprocess.run(["umount", str(mount)])
            mount.rmdir()
    return run


def huge_net(layers):
    """`convert info` on a chain of `layers` ReLU layers: progress of parse and build, and the
    memory each layer takes (peak RSS of the process over its layers)."""
    def run(folder):
        path = folder / "chain.prototxt"
        with open(path, "w") as f:
            f.write('layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 '
                    'dim: 4 } } }\n')
            for i in range(layers):
                f.write(f'layer {{ name: "r{i}" type: "ReLU" bottom: "x" top: "x" }}\n')
        base = subprocess.run([sys.executable, "-c", "import resource, caffepar.graph.net; "
                               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                              capture_output=True, text=True, env=_env()).stdout
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-c", "import resource, sys\n"
                               "from caffepar.cli import main\n"
                               "try:\n    main(['convert', 'info', sys.argv[1]])\n"
                               "finally:\n    print('maxrss', resource.getrusage("
                               "resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)", str(path)],
                              capture_output=True, text=True, env=_env(), timeout=1200)
        seconds = time.monotonic() - t0
        peak = int(re.search(r"maxrss (\d+)", done.stderr).group(1))
        per_layer = (peak - int(base)) * 1024 / layers
        progress = [l for l in done.stderr.splitlines() if l.startswith(("Parsing", "Building"))]
        ok = done.returncode == 0 and any(l.startswith("Building") for l in progress)
        return ok, seconds, progress[-1].replace(str(path), "chain.prototxt") if progress else \
            "no progress shown", f"{per_layer:.0f} bytes/layer (peak RSS), " \
            f"{len(progress)} progress lines"
    return run


def _plain_mpiexec(folder, args=()):
    """`mpiexec -n 2 caffepar train` as on a cluster (no caffepar launcher), output merged."""
    from caffepar.parallel.launch import find_mpiexec
    return subprocess.Popen([find_mpiexec(), "-n", "2", sys.executable, "-m", "caffepar.cli",
                             "train", "--solver", "solver.prototxt"] + [str(a) for a in args],
                            cwd=folder, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def ends_badly(way, plain):
    """Rank 1 ends the job badly (`way`: the fault layer's os._exit(0), sys.exit(0), an
    exception, a NaN, a hang with --watchdog 10, or kill -9 from outside), under a plain mpiexec
    or caffepar's launcher. Documented: a non-zero status and a line naming rank 1 (a NaN: every
    rank's line, rank 1's naming the layer), no traceback nor MPI error stack. `sigterm`:
    SIGTERM to mpiexec or the launcher snapshots and stops, status 0."""
    def run(folder):
        faults = {"exit0": "exit0", "sys.exit": "sys.exit", "exception": "raise", "nan": "nan",
                  "hang": "hang", "segv": "segv"}
        workdir(folder, {"rank": 1, "at": 12, "do": faults[way]} if way in faults else None)
        args = ["--watchdog", 10] if way == "hang" else []
        if plain:
            proc = _plain_mpiexec(folder, args)
        else:
            job = Run(folder, 2, args)
            proc = job.proc
        t0 = time.monotonic()
        try:
            if way in ("kill", "sigterm"):
                assert wait_until(lambda: (folder / "pids/rank1.pid").exists(), 120)
                time.sleep(1)
                t0 = time.monotonic()
                if way == "kill":
                    os.kill(int((folder / "pids/rank1.pid").read_text().split()[0]),
                            signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGTERM)
            if plain:
                out, _ = proc.communicate(timeout=180)
                code = proc.returncode
            else:
                code = job.finish(180)
                out = job.output
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        seconds = time.monotonic() - t0
        lines = verdict(out)
        clean = "Traceback" not in out and "error stack" not in out and not raw(out)
        if way == "sigterm":
            ok = code == 0 and len(snapshots(folder)) == 1 and not lines and clean
            return ok, seconds, f"exit {code}; {len(snapshots(folder))} snapshot(s)", "", raw(out)
        if way == "nan":
            named = all("the loss is nan" in line for line in lines) and any(
                line.startswith("[rank 1]") and '"fault"' in line for line in lines)
        elif way in ("kill", "segv"):
            signame = "SIGKILL" if way == "kill" else "SIGSEGV"
            named = len(lines) == 1 and lines[0].startswith(f"[rank 1] caffepar: killed by "
                                                            f"{signame}") and \
                code == 128 + getattr(signal, signame)
        else:
            named = len(lines) == 1 and "rank 1" in lines[0]
        ok = code != 0 and named and clean
        message = (lines[-1] if lines else "(no line)") + f" [exit {code}]"
        return ok, seconds, message, f"{len(lines)} line(s)", raw(out)
    return run


def stuck_holding_the_lock(folder):
    """Every rank stuck in a C call that holds the interpreter lock (no watchdog thread can run,
    no rank ends), --watchdog 5: the last resort (no lock needed) ends the job in one line."""
    workdir(folder, {"rank": "all", "at": 25, "do": "gil", "seconds": 300})
    job = Run(folder, 2, ["--watchdog", 5])
    job.rank_pids(120)
    job.wait_for("Iteration 20,", timeout=120)
    processes = job.processes()
    t0 = time.monotonic()
    code = job.finish(120)
    seconds = time.monotonic() - t0
    lines = verdict(job.output)
    ok = code == 1 and len(lines) == 1 and "holds the interpreter lock" in lines[0] and \
        not all_ended(processes, 10) and "Traceback" not in job.output and not raw(job.output)
    return ok, seconds, lines[0] if lines else f"exit {code}", f"exit {code}", raw(job.output)


def slow_snapshot(folder):
    """Rank 0's snapshot takes 5 s (a sleep put around the writer by a sitecustomize) with
    --watchdog 2: rank 1 waits on (rank 0 says it is busy); exit 0, the snapshot whole."""
    from caffepar.io.weights import read_caffemodel
    from caffepar.solvers.snapshot import read_binary
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import time\nimport caffepar.solvers.solver as s\n_save = s.save_caffemodel\n"
        "def slow(*args, **kwargs):\n    time.sleep(5)\n    return _save(*args, **kwargs)\n"
        "s.save_caffemodel = slow\n")
    workdir(folder, max_iter=12)
    before = os.environ["PYTHONPATH"]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), before])
    try:
        job = Run(folder, 2, ["--watchdog", 2])
    finally:
        os.environ["PYTHONPATH"] = before
    t0 = time.monotonic()
    job.wait_for("Snapshotting to", timeout=120)
    code = job.finish(120)
    seconds = time.monotonic() - t0
    whole = snapshots(folder) == [12] and read_binary(
        str(folder / "snap/tiny_iter_12.solverstate")).iter == 12 and [
        b[0].size for b in read_caffemodel(str(folder / "snap/tiny_iter_12.caffemodel"))
        .by_name()["ip1"]] == [160, 16]
    ok = code == 0 and whole and not verdict(job.output) and not raw(job.output)
    return ok, seconds, f"exit {code}; snapshot whole: {whole}", "", raw(job.output)


ROWS = [
    ("SIGINT at startup (0.3 s), 1 process", signal_at("SIGINT", 1, 0.3)),
    ("SIGINT at startup (0.3 s), --np 2", signal_at("SIGINT", 2, 0.3)),
    ("SIGHUP at startup (1.2 s), --np 2", signal_at("SIGHUP", 2, 1.2)),
    ("SIGTERM in the first iteration, --np 2", signal_at("SIGTERM", 2, "first iteration")),
    ("SIGINT in steady state, --np 2", signal_at("SIGINT", 2, "steady")),
    ("SIGHUP during a snapshot, --np 2", signal_at("SIGHUP", 2, "snapshot")),
    ("kill -9 of rank 1, --np 2", killed_rank),
    ("hung rank, default watchdog, tiny net", hung_rank("tiny")),
    ("hung rank, default watchdog, cifar10_quick", hung_rank("cifar10_quick")),
    ("launcher SIGTERM then SIGKILL, rank 1 hung", lost_launcher),
    ("timeout -k 10 stops the launcher, rank 1 hung", scheduler_timeout),
    ("process manager (hydra's proxy) killed, --np 2", killed_process_manager),
    ("caffemodel cut short", cut_file("caffemodel")),
    ("caffemodel cut short, --np 2", cut_file("caffemodel", ranks=2)),
    ("caffemodel of 0 bytes", cut_file("empty")),
    ("solverstate cut short", cut_file("solverstate")),
    ("prototxt cut short", cut_file("prototxt")),
    ("snapshot_prefix in a missing folder", missing_snapshot_folder),
    ("disk full, binary snapshot", disk_full("BINARYPROTO")),
    ("disk full, HDF5 snapshot", disk_full("HDF5")),
    ("huge net, 100,000 layers: convert info", huge_net(100000)),
    ("kill -9 of rank 1, --np 2, many runs", killed_rank),
] + [(f"{what}, {'plain mpiexec -n 2' if plain else '--np 2'}", ends_badly(way, plain))
     for plain in (True, False)
     for way, what in [("exit0", "rank 1 calls os._exit(0)"),
                       ("sys.exit", "rank 1 calls sys.exit(0)"),
                       ("exception", "an exception in rank 1"), ("nan", "a NaN in rank 1"),
                       ("hang", "rank 1 hung, --watchdog 10"), ("kill", "kill -9 of rank 1"),
                       ("segv", "a segmentation fault in rank 1"),
                       ("sigterm", "SIGTERM to mpiexec")]
     if plain or way in ("exit0", "exception", "nan", "segv")] + [
    ("every rank stuck holding the interpreter lock, --watchdog 5", stuck_holding_the_lock),
    ("snapshot (5 s) slower than --watchdog 2", slow_snapshot),
    ("network lab, 2 nodes, a run to its end", lab_run(killed=False)),
    ("network lab, 2 nodes, a run SIGKILLed, then netlab down", lab_run(killed=True)),
]
#: Rows whose runs are jobs of MPI ranks that end badly: their raw MPI lines are summed.
ABNORMAL = {"kill -9 of rank 1, --np 2", "kill -9 of rank 1, --np 2, many runs",
            "hung rank, default watchdog, tiny net", "hung rank, default watchdog, cifar10_quick",
            "launcher SIGTERM then SIGKILL, rank 1 hung",
            "timeout -k 10 stops the launcher, rank 1 hung",
            "process manager (hydra's proxy) killed, --np 2", "caffemodel cut short, --np 2",
            "every rank stuck holding the interpreter lock, --watchdog 5"} | {
    name for name, _fn in ROWS if "rank 1" in name and "mpiexec" in name or
    name.endswith("in rank 1, --np 2") or name == "rank 1 calls os._exit(0), --np 2"}
SINGLE = {"huge net, 100,000 layers: convert info"}       # one run is the measurement
MANY = {"kill -9 of rank 1, --np 2, many runs": 20}     # a race seen 1 run in 10


def _cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _env():
    path = os.pathsep.join(filter(None, [str(ROOT / "tests/mpi"), str(ROOT),
                                         os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "reliability"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--resume", action="store_true", help="keep the runs OUT.csv has")
    ap.add_argument("--only", action="append", default=[], help="rows whose name contains this")
    args = ap.parse_args()
    os.environ.update({k: v for k, v in _env().items() if k == "PYTHONPATH"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = []
    if args.resume and out.with_suffix(".csv").exists():
        with open(out.with_suffix(".csv"), newline="") as f:
            done = list(csv.DictReader(f))
    for name, fn in ROWS:
        if args.only and not any(o in name for o in args.only):
            continue
        runs = 1 if name in SINGLE else MANY.get(name, args.runs)
        for k in range(runs):
            if any(r["row"] == name and int(r["run"]) == k for r in done):
                continue
            with tempfile.TemporaryDirectory(prefix="caffepar-fault-") as tmp:
                try:
                    result = fn(Path(tmp))
                except Exception as e:      # a run that broke the harness is not documented
                    result = False, 0.0, f"harness: {type(e).__name__}: {e}"[:300], ""
            if result is None:
                print(f"{name}: skipped (needs root)", flush=True)
                break
            ok, seconds, message, detail, *counted = result
            done.append({"row": name, "run": k, "documented": int(bool(ok)),
                         "seconds": f"{seconds:.1f}", "message": message, "detail": detail,
                         "raw_mpi_lines": "" if not counted or counted[0] is None
                         else counted[0]})
            print(f"{name} #{k}: {'ok' if ok else 'NOT AS DOCUMENTED'} {seconds:.1f} s "
                  f"{message} {detail}", flush=True)
            _write_csv(out, done)
    _write_md(out, done)
    return 0


def _write_csv(out, rows):
    from tables import write_csv
    write_csv(out.with_suffix(".csv"), rows, FIELDS)


def _write_md(out, rows):
    from cpuinfo import cpu_name
    cpu = cpu_name()
    lines = ["# Reliability: how caffepar runs end under faults", "",
             f"`python scripts/fault_runs.py` on {cpu} ({os.cpu_count()} cores, shared with "
             "other work). Each row: runs, how many ended as the README documents (exit status, "
             "snapshots, one line naming the cause, no traceback, none of the process "
             "manager's own lines), seconds from the fault to the end (median / largest), the "
             "message a user reads, and the process manager's own lines counted in the runs' "
             "output (hydra's `[proxy:...]` and `[mpiexec@...]` lines, its BAD TERMINATION "
             "banner; - where not counted: one process, or a killed lab run's). Runs are small "
             "(a tiny net of two InnerProduct layers, cifar10_quick on DummyData), each in its "
             "own folder.",
             "", "| fault | runs | as documented | seconds to end (median / max) | message | "
             "detail | raw MPI lines |", "|---|---|---|---|---|---|---|"]
    for name, _fn in ROWS:
        mine = [r for r in rows if r["row"] == name]
        if not mine:
            continue
        secs = [float(r["seconds"]) for r in mine]
        ok = sum(int(r["documented"]) for r in mine)
        message = statistics.mode([r["message"] for r in mine]).replace("|", "\\|")
        detail = "; ".join(sorted({r["detail"] for r in mine if r["detail"]}))[:200]
        counted = [int(r["raw_mpi_lines"]) for r in mine if r.get("raw_mpi_lines", "") != ""]
        lines.append(f"| {name} | {len(mine)} | {ok} | {statistics.median(secs):.1f} / "
                     f"{max(secs):.1f} | {message} | {detail.replace('|', '/')} | "
                     f"{sum(counted) if counted else '-'} |")
    bad = [r for r in rows if r["row"] in ABNORMAL]
    documented = sum(int(r["documented"]) for r in bad)
    raw_lines = sum(int(r["raw_mpi_lines"] or 0) for r in bad)
    lines += ["", f"Jobs of MPI ranks that ended badly (the rows of killed, crashed, hung, "
              f"stuck or exiting ranks, a killed launcher or process manager, a cut --weights "
              f"under --np): {len(bad)} runs, {documented} as documented, {raw_lines} raw MPI "
              f"lines in their output.",
              "", "Notes:", "",
              "- Signals: seconds from the signal to the end of the run (at startup the start "
              "is included). A signal that comes while the command starts is kept until the "
              "solver runs (SIGHUP at startup: its snapshot, then SIGTERM's).",
              "- Hung rank: no --watchdog; the default limit is 20 times the longest a rank "
              "computed between two collectives, at least 60 s. The waiting rank's share of a "
              "core is measured over 10 s of its wait (MPICH's own wait spun it at 50% in the "
              "same test before it polled with naps).",
              "- Plain `mpiexec -n 2` (a cluster's launch, no caffepar launcher): every way a "
              "job ends badly exits non-zero. A rank that calls os._exit(0) ends the job "
              "through MPI_Abort with its line (MPICH's mpiexec would otherwise kill the other "
              "ranks and exit 0). A rank killed by a signal (kill -9, a segmentation fault) is "
              "named with it by its supervising parent, which ends the job through hydra's "
              "PMI abort with status 128 + the signal's number, under a plain mpiexec as under "
              "--np (hydra alone printed only its banner, status 9 or 11). A NaN loss is seen "
              "by every rank: one line each, rank 1's naming the layer.",
              "- A killed process manager or launcher: hydra's mpiexec complains in 4 lines "
              "when its proxy dies; under --np the launcher's relay drops them, and outlives a "
              "SIGKILLed launcher to pass on the ranks' last lines and remove the job folder. "
              "timeout -k 10: SIGTERM to `timeout` (as at its limit), which sends it to the "
              "launcher's process group and SIGKILL 10 s later; the job ends first (the ranks' "
              "watchdog names the hung rank after 5 s; the launcher ends the job after 8 s at "
              "the latest).",
              "- Faults a layer injects (exits, an exception, a NaN, a hang): seconds from the "
              "launch (the fault comes at the 12th forward) or, for the hang and the stuck "
              "ranks, from the iteration before it.",
              "- Stuck holding the interpreter lock: no Python thread can run, so the "
              "watchdog's last resort (faulthandler's timer, a C thread) ends each rank after "
              "the watchdog limit plus 10 s; the launcher reports where it was stuck.",
              "- kill -9, many runs: the rank that vanished is named, never a rank whose MPI "
              "then failed, and no MPI error stack is printed.",
              "- Not run here: a net too large for the machine's memory (refused before it is "
              "built; tests/test_net.py checks it with the available memory made small)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    sys.exit(main())
