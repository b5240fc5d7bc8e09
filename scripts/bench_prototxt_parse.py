#!/usr/bin/env python
"""Very long prototxts: parsing, and building the net, in seconds and peak memory.

    python scripts/bench_prototxt_parse.py [--sizes 25,50,100,200] [--whole-max 50]
                                           [--layers 100000,1000000,3080000]
                                           [--commands net,info,time] [--against DIR]
                                           [--out results/prototxt_parse]

Parse: each size is a generated net of conv / ReLU / pooling blocks (names, bottoms, fillers as
published nets write them), parsed by `read_net_text` in a fresh process whose peak RSS is read
from the kernel: `parts` is caffepar's reading (text straight to protobuf's wire format, a few MB
at a time), `whole` protobuf's own text parser on the whole text (up to --whole-max MB: it is
slow).

Build: each count is a chain of that many in-place ReLU layers, one a line (3.08 million of
them make a 200 MB text), built by `Net(path)` (what every command does first: parse, upgrade,
filter, splits, build), and run by `caffepar convert info` (that, then the per-layer report,
written to /dev/null) and `caffepar time --iterations 1` (that, then two passes forward and
backward, and the report), each in a fresh process: wall and CPU seconds, and the peak RSS
above that of a process that only imported caffepar, per layer, beside `Net.BYTES_PER_LAYER`,
the figure a net's memory check assumes.

With --against DIR (a source tree of another caffepar, e.g. `git archive COMMIT | tar -x -C
DIR`) the build rows run with it too, one after the other, for ratios measured side by side.
Generated texts live in a temporary folder and are removed. Writes OUT.csv, OUT.md and OUT.png.
CPU seconds are the process's own and its parse workers' (user + system), which a busy machine
inflates less than wall seconds; the machine's load average is recorded with each row. A parse
worker's peak RSS is reported on its own.
"""
import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

BLOCK = """layer {{
  name: "conv{i}"
  type: "Convolution"
  bottom: "{bottom}"
  top: "conv{i}"
  param {{ lr_mult: 1 decay_mult: 1 }}
  param {{ lr_mult: 2 decay_mult: 0 }}
  convolution_param {{
    num_output: 16
    pad: 1
    kernel_size: 3
    weight_filler {{ type: "xavier" }}
    bias_filler {{ type: "constant" value: 0 }}
  }}
}}
layer {{ name: "relu{i}" type: "ReLU" bottom: "conv{i}" top: "conv{i}" }}
layer {{
  name: "pool{i}"
  type: "Pooling"
  bottom: "conv{i}"
  top: "pool{i}"
  pooling_param {{ pool: MAX kernel_size: 3 stride: 1 pad: 1 }}
}}
"""

MEASURE = r"""
import resource, sys, time
sys.path.insert(0, sys.argv[1])
from caffepar.proto import text
chunk = int(sys.argv[3])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0, c0 = time.perf_counter(), time.process_time()
raw = text.read_text(sys.argv[2])
if sys.argv[4] == "whole":
    net = text.caffe_pb2.NetParameter()
    text.text_format.Merge(raw, net)
else:
    net = text.parse_text(raw, text.caffe_pb2.NetParameter(), sys.argv[2], chunk_chars=chunk)
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
workers = resource.getrusage(resource.RUSAGE_CHILDREN)
print(seconds, cpu + workers.ru_utime + workers.ru_stime, (peak - base) / 1024, len(net.layer),
      workers.ru_maxrss / 1024)
"""

# A process that imports what the command imports: the baseline its peak is measured above.
BASELINE = "import resource, caffepar.cli, caffepar.graph.net, caffepar.nn, caffepar.timing; " \
           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
RUN = r"""
import resource, sys, time
from caffepar.cli import main
t0, c0 = time.perf_counter(), time.process_time()
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
else:
    code = 0
r = resource.getrusage(resource.RUSAGE_SELF)
w = resource.getrusage(resource.RUSAGE_CHILDREN)
print("measured", code, time.perf_counter() - t0, r.ru_utime + r.ru_stime + w.ru_utime
      + w.ru_stime, r.ru_maxrss, w.ru_maxrss, file=sys.stderr)
"""
COMMANDS = {"info": ["convert", "info"], "time": ["time", "--iterations", "1", "--model"]}
# `net`: Net(path), which every command runs first (parse, upgrade, filter, splits, build).
NET = r"""
import resource, sys, time
from caffepar.graph.net import Net
t0, c0 = time.perf_counter(), time.process_time()
net = Net(sys.argv[1])
r = resource.getrusage(resource.RUSAGE_SELF)
w = resource.getrusage(resource.RUSAGE_CHILDREN)
print("measured", 0, time.perf_counter() - t0, time.process_time() - c0 + w.ru_utime
      + w.ru_stime, r.ru_maxrss, w.ru_maxrss, file=sys.stderr)
"""


def generate(path, megabytes):
    with open(path, "w") as f:
        f.write('name: "long"\nlayer { name: "data" type: "Input" top: "pool0" '
                'input_param { shape { dim: 1 dim: 16 dim: 8 dim: 8 } } }\n')
        i = 0
        while f.tell() < megabytes * 1e6:
            i += 1
            f.write(BLOCK.format(i=i, bottom=f"pool{i - 1}"))
    return os.path.getsize(path)


def relu_chain(path, layers):
    """An Input and `layers` in-place ReLU layers, one a line (65 bytes at 3 million)."""
    with open(path, "w") as f:
        f.write('layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 '
                'dim: 4 } } }\n')
        step = 100000
        for start in range(0, layers, step):
            f.write("".join(f'layer {{ name: "relu{i}" type: "ReLU" bottom: "x" top: "x" }}\n'
                            for i in range(start, min(layers, start + step))))
    return os.path.getsize(path)


def _env(tree=ROOT):
    """The environment of a measured process: caffepar imported from `tree`."""
    return dict(os.environ, CAFFEPAR_MAX_PROTOTXT_MB="100000",
                PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def measure_parse(path, whole):
    out = subprocess.run([sys.executable, "-c", MEASURE, str(ROOT), str(path), str(4 << 20),
                          "whole" if whole else "parts"], env=_env(), cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1]), float(out[2]), int(out[3]), float(out[4])


def measure_command(command, path, tree=ROOT):
    """(ok, wall s, CPU s (with its parse workers'), peak RSS above the baseline in bytes, the
    largest parse worker's peak RSS in bytes, last progress line or error), caffepar imported
    from `tree`."""
    # Run in `tree`: `python -c` puts the working folder first on the import path.
    base = int(subprocess.run([sys.executable, "-c", BASELINE], env=_env(tree), cwd=tree,
                              capture_output=True, text=True, check=True).stdout)
    with open(os.devnull, "w") as sink:
        args = [NET] if command == "net" else [RUN, *COMMANDS[command]]
        done = subprocess.run([sys.executable, "-c", *args, str(path)], env=_env(tree),
                              cwd=tree, stdout=sink, stderr=subprocess.PIPE, text=True)
    found = re.search(r"measured (\S+) (\S+) (\S+) (\d+) (\d+)", done.stderr)
    if not found:
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return False, 0.0, 0.0, 0, 0, tail[0][:200]
    code, wall, cpu, peak, workers = found.groups()
    lines = done.stderr.splitlines()
    progress = [ln for ln in lines if ln.startswith(("Parsing", "Building"))]
    errors = [ln for ln in lines if ln.startswith("caffepar:")]
    last = (errors or progress or [""])[-1].replace(str(path), path.name)
    return (code in ("0", "None"), float(wall), float(cpu), (int(peak) - base) * 1024,
            int(workers) * 1024, last)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="25,50,100,200", help="parse: text sizes in MB ('' none)")
    ap.add_argument("--whole-max", type=float, default=50,
                    help="parse with protobuf's text parser up to this size (MB)")
    ap.add_argument("--layers", default="100000,1000000,3080000",
                    help="build: ReLU chains of these many layers ('' none)")
    ap.add_argument("--commands", default="net,info,time",
                    help="build: net (Net(path) alone), info, time")
    ap.add_argument("--against", metavar="DIR",
                    help="build rows also with the caffepar of this source tree (an earlier "
                         "commit's: git archive COMMIT | tar -x -C DIR), side by side")
    ap.add_argument("--against-max", type=float, default=1e6,
                    help="run --against's rows up to this many layers")
    ap.add_argument("--out", default=str(ROOT / "results" / "prototxt_parse"))
    ap.add_argument("--against-label", default="earlier",
                    help="what the rows of --against are called in the results")
    args = ap.parse_args()
    from cpuinfo import cpu_name
    from caffepar.graph.net import Net
    parse_rows, build_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        for mb in [float(s) for s in args.sizes.split(",") if s]:
            path = Path(folder) / f"long_{mb:g}.prototxt"
            size = generate(path, mb)
            for mode in ("parts", "whole"):
                if mode == "whole" and mb > args.whole_max:
                    continue
                load = os.getloadavg()[0]
                seconds, cpu, peak_mb, layers, worker_mb = measure_parse(path, mode == "whole")
                parse_rows.append({"text_mb": round(size / 1e6, 1), "layers": layers,
                                   "mode": mode, "seconds": round(seconds, 2),
                                   "cpu_seconds": round(cpu, 2),
                                   "mb_per_cpu_s": round(size / 1e6 / cpu, 2),
                                   "peak_rss_mb": round(peak_mb),
                                   "child_peak_rss_mb": round(worker_mb),
                                   "load": round(load, 1)})
                print(parse_rows[-1], flush=True)
            path.unlink()
        for layers in [int(float(s)) for s in args.layers.split(",") if s]:
            path = Path(folder) / f"relu_chain_{layers}.prototxt"
            size = relu_chain(path, layers)
            trees = [("this", ROOT)] + ([(args.against_label, Path(args.against))]
                                        if args.against and layers <= args.against_max else [])
            for command in args.commands.split(","):
                for code, tree in trees:
                    load = os.getloadavg()[0]
                    ok, wall, cpu, peak, workers, last = measure_command(command, path, tree)
                    build_rows.append({"layers": layers, "text_mb": round(size / 1e6, 1),
                                       "code": code, "command": command, "ok": ok,
                                       "seconds": round(wall, 1),
                                       "cpu_seconds": round(cpu, 1),
                                       "peak_rss_gib": round(peak / 2 ** 30, 2),
                                       "bytes_per_layer": round(peak / layers),
                                       "child_peak_rss_gib": round(workers / 2 ** 30, 2),
                                       "load": round(load, 1), "last_progress": last})
                    print(build_rows[-1], flush=True)
            path.unlink()
    write(Path(args.out), parse_rows, build_rows, cpu_name(), Net.BYTES_PER_LAYER)


def write(out, parse_rows, build_rows, cpu, bytes_per_layer):
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"part": "parse", **r} for r in parse_rows] + [{"part": "build", **r}
                                                            for r in build_rows]
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    lines = ["# Long prototxts: parsing and building", "",
             f"CPU: {cpu}. Made by `scripts/bench_prototxt_parse.py` (its docstring says what "
             "each row runs); each in a fresh process. CPU seconds are the process's own and "
             "its parse workers' (a text of 32 MB or more is turned into wire format by one "
             "worker process a core, up to 4: wall seconds fall below CPU seconds); child peak "
             "RSS is the largest child process's (a parse worker, which shares the text with "
             "the main process, or a tool the command ran: `time` runs `uname` and `gcc "
             "--version` as its kernels load, whose peak before their program starts is the "
             "parent's pages, shared, not memory of their own); "
             "`load` is the machine's 1-minute load average when the row started (other jobs "
             "shared its cores: wall seconds grow with it).", ""]
    if parse_rows:
        lines += ["## Parsing", "",
                  "Nets of conv / ReLU / pooling blocks. `parts`: caffepar's `parse_text` (text "
                  "to protobuf's wire format, a few MB at a time); `whole`: protobuf's text "
                  "parser on the whole text. Peak RSS above the interpreter's own.", "",
                  "| text MB | layers | mode | seconds | CPU s | MB per CPU s | peak RSS MB | "
                  "child peak RSS MB | load |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['text_mb']} | {r['layers']:,} | {r['mode']} | {r['seconds']} | "
                  f"{r['cpu_seconds']} | {r['mb_per_cpu_s']} | {r['peak_rss_mb']} | "
                  f"{r['child_peak_rss_mb']} | {r['load']} |" for r in parse_rows]
        pairs = [(p, w) for p in parse_rows for w in parse_rows
                 if p["mode"] == "parts" and w["mode"] == "whole" and p["text_mb"] == w["text_mb"]]
        if pairs:
            lines += ["", "protobuf's parser / caffepar's, CPU seconds: " + ", ".join(
                f"{p['text_mb']:g} MB: {w['cpu_seconds'] / p['cpu_seconds']:.1f}x"
                for p, w in pairs)]
        lines.append("")
    if build_rows:
        lines += ["## Building a net of millions of layers", "",
                  "Chains of in-place ReLU layers, one a line. `net`: `Net(path)` alone (parse "
                  "and build, what every command does first); `info`: `caffepar convert info` "
                  "(its report to /dev/null); `time`: `caffepar time --iterations 1`. Peak RSS "
                  "above a process that only imported caffepar; bytes per layer beside the "
                  f"{bytes_per_layer} a net's memory check assumes (`Net.BYTES_PER_LAYER`).", "",
                  "| layers | text MB | code | command | ok | seconds | CPU s | peak RSS GiB | "
                  "bytes per layer | child peak RSS GiB | load | last progress line (or the "
                  "error) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['layers']:,} | {r['text_mb']} | {r['code']} | {r['command']} | {r['ok']} | "
                  f"{r['seconds']} | {r['cpu_seconds']} | {r['peak_rss_gib']} | "
                  f"{r['bytes_per_layer']} | {r['child_peak_rss_gib']} | {r['load']} | "
                  f"{r['last_progress']} |" for r in build_rows]
        pairs = [(a, b) for a in build_rows for b in build_rows if a["code"] == "this"
                 and b["code"] != "this" and (a["layers"], a["command"]) == (b["layers"],
                                                                             b["command"])
                 and a["ok"] and b["ok"]]
        if pairs:
            lines += ["", "Side by side (the other code / this code): " + "; ".join(
                f"{a['layers']:,} layers, {a['command']}: CPU {b['cpu_seconds'] / a['cpu_seconds']:.1f}x, "
                f"peak memory {b['bytes_per_layer'] / a['bytes_per_layer']:.1f}x"
                for a, b in pairs)]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("wrote", out.with_suffix(".md"))
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("parts", "o-"), ("whole", "s--")):
        sel = [r for r in parse_rows if r["mode"] == mode]
        if sel:
            axes[0].plot([r["text_mb"] for r in sel], [r["cpu_seconds"] for r in sel], marker,
                         label=f"parse, {mode}")
    for command, marker in (("net", "^-"), ("info", "o-"), ("time", "s-")):
        sel = [r for r in build_rows if r["command"] == command and r["ok"]
               and r["code"] == "this"]
        if sel:
            axes[0].plot([r["text_mb"] for r in sel], [r["cpu_seconds"] for r in sel], marker,
                         label=f"ReLU chain, {command}")
            axes[1].plot([r["layers"] / 1e6 for r in sel], [r["bytes_per_layer"] for r in sel],
                         marker, label=f"ReLU chain, {command}")
    axes[1].axhline(bytes_per_layer, color="grey", ls=":", label="Net.BYTES_PER_LAYER")
    axes[0].set(xlabel="prototxt MB", ylabel="CPU seconds", title="time")
    axes[1].set(xlabel="million layers", ylabel="peak RSS bytes per layer", title="memory")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
