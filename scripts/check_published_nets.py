#!/usr/bin/env python
"""Every caffepar command on a folder of published Caffe prototxts: each runs, or refuses in one
line naming what it does not support; a Python traceback or a hang is a caffepar bug.

    python scripts/check_published_nets.py DIR [--out results/published_nets] [--timeout 300]
                                           [--resume [--recheck GLOB ...]]
                                           [--conv-engines measure]

For each net prototxt under DIR (any depth): `convert info`, `plan --np 4`, `convert upgrade
--check`, `time --iterations 1` (TEST phase for nets with data layers, whose datasets are
not there: a one-line refusal naming the missing source is the expected answer), random
weights saved through the pycaffe API, and `convert onnx --verify` with them. For each solver
prototxt: `convert upgrade --check`. Every command runs in its own process with a timeout,
with the convolution engines a user's first run gets (measured on the machine: every engine a
layer shape lists is timed), unless --conv-engines says otherwise.
Writes OUT.csv and OUT.md; the exit status is 1 when a command gave a traceback or timed out.

results/published_nets.* were made on the folder FOLDER_LAYOUT describes (the published files,
never part of this repository).
"""
import argparse
import csv
import fnmatch
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER_LAYOUT = """The folder: `bvlc/` = every `*.prototxt` under `models/` and `examples/` of
BVLC/caffe (master); `resnet/` = ResNet-50/101/152-deploy.prototxt of
KaimingHe/deep-residual-networks; `squeezenet/v1.0`, `v1.1` = forresti/SqueezeNet's
(deploy, train_val, solver); `mobilenet/` = shicai/MobileNet-Caffe's mobilenet_deploy and
mobilenet_v2_deploy; `densenet/` = shicai/DenseNet-Caffe's DenseNet_121/161/169/201, and copies
`*_no_ceil_mode` with their `ceil_mode: false` lines deleted (a field of a Caffe fork, not of
BVLC Caffe); `fcn/` = shelhamer/fcn.berkeleyvision.org's voc-fcn8s, voc-fcn16s, voc-fcn32s,
voc-fcn-alexnet, voc-fcn8s-atonce and siftflow-fcn8s folders (their prototxts); `v0/` = the two
V0-format nets written out in BVLC Caffe's src/caffe/test/test_upgrade_proto.cpp
(all-parameters and ImageNet-with-padding); `v1/` = V1-format nets (a small one and a
train/test one)."""
COMMANDS = ["info", "plan", "upgrade", "time", "weights", "onnx"]
SAVE_WEIGHTS = """
import sys
import caffepar as caffe
from caffepar.errors import CaffeparError
try:
    net = caffe.Net(sys.argv[1], caffe.TEST)
except CaffeparError as e:
    sys.exit(f"caffepar: {e}")
for name, layer in zip(net._layer_names, net.layers):
    if layer.type == "BatchNorm":       # stored statistics of a trained net: mean 0, var 1
        blobs = net.params[name]
        blobs[0].data[...], blobs[1].data[...], blobs[2].data[...] = 0, 1, 1
net.save(sys.argv[2])
print(f"saved {len(net.params)} layers' weights")
"""


def is_solver(path):
    """Whether the file parses as a SolverParameter (a solver with its net inline too)."""
    from google.protobuf import text_format
    from caffepar.proto import caffe_pb2
    try:
        text_format.Parse(path.read_text(errors="replace"), caffe_pb2.SolverParameter())
    except text_format.ParseError:
        return False
    return True


CONV_ENGINES = "measure"      # CAFFEPAR_CONV_ENGINES of every command (--conv-engines)


def run(argv, timeout, cwd):
    """(status, the one line that says why, seconds): ran / refused / TRACEBACK / TIMEOUT."""
    t0 = time.monotonic()
    env = dict(os.environ, CAFFEPAR_CONV_ENGINES=CONV_ENGINES, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=env)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", f"no answer within {timeout} s", time.monotonic() - t0
    seconds = time.monotonic() - t0
    err = done.stderr
    if "Traceback (most recent call last)" in err:
        last = [line for line in err.splitlines() if line.strip()][-1]
        return "TRACEBACK", last.strip(), seconds
    if done.returncode == 0:
        return "ran", "", seconds
    lines = [line for line in (err + done.stdout).splitlines()
             if line.startswith(("caffepar:", "Error:")) or ": error: " in line]
    if len(lines) != 1:
        return "UNCLEAR", f"exit {done.returncode}, {len(lines)} error lines: " + \
            " | ".join(lines[:3] or err.splitlines()[-2:]), seconds
    return "refused", lines[0], seconds


def check_net(path, folder, timeout):
    """{command: (status, reason, seconds)} for one net prototxt."""
    cli = [sys.executable, "-m", "caffepar.cli"]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        net = str(path)
        out["info"] = run(cli + ["convert", "info", net], timeout, folder)
        out["plan"] = run(cli + ["plan", "--model", net, "--np", "4"], timeout, folder)
        out["upgrade"] = run(cli + ["convert", "upgrade", net, str(tmp / "up.prototxt"),
                                    "--check"], timeout, folder)
        out["time"] = run(cli + ["time", "--model", net, "--iterations", "1", "--phase", "TEST"],
                          timeout, folder)
        weights = tmp / "w.caffemodel"
        out["weights"] = run([sys.executable, "-c", SAVE_WEIGHTS, net, str(weights)], timeout,
                             folder)
        if weights.exists():
            out["onnx"] = run(cli + ["convert", "onnx", net, str(weights), str(tmp / "m.onnx"),
                                     "--verify"], timeout, folder)
        else:
            out["onnx"] = ("skipped", "no weights (the net does not build)", 0.0)
    return out


FIELDS = ["prototxt", "kind"] + [f for c in COMMANDS for f in (c, f"{c}_reason")] + ["engines"]
EARLIER_ENGINES = "rules"   # rows of runs made before the engines were recorded used the rules


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a folder of published prototxts (any depth)")
    ap.add_argument("--out", default=str(ROOT / "results" / "published_nets"))
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows OUT.csv already has (a run cut short goes on; rows of "
                         "prototxts outside DIR stay, so DIR may be one sub-folder rechecked)")
    ap.add_argument("--recheck", action="append", default=[], metavar="GLOB",
                    help="with --resume: check again the prototxts matching GLOB")
    ap.add_argument("--conv-engines", default="measure",
                    help="CAFFEPAR_CONV_ENGINES of the commands: measure (a first run's "
                         "default), rules, or an engine's name")
    args = ap.parse_args()
    global CONV_ENGINES
    CONV_ENGINES = args.conv_engines
    folder = Path(args.folder).resolve()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.resume and out.with_suffix(".csv").exists():
        with open(out.with_suffix(".csv"), newline="") as f:
            done = {r["prototxt"]: r for r in csv.DictReader(f)
                    if not any(fnmatch.fnmatch(r["prototxt"], g) for g in args.recheck)}
    rows = []
    for path in sorted(folder.rglob("*.prototxt")):
        name = str(path.relative_to(folder))
        if name in done:
            rows.append({k: v for k, v in done[name].items() if v != ""})
            continue
        if is_solver(path):
            status = run([sys.executable, "-m", "caffepar.cli", "convert", "upgrade", str(path),
                          os.devnull, "--check"], args.timeout, path.parent)
            rows.append({"prototxt": name, "kind": "solver", "upgrade": status[0],
                         "upgrade_reason": status[1], "engines": CONV_ENGINES})
        else:
            result = check_net(path, path.parent, args.timeout)
            row = {"prototxt": name, "kind": "net", "engines": CONV_ENGINES}
            for cmd in COMMANDS:
                row[cmd], row[f"{cmd}_reason"] = result[cmd][0], result[cmd][1]
            rows.append(row)
        print(name, {k: v for k, v in rows[-1].items() if k in COMMANDS}, flush=True)
        _write_csv(out, rows + [r for n, r in done.items() if n not in {x["prototxt"] for x in rows}])
    seen = {r["prototxt"] for r in rows}
    kept = [{k: v for k, v in r.items() if v != ""} for n, r in done.items() if n not in seen]
    rows = sorted(rows + kept, key=lambda r: Path(r["prototxt"]).parts)
    engines = {}
    for r in rows:
        if r["kind"] == "net":
            r.setdefault("engines", EARLIER_ENGINES)
            engines.setdefault(r["engines"], []).append(r["prototxt"])
    _write_csv(out, rows)
    bad = [(r["prototxt"], c, r[c], r[f"{c}_reason"]) for r in rows for c in COMMANDS
           if r.get(c) in ("TRACEBACK", "TIMEOUT", "UNCLEAR")]
    counts = {}
    for r in rows:
        for c in COMMANDS:
            if c in r:
                counts[r[c]] = counts.get(r[c], 0) + 1
    lines = ["# caffepar on published Caffe nets", "",
             f"`python scripts/check_published_nets.py DIR` over {len(rows)} prototxts "
             f"({sum(r['kind'] == 'net' for r in rows)} nets, "
             f"{sum(r['kind'] == 'solver' for r in rows)} solvers). Command results: " +
             ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) +
             f"; tracebacks, hangs or unclear reports: {len(bad)}.", "",
             "`refused` is a one-line error naming the unsupported or missing thing (for "
             "train/val nets, mostly their datasets, which are not part of the published "
             "files). Columns: convert info, plan --np 4, convert upgrade --check, time "
             "(TEST phase, one iteration), random weights saved through the pycaffe API, "
             "convert onnx --verify.", "",
             "Convolution engines (CAFFEPAR_CONV_ENGINES of the commands; `measure` times "
             "every engine able to run a layer shape, as a first run does): " +
             "; ".join(f"`{e}` for {len(n)} nets" + (
                 " (" + ", ".join(sorted({x.split("/")[0] for x in n})) + ")"
                 if len(engines) > 1 else "") for e, n in sorted(engines.items())) + ".", "",
             " ".join(FOLDER_LAYOUT.split()), ""]
    lines += ["| prototxt | " + " | ".join(COMMANDS) + " |",
              "|---|" + "---|" * len(COMMANDS)]
    for r in rows:
        lines.append(f"| {r['prototxt']} | " + " | ".join(
            _cell(r, c) for c in COMMANDS) + " |")
    reasons = {}
    for r in rows:
        for c in COMMANDS:
            if r.get(c) == "refused":
                reasons.setdefault(_short(r[f"{c}_reason"]), []).append(f"{r['prototxt']} ({c})")
    lines += ["", "## Refusals", ""]
    for reason, where in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"- {reason} — {len(where)}: {', '.join(where[:4])}"
                     f"{', …' if len(where) > 4 else ''}")
    if bad:
        lines += ["", "## Problems", ""] + [f"- {p} `{c}`: {s}: {why}" for p, c, s, why in bad]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}: {len(bad)} problem(s)")
    return 1 if bad else 0


def _write_csv(out, rows):
    """OUT.csv with `rows`, replaced in one step (a run cut short leaves the last whole file)."""
    from tables import write_csv
    write_csv(out.with_suffix(".csv"), rows, FIELDS)


def _cell(row, command):
    if command not in row:
        return "" if row["kind"] == "net" else "–"
    return row[command]


def _short(reason):
    """A refusal without its file and line, so alike ones group."""
    text = reason.split(": error: ", 1)[-1]
    for token in text.split('"')[1::2]:
        if "/" in token or token.endswith((".txt", ".lmdb", ".h5", ".leveldb")):
            text = text.replace(f'"{token}"', '"…"')
    return text[:160]


if __name__ == "__main__":
    sys.exit(main())
