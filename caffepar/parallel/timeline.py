"""`--timeline FILE.json`: every layer's forward and backward, every collective and every
gradient bucket's reduction of every rank, as a Chrome trace (chrome://tracing, Perfetto).

One `pid` per rank. Threads: "iterations" (one span per iteration), "compute" (layers, the
wait for gradients, the update) and "comm k" lanes (collectives; several can be in flight at
once, so each lane holds spans that do not overlap). Clocks are aligned by a barrier when the
timeline starts.
"""
import json
import time

from caffepar.io.weights import atomic_write

ITERATIONS, COMPUTE, COMM = 0, 1, 2


class Timeline:
    def __init__(self, comm, clock=time.perf_counter):
        self.comm = comm
        self.clock = clock
        comm.barrier()
        self.origin = clock()
        self.events = []
        self.lane_ends = []
        self.iteration_start = None

    def span(self, name, cat, tid, t0, t1, args=None):
        self.events.append((name, cat, tid, t0 - self.origin, t1 - t0, args))

    def collective(self, name, t0, t1, args=None):
        """A collective from its start to its completion, on the first free comm lane."""
        for lane, end in enumerate(self.lane_ends):
            if end <= t0:
                break
        else:
            lane = len(self.lane_ends)
            self.lane_ends.append(t0)
        self.lane_ends[lane] = t1
        self.span(name, "comm", COMM + lane, t0, t1, args)

    # ---- what is watched
    def watch(self, net):
        """Spans of every layer's forward and backward of `net`."""
        net.observers.append(_LayerSpans(self, net))

    def watch_solver(self, solver):
        """The solver's update, and one span per iteration (first forward to update end)."""
        self.watch(solver.net)
        update = solver.apply_update

        def timed_update():
            t0 = self.clock()
            iteration = solver.iter
            update()
            t1 = self.clock()
            self.span("update", "update", COMPUTE, t0, t1)
            if self.iteration_start is not None:
                self.span(f"iteration {iteration}", "iteration", ITERATIONS,
                          self.iteration_start, t1)
                self.iteration_start = None

        solver.apply_update = timed_update

    # ---- output
    def trace(self, events_by_rank):
        out = []
        for rank, events in enumerate(events_by_rank):
            out.append({"name": "process_name", "ph": "M", "pid": rank,
                        "args": {"name": f"rank {rank}"}})
            lanes = sorted({tid for _n, _c, tid, _t, _d, _a in events} | {ITERATIONS, COMPUTE})
            for tid in lanes:
                label = {ITERATIONS: "iterations", COMPUTE: "compute"}.get(tid,
                                                                           f"comm {tid - COMM}")
                out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                            "args": {"name": label}})
            for name, cat, tid, ts, dur, args in events:
                event = {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
                         "ts": round(ts * 1e6, 3), "dur": round(dur * 1e6, 3)}
                if args:
                    event["args"] = args
                out.append(event)
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path):
        """Gather every rank's spans; rank 0 writes the file (atomically). Collective."""
        gathered = self.comm.gather_object(self.events, root=0)
        if self.comm.rank != 0:
            return None
        trace = self.trace(gathered)
        atomic_write(path, lambda f: f.write(json.dumps(trace).encode("utf-8")))
        return path


class _LayerSpans:
    def __init__(self, timeline, net):
        self.timeline = timeline
        self.net = net
        self.started = 0.0

    def layer_start(self, kind, i):
        self.started = self.timeline.clock()
        if kind == "forward" and i == 0 and self.timeline.iteration_start is None:
            self.timeline.iteration_start = self.started

    def layer_end(self, kind, i):
        layer = self.net.layers[i]
        self.timeline.span(f"{kind} {layer.name}", kind, COMPUTE, self.started,
                           self.timeline.clock(), {"layer": layer.name, "type": layer.type})
