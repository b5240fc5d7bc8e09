#!/usr/bin/env python
"""Parsing very long prototxts: seconds and peak memory against the text's size, parsed in parts
(caffepar's way) and in one piece (protobuf's text parser on the whole text).

    python scripts/bench_prototxt_parse.py [--sizes 25,50,100,200] [--out results/prototxt_parse]

Each size is a generated net of conv / ReLU / pooling blocks (names, bottoms, fillers as
published nets write them), parsed by `read_net_text` in a fresh process whose peak RSS is read
from the kernel. Writes OUT.csv, OUT.md and OUT.png.
"""
import argparse
import csv
import os
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
t0 = time.perf_counter()
raw = text.read_text(sys.argv[2])
net = text.parse_text(raw, text.caffe_pb2.NetParameter(), sys.argv[2], chunk_chars=chunk)
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(seconds, (peak - base) / 1024, len(net.layer))
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


def measure(path, whole):
    chunk = 1 << 62 if whole else 4 << 20
    env = dict(os.environ, CAFFEPAR_MAX_PROTOTXT_MB="100000")
    out = subprocess.run([sys.executable, "-c", MEASURE, str(ROOT), str(path), str(chunk)],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="25,50,100,200", help="text sizes in MB")
    ap.add_argument("--out", default=str(ROOT / "results" / "prototxt_parse"))
    args = ap.parse_args()
    from cpuinfo import cpu_name
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for mb in [float(s) for s in args.sizes.split(",")]:
            path = Path(folder) / f"long_{mb:g}.prototxt"
            size = generate(path, mb)
            for mode in ("parts", "whole"):
                seconds, peak_mb, layers = measure(path, mode == "whole")
                rows.append({"text_mb": round(size / 1e6, 1), "layers": layers, "mode": mode,
                             "seconds": round(seconds, 2), "mb_per_s": round(size / 1e6 / seconds, 2),
                             "peak_rss_mb": round(peak_mb)})
                print(rows[-1], flush=True)
            path.unlink()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = ["# Parsing long prototxts", "",
             f"CPU: {cpu_name()}. Generated nets of conv / ReLU / pooling blocks; each parse in "
             "a fresh process, peak RSS above the interpreter's own. `parts`: caffepar's "
             "`parse_text` (merged a few MB at a time, progress in the log); `whole`: protobuf's "
             "text parser on the whole text.", "",
             "| text MB | layers | mode | seconds | MB/s | peak RSS MB |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['text_mb']} | {r['layers']} | {r['mode']} | {r['seconds']} | "
              f"{r['mb_per_s']} | {r['peak_rss_mb']} |" for r in rows]
    parts = [r for r in rows if r["mode"] == "parts"]
    whole = [r for r in rows if r["mode"] == "whole"]
    lines += ["", "Peak memory per text MB (parts / whole): " + ", ".join(
        f"{p['text_mb']:g} MB: {p['peak_rss_mb'] / p['text_mb']:.1f} / "
        f"{w['peak_rss_mb'] / w['text_mb']:.1f}" for p, w in zip(parts, whole)),
              "Seconds per text MB (parts): " + ", ".join(
        f"{p['text_mb']:g} MB: {p['seconds'] / p['text_mb']:.3f}" for p in parts), ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("wrote", out.with_suffix(".md"))
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("parts", "o-"), ("whole", "s--")):
        sel = [r for r in rows if r["mode"] == mode]
        axes[0].plot([r["text_mb"] for r in sel], [r["seconds"] for r in sel], marker, label=mode)
        axes[1].plot([r["text_mb"] for r in sel], [r["peak_rss_mb"] for r in sel], marker,
                     label=mode)
    axes[0].set(xlabel="prototxt MB", ylabel="seconds", title="parse time")
    axes[1].set(xlabel="prototxt MB", ylabel="peak RSS MB", title="parse memory")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
