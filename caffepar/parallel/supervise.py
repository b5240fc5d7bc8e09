"""Each rank of a job runs under a small parent process of its own, which reports how the
rank ended when the rank itself cannot: killed by a signal (SIGKILL from the kernel's
out-of-memory killer or a kill -9, SIGSEGV in compiled code), or stuck where its watchdog's last
resort ended it.

Without it, only the process manager sees such an end (hydra: its banner "YOUR APPLICATION
TERMINATED WITH THE EXIT STRING: Killed (signal 9)", not naming the rank) and it kills the other
ranks at once, before they can say anything. With it, the process the MPI launcher started is
this parent: it forks the rank as its child before NumPy or MPI are loaded (as `mpiexec -n 4
valgrind prog` runs each rank under a tool), waits for it, and when the rank dies of signal N
writes one line, `[rank r] caffepar: killed by SIGSEGV (segmentation fault) at layer.py:12, in
forward`, then ends the job with status 128 + N: through the process manager (hydra's PMI
`abort`, as MPI_Abort does: no banner, the other ranks ended at once), or by exiting with it.
Under caffepar's launcher the line goes to the job folder, and the launcher ends the job.

The parent ignores SIGINT, SIGTERM and SIGHUP: process managers signal a rank's whole process
group (hydra, Open MPI) or all its processes (Slurm), so the rank gets them as before, once. The
rank dies with its parent (SIGTERM on the parent's death, a snapshot and stop), and the parent
exits when its own parent, the process manager's proxy, dies, so that the rank's watchdog sees
the process manager gone. `CAFFEPAR_SUPERVISE=0` turns all of this off.

This module is imported by `caffepar/__init__.py` before anything heavy: it uses the standard
library and ranks.py only.
"""
import faulthandler
import os
import re
import select
import signal
import sys
import time

from caffepar.parallel.ranks import (NOTES_VAR, PARENT_VAR, job_file, stuck_line,
                                     wait_forwarded, write_job_file)

OFF_VAR = "CAFFEPAR_SUPERVISE"

_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
#: Signals the parent leaves to the rank (it gets them itself, as its process group's member).
_LEFT_TO_THE_RANK = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE",
                     "SIGALRM", "SIGTSTP")


def rank_of_environment():
    """This process's rank in the job an MPI launcher started, when that job has 2 or more
    ranks; else None."""
    env = os.environ
    size = next((env[v] for v in _SIZE_VARS if env.get(v, "").isdigit()), None)
    rank = next((env[v] for v in _RANK_VARS if env.get(v, "").isdigit()), None)
    if size is None and env.get("SLURM_STEP_ID") is not None:
        size, rank = env.get("SLURM_NTASKS", ""), env.get("SLURM_PROCID", "")
    if not (size or "").isdigit() or not (rank or "").isdigit() or int(size) < 2:
        return None
    return int(rank)


def supervise():
    """In a rank of a multi-rank job: fork the rank; this process stays its parent and never
    returns. Elsewhere (one rank, already supervised, turned off): nothing."""
    if os.environ.get(OFF_VAR) == "0" or PARENT_VAR in os.environ or \
            not sys.platform.startswith("linux"):
        return
    rank = rank_of_environment()
    if rank is None:
        return
    import tempfile
    try:
        notes = tempfile.TemporaryFile()
    except OSError:
        notes = None
    me = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        _become_rank(me, notes)
        return
    _watch(child, rank, notes)


def _become_rank(parent, notes):
    _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:          # the parent died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)
    os.environ[PARENT_VAR] = str(parent)
    if notes is not None:
        fd = os.dup(notes.fileno())
        notes.close()
        os.environ[NOTES_VAR] = str(fd)
        if not faulthandler.is_enabled():
            faulthandler.enable(file=fd, all_threads=True)


def _set_parent_death_signal(signum):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _watch(child, rank, notes):
    """The parent's whole life: wait for the rank; exit with its status, or report its death by
    a signal and end the job."""
    for name in _LEFT_TO_THE_RANK:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    manager = os.getppid()
    try:
        fd = os.pidfd_open(child)
    except (AttributeError, OSError):
        fd = None
    status = None
    while status is None:
        if fd is not None:
            select.select([fd], [], [], 1.0)
        else:
            time.sleep(0.2)
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid != child:
            status = None
            if os.getppid() != manager:     # the process manager died: let the rank see it
                os._exit(1)
    code = os.waitstatus_to_exitcode(status)
    text = _read(notes)
    line = None
    if code < 0:
        line = death_line(rank, -code, text)
        code = 128 - code
    elif code == 1 and text.startswith("Timeout ("):
        line = stuck_line(rank, text)
    if line:
        if text and any(a in ("--debug", "-debug") for a in sys.argv):
            _write(2, text)         # the stacks in full, as --debug shows a traceback
        _report(rank, code, line)
    os._exit(code)


def _write(fd, text):
    try:
        os.write(fd, text.encode("utf-8", "replace"))
    except OSError:
        pass


def _read(notes):
    if notes is None:
        return ""
    try:
        notes.seek(0)
        return notes.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def _report(rank, code, line):
    """Under caffepar's launcher, the line to the job folder (`rank<r>.killed`; the launcher
    reports it unless it ended the rank itself, or another rank had ended first) and the
    launcher ends the job. Otherwise to stderr, and under hydra the job ends through its process
    manager with this status."""
    path = job_file(rank, "killed")
    if path:
        try:
            write_job_file(path, f"{code}\n{line}\n")
            return
        except OSError:
            pass
    _write(2, line + "\n")
    wait_forwarded(2)       # stderr: the process manager has the line before the job ends
    _hydra_abort(code)


def _hydra_abort(code):
    """Ask hydra's process manager to end the job with `code` (PMI's abort command, on the
    connection the rank inherited from this process, as MPI_Abort does: no banner, the other
    ranks ended at once), and wait to be ended."""
    pmi = os.environ.get("PMI_FD", "")
    if not pmi.isdigit() or "HYDI_CONTROL_FD" not in os.environ:
        return
    try:
        os.write(int(pmi), f"cmd=abort exitcode={code}\n".encode())
    except OSError:
        return
    time.sleep(10)


def death_line(rank, signum, text=""):
    """`[rank r] caffepar: killed by SIGSEGV (segmentation fault) at layer.py:12, in forward`:
    where, from the stack Python's faulthandler wrote (the thread that got the signal): the
    innermost frame of caffepar's or of the user's code, and the call it was in when that was
    into the standard library or another package."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGKILL:
        return (f"[rank {rank}] caffepar: killed by SIGKILL (kill -9, or the kernel's "
                "out-of-memory killer)")
    what = (signal.strsignal(signum) or "").split(":")[0].lower()
    line = f"[rank {rank}] caffepar: killed by {name}" + (f" ({what})" if what else "")
    if "Fatal Python error" not in text:
        return line
    frames = re.findall(r'File "([^"]*)", line (\d+) in (\S+)',
                        text.partition("Current thread")[2].split("\n\n")[0])
    if not frames:
        return line
    mine = next((f for f in frames if _ours(f[0])), frames[0])
    line += f" at {os.path.basename(mine[0])}:{mine[1]}, in {mine[2]}"
    return line + (f", calling {frames[0][2]}" if mine != frames[0] else "")


def _ours(path):
    """True for caffepar's files and the user's (not the standard library's nor another
    installed package's)."""
    import sysconfig
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if path.startswith(here + os.sep):
        return True
    libraries = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib",
                                                        "platlib")}
    return not any(d and path.startswith(d + os.sep) for d in libraries)
