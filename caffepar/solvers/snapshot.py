"""Solver state files: Caffe's binary SolverState and HDF5 `.solverstate.h5`, read and written.

History blobs are streamed to and from disk without going through Python protobuf (which is
far too slow for VGG-sized histories). caffepar adds resume fields that Caffe skips when it
reads our files: `data_position` / `rng_state` (fields 1000/1001) in the binary form, and
`data_position` / `rng_state` datasets in the HDF5 form, and, for a run with top-k gradient
sparsification, every rank's gradient residual and thresholds (`gradient_residual` /
`gradient_threshold`, fields 1002/1003 or HDF5 groups of those names, one blob per rank).
"""
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from caffepar.errors import MissingFileError, SolverError
from caffepar.io.weights import (BLOB_DATA, BLOB_SHAPE, SHAPE_DIM, _Truncated, _encode_varint,
                                 _fields, _float_payload, _key, _length_delimited, atomic_write,
                                 decode_blob, temp_name_pattern)
from caffepar.logs import note
from caffepar.proto import caffe_pb2
from caffepar.proto.forks import read_fork_fields

STATE_HISTORY = 3
STATE_RESIDUAL = 1002
STATE_THRESHOLD = 1003
STATE_COUNT = 1004
_STREAMED = (STATE_HISTORY, STATE_RESIDUAL, STATE_THRESHOLD)
CAFFE_STATE_NUMBERS = frozenset(range(1, 5))
"""SolverState's field numbers in BVLC Caffe; the others are read field by field."""
"""Repeated BlobProto fields written and read without going through protobuf."""


@dataclass
class SolverStateData:
    """What a solver state file holds. `history` is a list of (values, shape, legacy_shape)."""

    iter: int = 0
    learned_net: str = None
    current_step: int = 0
    history: list = field(default_factory=list)
    data_position: list = field(default_factory=list)
    rng_state: bytes = None
    gradient_residual: list = field(default_factory=list)
    gradient_threshold: list = field(default_factory=list)

    def resume_state(self):
        """Our JSON resume record ({"rng": ..., "data": {...}}), or None for a Caffe snapshot."""
        if not self.rng_state:
            return None
        try:
            return json.loads(self.rng_state.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None


def _blob_chunks(array):
    """A history BlobProto as pieces in protobuf's field order (data, then shape), so a state
    without our extensions is byte-for-byte what Caffe's own serializer writes."""
    payload = _float_payload(array)
    dims = b"".join(_encode_varint(int(d)) for d in array.shape)
    shape = _length_delimited(BLOB_SHAPE, _length_delimited(SHAPE_DIM, dims) if dims else b"")
    return [_key(BLOB_DATA, 2) + _encode_varint(len(payload)), payload, shape]


def encode_resume_state(rng_state, data_states, test_states=()):
    """The JSON resume record: the RNG state, the train net's data layer states, and those of
    each test net (so test outputs after a resume are those of the uninterrupted run)."""
    return json.dumps({"rng": rng_state, "data": data_states, "test": list(test_states)},
                      sort_keys=True).encode("utf-8")


# ------------------------------------------------------------------------------- binary
def write_binary(path, state):
    """Write a SolverState atomically: our history count first (so a cut anywhere after the
    first bytes is seen), iter, learned_net, history as Caffe orders them, then top-k's state,
    then current_step and our resume fields."""
    count = caffe_pb2.SolverState()
    if state.rng_state is not None:
        count.history_count = len(state.history)
    head = caffe_pb2.SolverState()
    head.iter = int(state.iter)
    if state.learned_net is not None:
        head.learned_net = state.learned_net
    tail = caffe_pb2.SolverState()
    tail.current_step = int(state.current_step)
    tail.data_position.extend(int(p) for p in state.data_position)
    if state.rng_state is not None:
        tail.rng_state = state.rng_state

    def write_blobs(f, number, arrays):
        for h in arrays:
            pieces = _blob_chunks(np.asarray(h))
            f.write(_key(number, 2) + _encode_varint(sum(len(p) for p in pieces)))
            for p in pieces:
                f.write(p)

    def write(f):
        f.write(count.SerializeToString())
        f.write(head.SerializeToString())
        write_blobs(f, STATE_HISTORY, state.history)
        write_blobs(f, STATE_RESIDUAL, state.gradient_residual)
        write_blobs(f, STATE_THRESHOLD, state.gradient_threshold)
        f.write(tail.SerializeToString())       # the resume record last: its presence says
                                                # everything before it was written

    atomic_write(path, write)


def read_binary(path):
    with open(path, "rb") as f:
        buf = f.read()
    if not buf:
        raise SolverError("empty solver state (cut short while being written or copied?)",
                          path=path)
    rest, ours = bytearray(), []
    blobs = {number: [] for number in _STREAMED}
    msg = caffe_pb2.SolverState()
    try:
        for number, wire, _value, s, e, fstart in _fields(buf, 0, len(buf)):
            if number == STATE_HISTORY and wire == 2:
                blobs[number].append(decode_blob(buf, s, e))
            elif number in CAFFE_STATE_NUMBERS:
                rest += buf[fstart:e]
            elif number == STATE_COUNT and fstart:
                # caffepar writes its count first; elsewhere it is another Caffe's field
                ours.append((None, wire, s, e, bytes(buf[fstart:e])))
            else:
                ours.append((number, wire, s, e, bytes(buf[fstart:e])))
        msg.ParseFromString(bytes(rest))
    except (_Truncated, DecodeError):
        raise SolverError("cannot decode as a binary SolverState (truncated or not a "
                          "solverstate)", path=path) from None
    _read_extensions(path, buf, msg, ours, blobs)
    if msg.HasField("history_count"):
        _check_complete(path, msg.history_count, len(blobs[STATE_HISTORY]),
                        msg.HasField("rng_state"))
    return SolverStateData(
        iter=msg.iter,
        learned_net=msg.learned_net if msg.HasField("learned_net") else None,
        current_step=msg.current_step,
        history=blobs[STATE_HISTORY],
        data_position=list(msg.data_position),
        rng_state=msg.rng_state if msg.HasField("rng_state") else None,
        gradient_residual=[values for values, _shape, _legacy in blobs[STATE_RESIDUAL]],
        gradient_threshold=[values for values, _shape, _legacy in blobs[STATE_THRESHOLD]])


def _read_extensions(path, buf, msg, fields, blobs):
    """Our fields of a state (numbers BVLC Caffe does not use), each read where it holds what
    ours holds; any other (a fork's field of the same number) stays unread, as in BVLC Caffe,
    with one note."""
    others, odd = [], None
    for number, wire, s, e, raw in fields:
        if number is None:
            odd = odd or (STATE_COUNT, "history_count (caffepar writes it first)")
            continue
        if number not in blobs:
            others.append((number, raw))
            continue
        try:
            if wire != 2:
                raise _Truncated()
            blobs[number].append(decode_blob(buf, s, e))
        except _Truncated:
            odd = odd or (number, caffe_pb2.SolverState.DESCRIPTOR.fields_by_number[number].name)
    _unread, other = read_fork_fields(msg, others)
    odd = odd or other
    if odd:
        note(f"{os.path.basename(path)}: field {odd[0]} does not hold {odd[1]}, as it does "
             "here; kept as an unknown field, as BVLC Caffe does")


def _check_complete(path, expected, found, has_resume_record):
    """A caffepar state says how many history blobs it holds and ends with its resume record:
    a file with fewer, or without that record, was cut short."""
    if found != expected or not has_resume_record:
        what = f"{found} of its {expected} history blobs" if found != expected else \
            "its history but not its resume record"
        raise SolverError(f"truncated solver state: it holds {what} (cut short while being "
                          "written or copied?)", path=path)


# ------------------------------------------------------------------------------- HDF5
def _write_h5_string(h5file, name, text):
    """A scalar fixed-length, NUL-terminated string dataset, as HDF5's H5LTmake_dataset_string
    (Caffe's hdf5_save_string) writes it."""
    import h5py
    raw = text.encode("utf-8")
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(len(raw) + 1)
    tid.set_strpad(h5py.h5t.STR_NULLTERM)
    space = h5py.h5s.create(h5py.h5s.SCALAR)
    ds = h5py.h5d.create(h5file.id, name.encode(), tid, space)
    ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(raw + b"\0", dtype=f"S{len(raw) + 1}"))


def _read_h5_string(dataset):
    value = dataset[()]
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)[0]
    if isinstance(value, bytes):
        value = value.split(b"\0", 1)[0].decode("utf-8")
    return str(value)


def write_hdf5(path, state):
    """Caffe's SnapshotSolverStateToHDF5 layout: int datasets `iter` and `current_step` (shape
    (1,)), string `learned_net`, group `history` with datasets "0", "1", ...; plus our extras."""
    import h5py

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            f.create_dataset("iter", data=np.array([state.iter], np.int32))
            if state.learned_net is not None:
                _write_h5_string(f, "learned_net", state.learned_net)
            f.create_dataset("current_step", data=np.array([state.current_step], np.int32))
            g = f.create_group("history")
            for i, h in enumerate(state.history):
                g.create_dataset(str(i), data=np.asarray(h, np.float32))
            if state.data_position:
                f.create_dataset("data_position", data=np.asarray(state.data_position, np.int64))
            if state.rng_state is not None:
                f.create_dataset("history_count", data=np.array([len(state.history)], np.int32))
                _write_h5_string(f, "rng_state", state.rng_state.decode("utf-8"))
            for name in ("gradient_residual", "gradient_threshold"):
                arrays = getattr(state, name)
                if arrays:
                    g = f.create_group(name)
                    for i, a in enumerate(arrays):
                        g.create_dataset(str(i), data=np.asarray(a, np.float32))

    atomic_write(path, write, binary=False)


def read_hdf5(path):
    import h5py
    try:
        with h5py.File(path, "r") as f:
            if "iter" not in f or "history" not in f:
                raise SolverError('not a Caffe HDF5 solver state (needs "iter" and "history")',
                                  path=path)
            out = SolverStateData(iter=int(np.asarray(f["iter"]).reshape(-1)[0]))
            if "learned_net" in f:
                out.learned_net = _read_h5_string(f["learned_net"])
            if "current_step" in f:
                out.current_step = int(np.asarray(f["current_step"]).reshape(-1)[0])
            hist = f["history"]
            for i in range(len(hist)):
                if str(i) not in hist:
                    raise SolverError(f'history group lacks dataset "{i}"', path=path)
                arr = np.asarray(hist[str(i)])
                out.history.append((arr.reshape(-1), arr.shape, None))
            if "data_position" in f:
                out.data_position = [int(v) for v in np.asarray(f["data_position"]).reshape(-1)]
            if "rng_state" in f:
                out.rng_state = _read_h5_string(f["rng_state"]).encode("utf-8")
            for name in ("gradient_residual", "gradient_threshold"):
                if name in f:
                    group = f[name]
                    setattr(out, name, [np.asarray(group[str(i)]).reshape(-1)
                                        for i in range(len(group))])
            if "history_count" in f:
                _check_complete(path, int(np.asarray(f["history_count"]).reshape(-1)[0]),
                                len(out.history), out.rng_state is not None)
            return out
    except OSError as e:
        raise SolverError(f"cannot read HDF5 solver state: {e}", path=path) from None


def is_hdf5_name(path):
    """Caffe picks the format of a state file by its name: `.h5` means HDF5."""
    return os.fspath(path).endswith(".h5")


def read_solverstate(path):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise MissingFileError(path, "solver state file")
    return read_hdf5(path) if is_hdf5_name(path) else read_binary(path)


def find_learned_net(learned_net, state_path):
    """The weights file a state names: as written (relative to the working directory, as Caffe
    opens it), else beside the state file, else its base name beside the state file."""
    if os.path.exists(learned_net):
        return learned_net
    folder = os.path.dirname(os.path.abspath(state_path))
    for candidate in (os.path.join(folder, learned_net),
                      os.path.join(folder, os.path.basename(learned_net))):
        if os.path.exists(candidate):
            return candidate
    raise MissingFileError(learned_net, f"weights file named by solver state {state_path}")


# ------------------------------------------------------------------------------- one run per prefix
class PrefixLock:
    """`<snapshot_prefix>.lock`, held (flock) while a run writes snapshots with that prefix, so
    a second run on the same prefix is refused instead of mixing its snapshots with the first
    one's. The kernel drops the lock when its process ends, even on kill -9: a lock file left
    behind never blocks anyone."""

    def __init__(self, prefix):
        self.prefix = os.fspath(prefix)
        self.path = self.prefix + ".lock"
        self.fd = None

    def acquire(self):
        """Take the lock, or raise SolverError naming the run that holds it. Returns False (and
        locks nothing) where the folder is missing or the file system has no locks."""
        import fcntl
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except (FileNotFoundError, PermissionError):
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 400).decode("utf-8", "replace").strip() or "another run"
                os.close(fd)
                raise SolverError(f"{holder} is writing snapshots with the prefix "
                                  f"{self.prefix}", path=self.path,
                                  hint="wait for it to end, or give this run another "
                                       "snapshot_prefix") from None
            except OSError:
                os.close(fd)
                return False
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:    # else the previous holder removed the file as we opened it: retry
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, (f"caffepar run {os.getpid()} on {socket.gethostname()} "
                      f"(since {time.strftime('%Y-%m-%d %H:%M:%S')})\n").encode("utf-8"))
        self.fd = fd
        return True

    def release(self):
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


_LEGACY_TEMP = re.compile(r"\.tmp_[A-Za-z0-9_]{8}(?P<name>.+)")


def stale_temp_files(prefix):
    """Temp files that writes of this prefix's snapshots and CSV left behind when their process
    was killed (only call with the prefix's lock held: then no writer is running)."""
    folder, stem = os.path.split(os.path.abspath(prefix))
    snapshot = temp_name_pattern(f"{stem}_iter_")
    csv = temp_name_pattern(f"{stem}_log.csv")
    found = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        legacy = _LEGACY_TEMP.fullmatch(name)
        if snapshot.fullmatch(name) or csv.fullmatch(name) or name == f"{stem}_log.csv.tmp" \
                or legacy and legacy.group("name").startswith(f"{stem}_iter_"):
            found.append(os.path.join(folder, name))
    return sorted(found)
