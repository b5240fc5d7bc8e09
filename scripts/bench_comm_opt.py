#!/usr/bin/env python
"""The gradient communication options measured here: AlexNet and VGG-16, all layers data
parallel, at P=2 and P=4 ranks on this machine, plain / overlap / overlap+merge / top-k /
hierarchical.

    python scripts/bench_comm_opt.py [--nets alexnet,vgg16] [--np 2,4] [--rounds 2]
                                     [--iterations 3] [--fresh]

Each (net, P) is one mpiexec job (1 BLAS thread per rank, batch of the net's DummyData
prototxt per rank) that runs the options in alternating rounds: per round and option a fresh
solver, warm-up iterations (4 for the options whose buckets come from a 3-iteration profile,
else 1), then `--iterations` timed ones. Top-k recomputes exact thresholds every iteration here
(`--topk-refresh 1`): the DummyData input is the same every iteration, so residuals grow
steadily and thresholds reused from an earlier iteration would let far more than k values
through; exact ones send k per layer, and their selection time is the upper bound. Per option: iteration time, comm time (some bucket in
flight), exposed comm time (the solver waiting for gradients), top-k selection time, bytes.
The plain runs also record every layer's forward and backward time and the update's. A
finished (net, P) is kept in snapshots/comm_opt/ and skipped on a rerun (--fresh redoes it).
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_train import dummy_solver_param  # noqa: E402

TOPK_RATIO = 0.01


def options_of(ranks):
    """option label -> CommOptions fields"""
    return {"plain": {},
            "overlap": {"overlap": True},
            "overlap+merge": {"merge": "auto"},
            "top-k": {"topk": TOPK_RATIO, "topk_refresh": 1},
            "hierarchical": {"hierarchical": True, "ranks_per_node": max(1, ranks // 2)}}


class LayerClock:
    """Net observer: seconds of every layer's forward and backward."""

    def __init__(self, net):
        import numpy as np
        self.forward = np.zeros(len(net.layers))
        self.backward = np.zeros(len(net.layers))
        self.started = 0.0

    def layer_start(self, kind, i):
        self.started = time.perf_counter()

    def layer_end(self, kind, i):
        (self.forward if kind == "forward" else self.backward)[i] += \
            time.perf_counter() - self.started


def measure(comm, net_name, label, fields, iterations):
    from caffepar.parallel.data_parallel import make_parallel_solver
    from caffepar.parallel.gradsync import PROFILE_ITERATIONS, PROFILE_START
    from caffepar.parallel.options import CommOptions
    from caffepar.parallel.plan import Planner
    options = CommOptions().with_flags(**fields)
    solver = make_parallel_solver(dummy_solver_param(net_name, _batch(net_name)), comm,
                                  planner=Planner("data"), options=options)
    warm = 1
    if options.overlap and not options.bucket_mb:
        warm = PROFILE_START + PROFILE_ITERATIONS
    solver.step(warm)
    clock = LayerClock(solver.net)
    solver.net.observers.insert(0, clock)
    update = solver.apply_update
    update_s = [0.0]

    def timed_update():
        t0 = time.perf_counter()
        update()
        update_s[0] += time.perf_counter() - t0

    solver.apply_update = timed_update
    solver.sync.take_totals()
    comm.barrier()
    t0 = time.perf_counter()
    solver.step(iterations)
    comm.barrier()
    seconds = (time.perf_counter() - t0) / iterations
    totals = solver.sync.take_totals()
    row = {"net": net_name, "np": comm.size, "option": label,
           "iteration_ms": seconds * 1e3, "comm_ms": totals["comm_s"] * 1e3,
           "exposed_ms": totals["exposed_s"] * 1e3, "sparsify_ms": totals["sparsify_s"] * 1e3,
           "bytes": totals["bytes"], "update_ms": update_s[0] * 1e3 / iterations,
           "buckets": [[u.layer for u in b.units] for b in getattr(solver.sync, "buckets", [])]}
    if label == "plain":
        row["layers"] = [l.name for l in solver.net.layers]
        row["forward_ms"] = list(clock.forward * 1e3 / iterations)
        row["backward_ms"] = list(clock.backward * 1e3 / iterations)
    # The slowest rank's iteration is the job's.
    row["iteration_ms"] = max(comm.gather_object(row["iteration_ms"]) or [row["iteration_ms"]])
    del solver
    return row


def _batch(net_name):
    from caffepar.proto.text import read_net_text
    net, _ = read_net_text(str(ROOT / f"models/{net_name}/train_val_dummy.prototxt"))
    return next(l.dummy_data_param.shape[0].dim[0] for l in net.layer if l.type == "DummyData")


def run_ranks(args):
    import gc
    from caffepar.parallel.comm import MpiComm
    comm = MpiComm()
    labels = [l for l in options_of(comm.size) if l in args.options]
    rows = []
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            row = measure(comm, args.net, label, options_of(comm.size)[label], args.iterations)
            row["round"] = r
            rows.append(row)
            gc.collect()
            if comm.rank == 0:
                print(f"{args.net} P={comm.size} round {r} {label}: "
                      f"{row['iteration_ms']:.0f} ms, comm {row['comm_ms']:.0f} ms, "
                      f"exposed {row['exposed_ms']:.0f} ms", file=sys.stderr, flush=True)
    if comm.rank == 0:
        busy = None if args.busy_before == "None" else float(args.busy_before)
        Path(args.out).write_text(json.dumps({"rows": rows, "busy_before": busy,
                                              "busy_after": cpu_busy(),
                                              "when": time.strftime("%Y-%m-%d %H:%M")}))


def cpu_busy(seconds=3.0):
    """Fraction of this machine's CPU time others used over `seconds` (from /proc/stat), so a
    result can say whether it was measured on a quiet machine; None where /proc is absent."""
    def sample():
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)      # idle + iowait, total
    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except OSError:
        return None
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def launch(net_name, ranks, args):
    from caffepar.parallel.launch import find_mpiexec
    out = args.work / f"{net_name}_p{ranks}.json"
    if out.exists() and not args.fresh:
        print(f"{net_name} P={ranks}: measured before ({out})", flush=True)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, __file__, "--ranks-run",
           "--net", net_name, "--out", str(out), "--rounds", str(args.rounds),
           "--iterations", str(args.iterations), "--options", ",".join(args.options),
           "--busy-before", str(cpu_busy())]
    status = subprocess.call(cmd, env=env)
    if status:
        sys.exit(f"{net_name} P={ranks}: the job exited with {status}")


def summarize(args):
    """Mean over rounds per (net, P, option), in run order."""
    table = {}
    for path in sorted(args.work.glob("*_p*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:
            key = (row["net"], row["np"], row["option"])
            table.setdefault(key, []).append(dict(row, busy_before=data.get("busy_before"),
                                                  busy_after=data.get("busy_after"),
                                                  when=data["when"]))
    out = []
    for key, rows in table.items():
        mean = {k: sum(r[k] for r in rows) / len(rows)
                for k in ("iteration_ms", "comm_ms", "exposed_ms", "sparsify_ms", "bytes",
                          "update_ms")}
        out.append(dict(rows[0], **mean, rounds=len(rows),
                        spread=max(r["iteration_ms"] for r in rows) /
                        min(r["iteration_ms"] for r in rows) - 1))
    return out


def write_results(args):
    rows = summarize(args)
    if not rows:
        return
    args.results.mkdir(exist_ok=True)
    fields = ["net", "np", "option", "iteration_ms", "comm_ms", "exposed_ms", "sparsify_ms",
              "update_ms", "bytes", "rounds", "spread", "busy_before", "busy_after", "when"]
    with open(args.results / "comm_opt.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            w.writerow([f"{r[k]:.4g}" if isinstance(r[k], float) else r[k] for k in fields])
    _plot(rows, args.results / "comm_opt.png")
    _markdown(rows, args.results / "comm_opt.md", args.calibration)
    print(f"wrote {args.results / 'comm_opt.csv'}, comm_opt.md, comm_opt.png")


def _plot(rows, png):
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    groups = sorted({(r["net"], r["np"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6), squeeze=False)
    for ax, (net, ranks) in zip(axes[0], groups):
        mine = [r for r in rows if r["net"] == net and r["np"] == ranks]
        labels = [r["option"] for r in mine]
        exposed = [r["exposed_ms"] for r in mine]
        rest = [r["iteration_ms"] - r["exposed_ms"] for r in mine]
        ax.bar(labels, rest, color="#8aa", label="compute (and hidden comm)")
        ax.bar(labels, exposed, bottom=rest, color="#c55", label="exposed comm")
        ax.set_title(f"{net}, P={ranks}", fontsize=9)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
        ax.set_ylabel("ms per iteration", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def _busy_text(row):
    """Whether other work shared the machine, from the CPU others used just before and just
    after the job."""
    values = [v for v in (row["busy_before"], row["busy_after"]) if v is not None]
    if not values:
        return "machine load not recorded."
    shares = ", ".join(f"{100 * v:.0f}%" for v in values)
    verdict = "measured under load (other work was running)" if max(values) > 0.15 \
        else "quiet machine"
    return f"CPU used by others just before / after the job: {shares} ({verdict})."


def alexnet_like_lines():
    """What `caffepar plan --profile` says of each bundled net (the AlexNet-like rule)."""
    lines = ["## AlexNet-like nets (the patent application's rule)", "",
             "`caffepar plan --model models/<net>/train_val_dummy.prototxt --profile 2` "
             "(one process, this machine):", ""]
    for name in ("alexnet", "vgg16", "cifar10_quick"):
        out = subprocess.run([sys.executable, "-m", "caffepar.cli", "plan", "--model",
                              str(ROOT / f"models/{name}/train_val_dummy.prototxt"),
                              "--profile", "2"], capture_output=True, text=True).stdout
        said = next((l for l in out.splitlines() if l.startswith("Backward profile")), "?")
        lines.append(f"- {name}: {said}")
    return lines + [""]


def _units(net_name):
    """The net's gradient units (every layer data parallel), without drawing its weights."""
    from caffepar.fillers import shapes_only
    from caffepar.graph.net import TRAIN, Net
    from caffepar.parallel.buckets import gradient_units
    with shapes_only():
        net = Net(dummy_solver_param(net_name, _batch(net_name)).net_param, phase=TRAIN)
    return gradient_units(net)


def predictions(rows, calibration):
    """{(net, P, option): modelled ms} from each (net, P)'s plain run (per-layer compute and
    update as measured there) and the calibration; top-k's selection as measured."""
    from caffepar.parallel.cost import CostModel
    from caffepar.parallel.schedule import predict_options
    if not calibration.exists():
        return {}, None
    model = CostModel.load(calibration)
    out = {}
    for r in rows:
        if r["option"] != "plain":
            continue
        units = _units(r["net"])
        topk = next((x for x in rows if (x["net"], x["np"], x["option"]) ==
                     (r["net"], r["np"], "top-k")), None)
        select = topk["sparsify_ms"] / 1e3 / (sum(u.count for u in units) * 4) if topk else 0.0
        predicted = predict_options(units, sum(r["forward_ms"]), r["backward_ms"],
                                    r["update_ms"], model, r["np"], TOPK_RATIO,
                                    max(1, r["np"] // 2), model, select)
        for option, m in predicted.items():
            out[(r["net"], r["np"], option)] = m
    return out, model


def cluster_predictions(rows):
    """Markdown lines: the options predicted at P = 16 ... 1024 on 25GbE and 100Gb IB from the
    P=2 plain run's per-layer compute (one thread per rank, this machine's CPU)."""
    from caffepar.parallel.cost import CostModel, node_model
    from caffepar.parallel.schedule import OPTIONS, predict_options
    lines = ["## Predicted on a cluster", "",
             "The planner's model (`caffepar plan --np P --network N --profile-file F`): "
             "per-layer compute of the P=2 plain run here (one thread per rank, this CPU), "
             "communication from the network preset, hierarchical with nodes of 8 ranks over "
             "shared memory, top-k's selection at the rate measured here. Predicted iteration "
             "ms (exposed comm ms):", ""]
    for r in rows:
        if r["option"] != "plain" or r["np"] != 2:
            continue
        units = _units(r["net"])
        topk = next((x for x in rows if (x["net"], x["np"], x["option"]) ==
                     (r["net"], 2, "top-k")), None)
        select = topk["sparsify_ms"] / 1e3 / (sum(u.count for u in units) * 4) if topk else 0.0
        for network in ("25gbe", "100gb-ib"):
            model = CostModel.preset(network)
            lines += [f"### {r['net']}, {network}", "",
                      "| P | " + " | ".join(OPTIONS) + " |", "|---|" + "---|" * len(OPTIONS)]
            for ranks in (16, 64, 256, 1024):
                p = predict_options(units, sum(r["forward_ms"]), r["backward_ms"],
                                    r["update_ms"], model, ranks, TOPK_RATIO, 8, node_model(),
                                    select)
                lines.append(f"| {ranks} | " + " | ".join(
                    f"{p[o].iteration_s * 1e3:.0f} ({p[o].exposed_s * 1e3:.0f})"
                    for o in OPTIONS) + " |")
            lines.append("")
    return lines


def _markdown(rows, path, calibration=None):
    from cpuinfo import cpu_name
    lines = [
        "# Gradient communication options measured",
        "",
        "Produced by `python scripts/bench_comm_opt.py` (each (net, P) is kept in",
        "snapshots/comm_opt/; `--fresh` measures again). AlexNet (batch 16 per rank) and VGG-16",
        "(batch 4 per rank) from their DummyData prototxts, every layer data parallel",
        "(`--parallel data`), SGD; P ranks with one BLAS thread each on this machine. Options in",
        "alternating rounds; per round a fresh solver, warm-up, then timed iterations. Top-k at",
        f"ratio {TOPK_RATIO:g}; hierarchical with P/2 ranks per simulated node.",
        "",
        "Columns: iteration (slowest rank, mean over rounds), comm = time some bucket of",
        "gradients was in flight, exposed = time the solver waited for gradients after backward",
        "(the plain allreduce is all exposed), hidden = comm not exposed, selection = top-k's",
        "selection (on the backward's thread), MB each rank handed to MPI per iteration.",
        "",
    ]
    predicted, model = predictions(rows, calibration) if calibration else ({}, None)
    if model is not None:
        from caffepar.parallel.cost import describe
        lines += [f"Predicted: the planner's model of each option (caffepar.parallel.schedule) "
                  f"from the plain run's per-layer forward, backward and update times and "
                  f"{describe(model)}; top-k's selection as measured. The model lets a "
                  "reduction in flight take no CPU from backward (a network card's view).", ""]
    errors = []
    for net, ranks in sorted({(r["net"], r["np"]) for r in rows}):
        mine = [r for r in rows if r["net"] == net and r["np"] == ranks]
        plain = next((r for r in mine if r["option"] == "plain"), None)
        lines += [f"## {net}, P={ranks}", "",
                  "| option | iteration ms | predicted | error | vs plain | comm ms | "
                  "predicted | exposed ms | predicted | hidden | selection ms | MB/iter | "
                  "spread of rounds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            ratio = f"{r['iteration_ms'] / plain['iteration_ms']:.2f}x" if plain else ""
            hidden = max(0.0, 1 - r["exposed_ms"] / r["comm_ms"]) if r["comm_ms"] else 0.0
            m = predicted.get((net, ranks, r["option"]))
            if m is not None:
                err = (m.iteration_s * 1e3 - r["iteration_ms"]) / r["iteration_ms"]
                errors.append((r["option"], abs(err)))
                pred = (f"{m.iteration_s * 1e3:.0f} | {100 * err:+.0f}%", f"{m.comm_s * 1e3:.0f}",
                        f"{m.exposed_s * 1e3:.0f}")
            else:
                pred = ("- | -", "-", "-")
            lines.append(f"| {r['option']} | {r['iteration_ms']:.0f} | {pred[0]} | {ratio} | "
                         f"{r['comm_ms']:.0f} | {pred[1]} | {r['exposed_ms']:.0f} | {pred[2]} | "
                         f"{100 * hidden:.0f}% | "
                         f"{r['sparsify_ms']:.0f} | {r['bytes'] / 2 ** 20:.1f} | "
                         f"{100 * r['spread']:.0f}% |")
        lines += ["", f"Measured {mine[0]['when']}; {_busy_text(mine[0])}", ""]
    if errors:
        by_option = {}
        for option, e in errors:
            by_option.setdefault(option, []).append(e)
        lines += ["Prediction error of the iteration time (absolute, over nets and P): " +
                  "; ".join(f"{o} median {100 * sorted(v)[len(v) // 2]:.0f}%, largest "
                            f"{100 * max(v):.0f}%" for o, v in by_option.items()) + ".", ""]
    lines += [
        "## Where overlap cannot hide communication here",
        "",
        "All ranks share this machine's 2 cores and talk through shared memory. Moving and",
        "summing gradients in shared memory is work the ranks' own cores do (MPICH copies the",
        "data and adds it up on the CPU); nothing like a network card's DMA engine moves it on",
        "its own. While backward keeps every core busy, a reduction in flight gets CPU only",
        "by taking it from backward, so overlap turns exposed communication into slower",
        "backward layers, and the iteration takes about as long (see iteration ms against comm",
        "and exposed above). The hidden share counts time a bucket was in flight while the",
        "solver did not wait, not time saved. Top-k selection also runs on the backward's",
        "thread. On a cluster the network card moves the data while the cores compute.",
        "",
        "Where the iteration times of the options differ by less than the spread of the rounds",
        "(the machine shared with other work), they do not differ. The model above predicts",
        "overlap as a cluster would run it (communication costs the cores nothing), so here",
        "it is optimistic by about the comm it claims to hide.",
        "",
    ] + alexnet_like_lines() + cluster_predictions(rows) + [
        f"Machine: {cpu_name()}, {os.cpu_count()} cores.",
        "",
        "![compute and exposed communication per option](comm_opt.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default="alexnet,vgg16")
    ap.add_argument("--np", default="2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--options", default=",".join(options_of(2)),
                    type=lambda s: [x for x in s.split(",") if x],
                    help=f"a subset of {', '.join(options_of(2))}")
    ap.add_argument("--calibration", type=Path, default=ROOT / "results/calibration_shm.json",
                    help="the shm calibration the predictions here use (caffepar calibrate)")
    ap.add_argument("--work", type=Path, default=ROOT / "snapshots/comm_opt")
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--fresh", action="store_true", help="measure again what was measured")
    ap.add_argument("--report-only", action="store_true",
                    help="only rewrite results/ from what was measured")
    ap.add_argument("--ranks-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--net", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--busy-before", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ranks_run:
        run_ranks(args)
        return
    if not args.report_only:
        for net_name in args.nets.split(","):
            for ranks in (int(p) for p in args.np.split(",")):
                launch(net_name, ranks, args)
    write_results(args)


if __name__ == "__main__":
    main()
