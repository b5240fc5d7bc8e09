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


#: How MPI is made to talk between ranks on one machine. `tcp` forces the network path on
#: loopback (every rank as if on its own node), standing for a cluster's network: MPICH's
#: NOLOCAL with UCX's or libfabric's TCP transport, Open MPI's tcp BTL.
TRANSPORTS = {
    "shm": {},
    "tcp": {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "FI_PROVIDER": "tcp",
            "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self"},
}


def transport_environment(name):
    """Environment variables selecting transport `name` (shm: MPI's own choice)."""
    from caffepar.errors import CaffeparError
    if name not in TRANSPORTS:
        raise CaffeparError(f"unknown transport {name!r}: expected one of "
                            f"{', '.join(TRANSPORTS)}")
    return dict(TRANSPORTS[name])


def relaunch(ranks, argv, threads=None, mpiexec=None, transport=None):
    """Run `caffepar <argv>` under mpiexec with `ranks` processes; return its exit status.
    `transport` (default $CAFFEPAR_TRANSPORT, else shm) as in TRANSPORTS."""
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
    env.update(transport_environment(transport or os.environ.get("CAFFEPAR_TRANSPORT", "shm")))
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
