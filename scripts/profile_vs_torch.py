#!/usr/bin/env python
"""Where caffepar's training step loses or wins against PyTorch, layer by layer, on one bundled
net: results/profile_<net>_<cpu>.{md,csv,png} (with _avx2 or the build's instruction set added
when the kernels are built for less than the host has, as scripts/bench_train.py names files).

    python scripts/profile_vs_torch.py [--net cifar10_quick] [--rounds 5] [--out PATH]

Both sides run the same architecture (scripts/bench_train.py's PyTorch model) at the same batch
and thread count, layer by layer as `caffe time` runs a net: each layer's forward, then each
layer's backward in reverse order, timed one by one (PyTorch: every layer on a detached input,
its backward from the gradient its top received, so no autograd graph spans two layers). Rounds
alternate between the two sides and each layer's fastest time counts. Also, per side, the whole
training step (forward + backward + SGD update) and the sum of the layers: the rest is the
overhead outside the layers (the solver's update, the step's own bookkeeping). PyTorch's own
per-op profile (torch.profiler, self CPU time, over whole training steps) is listed too: it
names the oneDNN primitives the layers ran.
"""
import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import caffepar  # noqa: E402,F401  (sets BLAS threading up before NumPy loads it)
import numpy as np  # noqa: E402
from bench_train import NETS, caffepar_step, torch_model, torch_step  # noqa: E402
from cpuinfo import build_isa, cpu_key, cpu_name, isa_suffix  # noqa: E402


def clock_layers(forward, backward, n, fwd, bwd):
    """One layer-by-layer pass, each layer's time kept when it beats fwd[i] / bwd[i]."""
    for i in range(n):
        t0 = time.perf_counter()
        forward(i)
        fwd[i] = min(fwd[i], time.perf_counter() - t0)
    for i in range(n - 1, -1, -1):
        t0 = time.perf_counter()
        backward(i)
        bwd[i] = min(bwd[i], time.perf_counter() - t0)


class OursLayers:
    """caffepar's net (the solver's, as it trains) run layer by layer; the input layer left out."""

    def __init__(self, name, batch):
        self.step, self.update, self.solver, _flops, _first = caffepar_step(name, batch)
        net = self.solver.net
        self.net = net
        self.index = [i for i, layer in enumerate(net.layers) if layer.type not in
                      ("DummyData", "Data", "Input", "ImageData", "HDF5Data")]
        self.names = [net._layer_names[i] for i in self.index]
        self.types = [net.layers[i].type for i in self.index]
        for i in range(len(net.layers)):     # the layers before the first timed one, once
            if i in self.index:
                break
            net.forward_layer(i)

    def forward(self, j):
        self.net.forward_layer(self.index[j])

    def backward(self, j):
        self.net.backward_layer(self.index[j])


def conv_flops(net):
    """The FLOPs (2 per multiply-add) of each Convolution layer's training passes -- forward,
    dw, and dx where its bottom needs a gradient -- counting only the taps that read inside
    the image (a tap reading only zero padding is work a kernel can skip)."""
    flops = {}
    for i, layer in enumerate(net.layers):
        if layer.type != "Convolution":
            continue
        x = net.blob_list[net.bottom_ids[i][0]].shape
        out = net.blob_list[net.top_ids[i][0]].shape[2:]
        inside = 1
        for size, o, k, s, p, d in zip(x[2:], out, layer.kernel, layer.stride, layer.pad,
                                       layer.dilation):
            inside *= sum(1 for j in range(o) for t in range(k) if 0 <= j * s - p + t * d < size)
        passes = 3 if (layer.bottom_need_diff or [True])[0] else 2
        flops[net._layer_names[i]] = (2 * x[0] * layer.num_output * (x[1] // layer.group)
                                      * inside * passes)
    return flops


def goal_needs(rows, flops, peak, step_ours, step_torch, goal=0.85):
    """What a step of `goal` x PyTorch's asks of the convolutions: (their time at the FMA peak,
    PyTorch's and ours as measured, the time left to them when the rest of our step stays as
    measured), in ms."""
    conv = [r for r in rows if r["layer"] in flops]
    floor = sum(flops.values()) / (peak * 1e9) * 1e3
    ours = sum(r["caffepar_fwd_ms"] + r["caffepar_bwd_ms"] for r in conv)
    theirs = sum(r["pytorch_fwd_ms"] + r["pytorch_bwd_ms"] for r in conv)
    return dict(goal=goal, peak=peak, floor=floor, ours=ours, theirs=theirs,
                rest=step_ours - ours, left=goal * step_torch - (step_ours - ours))


class TorchLayers:
    """The PyTorch model's modules run one by one (in-place ReLU made out of place: a layer's
    input is a fresh leaf), the loss as the last layer; Flatten joins the layer after it."""

    def __init__(self, name, batch, threads, names):
        import torch
        import torch.nn as nn
        torch.set_num_threads(threads)
        model, shape = torch_model(name)
        mods = []
        pending = None
        for m in model:
            if isinstance(m, nn.Flatten):
                pending = m
                continue
            if isinstance(m, nn.ReLU):
                m = nn.ReLU()
            mods.append(nn.Sequential(pending, m) if pending is not None else m)
            pending = None
        loss = nn.CrossEntropyLoss()
        target = torch.zeros(batch, dtype=torch.long)
        mods.append(lambda x: loss(x, target))
        if len(mods) != len(names):
            raise SystemExit(f"{name}: {len(names)} caffepar layers but {len(mods)} PyTorch "
                             "modules; the models do not line up")
        self.torch, self.mods = torch, mods
        self.model = model
        self.x = torch.full((batch,) + shape, 0.5)
        self.inputs = [None] * len(mods)
        self.outputs = [None] * len(mods)
        self.grads = [None] * (len(mods) + 1)
        with torch.no_grad():
            self.model.train()

    def forward(self, j):
        x = self.x if j == 0 else self.outputs[j - 1].detach()
        x.requires_grad_(j > 0)
        self.inputs[j] = x
        self.outputs[j] = self.mods[j](x)

    def backward(self, j):
        out = self.outputs[j]
        grad = self.grads[j + 1] if j + 1 < len(self.mods) else None
        out.backward(grad)
        self.grads[j] = self.inputs[j].grad


def torch_op_profile(step, iterations=5, top=14):
    """PyTorch's per-op self CPU time (ms per step) over whole training steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(iterations):
            step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    del torch
    return [(e.key, e.self_cpu_time_total / 1e3 / iterations, e.count // iterations,
             100 * e.self_cpu_time_total / total) for e in ops[:top]]


ONEDNN_STEP = """
import sys
sys.path[:0] = [{root!r}, {scripts!r}]
from bench_train import torch_step
step = torch_step({net!r}, {batch}, {threads})
print("=== timed step", flush=True)
step()
"""


def onednn_primitives(net, batch, threads):
    """The oneDNN primitives one PyTorch training step runs (ONEDNN_VERBOSE=1 in a process of
    its own, after a warm-up step): (kind, implementation, pass, layouts, shape, calls, ms),
    ms as the verbose mode times them."""
    import subprocess
    code = ONEDNN_STEP.format(root=str(ROOT), scripts=str(ROOT / "scripts"), net=net,
                              batch=batch, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ONEDNN_VERBOSE="1")).stdout
    found = {}
    for line in out.split("=== timed step", 1)[-1].splitlines():
        f = line.split(",")
        if "exec" not in f[:5] or len(f) < 10:
            continue
        i = f.index("exec")
        layouts = " ".join(f"{part.split(':')[0]}:{part.split(':')[4]}"
                           for part in f[i + 5].split() if part.count(":") >= 4)
        key = (f[i + 2], f[i + 3], f[i + 4], layouts, f[-2])
        calls, ms = found.get(key, (0, 0.0))
        found[key] = (calls + 1, ms + float(f[-1]))
    return [k + v for k, v in found.items()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="cifar10_quick", choices=list(NETS))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--repeat", type=int, default=4, help="passes per side per round")
    ap.add_argument("--out", default=None, help="OUT.{md,csv,png} (empty: print only)")
    args = ap.parse_args()
    from bench_layers import fastest
    from caffepar.nn import native
    batch = args.batch or NETS[args.net]
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
    load_start = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M")
    k = native.kernels(np.float32)
    build = build_isa(k.vector_bytes) if k is not None else "numpy"
    if args.out is None:
        args.out = str(ROOT / f"results/profile_{args.net}_{cpu_key()}{isa_suffix(build)}")

    ours = OursLayers(args.net, batch)
    theirs = TorchLayers(args.net, batch, threads, ours.names)
    n = len(ours.names)
    times = {side: (np.full(n, np.inf), np.full(n, np.inf)) for side in ("ours", "torch")}
    for side in (ours, theirs):     # warm-up: first touch, engine measurement
        clock_layers(side.forward, side.backward, n, np.full(n, np.inf), np.full(n, np.inf))
    for _ in range(args.rounds):
        for label, side in (("ours", ours), ("torch", theirs)):
            for _ in range(args.repeat):
                clock_layers(side.forward, side.backward, n, *times[label])
    steps = [ours.step, torch_step(args.net, batch, threads), ours.update]
    step_ours, step_torch, update_ours = fastest(steps, args.repeat, args.rounds)
    ops = torch_op_profile(steps[1])
    primitives = onednn_primitives(args.net, batch, threads)
    load_end = os.getloadavg()[0]

    rows = []
    for j, name in enumerate(ours.names):
        f_o, b_o = times["ours"][0][j] * 1e3, times["ours"][1][j] * 1e3
        f_t, b_t = times["torch"][0][j] * 1e3, times["torch"][1][j] * 1e3
        rows.append({"layer": name, "type": ours.types[j], "caffepar_fwd_ms": f_o,
                     "pytorch_fwd_ms": f_t, "caffepar_bwd_ms": b_o, "pytorch_bwd_ms": b_t,
                     "gap_ms": f_o + b_o - f_t - b_t})
    sum_o = sum(r["caffepar_fwd_ms"] + r["caffepar_bwd_ms"] for r in rows)
    sum_t = sum(r["pytorch_fwd_ms"] + r["pytorch_bwd_ms"] for r in rows)
    rows.append({"layer": "(step outside the layers)", "type": "update + rest",
                 "caffepar_fwd_ms": 0.0, "pytorch_fwd_ms": 0.0,
                 "caffepar_bwd_ms": step_ours * 1e3 - sum_o, "pytorch_bwd_ms": step_torch * 1e3 - sum_t,
                 "gap_ms": (step_ours * 1e3 - sum_o) - (step_torch * 1e3 - sum_t)})
    gap = step_ours * 1e3 - step_torch * 1e3
    for r in rows:
        r["gap_share_pct"] = 100 * r["gap_ms"] / gap if gap else np.nan

    from conv_efficiency import fma_peak
    needs = goal_needs(rows, conv_flops(ours.net),
                       fma_peak(k.vector_bytes if k is not None else 32, threads),
                       step_ours * 1e3, step_torch * 1e3)
    info = dict(net=args.net, batch=batch, threads=threads, started=started, needs=needs,
                load=(load_start, load_end), step=(step_ours * 1e3, step_torch * 1e3),
                update=update_ours * 1e3, sums=(sum_o, sum_t), build=build,
                kernels=(f"{build} ({k.vector_bytes}-byte vectors, {k.registers} registers)"
                         if k is not None else "NumPy"),
                builds=", ".join(f"{v}={os.environ[v]}" for v in
                                 ("CAFFEPAR_CFLAGS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                  "OPENBLAS_CORETYPE") if os.environ.get(v)),
                engines="; ".join(f"{ours.net._layer_names[i]}:"
                                 f"{layer.engine(ours.net.blob_list[ours.net.bottom_ids[i][0]].shape)}"
                                 for i, layer in enumerate(ours.net.layers)
                                 if layer.type == "Convolution"))
    lines = report(rows, ops, primitives, info)
    print("\n".join(lines))
    if args.out:
        write(Path(args.out), rows, lines)


def report(rows, ops, primitives, info):
    ls, le = info["load"]
    loaded = ls > 0.5 or le > info["threads"] + 0.5
    step_o, step_t = info["step"]
    lines = [
        f"# {info['net']} layer by layer: caffepar vs PyTorch", "",
        f"Written by `python scripts/profile_vs_torch.py --net {info['net']}` "
        f"({info['started']}). CPU: {cpu_name()}; {info['threads']} thread(s) each; batch "
        f"{info['batch']}; caffepar kernels built for {info['kernels']}"
        + (f"; {info['builds']}" if info["builds"] else "") + f". Load average (1 min) "
        f"{ls:.2f} at the start, {le:.2f} at the end"
        + (": **measured on a loaded machine**." if loaded else ": a quiet machine."), "",
        f"Training step (forward + backward + update, fastest of alternating rounds): caffepar "
        f"**{step_o:.1f} ms**, PyTorch **{step_t:.1f} ms** (ratio **{step_o / step_t:.2f}**); "
        f"sum of the layers timed one by one: {info['sums'][0]:.1f} vs {info['sums'][1]:.1f} ms; "
        f"caffepar's SGD update alone {info['update']:.2f} ms. Convolution engines: "
        f"{info['engines']}.", "",
        "Each layer's fastest forward and backward (ms), run layer by layer on both sides. Gap = "
        "caffepar - PyTorch (positive: caffepar slower); share = the row's part of the "
        "whole step's gap. The last row is the step's time outside the layers (update, "
        "bookkeeping; for PyTorch also the autograd graph the layer-by-layer run does not "
        "span).", "",
        "| layer | type | caffepar fwd | PyTorch fwd | caffepar bwd | PyTorch bwd | gap ms | "
        "share |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['type']} | {r['caffepar_fwd_ms']:.2f} | "
                     f"{r['pytorch_fwd_ms']:.2f} | {r['caffepar_bwd_ms']:.2f} | "
                     f"{r['pytorch_bwd_ms']:.2f} | {r['gap_ms']:+.2f} | "
                     f"{r['gap_share_pct']:.0f}% |")
    nd = info["needs"]
    pct = lambda ms: 100 * nd["floor"] / ms if ms > 0 else float("inf")
    lines += ["", f"What a step of {nd['goal']}x PyTorch's asks of the convolutions: at this "
              f"CPU's FMA peak ({nd['peak']:.0f} GFLOP/s, measured as scripts/conv_efficiency.py "
              f"does), counting only the taps that read inside the image, their passes would "
              f"take {nd['floor']:.1f} ms. PyTorch's took {nd['theirs']:.1f} ms "
              f"({pct(nd['theirs']):.0f}% of that peak), ours {nd['ours']:.1f} ms "
              f"({pct(nd['ours']):.0f}%). With the rest of caffepar's step as measured "
              f"({nd['rest']:.1f} ms), a step of {nd['goal'] * step_t:.1f} ms leaves the "
              f"convolutions {nd['left']:.1f} ms: "
              + (f"**{pct(nd['left']):.0f}% of peak**." if nd["left"] > 0 else
                 "**none**.")]
    lines += ["", "PyTorch's own profile of whole training steps (torch.profiler, self CPU time "
                  "per step, top ops):", "", "| op | ms per step | calls per step | share |",
              "|---|---|---|---|"]
    lines += [f"| {name} | {ms:.2f} | {calls} | {pct:.0f}% |" for name, ms, calls, pct in ops]
    lines += ["", "The oneDNN primitives of one PyTorch training step (ONEDNN_VERBOSE=1: kind, "
                  "implementation, pass, memory formats -- abcd is plain NCHW, aBcd16b the "
                  "blocked nChw16c, Acdb16a and the like blocked weights -- and shape; ms as the "
                  "verbose mode times them, one step):", "",
              "| primitive | implementation | pass | formats | shape | calls | ms |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {kind} | {impl} | {prop} | {fmt} | {shape} | {calls} | {ms:.2f} |"
              for kind, impl, prop, fmt, shape, calls, ms in primitives]
    if not primitives:
        lines.append("| (none reported: this PyTorch build prints no oneDNN verbose lines) "
                     "| | | | | | |")
    return lines


def write(out, rows, lines):
    from tables import write_tables
    write_tables(out, lines, rows)
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.4))
    x = np.arange(len(rows))
    for dx, side, label in ((-0.2, "caffepar", "caffepar"), (0.2, "pytorch", "PyTorch")):
        f = [r[f"{side}_fwd_ms"] for r in rows]
        b = [r[f"{side}_bwd_ms"] for r in rows]
        ax.bar(x + dx, f, 0.38, label=f"{label} forward", color="C0" if side == "caffepar" else "C1")
        ax.bar(x + dx, b, 0.38, bottom=f, label=f"{label} backward / rest",
               color="C0" if side == "caffepar" else "C1", alpha=0.5)
    ax.set_xticks(x, [r["layer"].replace("(step outside the layers)", "rest") for r in rows],
                  rotation=45, fontsize=8)
    ax.set_ylabel("ms (fastest)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
