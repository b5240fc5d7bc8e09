"""Git revisions of the project side by side, for benchmarks that time each revision's code
(and its own compiled kernels) in a process of its own."""
import atexit
import shutil
import subprocess
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
