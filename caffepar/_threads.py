"""BLAS threads per MPI rank, decided before NumPy loads its BLAS: cores / ranks on this node,
unless the user set a thread count.

OpenBLAS's idle worker threads also spin for about a tenth of a second after every GEMM by
default; between GEMMs the layers' NumPy copies (and the data prefetch threads) need that core, so
workers are told to sleep at once (OPENBLAS_THREAD_TIMEOUT, unless the user set it)."""
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


set_blas_threads_for_mpi()
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
