"""Synchronous SGD over ranks, attached to a solver (layers never see communication).

Every rank builds the same nets with its own data shard (record i belongs to rank i mod P) and
InnerProduct layers the plan splits by output rows. The gradients of all replicated parameters —
one contiguous region of the net's flat diff buffer — are summed over the ranks (by default with
one allreduce after backward; gradsync.py does what the run's CommOptions ask), and every
gradient (replicated or sharded) is divided by P, so the update is the one a single process with
P times the batch computes. Snapshots gather the shards: the files are the ordinary Caffe ones,
and load into any number of ranks.
"""
import numpy as np

from caffepar import common
from caffepar.errors import SolverError
from caffepar.graph.net import Net
from caffepar.logs import LOGGER
from caffepar.parallel.gradsync import GradientSync
from caffepar.parallel.model_parallel import layer_factory
from caffepar.parallel.options import check_solver, options_from_solver
from caffepar.parallel.plan import MODEL, Planner
from caffepar.proto.upgrade import upgrade_solver
from caffepar.solvers import rules as _rules
from caffepar.solvers.solver import SOLVERS


class _AveragedOutputs:
    """Make a net's outputs (and returned loss) the mean over ranks after every full forward."""

    def __init__(self, net, comm):
        self.net, self.comm = net, comm
        self.plain_forward = net.forward_from_to
        net.forward_from_to = self.forward_from_to

    def forward_from_to(self, start=0, end=None):
        loss = self.plain_forward(start, end)
        last = len(self.net.layers) - 1
        if start == 0 and (end is None or end == last):
            loss = average_outputs(self.net, self.comm, loss)
        return loss


def average_outputs(net, comm, loss):
    """Replace each output blob's data by its mean over ranks; return the mean loss."""
    if comm.size == 1:
        return loss
    blobs = [net.blobs[n].data for n in net.outputs]
    flat = np.concatenate([np.asarray(b, np.float64).reshape(-1) for b in blobs] +
                          [np.asarray([loss], np.float64)])
    comm.allreduce_sum(flat, tag="outputs")
    flat /= comm.size
    offset = 0
    for b in blobs:
        b.reshape(-1)[...] = flat[offset:offset + b.size]
        offset += b.size
    return float(flat[-1])


class ReplicaSum:
    """Given to the layers whose training pass depends on the whole batch (BatchNorm's
    statistics, MultiBoxLoss's normalizer): values summed over the ranks, so that P ranks at
    batch B compute what one process at batch P*B does. Layers see a function, not MPI."""

    def __init__(self, comm):
        self.comm = comm
        self.world = comm.size

    def __call__(self, values, tag="replica sum"):
        buf = np.array(values, np.float64).reshape(-1)
        return self.comm.allreduce_sum(buf, tag=tag)


def _sharded_layers(net):
    return [layer for layer in net.layers if getattr(layer, "sharded", False)]


def gather_rows(comm, layer, local, root=0):
    """The full-size array of a row-sharded parameter (on root; None elsewhere)."""
    row = int(np.prod(local.shape[1:])) if local.ndim > 1 else 1
    full = np.empty((layer.full_output,) + local.shape[1:], local.dtype) \
        if comm.rank == root else None
    comm.gatherv(np.ascontiguousarray(local).reshape(-1), full,
                 [int(c) * row for c in layer.row_counts], root=root, tag=layer.name)
    return full


def make_parallel_solver(param, comm, source=None, planner=None, options=None, timeline=None):
    """A solver of the type `param` names whose nets are sharded over `comm` and whose updates
    are synchronised across ranks; gradients communicated as `options` (CommOptions; default:
    the solver's comm_param) say, spans recorded in `timeline` when given."""
    planner = planner or Planner()
    if options is None:
        options = options_from_solver(param, source)
    if param.random_seed < 0:
        param.random_seed = int(comm.bcast_object(
            int(np.random.default_rng().integers(2 ** 31)) if comm.rank == 0 else None))
    type_name = upgrade_solver(param, source=source)[0].type
    base = SOLVERS[type_name]
    cls = type(f"Parallel{base.__name__}", (ParallelSolverMixin, base), {})
    return cls(param, source=source, comm=comm, planner=planner, options=options,
               timeline=timeline)


class ParallelSolverMixin:
    """Overrides of Solver's hooks for a P-rank run (P = 1 runs unchanged)."""

    def __init__(self, param, source=None, comm=None, planner=None, base_dir=None,
                 options=None, timeline=None):
        self.comm = comm
        self.planner = planner
        self._snapshot_requests = self._snapshots_done = 0
        self._stop_requested = False
        super().__init__(param, source=source, base_dir=base_dir)
        net = self.net
        # Same seed everywhere built identical nets; from here on each rank draws its own
        # dropout masks, while rank 0's replicated weights are made authoritative.
        common.set_random_seed(self.param.random_seed * 7919 + comm.rank)
        comm.bcast(net.param_data[:net.replicated_count], root=0, tag="initial params")
        if self.param.eval_type != "detection":
            for test_net in self.test_nets:
                _AveragedOutputs(test_net, comm)
        for layer in [l for n in [net] + self.test_nets for l in n.layers]:
            if getattr(layer, "uses_replica_sum", False):
                layer.replica_sum = ReplicaSum(comm)
        self.writes_files = comm.rank == 0
        self._learnable_layers = self._owner_layers()
        correction = None
        if options.momentum_correction:
            check_solver(options, self.param, source)
            correction = (self.param.momentum, self._add_decay)
        self.sync = GradientSync(net, comm, options, timeline=timeline,
                                 momentum_correction=correction,
                                 cost_model=getattr(planner, "cost_model", None))
        if not self.sync.plain:
            net.observers.append(self.sync)
        self._passes = 0
        if comm.rank == 0:
            modes = [(l.name, l.mode) for l in net.layers if hasattr(l, "mode")]
            sharded = [name for name, mode in modes if mode == MODEL]
            LOGGER.info(f"Parallel run on {comm.size} rank(s): "
                        f"{', '.join(sharded) or 'no layer'} model parallel, the rest data "
                        f"parallel; {net.replicated_count:,} replicated parameters reduced "
                        "with one allreduce")

    def gather_detection_rows(self, rows):
        """Every rank's DetectionEvaluate rows, on every rank (images are told apart by
        rank only within AP's sums, which do not need it)."""
        gathered = self.comm.gather_object(rows, root=0)
        if self.comm.rank == 0:
            merged = {name: [a for part in gathered for a in part[name]] for name in rows}
        else:
            merged = None
        return self.comm.bcast_object(merged, root=0)

    def _make_net(self, source, phase, level, stages):
        return Net(source, phase=phase, level=level, stages=stages,
                   shard=(self.comm.rank, self.comm.size),
                   layer_factory=layer_factory(self.comm, self.planner))

    def _owner_layers(self):
        """(layer, blob index) of each learnable parameter, in the net's learnable order."""
        net = self.net
        owners = [net.param_layer_index[n] for n, o in enumerate(net.param_owner) if o < 0]
        return [(net.layers[i], k) for i, k in owners]

    STOP = 1 << 30

    def requested_action(self):
        """One signal, sent to every rank, reaches them at different iterations. Each rank
        counts the snapshot requests it has had; the job snapshots when the largest count
        grows (so one SIGHUP is one snapshot, not one per rank) and stops when any rank was
        asked to stop. Whether each rank saw a collective far slower than usual rides along
        (as its negative: the largest is minus the smallest flag, 1 when all of them did), so
        that all of them look for the straggler together."""
        local = super().requested_action()
        if local == "snapshot":
            self._snapshot_requests += 1
        elif local == "stop":
            self._stop_requested = True
        mine = self._snapshot_requests + (self.STOP if self._stop_requested else 0)
        stragglers = self.comm.stragglers
        most, not_all = self.comm.allreduce_max([mine, -stragglers.seen()])
        warning = stragglers.agreed(self.comm, -not_all)
        if warning and self.comm.rank == 0:
            LOGGER.warning(warning)
        if most >= self.STOP:
            return "stop"
        if most > self._snapshots_done:
            self._snapshots_done = most
            return "snapshot"
        return "none"

    # ---- one iteration
    def _forward_backward(self, debug):
        self._passes += 1
        self.sync.begin_pass(self.iter, self._passes == self.param.iter_size and not debug)
        loss = super()._forward_backward(debug)
        return average_outputs(self.net, self.comm, loss)

    def forward_only(self):
        return average_outputs(self.net, self.comm, super().forward_only())

    def on_gradients_ready(self):
        net, comm = self.net, self.comm
        self._passes = 0
        comm.warm = True        # engines measured: the watchdog's limit follows the job now
        if comm.size > 1:
            self.sync.finish()
            if self._row is not None:
                self._row["grad_bytes"] = self.sync.last_bytes
            if self._corrected():
                # The velocity is in the reduced values: the solver's momentum would count it
                # twice.
                self.history_data[0][:net.replicated_count] = 0
            net.param_diff *= net.param_diff.dtype.type(1.0 / comm.size)
            self._clip_global()
            display = self.param.display
            if display and self.iter % display == 0:
                self._log_comm()
        super().on_gradients_ready()

    def _log_comm(self):
        """Communication since the last display: time and volume, gradient reduction apart
        from the model-parallel layers' exchanges."""
        stats = self.comm.stats.take()
        seconds = sum(v[0] for v in stats.values())
        mb = sum(v[1] for v in stats.values()) / 2 ** 20
        reduce_s = sum(v[0] for (tag, _op), v in stats.items() if tag == "DATA params")
        layers_s = sum(v[0] for (tag, _op), v in stats.items()
                       if tag not in ("DATA params", "outputs"))
        LOGGER.info(f"    comm: {seconds * 1e3:.1f} ms, {mb:.1f} MB since the last display "
                    f"(gradient reduction {reduce_s * 1e3:.1f} ms, model-parallel layers "
                    f"{layers_s * 1e3:.1f} ms)")

    def _clip_global(self):
        """clip_gradients over the whole model: shards' squares summed across ranks first.
        Afterwards each rank's local norm is <= the clip, so the solver's own clip is a no-op."""
        clip = self.param.clip_gradients
        if clip <= 0:
            return
        net = self.net
        rep = net.param_diff[:net.replicated_count]
        shard = net.param_diff[net.replicated_count:]
        sq = float(np.dot(rep, rep)) + self.comm.allreduce_scalar(float(np.dot(shard, shard)))
        norm = np.sqrt(sq)
        if norm > clip:
            net.param_diff *= net.param_diff.dtype.type(clip / norm)

    # ---- snapshots: whole-size arrays from the shards, this rank's rows back
    def snapshot_blob_arrays(self):
        sharded = _sharded_layers(self.net)
        if not sharded:
            return None
        full = {layer.name: [(gather_rows(self.comm, layer, b.data), None) for b in layer.blobs]
                for layer in sharded}
        return lambda layer: full.get(layer.name) or [(b.data, b.diff) for b in layer.blobs]

    def snapshot_history(self):
        if not _sharded_layers(self.net):
            return self.history
        n = len(self._learnable_layers)
        out = []
        for index, hist in enumerate(self.history):
            layer, _k = self._learnable_layers[index % n]
            out.append(gather_rows(self.comm, layer, hist)
                       if getattr(layer, "sharded", False) else hist)
        return out

    def history_part(self, index, values):
        layer, k = self._learnable_layers[index % len(self._learnable_layers)]
        if getattr(layer, "sharded", False):
            values = layer.local_part(k, values.reshape(layer.full_shape(k)))
        return super().history_part(index, values)

    def snapshot(self):
        with self.comm.busy("snapshot"):       # the ranks that wait are told, and wait on
            result = super().snapshot()
        self.comm.barrier()
        return result

    # ---- top-k's momentum correction: momentum and weight decay move into the residual
    def _corrected(self):
        return self.sync.topk is not None and self.sync.topk.velocity is not None

    def _add_decay(self, values, lo, hi):
        """Add the update's weight decay of replicated parameters [lo, hi) to `values`
        (scaled by iter_size, as the solver divides the reduced gradient by it)."""
        net, p = self.net, self.param
        f = net.param_data.dtype.type
        for j, blob in enumerate(net.learnable_params):
            a, b = max(lo, net.param_offsets[j]), min(hi, net.param_offsets[j] + blob.count)
            decay = f(p.weight_decay) * f(net.decay_mults[j][0]) * f(p.iter_size)
            if a < b and b <= net.replicated_count and decay:
                _rules.regularize(values[a - lo:b - lo], net.param_data[a:b], decay,
                                  p.regularization_type, np.empty(b - a, values.dtype))

    def local_decay(self, i):
        if self._corrected() and self.net.param_offsets[i] < self.net.replicated_count:
            return self.net.param_data.dtype.type(0)
        return super().local_decay(i)

    # ---- top-k state: every rank's residual and thresholds, in rank order
    def snapshot_comm_state(self):
        topk = self.sync.topk
        if topk is None:
            return [], []
        comm = self.comm
        out = []
        for local in topk.state():
            local = np.ascontiguousarray(local, np.float32)
            full = np.empty(comm.size * local.size, np.float32) if comm.rank == 0 else None
            comm.gatherv(local, full, [local.size] * comm.size, tag="snapshot")
            out.append(list(full.reshape(comm.size, -1)) if comm.rank == 0 else [])
        return out[0], out[1]

    def restore_comm_state(self, state, path):
        topk = self.sync.topk
        residuals, thresholds = state.gradient_residual, state.gradient_threshold
        if topk is None:
            if residuals:
                LOGGER.info("The solver state holds top-k gradient residuals; this run does "
                            "not sparsify, so they are dropped")
            return
        if not residuals:
            return
        size = topk.residual.size
        if any(r.size not in (size, 2 * size) for r in residuals):
            raise SolverError(f"gradient residuals have {residuals[0].size} values, this "
                              f"net's replicated parameters {size}", path=path)
        if len(residuals) == self.comm.size:
            topk.set_state(residuals[self.comm.rank], thresholds[self.comm.rank]
                           if len(thresholds) == self.comm.size else None)
            return
        LOGGER.info(f"The solver state holds top-k residuals of {len(residuals)} ranks; their "
                    f"sum is shared evenly by this run's {self.comm.size}")
        total = np.sum(residuals, axis=0, dtype=np.float64) / self.comm.size
        topk.set_state(total.astype(np.float32), None)
