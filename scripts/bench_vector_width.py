#!/usr/bin/env python
"""The compiled kernels built for different vector widths on this CPU, side by side in
alternating rounds (fastest counts): the direct convolution (forward + backward, the engine
forced) at the bundled nets' shapes and cifar10_quick's pool1 (MAX 3x3/2, 100x32x32x32)
forward + backward. Builds:

- native: -march=native (64-byte vectors on an AVX-512 host);
- native-256: -march=native -DNATIVE_BYTES=32 (256-bit code, 32 registers: on a CPU whose
  AVX-512 units are two 256-bit halves, such as Zen 4, the question is whether it pays);
- avx2: -march=haswell (the code an AVX2-only host gets).

Each build runs in a process of its own (CAFFEPAR_CFLAGS). Written to results/vector_width_<cpu>
.{md,csv,png}.

    python scripts/bench_vector_width.py [--rounds 3] [--out results/vector_width_<cpu>]
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
sys.path.insert(0, str(ROOT / "scripts"))

BUILDS = {"native": "", "native-256": "-DNATIVE_BYTES=32", "avx2": "-march=haswell"}
# (name, batch, channels, height/width, outputs, kernel, stride, pad, group)
SHAPES = [("cifar10_quick conv1", 100, 3, 32, 32, 5, 1, 2, 1),
          ("cifar10_quick conv2", 100, 32, 16, 32, 5, 1, 2, 1),
          ("cifar10_quick conv3", 100, 32, 8, 64, 5, 1, 2, 1),
          ("alexnet conv2", 16, 96, 27, 256, 5, 1, 2, 2),
          ("alexnet conv5", 16, 384, 13, 256, 3, 1, 1, 2),
          ("vgg16 conv1_2", 4, 64, 224, 64, 3, 1, 1, 1)]


def child(repeat):
    """In a process of one build: {piece: fastest seconds}."""
    import caffepar  # noqa: F401
    import numpy as np
    from bench_layers import best_time
    from bench_train import pool1_ms
    from caffepar.nn import native
    from caffepar.nn.conv import dispatch
    os.environ["CAFFEPAR_CONV_ENGINES"] = "direct"
    k = native.kernels(np.float32)
    out = {"vector_bytes": k.vector_bytes, "registers": k.registers}
    rng = np.random.default_rng(0)
    for name, n, c, hw, o, kk, s, p, g in SHAPES:
        x = rng.standard_normal((n, c, hw, hw), dtype=np.float32)
        w = rng.standard_normal((o, c // g, kk, kk), dtype=np.float32) * 0.1
        y = dispatch.conv_forward(x, w, None, s, p, 1, g)
        dx = np.empty_like(x)

        def step():
            dispatch.conv_forward(x, w, None, s, p, 1, g, out=y)
            dispatch.conv_backward(y, x, w, s, p, 1, g, dx_out=dx)

        assert dispatch.conv_engine((hw, hw), w.shape, s, p, 1, g, n) == "direct"
        step()
        out[name] = best_time(step, repeat)
    out["pool1"] = pool1_ms(repeat) / 1e3
    print(json.dumps(out))


def run_build(flags, repeat):
    env = dict(os.environ, CAFFEPAR_CFLAGS=flags)
    done = subprocess.run([sys.executable, __file__, "--child", "--repeat", str(repeat)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"build {flags or 'native'} failed: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--builds", default=",".join(BUILDS))
    ap.add_argument("--out", default=None, help="OUT.md/.csv/.png (default: results/"
                                                "vector_width_<vendor>_<family>)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.repeat)
    from cpuinfo import cpu_key, cpu_name
    builds = args.builds.split(",")
    load_start, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M")
    best, info = {}, {}
    for r in range(args.rounds):            # alternating: every build in every round
        for b in builds:
            found = run_build(BUILDS[b], args.repeat)
            info[b] = (found.pop("vector_bytes"), found.pop("registers"))
            for piece, t in found.items():
                best[b, piece] = min(best.get((b, piece), float("inf")), t)
            print(f"round {r + 1} {b}: " + ", ".join(f"{p} {1e3 * t:.2f}"
                                                     for p, t in found.items()), flush=True)
    load_end = os.getloadavg()[0]
    pieces = [s[0] for s in SHAPES] + ["pool1"]
    out = Path(args.out) if args.out else ROOT / f"results/vector_width_{cpu_key()}"
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["piece"] + [f"{b}_ms" for b in builds])
        for p in pieces:
            w.writerow([p] + [f"{1e3 * best[b, p]:.3f}" for b in builds])
    ratio = [b for b in builds if b != "native"]
    lines = ["# Kernels built for different vector widths, side by side", "",
             f"Written by `python scripts/bench_vector_width.py` ({started}, {args.rounds} "
             f"alternating rounds, fastest counts). CPU: {cpu_name()}; threads: "
             f"{os.environ.get('OPENBLAS_NUM_THREADS', os.cpu_count())}. Load average (1 min) "
             f"{load_start:.2f} at the start, {load_end:.2f} at the end" +
             (": **measured on a loaded machine** (ratios from alternating rounds, absolute "
              "times noisy)." if max(load_start, load_end) > 2.5 else ": a quiet machine."),
             "",
             "Builds: " + "; ".join(f"{b} ({BUILDS[b] or '-march=native'}: {info[b][0]}-byte "
                                    f"vectors, {info[b][1]} registers)" for b in builds) + ".",
             "", "Direct convolution (engine forced) forward + backward, and pool1 forward + "
             "backward, ms; ratio = build / native (< 1: faster than native).", "",
             "| piece | " + " | ".join(builds) + " | " +
             " | ".join(f"{b} / native" for b in ratio) + " |",
             "|---|" + "---|" * (len(builds) + len(ratio))]
    for p in pieces:
        lines.append(f"| {p} | " + " | ".join(f"{1e3 * best[b, p]:.2f}" for b in builds) +
                     " | " + " | ".join(f"**{best[b, p] / best['native', p]:.2f}**"
                                        for b in ratio) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from figures import pyplot
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, b in enumerate(ratio):
        ax.bar([j + 0.4 * i - 0.2 for j in range(len(pieces))],
               [best[b, p] / best["native", p] for p in pieces], 0.4, label=f"{b} / native")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(pieces)), [p.replace(" ", "\n") for p in pieces], fontsize=7)
    ax.set_ylabel("time / native build's")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
