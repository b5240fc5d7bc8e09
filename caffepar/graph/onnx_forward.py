"""TEST forwards run by onnxruntime on the net's own ONNX export: an optional engine
(CAFFEPAR_INFERENCE=onnxruntime, with `pip install caffepar[onnx]`) for the nets where a
well-kept runtime is faster at batch 1 than our kernels (its fused NCHWc convolutions).

onnxruntime fuses across blobs a user can read, so what a user reads is kept Caffe's this way:

* the net's outputs, and every blob a user has read since the engine started, are outputs of
  the session and copied into their blobs at every forward;
* every other blob is pending after a forward: its first read, through any reference to the
  Blob, runs the net's own forward on that forward's inputs first (so it holds what Caffe
  computes), and the blob becomes an output of the sessions made from then on;
* a session is made from the weights as they are; once a parameter blob has been read or set
  from outside, every forward first compares the parameters with the copy the session was made
  from and makes a new session when they differ;
* the first forward of every session is checked against the net's own forward (every output
  within rtol 1e-4, a floor of 1e-5 of its scale and what its inputs' rounding carries through
  a sigmoid, tanh or softmax: graph/tolerance.py); where they differ the net runs its own plan
  at those input shapes from then on (other shapes keep their sessions); a net that cannot be
  exported runs its own plan at every shape; the log says why.

Reads are noticed by class: a watched blob's class is a subclass of Blob (no field added) whose
`data` tells the engine before giving the array; the engine puts back the plain class when it
has what it needs, and always before the net's own code runs (`paused`).
"""
import contextlib
import ctypes
import logging
from operator import is_

import numpy as np

from caffepar.blob import Blob
from caffepar.convert.onnx_export import _first_line
from caffepar.graph.tolerance import agree, carried_allowances

log = logging.getLogger(__name__)

#: CAFFEPAR_INFERENCE values that choose this engine.
ENGINE_VALUES = ("onnxruntime", "ort")
#: Sessions kept per net (input shapes x outputs), the least recently made dropped first.
MAX_SESSIONS = 4
#: Layers caffepar runs after onnxruntime's part, with everything after them, when the whole
#: net in onnxruntime disagrees with its own forward: SSD's DetectionOutput, whose ONNX form
#: settles tied scores otherwise than Caffe.
TAIL_TYPES = ("DetectionOutput",)

_DATA = Blob.__dict__["data"]           # the slot itself: reads that tell no one
_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class _Watched(Blob):
    """A blob whose reads and writes of `data` go to its engine's `read` first (`shape`,
    `count` and `num_axes` do not: a forward keeps the shapes)."""
    __slots__ = ()
    engine = None

    @property
    def data(self):
        type(self).engine.read(self)
        return _DATA.__get__(self)

    @data.setter
    def data(self, value):
        type(self).engine.read(self)
        _DATA.__set__(self, value)

    @property
    def shape(self):
        return _DATA.__get__(self).shape

    @property
    def count(self):
        return _DATA.__get__(self).size

    @property
    def num_axes(self):
        return _DATA.__get__(self).ndim


def engine_chosen(value):
    return value.strip().lower() in ENGINE_VALUES


class OnnxForward:
    """The onnxruntime engine of one TEST net (Net._onnx)."""

    def __init__(self, net):
        self.net = net
        self.name = net.name or "(unnamed)"     # for the log
        self.failed = None              # why the net runs its own plan instead
        self.refused = {}               # input shapes -> why the own plan runs at those
        self.busy = 0                   # the net's own code is running
        self.sessions = {}
        self.exposed = False            # a parameter was read or set from outside
        self.inputs = [net.blob_list[i] for i in net.input_ids]
        self.observed = set()           # blob ids read by a user: session outputs
        self._set_tail(None)
        self.pending = False            # watched blobs hold an older forward's values
        self.saved_inputs = None
        self.written = []               # (blob, array) onnxruntime wrote in the last forward
        self.params = [b for layer in net.layers for b in layer.blobs]
        self.param_arrays = ()
        self.snapshot = None
        kinds = {}
        for kind in ("pending", "seen", "param"):
            kinds[kind] = type(f"{kind.title()}Blob", (_Watched,),
                               {"__slots__": (), "engine": self, "kind": kind})
        self.kinds = kinds
        why = self._why_not()
        if why:
            self.fail(why)
        else:
            self._watch(pending=False)

    def _set_tail(self, start):
        """Layers start .. the last run by caffepar after onnxruntime's part (None: none)."""
        net = self.net
        self.tail = start
        tail = range(len(net.layers) if start is None else start, len(net.layers))
        # Blobs the tail writes (caffepar's code, at every forward) and those it reads from
        # onnxruntime's part.
        self.tail_ids = {t for i in tail for t in net.top_ids[i]}
        self.handoff_ids = {b for i in tail for b in net.bottom_ids[i]} - self.tail_ids
        fixed = set(net.input_ids) | set(net.output_ids) | self.tail_ids | self.handoff_ids
        self.watched_ids = [i for i in range(len(net.blob_list)) if i not in fixed]
        self._unread = None             # the watched blobs not observed

    # ------------------------------------------------------------ watching
    def _why_not(self):
        net = self.net
        if net.dtype != np.float32:
            return f"the net computes in {net.dtype.name}; the ONNX export is float32"
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
        except ImportError as e:
            return f"{e.name} is not installed (pip install caffepar[onnx])"
        for i, layer in enumerate(net.layers):
            if not net.bottom_ids[i] and layer.type != "Input":
                return f'layer "{layer.name}" ({layer.type}) makes data; only Input nets run'
            if any(layer.loss_weights):
                return f'layer "{layer.name}" ({layer.type}) is a loss'
        if any(not np.shares_memory(b.data, net.param_data) for b in self.params):
            return "its parameters are shared with another net"
        return None

    def fail(self, why):
        if self.failed is None:
            log.warning("net %s runs its own plan, not onnxruntime: %s", self.name, why)
        self.failed = why
        self.sessions = {}
        self._plain(self.net.blob_list)
        self._plain(self.params)

    @staticmethod
    def _plain(blobs):
        for b in blobs:
            b.__class__ = Blob

    def _watch(self, pending):
        if self.failed:
            return
        if self._unread is None:
            blobs = self.net.blob_list
            self._unread = [blobs[i] for i in self.watched_ids if i not in self.observed]
        cls = self.kinds["pending" if pending else "seen"]
        for b in self._unread:
            b.__class__ = cls
        self.pending = pending
        if not self.exposed:
            cls = self.kinds["param"]
            for b in self.params:
                b.__class__ = cls

    def read(self, blob):
        """A user reads or writes a watched blob's data (its class says which kind)."""
        kind = type(blob).kind
        if kind == "param":
            self.exposed = True
            self._plain(self.params)
            return
        self.observed.add(self.net.blob_list.index(blob))
        self._unread = None
        blob.__class__ = Blob
        if kind == "pending":
            self._materialize()

    @contextlib.contextmanager
    def paused(self, materialize=True):
        """The net's own code runs inside with plain blobs: the values of the last forward in
        every blob first (unless `materialize` is False), watching again afterwards."""
        if self.busy or self.failed:
            yield
            return
        if self.pending and materialize:
            self._materialize()
        self._plain(self.net.blob_list)
        self._plain(self.params)
        self.pending = False
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self._watch(pending=False)

    def _materialize(self):
        """Every pending blob given the values of the last forward: the net's own forward on
        that forward's inputs; what onnxruntime wrote and the inputs as they are now are put
        back afterwards."""
        net = self.net
        self._plain(net.blob_list)
        self.pending = False
        kept = [(blob, array.copy()) for blob, array in self.written]
        now = []
        for blob, saved in zip(self.inputs, self.saved_inputs or ()):
            data = _DATA.__get__(blob)
            if data.shape == saved.shape and not np.array_equal(data, saved):
                now.append((data, data.copy()))
                data[...] = saved
        self._own_forward()
        for blob, values in kept:
            data = _DATA.__get__(blob)
            if data.shape == values.shape:
                data[...] = values
        for array, values in now:
            array[...] = values
        self._watch(pending=False)

    def _own_forward(self):
        self._plain(self.params)
        self.busy += 1
        try:
            self.net.forward_from_to(0, len(self.net.layers) - 1)
        finally:
            self.busy -= 1

    # ------------------------------------------------------------ running
    def forward(self):
        """Run the whole net; False where the net's own plan must run it."""
        if self.failed:
            return False
        shapes = tuple(_DATA.__get__(b).shape for b in self.inputs)
        if shapes in self.refused:
            return False                # before the weights' memcmp: the own plan reads them
        net = self.net
        self._plain(net.blob_list if self._unread is None else self._unread)
        if self.exposed and not self._params_unchanged():
            self.sessions = {}
        key = (shapes, frozenset(self.observed))
        session = self.sessions.get(key)
        if session is None:
            try:
                session = self._session(key)
            except Exception as e:  # noqa: BLE001  (export or runtime refusal: own plan)
                self.fail(_first_line(e))
                return False
        feeds = {name: np.ascontiguousarray(_DATA.__get__(b), np.float32)
                 for name, b in zip(session.input_names, self.inputs)}
        try:
            results = session.run(session.output_names, feeds)
        except Exception as e:  # noqa: BLE001
            self.fail(_first_line(e))
            return False
        self.saved_inputs = [a.copy() for a in feeds.values()]
        written = []
        for blobs, result in zip(session.output_blobs, results):
            for blob in blobs:
                data = _DATA.__get__(blob)
                if data.shape != result.shape:
                    blob.reshape(result.shape)
                    data = _DATA.__get__(blob)
                np.copyto(data, result)
                written.append((blob, data))
        if self.tail is not None:
            self.busy += 1
            try:
                net.forward_from_to(self.tail, len(net.layers) - 1)
            finally:
                self.busy -= 1
            written += [(net.blob_list[t], _DATA.__get__(net.blob_list[t]))
                        for t in sorted(self.tail_ids)]
        self.written = written
        if not session.checked:
            return self._check(session, shapes)
        self._watch(pending=True)
        return True

    def _check(self, session, shapes):
        """The session's first forward against the net's own: the own values stay."""
        ort = [(blob, _DATA.__get__(blob).copy()) for blob, _ in self.written]
        self.written = []
        self._own_forward()
        for blob, got in ort:
            if not self._agrees(blob, got):
                name = self.net.blob_names[self.net.blob_list.index(blob)]
                tail = next((i for i, layer in enumerate(self.net.layers)
                             if layer.type in TAIL_TYPES), None)
                if self.tail is None and tail is not None:
                    log.info("net %s: onnxruntime's \"%s\" differs from the net's own forward; "
                             "%s and what follows run in caffepar", self.name, name,
                             self.net.layers[tail].name)
                    self._plain(self.net.blob_list)
                    self.sessions = {}
                    self._set_tail(tail)
                    self._watch(pending=False)
                    return True
                self._refuse(shapes, f'onnxruntime\'s "{name}" differs from the net\'s own '
                                     'forward')
                return True
        session.checked = True
        self._watch(pending=False)
        return True

    def _agrees(self, blob, got):
        want = _DATA.__get__(blob)
        if got.shape == want.shape and want.ndim == 4 and want.shape[-1] == 7 and \
                want.shape[:2] == (1, 1):
            got, want = _rows_sorted(got), _rows_sorted(want)
        if agree(got, want):
            return True
        net = self.net
        name = net.blob_names[net.blob_list.index(blob)]
        carried = carried_allowances(net, lambda n: _DATA.__get__(net.blobs[n]), [name])
        return name in carried and agree(got, want, carried[name])

    def _refuse(self, shapes, why):
        """The own plan runs every forward at these input shapes."""
        shown = ", ".join("x".join(map(str, s)) for s in shapes)
        log.warning("net %s runs its own plan at input shape %s, not onnxruntime: %s",
                    self.name, shown, why)
        self.refused[shapes] = why
        for key in [k for k in self.sessions if k[0] == shapes]:
            del self.sessions[key]
        self._watch(pending=False)

    def runs_own_plan(self):
        """Why the next forward runs the net's own plan (None: onnxruntime runs it)."""
        if self.failed:
            return self.failed
        return self.refused.get(tuple(_DATA.__get__(b).shape for b in self.inputs))

    def _params_unchanged(self):
        if self.snapshot is None:
            return True
        if not all(map(is_, (b.data for b in self.params), self.param_arrays)):
            return False
        data = self.net.param_data
        return data.size == self.snapshot.size and _memcmp(
            data.ctypes.data, self.snapshot.ctypes.data, data.nbytes) == 0

    def _session(self, key):
        import onnxruntime as ort
        from onnx import TensorProto, helper

        from caffepar.convert.onnx_export import _build
        from caffepar.nn.blas import blas_threads
        net = self.net
        self._plain(self.params)
        why = self._why_not()
        if why:
            raise RuntimeError(why)
        ends = None if self.tail is None else \
            [net.blob_names[b] for b in sorted(self.handoff_ids | set(net.output_ids))
             if b not in self.tail_ids]
        model, current = _build(net, 17, None, fast=True, end=self.tail, outputs=ends)
        outputs = {o.name for o in model.graph.output}
        inputs = {i.name for i in model.graph.input}
        by_tensor = {}
        for bid in sorted((set(net.output_ids) | self.handoff_ids | key[1]) - self.tail_ids):
            name = net.blob_names[bid]
            tensor = current.get(name)
            if name in outputs:
                tensor = name
            if tensor is None or tensor in inputs:
                continue
            if tensor not in outputs:
                model.graph.output.append(
                    helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None))
                outputs.add(tensor)
            by_tensor.setdefault(tensor, []).append(net.blob_list[bid])
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, blas_threads())
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        session = _Session(ort.InferenceSession(model.SerializeToString(), options,
                                                providers=["CPUExecutionProvider"]))
        session.input_names = [net.blob_names[i] for i in net.input_ids]
        session.output_names = list(by_tensor)
        session.output_blobs = list(by_tensor.values())
        self.param_arrays = tuple(b.data for b in self.params)
        self.snapshot = net.param_data.copy()
        while len(self.sessions) >= MAX_SESSIONS:
            self.sessions.pop(next(iter(self.sessions)))
        self.sessions[key] = session
        return session


class _Session:
    """An onnxruntime session and which blobs its outputs fill."""

    def __init__(self, session):
        self.session = session
        self.checked = False
        self.input_names = self.output_names = self.output_blobs = ()

    def run(self, names, feeds):
        return self.session.run(names, feeds)


def _rows_sorted(a):
    """Detections (1 x 1 x N x 7) in a fixed row order: onnxruntime may order ties otherwise."""
    rows = a.reshape(-1, 7)
    return rows[np.lexsort(rows.T[::-1])]
