#!/usr/bin/env python
"""Saving and loading a VGG-16-sized (553 MB) caffemodel: seconds each and peak RSS.

    python scripts/bench_weights_io.py [--keep PATH]
"""
import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", default=None, help="Write the caffemodel here and keep it.")
    args = ap.parse_args()
    from caffepar.graph.net import TEST, Net
    net = Net(str(ROOT / "models/vgg16/deploy.prototxt"), phase=TEST)
    path = args.keep or os.path.join(tempfile.mkdtemp(), "vgg16.caffemodel")
    t0 = time.perf_counter()
    net.save(path)
    t1 = time.perf_counter()
    net.copy_from(path)
    t2 = time.perf_counter()
    size = os.path.getsize(path) / 1e6
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{size:.1f} MB caffemodel: save {t1 - t0:.2f} s, load {t2 - t1:.2f} s; "
          f"peak RSS {peak:.0f} MiB (params {net.param_data.nbytes / 2 ** 20:.0f} MiB)")
    if not args.keep:
        os.unlink(path)


if __name__ == "__main__":
    main()
