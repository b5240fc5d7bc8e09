"""InnerProduct split by output rows across ranks (the paper's model parallelism).

Rank r holds rows [off_r, off_r + n_r) of the weight and bias. Each rank keeps its own M samples:

forward:  allgather bottoms -> (P*M, K); local GEMM -> (P*M, n_r); all-to-all so that every rank
          gets the full-width (M, N) top of its own samples.
backward: all-to-all of the top diff -> (P*M, n_r); weight/bias diff from the whole global batch
          (exact, nothing to reduce); partial bottom diff (P*M, K) reduce-scattered to each rank's
          M rows. The gathered bottom from forward is kept for backward.

In a data-parallel or one-rank run the same class is a plain InnerProduct, so a net built for
P ranks computes what a one-process net with P times the batch computes.
"""
import numpy as np

from caffepar.errors import NetError
from caffepar.nn.blas import gemm
from caffepar.nn.inner_product import InnerProductLayer
from caffepar.parallel.plan import MODEL, shard_rows


class ParallelInnerProductLayer(InnerProductLayer):
    """An InnerProduct whose mode (DATA or MODEL) the planner decides at set-up."""

    comm = None
    planner = None

    def layer_setup(self, bottom, top):
        p = self.param.inner_product_param
        k = int(np.prod(bottom[0].shape[p.axis if p.axis >= 0 else bottom[0].num_axes + p.axis:]))
        params = p.num_output * k + (p.num_output if p.bias_term else 0)
        axis = p.axis if p.axis >= 0 else bottom[0].num_axes + p.axis
        self.mode, self.mode_reason = self.planner.decide(
            self.param, params, fan_in=k, num_output=p.num_output,
            batch=int(np.prod(bottom[0].shape[:axis])))
        if self.mode == MODEL and p.transpose:
            raise self.error("model parallelism needs transpose: false (weights are split "
                             "by output rows)")
        self.sharded = self.mode == MODEL and self.comm.size > 1
        super().layer_setup(bottom, top)
        if not self.sharded:
            return
        ranks, rank = self.comm.size, self.comm.rank
        self.full_output = self.num_output
        self.row_counts, self.row_offsets = shard_rows(self.num_output, ranks)
        lo, n = int(self.row_offsets[rank]), int(self.row_counts[rank])
        self.rows = slice(lo, lo + n)
        for i, blob in enumerate(self.blobs):
            kept = np.ascontiguousarray(blob.data[self.rows])
            blob.data, blob.diff = kept, np.zeros_like(kept)

    # ---- copying whole (unsharded) blobs in and out, for weights files and snapshots
    def local_part(self, index, full):
        """This rank's rows of a full-size parameter array."""
        return full[self.rows] if self.sharded else full

    def full_shape(self, index):
        shape = self.blobs[index].shape
        return (self.full_output,) + shape[1:] if self.sharded else shape

    def reshape(self, bottom, top):
        if not self.sharded:
            return super().reshape(bottom, top)
        axis = self.axis
        shape = bottom[0].shape
        k = int(np.prod(shape[axis:]))
        if k != self.k:
            raise self.error(f"bottom {shape} gives {k} inputs after axis {axis}, the weights "
                             f"expect {self.k}")
        self.m = int(np.prod(shape[:axis]))
        top[0].reshape(shape[:axis] + (self.full_output,))
        ranks = self.comm.size
        n = int(self.row_counts[self.comm.rank])
        self.gathered = np.empty((ranks * self.m, self.k), self.dtype)
        self.top_part = np.empty((ranks * self.m, n), self.dtype)
        self.exchange = np.empty((ranks, self.m, n), self.dtype)
        self.top_blocks = np.empty(self.m * self.full_output, self.dtype)
        self.partial = np.empty((ranks * self.m, self.k), self.dtype)

    def forward(self, bottom, top):
        if not self.sharded:
            return super().forward(bottom, top)
        comm, m = self.comm, self.m
        n_r = int(self.row_counts[comm.rank])
        comm.allgather(np.ascontiguousarray(bottom[0].data.reshape(m, self.k)), self.gathered,
                       tag=self.name)
        gemm(self.gathered, self.blobs[0].data.T, self.top_part)
        if self.bias_term:
            self.top_part += self.blobs[1].data
        # Block s of the send buffer: samples of rank s, my columns.
        self.exchange[...] = self.top_part.reshape(comm.size, m, n_r)
        counts = m * self.row_counts
        comm.alltoallv(self.exchange.reshape(-1), [m * n_r] * comm.size, self.top_blocks,
                       counts, tag=self.name)
        y = top[0].data.reshape(m, self.full_output)
        start = 0
        for q in range(comm.size):
            nq = int(self.row_counts[q])
            y[:, self.row_offsets[q]:self.row_offsets[q] + nq] = \
                self.top_blocks[start:start + m * nq].reshape(m, nq)
            start += m * nq

    def backward(self, top, propagate_down, bottom):
        if not self.sharded:
            return super().backward(top, propagate_down, bottom)
        comm, m = self.comm, self.m
        n_r = int(self.row_counts[comm.rank])
        dy = top[0].diff.reshape(m, self.full_output)
        start = 0
        for q in range(comm.size):
            nq = int(self.row_counts[q])
            self.top_blocks[start:start + m * nq] = \
                dy[:, self.row_offsets[q]:self.row_offsets[q] + nq].reshape(-1)
            start += m * nq
        comm.alltoallv(self.top_blocks, m * self.row_counts, self.exchange.reshape(-1),
                       [m * n_r] * comm.size, tag=self.name)
        dtop = self.exchange.reshape(comm.size * m, n_r)
        if self.param_propagate_down[0]:
            gemm(dtop.T, self.gathered, self.blobs[0].diff, beta=1.0)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dtop.sum(axis=0)
        if propagate_down[0]:
            gemm(dtop, self.blobs[0].data, self.partial)
            comm.reduce_scatter_block(self.partial, bottom[0].diff.reshape(m, self.k),
                                      tag=self.name)


def layer_factory(comm, planner):
    """For Net(..., layer_factory=...): InnerProduct layers become planner-decided ones."""

    def make(param, phase, dtype, where):
        if param.type != "InnerProduct":
            if param.HasField("parallel_mode") and param.parallel_mode == param.MODEL:
                raise NetError("only InnerProduct layers can run model parallel "
                               "(parallel_mode: MODEL)", layer=param.name,
                               layer_type=param.type, **where)
            return None
        layer = ParallelInnerProductLayer(param, phase, dtype, where)
        layer.comm, layer.planner = comm, planner
        return layer

    return make
