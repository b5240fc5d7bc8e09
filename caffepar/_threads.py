"""BLAS threads per MPI rank, decided before NumPy loads its BLAS: cores / ranks on this node,
unless the user set a thread count.

OpenBLAS's idle worker threads also spin for about a tenth of a second after every GEMM by
default; between GEMMs the layers' NumPy copies (and the data prefetch threads) need that core, so
workers are told to sleep at once (OPENBLAS_THREAD_TIMEOUT, unless the user set it).

OpenBLAS picks its kernels by CPU model, and takes an AMD CPU with AVX-512 it does not know (Zen 5
in OpenBLAS 0.3.31) for a Haswell: AVX2 kernels at half the speed the CPU has (SGEMM 51 vs 130
GFLOP/s on one Zen 5 core). On such a CPU its AVX-512 kernels are asked for (OPENBLAS_CORETYPE,
unless the user set it); every CPU with these AVX-512 subsets runs them."""
import os

_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_LOCAL_RANK_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE", "PMI_SIZE")


def threads_per_rank(ranks_here):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, ranks_here))


def set_blas_threads_for_mpi():
    if any(os.environ.get(v) for v in _THREAD_VARS):
        return
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            n = str(threads_per_rank(int(value)))
            for v in _THREAD_VARS:
                os.environ[v] = n
            return


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


set_blas_threads_for_mpi()
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
if "OPENBLAS_CORETYPE" not in os.environ and openblas_coretype():
    os.environ["OPENBLAS_CORETYPE"] = openblas_coretype()
