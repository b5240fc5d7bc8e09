"""Starting a P-rank job (`--np P` re-runs the command under the mpiexec installed with
caffepar) and ending all ranks when one fails."""
import os
import shutil
import subprocess
import sys

from caffepar._threads import threads_per_rank


def find_mpiexec(explicit=None):
    """The mpiexec beside this Python (the mpich wheel's) first, then the PATH."""
    if explicit:
        return explicit
    here = os.path.dirname(sys.executable)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=here + os.pathsep + os.environ.get("PATH", ""))
        if found:
            return found
    return None


def strip_option(argv, names, takes_value=True):
    """argv without the named options (`--np 4` or `--np=4`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = takes_value and "=" not in arg
            continue
        out.append(arg)
    return out


def relaunch(ranks, argv, threads=None, mpiexec=None):
    """Run `caffepar <argv>` under mpiexec with `ranks` processes; return its exit status."""
    from caffepar.errors import CaffeparError
    exe = find_mpiexec(mpiexec)
    if exe is None:
        raise CaffeparError("--np needs mpiexec: install caffepar with its MPI (pip install "
                            "mpich) or launch the ranks yourself (mpiexec -n P caffepar ...)")
    env = dict(os.environ)
    n = str(threads or threads_per_rank(ranks))
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if threads or var not in os.environ:
            env[var] = n
    env["CAFFEPAR_MPI"] = "1"
    cmd = [exe, "-n", str(ranks), sys.executable, "-m", "caffepar.cli"] + list(argv)
    return subprocess.call(cmd, env=env)


def abort_all(comm, message, code=1):
    """Print the failing rank's reason and end every rank of the job."""
    sys.stderr.write(f"[rank {comm.rank}] {message}\n")
    sys.stderr.flush()
    comm.abort(code)
