#!/usr/bin/env python
"""The fixed cost per layer of a batch-1 TEST forward: the inference plan against the
layer-by-layer forward (CAFFEPAR_INFERENCE=off), in one process, alternating.

* kinds: a chain of --layers layers of one kind on tiny blobs (1 x 8 x 4 x 4), where the
  kernels cost next to nothing: what is left is Python and dispatch, per layer of the net;
* nets: published deploy nets (RFB-320 and the others found in --nets-dir) at their input
  size and at a tiny one (the same layers on 1/8 of the side, where they build at it);
* steps: on each tiny net, every step of the plan called alone in a loop, its mean cost by
  the type of the layer it runs (the host of an epilogue), to show where a layer's fixed cost
  goes (a convolution's is the prepared call of caffepar.nn.conv).

Times are medians of --repeat alternating rounds, both wall-clock and the CPU time of the
thread running the forward (on a machine shared with other loads the wall-clock time holds the
waits for a core; the CPU time is what the forward itself costs), on --threads threads
(default 1, where the thread's CPU time is all of it: at batch 1 on tiny blobs there is no
work to share). Writes OUT_<cpu>.csv and OUT_<cpu>.md.

    python scripts/bench_plan_overhead.py [--nets-dir DIR] [--only RFB-320 ...] [--threads 1]
                                          [--repeat 15] [--layers 60] [--out results/plan_overhead]
"""
import argparse
import csv
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402
from google.protobuf import text_format  # noqa: E402

from caffepar.graph.net import TEST, Net  # noqa: E402
from caffepar.graph.passes import with_batch  # noqa: E402
from caffepar.proto import caffe_pb2  # noqa: E402
from check_inference_nets import randomize  # noqa: E402
from cpuinfo import cpu_key, cpu_name  # noqa: E402

SHAPE = (1, 8, 4, 4)
DEFAULT_NETS = ("RFB-320", "mobilenet_v2_deploy", "shufflenet_v2_1x_deploy",
                "squeezenet_v1.1_deploy", "MobileNetSSD_deploy", "ResNet-50-deploy",
                "bvlc_googlenet_deploy")


def _layer(name, kind, bottoms, tops, extra=""):
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    return f'layer {{ name: "{name}" type: "{kind}" {b} {t} {extra} }}\n'


def _conv(name, bottom, top, n=8, k=1, group=1, bias="false"):
    return _layer(name, "Convolution", [bottom], [top],
                  f"convolution_param {{ num_output: {n} kernel_size: {k} pad: {k // 2} "
                  f"group: {group} bias_term: {bias} }}")


def _bsr(name, blob, act="ReLU", top=None):
    out = top or blob
    return (_layer(f"{name}/bn", "BatchNorm", [blob], [out]) +
            _layer(f"{name}/sc", "Scale", [out], [out], "scale_param { bias_term: true }") +
            _layer(f"{name}/act", act, [out], [out]))


def chain(kind, count):
    """A net of `count` layers of one kind (and the few that feed them), on tiny blobs."""
    dims = " ".join(f"dim: {d}" for d in SHAPE)
    text = (f'layer {{ name: "data" type: "Input" top: "x0" '
            f'input_param {{ shape {{ {dims} }} }} }}\n')
    groups = {"conv + BatchNorm + Scale + ReLU": 4, "depthwise conv + BN + Scale + ReLU6": 4,
              "BatchNorm + Scale + ReLU (not in place)": 3, "Concat of 2 + Slice": 2}
    per = groups.get(kind, 1)
    for i in range(count // per):
        x, y = f"x{i}", f"x{i + 1}"
        if kind == "conv + BatchNorm + Scale + ReLU":
            text += _conv(f"c{i}", x, y) + _bsr(f"c{i}", y)
        elif kind == "depthwise conv + BN + Scale + ReLU6":
            text += _conv(f"c{i}", x, y, k=3, group=8) + _bsr(f"c{i}", y, "ReLU6")
        elif kind == "conv 1x1 (bias)":
            text += _conv(f"c{i}", x, y, bias="true")
        elif kind == "BatchNorm + Scale + ReLU (not in place)":
            text += _bsr(f"b{i}", x, top=y)
        elif kind == "ReLU":
            text += _layer(f"r{i}", "ReLU", [x], [y])
        elif kind == "ReLU6":
            text += _layer(f"r{i}", "ReLU6", [x], [y])
        elif kind == "Eltwise SUM":
            text += _layer(f"e{i}", "Eltwise", [x, x], [y])
        elif kind == "Pooling MAX 3x3":
            text += _layer(f"p{i}", "Pooling", [x], [y],
                           "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
        elif kind == "Softmax":
            text += _layer(f"s{i}", "Softmax", [x], [y])
        elif kind == "Permute":
            text += _layer(f"p{i}", "Permute", [x], [y],
                           "permute_param { order: 0 order: 1 order: 3 order: 2 }")
        elif kind == "Power":
            text += _layer(f"p{i}", "Power", [x], [y], "power_param { scale: 0.5 shift: 1 }")
        elif kind == "Concat of 2 + Slice":
            text += _layer(f"cat{i}", "Concat", [x, x], [f"c{i}"])
            text += _layer(f"sl{i}", "Slice", [f"c{i}"], [y, f"rest{i}"],
                           "slice_param { axis: 1 }")
            text += _layer(f"si{i}", "Silence", [f"rest{i}"], [])
        elif kind == "Flatten + Reshape + Split (free)":
            text += _layer(f"f{i}", "Flatten", [x], [f"f{i}"])
            text += _layer(f"r{i}", "Reshape", [f"f{i}"], [y],
                           "reshape_param { shape { dim: 1 dim: 8 dim: 4 dim: 4 } }")
        else:
            raise ValueError(kind)
    return text


KINDS = ("conv + BatchNorm + Scale + ReLU", "depthwise conv + BN + Scale + ReLU6",
         "conv 1x1 (bias)", "BatchNorm + Scale + ReLU (not in place)", "ReLU", "ReLU6",
         "Eltwise SUM", "Pooling MAX 3x3", "Softmax", "Permute", "Power",
         "Concat of 2 + Slice", "Flatten + Reshape + Split (free)")


def timed(net, repeat):
    """{"fused_ms", "unfused_ms", "fused_cpu_ms", "unfused_cpu_ms"}: medians of alternating
    forwards (after two of each), wall-clock and CPU time."""
    for _ in range(2):
        net.forward()
        with net.unfused():
            net.forward()
    wall, cpu = {True: [], False: []}, {True: [], False: []}
    clock, cpu_clock = time.perf_counter, time.thread_time
    for _ in range(repeat):
        for fused in (True, False):
            if fused:
                c0, t0 = cpu_clock(), clock()
                net.forward()
            else:
                with net.unfused():
                    c0, t0 = cpu_clock(), clock()
                    net.forward()
            wall[fused].append(clock() - t0)
            cpu[fused].append(cpu_clock() - c0)
    ms = lambda v: float(np.median(v) * 1e3)     # noqa: E731
    return {"fused_ms": ms(wall[True]), "unfused_ms": ms(wall[False]),
            "fused_cpu_ms": ms(cpu[True]), "unfused_cpu_ms": ms(cpu[False])}


def shrunk(param, side):
    """The net at batch 1, its 4-D inputs' height and width divided by `side` (and, when
    shrunk, a pooling with a window of 7 or more made global, as the last pooling of a
    classifier is at its own size)."""
    out = with_batch(param, 1)
    for lp in out.layer:
        p = lp.pooling_param
        if side > 1 and lp.type == "Pooling" and max(p.kernel_size, p.kernel_h) >= 7:
            for field in ("kernel_size", "kernel_h", "kernel_w", "stride", "pad"):
                p.ClearField(field)
            p.global_pooling = True
    shapes = [s for l in out.layer if l.type == "Input" for s in l.input_param.shape]
    shapes += list(out.input_shape)
    for s in shapes:
        if len(s.dim) == 4:
            s.dim[2], s.dim[3] = max(1, s.dim[2] // side), max(1, s.dim[3] // side)
    if len(out.input_dim) == 4:
        out.input_dim[2] = max(1, out.input_dim[2] // side)
        out.input_dim[3] = max(1, out.input_dim[3] // side)
    return out


def step_costs(net, calls=200):
    """{layer type: (steps, mean CPU us per call)} of the net's plan, each step called alone."""
    net.forward()
    plan = net._plan
    by_type = defaultdict(list)
    clock = time.thread_time
    with np.errstate(all="ignore"):
        for call, layers in plan.steps:
            if call is None:
                continue
            call()
            t0 = clock()
            for _ in range(calls):
                call()
            by_type[net.layers[layers[0]].type].append((clock() - t0) / calls * 1e6)
    return {t: (len(v), float(np.mean(v))) for t, v in by_type.items()}


def inputs_text(net):
    return " ".join("x".join(map(str, net.blobs[n].shape)) for n in net.inputs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets-dir", default=None,
                    help="published deploy prototxts (default: $CAFFEPAR_CACHE_DIR/"
                         "published_nets)")
    ap.add_argument("--only", nargs="*", default=None, help="net file stems (default: "
                    + ", ".join(DEFAULT_NETS) + ")")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--tiny", type=int, default=8, help="side divisor of the tiny nets (else "
                    "half or a quarter of it, the first the net builds at)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "plan_overhead"))
    args = ap.parse_args()
    from caffepar.nn import native
    from caffepar.nn.blas import set_blas_threads
    set_blas_threads(args.threads)
    folder = Path(args.nets_dir) if args.nets_dir else native.cache_dir() / "published_nets"
    rows = []
    for kind in KINDS:
        text = chain(kind, args.layers)
        net = randomize(Net(text_format.Parse(text, caffe_pb2.NetParameter()), phase=TEST))
        t = timed(net, args.repeat)
        n = len(net.layers) - 1         # the Input layer runs nothing either way
        rows.append(dict(section="kinds", name=kind, input=inputs_text(net), layers=n,
                         steps=len(net._plan.calls), **t))
        print(f"{kind:45s} CPU {1e3 * t['fused_cpu_ms'] / n:7.2f} us/layer planned, "
              f"{1e3 * t['unfused_cpu_ms'] / n:7.2f} layer by layer", flush=True)
    steps = {}
    for stem in args.only or DEFAULT_NETS:
        path = folder / f"{stem}.prototxt"
        if not path.is_file():
            print(f"{stem}: not in {folder}, skipped", flush=True)
            continue
        param = text_format.Parse(path.read_text(), caffe_pb2.NetParameter())
        for sides in ((1,), (args.tiny, args.tiny // 2, args.tiny // 4)):
            for side in (s for s in sides if s >= 1):
                try:
                    net = randomize(Net(shrunk(param, side), phase=TEST))
                    net.forward()
                    break
                except Exception as e:      # a net whose layers need a larger input
                    print(f"{stem} at 1/{side} side: {e}", flush=True)
            else:
                continue
            t = timed(net, args.repeat)
            n = len(net.layers)
            name = stem if side == 1 else f"{stem} (tiny input)"
            rows.append(dict(section="nets", name=name, input=inputs_text(net), layers=n,
                             steps=len(net._plan.calls), **t))
            print(f"{name:45s} CPU {t['fused_cpu_ms']:8.2f} ms planned, "
                  f"{t['unfused_cpu_ms']:8.2f} layer by layer; wall {t['fused_ms']:8.2f} / "
                  f"{t['unfused_ms']:8.2f}", flush=True)
            if side != 1:
                steps[stem] = step_costs(net)
    for stem, costs in steps.items():
        for kind, (count, us) in sorted(costs.items(), key=lambda kv: -kv[1][1]):
            rows.append(dict(section="steps", name=f"{stem}: {kind}", input="", layers="",
                             steps=count, fused_ms="", unfused_ms="", fused_cpu_ms=us / 1e3,
                             unfused_cpu_ms=""))
    write(rows, args)


def write(rows, args):
    key = cpu_key()
    out = Path(f"{args.out}_{key}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["section", "name", "input", "layers", "steps", "fused_cpu_ms", "unfused_cpu_ms",
              "fused_ms", "unfused_ms"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.4f}" if isinstance(r[k], float) else r[k]) for k in fields})
    from caffepar.nn.blas import blas_threads
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    busy = " (a loaded machine: times are inflated and noisy; the ratios of one run hold " \
        "better)" if load > 1.5 * (os.cpu_count() or 1) else ""
    md = [f"# Fixed cost per layer of a batch-1 TEST forward ({key})", "",
          f"CPU: {cpu_name()}; {blas_threads()} thread(s); load average {load:.1f} at the end "
          f"of the run{busy}. Made by `python scripts/bench_plan_overhead.py --threads "
          f"{args.threads} --repeat {args.repeat} --layers {args.layers}`: medians of "
          "alternating rounds, the inference plan against the layer-by-layer forward "
          "(CAFFEPAR_INFERENCE=off) in one process; CPU: the forward's thread's CPU time, wall: "
          "wall-clock time.", "",
          "## Chains of one kind on 1 x 8 x 4 x 4 blobs (kernels cost next to nothing)", "",
          "| layers | count | plan steps | plan, CPU us per layer | layer by layer, CPU us per "
          "layer | plan, wall us per layer | layer by layer, wall us per layer |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    per = lambda r, k: 1e3 * r[k] / r["layers"]        # noqa: E731
    for r in rows:
        if r["section"] == "kinds":
            md.append(f"| {r['name']} | {r['layers']} | {r['steps']} | "
                      f"{per(r, 'fused_cpu_ms'):.2f} | {per(r, 'unfused_cpu_ms'):.2f} | "
                      f"{per(r, 'fused_ms'):.2f} | {per(r, 'unfused_ms'):.2f} |")
    md += ["", "## Published nets at batch 1 (random weights)", "",
           "| net | input | layers | plan steps | plan CPU ms | layer by layer CPU ms | ratio | "
           "plan, CPU us per layer | plan wall ms | layer by layer wall ms |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["section"] == "nets":
            md.append(f"| {r['name']} | {r['input']} | {r['layers']} | {r['steps']} | "
                      f"{r['fused_cpu_ms']:.2f} | {r['unfused_cpu_ms']:.2f} | "
                      f"{r['unfused_cpu_ms'] / r['fused_cpu_ms']:.2f} | "
                      f"{per(r, 'fused_cpu_ms'):.1f} | {r['fused_ms']:.2f} | "
                      f"{r['unfused_ms']:.2f} |")
    md += ["", "## Where a tiny net's steps go: each step called alone, by the type of the "
           "layer it runs (CPU time)", "", "| net: step type | steps | us per call |",
           "|---|---:|---:|"]
    for r in rows:
        if r["section"] == "steps":
            md.append(f"| {r['name']} | {r['steps']} | {1e3 * r['fused_cpu_ms']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
