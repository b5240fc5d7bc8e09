#!/usr/bin/env python
"""What VGG-16 and AlexNet would cost on a cluster: the cost model's predicted iteration time of
DATA, HYBRID and AUTO at P = 8 ... 1024 on 25GbE and 100Gb InfiniBand, batch 1-64 per rank, and
the model checked where it can be: predicted vs measured at P = 2 and 4 on this machine.

    python scripts/cluster_plan.py [--calibration results/calibration_shm.json] [--rounds 3]
                                   [--no-local]

Compute comes from a profile of each net measured here in one process with one BLAS thread
(as a rank runs; `caffepar time --save-profile`, once per round, the fastest kept), in
snapshots/cluster_plan/, scaled linearly to other batches; a MODEL layer computes the same
FLOPs as DATA. The rounds alternate their order and record the CPU others used before each run
(the machine is shared). Communication comes from the network presets of
caffepar.parallel.cost (the cluster table) or from a shm calibration made here (the check).
Compute and communication are added (no overlap), as caffepar's plain synchronous SGD runs.
Writes results/cluster_plan.csv and results/cluster_plan.md.
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cpuinfo import cpu_name  # noqa: E402

NETS = {"vgg16": 4, "alexnet": 16}           # the bundled DummyData batch per rank
NETWORKS = ("25gbe", "100gb-ib")
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
LOCAL_RANKS = (2, 4)
STATE = ROOT / "snapshots" / "cluster_plan"
RESULTS = ROOT / "results"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def model_path(name):
    return ROOT / f"models/{name}/train_val_dummy.prototxt"


def caffepar(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "caffepar.cli", *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode:
        sys.exit(f"caffepar {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc.stdout


def measure_profile(name, round_):
    """`caffepar time --save-profile`: the net's per-layer compute here in one process with one
    BLAS thread (as a rank computes) at its bundled batch; (forward + backward ms, file)."""
    from caffepar.timing import load_profile, profile_compute_ms
    STATE.mkdir(parents=True, exist_ok=True)
    path = STATE / f"{name}_profile_{round_}.json"
    caffepar("time", "--model", model_path(name), "--iterations", "3", "--save-profile", path,
             env=ONE_THREAD)
    doc = load_profile(path)
    return profile_compute_ms(doc, doc["batch"]), str(path)


def profile(name):
    """The fastest of the net's profiles measured in the rounds (the machine is shared: the
    least disturbed one); one is measured when there is none."""
    from caffepar.timing import load_profile, profile_compute_ms
    paths = sorted(STATE.glob(f"{name}_profile_*.json"))
    if not paths:
        print(f"profiling {name} (one thread) ...", flush=True)
        paths = [Path(measure_profile(name, 0)[1])]
    docs = [load_profile(p) for p in paths]
    return min(docs, key=lambda d: profile_compute_ms(d, d["batch"]))


def predict(name, batch, ranks, cost_model):
    """{plan: (comm ms, model parallel layers)} for the net at `batch` per rank."""
    from caffepar.fillers import shapes_only
    from caffepar.graph.net import Net
    from caffepar.graph.passes import with_batch
    from caffepar.parallel.plan import compare_plans
    from caffepar.proto import caffe_pb2
    from caffepar.proto.text import read_net_text
    param, _ = read_net_text(str(model_path(name)))
    with shapes_only():
        net = Net(with_batch(param, batch), phase=caffe_pb2.TRAIN)
    return {plan: (comm, [p.name for p in plans if p.mode == "MODEL"])
            for plan, (plans, comm) in compare_plans(net, cost_model, ranks).items()}


def cluster_rows():
    from caffepar.parallel.cost import CostModel
    from caffepar.timing import profile_compute_ms
    rows = []
    for name in NETS:
        prof = profile(name)
        for network in NETWORKS:
            model = CostModel.preset(network)
            for batch in BATCHES:
                compute = profile_compute_ms(prof, batch)
                for ranks in RANKS:
                    pred = predict(name, batch, ranks, model)
                    row = {"net": name, "network": network, "np": ranks, "batch": batch,
                           "compute_ms": round(compute, 2)}
                    for plan, (comm, split) in pred.items():
                        row[f"{plan.lower()}_comm_ms"] = round(comm, 2)
                        row[f"{plan.lower()}_ms"] = round(compute + comm, 2)
                    row["auto_splits"] = " ".join(pred["AUTO"][1]) or "-"
                    row["hybrid_splits"] = " ".join(pred["HYBRID"][1]) or "-"
                    rows.append(row)
    return rows


# ---------------------------------------------------------------- predicted vs measured here
def measure_here(name, ranks, plan, calibration):
    """`caffepar time --np P` here: (iteration ms, comm ms summed over layers)."""
    out = caffepar("time", "--model", model_path(name), "--np", ranks, "--iterations", "3",
                   "--parallel", plan.lower(), "--calibration", calibration, env=ONE_THREAD)
    iteration = float(re.search(r"Average Forward-Backward: ([\d.]+) ms", out).group(1))
    comm = sum(float(m) for m in re.findall(r"comm: ([\d.]+) ms", out))
    return iteration, comm


PLANS = ("DATA", "HYBRID", "AUTO")


def measure_rounds(calibration, rounds):
    """{"net/P/plan": [runs]}: every net's one-process profile and every (net, P, plan) run
    measured once per round, the rounds in alternating order (the machine is shared: a slow
    spell then hits every configuration alike), each run with the CPU share others used just
    before it. Kept in snapshots/cluster_plan/local.json; a rerun measures only the rounds
    still missing."""
    from bench_comm_opt import cpu_busy
    path = STATE / "local.json"
    done = json.loads(path.read_text()) if path.exists() else {}
    keys = [(name, 1, "profile") for name in NETS] + \
        [(name, ranks, plan) for name in NETS for ranks in LOCAL_RANKS for plan in PLANS]
    for r in range(rounds):
        for name, ranks, plan in keys if r % 2 == 0 else keys[::-1]:
            runs = done.setdefault(f"{name}/{ranks}/{plan}", [])
            if len(runs) > r:
                continue
            print(f"measuring {name} P={ranks} {plan}, round {r + 1} ...", flush=True)
            busy = cpu_busy()
            if plan == "profile":
                iteration, comm = measure_profile(name, r)[0], 0.0
            else:
                iteration, comm = measure_here(name, ranks, plan, calibration)
            runs.append({"iteration_ms": iteration, "comm_ms": comm, "others_busy": busy,
                         "when": time.strftime("%Y-%m-%d %H:%M")})
            STATE.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(done, indent=1))
    return done


def local_rows(calibration, rounds):
    from caffepar.parallel.cost import CostModel
    from caffepar.timing import profile_compute_ms
    model = CostModel.load(calibration)
    cores = os.cpu_count() or 1
    done = measure_rounds(calibration, rounds)
    rows = []
    for name, batch in NETS.items():
        prof = profile(name)
        for ranks in LOCAL_RANKS:
            pred = predict(name, batch, ranks, model)
            # Ranks beyond the cores share them: each rank's compute slows by P / cores.
            compute = profile_compute_ms(prof, batch) * max(1.0, ranks / cores)
            for plan in PLANS:
                runs = done[f"{name}/{ranks}/{plan}"][:rounds]
                best = min(runs, key=lambda run: run["iteration_ms"])
                iteration = best["iteration_ms"]
                predicted = compute + pred[plan][0]
                busy = [run["others_busy"] for run in runs if run["others_busy"] is not None]
                rows.append({"net": name, "np": ranks, "batch": batch, "plan": plan,
                             "splits": " ".join(pred[plan][1]) or "-",
                             "predicted_ms": round(predicted, 1),
                             "measured_ms": round(iteration, 1),
                             "error_pct": round(100 * (predicted - iteration) / iteration, 1),
                             "predicted_comm_ms": round(pred[plan][0], 1),
                             "comm_ms_in_layers": round(best["comm_ms"], 1),
                             "rounds": len(runs),
                             "spread_pct": round(100 * (max(r["iteration_ms"] for r in runs) /
                                                        iteration - 1), 1),
                             "others_busy_pct": round(100 * max(busy), 0) if busy else "",
                             "when": best["when"]})
    return rows


def write(rows, local, calibration):
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "cluster_plan.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    from caffepar.parallel.cost import NETWORKS as PRESETS
    lines = ["# VGG-16 and AlexNet on a cluster: DATA vs HYBRID vs AUTO, predicted", "",
             "Produced by `python scripts/cluster_plan.py`; every row of "
             "`results/cluster_plan.csv` is `caffepar plan --model M --np P --batch B "
             "--network N --profile-file F`. Iteration = compute + communication (plain "
             "synchronous SGD, no overlap). Compute: each net profiled here in one process "
             "with one BLAS thread at its bundled batch (`caffepar time --save-profile`, the "
             "fastest of the rounds), scaled linearly to the batch. "
             "Communication: the cost model (alpha-beta per collective) with the presets",
             ""]
    lines += [f"- `{k}`: {v[2]}" for k, v in PRESETS.items() if k in NETWORKS]
    lines += ["", "HYBRID is the paper's rule (InnerProduct layers above 8 Mi parameters MODEL); "
              "AUTO picks per InnerProduct the mode predicted to communicate less. Compute is "
              "one core of this CPU per rank: a cluster node computing faster (more cores, a "
              "GPU) leaves communication a larger share of the iteration, and the plans' "
              "differences grow with it (`results/cluster_plan.csv` has each plan's comm ms "
              "alone).", ""]
    for name in NETS:
        for network in NETWORKS:
            lines += [f"## {name}, {network}", "",
                      "Predicted iteration ms, DATA / HYBRID / AUTO (AUTO's model parallel "
                      "layers)", "",
                      "| P | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
                      "|---|" + "---|" * len(BATCHES)]
            for ranks in RANKS:
                cells = []
                for b in BATCHES:
                    r = next(r for r in rows if (r["net"], r["network"], r["np"], r["batch"])
                             == (name, network, ranks, b))
                    cells.append(f"{r['data_ms']:.0f} / {r['hybrid_ms']:.0f} / "
                                 f"**{r['auto_ms']:.0f}** ({r['auto_splits']})")
                lines.append(f"| {ranks} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += summary(rows)
    if local:
        errs = [abs(r["error_pct"]) for r in local]
        rounds = min(r["rounds"] for r in local)
        lines += ["## The model checked here: predicted vs measured at P = 2 and 4", "",
                  f"`caffepar time --np P --parallel data|hybrid|auto --calibration "
                  f"{Path(calibration).name}` on this machine (one BLAS thread per rank; "
                  f"{rounds} rounds, every configuration and the one-process profiles "
                  "(`caffepar time --save-profile`, one thread) once per round, the rounds in "
                  "alternating order; the best round is shown, spread = slowest round / best "
                  "- 1), against `caffepar plan` with the same calibration and the fastest "
                  f"profile. This machine has {os.cpu_count()} cores: at P=4 ranks share them, "
                  "so the predicted compute is the profile's times P / cores. Others' CPU = "
                  "the largest share of the machine's CPU time other work used in the 3 s "
                  "before a round of that row started.", "",
                  "| net | P | batch/rank | plan | MODEL layers | predicted ms | measured ms "
                  "| error | spread | others' CPU | predicted comm ms "
                  "| comm measured in layers ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in local:
            busy = f"{r['others_busy_pct']:.0f}%" if r["others_busy_pct"] != "" else "?"
            lines.append(f"| {r['net']} | {r['np']} | {r['batch']} | {r['plan']} | "
                         f"{r['splits']} | {r['predicted_ms']} | {r['measured_ms']} | "
                         f"{r['error_pct']:+.1f}% | {r['spread_pct']:.0f}% | {busy} | "
                         f"{r['predicted_comm_ms']} | {r['comm_ms_in_layers']} |")
        loaded = [r for r in local if r["others_busy_pct"] != "" and r["others_busy_pct"] > 15]
        lines += ["", f"Median absolute error {sorted(errs)[len(errs) // 2]:.1f}%, largest "
                  f"{max(errs):.1f}%. The comm measured in layers is what model-parallel "
                  "layers record inside forward and backward (the DATA allreduce is not "
                  "listed per layer). " + (
                      f"{len(loaded)} of {len(local)} rows had other work taking more than "
                      "15% of the CPU before one of their rounds (measured under load)."
                      if loaded else "Other work took at most 15% of the CPU before every "
                      "round (a quiet machine)."), ""]
        with open(RESULTS / "cluster_plan_local.csv", "w", newline="") as f:
            w = csv.DictWriter(f, list(local[0]))
            w.writeheader()
            w.writerows(local)
    lines.append(f"Machine: {cpu_name()}, {os.cpu_count()} cores; measured {time.strftime('%Y-%m-%d')}.")
    (RESULTS / "cluster_plan.md").write_text("\n".join(lines) + "\n")


def summary(rows):
    out = ["## What the predictions say", ""]
    for name in NETS:
        for network in NETWORKS:
            mine = [r for r in rows if r["net"] == name and r["network"] == network]
            auto_vs_data = [r["data_ms"] / r["auto_ms"] for r in mine]
            auto_vs_hybrid = [r["hybrid_ms"] / r["auto_ms"] for r in mine]
            splits = {}
            for r in mine:
                splits.setdefault(r["auto_splits"], []).append((r["np"], r["batch"]))
            out.append(f"- {name} on {network}: AUTO is {min(auto_vs_data):.2f}-"
                       f"{max(auto_vs_data):.2f}x faster than DATA and "
                       f"{min(auto_vs_hybrid):.2f}-{max(auto_vs_hybrid):.2f}x than HYBRID. "
                       "AUTO splits: " + "; ".join(
                           f"{k} in {len(v)} of {len(mine)} cells" for k, v in
                           sorted(splits.items(), key=lambda kv: -len(kv[1]))) + ".")
    return out + [""]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default=str(RESULTS / "calibration_shm.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-local", action="store_true", help="skip the check on this machine")
    args = ap.parse_args()
    local = []
    if not args.no_local:
        if not Path(args.calibration).exists():
            sys.exit(f"{args.calibration}: no calibration (caffepar calibrate --np 2 -o ...; "
                     "--np 4 -o the same file)")
        local = local_rows(args.calibration, args.rounds)
    rows = cluster_rows()
    write(rows, local, args.calibration)
    print(f"wrote results/cluster_plan.csv ({len(rows)} rows) and cluster_plan.md")


if __name__ == "__main__":
    main()
