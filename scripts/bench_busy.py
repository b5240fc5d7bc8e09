#!/usr/bin/env python
"""`caffepar time` on a mid-size net alone and beside CPU hogs, against the fair share.

With T threads of ours and H busy processes on C cores, a fair scheduler gives our threads
T * C / (H + T) cores where they had min(T, C): a slowdown of (H + T) / C is the fair share
(T <= C). More than that means time lost to waiting badly -- threads spinning on a core the
work needs, or a thread that was descheduled holding up the others. Two settings of the BLAS's
idle threads are compared side by side in alternating rounds: caffepar's (they sleep at once,
OPENBLAS_THREAD_TIMEOUT=4) and OpenBLAS's default spinning (a long timeout).

    python scripts/bench_busy.py [--net alexnet] [--hogs 4] [--rounds 3]
                                 [--out results/busy_<cpu>]
"""
import argparse
import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

SETTINGS = {"caffepar (idle BLAS threads sleep)": {},
            "BLAS threads spin when idle": {"OPENBLAS_THREAD_TIMEOUT": "30"}}
HOG = "while True: pass"


def time_net(net, iterations, env):
    out = subprocess.run([sys.executable, "-m", "caffepar.cli", "time", "--model",
                          str(ROOT / f"models/{net}/train_val_dummy.prototxt"), "--iterations",
                          str(iterations)], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, **env))
    found = re.search(r"Average Forward-Backward: ([\d.]+) ms", out.stdout + out.stderr)
    if not found:
        raise SystemExit(f"caffepar time failed: {(out.stderr or out.stdout)[-500:]}")
    return float(found.group(1))


def start_hogs(count):
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]


def stop_hogs(hogs):
    for p in hogs:
        os.kill(p.pid, signal.SIGTERM)
    for p in hogs:
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--hogs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from cpuinfo import cpu_key, cpu_name
    cores = len(os.sched_getaffinity(0))
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", cores))
    fair = max(1.0, (args.hogs + min(threads, cores)) / cores)
    load_start, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
    time_net(args.net, 1, {})           # kernels built and engines measured before timing
    alone = {s: float("inf") for s in SETTINGS}
    busy = dict(alone)
    for r in range(args.rounds):        # alternating: every setting, alone and busy, each round
        for s, env in SETTINGS.items():
            alone[s] = min(alone[s], time_net(args.net, args.iterations, env))
            hogs = start_hogs(args.hogs)
            try:
                time.sleep(0.5)
                busy[s] = min(busy[s], time_net(args.net, args.iterations, env))
            finally:
                stop_hogs(hogs)
            print(f"round {r + 1} {s}: alone {alone[s]:.0f} ms, beside {args.hogs} hogs "
                  f"{busy[s]:.0f} ms", flush=True)
    out = Path(args.out) if args.out else ROOT / f"results/busy_{cpu_key()}"
    rows = [{"setting": s, "alone_ms": alone[s], "busy_ms": busy[s],
             "slowdown": busy[s] / alone[s], "fair_share": fair,
             "over_fair": busy[s] / alone[s] / fair} for s in SETTINGS]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for row in rows:
            w.writerow({k: f"{v:.3f}" if isinstance(v, float) else v for k, v in row.items()})
    lines = [f"# `caffepar time` on {args.net} beside CPU hogs", "",
             f"Written by `python scripts/bench_busy.py` ({started}, {args.rounds} alternating "
             f"rounds, fastest counts). CPU: {cpu_name()}; {cores} cores; {threads} thread(s) "
             f"of ours; {args.hogs} hogs (`python -c '{HOG}'`). Load average (1 min) "
             f"{load_start:.2f} before the first run.", "",
             f"Fair share: (hogs + our threads) / cores = **{fair:.2f}x** the time alone.", "",
             "| setting | alone ms | beside hogs ms | slowdown | slowdown / fair share |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['alone_ms']:.0f} | {r['busy_ms']:.0f} | "
                     f"{r['slowdown']:.2f}x | **{r['over_fair']:.2f}** |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(range(len(rows)), [r["slowdown"] for r in rows], 0.5)
    ax.axhline(fair, color="k", ls="--", lw=1, label=f"fair share {fair:.1f}x")
    ax.set_xticks(range(len(rows)), [r["setting"] for r in rows], fontsize=7)
    ax.set_ylabel(f"slowdown beside {args.hogs} hogs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
