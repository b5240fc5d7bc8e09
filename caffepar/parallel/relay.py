"""Carries a job's output from mpiexec to the launcher's stdout and stderr, without the
process manager's own lines, and removes the job folder if the launcher dies before the job.

    python relay.py OUT_FD ERR_FD JOB_FOLDER LAUNCHER_PID

Run by caffepar's launcher as a script of its own (standard library only, no caffepar import),
in a session of its own: a signal to the launcher's process group, or the launcher killed
(`timeout -k`, a scheduler's SIGKILL), leaves it relaying until the last process writing to the
pipes (mpiexec, its proxies, the ranks) has ended. The ranks' lines pass unchanged, as they
come; what the process manager prints about the job's end (the launcher reports that in one
line) is dropped: hydra's `[proxy:0@host] ...` and `[mpiexec@host] ...` diagnostics and its
"BAD TERMINATION" / "YOUR APPLICATION TERMINATED WITH THE EXIT STRING" banner.
"""
import os
import re
import select
import shutil
import signal
import sys

#: Lines of the process manager's, never a rank's.
RAW_LINES = re.compile(
    rb"^\[(proxy|mpiexec)[:@][^\]]*\]"           # hydra's diagnostics: [proxy:0@vm] ...
    rb"|^=+$|^=   "                              # hydra's BAD TERMINATION banner
    rb"|^YOUR APPLICATION TERMINATED WITH THE EXIT STRING: "
    rb"|^This typically refers to a problem with your application\.$"
    rb"|^Please see the FAQ page for debugging suggestions$")
#: A part of a line held back this long for its end before it is written as it is.
PARTIAL = 0.2
#: Job folders removed when the launcher is gone: only those named so.
JOB_PREFIX = "caffepar-job-"


class Stream:
    """One pipe's lines to one descriptor. Blank lines are held until the next line, so that
    the blank lines hydra prints before its banner go with it."""

    def __init__(self, fd_in, fd_out):
        self.fd_in, self.fd_out = fd_in, fd_out
        self.pending = b""
        self.blank = b""
        self.dropped = 0

    def feed(self, data):
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self._line(line + b"\n")

    def flush_partial(self, final=False):
        """The unfinished line so far (a progress line, or the stream's end), unless it begins
        as a process manager's line would."""
        if self.pending and not RAW_LINES.match(self.pending):
            self._write(self.blank + self.pending)
            self.blank = self.pending = b""
        if final:
            self.pending = b""
            self._write(self.blank)
            self.blank = b""

    def _line(self, line):
        if not line.strip():
            self.blank += line
        elif RAW_LINES.match(line.rstrip(b"\r\n")):
            self.blank = b""
            self.dropped += 1
        else:
            self._write(self.blank + line)
            self.blank = b""

    def _write(self, data):
        while data:
            try:
                data = data[os.write(self.fd_out, data):]
            except InterruptedError:
                continue
            except OSError:         # the reader went away: keep draining the pipe
                return


def relay(streams):
    """Until every stream's writers have all closed it."""
    open_ = {s.fd_in: s for s in streams}
    while open_:
        partial = any(s.pending for s in open_.values())
        ready, _, _ = select.select(list(open_), [], [], PARTIAL if partial else None)
        if not ready:
            for s in open_.values():
                s.flush_partial()
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if data:
                open_[fd].feed(data)
            else:
                open_.pop(fd).flush_partial(final=True)


def main(argv):
    out_fd, err_fd, folder, launcher = int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    relay([Stream(out_fd, 1), Stream(err_fd, 2)])
    if os.getppid() != launcher and os.path.basename(folder).startswith(JOB_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)       # the launcher could not
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
