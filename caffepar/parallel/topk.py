"""Layer-wise top-k sparsification with residuals (seed 001, DLGS).

Per layer, the gradient plus the layer's residual is thresholded: values with |g| >= the
layer's threshold are sent as (index, value) pairs, the rest stay in the residual and are sent
once they have grown. The exact threshold (the k-th largest |g|, k = ceil(ratio * n)) is
recomputed every `refresh` iterations and reused in between. Residuals and thresholds are per
rank and belong to the solver state.
"""
import math

import numpy as np


class TopK:
    def __init__(self, units, size, ratio, refresh, dtype=np.float32):
        self.units = list(units)
        self.slot = {u.layer: n for n, u in enumerate(self.units)}
        self.ratio = float(ratio)
        self.refresh = int(refresh)
        self.residual = np.zeros(size, dtype)
        self.words = np.dtype(dtype).itemsize // 4     # int32 words per value in a pair
        self.threshold = np.full(len(self.units), np.nan, np.float64)

    def select(self, grad, bucket, iteration):
        """Sparsify the bucket's units of the flat gradient `grad`, updating the residual:
        returns (pair count, int32 [indices relative to bucket.lo ..., values' bits ...])."""
        lo = bucket.lo
        refresh = iteration % self.refresh == 0
        picked, values = [], []
        for u in bucket.units:
            acc = grad[u.lo:u.hi]
            residual = self.residual[u.lo:u.hi]
            acc += residual
            magnitude = np.abs(acc)
            slot = self.slot[u.layer]
            if refresh or np.isnan(self.threshold[slot]):
                k = max(1, math.ceil(self.ratio * u.count))
                self.threshold[slot] = np.partition(magnitude, u.count - k)[u.count - k]
            threshold = self.threshold[slot]
            keep = np.flatnonzero(magnitude >= threshold if threshold > 0 else magnitude > 0)
            residual[...] = acc
            residual[keep] = 0
            picked.append(keep + (u.lo - lo))
            values.append(acc[keep])
        index = np.concatenate(picked).astype(np.int32)
        value = np.concatenate(values)
        return index.size, np.concatenate([index, value.view(np.int32)])

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
        return self.residual, self.threshold.astype(np.float32)

    def set_state(self, residual, threshold):
        self.residual[...] = residual.reshape(-1)
        if threshold is None or threshold.size != self.threshold.size:
            self.threshold[...] = np.nan
        else:
            self.threshold[...] = threshold.reshape(-1)
