"""Starting a P-rank job (`--np P` re-runs the command under the mpiexec installed with
caffepar), watching it from the launcher, and ending every rank when one fails.

The launcher stays the job's one front: the signals it gets (from a terminal's Ctrl-C, `kill`, or
a signal to its whole process group) go to every rank, which acts as one process does
(`--sigint_effect` / `--sighup_effect`, SIGTERM snapshot and stop). mpiexec runs in a session
of its own, so group signals never reach it: hydra's mpiexec force-kills the job on a second
SIGINT and dies of SIGHUP. If the launcher itself is killed, even by SIGKILL, the kernel sends
mpiexec SIGTERM (Linux's parent-death signal), which it forwards to the ranks: they snapshot and
stop; each rank also checks that the launcher is alive (the same request where there is no
parent-death signal). Ranks note in a job folder their pid and how they ended; the launcher
prints each failure once, as one line naming the rank, and names a rank that ended without a
word (killed, or exited on its own). The launcher, not hydra, ends the other ranks after a
failure, once it has seen which rank ended first.
"""
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from caffepar._threads import threads_per_rank
from caffepar.parallel.comm import MPI_FAILED

#: Set by `relaunch` for the ranks: the job folder, and the launcher's pid.
JOB_DIR_VAR = "CAFFEPAR_JOB_DIR"
LAUNCHER_VAR = "CAFFEPAR_LAUNCHER_PID"

FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                  if hasattr(signal, name))


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


#: A job folder's name: the prefix, the launcher's pid, a dash and a random part.
JOB_PREFIX = "caffepar-job-"


def remove_stale_job_folders(where=None):
    """Job folders whose launcher is gone (killed by SIGKILL, it could not remove its own);
    a folder named without a pid goes when none of the ranks it lists runs and it is an hour
    old."""
    where = where or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(where) if n.startswith(JOB_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        found = re.fullmatch(re.escape(JOB_PREFIX) + r"(\d+)-.*", name)
        try:
            if found:
                stale = not process_alive(int(found.group(1)))
            else:
                stale = time.time() - os.path.getmtime(path) > 3600 and not any(
                    process_alive(pid) for pid in _listed_pids(path))
        except OSError:
            continue
        if stale and os.stat(path).st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _listed_pids(folder):
    pids = []
    for name in os.listdir(folder):
        if re.fullmatch(r"rank\d+\.pid", name):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    pids.append(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
    return pids


def relaunch(ranks, argv, threads=None, mpiexec=None, transport=None):
    """Run `caffepar <argv>` under mpiexec with `ranks` processes; return the exit status
    a one-process run would have had. `transport` (default $CAFFEPAR_TRANSPORT, else shm) as
    in TRANSPORTS."""
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
    remove_stale_job_folders()
    folder = tempfile.mkdtemp(prefix=f"{JOB_PREFIX}{os.getpid()}-")
    env[JOB_DIR_VAR] = folder
    env[LAUNCHER_VAR] = str(os.getpid())
    cmd = [exe] + _own_cleanup(exe) + _other_mpi(exe, ranks) + [
        "-n", str(ranks), sys.executable, "-m", "caffepar.cli"] + list(argv)
    try:
        status = Job(cmd, env, folder, ranks).run()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if status < 0:      # the ranks died of the signal the launcher got: so does the launcher
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status
    return status


def _own_cleanup(exe):
    """Options that leave ending the ranks after a failure to the launcher: hydra's mpiexec
    kills the other ranks the moment one ends badly, often before the launcher has seen which
    one ended first (it would then blame a rank that did nothing wrong)."""
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return ["-disable-auto-cleanup"] if "HYDRA" in version else []


def _other_mpi(exe, ranks):
    """Options for an mpiexec that is not hydra (Open MPI's mpirun: root, more ranks than
    cores); refuses, in one line, an mpiexec of another MPI than the one mpi4py runs on."""
    from caffepar.errors import CaffeparError
    from caffepar.parallel import mpilib
    wrong = mpilib.check_launcher(exe)
    if wrong:
        raise CaffeparError(wrong)
    return mpilib.open_mpi_options(ranks) if mpilib.is_open_mpi_launcher(exe) else []


class Job:
    """mpiexec and its ranks, seen from the launcher."""

    POLL, STARTING = 0.25, 0.02
    """Seconds between looks at the job folder for ranks that have started (until all have)."""

    def __init__(self, cmd, env, folder, size):
        self.cmd, self.env, self.folder, self.size = cmd, env, folder, size
        self.host = socket.gethostname()
        self.registered = set()  # ranks that have written their pid
        self.pids = {}          # rank -> pid, for the ranks on this host
        self.pidfds = {}        # pidfd -> rank (None: mpiexec)
        self.gone = []          # ranks in the order they were seen to end
        self.received = []      # signals the launcher got
        self.poller = select.poll() if hasattr(os, "pidfd_open") else None
        self.proc = None
        self.ending = False      # a rank failed: the others are being ended

    # ---- running
    def run(self):
        from caffepar import _signals
        noted = _signals.take()     # signals that came while the launcher started
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        self.received += noted
        try:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=_parent_death_signal())
            self._watch(None, self.proc.pid)
            while self.proc.poll() is None:
                self._register()
                self._wait()
                self._end_after_failure()
            self._register()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._end_leftovers()
        return self._report()

    def _forward(self, signum, frame):
        self.received.append(signum)
        for rank, pid in self.pids.items():
            if rank not in self.gone:
                _signal(pid, signum)

    def _watch(self, rank, pid):
        if self.poller is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            if rank is not None:
                self.gone.append(rank)
            return
        except OSError:     # an old kernel: look at the ranks every POLL seconds instead
            self.poller = None
            return
        self.pidfds[fd] = rank
        self.poller.register(fd, select.POLLIN)

    def _register(self):
        """Ranks that wrote their pid since the last look: watched, and sent the signals the
        launcher got before they could take them."""
        if len(self.registered) == self.size:
            return
        for name in os.listdir(self.folder):
            found = re.fullmatch(r"rank(\d+)\.pid", name)
            if not found or int(found.group(1)) in self.registered:
                continue
            rank = int(found.group(1))
            try:
                with open(os.path.join(self.folder, name), encoding="utf-8") as f:
                    pid, host = f.read().split()
            except (OSError, ValueError):
                continue
            self.registered.add(rank)
            if host != self.host:
                continue
            self.pids[rank] = int(pid)
            self._watch(rank, int(pid))
            for sig in self.received:
                _signal(int(pid), sig)

    def _wait(self):
        """Until a rank or mpiexec ends, a signal comes, or POLL seconds pass."""
        timeout = self.POLL if len(self.registered) == self.size else self.STARTING
        if self.poller is None:
            time.sleep(timeout)
            for rank, pid in self.pids.items():
                if rank not in self.gone and not process_alive(pid):
                    self.gone.append(rank)
            return
        for fd, _event in self.poller.poll(timeout * 1000):
            rank = self.pidfds.pop(fd, None)
            self.poller.unregister(fd)
            os.close(fd)
            if rank is not None:
                self.gone.append(rank)

    def _end_after_failure(self):
        """A rank that ended without finishing (no end record, or a failure's): the others
        cannot go on, and are ended (SIGKILL, as hydra's own clean-up), now that the launcher
        knows which rank ended first."""
        if self.ending or not self.gone:
            return
        ends = self._ends()
        if all(ends.get(r, (1, ""))[0] == 0 for r in self.gone):
            return
        self.ending = True
        for rank, pid in self.pids.items():
            if rank not in self.gone:
                _signal(pid, signal.SIGKILL)

    def _end_leftovers(self):
        """Ranks still running once mpiexec has ended (a process manager killed under them):
        a moment to end on their own, then SIGKILL."""
        if self.poller is not None:         # ranks that ended as mpiexec did: noted first
            for fd, _event in self.poller.poll(0):
                rank = self.pidfds.pop(fd, None)
                os.close(fd)
                if rank is not None:
                    self.gone.append(rank)
        for fd in list(self.pidfds):
            os.close(fd)
        self.pidfds.clear()
        left = [r for r, pid in self.pids.items() if r not in self.gone and process_alive(pid)]
        deadline = time.monotonic() + 2.0
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [r for r in left if process_alive(self.pids[r])]
        for rank in left:
            _signal(self.pids[rank], signal.SIGKILL)
            self.gone.append(rank)

    # ---- the outcome
    def _ends(self):
        """{rank: (exit status, report line)} from the ranks' end records."""
        ends = {}
        for name in os.listdir(self.folder):
            found = re.fullmatch(r"rank(\d+)\.end", name)
            if found:
                with open(os.path.join(self.folder, name), encoding="utf-8",
                          errors="replace") as f:
                    code, _, line = f.read().partition("\n")
                ends[int(found.group(1))] = (int(code), line.strip())
        return ends

    def _report(self):
        status = self.proc.returncode
        ends = self._ends()
        failed = [(r, code, line) for r, (code, line) in sorted(ends.items()) if code]
        first = self.gone[0] if self.gone else None
        if failed and first is not None and first not in ends:
            failed = []     # the others' errors follow from the rank that vanished first
        if any(r not in ends for r in range(self.size)):    # and an MPI failure, from any
            failed = [f for f in failed if MPI_FAILED not in f[2]]
        if failed:
            _say(merge_rank_lines([line for _r, _c, line in failed]))
            return failed[0][1]
        missing = [r for r in range(self.size) if r not in ends]
        if not missing:
            return status
        if self.received and status == self.received[-1]:
            return -status      # hydra's status for ranks killed by that signal
        if status < 0:
            _say([f"caffepar: mpiexec (the process manager) was ended by "
                  f"{signal.Signals(-status).name}; ranks {_ranks(missing)} did not finish"])
            return 1
        stuck = [line for line in map(self._stuck, missing) if line]
        if stuck:
            _say(merge_rank_lines(stuck))
            return 1
        first = [r for r in self.gone if r in missing][:1] or missing
        label = f"[rank {first[0]}]" if len(first) == 1 else f"[ranks {_ranks(first)}]"
        _say([f"{label} caffepar: ended before the job finished, without an error message "
              f"(killed by a signal, or exited on its own); mpiexec's exit status {status}"])
        return 1

    def _stuck(self, rank):
        """The report line of a rank ended by its watchdog's last resort (stuck holding the
        interpreter lock; Watchdog.backstop), from the stacks it wrote, or None."""
        try:
            with open(os.path.join(self.folder, f"rank{rank}.stuck"), encoding="utf-8",
                      errors="replace") as f:
                text = f.read()
        except OSError:
            return None
        found = re.match(r"Timeout \((\d+):(\d+):(\d+)", text)
        if not found:
            return None
        h, m, sec = map(int, found.groups())
        main = text.rstrip().split("\n\n")[-1]       # the main thread's stack comes last
        frame = re.search(r'File "([^"]*)", line (\d+) in (\S+)', main)
        where = f" ({os.path.basename(frame.group(1))}:{frame.group(2)}, in {frame.group(3)})" \
            if frame else ""
        return (f"[rank {rank}] caffepar: stuck {3600 * h + 60 * m + sec} s in compiled code "
                f"that holds the interpreter lock{where}; ended")


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


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


def _ranks(ranks):
    return ", ".join(str(r) for r in ranks)


def _say(lines):
    for line in lines:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def merge_rank_lines(lines):
    """Report lines, each once: `[rank 0] X` and `[rank 1] X` become `[ranks 0, 1] X`."""
    order, ranks = [], {}
    for line in lines:
        found = re.fullmatch(r"\[rank (\d+)\] (.*)", line, re.S)
        text = found.group(2) if found else line
        if text not in ranks:
            order.append(text)
            ranks[text] = []
        if found and int(found.group(1)) not in ranks[text]:
            ranks[text].append(int(found.group(1)))
    out = []
    for text in order:
        rs = sorted(ranks[text])
        label = "" if not rs else f"[rank {rs[0]}] " if len(rs) == 1 else f"[ranks {_ranks(rs)}] "
        out.append(label + text)
    return out


def _parent_death_signal():
    """A preexec_fn that has the kernel send mpiexec SIGTERM when the launcher dies (Linux's
    PR_SET_PDEATHSIG), or None where there is no such thing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def set_signal():
        prctl(1, int(signal.SIGTERM), 0, 0, 0)     # 1 = PR_SET_PDEATHSIG
        if os.getppid() != launcher:                # the launcher died before prctl
            os._exit(1)

    return set_signal


# ------------------------------------------------------------------------ the ranks' side
def _job_file(comm, kind):
    folder = os.environ.get(JOB_DIR_VAR)
    return os.path.join(folder, f"rank{comm.rank}.{kind}") if folder else None


def _write_job_file(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def register_rank(comm):
    """Tell the launcher (if caffepar's launcher started this job) which process is this rank;
    from now on the rank cannot end the job unseen (guard_exit)."""
    path = _job_file(comm, "pid")
    if path:
        try:
            _write_job_file(path, f"{os.getpid()} {socket.gethostname()}\n")
        except OSError:     # a rank on another host, without the launcher's folder
            pass
    guard_exit(comm)


def stuck_file(comm):
    """Where the watchdog's last resort writes the stacks of a rank stuck holding the
    interpreter lock: `rank<r>.stuck` in the job folder (the launcher reports it), else stderr."""
    path = _job_file(comm, "stuck")
    if path:
        try:
            return open(path, "w", encoding="utf-8")
        except OSError:
            pass
    return sys.stderr


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
    lost = comm.watchdog.orphaned if comm.watchdog is not None else None
    comm.stop_watchdog()
    if lost:
        abort_all(comm, f"[rank {comm.rank}] caffepar: {lost}; stopped", hard=True)
    path = _job_file(comm, "end")
    if path:
        try:
            _write_job_file(path, "0\n")
        except OSError:
            pass
    os._exit = _os_exit


def abort_all(comm, line, code=1, hard=False):
    """End every rank of the job, with `line` (`[rank r] ...`) as the reason, reported once.

    Under caffepar's launcher the line goes to the job folder and the rank just exits: hydra
    ends the others, quietly, and the launcher prints the line. Under another launcher the line
    goes to stderr, then MPI_Abort (its own banner silenced) ends the job."""
    path = _job_file(comm, "end")
    written = False
    if path:
        try:
            _write_job_file(path, f"{code}\n{line}\n")
            written = True
        except OSError:
            pass
    if not written:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        time.sleep(0.5)     # a launcher we did not start forwards output asynchronously
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    if not written and not hard:       # hard: no process manager left to abort through
        _silence_output()
        comm.abort(code)
    _os_exit(code)


def _silence_output():
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    except OSError:
        pass
