#!/usr/bin/env python
"""Every distinct convolution shape of published deploy nets, caffepar against onnxruntime,
side by side: results/conv_shapes_<cpu>.{csv,md,png}.

The nets' deploy prototxts are read from a folder (--nets-dir; their files are never part of
the repository), each built with caffepar at its own input size and batch 1 to find its
convolutions' shapes (Convolution, ConvolutionDepthwise, DepthwiseConvolution). A shape is
its input (C, H, W), outputs, kernel, stride, pad, dilation, group and the activation that
follows it in place (ReLU, ReLU6 as a clip, or none): each is timed once per batch (1 and 32)
however many layers share it, with random weights.

- caffepar: ``prepare_conv_forward`` with an epilogue (per-channel scale and shift, the
  activation): the call an inference plan makes, the engine measured as it will be in use;
- onnxruntime: a one-node ONNX graph (Conv with bias, then Relu or Clip, which it fuses),
  2 threads, all graph optimisations, input and output bound once (run_with_iobinding).
  Its fixed cost per run (a graph holding a 1x1 Relu, timed alongside) is given apart, and
  the ratio is taken on its time less that cost: inside a net it is paid once, not per layer.

Each figure is the fastest median of alternating rounds (caffepar, onnxruntime, the empty
graph, in turn). A run is resumable: rows already in the CSV are kept (--fresh to redo them).

    python scripts/bench_conv_shapes.py --nets-dir DIR [--batch 1 32] [--rounds 3]
"""
import argparse
import csv
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402

from cpuinfo import cpu_key, cpu_name  # noqa: E402
from figures import pyplot  # noqa: E402
from tables import write_tables  # noqa: E402

CONV_TYPES = ("Convolution", "ConvolutionDepthwise", "DepthwiseConvolution")
ACTIVATIONS = {"ReLU": "relu", "ReLU6": "clip"}
FIELDS = ["shape", "batch", "nets", "layers", "c", "h", "w", "o", "k", "s", "p", "d", "group",
          "act", "mmacs", "engine", "caffepar_us", "ort_us", "ort_fixed_us", "ratio"]


def net_shapes(path):
    """[(key, layer name)] of a deploy prototxt's convolutions, key = (c, h, w, o, kh, kw,
    sh, sw, ph, pw, dh, dw, group, act)."""
    from caffepar.graph.net import TEST, Net
    from caffepar.proto.text import read_net_text
    param, _ = read_net_text(str(path))
    net = Net(param, phase=TEST)
    found = []
    layers = list(net.layer_dict.items())
    for i, (name, layer) in enumerate(layers):
        if layer.param.type not in CONV_TYPES:
            continue
        bottom = net.blobs[layer.param.bottom[0]].shape
        top = layer.param.top[0]
        act = None
        for nxt in layer_after(layers, i, top):
            act = ACTIVATIONS.get(nxt.param.type)
            break
        c, h, w = bottom[1:4]
        key = (c, h, w, layer.num_output, *layer.kernel, *layer.stride, *layer.pad,
               *layer.dilation, layer.group, act or "none")
        found.append((key, name))
    return found


def layer_after(layers, i, top):
    """The layers after layer i that run in place on its top (BatchNorm, Scale, then the
    activation): yields the first activation-like layer reading `top`."""
    for _, layer in layers[i + 1:]:
        p = layer.param
        if top not in p.bottom:
            continue
        if p.type in ("BatchNorm", "Scale", "BN") and list(p.top) == [top]:
            continue
        yield layer
        return


def caffepar_call(key, batch, rng):
    from caffepar.nn import conv as cm
    from caffepar.nn.conv import geometry
    from caffepar.nn.conv.epilogue import Epilogue
    c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, group, act = key
    x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
    wt = rng.standard_normal((o, c // group, kh, kw), dtype=np.float32) * 0.1
    out = cm.conv_output_shape((h, w), (kh, kw), (sh, sw), (ph, pw), (dh, dw))
    y = np.empty((batch, o) + out, np.float32)
    ep = Epilogue(scale=rng.uniform(0.5, 1.5, o).astype(np.float32),
                  shift=rng.standard_normal(o).astype(np.float32),
                  act=None if act == "none" else act, lo=0.0, hi=6.0)
    run = cm.prepare_conv_forward(x, wt, (sh, sw), (ph, pw), (dh, dw), group, y, ep)
    run()
    from caffepar.nn.conv import dispatch
    engine = dispatch._engine(geometry.geom((h, w), (kh, kw), (sh, sw), (ph, pw), (dh, dw)),
                              c // group, o // group, group, batch, np.dtype(np.float32))
    return run, engine, (x, wt, ep, y)


def ort_call(key, batch, rng, threads):
    from onnx import helper, numpy_helper
    c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, group, act = key
    wt = (rng.standard_normal((o, c // group, kh, kw)) * 0.1).astype(np.float32)
    b = rng.standard_normal(o).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv" if act != "none" else "y"],
                              kernel_shape=[kh, kw], strides=[sh, sw], pads=[ph, pw, ph, pw],
                              dilations=[dh, dw], group=group)]
    inits = [numpy_helper.from_array(wt, "w"), numpy_helper.from_array(b, "b")]
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["conv"], ["y"]))
    elif act == "clip":
        inits += [numpy_helper.from_array(np.float32(0), "lo"),
                  numpy_helper.from_array(np.float32(6), "hi")]
        nodes.append(helper.make_node("Clip", ["conv", "lo", "hi"], ["y"]))
    x = rng.standard_normal((batch, c, h, w)).astype(np.float32)
    return _session(nodes, inits, x, threads)


def ort_fixed(threads):
    """A graph of one Relu on a 1x1x1x1 tensor: onnxruntime's own cost per run."""
    from onnx import helper
    return _session([helper.make_node("Relu", ["x"], ["y"])], [],
                    np.ones((1, 1, 1, 1), np.float32), threads)


def _session(nodes, inits, x, threads):
    import onnxruntime as ort
    from onnx import TensorProto, helper
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("y")
    sess.run_with_iobinding(binding)
    return lambda: sess.run_with_iobinding(binding)


def median_time(fn, budget, least=5, clock=time.perf_counter):
    """The median of repeated runs filling `budget` seconds (at least `least`), each timed by
    `clock`."""
    times = []
    start = time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) >= 2000:
            break
    return float(np.median(times))


def read_done(path):
    if not path.exists():
        return {}
    with open(path) as f:
        return {(r["shape"], r["batch"]): r for r in csv.DictReader(f)}


def shape_name(key):
    c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, group, act = key
    text = f"{c}x{h}x{w}->{o} k{kh}" + (f"x{kw}" if kw != kh else "") + f" s{sh}"
    text += (f" p{ph}" if ph == pw else f" p{ph}x{pw}")
    if dh > 1 or dw > 1:
        text += f" d{dh}"
    if group > 1:
        text += f" g{group}"
    return text + ("" if act == "none" else f" {act}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets-dir", type=Path, required=True,
                    help="folder of deploy prototxts (every *.prototxt in it)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.15,
                    help="seconds of runs per figure per round (at least 5 runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time, with --threads 1: what each "
                         "run computes, whatever other load shares the cores")
    ap.add_argument("--only", nargs="*", default=[],
                    help="nets whose file name contains one of these")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / f"conv_shapes_{cpu_key()}")
    ap.add_argument("--fresh", action="store_true", help="measure rows already in the CSV again")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts the calling thread's time: give --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    from caffepar.nn.blas import set_blas_threads
    set_blas_threads(args.threads)
    shapes = {}
    for path in sorted(args.nets_dir.glob("*.prototxt")):
        if args.only and not any(part in path.name for part in args.only):
            continue
        try:
            found = net_shapes(path)
        except Exception as e:      # a net caffepar cannot build: named, not fatal
            print(f"{path.name}: skipped ({e})", file=sys.stderr)
            continue
        for key, layer in found:
            entry = shapes.setdefault(key, {"nets": set(), "layers": []})
            entry["nets"].add(path.stem)
            entry["layers"].append(f"{path.stem}:{layer}")
    per_net = {}        # shape name -> {net: layers of that shape}
    for key, entry in shapes.items():
        counts = per_net.setdefault(shape_name(key), {})
        for layer in entry["layers"]:
            net = layer.split(":", 1)[0]
            counts[net] = counts.get(net, 0) + 1
    print(f"{len(shapes)} distinct convolution shapes in {args.nets_dir}", flush=True)
    done = {} if args.fresh else read_done(args.out.with_suffix(".csv"))
    rows = []
    rng = np.random.default_rng(0)
    fixed = ort_fixed(args.threads)
    for batch in args.batch:
        for key, entry in sorted(shapes.items(), key=lambda i: (-len(i[1]["layers"]), i[0])):
            name = shape_name(key)
            if (name, str(batch)) in done:
                rows.append(done[(name, str(batch))])
                continue
            c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, group, act = key
            ours, engine, _keep = caffepar_call(key, batch, rng)
            theirs = ort_call(key, batch, rng, args.threads)
            best = [np.inf] * 3
            for _ in range(args.rounds):
                for i, fn in enumerate((ours, theirs, fixed)):
                    best[i] = min(best[i], median_time(fn, args.budget, clock=clock))
            out = ((h + 2 * ph - dh * (kh - 1) - 1) // sh + 1) * \
                ((w + 2 * pw - dw * (kw - 1) - 1) // sw + 1)
            mmacs = batch * o * (c // group) * kh * kw * out / 1e6
            ort_net = max(best[1] - best[2], 1e-7)
            row = {"shape": name, "batch": batch, "nets": " ".join(sorted(entry["nets"])),
                   "layers": len(entry["layers"]), "c": c, "h": h, "w": w, "o": o,
                   "k": f"{kh}x{kw}", "s": sh, "p": ph, "d": dh, "group": group, "act": act,
                   "mmacs": round(mmacs, 3), "engine": engine,
                   "caffepar_us": round(1e6 * best[0], 1), "ort_us": round(1e6 * best[1], 1),
                   "ort_fixed_us": round(1e6 * best[2], 1),
                   "ratio": round(best[0] / ort_net, 2)}
            rows.append(row)
            print(f"b{batch} {name:<40} {engine:<10} caffepar {row['caffepar_us']:>9.1f} us  "
                  f"ort {row['ort_us']:>9.1f} us (fixed {row['ort_fixed_us']:.1f})  "
                  f"x{row['ratio']:.2f}", flush=True)
            write(args, rows, per_net)
    write(args, rows, per_net)


def write(args, rows, per_net):
    from caffepar.nn.blas import blas_threads
    if not rows:
        return
    lines = ["# Convolution shapes of published nets: caffepar vs onnxruntime",
             "",
             f"CPU: {cpu_name()}; {args.threads} threads each (caffepar's BLAS threads: "
             f"{blas_threads()}); times are "
             + ("wall-clock" if args.clock == "wall" else "the calling thread's CPU time")
             + f". Command: `python scripts/bench_conv_shapes.py --nets-dir DIR --batch "
             f"{' '.join(map(str, args.batch))} --rounds {args.rounds} --budget {args.budget} "
             f"--threads {args.threads} --clock {args.clock}"
             + (f" --only {' '.join(args.only)}" if args.only else "") + "` (DIR: the "
             "published deploy prototxts, fetched outside the repository).",
             "",
             "Each time is the fastest median of alternating rounds; caffepar's is a prepared "
             "forward with the epilogue (scale, shift, activation), onnxruntime's a one-node "
             "graph (Conv + bias + activation). ratio = caffepar / (onnxruntime - its fixed "
             "cost per run, from a graph of one 1x1 Relu timed alongside).",
             ""]
    for batch in sorted({int(r["batch"]) for r in rows}):
        sel = [r for r in rows if int(r["batch"]) == batch]
        ours = sum(float(r["caffepar_us"]) * int(r["layers"]) for r in sel)
        theirs = sum((float(r["ort_us"]) - float(r["ort_fixed_us"])) * int(r["layers"])
                     for r in sel)
        lines += [f"## Batch {batch}", "",
                  f"All layers of all nets (each shape times its layer count): caffepar "
                  f"{ours / 1e3:.1f} ms, onnxruntime {theirs / 1e3:.1f} ms "
                  f"(x{ours / max(theirs, 1e-9):.2f}).", "",
                  "| net | convolutions | caffepar ms | onnxruntime ms | ratio |",
                  "|---|---|---|---|---|"]
        nets = sorted({n for r in sel for n in per_net.get(r["shape"], {})})
        for net in nets:
            mine = [(r, per_net[r["shape"]][net]) for r in sel if net in per_net[r["shape"]]]
            a = sum(float(r["caffepar_us"]) * k for r, k in mine)
            b = sum((float(r["ort_us"]) - float(r["ort_fixed_us"])) * k for r, k in mine)
            lines.append(f"| {net} | {sum(k for _, k in mine)} | {a / 1e3:.2f} | "
                         f"{b / 1e3:.2f} | {a / max(b, 1e-9):.2f} |")
        lines += ["",
                  "| shape | layers | MMACs | engine | caffepar us | onnxruntime us | fixed us "
                  "| ratio | nets |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sel, key=lambda r: -float(r["caffepar_us"]) * int(r["layers"])):
            lines.append(f"| {r['shape']} | {r['layers']} | {r['mmacs']} | {r['engine']} | "
                         f"{r['caffepar_us']} | {r['ort_us']} | {r['ort_fixed_us']} | "
                         f"{r['ratio']} | {r['nets']} |")
        lines.append("")
    write_tables(args.out, lines, rows, digits=3)
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len({r["batch"] for r in rows}), figsize=(12, 5),
                             squeeze=False)
    for ax, batch in zip(axes[0], sorted({int(r["batch"]) for r in rows})):
        sel = [r for r in rows if int(r["batch"]) == batch]
        macs = [float(r["mmacs"]) for r in sel]
        ratio = [float(r["ratio"]) for r in sel]
        depthwise = [int(r["group"]) > 1 for r in sel]
        ax.scatter([m for m, d in zip(macs, depthwise) if not d],
                   [q for q, d in zip(ratio, depthwise) if not d], s=12, label="group 1")
        ax.scatter([m for m, d in zip(macs, depthwise) if d],
                   [q for q, d in zip(ratio, depthwise) if d], s=12, label="grouped")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("million multiply-adds")
        ax.set_ylabel("caffepar / onnxruntime")
        ax.set_title(f"batch {batch}")
        ax.legend()
    fig.suptitle(f"Convolution shapes of published nets, {cpu_name()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
