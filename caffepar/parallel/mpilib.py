"""Which MPI library caffepar runs on, and what each launcher needs from it.

caffepar runs on any MPI that mpi4py was built against: the `mpich` wheel by default, or a
cluster's own (Open MPI, a vendor MPICH). The library is named by `caffepar --version`, by
`caffepar calibrate` and in its calibration files. A launcher that is not hydra needs a few
things of its own: Open MPI's mpirun refuses root and more ranks than cores unless told, and
Slurm's pmi2 plugin (`srun --mpi=pmi2`) cannot serve MPICH's UCX start-up (see
`prepare_environment`).
"""
import functools
import os
import subprocess
import sys


_QUERY = """
import mpi4py
mpi4py.rc.initialize = False        # the version needs no MPI_Init
from mpi4py import MPI
lines = MPI.Get_library_version().strip().splitlines() or ["unknown"]
print(" ".join(lines[0].replace("\\0", " ").split()))
print("%d.%d" % MPI.Get_version())
print(mpi4py.__version__)
"""


@functools.lru_cache(maxsize=None)
def _query():
    """(library, MPI standard version, mpi4py version) of the MPI mpi4py runs on. Asked in a
    process of its own unless MPI has started here: importing mpi4py.MPI starts MPI, and a
    launcher must not (nor leave mpi4py unable to start it later)."""
    if "mpi4py.MPI" in sys.modules:
        import mpi4py
        from mpi4py import MPI
        lines = MPI.Get_library_version().strip().splitlines() or ["unknown"]
        name = " ".join(lines[0].replace("\0", " ").split())     # Open MPI's ends in a NUL
        return name, "%d.%d" % MPI.Get_version(), mpi4py.__version__
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return f"unusable ({error})", None, None
    if done.returncode:
        if "No module named 'mpi4py'" in done.stderr:
            return None, None, None
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"unusable ({last})", None, None
    return tuple(done.stdout.strip().splitlines()[:3])


def library_version():
    """MPI's own name for itself (the first line of MPI_Get_library_version, e.g. `MPICH
    Version: 5.0.2`, `Open MPI v4.1.4, ...`); None without mpi4py."""
    return _query()[0]


def describe():
    """One line: the MPI library, its MPI standard version, and mpi4py's."""
    version, standard, mpi4py_version = _query()
    if version is None:
        return "MPI: none (mpi4py is not installed)"
    if standard is None:
        return f"MPI: {version}"
    return f"MPI: {version} (MPI {standard}, mpi4py {mpi4py_version})"


def family():
    """`mpich`, `openmpi` or `other`: the library mpi4py runs on."""
    version = (library_version() or "").lower()
    if version.startswith("open mpi"):
        return "openmpi"
    if "mpich" in version or "mvapich" in version or "intel" in version:
        return "mpich"
    return "other"


#: Slurm's pmi2 plugin reads each PMI-1 request of a rank with one read() of at most 1024
#: bytes (slurm 22.05, src/plugins/mpi/pmi2/pmi1.c). MPICH's UCX start-up puts its address
#: table in segments of the largest value the plugin allows, each line longer than that: a
#: line read in two parts is two invalid requests, and MPI_Init fails or hangs in about half
#: the runs. Its OFI netmod's start-up puts short lines only.
SLURM_PMI_NETMOD = "ofi"


def prepare_environment(environ=None):
    """Before MPI starts in a rank: under `srun --mpi=pmi2` (Slurm's PMI, not hydra's), MPICH
    uses its OFI netmod unless the user chose one (MPIR_CVAR_CH4_NETMOD); returns what it
    set, {} when nothing. Other MPI libraries ignore the variable."""
    env = os.environ if environ is None else environ
    under_slurm_pmi = (env.get("SLURM_MPI_TYPE", "").startswith("pmi2") and "PMI_FD" in env
                       and "MPI_LOCALNRANKS" not in env)     # hydra's proxies set that
    if not under_slurm_pmi or "MPIR_CVAR_CH4_NETMOD" in env:
        return {}
    env["MPIR_CVAR_CH4_NETMOD"] = SLURM_PMI_NETMOD
    return {"MPIR_CVAR_CH4_NETMOD": SLURM_PMI_NETMOD}


def is_open_mpi_launcher(exe):
    """Whether `exe` (an mpiexec or mpirun) is Open MPI's."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def open_mpi_options(ranks):
    """What Open MPI's mpirun needs to run a `--np` job as hydra does: run as root where
    caffepar is run as root (containers), and more ranks than cores (hydra's default)."""
    opts = ["--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        opts.append("--allow-run-as-root")
    return opts


def check_launcher(exe):
    """The mpiexec `exe` must start ranks of the MPI mpi4py runs on: an mpi4py built against
    Open MPI started by hydra (or the other way round) runs P one-rank jobs, each training
    alone. Returns the one line saying so, or None."""
    open_mpi = is_open_mpi_launcher(exe)
    mine = family()
    if open_mpi and mine == "mpich":
        return (f"{exe} is Open MPI's mpirun, but mpi4py runs on {library_version()}: give "
                "--mpiexec with MPICH's mpiexec (the mpich wheel's is beside caffepar's "
                "Python), or rebuild mpi4py against Open MPI")
    if not open_mpi and mine == "openmpi":
        return (f"{exe} is not Open MPI's, but mpi4py runs on {library_version()}: give "
                "--mpiexec with Open MPI's mpirun")
    return None
