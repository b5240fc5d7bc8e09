#!/usr/bin/env python
"""Fine-tuning MobileNet-SSD on a VOC-format folder, caffepar beside the SSD fork of Caffe:
mAP on held-out images over training, time per iteration, and P=2 against one process.

    python scripts/train_ssd.py --mobilenet-ssd DIR --caffe PATH/caffe [--work DIR]
                                [--size 96] [--iterations 1500] [--batch 8] [--base-lr 0.002]
                                [--lr-mult 1] [--eval-images N]

DIR is a checkout of chuanqi305/MobileNet-SSD (its template/MobileNetSSD_{train,test}_template
.prototxt and solver_train.prototxt are read from there; nothing of it is copied here). PATH/caffe
is the weiliu89/caffe `ssd` branch's tool. The steps, each skipped when its output exists (so an
interrupted run continues where it stopped; training resumes from its last snapshot):

1. `scripts/make_shapes_voc.py` draws the dataset (3000 training, 500 test images of 5 shape
   classes) and `caffepar data annoset` converts it (JPEG records, label map, name/size file);
2. the published nets get what gen_model.sh gives them (num_classes = 6) and, so that runs fit
   a shared 2-core machine, a smaller input (--size; 300 published; PriorBox sizes scaled by
   size/300, so the priors cover the same fraction of the image), batch sizes, the data paths
   and CPU mode. The solver keeps its type (RMSProp), weight decay, steps and ap_version
   ("11point"); there are no published weights to fine-tune from (the repository's caffemodel
   is not in it), so both programs train from their fillers, at --base-lr (the published 5e-4
   is a fine-tuning rate) and with the layers the published net keeps from its VOC model at
   --lr-mult (0.1 published) for --iterations, testing on --eval-images every --test-interval;
3. the fork and caffepar train side by side (one thread each), so that their mAP curves share
   the machine's ups and downs;
4. time per iteration: --rounds alternating runs of --time-iterations, the fork then caffepar,
   each alone with all threads (a ratio measured side by side); the fork runs with
   OPENBLAS_CORETYPE set to the widest kernel this CPU runs (unless set already);
5. caffepar over `--np 2 --parallel data` and `--parallel hybrid` at batch B/2 per rank
   against one process at batch B for --parallel-iterations iterations, augmentations on:
   losses and weights must agree.

Writes results/ssd_finetune.{csv,md,png}.
"""
import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
CLASSES = 6                                    # background + the 5 shape classes


# ---------------------------------------------------------------- nets and solver
def edit_net(text, size, source, batch, label_map, lr_mult=0.1):
    """The published prototxt as gen_model.sh makes it for CLASSES, at input `size`, with the
    layers kept from the VOC model (lr_mult 0.1, biases 0.2) learning at `lr_mult`."""
    if lr_mult != 0.1:
        text = re.sub(r"lr_mult: 0\.([12])\b",
                      lambda m: f"lr_mult: {lr_mult * int(m.group(1)):g}", text)
    text = text.replace("cls6x", str(CLASSES * 6)).replace("cls3x", str(CLASSES * 3))
    text = text.replace("cls1x", str(CLASSES))
    text = re.sub(r"(height|width): 300\b", lambda m: f"{m.group(1)}: {size}", text)
    scale = size / 300.0
    text = re.sub(r"(min_size|max_size): ([0-9.]+)",
                  lambda m: f"{m.group(1)}: {round(float(m.group(2)) * scale):.1f}", text)
    text = re.sub(r'source: "[^"]*"', f'source: "{source}"', text)
    text = re.sub(r"batch_size: \d+", f"batch_size: {batch}", text)
    text = re.sub(r'label_map_file: "[^"]*"', f'label_map_file: "{label_map}"', text)
    return text


def edit_solver(text, train_net, test_net, test_iter, args, prefix, max_iter=None):
    """solver_train.prototxt with this run's nets, lengths, rate and CPU mode (its steps, at
    20000 and 40000, stay: a shorter run keeps one rate)."""
    max_iter = max_iter or args.iterations
    fields = {"train_net": f'"{train_net}"', "test_net": f'"{test_net}"',
              "test_iter": test_iter, "test_interval": args.test_interval,
              "max_iter": max_iter, "snapshot": args.snapshot, "snapshot_prefix": f'"{prefix}"',
              "solver_mode": "CPU", "test_initialization": "true", "display": args.display,
              "random_seed": args.seed, "base_lr": args.base_lr}
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() not in fields]
    lines += [f"{key}: {value}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- logs
ITER = re.compile(r"^I(?:\d{4})?\d{4} (\d\d):(\d\d):([\d.]+) .*Iteration (\d+)(?: \(.*\))?, "
                  r"loss = ([\d.e+-]+|nan|inf)")
TESTING = re.compile(r"Iteration (\d+), Testing net")
MAP = re.compile(r"Test net output #0: detection_eval = ([\d.e+-]+)")


def parse_log(paths):
    """(smoothed losses {iter: loss}, mAP {iter: value}, seconds per iteration of each display
    interval that had no test in it), from either program's log (glog lines). The fork prints
    no detection_eval line when no detection passed the threshold: a test followed by training
    without one counts as mAP 0."""
    losses, maps, per_iter = {}, {}, []
    for path in paths:
        testing, last = None, None
        for line in Path(path).read_text(errors="replace").splitlines():
            m = ITER.search(line)
            if m:
                h, mi, sec, it = int(m.group(1)), int(m.group(2)), float(m.group(3)), \
                    int(m.group(4))
                losses[it] = float(m.group(5))
                if testing is not None and testing not in maps:
                    maps[testing] = 0.0
                t = h * 3600 + mi * 60 + sec
                if last is not None and it > last[0] and not last[2]:
                    per_iter.append(((t - last[1]) % 86400) / (it - last[0]))
                last = (it, t, False)
                continue
            m = TESTING.search(line)
            if m:
                testing = int(m.group(1))
                if last is not None:
                    last = (last[0], last[1], True)
                continue
            m = MAP.search(line)
            if m and testing is not None:
                maps[testing] = float(m.group(1))
    return losses, maps, per_iter


def latest_state(folder, prefix):
    states = sorted(folder.glob(f"{prefix}_iter_*.solverstate"),
                    key=lambda p: int(re.search(r"_iter_(\d+)", p.name).group(1)))
    return states[-1] if states else None


def run_logged(cmd, log, cwd, env):
    """Run cmd in cwd with its output into log; a failure ends the script naming the log."""
    print("+", " ".join(map(str, cmd)), f"> {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=f,
                              stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{cmd[0]} failed ({proc.returncode}); see {log}")


def caffepar_cmd():
    exe = Path(sys.executable).with_name("caffepar")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "caffepar.cli"]


def blas_core():
    """The OpenBLAS core type for the fork (Debian's OpenBLAS may fall back to an old kernel on
    a CPU newer than itself): the widest this CPU runs, unless OPENBLAS_CORETYPE is set."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return os.environ["OPENBLAS_CORETYPE"]
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return "SkylakeX" if "avx512f" in flags else "Haswell" if "avx2" in flags else None


def fork_env(env):
    core = blas_core()
    return dict(env, OPENBLAS_CORETYPE=core) if core else dict(env)


def blas_kernel(caffe):
    """The kernel the fork's OpenBLAS runs under fork_env (openblas_get_corename)."""
    probe = ("import ctypes, sys\n"
             "lib = ctypes.CDLL(sys.argv[1]); lib.openblas_get_corename.restype = ctypes.c_char_p\n"
             "print(lib.openblas_get_corename().decode())")
    try:
        libs = subprocess.run(["ldd", str(caffe)], capture_output=True, text=True).stdout
        path = re.search(r"libopenblas\S*\s*=>\s*(\S+)", libs).group(1)
        return subprocess.run([sys.executable, "-c", probe, path], env=fork_env(os.environ),
                              capture_output=True, text=True, check=True).stdout.strip()
    except (AttributeError, OSError, subprocess.CalledProcessError):
        return None


def command(kind, solver, args, threads, state=None):
    if kind == "fork":
        cmd = [args.caffe, "train", f"-solver={solver}"]
        return cmd + [f"-snapshot={state}"] if state else cmd
    cmd = caffepar_cmd() + ["train", "--solver", solver, "--threads", str(threads)]
    return cmd + ["--snapshot", state] if state else cmd


def train_side_by_side(work, args):
    """The fork's and caffepar's training runs at once, one thread each (continued from their
    last snapshots when interrupted); returns each one's logs."""
    procs = {}
    for kind in ("fork", "caffepar"):
        folder = work / kind
        if kind in args.skip or (folder / "done").exists():
            continue
        logs = sorted(folder.glob("train*.log"))
        state = latest_state(folder / "snap", "mobilenet")
        log = folder / f"train{len(logs):02d}.log"
        cmd = command(kind, "solver.prototxt", args, 1, state)
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   GLOG_logtostderr="1")
        env = fork_env(env) if kind == "fork" else env
        print("+", " ".join(map(str, cmd)), f"> {log}", flush=True)
        procs[kind] = (subprocess.Popen([str(c) for c in cmd], cwd=folder, env=env,
                                        stdout=open(log, "w"), stderr=subprocess.STDOUT), log)
    for kind, (proc, log) in procs.items():
        if proc.wait():
            sys.exit(f"{kind} training failed ({proc.returncode}); see {log}")
        (work / kind / "done").write_text("")
    return {kind: sorted((work / kind).glob("train*.log")) for kind in ("fork", "caffepar")}


def time_rounds(work, data, args, templates):
    """Seconds per iteration of each program alone with all threads, in alternating rounds of
    args.time_iterations from the same start (no test): {kind: [per-round medians]}."""
    out = work / "timing"
    result = out / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads), GLOG_logtostderr="1")
    times = {"fork": [], "caffepar": []}
    for r in range(args.rounds):
        for kind in ("fork", "caffepar"):
            folder = out / f"{kind}{r}"
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "snap").mkdir(parents=True)
            write_nets(folder, data, args, templates, args.batch)
            solver = edit_solver(templates["solver"], "train.prototxt", "test.prototxt", 1,
                                 argparse.Namespace(**{**vars(args), "test_interval": 10 ** 6,
                                                       "snapshot": 0, "display": 5}),
                                 "snap/mobilenet", max_iter=args.time_iterations)
            (folder / "solver.prototxt").write_text(
                re.sub(r"snapshot_after_train: \w+", "snapshot_after_train: false",
                       solver.replace("test_initialization: true", "test_initialization: false")))
            run_logged(command(kind, "solver.prototxt", args, args.threads), folder / "train.log",
                       folder, fork_env(env) if kind == "fork" else env)
            per_iter = parse_log([folder / "train.log"])[2][1:]     # the first interval warms up
            times[kind].append(float(np.median(per_iter)))
            print(f"round {r}: {kind} {times[kind][-1]:.3f} s/iteration", flush=True)
    times["load"] = os.getloadavg()[0]
    result.write_text(json.dumps(times, indent=1))
    return times


def write_nets(folder, data, args, templates, batch):
    (folder / "train.prototxt").write_text(edit_net(
        templates["train"], args.size, data / "trainval_lmdb", batch,
        data / "voc" / "labelmap.prototxt", args.lr_mult))
    (folder / "test.prototxt").write_text(edit_net(
        templates["test"], args.size, data / "test_lmdb", 8, data / "voc" / "labelmap.prototxt",
        args.lr_mult))


# ---------------------------------------------------------------- P=2 against one process
def parallel_check(work, data, args, env, templates):
    """caffepar at batch B (one process) and at B/2 on each of 2 ranks, in DATA and in HYBRID
    mode, from the same start with augmentations on: per-iteration loss and final weights;
    beside them one process at batch B with 1 thread instead of args.threads, which sums in
    another order: the difference float rounding alone makes in this training."""
    from caffepar.io.weights import read_caffemodel
    out = work / "parallel"
    result = out / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    out.mkdir(parents=True, exist_ok=True)
    n = args.parallel_iterations
    runs = {}
    for name, batch, ranks, threads in (
            ("one", args.batch, 1, args.threads), ("data", args.batch // 2, 2, args.threads // 2),
            ("hybrid", args.batch // 2, 2, args.threads // 2), ("threads", args.batch, 1, 1)):
        folder = out / name
        snap = folder / "snap" / f"mobilenet_iter_{n}.caffemodel"
        if not snap.exists():
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "snap").mkdir(parents=True)
            write_nets(folder, data, args, templates, batch)
            solver = edit_solver(templates["solver"], "train.prototxt", "test.prototxt", 1,
                                 argparse.Namespace(**{**vars(args), "test_interval": 10 ** 6,
                                                       "snapshot": n, "display": 1}),
                                 "snap/mobilenet", max_iter=n)
            solver = solver.replace("test_initialization: true", "test_initialization: false")
            (folder / "solver.prototxt").write_text(solver)
            cmd = caffepar_cmd() + ["train", "--solver", "solver.prototxt", "--threads",
                                    str(max(1, threads))]
            if ranks > 1:
                cmd += ["--np", str(ranks), "--parallel", name]
            run_logged(cmd, folder / "train.log", folder,
                       dict(env, OPENBLAS_NUM_THREADS=str(max(1, threads)),
                            OMP_NUM_THREADS=str(max(1, threads))))
        weights = {(name_, i): np.asarray(v).reshape(shape) for name_, _t, blobs in
                   read_caffemodel(snap).layers
                   for i, (v, shape, _l) in enumerate(blobs)}
        with open(folder / "snap" / "mobilenet_log.csv", newline="") as f:
            losses = [float(r["loss"]) for r in csv.DictReader(f) if r.get("lr")]
        runs[name] = (weights, losses)
    w1, l1 = runs["one"]
    res = {"iterations": n, "batch": args.batch, "blobs": len(w1), "losses_one": l1,
           "max_weight": max(float(np.max(np.abs(w1[k]))) for k in w1), "modes": {}}
    for mode in ("data", "hybrid", "threads"):
        w2, l2 = runs[mode]
        res["modes"][mode] = {
            "max_abs_weight_diff": max(float(np.max(np.abs(w1[k] - w2[k]))) for k in w1),
            "max_rel_weight_diff": max(float(np.max(np.abs(w1[k] - w2[k]) /
                                                    (np.abs(w1[k]) + 1e-3))) for k in w1),
            "losses": l2, "max_loss_diff": float(np.max(np.abs(np.array(l1) - np.array(l2))))}
    result.write_text(json.dumps(res, indent=1))
    return res


# ---------------------------------------------------------------- outputs
def cpu_name():
    """The model name with its family and model numbers (a virtual CPU's name may hide them)."""
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    name = info.get("model name", "unknown CPU")
    if "cpu family" in info and "model" in info:
        name += f" (family {info['cpu family']} model {info['model']})"
    return name


def write_results(args, runs, timing, parallel, out):
    iters = sorted(set(runs["caffepar"]["maps"]) | set(runs["fork"]["maps"]))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", "caffepar_map", "fork_map", "caffepar_loss", "fork_loss"])
        for it in iters:
            w.writerow([it] + [f"{runs[k]['maps'][it]:.6f}" if it in runs[k]["maps"] else ""
                               for k in ("caffepar", "fork")] +
                       [f"{runs[k]['losses'][it]:.6f}" if it in runs[k]["losses"] else ""
                        for k in ("caffepar", "fork")])
    last = {k: max(runs[k]["maps"]) for k in runs}
    ratios = [f / c for f, c in zip(timing["fork"], timing["caffepar"])]

    def cell(v):
        return "" if v is None else f"{v:.4f}"

    evaluated = args.eval_images or args.test_images
    maps = {k: runs[k]["maps"] for k in runs}
    common = [it for it in iters if it in maps["caffepar"] and it in maps["fork"]]
    late = [it for it in common if it >= max(common) // 2]
    gap = [maps["caffepar"][it] - maps["fork"][it] for it in late]
    wobble = {k: float(np.std(np.diff([maps[k][it] for it in late]))) if len(late) > 2 else 0.0
              for k in maps}
    kernel = args.blas_kernel or "unknown"
    lines = [
        "# Fine-tuning MobileNet-SSD: caffepar beside the SSD fork of Caffe",
        "",
        f"`python scripts/train_ssd.py --mobilenet-ssd DIR --caffe PATH/caffe --size {args.size} "
        f"--batch {args.batch} --base-lr {args.base_lr:g} --lr-mult {args.lr_mult:g} "
        f"--iterations {args.iterations} --test-interval {args.test_interval} "
        f"--test-images {args.test_images} "
        + (f"--eval-images {args.eval_images} " if args.eval_images else "")
        + f"--object-sizes {args.object_sizes[0]:g},{args.object_sizes[1]:g} "
        f"--max-objects {args.max_objects} --parallel-iterations {args.parallel_iterations} "
        f"--rounds {args.rounds} --time-iterations {args.time_iterations}` on {cpu_name()} ({os.cpu_count()} cores, shared with "
        "other jobs). DIR: chuanqi305/MobileNet-SSD; PATH/caffe: weiliu89/caffe `ssd` built "
        "CPU_ONLY (tests/fixtures/ssd/README.md). The fork ran with "
        f"OPENBLAS_CORETYPE={blas_core()} (Debian's OpenBLAS can fall back to an older kernel on "
        f"a CPU newer than itself; its openblas_get_corename() said {kernel}).",
        "",
        f"- Data: `scripts/make_shapes_voc.py` ({args.train_images} training and "
        f"{args.test_images} test images, five shape classes on gradients, stripes, noise and "
        f"clutter, 160-280 px, 1-{args.max_objects} objects per image with sides "
        f"{args.object_sizes[0]:.0%}-{args.object_sizes[1]:.0%} of the image's), converted "
        "with `caffepar data annoset` (JPEG records); the fork reads the same LMDBs." +
        (f" The generator's default goes down to 8%: at {args.size} px such a shape is "
         f"{0.08 * args.size:.0f} px, under half the side of the smallest prior "
         f"({round(60 * args.size / 300)} px), and the expansion augmentation makes it up to "
         "four times smaller still; a short run from scratch learns little from those."
         if args.object_sizes[0] > 0.08 else ""),
        "- Net and solver: MobileNet-SSD's MobileNetSSD_train/test_template.prototxt and "
        f"solver_train.prototxt with num_classes {CLASSES} (as its gen_model.sh) and all the "
        "published augmentations (distortion, expansion up to 4x, the six samplers, five "
        "interpolations, mirror); RMSProp, the published weight decay and ap_version 11point. "
        "Changed, so that a curve means something within hours on a shared 2-core machine: "
        f"input {args.size}x{args.size} instead of 300x300 (PriorBox min/max sizes scaled by "
        f"{args.size}/300), train batch {args.batch}, test batch 8, {args.iterations} "
        "iterations. There are no published weights to start from (the caffemodel is not in "
        "the repository), so both programs train from their fillers; the published solver "
        "is a fine-tuning one (base_lr 0.0005, and lr_mult 0.1 on every layer but the new "
        "class heads, to keep the VOC features), which from fillers leaves the backbone "
        f"nearly frozen. Here every layer learns at lr_mult {args.lr_mult:g} (biases "
        f"{2 * args.lr_mult:g}), base_lr {args.base_lr:g}.",
        "- Test: mAP (11point) on " + (
            f"the first {evaluated} of the {args.test_images}" if evaluated < args.test_images
            else f"the {evaluated}") + " held-out "
        f"images every {args.test_interval} iterations, as each solver reports it (\"Test net "
        "output #0: detection_eval\"). The two runs trained side by side, one thread each"
        + (f", in {max(runs[k]['legs'] for k in runs)} legs (each continued from its last "
           "snapshots: the script resumes a stopped or lengthened run)"
           if max(runs[k]["legs"] for k in runs) > 1 else "") + ".",
        "",
        "| iteration | caffepar mAP | fork mAP |",
        "|---|---|---|",
    ]
    for it in iters:
        lines.append(f"| {it} | {cell(maps['caffepar'].get(it))} | {cell(maps['fork'].get(it))} |")
    early = [it for it in common if 0 < it <= max(common) // 10]
    final = [it for it in common if it > max(common) * 4 // 5]
    rise = "; ".join(
        f"{k}'s mAP rose from {np.mean([maps[k][it] for it in early]):.3f} on average over "
        f"iterations {early[0]}-{early[-1]} to {np.mean([maps[k][it] for it in final]):.3f} "
        f"over {final[0]}-{final[-1]}" for k in ("caffepar", "fork")) if early and final else ""
    lines += [
        "",
        (rise + ".") if rise else "",
        "",
        f"Last test: caffepar {cell(maps['caffepar'][last['caffepar']])} at iteration "
        f"{last['caffepar']}, fork {cell(maps['fork'][last['fork']])} at iteration "
        f"{last['fork']}." + "".join(
            f" {'The fork' if k == 'fork' else 'caffepar'}'s training was stopped at iteration "
            f"{last[k]} of {args.iterations}, so that the whole run kept to its time on the "
            "shared machine."
            for k in ("fork", "caffepar") if last[k] < args.iterations) +
        f" Over the second half of the iterations both tested, caffepar minus the fork is "
        f"{np.mean(gap):+.4f} on average "
        f"(from {min(gap):+.4f} to {max(gap):+.4f}); from one test to the next each curve moves "
        f"by {wobble['caffepar']:.4f} (caffepar) and {wobble['fork']:.4f} (fork), one standard "
        "deviation." if gap else "",
        "",
        (f"Both curves rise from 0 but stay low: {args.iterations} iterations at batch "
         f"{args.batch} from fillers (about {args.iterations * args.batch // args.train_images} "
         "passes over the data) is the very start of an SSD training; the published one runs "
         "120000 iterations at batch 24 from a trained model. What the run shows is that the "
         "two programs learn alike on the same data and solver, not a finished detector."
         if max(maps[k][last[k]] for k in maps) < 0.2 else ""),
        "",
        "The two curves are two trainings from different random starts and different random "
        "augmentations (caffepar's fillers and data seeds are not Caffe's), so they agree "
        "within the spread of such runs, not number for number; the layers themselves are "
        "checked against the fork number for number in tests/test_ssd_fork_fixtures.py.",
        "",
        f"## Time per iteration ({args.rounds} alternating rounds of {args.time_iterations} "
        f"iterations, each program alone with {args.threads} threads)",
        "",
        "| round | fork (s) | caffepar (s) | fork / caffepar |",
        "|---|---|---|---|",
    ]
    for r, (f, c) in enumerate(zip(timing["fork"], timing["caffepar"])):
        lines.append(f"| {r} | {f:.3f} | {c:.3f} | {f / c:.2f}x |")
    lines += [
        f"| median | {np.median(timing['fork']):.3f} | {np.median(timing['caffepar']):.3f} | "
        f"{np.median(ratios):.2f}x |",
        "",
        "Each round's value is the median over its display intervals after the first (which "
        "holds start-up), from the logs' timestamps. The machine is shared: its load average "
        f"was {timing['load']:.1f} at the end of the timing; the ratios come from runs "
        "alternated within minutes. caffepar's data layer augments in one background thread; "
        "the fork's also JPEG-encodes each record three times (after distortion, expansion "
        "and the crop). PyTorch: not measured, as no PyTorch MultiBoxLoss with the fork's "
        "matching and mining exists to time beside it.",
        "",
        "During the side-by-side training above (one thread each, both running at once, tests "
        "left out) the median display interval gave "
        f"{np.median(runs['fork']['per_iter']):.3f} s/iteration for the fork and "
        f"{np.median(runs['caffepar']['per_iter']):.3f} for caffepar "
        f"({np.median(runs['fork']['per_iter']) / np.median(runs['caffepar']['per_iter']):.2f}x).",
        "",
        f"## P = 2 against one process ({parallel['iterations']} iterations)",
        "",
        f"`caffepar train --np 2 --parallel data` and `--parallel hybrid` at batch "
        f"{parallel['batch'] // 2} per rank against one process at batch {parallel['batch']}, "
        "from the same start, with the augmentations on (each record's random choices follow "
        "the record), BatchNorm's statistics and MultiBoxLoss's normalizer over the whole "
        f"batch. Weights up to {parallel['max_weight']:.3g} in {parallel['blobs']} blobs; "
        f"losses {min(parallel['losses_one']):.3g} to {max(parallel['losses_one']):.3g}.",
        "",
        "| against one process at batch B | largest weight difference | largest relative (to abs(w) + 1e-3) | largest "
        "per-iteration loss difference |",
        "|---|---|---|---|",
    ]
    label = {"data": "`--np 2 --parallel data`", "hybrid": "`--np 2 --parallel hybrid`",
             "threads": f"one process, 1 thread instead of {args.threads}"}
    for mode, m in parallel["modes"].items():
        lines.append(f"| {label[mode]} | {m['max_abs_weight_diff']:.3g} | "
                     f"{m['max_rel_weight_diff']:.3g} | {m['max_loss_diff']:.3g} |")
    floor = parallel["modes"]["threads"]["max_loss_diff"]
    worst = max(parallel["modes"][m]["max_loss_diff"] for m in ("data", "hybrid"))
    lines += [
        "",
        "The last row is the same process run with another thread count: its sums go in "
        "another order, so it differs from the first by float rounding alone, and this "
        "training from fillers (RMSProp's first steps are 10 x base_lr x sign(diff); "
        "BatchNorm over channels of tiny variance) grows rounding into visible differences "
        f"within iterations. The P = 2 runs differ from one process by {worst:.3g} in the "
        f"loss at most, against {floor:.3g} for the thread count alone: "
        + ("the same order, i.e. equal up to rounding." if worst <= 3 * floor else
           "more than rounding explains.")
        + " tests/test_parallel_ssd.py proves the equality to 1e-4 on a small SSD with the "
        "same augmentations, BatchNorm and MultiBoxLoss over 4 iterations.",
        ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, style in (("caffepar", "-o"), ("fork", "--s")):
        m = runs[k]["maps"]
        axes[0].plot(sorted(m), [m[i] for i in sorted(m)], style, label=k, ms=3)
        loss = runs[k]["losses"]
        axes[1].plot(sorted(loss), [loss[i] for i in sorted(loss)], style[:-1], label=k, lw=1)
    axes[0].set(xlabel="iteration", ylabel=f"mAP (11point), {args.test_images} test images",
                title="MobileNet-SSD on shapes: test mAP")
    axes[1].set(xlabel="iteration", ylabel="training loss (average_loss 10)",
                title="MultiBoxLoss")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mobilenet-ssd", required=True, type=Path,
                    help="a checkout of chuanqi305/MobileNet-SSD")
    ap.add_argument("--caffe", required=True, type=Path,
                    help="the SSD fork's caffe tool (build/tools/caffe)")
    ap.add_argument("--work", type=Path,
                    default=Path(os.environ.get("CAFFEPAR_CACHE_DIR",
                                                Path.home() / ".cache" / "caffepar")) / "ssd")
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--base-lr", type=float, default=0.002)
    ap.add_argument("--iterations", type=int, default=1500)
    ap.add_argument("--test-interval", type=int, default=150)
    ap.add_argument("--snapshot", type=int, default=150)
    ap.add_argument("--display", type=int, default=10)
    ap.add_argument("--train-images", type=int, default=3000)
    ap.add_argument("--test-images", type=int, default=500)
    ap.add_argument("--object-sizes", default="0.08,0.6",
                    type=lambda v: tuple(float(x) for x in v.split(",")),
                    help="min,max side of a shape as a fraction of the image's shorter side")
    ap.add_argument("--max-objects", type=int, default=4)
    ap.add_argument("--eval-images", type=int, default=0,
                    help="test on the first N test images (default: all)")
    ap.add_argument("--lr-mult", type=float, default=1.0,
                    help="lr_mult of the layers the published net keeps from its VOC model "
                         "(0.1 published, for fine-tuning; their biases get twice this)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1701)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-iterations", type=int, default=30)
    ap.add_argument("--parallel-iterations", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "ssd_finetune")
    ap.add_argument("--skip", default="",
                    help="comma-separated steps not to run: fork, caffepar, timing, parallel")
    args = ap.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    work = args.work.resolve()
    data = work / "data"
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
               OMP_NUM_THREADS=str(args.threads))
    templates = {
        "train": (args.mobilenet_ssd / "template" / "MobileNetSSD_train_template.prototxt")
        .read_text(),
        "test": (args.mobilenet_ssd / "template" / "MobileNetSSD_test_template.prototxt")
        .read_text(),
        "solver": (args.mobilenet_ssd / "solver_train.prototxt").read_text()}

    # 1. data
    if not (data / "done").exists():
        from make_shapes_voc import make_dataset
        from caffepar.data.annoset import convert_annoset
        shutil.rmtree(data, ignore_errors=True)
        make_dataset(str(data / "voc"), args.train_images, args.test_images, seed=1,
                     sizes=args.object_sizes, max_objects=args.max_objects)
        for split in ("trainval", "test"):
            convert_annoset(str(data / "voc"), str(data / "voc" / f"{split}.txt"),
                            str(data / f"{split}_lmdb"),
                            label_map_file=str(data / "voc" / "labelmap.prototxt"),
                            encode_type="jpg", name_size_file=str(data / f"{split}_name_size.txt"),
                            shuffle=split == "trainval", seed=1)
        (data / "done").write_text("")

    # 2-3. the two trainings, side by side
    for kind in ("fork", "caffepar"):
        folder = work / kind
        (folder / "snap").mkdir(parents=True, exist_ok=True)
        write_nets(folder, data, args, templates, args.batch)
        (folder / "solver.prototxt").write_text(edit_solver(
            templates["solver"], "train.prototxt", "test.prototxt",
            -(-(args.eval_images or args.test_images) // 8), args, "snap/mobilenet"))
    logs = train_side_by_side(work, args)
    runs = {}
    for kind in ("fork", "caffepar"):
        losses, maps, per_iter = parse_log(logs[kind])
        runs[kind] = {"losses": losses, "maps": maps, "per_iter": per_iter,
                      "legs": len(logs[kind])}
        print(f"{kind}: mAP {maps}", flush=True)

    # 4. time per iteration, 5. P = 2 (a skipped step's earlier result is used if there is one)
    done = {"timing": work / "timing" / "result.json",
            "parallel": work / "parallel" / "result.json"}
    timing = time_rounds(work, data, args, templates) if "timing" not in args.skip \
        else done["timing"].exists() and json.loads(done["timing"].read_text())
    parallel = parallel_check(work, data, args, env, templates) if "parallel" not in args.skip \
        else done["parallel"].exists() and json.loads(done["parallel"].read_text())
    if not (timing and parallel) or args.skip & {"fork", "caffepar"}:
        print("steps skipped: results not written", flush=True)
        return
    args.blas_kernel = blas_kernel(args.caffe)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args, runs, timing, parallel, args.out)
    print(f"wrote {args.out}.{{csv,md,png}}")


if __name__ == "__main__":
    main()
