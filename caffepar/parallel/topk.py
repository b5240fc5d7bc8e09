"""Layer-wise top-k sparsification with residuals: DLGS (Ju, Kang, Liu and Huo, "Dynamic
layer-wise gradient sparsification and gradient merging optimization method for deep neural
networks", Journal of Xi'an Jiaotong University, 2024).

Per layer, the gradient plus the layer's residual is thresholded: values with |g| >= the
layer's threshold are sent as (index, value) pairs, the rest stay in the residual and are sent
once they have grown. The exact threshold (the k-th largest |g|, k = ceil(ratio * n)) is
recomputed every `refresh` iterations and reused in between. Residuals and thresholds are per
rank and belong to the solver state.

With momentum correction (DGC, Lin et al. 2018) for momentum SGD, each rank keeps its own
velocity u = momentum * u + g + weight decay, the residual accumulates u instead of g, and a
value sent leaves both (momentum factor masking: a value's stale momentum does not push it
again); the solver then steps by the reduced values without its own momentum. Without it, a
value held back for many iterations reaches the momentum only when it is sent. (At ratio 1
every value is sent every iteration, so the masking leaves plain SGD without momentum.)
"""
import math

import numpy as np


class TopK:
    """`momentum` > 0 turns momentum correction on; `add_decay(values, lo, hi)` then adds the
    weight decay of the replicated parameters [lo, hi) to `values`."""

    def __init__(self, units, size, ratio, refresh, dtype=np.float32, momentum=0.0,
                 add_decay=None):
        self.units = list(units)
        self.slot = {u.layer: n for n, u in enumerate(self.units)}
        self.ratio = float(ratio)
        self.refresh = int(refresh)
        self.residual = np.zeros(size, dtype)
        self.momentum = np.dtype(dtype).type(momentum)
        self.velocity = np.zeros(size, dtype) if momentum else None
        self.add_decay = add_decay
        self.words = np.dtype(dtype).itemsize // 4     # int32 words per value in a pair
        self.threshold = np.full(len(self.units), np.nan, np.float64)
        self.magnitude = np.empty(0, dtype)
        self.above = np.empty(0, bool)

    def select(self, grad, bucket, iteration):
        """Sparsify the bucket's units of the flat gradient `grad` (left as it was): the
        residual takes the gradient, gives up the values sent and keeps the rest. Returns
        (pair count, int32 [indices relative to bucket.lo ..., values' bits ...])."""
        lo = bucket.lo
        refresh = iteration % self.refresh == 0
        picked, values = [], []
        for u in bucket.units:
            acc = self.residual[u.lo:u.hi]
            if self.velocity is None:
                acc += grad[u.lo:u.hi]
            else:
                velocity = self.velocity[u.lo:u.hi]
                velocity *= self.momentum
                velocity += grad[u.lo:u.hi]
                if self.add_decay is not None:
                    self.add_decay(velocity, u.lo, u.hi)
                acc += velocity
            magnitude, above = self._work(u.count)
            slot = self.slot[u.layer]
            if refresh or np.isnan(self.threshold[slot]):
                k = max(1, math.ceil(self.ratio * u.count))
                np.abs(acc, out=magnitude)
                magnitude.partition(u.count - k)
                self.threshold[slot] = magnitude[u.count - k]
            threshold = self.threshold[slot]
            np.abs(acc, out=magnitude)
            if threshold > 0:
                np.greater_equal(magnitude, threshold, out=above)
            else:
                np.greater(magnitude, 0, out=above)
            keep = np.flatnonzero(above)
            values.append(acc[keep])
            acc[keep] = 0
            if self.velocity is not None:
                velocity[keep] = 0
            picked.append(keep + (u.lo - lo))
        index = np.concatenate(picked).astype(np.int32)
        value = np.concatenate(values)
        return index.size, np.concatenate([index, value.view(np.int32)])

    def _work(self, n):
        """Work arrays for n magnitudes and flags, kept between iterations."""
        if self.magnitude.size < n:
            self.magnitude = np.empty(n, self.residual.dtype)
            self.above = np.empty(n, bool)
        return self.magnitude[:n], self.above[:n]

    def scatter(self, grad, bucket, gathered, counts):
        """The bucket's dense sum over ranks from every rank's pairs (in rank order)."""
        dense = grad[bucket.lo:bucket.hi]
        dense[...] = 0
        start = 0
        for c in counts:
            pairs = gathered[start:start + (1 + self.words) * c]
            dense[pairs[:c]] += pairs[c:].view(dense.dtype)
            start += pairs.size

    # ---- solver state
    def state(self):
        """(residual, then the velocity with momentum correction, as one flat array;
        thresholds)."""
        kept = self.residual if self.velocity is None else \
            np.concatenate([self.residual, self.velocity])
        return kept, self.threshold.astype(np.float32)

    def set_state(self, kept, threshold):
        """From state() of a run with or without momentum correction (a velocity this run
        does not keep is dropped; one it keeps but the state lacks starts at zero)."""
        kept = kept.reshape(-1)
        n = self.residual.size
        self.residual[...] = kept[:n]
        if self.velocity is not None:
            self.velocity[...] = kept[n:] if kept.size == 2 * n else 0
        if threshold is None or threshold.size != self.threshold.size:
            self.threshold[...] = np.nan
        else:
            self.threshold[...] = threshold.reshape(-1)
