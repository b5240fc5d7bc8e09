import os
from pathlib import Path

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CAFFE_REF = SHARED / "caffe_ref"
DATA = SHARED / "data"


def need_shared(path=SHARED):
    """Skip when the shared reference data (Caffe outputs, real models) is not beside the repo."""
    if not Path(path).exists():
        pytest.skip(f"reference data not available ({path.name} missing beside the repository)")
    return Path(path)
