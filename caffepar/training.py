"""What `caffepar train` and `caffepar test` do around the solver: logging, signals, the CSV of
per-iteration values, the terminal progress bar, and Caffe's `test` scoring loop."""
import os
import signal
import sys

import numpy as np

from caffepar.logs import LOGGER, CsvWriter, setup_logging


class SignalActions:
    """Caffe's --sigint_effect / --sighup_effect: a signal becomes a request the solver polls
    after each iteration. SIGTERM always means snapshot and stop."""

    def __init__(self, sigint_effect="stop", sighup_effect="snapshot", on_stop=None):
        self.effects = {signal.SIGINT: sigint_effect, signal.SIGTERM: "stop"}
        self.on_stop = on_stop      # told at once (a parallel run's watchdog)
        if hasattr(signal, "SIGHUP"):
            self.effects[signal.SIGHUP] = sighup_effect
        self.pending = "none"
        self.previous = {}

    def install(self):
        """Take over the signals, with those that came while the command started."""
        from caffepar import _signals
        noted = _signals.take()
        for sig in self.effects:
            self.previous[sig] = signal.signal(sig, self._handle)
        for sig in noted:
            self._handle(sig, None)
        return self

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        effect = self.effects.get(signum, "none")
        if effect == "none":
            return
        if self.pending != "stop":
            self.pending = effect
        if effect == "stop" and self.on_stop is not None:
            self.on_stop(f"asked to stop ({signal.Signals(signum).name})")
        LOGGER.info(f"Signal {signal.Signals(signum).name} received: {effect}")

    def __call__(self):
        action, self.pending = self.pending, "none"
        return action


class ProgressBar:
    """A one-line bar on a terminal's stderr, redrawn under the log lines."""

    def __init__(self, total, stream=None, enabled=True):
        self.total = max(total, 1)
        self.stream = stream if stream is not None else sys.stderr
        try:
            self.enabled = enabled and self.stream.isatty()
        except (ValueError, AttributeError):
            self.enabled = False
        self.line = ""

    def clear(self):
        if self.enabled and self.line:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def draw(self, done, text=""):
        if not self.enabled:
            return
        width = 30
        filled = int(width * min(done, self.total) / self.total)
        self.line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {text}"
        self.stream.write("\r\033[K" + self.line)
        self.stream.flush()

    def redraw(self):
        if self.enabled and self.line:
            self.stream.write(self.line)
            self.stream.flush()

    def close(self):
        if self.enabled and self.line:
            self.stream.write("\n")
            self.stream.flush()
            self.line = ""


def _hook_bar_into_logging(bar):
    for handler in LOGGER.handlers:
        stream = getattr(handler, "stream", None)
        if stream is bar.stream:
            emit = handler.emit

            def emit_under_bar(record, _emit=emit):
                bar.clear()
                _emit(record)
                bar.redraw()

            handler.emit = emit_under_bar


def comm_options(param, solver_path, comm_flags, ranks):
    """The run's CommOptions: the solver's comm_param with the command line's flags on top."""
    from caffepar.errors import SolverError
    from caffepar.parallel.options import (check_against_ranks, check_solver,
                                           options_from_solver)
    options = options_from_solver(param, solver_path).with_flags(**(comm_flags or {}))
    conflict = options.conflicts()
    if conflict:
        raise SolverError(f"comm_param and the command line: {conflict[1]}", path=solver_path)
    check_against_ranks(options, ranks, solver_path)
    check_solver(options, param, solver_path)
    if ranks == 1 and not options.plain:
        LOGGER.info(f"One rank: no gradients to communicate ({options.describe()} unused)")
    return options


def run_training(solver_path, weights=None, snapshot=None, iterations=None, level=0, stages=(),
                 sigint_effect="stop", sighup_effect="snapshot", log_file=None, csv_file=None,
                 comm=None, planner=None, log_all_ranks=False, comm_flags=None,
                 on_nonfinite="stop", allow_missing=False):
    """`caffepar train`: one process, or one rank of a parallel job when comm has P > 1.
    `comm_flags`: gradient communication options given on the command line; `on_nonfinite`:
    stop at a NaN or infinite loss, or continue as Caffe does."""
    from caffepar.io.weights import copy_weights_files
    from caffepar.parallel.comm import LocalComm
    from caffepar.parallel.timeline import Timeline
    from caffepar.proto.text import read_solver_text
    from caffepar.solvers import get_solver
    from caffepar.solvers.snapshot import PrefixLock, stale_temp_files
    comm = comm if comm is not None else LocalComm()
    rank = comm.rank
    parallel = comm.size > 1
    setup_logging(log_file if rank == 0 else None, enabled=rank == 0 or log_all_ranks,
                  prefix=f"[rank {rank}] " if log_all_ranks and parallel else "")
    param = read_solver_text(solver_path)
    if iterations is not None:
        param.max_iter = iterations
    param.train_state.level = level
    param.train_state.stage.extend(stages)
    options = comm_options(param, solver_path, comm_flags, comm.size)
    timeline = Timeline(comm) if options.timeline else None
    if parallel:
        from caffepar.parallel.data_parallel import make_parallel_solver
        solver = make_parallel_solver(param, comm, source=solver_path, planner=planner,
                                      options=options, timeline=timeline)
    else:
        solver = get_solver(param, source=solver_path)
    if timeline is not None:
        comm.timeline = timeline
        timeline.watch_solver(solver)
    if rank == 0:
        solver.check_snapshot_folder()      # before any training: the CSV and snapshots go there
    lock = PrefixLock(solver.snapshot_prefix)
    if rank == 0 and lock.acquire():
        _remove_stale_temp_files(stale_temp_files(solver.snapshot_prefix))
    try:
        if weights:
            paths = weights.split(",")
            for path in paths:
                LOGGER.info(f"Finetuning from {path}")
            for net in [solver.net] + list(solver.test_nets):
                copy_weights_files(net, paths, allow_missing=allow_missing)
        solver = _train(solver, param, snapshot, sigint_effect, sighup_effect, csv_file, rank,
                        on_nonfinite)
    finally:
        lock.release()
    if timeline is not None and timeline.write(options.timeline):
        LOGGER.info(f"Wrote the timeline to {options.timeline}")
    return solver


def _remove_stale_temp_files(paths):
    sizes = 0
    for path in paths:
        try:
            sizes += os.path.getsize(path)
            os.unlink(path)
        except OSError:
            pass
    if paths:
        LOGGER.info(f"Removed {len(paths)} temp file(s) ({sizes / 2 ** 20:.1f} MB) left by an "
                    f"interrupted write: {', '.join(os.path.basename(p) for p in paths)}")


def _train(solver, param, snapshot, sigint_effect, sighup_effect, csv_file, rank,
           on_nonfinite):
    """The solver's run with signals, the CSV and the progress bar attached."""
    start_iter = solver.iter
    csv = CsvWriter(csv_file or f"{solver.snapshot_prefix}_log.csv") if rank == 0 else None
    bar = ProgressBar(param.max_iter, enabled=rank == 0)
    _hook_bar_into_logging(bar)
    waited = {"seconds": 0.0, "data": 0.0}
    display = param.display

    def on_iteration(info):
        row = {"iter": info["iter"], "loss": info.get("loss"), "lr": info.get("lr"),
               "seconds": info.get("seconds"), "data_wait_s": info.get("data_wait")}
        if "grad_bytes" in info:
            row["grad_bytes"] = info["grad_bytes"]     # replicated gradients, sent by this rank
        row.update({f"test/{k}": v for k, v in info.get("test", {}).items()})
        if csv is not None:
            if snapshot and csv.kept is None:
                csv.keep_rows_before(info["iter"])
            csv.add(row)
            if solver.last_snapshot_iter == solver.iter:
                csv.write()     # a run resumed from this snapshot keeps these rows
        waited["seconds"] += info.get("seconds") or 0.0
        waited["data"] += info.get("data_wait") or 0.0
        if display and info["iter"] % display == 0 and waited["seconds"] > 0:
            LOGGER.info(f"    data wait: {waited['data']:.3f} s "
                        f"({100 * waited['data'] / waited['seconds']:.1f}% of "
                        f"{waited['seconds']:.2f} s)")
            waited["seconds"] = waited["data"] = 0.0
        loss = info.get("loss")
        bar.draw(info["iter"] + 1, f"loss {loss:.4g}" if loss is not None else "")

    solver.add_callback(on_iteration)
    comm = getattr(solver, "comm", None)
    actions = SignalActions(sigint_effect, sighup_effect,
                            comm.note_stop if comm is not None else None).install()
    solver.action_request = actions
    solver.stop_on_nonfinite = on_nonfinite == "stop"
    LOGGER.info("Starting Optimization")
    try:
        solver.solve(resume_file=snapshot)
        # Every rank agrees on requested_early_exit and last_snapshot_iter, so all take part.
        if solver.requested_early_exit and solver.last_snapshot_iter != solver.iter:
            solver.snapshot()
    finally:
        actions.restore()
        bar.close()
        if csv is not None and (csv.rows or start_iter == solver.iter):
            if snapshot and csv.kept is None:
                csv.keep_rows_before(solver.iter)
            csv.write()
    if csv is not None:
        LOGGER.info(f"Wrote per-iteration values to {csv.path}")
    return solver


def run_test(model, weights, iterations, level=0, stages=(), log_file=None, allow_missing=False):
    """Caffe's `test`: forward `iterations` batches, print each batch's outputs, then means."""
    from caffepar.graph.net import TEST, Net
    setup_logging(log_file)
    net = Net(model, phase=TEST, level=level, stages=tuple(stages))
    net.copy_from(weights, allow_missing=allow_missing)
    LOGGER.info(f"Running for {iterations} iterations.")
    names = list(net.outputs)
    scores = {n: None for n in names}
    total_loss = 0.0
    for i in range(iterations):
        total_loss += net.forward_from_to()
        for name in names:
            values = np.asarray(net.blobs[name].data, np.float64).reshape(-1)
            scores[name] = values.copy() if scores[name] is None else scores[name] + values
            for v in values:
                LOGGER.info(f"Batch {i}, {name} = {v:g}")
    LOGGER.info(f"Loss: {total_loss / iterations:g}")
    results = {}
    for name in names:
        mean = scores[name] / iterations
        weight = net.blob_loss_weights.get(name, 0.0)
        for k, v in enumerate(mean):
            label = name if len(mean) == 1 else f"{name}[{k}]"
            extra = f" (* {weight:g} = {weight * v:g} loss)" if weight else ""
            LOGGER.info(f"{label} = {v:g}{extra}")
        results[name] = mean
    return results
