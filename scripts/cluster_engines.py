#!/usr/bin/env python
"""Slurm and Open MPI on the network lab, beside hydra and the mpich wheel: the same training
job started by each engine and launcher, its time to the first iteration, its iteration time
against hydra's on the same lab, whether it reached hydra's weights, and how long each fault
takes to end the job.

    sudo python scripts/cluster_engines.py [--iterations N] [--batch B]

Needs root, Slurm and munge, Open MPI and the venv whose mpi4py is built against it (`bash
scripts/cluster_tests.sh` installs them; `make .venv-openmpi/.installed` builds the venv).
Every run is on one lab (2 nodes, 1 Gbit/s links, Slurm up), made for the campaign and removed
after it. The job: cifar10_quick (tests/mpi/nets.py) on random images, HYBRID (ip1 and ip2
model parallel), one BLAS thread per rank, the convolution engines of the fixed rules.
Writes results/cluster_engines.csv, .md and .png.
"""
import argparse
import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "mpi"))

from caffepar import netlab, netlab_slurm  # noqa: E402

RESULTS = ROOT / "results"
OPENMPI_PYTHON = ROOT / ".venv-openmpi" / "bin" / "python"
LAB = "cpe"
FIELDS = ("engine", "launcher", "layout", "ranks", "time_to_first_s", "iteration_ms",
          "vs_hydra", "spread", "weights", "status", "others_busy_pct")
FAULT_FIELDS = ("engine", "launcher", "fault", "layout", "watchdog_s", "to_line_s", "to_end_s",
                "status", "line")
ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "CAFFEPAR_CONV_ENGINES": "rules",
       "CAFFEPAR_CONTENDED": "0"}
_GLOG = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) ")


def job_env(**extra):
    path = os.pathsep.join(filter(None, [str(ROOT / "tests" / "mpi"),
                                         os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **ENV, **extra)


def day_seconds(stamp):
    return stamp.hour * 3600 + stamp.minute * 60 + stamp.second + stamp.microsecond / 1e6


def first_iteration_s(text, started):
    """Seconds from `started` (a datetime) to the log line of iteration 1's end."""
    for line in text.splitlines():
        if "] Iteration 1 (" in line:
            m = _GLOG.match(line)
            if m:
                s = int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
                return round((s - day_seconds(started)) % 86400, 2)
    return None


def iteration_ms(folder, skip=5):
    """Median iteration time (rank 0's CSV) past the first `skip` iterations."""
    import numpy as np
    with open(folder / "snap" / "c_log.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("seconds")]
    times = [float(r["seconds"]) for r in rows if int(r["iter"]) >= skip]
    return round(1000 * float(np.median(times)), 1) if times else None


def same_weights(a, b):
    from test_cluster_engines import weights
    import numpy as np
    wa, wb = weights(a), weights(b)
    if wa.keys() != wb.keys():
        return "different layers"
    if all(np.array_equal(wa[k], wb[k]) for k in wa):
        return "bitwise equal"
    worst = max(float(np.max(np.abs(wa[k] - wb[k])) / np.max(np.abs(wb[k]))) for k in wa)
    return f"differ by {worst:.1e} of a blob's largest weight"


def rounding(work, iterations=(1, 10)):
    """The same job at P=4 (--np 4, one machine) on each engine: where the two libraries add
    the 4 ranks' sums in different orders, how far apart the weights are after a few
    iterations (float32 rounding, not a different computation)."""
    from test_cluster_engines import cifar_job, weights
    import numpy as np
    rows = []
    for it in iterations:
        got = {}
        for name, python in (("mpich", sys.executable), ("openmpi", OPENMPI_PYTHON)):
            folder = cifar_job(work / f"p4_{name}_{it}", it)
            done = subprocess.run([str(python), "-m", "caffepar.cli", "train", "--solver",
                                   "solver.prototxt", "--np", "4", "--parallel", "hybrid",
                                   "--mp-threshold", "0"], cwd=folder, env=job_env(),
                                  capture_output=True, text=True, timeout=600)
            if done.returncode:
                return rows
            got[name] = weights(folder / f"snap/c_iter_{it}.caffemodel")
        a, b = got["openmpi"], got["mpich"]
        rows.append((it, max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(b[k])))
                             for k in b)))
        print(f"P=4, {it} iteration(s): Open MPI vs MPICH {rows[-1][1]:.1e}", flush=True)
    return rows


# ------------------------------------------------------------------------- the runs
def run_hydra(lab, folder, per_node, args, python=sys.executable):
    code = ("import sys\nfrom caffepar import netlab\n"
            f"lab = netlab.Lab({lab.name!r}, {lab.rates!r}, {per_node})\n"
            f"sys.exit(netlab.run_job(lab, {['train', '--solver', 'solver.prototxt', *args]!r}))")
    started = datetime.now()
    done = subprocess.run([str(python), "-c", code], cwd=folder, env=job_env(),
                          capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout + done.stderr, started


def run_sbatch(lab, folder, per_node, args, command=None, timeout=900):
    from test_cluster_engines import train_cmd
    script = folder / "job.sh"
    script.write_text(netlab_slurm.batch_script(command or train_cmd(sys.executable, *args),
                                                netlab_slurm.LAB_JOB_ENV))
    started = datetime.now()
    done = netlab_slurm.run(lab, ["sbatch", "--parsable", "-N", "2", "--ntasks-per-node",
                                  str(per_node), "-D", str(folder), "-o",
                                  str(folder / "slurm.out"), str(script)], env=job_env(),
                            timeout=60)
    job = int(done.stdout.strip().split(";")[0])
    netlab_slurm.wait_job(lab, job, timeout)
    out = (folder / "slurm.out").read_text(errors="replace")
    return (0 if "Optimization Done." in out else 1), out, started


def run_salloc(lab, folder, per_node, args):
    from test_cluster_engines import train_cmd
    started = datetime.now()
    done = subprocess.run(netlab_slurm.in_hub(lab, [
        "salloc", "-N", "2", "--ntasks-per-node", str(per_node), "srun", "--mpi=pmi2",
        *train_cmd(sys.executable, *args)]), cwd=folder,
        env=netlab_slurm.environment(lab, job_env(**netlab_slurm.LAB_JOB_ENV)),
        capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout + done.stderr, started


def run_openmpi_sbatch(lab, folder, per_node, args):
    """Open MPI's mpirun inside an sbatch allocation: it starts its daemons with srun."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command = ["mpirun", *root, "--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
               "--mca", "btl", "tcp,self,vader", "--mca", "btl_tcp_if_include", "eth0",
               "--mca", "oob_tcp_if_include", "eth0", str(OPENMPI_PYTHON), "-m",
               "caffepar.cli", "train", "--solver", "solver.prototxt", *args]
    script = folder / "job.sh"
    script.write_text("#!/bin/sh\n#SBATCH --no-requeue\n" + " ".join(command) + "\n")
    started = datetime.now()
    done = netlab_slurm.run(lab, ["sbatch", "--parsable", "-N", "2", "--ntasks-per-node",
                                  str(per_node), "-D", str(folder), "-o",
                                  str(folder / "slurm.out"), str(script)], env=job_env(),
                            timeout=60)
    job = int(done.stdout.strip().split(";")[0])
    netlab_slurm.wait_job(lab, job, 900)
    out = (folder / "slurm.out").read_text(errors="replace")
    return (0 if "Optimization Done." in out else 1), out, started


#: Open MPI's ranks on the lab: ob1's tcp BTL on the node's link, vader within a node.
OMPI_ENV = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self,vader",
            "OMPI_MCA_btl_tcp_if_include": "eth0"}


def run_openmpi_srun(lab, folder, per_node, args):
    """srun --mpi=pmix starting mpi4py-on-Open-MPI ranks (PMIx from Slurm) from the login
    node."""
    started = datetime.now()
    done = subprocess.run(netlab_slurm.in_hub(lab, [
        "srun", "-N", "2", "--ntasks-per-node", str(per_node), "--mpi=pmix",
        str(OPENMPI_PYTHON), "-m", "caffepar.cli", "train", "--solver", "solver.prototxt",
        *args]), cwd=folder, env=netlab_slurm.environment(lab, job_env(**OMPI_ENV)),
        capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout + done.stderr, started


def trainings(lab, work, iterations, batch, busy, rounds):
    from test_cluster_engines import cifar_job
    args = ["--parallel", "hybrid", "--mp-threshold", "0"]
    runs = [("MPICH 5 (mpich wheel)", "hydra mpiexec (netlab run)", run_hydra),
            ("MPICH 5 (mpich wheel)", "sbatch + srun --mpi=pmi2", run_sbatch),
            ("MPICH 5 (mpich wheel)", "salloc + srun --mpi=pmi2", run_salloc),
            ("Open MPI 4.1 (Debian)", "mpirun (netlab run)",
             lambda lab, f, per, a: run_hydra(lab, f, per, a, OPENMPI_PYTHON)),
            ("Open MPI 4.1 (Debian)", "sbatch + mpirun", run_openmpi_sbatch),
            ("Open MPI 4.1 (Debian)", "srun --mpi=pmix", run_openmpi_srun)]
    import numpy as np
    cells = {}      # (per_node, run index) -> row, with each round's figures in lists
    for rnd in range(rounds):
        for per_node in (1, 2):
            hydra_ms = None
            for i, (engine, launcher, fn) in enumerate(runs):
                folder = work / f"r{rnd}_{launcher.split()[0]}_{engine.split()[0]}_{per_node}"
                job = cifar_job(folder, iterations)
                net = job / "net.prototxt"
                net.write_text(re.sub(r"batch_size: \d+", f"batch_size: {batch}",
                                      net.read_text()))
                b = busy()
                code, out, started = fn(lab, job, per_node, args)
                final = job / f"snap/c_iter_{iterations}.caffemodel"
                row = cells.setdefault((per_node, i), {
                    "engine": engine, "launcher": launcher, "layout": f"2x{per_node}",
                    "ranks": 2 * per_node, "status": "ok", "others_busy_pct": [],
                    "first": [], "ms": [], "ratio": [], "final": None})
                row["others_busy_pct"].append(b)
                if code != 0 or not final.exists():
                    row["status"] = f"failed ({code})"
                    (work / f"{folder.name}.log").write_text(out)
                    continue
                ms = iteration_ms(job)
                hydra_ms = hydra_ms or ms          # the first run of the round is hydra's
                row["first"].append(first_iteration_s(out, started))
                row["ms"].append(ms)
                row["ratio"].append(ms / hydra_ms)
                row["final"] = row["final"] or final
                hydra_final = cells[(per_node, 0)]["final"]
                if "weights" not in row or row["weights"] == "bitwise equal":
                    row["weights"] = same_weights(final, hydra_final)
                print(f"round {rnd + 1}: {engine} / {launcher} 2x{per_node}: first "
                      f"{row['first'][-1]} s, {ms} ms ({ms / hydra_ms:.2f}x hydra), "
                      f"{row['weights']}", flush=True)
    rows = []
    for key in sorted(cells):
        row = cells[key]
        if row["status"] == "ok":
            row["time_to_first_s"] = round(float(np.median(row["first"])), 1)
            row["iteration_ms"] = round(float(np.median(row["ms"])), 1)
            row["vs_hydra"] = round(float(np.median(row["ratio"])), 2)
            row["spread"] = f"{min(row['ratio']):.2f}-{max(row['ratio']):.2f}"
        busy_ = [b for b in row["others_busy_pct"] if b is not None]
        row["others_busy_pct"] = max(busy_) if busy_ else None
        rows.append({k: v for k, v in row.items() if k not in ("first", "ms", "ratio",
                                                              "final")})
    return rows


# ------------------------------------------------------------------------- the faults
def faults(lab_layout, work, busy):
    from test_cluster_engines import tiny_job, train_cmd
    rows = []
    # Slurm: scancel, and a node lost (its slurmd killed, every process of the node with it)
    for fault, per_node in (("scancel", 1), ("node lost (slurmd killed)", 1),
                            ("node lost (slurmd killed)", 2)):
        lab = netlab.up(netlab.Lab(LAB + "f", netlab.parse_links("1gbit", 2), 2))
        try:
            netlab_slurm.start(lab)
            folder = tiny_job(work / f"fault_{len(rows)}")
            args = ["--watchdog", "5"] if fault.startswith("node") else []
            script = folder / "job.sh"
            script.write_text(netlab_slurm.batch_script(train_cmd(sys.executable, *args),
                                                        netlab_slurm.LAB_JOB_ENV))
            done = netlab_slurm.run(lab, ["sbatch", "--parsable", "-N", "2",
                                          "--ntasks-per-node", str(per_node), "-D",
                                          str(folder), "-o", str(folder / "slurm.out"),
                                          str(script)], env=job_env(), timeout=60)
            job = int(done.stdout.strip().split(";")[0])
            out = folder / "slurm.out"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and "Iteration 20," not in (
                    out.read_text(errors="replace") if out.exists() else ""):
                time.sleep(0.2)
            t0 = time.monotonic()
            if fault == "scancel":
                netlab_slurm.run(lab, ["scancel", str(job)], timeout=30)
                marker = "Optimization stopped early."
            else:
                netlab_slurm.kill_node(lab, 1)
                marker = "caffepar: rank"
            to_line = None
            while time.monotonic() - t0 < 120:
                if to_line is None and marker in out.read_text(errors="replace"):
                    to_line = round(time.monotonic() - t0, 1)
                if netlab_slurm.job_state(lab, job) is None:
                    break
                time.sleep(0.2)
            to_end = round(time.monotonic() - t0, 1)
            text = out.read_text(errors="replace")
            line = next((ln for ln in text.splitlines() if ln.startswith("caffepar:")), "")
            status = "snapshot, stopped early" if "Optimization stopped early." in text else \
                ("ended, rank and node named" if re.search(r"rank \d+ on node1", line)
                 else "ended")
            rows.append({"engine": "MPICH 5 (mpich wheel)", "launcher": "sbatch + srun",
                         "fault": fault, "layout": f"2x{per_node}",
                         "watchdog_s": 5 if args else "", "to_line_s": to_line,
                         "to_end_s": to_end, "status": status, "line": line})
        finally:
            netlab.down(lab.name)
        print(f"{fault} 2x{per_node}: line {to_line} s, end {to_end} s; {line}", flush=True)
    # Open MPI: a failed rank (--np and a plain mpirun), a hung rank (the watchdog), SIGTERM
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cases = [("a rank raises", {"rank": 1, "at": 30, "do": "raise"}, ["--np", "2"], None),
             ("a rank raises", {"rank": 1, "at": 30, "do": "raise"}, [],
              ["mpirun", *root, "--oversubscribe", "-n", "2"]),
             ("a rank hangs", {"rank": 1, "at": 30, "do": "hang"}, ["--np", "2", "--watchdog",
                                                                    "3"], None),
             ("SIGTERM to the launcher", None, ["--np", "2"], None)]
    for fault, spec, args, launcher in cases:
        folder = tiny_job(work / f"fault_{len(rows)}", **({"fault": spec} if spec else {}))
        proc = subprocess.Popen((launcher or []) + train_cmd(OPENMPI_PYTHON, *args), cwd=folder,
                                env=job_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        seen, t_last, t_signal = [], time.monotonic(), None
        for line in proc.stdout:
            seen.append(line)
            if "] Iteration " in line and "Testing" not in line:
                t_last = time.monotonic()
            if spec is None and t_signal is None and "Iteration 20," in line:
                os.kill(proc.pid, signal.SIGTERM)
                t_signal = time.monotonic()
        proc.wait()
        t_end = time.monotonic()
        text = "".join(seen)
        line = next((ln for ln in text.splitlines() if "caffepar:" in ln and "[rank" in ln
                     or ln.startswith("caffepar: rank")), "")
        rows.append({"engine": "Open MPI 4.1 (Debian)",
                     "launcher": "plain mpirun" if launcher else "caffepar --np (mpirun)",
                     "fault": fault, "layout": "1 machine, 2 ranks",
                     "watchdog_s": 3 if "hang" in fault else "", "to_line_s": "",
                     "to_end_s": round(t_end - (t_signal or t_last), 1),
                     "status": f"exit {proc.returncode}"
                     + (", snapshot" if "Optimization stopped early." in text else ""),
                     "line": line.strip()})
        print(f"Open MPI {fault} ({rows[-1]['launcher']}): {rows[-1]['to_end_s']} s, "
              f"{rows[-1]['status']}; {line.strip()}", flush=True)
    return rows


# ------------------------------------------------------------------------- the report
def write(rows, fault_rows, iterations, batch, rounded=(), rounds=1):
    from cpuinfo import cpu_name
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "cluster_engines.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["kind", *FIELDS, *[x for x in FAULT_FIELDS if x not in FIELDS]])
        w.writeheader()
        for r in rows:
            w.writerow({"kind": "training", **r})
        for r in fault_rows:
            w.writerow({"kind": "fault", **r})
    busy = [r["others_busy_pct"] for r in rows if r.get("others_busy_pct") is not None]
    busy += [r["others_busy_pct"] for r in fault_rows if r.get("others_busy_pct") is not None]
    md = ["# Cluster engines on the network lab: Slurm and Open MPI beside hydra", "",
          "Produced by `sudo python scripts/cluster_engines.py` "
          f"(--iterations {iterations} --batch {batch} --rounds {rounds}); rows in "
          "results/cluster_engines.csv. "
          f"CPU: {cpu_name()}, {os.cpu_count()} cores shared by every node of the lab "
          "(network namespaces of one machine, 1 Gbit/s links shaped by tc). Other processes "
          "used " + (f"{min(busy)}-{max(busy)}% of the CPU before the runs" if busy else
                     "an unrecorded share of the CPU") + ": the times are of a shared machine, "
          "to compare within one table, not across runs.", "",
          "The job: cifar10_quick (tests/mpi/nets.py) on random images, batch "
          f"{batch} per rank, {iterations} iterations, HYBRID (ip1, ip2 model parallel), one "
          "BLAS thread per rank. Slurm 22.05 (Debian's slurm-wlm, munge) runs on the lab "
          "(`caffepar netlab up --slurm`): slurmctld on the hub, a slurmd per node. MPICH "
          "under srun takes its OFI netmod (libfabric tcp on the node's link; caffepar sets "
          "MPIR_CVAR_CH4_NETMOD=ofi under srun's pmi2, see the README); under hydra, UCX on "
          "tcp. Open MPI: mpi4py built against Debian's Open MPI 4.1.4 in a venv of its own, "
          "ob1 with the tcp BTL between nodes, vader within a node.", "",
          "Time to first iteration: from the launch command (netlab run, sbatch, salloc, "
          "srun) to the log line of iteration 1 (starting the ranks, MPI, the nets, "
          "iterations 0 and 1). Iteration: median of rank 0's iterations after the 5th (its "
          "CSV). Each cell ran once in each of " + str(rounds) + " rounds, hydra first in "
          "every round and layout; the table gives the medians over the rounds, vs hydra "
          "the median of each round's ratio to hydra's run just before (and their range). "
          "Weights: the final snapshot against hydra's run of the same job and layout.", "",
          "| engine | launcher | layout | first iteration s | iteration ms | vs hydra "
          "(range) | weights vs hydra |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            md.append(f"| {r['engine']} | {r['launcher']} | {r['layout']} | - | - | - | "
                      f"{r['status']} |")
            continue
        md.append(f"| {r['engine']} | {r['launcher']} | {r['layout']} | "
                  f"{r['time_to_first_s']} | {r['iteration_ms']} | {r['vs_hydra']:.2f} "
                  f"({r['spread']}) | {r['weights']} |")
    if rounded:
        md += ["", "At P=2 every engine and launcher reaches hydra's weights bit for bit. At "
               "P=4 Open MPI adds the 4 ranks' sums in another order than MPICH: the same job "
               "(`--np 4`, one machine, batch 4 per rank) differs by "
               + ", ".join(f"{d:.1e} after {it} iteration{'s' if it > 1 else ''}"
                           for it, d in rounded)
               + " (of a blob's largest weight: float32 rounding), which training then "
               "carries on; the Open MPI runs are bitwise equal among themselves."]
    md += ["", "## Faults: time to end", "",
           "Slurm (sbatch, srun --mpi=pmi2, the tiny net of tests/test_jobs.py): seconds from "
           "the fault to caffepar's line (snapshot or report) and to the job leaving Slurm's "
           "queue. The node lost is node1's slurmd killed, every process of the node with "
           "it (its PID namespace), as a crashed machine; slurmctld marks the node down after "
           f"SlurmdTimeout ({netlab_slurm.NODE_TIMEOUT} s in the lab). Open MPI (one machine, "
           "2 ranks): seconds from the last iteration rank 0 logged before the fault (the "
           "signal, for SIGTERM) to the launcher's exit.", "",
           "| engine | launcher | fault | layout | watchdog s | to line s | to end s | "
           "outcome | line |", "|---|---|---|---|---|---|---|---|---|"]
    for r in fault_rows:
        md.append(f"| {r['engine']} | {r['launcher']} | {r['fault']} | {r['layout']} | "
                  f"{r['watchdog_s']} | {r['to_line_s']} | {r['to_end_s']} | {r['status']} | "
                  f"`{r['line']}` |")
    (RESULTS / "cluster_engines.md").write_text("\n".join(md) + "\n")
    plot(rows)
    print("wrote results/cluster_engines.csv, .md, .png")


def plot(rows):
    from figures import pyplot
    plt = pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    if plt is None or not ok:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = [f"{r['engine'].split(' (')[0]}, {r['launcher'].replace(' (', ', ').rstrip(')')}, "
              f"{r['layout']}"
              for r in ok]
    y = list(range(len(ok)))[::-1]
    ax.barh(y, [float(r["iteration_ms"]) for r in ok],
            color=["tab:blue" if "MPICH" in r["engine"] else "tab:orange" for r in ok])
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("iteration ms (median over the rounds)")
    ax.set_title("cifar10_quick HYBRID on the lab (2 nodes, 1 Gbit/s): engines and launchers",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "cluster_engines.png", dpi=90)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3,
                    help="Runs of every cell, in rounds (each round hydra first): medians.")
    ap.add_argument("--plot", action="store_true",
                    help="Only draw results/cluster_engines.png from the CSV.")
    args = ap.parse_args()
    if args.plot:
        with open(RESULTS / "cluster_engines.csv", newline="") as f:
            plot([r for r in csv.DictReader(f) if r["kind"] == "training"])
        return
    for message in (netlab.missing_privileges(), netlab_slurm.missing_programs(),
                    None if OPENMPI_PYTHON.exists() else
                    "no Open MPI venv: make .venv-openmpi/.installed"):
        if message:
            sys.exit(message)
    from bench_comm_opt import cpu_busy
    from caffepar.nn import native
    native.kernels("float32")       # built once, before any job times its start
    busy = lambda: (lambda b: None if b is None else round(100 * b))(cpu_busy(2.0))
    work = Path(tempfile.mkdtemp(prefix="cluster-engines-"))
    lab = netlab.up(netlab.Lab(LAB, netlab.parse_links("1gbit", 2), 2))
    try:
        netlab_slurm.start(lab)
        rows = trainings(lab, work, args.iterations, args.batch, busy, args.rounds)
    finally:
        netlab.down(lab.name)
    try:
        fault_rows = faults(None, work, busy)
    finally:
        netlab.down(LAB + "f")
    write(rows, fault_rows, args.iterations, args.batch, rounding(work), args.rounds)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
