"""Git revisions of the project side by side, for benchmarks that time each revision's code
(and its own compiled kernels) in a process of its own."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def extract(revisions, paths=("caffepar",), prefix="caffepar-revisions-"):
    """{revision: folder} holding each revision's `paths`, in a temporary folder removed at
    exit."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, work, True)
    trees = {}
    for rev in revisions:
        tree = work / rev.replace("/", "_")
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *paths],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        trees[rev] = tree
    return trees


def time_passes(tree, shapes, step=False, threads=None):
    """(vector bytes of the kernels built, {shape: {pass: ms}} and with `step` also
    {"training step": ms}) from scripts/direct_passes.py run on `tree`'s code in a process of
    its own, on `threads` BLAS threads when given."""
    env = None
    if threads is not None:
        env = dict(os.environ, **{v: str(threads) for v in
                                  ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")})
    got = json.loads(subprocess.run(
        [sys.executable, str(ROOT / "scripts/direct_passes.py"), str(tree), json.dumps(shapes)]
        + (["--step"] if step else []),
        capture_output=True, text=True, check=True, env=env).stdout)
    return got.pop("vector_bytes"), got
