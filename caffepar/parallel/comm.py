"""Communicators: the collectives the parallel plan needs, timed and byte-counted per layer.

`LocalComm` is the one-rank group: every collective is the identity, so parallel code runs in an
ordinary process (and in tests) unchanged. `MpiComm` runs the same calls over mpi4py with
buffer (uppercase) methods on contiguous NumPy arrays.

Non-blocking collectives (`i...`) return a request with `test()` and `wait()`; they are not
timed here, their caller knows when it started and when it saw them complete. A timeline set
on a communicator (`comm.timeline`) records every blocking collective.
"""
import contextlib
import faulthandler
import os
import signal
import socket
import time
from collections import defaultdict, deque

import numpy as np


class CommStats:
    """Seconds, bytes and calls per (layer, operation); `take()` returns and resets them."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.table = defaultdict(lambda: [0.0, 0, 0])

    def add(self, key, seconds, nbytes):
        row = self.table[key]
        row[0] += seconds
        row[1] += nbytes
        row[2] += 1

    def total_seconds(self):
        return sum(r[0] for r in self.table.values())

    def total_bytes(self):
        return sum(r[1] for r in self.table.values())

    def take(self):
        out = {k: tuple(v) for k, v in self.table.items()}
        self.reset()
        return out


class Done:
    """A request that completed when it was posted (one-rank groups)."""

    def test(self):
        return True

    def wait(self):
        pass


#: A waiting rank tests its request in a tight loop this long, then between naps of NAP_SHARE
#: of the time waited so far, at most NAP seconds (a wait's end is seen that much later).
SPIN, NAP_SHARE, NAP = 1e-3, 0.05, 5e-3


def complete(request):
    """Wait for an MPI request without spinning: MPICH's own waits poll at full speed, a whole
    core for each rank that waits on a slow or hung one."""
    if request.Test():
        return
    t0 = time.monotonic()
    while not request.Test():
        waited = time.monotonic() - t0
        if waited > SPIN:
            time.sleep(min(NAP, NAP_SHARE * waited))


class _Request:
    def __init__(self, request):
        self.request = request

    def test(self):
        return self.request.Test()

    def wait(self):
        complete(self.request)


def _displacements(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


class Comm:
    """Interface shared by LocalComm and MpiComm. `tag` names the layer a call is made for."""

    rank = 0
    size = 1
    timeline = None

    def __init__(self):
        self.stats = CommStats()
        self.calls = 0
        self.waiting = None
        self.watchdog = None
        self.busy_with = None       # a long step this rank takes alone (a snapshot)
        self.warm = False           # past the first iteration (engine measurement, first test)
        self.longest_gap = 0.0      # longest time between two collectives since warm
        self.stop_since = None      # when this rank was asked to stop (SIGTERM, SIGINT)
        self.stop_reason = ""
        self._left = None
        self.stragglers = Stragglers()

    def _timed(self, tag, op, nbytes, fn):
        t0 = time.perf_counter()
        result = self._watched(tag, op, fn)
        t1 = time.perf_counter()
        self.stats.add((tag, op), t1 - t0, nbytes)
        self.stragglers.note((tag, op), t1 - t0)
        if self.timeline is not None:
            self.timeline.collective(f"{op} {tag}", t0, t1, {"bytes": nbytes})
        return result

    def _watched(self, tag, op, fn):
        """Run one collective, noting for the watchdog which one this rank waits in and how
        long it computes between collectives."""
        now = time.monotonic()
        if self.warm and self._left is not None:
            self.longest_gap = max(self.longest_gap, now - self._left)
        self.calls += 1
        self.waiting = (self.calls, op, tag, now)
        try:
            return fn()
        finally:
            self.waiting = None
            self._left = time.monotonic()

    @contextlib.contextmanager
    def busy(self, what):
        """A step this rank takes alone while the others wait (its watchdog tells them)."""
        self.busy_with = what
        if self.watchdog is not None:
            self.watchdog.backstop()        # the step may hold the interpreter lock
        try:
            yield
        finally:
            self.busy_with = None
            self._left = time.monotonic()

    def note_stop(self, reason="asked to stop"):
        if self.stop_since is None:
            self.stop_since = time.monotonic()
            self.stop_reason = reason

    def start_watchdog(self, timeout=None):
        """See Watchdog; nothing to watch with one rank."""

    def stop_watchdog(self):
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    # Non-blocking collectives, sums in place; one rank: nothing to do.
    def iallreduce_sum(self, buf):
        return Done()

    def ireduce_scatter_sum(self, send, recv, counts):
        """Rank r receives the sum over ranks of send's block r (block sizes `counts`)."""
        recv[...] = send.reshape(-1)[:recv.size]
        return Done()

    def iallgatherv_inplace(self, buf, counts):
        """Every rank's block (at its displacement in buf) reaches every rank."""
        return Done()

    def iallgather(self, send, recv):
        recv[...] = send.reshape(recv.shape)
        return Done()

    def iallgatherv(self, send, recv, counts):
        recv[...] = send.reshape(recv.shape)
        return Done()

    # Sub-groups
    def dup(self):
        return self

    def split(self, color, key=0):
        return self

    def node_groups(self, ranks_per_node=None):
        """(ranks of my node, my peers of the same local rank on the other nodes)."""
        return self, self

    def gather_object(self, obj, root=0):
        return [obj]

    # Collectives (overridden by MpiComm). All work in place where the name says so.
    def allreduce_sum(self, buf, tag=""):
        return buf

    def allgather(self, send, recv, tag=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def alltoallv(self, send, send_counts, recv, recv_counts, tag=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def reduce_scatter_block(self, send, recv, tag=""):
        recv[...] = send.reshape(recv.shape)
        return recv

    def bcast(self, buf, root=0, tag=""):
        return buf

    def bcast_object(self, obj, root=0):
        return obj

    def allreduce_scalar(self, value, op="sum"):
        return value

    def allreduce_max(self, values):
        """Each of a few integers' largest value over the ranks."""
        return [int(v) for v in values]

    def gatherv(self, send, recv, counts, root=0, tag=""):
        if recv is not None:
            recv[...] = send.reshape(recv.shape)
        return recv

    def barrier(self):
        pass

    def abort(self, code=1):
        os._exit(code)


class LocalComm(Comm):
    """One rank: every collective is the identity."""


class MpiComm(Comm):
    """Collectives over an mpi4py communicator (COMM_WORLD by default)."""

    def __init__(self, comm=None):
        super().__init__()
        # UCX, MPICH's transport, takes SIGHUP as its signal to log at debug level (hundreds
        # of lines at exit) unless told not to: SIGHUP is Caffe's snapshot request.
        os.environ.setdefault("UCX_DEBUG_SIGNO", "0")
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def allreduce_sum(self, buf, tag=""):
        if self.size == 1 or buf.size == 0:
            return buf
        self._timed(tag, "allreduce", buf.nbytes,
                    lambda: complete(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)))
        return buf

    def allgather(self, send, recv, tag=""):
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return recv
        self._timed(tag, "allgather", recv.nbytes, lambda: complete(self.comm.Iallgather(send, recv)))
        return recv

    def alltoallv(self, send, send_counts, recv, recv_counts, tag=""):
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return recv
        send_displ = _displacements(send_counts)
        recv_displ = _displacements(recv_counts)
        mpi_type = self.MPI._typedict[send.dtype.char]
        self._timed(tag, "alltoall", send.nbytes, lambda: complete(self.comm.Ialltoallv(
            [send, (list(send_counts), list(send_displ)), mpi_type],
            [recv, (list(recv_counts), list(recv_displ)), mpi_type])))
        return recv

    def reduce_scatter_block(self, send, recv, tag=""):
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return recv
        self._timed(tag, "reduce_scatter", send.nbytes,
                    lambda: complete(self.comm.Ireduce_scatter_block(send, recv,
                                                                       op=self.MPI.SUM)))
        return recv

    def bcast(self, buf, root=0, tag=""):
        if self.size == 1:
            return buf
        self._timed(tag, "bcast", buf.nbytes, lambda: complete(self.comm.Ibcast(buf, root=root)))
        return buf

    def bcast_object(self, obj, root=0):
        if self.size == 1:
            return obj
        return self._watched("", "bcast", lambda: self._arrived(
            lambda: self.comm.bcast(obj, root=root)))

    def allreduce_scalar(self, value, op="sum"):
        """`value` summed (or, op="max", the largest) over the ranks."""
        if self.size == 1:
            return value
        mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX}[op]
        return self._watched("", "allreduce", lambda: self._arrived(
            lambda: self.comm.allreduce(value, op=mpi_op)))

    def allreduce_max(self, values):
        buf = np.array(values, np.int64)
        if self.size > 1:
            self._watched("", "allreduce", lambda: complete(
                self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX)))
        return [int(v) for v in buf]

    def gatherv(self, send, recv, counts, root=0, tag=""):
        if self.size == 1:
            if recv is not None:
                recv[...] = send.reshape(recv.shape)
            return recv
        displ = _displacements(counts)
        mpi_type = self.MPI._typedict[send.dtype.char]
        target = [recv, (list(counts), list(displ)), mpi_type] if self.rank == root else None
        self._timed(tag, "gather", send.nbytes, lambda: complete(self.comm.Igatherv(send, target,
                                                                        root=root)))
        return recv

    def barrier(self):
        self._watched("", "barrier", lambda: complete(self.comm.Ibarrier()))

    def _arrived(self, fn):
        """fn(), an object collective, once every rank has come (waited for without
        spinning): it then completes at once."""
        complete(self.comm.Ibarrier())
        return fn()

    def abort(self, code=1):
        self.comm.Abort(code)

    def iallreduce_sum(self, buf):
        if self.size == 1 or buf.size == 0:
            return Done()
        return _Request(self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM))

    def ireduce_scatter_sum(self, send, recv, counts):
        if self.size == 1:
            return super().ireduce_scatter_sum(send, recv, counts)
        return _Request(self.comm.Ireduce_scatter(send, recv, [int(c) for c in counts],
                                                  op=self.MPI.SUM))

    def iallgatherv_inplace(self, buf, counts):
        if self.size == 1:
            return Done()
        mpi_type = self.MPI._typedict[buf.dtype.char]
        spec = [buf, ([int(c) for c in counts], list(_displacements(counts))), mpi_type]
        return _Request(self.comm.Iallgatherv(self.MPI.IN_PLACE, spec))

    def iallgather(self, send, recv):
        if self.size == 1:
            return super().iallgather(send, recv)
        return _Request(self.comm.Iallgather(send, recv))

    def iallgatherv(self, send, recv, counts):
        if self.size == 1:
            return super().iallgatherv(send, recv, counts)
        mpi_type = self.MPI._typedict[recv.dtype.char]
        spec = [recv, ([int(c) for c in counts], list(_displacements(counts))), mpi_type]
        return _Request(self.comm.Iallgatherv(send, spec))

    def dup(self):
        return MpiComm(self.comm.Dup())

    def split(self, color, key=0):
        return MpiComm(self.comm.Split(color, key))

    def node_groups(self, ranks_per_node=None):
        """Nodes are `ranks_per_node` consecutive ranks, or (None) the ranks sharing memory.
        Every node must hold the same number of ranks."""
        from caffepar.errors import CaffeparError
        if ranks_per_node:
            if self.size % ranks_per_node:
                raise CaffeparError(f"ranks per node ({ranks_per_node}) must divide the number "
                                    f"of ranks ({self.size})")
            node = self.split(self.rank // ranks_per_node, self.rank)
        else:
            node = MpiComm(self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank))
        sizes = self.comm.allgather(node.size)
        if len(set(sizes)) != 1:
            raise CaffeparError(f"hierarchical reduction needs the same number of ranks on "
                                f"every node, got {sorted(set(sizes))}; use --ranks-per-node")
        return node, self.split(node.rank, self.rank)

    def gather_object(self, obj, root=0):
        return [obj] if self.size == 1 else self.comm.gather(obj, root=root)

    def start_watchdog(self, timeout=None):
        if self.size > 1 and self.watchdog is None:
            self.watchdog = Watchdog(self, timeout)
            self.watchdog.start()


class Stragglers:
    """Notices a collective far slower than its usual time and names the slow rank.

    Each kind of collective (layer, operation) keeps its last WINDOW durations; one is slow when
    it took FACTOR times their median and FLOOR s more. A rank that computed late makes the
    others wait in the next collective, not itself: so a slowdown counts only when every rank
    saw one in the same iteration, which the solver asks of them all at once (a flag beside its
    per-iteration request, one collective it makes anyway). Then all of them probe: each pair
    of ranks in turn swaps PROBE_BYTES both ways, timed at both ends, the faster end kept. The
    first probe, once the job is warm, is the baseline; the one after a slowdown compares each
    pair with it (`name_slow`). One warning per episode of a slow network: it ends after QUIET
    agreed iterations without a slowdown (slow durations join the window, so a lasting
    slowdown becomes the usual). A probe that finds the network as fast as at the start is said
    once per run, and the next probe waits COOLDOWN iterations. Pairs grow as the square of the
    ranks: beyond MAX_PROBED ranks the warning names no rank.
    """

    WINDOW, MIN_SAMPLES, FACTOR, FLOOR = 20, 5, 4.0, 0.1
    QUIET, COOLDOWN = 20, 5
    PROBE_BYTES, REPEATS, TAG = 1 << 20, 2, 7303
    MAX_PROBED = 16

    def __init__(self):
        self.history = defaultdict(lambda: deque(maxlen=self.WINDOW))
        self.slow = None            # (seconds, usual, key) of the slowest since last agreed
        self.baseline = None
        self.in_episode = False
        self.quiet = self.cooldown = 0
        self.said_fast = False

    def note(self, key, seconds):
        past = self.history[key]
        if len(past) >= self.MIN_SAMPLES:
            usual = float(np.median(past))
            if seconds > self.FACTOR * usual and seconds - usual > self.FLOOR and \
                    (self.slow is None or seconds / usual > self.slow[0] / self.slow[1]):
                self.slow = (seconds, usual, key)
        past.append(seconds)

    def seen(self):
        """1 when this rank saw a slow collective since the ranks last agreed."""
        return int(self.slow is not None)

    def agreed(self, comm, slow):
        """Every rank calls this with the same `slow`: 1 when every rank saw a slow collective
        since the last call (the smallest of their flags). Returns the warning to log (once per
        episode), or None."""
        if comm.size == 1:
            return None
        seen, self.slow = self.slow, None
        if self.baseline is None:
            if comm.warm:       # the first iteration's collectives (engines measured) are no
                self.baseline = self.probe(comm) if comm.size <= self.MAX_PROBED else False
            return None
        self.cooldown = max(0, self.cooldown - 1)
        if not slow:
            self.quiet += 1
            if self.quiet >= self.QUIET:
                self.in_episode = False
            return None
        self.quiet = 0
        if self.in_episode or self.cooldown:
            return None
        now = self.probe(comm) if self.baseline is not False else None
        gathered = comm.comm.allgather((socket.gethostname(), seen))
        hosts = [h for h, _ in gathered]
        rank, (seconds, usual, (tag, op)) = max(
            ((r, v) for r, (_h, v) in enumerate(gathered) if v),
            key=lambda rv: rv[1][0] / rv[1][1])
        what = f"{op} {tag!r}" if tag else op
        words, network = name_slow(self.baseline, now, hosts) if now is not None else (
            f"{comm.size} ranks are too many to probe each pair: no rank named", True)
        if network:
            self.in_episode = True
        else:
            self.cooldown = self.COOLDOWN
            if self.said_fast:
                return None
            self.said_fast = True
        return (f"caffepar: straggler: {what} took {seconds:.3g} s on rank {rank}, usually "
                f"{usual:.3g} s; {words}")

    def probe(self, comm):
        """seconds[a, b]: the time ranks a and b took to swap PROBE_BYTES (the faster end's
        clock, best of REPEATS); pairs in turn, a barrier between them."""
        return comm._watched("", "probe", lambda: self._probe(comm))

    def _probe(self, comm):
        mpi, size, rank = comm.comm, comm.size, comm.rank
        send = np.zeros(self.PROBE_BYTES, np.uint8)
        recv = np.empty_like(send)
        seconds = np.full((size, size), np.inf)
        complete(mpi.Ibarrier())
        for _ in range(self.REPEATS):
            for a in range(size):
                for b in range(a + 1, size):
                    if rank in (a, b):
                        other = b if rank == a else a
                        t0 = time.perf_counter()
                        for request in (mpi.Irecv(recv, source=other, tag=self.TAG),
                                        mpi.Isend(send, dest=other, tag=self.TAG)):
                            complete(request)
                        seconds[rank, other] = min(seconds[rank, other],
                                                   time.perf_counter() - t0)
                    complete(mpi.Ibarrier())
        seconds[~np.isfinite(seconds)] = 0
        complete(mpi.Iallreduce(comm.MPI.IN_PLACE, seconds, op=comm.MPI.SUM))
        both = np.minimum(seconds, seconds.T)
        np.fill_diagonal(both, 0)
        return both


def name_slow(baseline, now, hosts, ratio=3.0):
    """Which ranks' links are slow, from two pairwise probes (seconds[a, b] for ranks a, b)
    at the job's start and now: (words, whether any pair slowed). Ranks of one host share its
    link, so hosts are compared when the job spans several, else ranks. A pair slowed when it
    takes `ratio` times its baseline. A host (or rank) is slow when every pair it belongs to
    slowed while some pair without it did not: its link is the one they share. Between two
    only, the path between them is slow, and timing cannot tell which end's link."""
    size = len(hosts)
    names = list(dict.fromkeys(hosts))
    if len(names) > 1:
        units = [[r for r in range(size) if hosts[r] == h] for h in names]
        labels = [f"{h} (rank{'s' if len(u) > 1 else ''} {', '.join(map(str, u))})"
                  for h, u in zip(names, units)]
    else:
        units = [[r] for r in range(size)]
        labels = [f"rank {r}" for r in range(size)]
    n = len(units)
    pairs = {}
    for i in range(n):
        for j in range(i + 1, n):
            cells = [(a, b) for a in units[i] for b in units[j]]
            pairs[i, j] = (float(np.median([now[c] for c in cells])),
                           float(np.median([baseline[c] for c in cells])))
    slowed = {k for k, (t, base) in pairs.items() if t > ratio * base}
    ms = lambda k: f"{pairs[k][0] * 1e3:.0f} ms against {pairs[k][1] * 1e3:.0f} ms at the start"
    swap = f"swapping {Stragglers.PROBE_BYTES / 2 ** 20:g} MiB"
    if not slowed:
        worst = max(pairs, key=lambda k: pairs[k][0] / pairs[k][1])
        return (f"yet every pair of {'hosts' if len(names) > 1 else 'ranks'} swaps data as "
                f"fast as at the start (slowest {labels[worst[0]]} - {labels[worst[1]]}: "
                f"{ms(worst)}): not the network; the slowdown has passed, or the ranks' "
                "machines slowed them all"), False
    if n == 2:
        return (f"the path between {labels[0]} and {labels[1]} is slow ({swap}: "
                f"{ms((0, 1))}); with two ends, which one's link cannot be told"), True
    slow = [i for i in range(n) if all(k in slowed for k in pairs if i in k)
            and any(k not in slowed for k in pairs if i not in k)]
    if not slow:
        return (f"{len(slowed)} of {len(pairs)} pairs slowed ({swap}), with no one "
                "end in common: more than one link, or what they share, is slow"), True
    fast = [k for k in pairs if k not in slowed]
    typical = float(np.median([pairs[k][0] for k in fast]))
    who = " and ".join(labels[i] for i in slow)
    mine = [k for k in pairs if slow[0] in k]
    return (f"{who} {'is' if len(slow) == 1 else 'are'} slow: {swap} with "
            f"{'it' if len(slow) == 1 else 'them'} took "
            f"{float(np.median([pairs[k][0] for k in mine])) * 1e3:.0f} ms (at the start "
            f"{float(np.median([pairs[k][1] for k in mine])) * 1e3:.0f} ms), between the "
            f"others {typical * 1e3:.0f} ms"), True


class Watchdog:
    """A thread per rank that ends the job when it cannot end by itself.

    - This rank has waited too long in one collective: it asks every rank (point to point, on a
      communicator of its own) how far it has got, and the lowest rank that waits there ends the
      job in one line naming the ranks that did not come (and their hosts, when the job spans
      several). Too long is `timeout` seconds when given (0: never), else FACTOR times the
      longest this rank has computed between two collectives since the first iteration, at
      least FLOOR seconds; during the first iteration (engines measured, a first test) FIRST
      seconds. A late rank that says it is writing a snapshot is waited for (up to BUSY_MAX).
    - This rank's parent (the process manager's proxy) or caffepar's launcher has died: the job
      cannot end normally; the rank is asked to stop (a snapshot, as SIGTERM).
    - This rank was asked to stop but is still running GRACE seconds later (or 3 times its
      longest computation between collectives), not writing a snapshot: blocked in a collective
      or a hung layer. It ends at once, naming the rank the job waits for.
    The training thread only notes which collective it is in; the watchdog looks once a second.

    All of that is Python, and needs the interpreter lock: a rank stuck in compiled code that
    holds it (a layer's C call that does not release it) would never end, which matters once no
    process manager is left to kill it. So each look also re-arms a last resort that needs no
    lock, faulthandler's timer (a C thread): a rank whose watchdog could not look for as long
    as it may wait in a collective, plus GRACE (BUSY_MAX while it writes a snapshot), writes
    where it was stuck and exits with status 1 (see `backstop`).
    """

    INTERVAL = 1.0
    FLOOR, FIRST, FACTOR = 60.0, 300.0, 20.0
    GRACE = 10.0
    BUSY_MAX = 3600.0
    QUERY, ANSWER = 7301, 7302

    def __init__(self, comm, timeout=None):
        import threading
        from caffepar.parallel.launch import LAUNCHER_VAR
        self.comm = comm
        self.timeout = None if timeout is None else float(timeout)
        self.MPI = comm.MPI
        self.side = comm.comm.Dup()
        self.hosts = self.side.allgather(socket.gethostname())
        self.can_ask = self.MPI.Query_thread() == self.MPI.THREAD_MULTIPLE
        self.parent = os.getppid()
        launcher = os.environ.get(LAUNCHER_VAR)
        self.launcher = int(launcher) if launcher and launcher.isdigit() else None
        self.orphaned = False
        self.stuck_file = None
        self.patience = (None, 0.0)     # (collective number, when a busy rank was last seen)
        self.queries = []               # sends of _ask not yet complete
        self.posting = self.unreachable = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="caffepar-watchdog", daemon=True)

    def start(self):
        import atexit
        self.backstop()
        self.thread.start()
        atexit.register(self.stop)      # before MPI_Finalize (registered earlier, run later)

    def stop(self):
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()
        faulthandler.cancel_dump_traceback_later()

    def backstop(self):
        """(Re-)arm the last resort: exit, without the interpreter lock, if the watchdog does
        not look again within its time. The stacks go to the job folder under caffepar's
        launcher (which reports them in one line), else to stderr."""
        limit = self.BUSY_MAX if self.comm.busy_with else self.limit()
        if limit is None:
            faulthandler.cancel_dump_traceback_later()
            return
        if self.stuck_file is None:
            from caffepar.parallel.launch import stuck_file
            self.stuck_file = stuck_file(self.comm)
        faulthandler.dump_traceback_later(limit + self.GRACE, exit=True, file=self.stuck_file)

    def limit(self):
        """Seconds a rank may wait in one collective (None: for ever)."""
        if self.timeout is not None:
            return self.timeout or None
        if not self.comm.warm:
            return self.FIRST
        return max(self.FLOOR, self.FACTOR * self.comm.longest_gap)

    def _run(self):
        query = np.zeros(1, np.int64)
        request = self.side.Irecv(query, source=self.MPI.ANY_SOURCE, tag=self.QUERY) \
            if self.can_ask else None
        while not self.stopping.wait(self.INTERVAL):
            self.backstop()
            try:
                request = self._answer(request, query)
                self._check_parents()
                request = self._check_stop(request, query)
                waiting, limit = self.comm.waiting, self.limit()
                if limit and waiting and self._waited(waiting) > limit:
                    request = self._expired(waiting, request, query, limit)
            except self.MPI.Exception as error:     # a rank gone: one line, not a traceback
                self._end_job(f"[rank {self.comm.rank}] {mpi_failure(error)}")
        if request is not None:
            request.Cancel()
            request.Wait()

    def _waited(self, waiting):
        number, since = waiting[0], waiting[3]
        if self.patience[0] == number:
            since = max(since, self.patience[1])
        return time.monotonic() - since

    def _check_parents(self):
        from caffepar.parallel.launch import process_alive
        if self.orphaned:
            return
        if os.getppid() != self.parent:
            why = f"lost its process manager (parent process {self.parent} ended)"
        elif self.launcher is not None and not process_alive(self.launcher):
            why = "lost caffepar's launcher (it ended)"
        else:
            return
        self.orphaned = why
        self.comm.note_stop(why)
        os.kill(os.getpid(), signal.SIGTERM)        # snapshot and stop, if it can

    def _check_stop(self, request, query):
        """Asked to stop GRACE seconds ago and still running: end now."""
        comm = self.comm
        if comm.stop_since is None or comm.busy_with:
            return request
        grace = max(self.GRACE, 3 * comm.longest_gap)
        if time.monotonic() - comm.stop_since < grace:
            return request
        waiting = comm.waiting
        if waiting:
            return self._expired(waiting, request, query, None, stopping=True)
        self._end_job(f"[rank {comm.rank}] caffepar: {comm.stop_reason}, but still computing "
                      f"{grace:g} s later (a hung layer?); ended the job")
        return request

    def _answer(self, request, query):
        """Tell a rank that asks: how many collectives this rank has entered, whether it waits
        in the last one, and whether it is writing a snapshot."""
        status = self.MPI.Status()
        while request is not None and request.Test(status):
            comm = self.comm
            reply = [comm.calls, comm.waiting is not None, comm.busy_with is not None]
            self.side.Isend(np.array(reply, np.int64), dest=status.Get_source(),
                            tag=self.ANSWER).Wait()
            request = self.side.Irecv(query, source=self.MPI.ANY_SOURCE, tag=self.QUERY)
        return request

    def _ask(self, number, request, query):
        """{rank: (collectives entered, waits, busy)} of the ranks that answer within 5 s."""
        others = [r for r in range(self.comm.size) if r != self.comm.rank]
        answers = {}
        if not self.can_ask:
            return answers, request
        replies = {r: np.zeros(3, np.int64) for r in others}
        pending = {r: self.side.Irecv(replies[r], source=r, tag=self.ANSWER) for r in others}
        if not self._post_queries(number, others):
            return answers, request
        deadline = time.monotonic() + max(5.0, 3 * self.INTERVAL)
        while pending and time.monotonic() < deadline:
            request = self._answer(request, query)
            for r in [r for r, req in pending.items() if req.Test()]:
                answers[r] = tuple(int(v) for v in replies[r])
                del pending[r]
            time.sleep(0.05)
        for req in pending.values():
            req.Cancel()
        return answers, request

    POST_LIMIT = 2.0

    def _post_queries(self, number, others):
        """Send the query to the others, from a thread of its own: with some transports (MPICH
        over OFI's tcp) posting a send to a rank whose node is gone blocks, and every other MPI
        call with it. False when that happened (`unreachable` is that rank); the sends are not
        waited for."""
        import threading
        posted = threading.Event()

        def post():
            for r in others:
                self.posting = r
                self.queries.append(self.side.Isend(np.array([number], np.int64), dest=r,
                                                    tag=self.QUERY))
            posted.set()

        self.queries = [q for q in self.queries if not q.Test()]
        threading.Thread(target=post, name="caffepar-watchdog-ask", daemon=True).start()
        if posted.wait(self.POST_LIMIT):
            return True
        self.unreachable = self.posting
        return False

    def _expired(self, waiting, request, query, limit, stopping=False):
        """This rank has waited `limit` s in `waiting` (or was asked to stop while waiting):
        end the job naming the ranks that did not come, unless a late one is writing a
        snapshot, or a lower rank that waits there too will say it."""
        number, op, tag, since = waiting
        comm = self.comm
        # orphaned: no launcher reads the line, and the ranks asked may be gone (5 s lost)
        answers, request = ({}, request) if self.orphaned else self._ask(number, request, query)
        if self.stopping.is_set() or (comm.waiting or (None,))[0] != number:
            return request      # it completed while the others were asked (they may be gone)
        what = f"collective #{number} ({op} {tag!r})" if tag else f"collective #{number} ({op})"
        if self.unreachable is not None:
            r = self.unreachable
            host = f" on {self.hosts[r]}" if len(set(self.hosts)) > 1 else ""
            self._end_job(f"caffepar: rank {r}{host} cannot be reached (MPI blocks sending to "
                          f"it: its process or node is gone?); rank {comm.rank} waited "
                          f"{time.monotonic() - since:.0f} s in {what}; ended the job")
            return request
        waited = time.monotonic() - since
        others = [r for r in range(comm.size) if r != comm.rank]
        late = sorted(r for r in others if r not in answers or answers[r][0] < number)
        waiters = sorted([comm.rank] + [r for r, a in answers.items()
                                        if a[0] == number and a[1]])
        if not stopping and waited < self.BUSY_MAX and any(answers.get(r, (0, 0, 0))[2]
                                                           for r in late):
            self.patience = (number, time.monotonic())      # a snapshot: wait on
            return request
        if waiters[0] != comm.rank and waited < 2 * (limit or self.GRACE):
            return request                                  # the lower rank says it
        several_hosts = len(set(self.hosts)) > 1
        who = []
        for r in late:
            host = f" on {self.hosts[r]}" if several_hosts else ""
            state = "does not answer" if r not in answers else \
                f"is at #{answers[r][0]}" + (" waiting" if answers[r][1] else "")
            who.append(f"rank {r}{host} ({state})")
        waited_by = f"rank {waiters[0]}" if len(waiters) == 1 else \
            f"ranks {', '.join(map(str, waiters))}"
        reason = f" after {comm.stop_reason}" if stopping else ""
        if late:
            line = (f"caffepar: {'; '.join(who)} stopped before {what}; {waited_by} waited "
                    f"{waited:.0f} s there{reason}; ended the job")
        else:
            line = (f"caffepar: {waited_by} waited {waited:.0f} s in {what}{reason}, every rank "
                    "in a collective (the ranks do not call the same ones); ended the job")
        self._end_job(line)
        return request

    def _end_job(self, line):
        from caffepar.parallel.launch import abort_all
        # unreachable: MPI_Abort would block too, as the sends did
        abort_all(self.comm, line, hard=bool(self.orphaned) or self.unreachable is not None)


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


_LAUNCH_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
               "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "I_MPI_HYDRA_HOST_FILE")


def launched_by_mpi():
    """True when an MPI launcher (mpiexec, srun with PMI) started this process."""
    if os.environ.get("CAFFEPAR_MPI") or any(os.environ.get(k) for k in _LAUNCH_ENV):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ


def world_comm(force=False):
    """MpiComm over COMM_WORLD when launched by MPI (or forced), else LocalComm."""
    if force or launched_by_mpi():
        return MpiComm()
    return LocalComm()
