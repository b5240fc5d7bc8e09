#!/usr/bin/env python
"""Fault runs: caffepar under signals at every phase, killed and hung ranks with default
settings, files cut short, a full disk and huge nets; each way a few times, checking that it
ends as the README says.

    python scripts/fault_runs.py [--out results/reliability] [--runs 3] [--resume] [--only ROW]

Each row is a kind of run: how many runs, how many ended as documented (exit status, snapshot,
the one line), the seconds from the fault to the end (median and largest), and the message a
user reads. Runs are small (a tiny net of two InnerProduct layers, cifar10_quick on DummyData)
and use the test suite's fault layer (tests/mpi/faults.py). Writes OUT.csv (one line per run,
kept by --resume) and OUT.md. The disk-full row mounts a 64 KB tmpfs and needs root.
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

from test_jobs import Run, all_ended, snapshots, wait_until, workdir  # noqa: E402

FIELDS = ["row", "run", "documented", "seconds", "message", "detail"]


def verdict(lines):
    """The lines a user reads as the verdict (log lines and MPI's banners aside)."""
    return [l for l in lines.splitlines() if "caffepar:" in l or l.strip() == "aborted"]


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
              and "UCX" not in out and not verdict(out))
        message = f"exit {code}; {len(snapshots(folder)) - before} snapshot(s)" + \
            ("; Optimization stopped early." if "stopped early" in out else "")
        return ok, seconds, message, ""
    return run


def killed_rank(folder):
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
    ok = code == 1 and len(lines) == 1 and lines[0].startswith("[rank 1]") and \
        not all_ended(processes, 10)
    return ok, seconds, lines[0] if lines else f"exit {code}", f"exit {code}, {len(lines)} line(s)"


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
            not all_ended(processes, 10)
        return ok, seconds, lines[0] if lines else f"exit {code}", \
            f"waiting rank used {100 * share:.1f}% of a core"
    return run


def lost_launcher(folder):
    """A batch scheduler at its time limit: SIGTERM to the launcher, SIGKILL 4 s later, while
    rank 1 hangs and rank 0 waits: every process gone within seconds."""
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
    return not left, seconds, "every process ended" if not left else \
        f"{len(left)} process(es) still running after 60 s", ""


def cut_file(kind):
    """A weights file, solver state or prototxt cut short: refused in one line naming it."""
    def run(folder):
        workdir(folder)
        subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                        "solver.prototxt", "--iterations", "10"], cwd=folder, env=_env(),
                       capture_output=True, timeout=300)
        (folder / "solver.prototxt").write_text(
            (folder / "solver.prototxt").read_text().replace("max_iter: 100000", "max_iter: 20"))
        target = {"caffemodel": folder / "snap/tiny_iter_10.caffemodel",
                  "solverstate": folder / "snap/tiny_iter_10.solverstate",
                  "prototxt": folder / "net.prototxt"}[kind]
        data = target.read_bytes()
        target.write_bytes(data[:len(data) * 2 // 3])
        args = {"caffemodel": ["--weights", "snap/tiny_iter_10.caffemodel"],
                "solverstate": ["--snapshot", "snap/tiny_iter_10.solverstate"],
                "prototxt": []}[kind]
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "caffepar.cli", "train", "--solver",
                               "solver.prototxt"] + args, cwd=folder, env=_env(),
                              capture_output=True, text=True, timeout=300)
        lines = verdict(done.stderr)
        ok = done.returncode == 1 and len(lines) == 1 and target.name in lines[0] and \
            "Traceback" not in done.stderr
        return ok, time.monotonic() - t0, lines[0] if lines else f"exit {done.returncode}", ""
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
    ("caffemodel cut short", cut_file("caffemodel")),
    ("solverstate cut short", cut_file("solverstate")),
    ("prototxt cut short", cut_file("prototxt")),
    ("disk full, binary snapshot", disk_full("BINARYPROTO")),
    ("disk full, HDF5 snapshot", disk_full("HDF5")),
    ("huge net, 100,000 layers: convert info", huge_net(100000)),
]
SINGLE = {"huge net, 100,000 layers: convert info"}       # one run is the measurement


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
        runs = 1 if name in SINGLE else args.runs
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
            ok, seconds, message, detail = result
            done.append({"row": name, "run": k, "documented": int(bool(ok)),
                         "seconds": f"{seconds:.1f}", "message": message, "detail": detail})
            print(f"{name} #{k}: {'ok' if ok else 'NOT AS DOCUMENTED'} {seconds:.1f} s "
                  f"{message} {detail}", flush=True)
            _write_csv(out, done)
    _write_md(out, done)
    return 0


def _write_csv(out, rows):
    tmp = out.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, out.with_suffix(".csv"))


def _write_md(out, rows):
    from cpuinfo import cpu_name
    cpu = cpu_name()
    lines = ["# Reliability: how caffepar runs end under faults", "",
             f"`python scripts/fault_runs.py` on {cpu} ({os.cpu_count()} cores, shared with "
             "other work). Each row: runs, how many ended as the README documents (exit status, "
             "snapshots, one line naming the cause, no traceback), seconds from the fault to the "
             "end (median / largest), and the message a user reads. Runs are small (a tiny net "
             "of two InnerProduct layers, cifar10_quick on DummyData), each in its own folder.",
             "", "| fault | runs | as documented | seconds to end (median / max) | message | "
             "detail |", "|---|---|---|---|---|---|"]
    for name, _fn in ROWS:
        mine = [r for r in rows if r["row"] == name]
        if not mine:
            continue
        secs = [float(r["seconds"]) for r in mine]
        ok = sum(int(r["documented"]) for r in mine)
        message = statistics.mode([r["message"] for r in mine]).replace("|", "\\|")
        detail = "; ".join(sorted({r["detail"] for r in mine if r["detail"]}))[:200]
        lines.append(f"| {name} | {len(mine)} | {ok} | {statistics.median(secs):.1f} / "
                     f"{max(secs):.1f} | {message} | {detail.replace('|', '/')} |")
    lines += ["", "Notes:", "",
              "- Signals: seconds from the signal to the end of the run (at startup the start "
              "is included). A signal that comes while the command starts is kept until the "
              "solver runs (SIGHUP at startup: its snapshot, then SIGTERM's).",
              "- Hung rank: no --watchdog; the default limit is 20 times the longest a rank "
              "computed between two collectives, at least 60 s. The waiting rank's share of a "
              "core is measured over 10 s of its wait (MPICH's own wait spun it at 50% in the "
              "same test before it polled with naps).",
              "- Not run here: a net too large for the machine's memory (refused before it is "
              "built; tests/test_net.py checks it with the available memory made small), and "
              "a rank that calls exit(0) in the middle of a plain `mpiexec` job (MPICH's "
              "mpiexec then ends the other ranks and exits 0: only caffepar's launcher, which "
              "sees the rank end without its end record, reports it)."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    sys.exit(main())
