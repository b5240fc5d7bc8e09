"""Signals that reach the `caffepar` command before it can act on them.

Importing caffepar, NumPy and MPI takes about a second. A Ctrl-C in that time would end the
process with a KeyboardInterrupt traceback; a SIGTERM or SIGHUP would kill it without a word (or
reach the MPI library's transport, which takes SIGHUP as its own debug signal). So while the
command starts, SIGINT, SIGTERM and SIGHUP are only noted. The part of the command that acts on
signals takes the noted ones over (`take`: the solver's signal actions, the `--np` launcher,
which forwards them to the ranks); a command without such a part gets them back at its start
(`release`), which stops it in one line. A second SIGINT while signals are held interrupts at
once (a start that takes long, e.g. a huge net, can still be cut short).

Held only when the process is the command (not when a program imports caffepar)."""
import os
import signal
import sys

HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
             if hasattr(signal, name))

_noted = None       # the signals noted while held, or None when not holding
_previous = {}
_interruptible = False      # the command's main has started: it reports a KeyboardInterrupt


class StartSignal(Exception):
    """A signal that stopped the command while it started."""

    def __init__(self, signum):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"caffepar: {name} received while starting; stopped")


def is_command():
    """True in the `caffepar` command (its console script, or `python -m caffepar.cli` as the
    ranks of a job run it)."""
    argv = getattr(sys, "orig_argv", None) or sys.argv
    if os.path.basename(sys.argv[0] or "") == "caffepar":
        return True
    return any(a == "-m" and b == "caffepar.cli" for a, b in zip(argv, argv[1:]))


def hold():
    """Note SIGINT, SIGTERM and SIGHUP from now on instead of acting on them."""
    global _noted
    if _noted is not None or not is_command():
        return
    try:
        for sig in HELD:
            _previous[sig] = signal.signal(sig, _note)
    except ValueError:          # not the main thread
        _restore()
        return
    _noted = []


def interruptible():
    """From now on a second SIGINT interrupts (the command reports it in one line)."""
    global _interruptible
    _interruptible = True


def _note(signum, frame):
    if signum == signal.SIGINT and signal.SIGINT in _noted and _interruptible:
        take()
        raise KeyboardInterrupt
    _noted.append(signum)


def _restore():
    for sig, handler in _previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    _previous.clear()


def take():
    """The signals noted so far (in order), and the handlers of before back: the caller installs
    its own and acts on these."""
    global _noted
    noted, _noted = _noted or [], None
    _restore()
    return noted


def holding():
    return _noted is not None


def release():
    """Stop holding; a signal noted meanwhile stops the command (StartSignal, or
    KeyboardInterrupt for SIGINT)."""
    noted = take()
    if not noted:
        return
    if noted[0] == signal.SIGINT:
        raise KeyboardInterrupt
    raise StartSignal(noted[0])
