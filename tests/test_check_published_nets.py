"""scripts/check_published_nets.py on a small folder: a net that runs every command, a net that
is refused in one line, a solver (its net inline too); the CSV and markdown it writes, and a
resumed run that checks again only what --recheck names."""
import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from caffepar.nn import native

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_published_nets.py"

NET = """name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv2" type: "Convolution" bottom: "conv" top: "conv2"
        convolution_param { num_output: 3 kernel_size: 3 stride: 2 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip" inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""
UNKNOWN = NET.replace('type: "Softmax"', 'type: "NoSuchLayer"')
SOLVER = 'net: "small.prototxt"\nbase_lr: 0.01\nmax_iter: 10\nlr_policy: "fixed"\n'
INLINE_SOLVER = 'base_lr: 0.01\nmax_iter: 10\nnet_param { ' + NET.replace("\n", " ") + '}\n'


def check(folder, out, *extra):
    """The script on `folder` with a cache of its own (the engines are measured afresh), which
    starts with the suite's build of the kernels."""
    cache = out.parent / "cache"
    env = dict(os.environ, CAFFEPAR_CACHE_DIR=str(cache))
    built = native.library_path()
    if built.exists() and not (cache / built.name).exists():
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, cache / built.name)
    done = subprocess.run([sys.executable, str(SCRIPT), str(folder), "--out", str(out),
                           "--timeout", "120", *extra], capture_output=True, text=True, env=env)
    with open(out.with_suffix(".csv"), newline="") as f:
        return done, {r["prototxt"]: r for r in csv.DictReader(f)}


@pytest.mark.filterwarnings("ignore")
def test_check_published_nets(tmp_path):
    pytest.importorskip("onnxruntime")
    folder = tmp_path / "nets"
    (folder / "sub").mkdir(parents=True)
    (folder / "small.prototxt").write_text(NET)
    (folder / "sub" / "unknown.prototxt").write_text(UNKNOWN)
    (folder / "solver.prototxt").write_text(SOLVER)
    (folder / "inline_solver.prototxt").write_text(INLINE_SOLVER)
    out = tmp_path / "res" / "published"
    done, rows = check(folder, out)
    assert done.returncode == 0, done.stderr
    small = rows["small.prototxt"]
    assert [small[c] for c in ("info", "plan", "upgrade", "time", "weights", "onnx")] == \
        ["ran"] * 6
    unknown = rows["sub/unknown.prototxt"]
    assert unknown["info"] == "refused" and "NoSuchLayer" in unknown["info_reason"]
    assert unknown["onnx"] == "skipped"
    for name in ("solver.prototxt", "inline_solver.prototxt"):
        assert rows[name]["kind"] == "solver" and rows[name]["upgrade"] == "ran"
    md = out.with_suffix(".md").read_text()
    assert "tracebacks, hangs or unclear reports: 0" in md and "NoSuchLayer" in md
    # The engines a first run measures (the test suite's own are the fixed rules), conv2's
    # 3x3 kernel on a 2x2 input among them.
    assert "`measure` for 2 nets" in md and small["engines"] == "measure"

    (folder / "small.prototxt").write_text(UNKNOWN)      # kept: not rechecked
    (folder / "sub" / "unknown.prototxt").write_text(NET)
    (folder / "inline_solver.prototxt").unlink()         # kept: a row of a file outside DIR
    done, again = check(folder, out, "--resume", "--recheck", "sub/*")
    assert done.returncode == 0, done.stderr
    assert again["small.prototxt"]["info"] == "ran"
    assert again["sub/unknown.prototxt"]["info"] == "ran"
    assert set(again) == set(rows)
