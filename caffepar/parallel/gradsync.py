"""Reduction of a data-parallel run's replicated gradients (the region net.param_diff[:
net.replicated_count]) over the ranks, as the run's CommOptions ask.

Plain (no option): one blocking allreduce after backward, exactly as before any option existed.
Otherwise the region is cut into buckets (buckets.py) and each bucket's reduction is a small
program that posts non-blocking collectives one stage after another: an allreduce; or, top-k,
an allgather of pair counts then of (index, value) pairs; or, hierarchical, a reduce-scatter in
the node, an allreduce of the shards across nodes and an allgather in the node. With overlap a
bucket's program starts as soon as backward has passed its last layer, and a progress thread
tests the requests in flight (MPI only moves a non-blocking collective along inside MPI calls),
so the transfer runs while backward computes the layers below.

Each stage kind has its own communicator and every rank posts a communicator's collectives in
bucket order, whichever thread posts them, as MPI requires.
"""
import threading
import time
import weakref

import numpy as np

from caffepar.errors import CaffeparError
from caffepar.logs import LOGGER
from caffepar.parallel.buckets import (Bucket, describe_buckets, detect_alexnet_like,
                                       fixed_buckets, gradient_units, layer_buckets, one_bucket,
                                       split_buckets)
from caffepar.parallel.plan import shard_rows
from caffepar.parallel.timeline import COMPUTE
from caffepar.parallel.topk import TopK

PROFILE_START = 1
PROFILE_ITERATIONS = 3
"""Backward times are profiled on iterations 1-3 of a run (0 warms up) when buckets depend on
them (overlap without a fixed size, merge auto)."""
POLL_SECONDS = 0.0005
TAG = "DATA params"


class _Flight:
    """One bucket's reduction in progress."""

    def __init__(self, bucket, program, clock):
        self.bucket = bucket
        self.program = program
        self.stage = 0
        self.done = False
        self.posted = clock()
        self.finished = None
        self.request = None
        self.sent = 0

    def step(self, clock):
        """Run the program to its next collective; False once it has finished."""
        try:
            self.request = next(self.program)
            self.stage += 1
            return True
        except StopIteration:
            self.done = True
            self.finished = clock()
            return False


class GradientSync:
    """Sums the replicated gradients over the ranks; a net observer (layer_start/layer_end)
    so that it can start buckets during backward."""

    def __init__(self, net, comm, options, planner=None, timeline=None, clock=time.perf_counter,
                 momentum_correction=None, cost_model=None):
        """momentum_correction: (momentum, add_decay) for top-k's momentum correction;
        cost_model: what merge auto plans with (measured on the ranks when None)."""
        self.net, self.comm, self.options = net, comm, options
        self.timeline = timeline
        self.clock = clock
        self.grad = net.param_diff[:net.replicated_count]
        self.plain = options.plain or comm.size == 1
        self.plan_buckets = planner
        self.cost_model = cost_model
        self.iteration = 0
        self.armed = False
        self.reductions = 0
        self.last_bytes = 0
        self.totals = {"iterations": 0, "comm_s": 0.0, "exposed_s": 0.0, "sparsify_s": 0.0,
                       "bytes": 0}
        self.topk = None
        if self.plain:
            return
        self.units = gradient_units(net)
        layout = ""
        if options.hierarchical:
            node, across = comm.node_groups(options.ranks_per_node)
            self.comms = [node.dup(), across, node.dup()]
            self.program = self._hierarchical
            layout = f" over {across.size} node(s) of {node.size} rank(s)"
        elif options.topk:
            self.comms = [comm.dup(), comm.dup()]
            if options.momentum_correction and momentum_correction is None:
                raise CaffeparError("momentum correction needs a solver's momentum "
                                    "(caffepar train)")
            momentum, add_decay = momentum_correction if options.momentum_correction \
                else (0.0, None)
            self.topk = TopK(self.units, self.grad.size, options.topk, options.topk_refresh,
                             self.grad.dtype, momentum, add_decay)
            self.program = self._topk
        else:
            self.comms = [comm.dup()]
            self.program = self._allreduce
        itemsize = self.grad.dtype.itemsize
        if options.bucket_mb:
            self.buckets = fixed_buckets(self.units, options.bucket_mb * 2 ** 20, itemsize)
        elif options.overlap:
            self.buckets = layer_buckets(self.units)
        else:
            self.buckets = one_bucket(self.units)
        self.profiling = options.overlap and not options.bucket_mb
        self.backward_s = np.zeros(len(net.layers))
        self._started = 0.0
        self.flights = []
        self.posted = 0
        self.sparsify_s = 0.0
        self.sent = 0
        self.shards = {}
        self.error = None
        self.lock = threading.Condition()
        self.thread = None
        if options.overlap and _threads_allowed():
            self.thread = threading.Thread(target=_progress, args=(weakref.ref(self),),
                                           name="caffepar-mpi-progress", daemon=True)
            self.thread.start()
        if comm.rank == 0:
            LOGGER.info(f"Gradient reduction: {options.describe()}{layout}; buckets "
                        f"{describe_buckets(self.buckets, itemsize)}")

    # ---- the solver's side
    def begin_pass(self, iteration, armed):
        """A forward/backward pass of `iteration` starts; `armed`: its backward completes the
        gradients (the last of iter_size passes), so buckets may start during it."""
        self.iteration = iteration
        self.armed = armed and not self.plain and self.options.overlap

    def finish(self):
        """Return once the region holds the sum over ranks (every bucket reduced)."""
        if self.plain:
            t0 = self.clock()
            self.comm.allreduce_sum(self.grad, tag=TAG)
            spent = self.clock() - t0
            self.last_bytes = self.grad.nbytes
            self._add_totals(spent, spent, 0.0, self.grad.nbytes)
            return
        t0 = self.clock()
        sparsify_before = self.sparsify_s
        with self.lock:
            self._post_ready(-1)
            while self.flights and not self.flights[-1].done:
                first = next(f for f in self.flights if not f.done)
                first.request.wait()
                self._advance()
        t1 = self.clock()
        if self.error is not None:
            raise self.error
        exposed = t1 - t0 - (self.sparsify_s - sparsify_before)
        self.comm.stragglers.note((TAG, "wait"), exposed)
        if self.timeline is not None:
            self.timeline.span("wait for gradients", "wait", COMPUTE, t0, t1)
        self._account(exposed)
        self.armed = False
        self.reductions += 1
        if self.profiling:
            self._profile_step()

    # ---- net observer
    def layer_start(self, kind, i):
        if kind == "backward":
            self._started = self.clock()

    def layer_end(self, kind, i):
        if kind != "backward":
            return
        if self.profiling:
            self.backward_s[i] += self.clock() - self._started
        if self.armed:
            with self.lock:
                started = self._post_ready(i)
                if self.flights:
                    self._advance()         # MPI progress between layers, thread or not
                if started:
                    self.lock.notify()

    # ---- buckets in flight
    def _post_ready(self, done_layer):
        """Start every bucket whose gradients are complete once backward has finished layer
        `done_layer` (-1: all); True if any started."""
        started = False
        while self.posted < len(self.buckets) and self.buckets[self.posted].ready >= done_layer:
            bucket = self.buckets[self.posted]
            flight = _Flight(bucket, self.program(bucket, self._prepare(bucket)), self.clock)
            self.flights.append(flight)
            self.posted += 1
            sent = self.sent
            running = flight.step(self.clock)
            flight.sent = self.sent - sent      # programs count their bytes before posting
            if not running:
                self._finished(flight)
            started = True
        return started

    def _advance(self):
        """Move every flight whose request has completed to its next stage, never ahead of
        the bucket before it (collective order)."""
        previous = None
        for flight in self.flights:
            if not flight.done and (previous is None or previous.done or
                                    previous.stage > flight.stage):
                if flight.request.test() and not flight.step(self.clock):
                    self._finished(flight)
            previous = flight

    def _finished(self, flight):
        if self.timeline is not None:
            b = flight.bucket
            self.timeline.collective(f"{self.program.__name__.strip('_')} {b.name}",
                                     flight.posted, flight.finished,
                                     {"layers": [u.layer for u in b.units],
                                      "bytes": int(flight.sent)})

    def _in_flight(self):
        return bool(self.flights) and not self.flights[-1].done and self.error is None

    # ---- reduction programs: generators yielding one request per stage
    def _prepare(self, bucket):
        """Computation before a bucket's communication (top-k's selection), not counted as
        communication time: (pair count, pairs) for top-k, else None."""
        if self.topk is None:
            return None
        t0 = self.clock()
        selected = self.topk.select(self.grad, bucket, self.iteration)
        self.sparsify_s += self.clock() - t0
        return selected

    def _allreduce(self, bucket, _prepared):
        view = self.grad[bucket.lo:bucket.hi]
        self.sent += view.nbytes
        yield self.comms[0].iallreduce_sum(view)

    def _hierarchical(self, bucket, _prepared):
        node, across, node_again = self.comms
        view = self.grad[bucket.lo:bucket.hi]
        if node.size == 1 or across.size == 1:
            # One rank per node: an allreduce across; one node: one inside it.
            group = across if node.size == 1 else node_again
            self.sent += view.nbytes
            yield group.iallreduce_sum(view)
            return
        counts, offsets = shard_rows(view.size, node.size)
        lo, n = int(offsets[node.rank]), int(counts[node.rank])
        shard = self._shard(n, view.dtype)
        self.sent += view.nbytes + 2 * shard.nbytes
        yield node.ireduce_scatter_sum(view, shard, counts)
        yield across.iallreduce_sum(shard)
        view[lo:lo + n] = shard
        yield node_again.iallgatherv_inplace(view, counts)

    def _shard(self, n, dtype):
        """A work array of n values, reused across iterations (a fresh one would pay its page
        faults every time)."""
        key = (n, dtype.str)
        if key not in self.shards:
            self.shards[key] = np.empty(n, dtype)
        return self.shards[key]

    def _topk(self, bucket, prepared):
        count, pairs = prepared
        mine = np.array([count], np.int64)
        counts = np.empty(self.comm.size, np.int64)
        self.sent += mine.nbytes + pairs.nbytes
        yield self.comms[0].iallgather(mine, counts)
        sizes = counts * (1 + self.topk.words)
        gathered = np.empty(int(sizes.sum()), np.int32)
        yield self.comms[1].iallgatherv(pairs, gathered, sizes)
        self.topk.scatter(self.grad, bucket, gathered, counts)

    # ---- accounting and planning
    def _account(self, exposed):
        spans = sorted((f.posted, f.finished) for f in self.flights)
        busy, end = 0.0, -np.inf
        for t0, t1 in spans:
            busy += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
        self._add_totals(busy, exposed, self.sparsify_s, self.sent)
        self.comm.stats.add((TAG, self.program.__name__.strip("_")), exposed, self.sent)
        self.last_bytes = self.sent
        self.flights, self.posted, self.sparsify_s, self.sent = [], 0, 0.0, 0

    def _add_totals(self, comm_s, exposed_s, sparsify_s, nbytes):
        t = self.totals
        t["iterations"] += 1
        t["comm_s"] += comm_s
        t["exposed_s"] += exposed_s
        t["sparsify_s"] += sparsify_s
        t["bytes"] += nbytes

    def take_totals(self):
        """Per-iteration means since the last call: comm (time some bucket was in flight),
        exposed (time the solver waited for gradients), sparsify seconds, bytes sent."""
        t = self.totals
        n = max(t["iterations"], 1)
        out = {k: v / n for k, v in t.items() if k != "iterations"}
        out["iterations"] = t["iterations"]
        for k in t:
            t[k] = 0 if k in ("iterations", "bytes") else 0.0
        return out

    def _profile_step(self):
        if self.reductions == PROFILE_START:
            self.backward_s[...] = 0
        if self.reductions < PROFILE_START + PROFILE_ITERATIONS:
            return
        self.profiling = False
        backward_ms = self.backward_s * 1e3 / PROFILE_ITERATIONS
        if self.options.merge and self.plan_buckets is None and self.cost_model is None:
            from caffepar.parallel.calibrate import allreduce_model
            self.cost_model = allreduce_model(self.comm)        # every rank takes part
        plan = None
        if self.comm.rank == 0:
            plan = self._plan(backward_ms)
        plan = self.comm.bcast_object(plan)
        names = {u.layer: u for u in self.units}
        self.buckets = [Bucket([names[n] for n in group]) for group in plan]
        if self.comm.rank == 0:
            LOGGER.info(f"Buckets from a {PROFILE_ITERATIONS}-iteration profile: "
                        f"{describe_buckets(self.buckets, self.grad.itemsize)}")

    def _plan(self, backward_ms):
        """Rank 0's bucket plan (unit names per bucket) from profiled backward times."""
        net = self.net
        if self.plan_buckets is not None:
            buckets = self.plan_buckets(self.units, backward_ms)
        elif self.options.merge:
            from caffepar.parallel.cost import describe
            from caffepar.parallel.schedule import merge_buckets
            buckets, gain = merge_buckets(self.units, backward_ms, self.cost_model,
                                          self.comm.size, self.grad.itemsize)
            LOGGER.info(f"Optimal merge (MG-WFBP) with {describe(self.cost_model)}: "
                        f"{len(buckets)} bucket(s) for {len(self.units)} layer(s), modelled "
                        f"backward + communication {gain[0]:.1f} -> {gain[1]:.1f} ms")
        else:
            detection = detect_alexnet_like([l.name for l in net.layers], backward_ms,
                                            layer_parameters(net))
            LOGGER.info(f"Net is {detection.describe()}")
            buckets = split_buckets(self.units, detection.split_index) \
                if detection.alexnet_like else layer_buckets(self.units)
        return [[u.layer for u in b.units] for b in buckets]


def _progress(ref):
    """The progress thread: tests the requests in flight every POLL_SECONDS. It holds its
    GradientSync only weakly, and ends once the sync is gone."""
    while True:
        sync = ref()
        if sync is None:
            return
        lock = sync.lock
        with lock:
            busy = sync._in_flight()
            if busy:
                try:
                    sync._advance()
                except Exception as e:      # reported by the main thread in finish()
                    sync.error = e
            del sync
            if not busy:
                lock.wait(timeout=1.0)
        if busy:
            time.sleep(POLL_SECONDS)


def layer_parameters(net):
    """Parameters of every layer of `net` (whole-size for model-parallel shards)."""
    out = []
    for layer in net.layers:
        count = 0
        for k, blob in enumerate(layer.blobs):
            shape = layer.full_shape(k) if getattr(layer, "sharded", False) else blob.shape
            count += int(np.prod(shape))
        out.append(count)
    return out


def _threads_allowed():
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return MPI.Is_initialized() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
