"""A rank's side of a job: how it tells caffepar's launcher who it is and how it ended, and
how it ends the whole job when it cannot go on.

Under caffepar's launcher (`--np`, `netlab run`) every rank writes into the job folder
($CAFFEPAR_JOB_DIR): `rank<r>.pid` when it starts, `rank<r>.end` (exit status, then the one line
that reports it) when it ends, `rank<r>.stuck` when the watchdog's last resort ends it; the
rank's supervising parent (supervise.py) writes `rank<r>.killed` (the same two lines) when the
rank was killed by a signal.
The launcher reads them (launch.py); the communicators' watchdog ends the job through abort_all
(comm.py). They import this module, which imports none of them (and only the standard library:
the supervising parent loads it before anything else).
"""
import os
import re
import socket
import sys
import time

#: Set by caffepar's launcher for the ranks: the job folder, and the launcher's pid.
JOB_DIR_VAR = "CAFFEPAR_JOB_DIR"
LAUNCHER_VAR = "CAFFEPAR_LAUNCHER_PID"

#: Set by the supervising parent in its rank's environment: the parent's pid, and the descriptor
#: of the file where the rank's fatal-signal and stuck stacks go (supervise.py).
PARENT_VAR = "CAFFEPAR_RANK_PARENT"
NOTES_VAR = "CAFFEPAR_RANK_NOTES"

#: How a rank reports an MPI call that failed: most often the consequence of another rank, or
#: the link to it, gone (the launcher then names that rank instead).
MPI_FAILED = "caffepar: MPI failed"


def mpi_failure(error):
    """One line for an exception of mpi4py (its text is MPICH's whole error stack), or None."""
    if type(error).__module__ != "mpi4py.MPI" or not hasattr(error, "Get_error_class"):
        return None
    try:
        from mpi4py import MPI
        what = MPI.Get_error_string(error.Get_error_class())
    except Exception:           # noqa: BLE001 - the line must come out whatever MPI's state
        what = str(error).partition("\n")[0].split(", error stack")[0]
    return f"{MPI_FAILED} ({what}): another rank, or the link to it, is gone?"


def process_alive(pid):
    """True while process `pid` runs (a zombie, ended but not yet reaped, does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return True


def supervisor_pid():
    """The pid of this rank's supervising parent (supervise.py), or None when it has none."""
    value = os.environ.get(PARENT_VAR, "")
    return int(value) if value.isdigit() and int(value) == os.getppid() else None


def notes_fd():
    """The descriptor of the supervising parent's notes file, or None."""
    value = os.environ.get(NOTES_VAR, "")
    return int(value) if value.isdigit() and supervisor_pid() is not None else None


def job_file(rank, kind):
    """`rank<r>.<kind>` in the job folder, or None outside caffepar's launcher."""
    folder = os.environ.get(JOB_DIR_VAR)
    return os.path.join(folder, f"rank{rank}.{kind}") if folder else None


def write_job_file(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def register_rank(comm):
    """Tell the launcher (if caffepar's launcher started this job) which process is this rank;
    from now on the rank cannot end the job unseen (guard_exit)."""
    path = job_file(comm.rank, "pid")
    if path:
        try:
            write_job_file(path, f"{os.getpid()} {socket.gethostname()}\n")
        except OSError:     # a rank on another host, without the launcher's folder
            pass
    guard_exit(comm)


def stuck_file(comm):
    """Where the watchdog's last resort writes the stacks of a rank stuck holding the
    interpreter lock: `rank<r>.stuck` in the job folder (the launcher reports it), else the
    supervising parent's notes (it reports them), else stderr."""
    path = job_file(comm.rank, "stuck")
    if path:
        try:
            return open(path, "w", encoding="utf-8")
        except OSError:
            pass
    notes = notes_fd()
    return notes if notes is not None else sys.stderr


def first_frame(stack):
    """`file.py:12, in name` of the first frame of a stack Python's faulthandler wrote."""
    frame = re.search(r'File "([^"]*)", line (\d+) in (\S+)', stack)
    return f"{os.path.basename(frame.group(1))}:{frame.group(2)}, in {frame.group(3)}" \
        if frame else None


def stuck_line(rank, text):
    """The report line of a rank ended by its watchdog's last resort (stuck holding the
    interpreter lock: Watchdog.backstop), from the stacks it wrote, or None."""
    found = re.match(r"Timeout \((\d+):(\d+):(\d+)", text)
    if not found:
        return None
    h, m, sec = map(int, found.groups())
    where = first_frame(text.rstrip().split("\n\n")[-1])     # the main thread comes last
    return (f"[rank {rank}] caffepar: stuck {3600 * h + 60 * m + sec} s in compiled code "
            f"that holds the interpreter lock{f' ({where})' if where else ''}; ended")


_os_exit = os._exit


def guard_exit(comm):
    """os._exit in this rank (a Python layer ending its process) before the job ends ends the
    job through abort_all: non-zero, in one line naming the rank.

    A rank that just vanishes cannot be reported by the others: MPICH's mpiexec kills them at
    once (SIGKILL, before they can act) and, when the vanished rank's status was 0, exits 0
    itself, so a scheduler would record a failed job as a success. Processes forked by the rank
    (their os._exit ends only them) are left alone."""
    owner = os.getpid()

    def _exit(code):
        if os.getpid() == owner:
            abort_all(comm, f"[rank {comm.rank}] caffepar: exited (os._exit({code})) before "
                      "the job finished", code or 1)
        _os_exit(code)

    os._exit = _exit


def finish_rank(comm):
    """This rank ended normally (stopped early when its process manager or launcher died: the
    job did not end as it should, which its status says)."""
    lost = comm.watchdog.lost() if comm.watchdog is not None else None
    comm.stop_watchdog()
    if lost:
        abort_all(comm, f"[rank {comm.rank}] caffepar: {lost}; stopped", hard=True)
    path = job_file(comm.rank, "end")
    if path:
        try:
            write_job_file(path, "0\n")
        except OSError:
            pass
    os._exit = _os_exit


def abort_all(comm, line, code=1, hard=False):
    """End every rank of the job, with `line` (`[rank r] ...`) as the reason, reported once.

    Under caffepar's launcher the line goes to the job folder and the rank just exits: hydra
    ends the others, quietly, and the launcher prints the line. Under another launcher the line
    goes to stderr, then MPI_Abort (its own banner silenced) ends the job."""
    path = job_file(comm.rank, "end")
    written = False
    if path:
        try:
            write_job_file(path, f"{code}\n{line}\n")
            written = True
        except OSError:
            pass
    if not written:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        wait_forwarded(2)       # stderr: a launcher we did not start forwards it later
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    if not written and not hard:       # hard: no process manager left to abort through
        _silence_output()
        comm.abort(code)
    _os_exit(code)


def wait_forwarded(fd, limit=2.0):
    """Until what was written to `fd` has been taken by the process manager that forwards this
    rank's output (the pipe behind it read empty), at most `limit` seconds, and a moment more
    for it to pass it on; at once where `fd` is no pipe (a file, a terminal)."""
    import array
    import fcntl
    import stat
    import termios
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except OSError:
        return
    waiting = array.array("i", [0])
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, waiting, True)
        except OSError:
            break
        if not waiting[0]:
            break
        time.sleep(0.01)
    time.sleep(0.1)


def _silence_output():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    except OSError:
        pass
