"""Caffe's Solver: builds the train and test nets from a SolverParameter and runs Caffe's
training loop (Solver::Step / Solve / TestAll), updates (SGDSolver::ApplyUpdate), snapshots and
restores, with the same order of operations and the same log lines."""
import logging
import math
import os
import time

import numpy as np
from google.protobuf import text_format

from caffepar import common
from caffepar.errors import SolverError
from caffepar.graph.net import TEST, TRAIN, Net
from caffepar.io.weights import save_caffemodel, save_caffemodel_hdf5
from caffepar.nn import native
from caffepar.nn.blas import run_parts, scratch, split_parts
from caffepar.proto import caffe_pb2
from caffepar.proto.text import read_net_text, read_solver_text
from caffepar.proto.upgrade import upgrade_solver
from caffepar.solvers import rules as _rules
from caffepar.solvers import snapshot as _snap
from caffepar.solvers.lr_policy import learning_rate

log = logging.getLogger("caffepar")

BINARYPROTO = caffe_pb2.SolverParameter.BINARYPROTO
HDF5 = caffe_pb2.SolverParameter.HDF5

ACTIONS = ("none", "snapshot", "stop")
AP_VERSIONS = ("11point", "MaxIntegral", "Integral")
CHUNK = 1 << 18
"""Elements per step of the update loop: bounds the scratch memory on very large blobs."""


def _g(x):
    """A number as C++'s default ostream prints a float (6 significant digits)."""
    return f"{float(x):.6g}"


def upgrade_solver_param(param, source=None):
    """Caffe's ReadSolverParamsFromTextFileOrDie after parsing: solver_type -> type, and, for a
    solver read from a file, UpgradeSnapshotPrefixProperty (unset prefix -> the solver file's
    path without extension; a directory prefix -> that directory / the file's stem)."""
    param, notes = upgrade_solver(param, source=source)
    for note in notes:
        log.info(note)
    if source is not None:
        source = os.fspath(source)
        if not param.HasField("snapshot_prefix"):
            param.snapshot_prefix = os.path.splitext(source)[0]
            log.info("snapshot_prefix was not specified and is set to %s", param.snapshot_prefix)
        elif os.path.isdir(param.snapshot_prefix):
            stem = os.path.splitext(os.path.basename(source))[0]
            param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)
            log.info("snapshot_prefix was a directory and is replaced to %s",
                     param.snapshot_prefix)
    return param


def resolve_prefix(prefix, base_dir):
    """A snapshot prefix whose folder is missing here but present beside the solver file
    (in `base_dir`) is taken from there."""
    folder = os.path.dirname(prefix)
    if not folder or os.path.isabs(prefix) or os.path.isdir(folder) or not base_dir:
        return prefix
    alt = os.path.join(base_dir, prefix)
    return alt if os.path.isdir(os.path.dirname(alt)) else prefix


def _data_states(net):
    """{layer name: get_state()} of the net's data layers (those that can be put back)."""
    return {layer.name: layer.get_state() for layer in net.layers
            if callable(getattr(layer, "get_state", None))
            and callable(getattr(layer, "set_state", None))}


def _set_data_states(net, states):
    for name, state in states.items():
        layer = net.layer_dict.get(name)
        if layer is not None and callable(getattr(layer, "set_state", None)):
            layer.set_state(state)


def load_solver_param(path):
    """A solver prototxt read and upgraded as Caffe reads it."""
    return upgrade_solver_param(read_solver_text(path), source=path)


def _merged_state(phase, *states):
    """NetState defaults <- the net's own state <- the solver's train/test state, merged as
    protobuf MergeFrom does (set scalars override, stages accumulate)."""
    level, stages = 0, []
    for st in states:
        if st is None:
            continue
        if st.HasField("phase"):
            phase = st.phase
        if st.HasField("level"):
            level = st.level
        stages.extend(st.stage)
    return phase, level, tuple(stages)


class Solver:
    """A Caffe solver. Construct from a solver prototxt path or a SolverParameter (with
    `source` = the file it came from, for Caffe's snapshot_prefix rule and as the fallback
    folder for relative paths).

    Hooks for drivers: `action_request` (callable -> "none" | "snapshot" | "stop", polled after
    every iteration and during testing, like Caffe's signal handler: return each request once),
    `add_callback(fn)` (fn(info) after every iteration), `on_gradients_ready()` (between backward
    and the update; a data-parallel subclass reduces `net.param_diff` there), `history_rows`."""

    solver_type = None

    def __init__(self, param, source=None, base_dir=None):
        if isinstance(param, caffe_pb2.SolverParameter):
            raw = caffe_pb2.SolverParameter()
            raw.CopyFrom(param)
        else:
            source = os.fspath(param)
            raw = read_solver_text(source)
        self.source = os.fspath(source) if source is not None else None
        if base_dir is None and self.source is not None:
            base_dir = os.path.dirname(os.path.abspath(self.source))
        self.base_dir = base_dir
        self.param = upgrade_solver_param(raw, self.source)
        p = self.param
        self._type = type(self).solver_type or p.type
        log.info("Initializing solver from parameters: \n%s",
                 text_format.MessageToString(p, as_utf8=True))
        self.rule = _rules.make_rule(self._type, p)
        if p.average_loss < 1:
            raise SolverError(f"average_loss must be >= 1, got {p.average_loss}")
        if p.iter_size < 1:
            raise SolverError(f"iter_size must be >= 1, got {p.iter_size}")
        if p.eval_type not in ("classification", "detection"):
            raise SolverError(f'unknown eval_type "{p.eval_type}" (classification or '
                              'detection)', path=self.source)
        if p.eval_type == "detection" and p.ap_version not in AP_VERSIONS:
            raise SolverError(f'unknown ap_version "{p.ap_version}" ({", ".join(AP_VERSIONS)})',
                              path=self.source)
        self._check_snapshot_prefix()
        if p.random_seed >= 0:
            common.set_random_seed(p.random_seed)
        self.net = self._init_train_net()
        self.test_nets = self._init_test_nets()
        self._initial_data_states = [_data_states(net) for net in [self.net] + self.test_nets]
        log.info("Solver scaffolding done.")
        self.iter = 0
        self.current_step = 0
        self._init_history()
        self.action_request = lambda: "none"
        self.callbacks = []
        self.pycaffe_callbacks = []
        self.history_rows = []
        self.requested_early_exit = False
        self.smoothed_loss = 0.0
        self._losses = []
        self._row = None
        self.last_lr = None
        self.last_snapshot_iter = None
        self._wait_seen = {}
        self._iterations_last = 0

    # ------------------------------------------------------------------ properties
    @property
    def type(self):
        return self._type

    @property
    def snapshot_prefix(self):
        return resolve_prefix(self.param.snapshot_prefix, self.base_dir)

    @property
    def lr(self):
        """pycaffe's SGDSolver.lr: the rate for the current iteration (no state change)."""
        return learning_rate(self.param, self.iter, self.current_step)[0]

    # ------------------------------------------------------------------ paths
    def _resolve(self, path):
        """A path as Caffe opens it (relative to the working directory), else relative to the
        solver file's folder."""
        if os.path.isabs(path) or os.path.exists(path) or not self.base_dir:
            return path
        alt = os.path.join(self.base_dir, path)
        return alt if os.path.exists(alt) else path

    def _check_snapshot_prefix(self):
        p = self.param
        if not p.snapshot:
            return
        if not p.HasField("snapshot_prefix"):
            raise SolverError("In solver params, snapshot is specified but snapshot_prefix is "
                              "not", path=self.source)
        self.check_snapshot_folder()

    def check_snapshot_folder(self):
        """The folder of snapshot_prefix, where snapshots (and `caffepar train`'s CSV) go,
        exists and is writable; else a SolverError naming that folder."""
        folder = os.path.dirname(self.snapshot_prefix) or "."
        hint = "create it, or change snapshot_prefix" + (f" in {self.source}" if self.source
                                                         else "")
        if not os.path.isdir(folder):
            raise SolverError(f'no such folder, for snapshot_prefix "{self.param.snapshot_prefix}"',
                              path=folder, hint=hint)
        if not os.access(folder, os.W_OK):
            raise SolverError(f'cannot write in this folder, for snapshot_prefix '
                              f'"{self.param.snapshot_prefix}"', path=folder,
                              hint=hint.replace("create it", "make it writable"))

    # ------------------------------------------------------------------ nets
    def _make_net(self, source, phase, level, stages):
        return Net(source, phase=phase, level=level, stages=stages)

    def _net_source(self, value):
        """(what Net takes, the net's own NetState) for a file name or a NetParameter."""
        if isinstance(value, caffe_pb2.NetParameter):
            return value, value.state if value.HasField("state") else None
        path = self._resolve(value)
        net_param, _ = read_net_text(path)
        return path, net_param.state if net_param.HasField("state") else None

    def _load_weights(self, net):
        for model_list in self.param.weights:
            for name in model_list.split(","):
                name = name.strip()
                log.info("Finetuning from %s", name)
                net.copy_from(self._resolve(name))

    def _init_train_net(self):
        p = self.param
        fields = "net, net_param, train_net, train_net_param"
        count = sum(p.HasField(f) for f in ("net", "net_param", "train_net", "train_net_param"))
        if count < 1:
            raise SolverError(f"SolverParameter must specify a train net using one of these "
                              f"fields: {fields}", path=self.source)
        if count > 1:
            raise SolverError(f"SolverParameter must not contain more than one of these fields "
                              f"specifying a train_net: {fields}", path=self.source)
        if p.HasField("train_net_param"):
            log.info("Creating training net specified in train_net_param.")
            value = p.train_net_param
        elif p.HasField("train_net"):
            log.info("Creating training net from train_net file: %s", p.train_net)
            value = p.train_net
        elif p.HasField("net_param"):
            log.info("Creating training net specified in net_param.")
            value = p.net_param
        else:
            log.info("Creating training net from net file: %s", p.net)
            value = p.net
        source, own_state = self._net_source(value)
        phase, level, stages = _merged_state(
            TRAIN, own_state, p.train_state if p.HasField("train_state") else None)
        net = self._make_net(source, phase, level, stages)
        self._load_weights(net)
        return net

    def _init_test_nets(self):
        p = self.param
        generic = p.HasField("net_param") + p.HasField("net")
        if generic > 1:
            raise SolverError("Both net_param and net_file may not be specified.",
                              path=self.source)
        num_specific = len(p.test_net_param) + len(p.test_net)
        if generic and len(p.test_iter) < num_specific or \
                not generic and len(p.test_iter) != num_specific:
            raise SolverError("test_iter must be specified for each test network.",
                              path=self.source)
        instances = num_specific + (len(p.test_iter) - num_specific)
        if p.test_state and len(p.test_state) != instances:
            raise SolverError("test_state must be unspecified or specified once per test net.",
                              path=self.source)
        if instances and p.test_interval <= 0:
            raise SolverError("test_interval must be > 0 when there are test nets",
                              path=self.source)
        specs = [("test_net_param", v) for v in p.test_net_param]
        specs += [(f"test_net file: {v}", v) for v in p.test_net]
        remaining = len(p.test_iter) - len(specs)
        if p.HasField("net_param"):
            specs += [("net_param", p.net_param)] * remaining
        elif p.HasField("net"):
            specs += [(f"net file: {p.net}", p.net)] * remaining
        nets = []
        for i, (what, value) in enumerate(specs):
            source, own_state = self._net_source(value)
            phase, level, stages = _merged_state(
                TEST, own_state, p.test_state[i] if p.test_state else None)
            log.info("Creating test net (#%d) specified by %s", i, what)
            net = self._make_net(source, phase, level, stages)
            self._load_weights(net)
            net.share_with(self.net)
            nets.append(net)
        return nets

    # ------------------------------------------------------------------ history
    def _init_history(self):
        """History blobs in Caffe's order: N blobs per history set, sets one after another."""
        dtype = self.net.param_data.dtype
        total = self.net.param_data.size
        self.history_data = [np.zeros(total, dtype) for _ in range(self.rule.num_history)]
        self.history = []
        for flat in self.history_data:
            for blob, offset in zip(self.net.learnable_params, self.net.param_offsets):
                self.history.append(flat[offset:offset + blob.count].reshape(blob.shape))

    # ------------------------------------------------------------------ hooks
    def add_callback(self, fn, on_gradients_ready=None):
        """add_callback(fn): fn(info) after every iteration, info = {"iter", "loss",
        "smoothed_loss", "lr", "seconds", "data_wait", "test"}. add_callback(on_start,
        on_gradients_ready): pycaffe's form, both called without arguments."""
        if on_gradients_ready is None:
            self.callbacks.append(fn)
        else:
            self.pycaffe_callbacks.append((fn, on_gradients_ready))

    def on_gradients_ready(self):
        """Called once the gradients of an iteration are complete, before the update."""

    def requested_action(self):
        request = self.action_request() if self.action_request else "none"
        request = str(request or "none").lower()
        if request not in ACTIONS:
            raise SolverError(f'action_request returned "{request}"; expected one of '
                              f"{', '.join(ACTIONS)}")
        return request

    def _data_wait(self):
        """Seconds this iteration's data layers spent waiting for their batches."""
        total = 0.0
        for layer in self.net.layers:
            reset = getattr(layer, "reset_data_wait", None)
            if callable(reset):
                total += float(reset() or 0.0)
                continue
            value = float(getattr(layer, "data_wait_seconds", 0.0) or 0.0)
            seen = self._wait_seen.get(id(layer), 0.0)
            total += value - seen if value >= seen else value
            self._wait_seen[id(layer)] = value
        return total

    # ------------------------------------------------------------------ training loop
    def _update_smoothed_loss(self, loss, start_iter, average_loss):
        f = np.float32
        if len(self._losses) < average_loss:
            self._losses.append(f(loss))
            size = len(self._losses)
            self.smoothed_loss = f((f(self.smoothed_loss) * (size - 1) + f(loss)) / size)
        else:
            idx = (self.iter - start_iter) % average_loss
            self.smoothed_loss = f(self.smoothed_loss + (f(loss) - self._losses[idx]) / average_loss)
            self._losses[idx] = f(loss)

    def _forward_backward(self, debug):
        net = self.net
        if not debug:
            loss = net.forward_from_to()
            net.backward_from_to()
            return loss
        # Statistics of diverging values overflow float32 to inf, which is what they print.
        with np.errstate(over="ignore", invalid="ignore"):
            return self._forward_backward_logged()

    def _forward_backward_logged(self):
        """debug_info: each layer's forward and backward, with the mean magnitude of its tops,
        bottom diffs and parameters, as Caffe logs them."""
        net = self.net
        loss = 0.0
        for i, layer in enumerate(net.layers):
            loss += net.forward_from_to(i, i)
            for t in net.top_ids[i]:
                log.info("    [Forward] Layer %s, top blob %s data: %s", layer.name,
                         net.blob_names[t], _g(np.abs(net.blob_list[t].data).mean()
                                                if net.blob_list[t].count else 0))
            for k, b in enumerate(layer.blobs):
                log.info("    [Forward] Layer %s, param blob %d data: %s", layer.name, k,
                         _g(np.abs(b.data).mean() if b.count else 0))
        for i in range(len(net.layers) - 1, -1, -1):
            if not net.layer_need_backward[i]:
                continue
            net.backward_from_to(i, i)
            layer = net.layers[i]
            for j, b in enumerate(net.bottom_ids[i]):
                if net.bottom_need_backward[i][j]:
                    blob = net.blob_list[b]
                    log.info("    [Backward] Layer %s, bottom blob %s diff: %s", layer.name,
                             net.blob_names[b], _g(np.abs(blob.diff).mean() if blob.count else 0))
            for k, b in enumerate(layer.blobs):
                if k < len(layer.param_propagate_down) and layer.param_propagate_down[k]:
                    log.info("    [Backward] Layer %s, param blob %d diff: %s", layer.name, k,
                             _g(np.abs(b.diff).mean() if b.count else 0))
        data, diff = net.param_data, net.param_diff
        log.info("    [Backward] All net params (data, diff): L1 norm = (%s, %s); "
                 "L2 norm = (%s, %s)", _g(np.abs(data).sum()), _g(np.abs(diff).sum()),
                 _g(math.sqrt(float(np.dot(data, data)))), _g(math.sqrt(float(np.dot(diff, diff)))))
        return loss

    def forward_only(self):
        """The train net's loss without backward (the display after the last iteration)."""
        return self.net.forward_from_to()

    def _display_outputs(self):
        net = self.net
        index = 0
        for name in net.outputs:
            weight = net.blob_loss_weights[name]
            for v in np.asarray(net.blobs[name].data).reshape(-1):
                extra = f" (* {_g(weight)} = {_g(np.float32(weight) * v)} loss)" if weight else ""
                log.info("    Train net output #%d: %s = %s%s", index, name, _g(v), extra)
                index += 1

    def step(self, iters):
        """Caffe's Solver::Step: `iters` iterations of test (when due), forward/backward,
        update and snapshot (when due or requested)."""
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + int(iters)
        average_loss = p.average_loss
        self._losses = []
        self.smoothed_loss = 0.0
        timer = time.perf_counter()
        while self.iter < stop_iter:
            t0 = time.perf_counter()
            self._data_wait()
            self.net.clear_param_diffs()
            row = {"iter": self.iter}
            self._row = row
            if p.test_interval and self.iter % p.test_interval == 0 \
                    and (self.iter > 0 or p.test_initialization):
                self.test_all()
                if self.requested_early_exit:
                    break
            for on_start, _ in self.pycaffe_callbacks:
                on_start()
            display = bool(p.display) and self.iter % p.display == 0
            debug = display and p.debug_info
            loss = np.float32(0)
            for _ in range(p.iter_size):
                loss += np.float32(self._forward_backward(debug))
            loss = np.float32(loss / p.iter_size)
            if self.stop_on_nonfinite and not np.isfinite(loss):
                raise SolverError(self._nonfinite_report(loss))
            self._update_smoothed_loss(loss, start_iter, average_loss)
            if display:
                lapse = time.perf_counter() - timer
                per_s = (self.iter - self._iterations_last) / (lapse if lapse else 1)
                log.info("Iteration %d (%s iter/s, %ss/%d iters), loss = %s", self.iter,
                         _g(per_s), _g(lapse), p.display, _g(self.smoothed_loss))
                timer = time.perf_counter()
                self._iterations_last = self.iter
                self._display_outputs()
            self.on_gradients_ready()
            for _, on_grads in self.pycaffe_callbacks:
                on_grads()
            self.apply_update()
            row.update(loss=float(loss), smoothed_loss=float(self.smoothed_loss),
                       lr=self.last_lr, seconds=time.perf_counter() - t0,
                       data_wait=self._data_wait())
            self._row = None
            self.history_rows.append(row)
            request = self.requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0) or request == "snapshot":
                self.snapshot()
            for fn in self.callbacks:
                fn(dict(row))
            if request == "stop":
                self.requested_early_exit = True
                break

    def solve(self, resume_file=None):
        """Caffe's Solver::Solve: optionally restore, train to max_iter, snapshot, then one
        more forward (when display is due) and a final test (when test_interval is due)."""
        p = self.param
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", p.lr_policy)
        self.requested_early_exit = False
        if resume_file:
            log.info("Restoring previous solver status from %s", resume_file)
            self.restore(resume_file)
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            return
        row = {"iter": self.iter}
        self._row = row
        if p.display and self.iter % p.display == 0:
            loss = self.forward_only()
            self._update_smoothed_loss(loss, start_iter, p.average_loss)
            log.info("Iteration %d, loss = %s", self.iter, _g(self.smoothed_loss))
            row.update(loss=float(loss), smoothed_loss=float(self.smoothed_loss))
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        self._row = None
        if len(row) > 1:
            self.history_rows.append(row)
        log.info("Optimization Done.")

    # ------------------------------------------------------------------ testing
    def test_all(self):
        """Caffe's TestAll; returns {test net id: {output name: mean}}."""
        results = {}
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            results[i] = self.test(i)
        return results

    def test(self, test_net_id=0):
        """Caffe's Test: test_iter[id] forwards of the test net sharing the train net's weights;
        each output element averaged over them (eval_type "detection": the SSD fork's mAP)."""
        p = self.param
        if p.eval_type == "detection":
            return self.test_detection(test_net_id)
        log.info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        test_net = self.test_nets[test_net_id]
        test_net.share_with(self.net)
        n = p.test_iter[test_net_id]
        scores = None
        loss = np.float32(0)
        for iter_loss in self._test_forwards(test_net, n):
            if p.test_compute_loss:
                loss += np.float32(iter_loss)
            values = [np.asarray(test_net.blobs[name].data, np.float32).reshape(-1)
                      for name in test_net.outputs]
            if scores is None:
                scores = [v.copy() for v in values]
            else:
                for s, v in zip(scores, values):
                    s += v
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return None
        if p.test_compute_loss:
            loss = np.float32(loss / n)
            log.info("Test loss: %s", _g(loss))
        results = {}
        index = 0
        for name, total in zip(test_net.outputs, scores or []):
            weight = test_net.blob_loss_weights[name]
            for k, value in enumerate(total):
                mean = np.float32(value / n)
                extra = f" (* {_g(weight)} = {_g(np.float32(weight) * mean)} loss)" \
                    if weight else ""
                log.info("    Test net output #%d: %s = %s%s", index, name, _g(mean), extra)
                index += 1
                key = name if total.size == 1 else f"{name}[{k}]"
                results[key] = float(mean)
        if self._row is not None:
            prefix = "" if test_net_id == 0 else f"{test_net_id}/"
            self._row.setdefault("test", {}).update(
                {prefix + k: v for k, v in results.items()})
        return results

    def _test_forwards(self, test_net, n):
        """The n forwards of a test, each after the signals' requests (a snapshot, or a stop
        that ends the test early, as Caffe's Test does); yields each forward's loss."""
        for _ in range(n):
            request = self.requested_action()
            if request == "snapshot":
                self.snapshot()
            elif request == "stop":
                self.requested_early_exit = True
            if self.requested_early_exit:
                return
            yield test_net.forward_from_to()

    def test_detection(self, test_net_id=0):
        """The SSD fork's TestDetection: the DetectionEvaluate rows of test_iter[id] forwards,
        gathered per output, give each output's mean average precision (ap_version)."""
        from caffepar.nn.ssd_train import detection_map
        p = self.param
        log.info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        test_net = self.test_nets[test_net_id]
        test_net.share_with(self.net)
        n = p.test_iter[test_net_id]
        rows = {name: [] for name in test_net.outputs}
        loss = np.float32(0)
        for iter_loss in self._test_forwards(test_net, n):
            if p.test_compute_loss:
                loss += np.float32(iter_loss)
            for name in test_net.outputs:
                data = np.asarray(test_net.blobs[name].data, np.float32)
                if data.ndim == 0 or data.shape[-1] != 5:
                    raise SolverError(f'eval_type "detection" takes test net outputs of rows of '
                                      f'5 values (a DetectionEvaluate top); output "{name}" has '
                                      f"shape {tuple(data.shape)}", path=self.source)
                rows[name].append(data.reshape(-1, 5).copy())
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return None
        rows = self.gather_detection_rows(rows)
        if p.test_compute_loss:
            loss = np.float32(loss / n)
            log.info("Test loss: %s", _g(loss))
        results = {}
        for index, name in enumerate(test_net.outputs):
            found = np.concatenate(rows[name]) if rows[name] else np.zeros((0, 5), np.float32)
            mean_ap, aps = detection_map(found, p.ap_version)
            if p.show_per_class_result:
                for label, ap in aps.items():
                    log.info("class%d: %s", label, _g(ap))
            log.info("    Test net output #%d: %s = %s", index, name, _g(mean_ap))
            results[name] = float(np.float32(mean_ap))
        if self._row is not None:
            prefix = "" if test_net_id == 0 else f"{test_net_id}/"
            self._row.setdefault("test", {}).update(
                {prefix + k: v for k, v in results.items()})
        return results

    def gather_detection_rows(self, rows):
        """{output: [row arrays]} of every rank (one process: its own)."""
        return rows

    # ------------------------------------------------------------------ update
    def apply_update(self):
        """SGDSolver::ApplyUpdate then Net::Update: rate, clip, then per blob normalize,
        regularize, the solver's rule and data -= diff (a chunk at a time; every element is
        independent, so this equals Caffe's blob-by-blob order), then iter += 1."""
        p = self.param
        rate, self.current_step = learning_rate(p, self.iter, self.current_step)
        self.last_lr = rate
        if p.display and self.iter % p.display == 0:
            log.info("Iteration %d, lr = %s", self.iter, _g(rate))
        net = self.net
        params = net.learnable_params
        clipped = _rules.clip_gradients([b.diff for b in params], p.clip_gradients)
        if clipped:
            norm, scale = clipped
            log.info("Gradient clipping: scaling down gradients (L2 norm %s > %s) by scale "
                     "factor %s", _g(norm), _g(p.clip_gradients), _g(scale))
        f = net.param_data.dtype.type
        n_sets = self.rule.num_history
        n_params = len(params)
        chunks = [(i, start, min(start + CHUNK, blob.count))
                  for i, blob in enumerate(params) for start in range(0, blob.count, CHUNK)]
        n_work = max(1, self.rule.num_scratch)
        kernels = native.kernels(net.param_data.dtype)
        if kernels is not None:
            self._apply_update_compiled(kernels, params, chunks, rate)
            self.iter += 1
            return

        def run(chunks):
            work = [scratch(f"update{k}", (CHUNK,), net.param_data.dtype) for k in range(n_work)]
            for i, start, stop in chunks:
                blob = params[i]
                work_chunk = [s[:stop - start] for s in work]
                g = blob.diff.reshape(-1)[start:stop]
                w = blob.data.reshape(-1)[start:stop]
                hist = [self.history[s * n_params + i].reshape(-1)[start:stop]
                        for s in range(n_sets)]
                _rules.normalize(g, p.iter_size)
                _rules.regularize(g, w, self.local_decay(i), p.regularization_type,
                                  work_chunk[0])
                self.rule.update(g, hist, f(rate) * f(net.lr_mults[i][0]), self.iter, work_chunk)
                w -= g      # Net::Update, while the chunk is in cache

        run_parts(run, split_parts(chunks))
        self.iter += 1

    def _apply_update_compiled(self, kernels, params, chunks, rate):
        """The same per chunk, each chunk one pass of the compiled update (bit for bit the
        NumPy steps')."""
        p, net = self.param, self.net
        f = net.param_data.dtype.type
        n_params = len(params)
        calls = []
        for i, blob in enumerate(params):
            decay = self.local_decay(i)
            kind = _rules.regularization_code(p.regularization_type) if decay else 0
            args = self.rule.kernel_args(f(rate) * f(net.lr_mults[i][0]), self.iter)
            arrays = [blob.diff, blob.data] + [self.history[s * n_params + i]
                                               for s in range(self.rule.num_history)]
            calls.append(([native.ptr(a) for a in arrays], arrays[0].itemsize,
                          (float(decay), kind) + args))

        def run(chunks):
            for i, start, stop in chunks:
                ptrs, size, args = calls[i]
                at = [q + start * size for q in ptrs] + [0] * (4 - len(ptrs))
                kernels.solver_update(*at, stop - start, self.rule.code, 1.0 / p.iter_size,
                                      *args)

        run_parts(run, split_parts(chunks))

    # ------------------------------------------------------------------ snapshots
    def snapshot_filename(self, extension):
        return f"{self.snapshot_prefix}_iter_{self.iter}{extension}"

    #: Stop at a loss that is NaN or infinite (`caffepar train`; Caffe, and so pycaffe's
    #: Solver, trains on).
    stop_on_nonfinite = False

    def _nonfinite_report(self, loss):
        """Where the loss went non-finite: the first layer (in forward order) with a top that
        is not finite."""
        net = self.net
        first = next(((net._layer_names[i], net.blob_names[t])
                      for i in range(len(net.layers)) for t in net.top_ids[i]
                      if not np.isfinite(net.blob_list[t].data).all()), None)
        where = (f'the first layer with a non-finite output is "{first[0]}" (top "{first[1]}")'
                 if first else "every layer's output is finite")
        kept = ("the last snapshot holds finite weights" if self.last_snapshot_iter is not None
                 else "this run wrote no snapshot yet")
        return (f"iteration {self.iter}: the loss is {loss}; {where}. Stopped before the "
                f"update ({kept}; lower base_lr, or --on-nonfinite continue to train on as "
                "Caffe does)")

    def snapshot(self):
        """Caffe's Snapshot: the weights, then the solver state; both written atomically.
        Returns (model path, state path)."""
        p = self.param
        if not _all_finite(self.net.param_data):
            log.warning("Snapshotting weights that are not all finite (NaN or infinite) at "
                        "iteration %d", self.iter)
        arrays = self.snapshot_blob_arrays()
        if p.snapshot_format == HDF5:
            model = self.snapshot_filename(".caffemodel.h5")
            log.info("Snapshotting to HDF5 file %s", model)
            if self.writes_files:
                save_caffemodel_hdf5(self.net, model, write_diff=p.snapshot_diff,
                                     blob_arrays=arrays)
        elif p.snapshot_format == BINARYPROTO:
            model = self.snapshot_filename(".caffemodel")
            log.info("Snapshotting to binary proto file %s", model)
            if self.writes_files:
                save_caffemodel(self.net, model, write_diff=p.snapshot_diff, blob_arrays=arrays)
        else:
            raise SolverError("Unsupported snapshot format.")
        state = self.snapshot_solver_state(model)
        self.last_snapshot_iter = self.iter
        return model, state

    def local_decay(self, i):
        """Weight decay of learnable parameter i in the update."""
        f = self.net.param_data.dtype.type
        return f(self.param.weight_decay) * f(self.net.decay_mults[i][0])

    # Hooks a model-parallel run overrides: whole-size arrays for files, this rank's part back.
    writes_files = True

    def snapshot_blob_arrays(self):
        """None (the net's own blobs), or a function layer -> [(data, diff), ...]."""
        return None

    def snapshot_history(self):
        return self.history

    def snapshot_comm_state(self):
        """Every rank's gradient residual and thresholds (top-k sparsification), for the
        state file: ([], []) when there are none."""
        return [], []

    def restore_comm_state(self, state, path):
        """Take this rank's residual and thresholds back from a read solver state."""

    def history_part(self, index, values):
        """This process's part of history blob `index` read from a solver state."""
        target = self.history[index]
        if values.size != target.size:
            raise SolverError(f"history blob {index} has {values.size} values, the net's "
                              f"parameter has shape {target.shape}")
        return values.reshape(target.shape)

    def _resume_record(self):
        """Our resume record (the RNG, and where every data layer of the train and test nets
        reads next) and the train net's data positions."""
        data = _data_states(self.net)
        positions = []
        for state in data.values():
            if isinstance(state, dict):
                pos = state.get("position", state.get("batch"))
                if isinstance(pos, int):
                    positions.append(pos)
        rng_state = common.rng().bit_generator.state
        tests = [_data_states(net) for net in self.test_nets]
        return _snap.encode_resume_state(rng_state, data, tests), positions

    def snapshot_solver_state(self, model_filename):
        record, positions = self._resume_record()
        residual, threshold = self.snapshot_comm_state()
        state = _snap.SolverStateData(iter=self.iter, learned_net=model_filename,
                                      current_step=self.current_step,
                                      history=self.snapshot_history(),
                                      data_position=positions, rng_state=record,
                                      gradient_residual=residual, gradient_threshold=threshold)
        if self.param.snapshot_format == HDF5:
            path = self.snapshot_filename(".solverstate.h5")
            log.info("Snapshotting solver state to HDF5 file %s", path)
            if self.writes_files:
                _snap.write_hdf5(path, state)
        else:
            path = self.snapshot_filename(".solverstate")
            log.info("Snapshotting solver state to binary proto file %s", path)
            if self.writes_files:
                _snap.write_binary(path, state)
        return path

    def restore(self, state_file):
        """Caffe's Restore (format by the `.h5` ending): iter, learned_net's weights,
        current_step and history. A caffepar state also brings back the RNG and every data
        layer's position, so the run continues exactly; a Caffe state does not have them, so the
        data layers go back to their first record, as in a Caffe process resuming."""
        path = os.fspath(state_file)
        state = _snap.read_solverstate(path)
        if len(state.history) != len(self.history):
            raise SolverError(f"Incorrect length of history blobs: the state has "
                              f"{len(state.history)}, this {self.type} solver keeps "
                              f"{len(self.history)}", path=path)
        try:
            parts = [self.history_part(i, values) for i, (values, _shape, _legacy)
                     in enumerate(state.history)]
        except SolverError as e:
            e.path = path
            raise
        self.iter = state.iter
        if state.learned_net:
            # A snapshot's weights hold every layer of the net that wrote them.
            self.net.copy_from(_snap.find_learned_net(state.learned_net, path),
                               allow_missing=False)
        self.current_step = state.current_step
        log.info("SGDSolver: restoring history")
        for part, target in zip(parts, self.history):
            target[...] = part
        record = state.resume_state()
        if record is not None:
            rng_state = record.get("rng")
            if rng_state is not None:
                common.rng().bit_generator.state = rng_state
            data_states = [record.get("data") or {}] + list(record.get("test") or [])
        else:
            data_states = self._initial_data_states
        for net, states in zip([self.net] + self.test_nets, data_states):
            _set_data_states(net, states)
        self.restore_comm_state(state, path)
        for net in self.test_nets:
            net.share_with(self.net)
        return state


class SGDSolver(Solver):
    solver_type = "SGD"


class NesterovSolver(SGDSolver):
    solver_type = "Nesterov"


class AdaGradSolver(SGDSolver):
    solver_type = "AdaGrad"


class RMSPropSolver(SGDSolver):
    solver_type = "RMSProp"


class AdaDeltaSolver(SGDSolver):
    solver_type = "AdaDelta"


class AdamSolver(SGDSolver):
    solver_type = "Adam"


SOLVERS = {cls.solver_type: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver,
                                            RMSPropSolver, AdaDeltaSolver, AdamSolver)}


def get_solver(param, source=None, base_dir=None):
    """Caffe's SolverRegistry::CreateSolver: the solver class named by the (upgraded) type."""
    if isinstance(param, caffe_pb2.SolverParameter):
        type_name = upgrade_solver(param, source=source)[0].type
    else:
        type_name = upgrade_solver(read_solver_text(param), source=param)[0].type
    cls = SOLVERS.get(type_name)
    if cls is None:
        raise SolverError(f'unknown solver type "{type_name}"', path=source,
                          hint=f"known types: {', '.join(SOLVERS)}")
    return cls(param, source=source, base_dir=base_dir)


def _all_finite(a, chunk=1 << 18):
    """np.isfinite(a).all() a piece at a time: no mask as large as the weights."""
    flat = a.reshape(-1)
    return all(np.isfinite(flat[i:i + chunk]).all() for i in range(0, flat.size, chunk))
