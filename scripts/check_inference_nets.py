#!/usr/bin/env python
"""Every blob of the inference plan's forward against the layer-by-layer forward
(CAFFEPAR_INFERENCE=off) on published deploy nets at their own input size, random weights (the
suite checks them at a small input; this is the full-size check it leaves out).

For each net: what the pass folded (epilogues, layers run inside them, free and shared layers,
Concat parts written in place), every blob compared (rtol 1e-4, and an absolute 1e-5 of the
blob's largest value), the largest difference relative to that value, and both forwards' time
(one run each: a correctness check, not a benchmark). DetectionOutput tops are compared as
detections: the same (image, label, score)s, boxes the same but where NMS chose between
candidates of equal scores. Writes OUT.csv and OUT.md; exits 1 when a blob differs.

    python scripts/check_inference_nets.py [--nets-dir DIR] [--only STEM ...]
                                           [--out results/inference_check]
"""
import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from caffepar.graph.net import TEST, Net  # noqa: E402
from caffepar.proto import caffe_pb2  # noqa: E402
from cpuinfo import cpu_name  # noqa: E402


def randomize(net, seed=0):
    """Weights scaled by their fan-in, so that values stay near 1 through the net (as a
    trained net's do); BatchNorm statistics with positive variances."""
    rng = np.random.default_rng(seed)
    for layer in net.layers:
        for k, b in enumerate(layer.blobs):
            fan_in = int(np.prod(b.shape[1:])) if k == 0 and b.data.ndim > 1 else 1
            b.data[...] = rng.standard_normal(b.shape) * (1.5 / np.sqrt(fan_in)
                                                          if fan_in > 1 else 0.5)
        if layer.type == "BatchNorm":
            layer.blobs[1].data[...] = rng.uniform(0.2, 2.0, layer.blobs[1].shape)
            layer.blobs[2].data[...] = rng.uniform(0.5, 2.0)
        if layer.type == "BN" and len(layer.blobs) == 4:
            layer.blobs[3].data[...] = rng.uniform(0.2, 2.0, layer.blobs[3].shape)
    for name in net.inputs:
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)
    return net


def same_detections(got, want):
    g, w = got.reshape(-1, 7), want.reshape(-1, 7)
    if g.shape != w.shape:
        return False
    order = lambda a: a[np.lexsort((-a[:, 2], a[:, 1], a[:, 0]))]     # noqa: E731
    if not np.allclose(order(g)[:, :3], order(w)[:, :3], rtol=1e-4, atol=1e-5):
        return False
    matched = [np.any(np.all(np.abs(w - r) <= 1e-4 + 1e-4 * np.abs(w), axis=1)) for r in g]
    return not len(g) or np.mean(matched) >= 0.9


def check(path):
    param = text_format.Parse(path.read_text(), caffe_pb2.NetParameter())
    net, ref = randomize(Net(param, phase=TEST)), randomize(Net(param, phase=TEST))
    t0 = time.perf_counter()
    with ref.unfused():
        ref.forward()
    t1 = time.perf_counter()
    net.forward()
    t2 = time.perf_counter()
    graph = net.inference_graph()
    kinds = [n.kind for n in graph.nodes]
    inside = sum(len(n.layers) - 1 for n in graph.nodes if n.kind == "epilogue")
    detections = {ref.top_names[n][0] for n, l in zip(ref._layer_names, ref.layers)
                  if l.type == "DetectionOutput"}
    worst, bad = 0.0, []
    for name, blob in ref.blobs.items():
        want, got = blob.data, net.blobs[name].data
        if name in detections:
            if not same_detections(got, want):
                bad.append(name)
            continue
        if got.shape != want.shape:
            bad.append(name)
            continue
        scale = float(np.abs(want).max()) if want.size else 0.0
        if want.size and scale:
            worst = max(worst, float(np.abs(got - want).max()) / scale)
        if not np.allclose(got, want, rtol=1e-4, atol=1e-5 * scale):
            bad.append(name)
    return dict(net=path.stem, input=" ".join("x".join(map(str, net.blobs[n].shape))
                                              for n in net.inputs),
                layers=len(net.layers), blobs=len(ref.blobs), epilogues=kinds.count("epilogue"),
                inside=inside, free=kinds.count("free") + kinds.count("share"),
                concat_parts=sum(len(n.into) for n in graph.nodes if n.kind == "concat"),
                worst=worst, differ=" ".join(bad), unfused_ms=(t1 - t0) * 1e3,
                fused_ms=(t2 - t1) * 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets-dir", default=None,
                    help="published deploy prototxts (default: $CAFFEPAR_CACHE_DIR/"
                         "published_nets)")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--out", default=str(ROOT / "results" / "inference_check"))
    args = ap.parse_args()
    from caffepar.nn import native
    folder = Path(args.nets_dir) if args.nets_dir else native.cache_dir() / "published_nets"
    paths = sorted(folder.glob("*.prototxt"))
    if args.only:
        paths = [p for p in paths if p.stem in args.only]
    if not paths:
        sys.exit(f"no published nets in {folder}")
    rows = []
    for path in paths:
        rows.append(check(path))
        r = rows[-1]
        print(f"{r['net']:42s} {r['blobs']:4d} blobs, worst {r['worst']:.1e} "
              f"{'DIFFER: ' + r['differ'] if r['differ'] else 'all equal'}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0])
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: f"{v:.3g}" if isinstance(v, float) else v for k, v in r.items()})
    md = ["# Every blob of the inference plan against the layer-by-layer forward", "",
          f"CPU: {cpu_name()}. Made by `python scripts/check_inference_nets.py`: published "
          "deploy nets at their own input size, random weights scaled by fan-in, every blob "
          "compared (rtol 1e-4, absolute 1e-5 of the blob's largest value; DetectionOutput "
          "as detections). Worst: the largest difference over a blob's largest value. The "
          "counts are the pass's decisions; a Concat part whose place in the top is not "
          "contiguous (along channels at a batch above 1) is copied by the plan instead.", "",
          "| net | input | layers | blobs | epilogues | layers run inside them | free or "
          "shared | Concat parts written in place | worst | blobs that differ |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['net']} | {r['input']} | {r['layers']} | {r['blobs']} | "
                  f"{r['epilogues']} | {r['inside']} | {r['free']} | {r['concat_parts']} | "
                  f"{r['worst']:.1e} | {r['differ'] or 'none'} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.md')}")
    sys.exit(1 if any(r["differ"] for r in rows) else 0)


if __name__ == "__main__":
    main()
