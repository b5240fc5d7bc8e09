"""BLAS threads per MPI rank, decided before NumPy loads its BLAS: cores / ranks on this node,
unless the user set a thread count.

OpenBLAS's idle worker threads also spin for about a tenth of a second after every GEMM by
default; between GEMMs the layers' NumPy copies (and the data prefetch threads) need that core, so
workers are told to sleep at once (OPENBLAS_THREAD_TIMEOUT, unless the user set it).

OpenBLAS picks its kernels by CPU model, and takes an AMD CPU with AVX-512 it does not know (Zen 5
in OpenBLAS 0.3.31) for a Haswell: AVX2 kernels at half the speed the CPU has (SGEMM 51 vs 130
GFLOP/s on one Zen 5 core). On such a CPU its AVX-512 kernels are asked for (OPENBLAS_CORETYPE,
unless the user set it); every CPU with these AVX-512 subsets runs them.

OpenBLAS reads these variables once, when it is loaded. A script that imports NumPy before
caffepar (`import numpy as np; import caffe`, as pycaffe scripts do) has loaded it already:
`missed_settings` names what it did not see, and caffepar.nn.blas applies the thread timeout and
count through OpenBLAS's entry points. Its kernels cannot change once loaded; a warning says so
where it matters."""
import os
import sys

_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_LOCAL_RANK_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE", "PMI_SIZE")


def threads_per_rank(ranks_here):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, ranks_here))


def set_blas_threads_for_mpi():
    """The thread count set for this rank, or None when it is the user's or there is one rank
    on this node."""
    if any(os.environ.get(v) for v in _THREAD_VARS):
        return None
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            n = str(threads_per_rank(int(value)))
            for v in _THREAD_VARS:
                os.environ[v] = n
            return n
    return None


AVX512_KERNELS = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


def openblas_coretype(cpuinfo="/proc/cpuinfo"):
    """The OpenBLAS kernels to ask for on this CPU, or None to let OpenBLAS choose."""
    try:
        with open(cpuinfo) as f:
            text = f.read(1 << 16)
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if fields.get("vendor_id") != "AuthenticAMD":
        return None
    return "SkylakeX" if AVX512_KERNELS <= set(fields.get("flags", "").split()) else None


def loaded_openblas(maps="/proc/self/maps"):
    """Real paths of the OpenBLAS libraries this process has loaded, or None where the
    process's mappings cannot be read (then NumPy having been imported stands for it)."""
    try:
        with open(maps) as f:
            return {line.split(None, 5)[5].strip() for line in f
                    if "openblas" in line.lower() and len(line.split(None, 5)) == 6}
    except OSError:
        return None


def missed_settings(path):
    """{variable: value} of what this module set that the OpenBLAS at `path` was loaded too
    early to read; {} when it was loaded after this module ran."""
    if _LOADED_BEFORE is None:
        early = _NUMPY_BEFORE
    else:
        early = os.path.realpath(path) in _LOADED_BEFORE
    return dict(_SET) if early else {}


def set_openblas_environment():
    """Set the OpenBLAS variables above that the user left unset; {variable: value} of those
    set here."""
    set_here = {}
    if set_blas_threads_for_mpi():
        set_here["OPENBLAS_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"]
    if "OPENBLAS_THREAD_TIMEOUT" not in os.environ:
        set_here["OPENBLAS_THREAD_TIMEOUT"] = os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
    coretype = openblas_coretype()
    if coretype and "OPENBLAS_CORETYPE" not in os.environ:
        set_here["OPENBLAS_CORETYPE"] = os.environ["OPENBLAS_CORETYPE"] = coretype
    return set_here


_LOADED_BEFORE = loaded_openblas()
_NUMPY_BEFORE = "numpy" in sys.modules
_SET = set_openblas_environment()
