"""Starting a P-rank job (`--np P` re-runs the command under the mpiexec installed with
caffepar), watching it from the launcher, and ending every rank when one fails.

The launcher stays the job's one front: the signals it gets (from a terminal's Ctrl-C, `kill`, or
a signal to its whole process group) go to every rank, which acts as one process does
(`--sigint_effect` / `--sighup_effect`, SIGTERM snapshot and stop). mpiexec runs in a session
of its own, so group signals never reach it: hydra's mpiexec force-kills the job on a second
SIGINT and dies of SIGHUP. If the launcher itself is killed, even by SIGKILL, the kernel sends
mpiexec SIGTERM (Linux's parent-death signal), which it forwards to the ranks: they snapshot and
stop; each rank also checks that the launcher is alive (the same request where there is no
parent-death signal). Ranks note in a job folder their pid and how they ended (a rank killed
by a signal: its supervising parent, supervise.py); the launcher prints each failure once, as
one line naming the rank. The launcher, not hydra, ends the other ranks after a failure, once it
has seen which rank ended first. After SIGTERM (a scheduler's time limit) the job ends within
STOP_LIMIT seconds, before the usual SIGKILL that follows it (`timeout -k 10`, docker stop,
Slurm's KillWait). mpiexec's output reaches the launcher's stdout and stderr through a relay
(relay.py) that drops the process manager's own lines and outlives a killed launcher.
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
from caffepar.parallel.ranks import (JOB_DIR_VAR, LAUNCHER_VAR, MPI_FAILED, process_alive,
                                     stuck_line)
from caffepar.parallel.relay import JOB_PREFIX

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


def job_folder():
    """A new job folder: named by the prefix, the launcher's pid, a dash and a random part (so
    that the next launch can tell a killed launcher's folder from a running one's)."""
    remove_stale_job_folders()
    return tempfile.mkdtemp(prefix=f"{JOB_PREFIX}{os.getpid()}-")


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
    folder = job_folder()
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
    STOP_LIMIT = 8.0
    """Seconds the ranks have to end after SIGTERM before the launcher ends them."""
    RELAY_WAIT = 3.0
    """Seconds the relay may take to pass on the job's last output once mpiexec has ended."""
    LEFTOVER_GRACE = 6.0
    """Seconds ranks that outlive mpiexec get to end on their own: each notices a lost process
    manager within its watchdog's second, then snapshots and writes its end record."""
    FAILURE_GRACE = 1.0
    """Seconds the other ranks get to end on their own once one has failed with a reason: they
    often meet the same error (a file every rank reads), and each is named. None after a
    SIGTERM, whose time is short."""

    def __init__(self, cmd, env, folder, size):
        self.cmd, self.env, self.folder, self.size = cmd, env, folder, size
        self.host = socket.gethostname()
        self.registered = set()  # ranks that have written their pid
        self.pids = {}          # rank -> pid, for the ranks on this host
        self.ended = set()      # ranks the launcher ended
        self.pidfds = {}        # pidfd -> rank (None: mpiexec)
        self.gone = []          # ranks in the order they were seen to end
        self.received = []      # signals the launcher got
        self.poller = select.poll() if hasattr(os, "pidfd_open") else None
        self.proc = None
        self.relay = None
        self.failed_since = None     # when a rank was first seen to fail
        self.ending = False      # a rank failed: the others are being ended
        self.stop_by = None      # SIGTERM came: when the job must have ended
        self.cut = False         # ... and it had not: the launcher ended it

    # ---- running
    def run(self):
        from caffepar import _signals
        noted = _signals.take()     # signals that came while the launcher started
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        for sig in noted:
            self._note(sig)
        try:
            out, err = self._start_relay()
            try:
                self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=err, start_new_session=True,
                                             preexec_fn=_parent_death_signal())
            finally:
                for fd in (out, err):
                    if fd is not None:
                        os.close(fd)
            self._watch(None, self.proc.pid)
            while self.proc.poll() is None:
                self._register()
                self._wait()
                self._end_after_failure()
                self._end_when_overdue()
            self._register()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._end_leftovers()
        self._wait_for_relay()
        return self._report()

    def _start_relay(self):
        """Pipes for mpiexec's stdout and stderr, read by the relay (relay.py); (None, None),
        mpiexec's output left as it is, when it cannot start."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py")
        try:
            self.relay = subprocess.Popen(
                [sys.executable, "-I", "-S", script, str(out_r), str(err_r), self.folder,
                 str(os.getpid())], pass_fds=(out_r, err_r), stdin=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            return None, None
        os.close(out_r)
        os.close(err_r)
        return out_w, err_w

    def _forward(self, signum, frame):
        self._note(signum)
        for rank, pid in self.pids.items():
            if rank not in self.gone:
                _signal(pid, signum)

    def _note(self, signum):
        self.received.append(signum)
        if signum == signal.SIGTERM and self.stop_by is None:
            self.stop_by = time.monotonic() + self.STOP_LIMIT

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
        for until in (self.stop_by, None if self.failed_since is None or self.ending
                      else self.failed_since + self.FAILURE_GRACE):
            if until is not None:
                timeout = max(0.0, min(timeout, until - time.monotonic()))
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

    def _end_rank(self, rank):
        """SIGKILL to a rank on this host (what its supervising parent then reports of it is
        not the job's story)."""
        self.ended.add(rank)
        _signal(self.pids[rank], signal.SIGKILL)

    def _end_after_failure(self):
        """A rank that ended without finishing (no end record, or a failure's): the others
        cannot go on, and are ended (SIGKILL, as hydra's own clean-up), now that the launcher
        knows which rank ended first; after FAILURE_GRACE, unless it vanished without a
        word."""
        if self.ending or not self.gone:
            return
        ends = self._ends()
        failed = [r for r in self.gone if ends.get(r, (1, ""))[0] != 0]
        if not failed:
            return
        if self.failed_since is None:
            self.failed_since = time.monotonic()
        alive = [r for r in self.pids if r not in self.gone]
        if alive and failed[0] in ends and self.stop_by is None and \
                time.monotonic() - self.failed_since < self.FAILURE_GRACE:
            return      # (after SIGTERM time is short: no grace)
        self.ending = True
        for rank in alive:
            self._end_rank(rank)

    def _end_when_overdue(self):
        """SIGTERM came STOP_LIMIT seconds ago and the job still runs (a rank blocked where it
        cannot stop, or stopping slowly): the launcher ends every rank and mpiexec, and reports
        it, rather than leave that to the SIGKILL a scheduler sends after its grace."""
        if self.stop_by is None or self.cut or time.monotonic() < self.stop_by:
            return
        self.cut = True
        for rank in self.pids:
            if rank not in self.gone:
                self._end_rank(rank)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # mpiexec and its proxies
        except (ProcessLookupError, PermissionError):
            pass

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
        deadline = time.monotonic() + (0.0 if self.cut else self.LEFTOVER_GRACE)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [r for r in left if process_alive(self.pids[r])]
        for rank in left:
            self._end_rank(rank)
            self.gone.append(rank)

    def _wait_for_relay(self):
        """The job's last output passed on before the launcher's report. A process left
        holding the pipes keeps the relay going on its own."""
        if self.relay is not None:
            try:
                self.relay.wait(self.RELAY_WAIT)
            except subprocess.TimeoutExpired:
                pass

    # ---- the outcome
    def _ends(self, kind="end"):
        """{rank: (exit status, report line)} from the ranks' end records (`killed`: those
        their supervising parents wrote of ranks killed by a signal)."""
        ends = {}
        for name in os.listdir(self.folder):
            found = re.fullmatch(rf"rank(\d+)\.{kind}", name)
            if found:
                with open(os.path.join(self.folder, name), encoding="utf-8",
                          errors="replace") as f:
                    code, _, line = f.read().partition("\n")
                ends[int(found.group(1))] = (int(code), line.strip())
        return ends

    def _all_ends(self):
        """The end records, with a rank killed by a signal counted for the first rank seen to
        end (or any, where the launcher sees no rank: other hosts) but never for a rank the
        launcher ended, nor one killed after the first (by its process manager's clean-up)."""
        ends = self._ends()
        first = self.gone[0] if self.gone else None
        for rank, record in self._ends("killed").items():
            if rank not in ends and rank not in self.ended and first in (None, rank):
                ends[rank] = record
        return ends

    def _report(self):
        status = self.proc.returncode
        ends = self._all_ends()
        failed = [(r, code, line) for r, (code, line) in sorted(ends.items()) if code]
        first = self.gone[0] if self.gone else None
        if failed and first is not None and first not in ends:
            failed = []     # the others' errors follow from the rank that vanished first
        missing = [r for r in range(self.size) if r not in ends]
        if missing or any(MPI_FAILED not in f[2] for f in failed):
            failed = [f for f in failed if MPI_FAILED not in f[2]]  # a consequence
        if failed:
            _say(merge_rank_lines([line for _r, _c, line in failed]))
            return next((code for r, code, _l in failed if r == first), failed[0][1])
        if not missing:
            return status
        if self.cut:
            _say([f"caffepar: SIGTERM received; {_label(missing)} had not stopped "
                  f"{self.STOP_LIMIT:g} s later (blocked in a layer or a collective?); "
                  "ended the job"])
            return 1
        if self.received and status == self.received[-1]:
            return -status      # hydra's status for ranks killed by that signal
        if status < 0:
            _say([f"caffepar: mpiexec (the process manager) was ended by "
                  f"{signal.Signals(-status).name}; {_label(missing)} did not finish"])
            return 1
        stuck = [line for line in map(self._stuck, missing) if line]
        if stuck:
            _say(merge_rank_lines(stuck))
            return 1
        first = [r for r in self.gone if r in missing][:1] or missing
        _say([f"[{_label(first)}] caffepar: ended before the job finished, without an error "
              "message (killed, or exited on its own)"])
        return 1

    def _stuck(self, rank):
        """The report line of a rank ended by its watchdog's last resort, from the stacks it
        wrote in the job folder, or None."""
        try:
            with open(os.path.join(self.folder, f"rank{rank}.stuck"), encoding="utf-8",
                      errors="replace") as f:
                return stuck_line(rank, f.read())
        except OSError:
            return None


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _ranks(ranks):
    return ", ".join(str(r) for r in ranks)


def _label(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


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
