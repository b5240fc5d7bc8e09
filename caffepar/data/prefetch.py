"""Background preparation of batches, as Caffe's BasePrefetchingDataLayer.

A batch is a pure function of its index (the layer derives every random choice from a seed and
the batch index), so the prefetcher only has to produce indices start, start+1, ... in order into
a bounded queue, and restarting at any index reproduces the same stream.
"""
import queue
import threading
import time
import weakref

PREFETCH_COUNT = 3


class _Failure:
    __slots__ = ("index", "error")

    def __init__(self, index, error):
        self.index = index
        self.error = error


class PrefetchError(RuntimeError):
    """A reader thread failed; carries the batch index and the original exception."""

    def __init__(self, index, error):
        super().__init__(f"reading batch {index} failed: {type(error).__name__}: {error}")
        self.index = index
        self.error = error


def _run(produce_ref, start, out, stop):
    index = start
    while not stop.is_set():
        produce = produce_ref()
        if produce is None:
            return
        try:
            item = produce(index)
        except BaseException as e:  # surfaced to the consumer, which raises it in forward()
            item = _Failure(index, e)
        del produce
        while not stop.is_set():
            try:
                out.put((index, item), timeout=0.1)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return
        index += 1


class Prefetcher:
    """Produces `produce(i)` for i = start, start+1, ... on a daemon thread, `depth` batches
    ahead. `produce` is held weakly when it is a bound method, so the owner can be collected;
    the thread then ends by itself."""

    def __init__(self, produce, start=0, depth=PREFETCH_COUNT, name="prefetch"):
        self.depth = max(1, int(depth))
        self.name = name
        try:
            self._produce_ref = weakref.WeakMethod(produce)
        except TypeError:
            self._produce_ref = lambda: produce
        self._thread = None
        self._stop = None
        self._queue = None
        self.restart(start)

    def restart(self, start):
        """Drop read-ahead batches and continue from batch `start`."""
        self.close()
        self._next = int(start)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=_run, name=self.name, daemon=True,
                                        args=(self._produce_ref, self._next, self._queue,
                                              self._stop))
        self._thread.start()

    def next(self):
        """The next batch and the seconds spent waiting for it."""
        t0 = time.perf_counter()
        while True:
            try:
                index, item = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    if self._queue.empty():
                        raise PrefetchError(self._next, RuntimeError("reader thread stopped"))
        waited = time.perf_counter() - t0
        if isinstance(item, _Failure):
            self.close()
            raise PrefetchError(item.index, item.error)
        if index != self._next:
            raise PrefetchError(self._next, RuntimeError(f"got batch {index} out of order"))
        self._next += 1
        return item, waited

    def close(self):
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def __del__(self):
        if self._stop is not None:
            self._stop.set()
