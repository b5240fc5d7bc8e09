"""Starting a P-rank job (`--np P` re-runs the command under the mpiexec installed with
caffepar) and ending all ranks when one fails."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

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
    fd, report = tempfile.mkstemp(prefix="caffepar-abort-", suffix=".txt")
    os.close(fd)
    env[ABORT_REPORT_VAR] = report
    try:
        status = subprocess.call(cmd, env=env)
        with open(report, encoding="utf-8", errors="replace") as f:
            reasons = f.read()
        if reasons:
            sys.stderr.write(reasons)
            sys.stderr.flush()
        return status
    finally:
        os.unlink(report)


#: Set by `relaunch`: the file a failing rank writes its reason to. mpiexec may tear down
#: the output forwarding of the ranks it kills before their last lines arrive, so the
#: launcher prints the reason itself once the job has ended.
ABORT_REPORT_VAR = "CAFFEPAR_ABORT_REPORT"


def abort_all(comm, message, code=1):
    """Report the failing rank's reason and end every rank of the job."""
    line = f"[rank {comm.rank}] {message}\n"
    report = os.environ.get(ABORT_REPORT_VAR)
    if report:
        with open(report, "a", encoding="utf-8") as f:
            f.write(line)
    else:
        sys.stderr.write(line)
        sys.stderr.flush()
        time.sleep(0.5)     # a launcher we did not start forwards output asynchronously
    comm.abort(code)
