#!/usr/bin/env python
"""The full cifar10_quick recipe on all of CIFAR-10 (JPEG copy): 4000 iterations at lr 1e-3, then
1000 at 1e-4 resumed from the snapshot, as Caffe's examples/cifar10/train_quick.sh.

The JPEGs are decoded in list order into CIFAR-10's binary batch files (the layout
`convert_cifar_data` reads), converted to LMDB with `caffepar data cifar10`, and the mean computed
with `caffepar data mean` — the same data BVLC Caffe was trained on for its reference figure.

    python scripts/train_cifar10_full.py --jpeg-dir ../shared/data/cifar10_jpeg [--work data/cifar10]

Prints the test accuracy after each stage and the wall time.
"""
import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def decode_batches(jpeg_dir, out_dir):
    """train_list/test_list order -> data_batch_1..5.bin, test_batch.bin (label, R, G, B planes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lists = {"train": (jpeg_dir / "train_list.txt").read_text().split("\n"),
             "test": (jpeg_dir / "test_list.txt").read_text().split("\n")}
    wanted = {}
    for split, lines in lists.items():
        for i, line in enumerate(l for l in lines if l.strip()):
            path, label = line.rsplit(" ", 1)
            wanted[path] = (split, i, int(label))
    records = {"train": np.zeros((50000, 3073), np.uint8), "test": np.zeros((10000, 3073), np.uint8)}
    seen = 0
    with tarfile.open(jpeg_dir / "cifar10-jpeg.tar.xz", "r|xz") as tar:
        for member in tar:
            name = member.name.lstrip("./")
            if name not in wanted:
                continue
            split, i, label = wanted[name]
            rgb = np.asarray(Image.open(io.BytesIO(tar.extractfile(member).read())).convert("RGB"))
            records[split][i, 0] = label
            records[split][i, 1:] = rgb.transpose(2, 0, 1).reshape(-1)
            seen += 1
    if seen != len(wanted):
        sys.exit(f"only {seen} of {len(wanted)} listed images found in the tarball")
    files = [(f"data_batch_{b + 1}.bin", records["train"][b * 10000:(b + 1) * 10000])
             for b in range(5)] + [("test_batch.bin", records["test"])]
    for name, block in files:
        data = block.tobytes()
        (out_dir / name).write_bytes(data)
        print(f"{name}: sha256 {hashlib.sha256(data).hexdigest()}")


def run(*args):
    print("+ caffepar " + " ".join(str(a) for a in args), flush=True)
    subprocess.run([sys.executable, "-m", "caffepar.cli"] + [str(a) for a in args], check=True,
                   cwd=ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jpeg-dir", type=Path, default=ROOT.parent / "shared/data/cifar10_jpeg")
    ap.add_argument("--work", type=Path, default=ROOT / "data/cifar10")
    args = ap.parse_args()
    t0 = time.time()
    batches = args.work / "batches"
    if not (batches / "test_batch.bin").exists():
        decode_batches(args.jpeg_dir, batches)
    if not (args.work / "cifar10_test_lmdb").exists():
        run("data", "cifar10", batches, args.work)
    if not (args.work / "mean.binaryproto").exists():
        run("data", "mean", args.work / "cifar10_train_lmdb", args.work / "mean.binaryproto")
    prepared = time.time()
    os.makedirs(ROOT / "snapshots", exist_ok=True)
    run("train", "--solver", "models/cifar10_quick/solver.prototxt",
        "--log", "snapshots/cifar10_quick_stage1.log")
    run("train", "--solver", "models/cifar10_quick/solver_lr1.prototxt",
        "--snapshot", "snapshots/cifar10_quick_iter_4000.solverstate",
        "--log", "snapshots/cifar10_quick_stage2.log")
    done = time.time()
    from caffepar.logs import read_curves
    for stage in (1, 2):
        test = read_curves(ROOT / f"snapshots/cifar10_quick_stage{stage}.log")["test"]
        its, acc = test.get("accuracy", ([], []))
        if acc:
            print(f"stage {stage}: test accuracy {acc[-1]:.4f} at iteration {its[-1]}")
    print(f"data preparation {prepared - t0:.0f} s, training {done - prepared:.0f} s "
          f"({(done - prepared) / 60:.1f} min)")


if __name__ == "__main__":
    main()
