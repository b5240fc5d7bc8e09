"""The modelled iteration of a data-parallel run with gradient buckets, and DLGS's optimal
merge of layers into buckets (Ju, Kang, Liu and Huo, Journal of Xi'an Jiaotong University, 2024;
as MG-WFBP).

The model follows what gradsync.py does: forward, then backward from the top layer down; a
bucket's gradients are complete once backward has passed its lowest layer; preparing a bucket
(top-k's selection) runs on the backward's thread and delays the layers below; with overlap a
bucket's communication starts when it is complete and the previous bucket's communication has
ended (comm_start(l) = max(comm_end(l+1), prepare_end(l))), without overlap all of them start
after backward, one after another; the update starts when backward and every communication
have ended. Communication is assumed to take no compute time (a network card moves the data).
"""
from dataclasses import dataclass

from caffepar.parallel.buckets import Bucket


@dataclass
class Modelled:
    iteration_s: float
    comm_s: float
    """Time some bucket is being communicated."""
    exposed_s: float
    """Time the update waits for communication after backward has ended."""


def model_iteration(forward_s, backward_s, update_s, buckets, comm_s, prepare_s=None,
                    overlap=True):
    """Modelled times of one iteration. forward_s: total forward seconds; backward_s: per
    layer (net order); buckets in the order they are sent; comm_s(bucket) / prepare_s(bucket):
    seconds of a bucket's communication / preparation."""
    prepare_s = prepare_s or (lambda bucket: 0.0)
    ready = sorted(((b.ready, n) for n, b in enumerate(buckets)), reverse=True)
    clock = forward_s
    layer = len(backward_s) - 1
    prepared = {}
    for ready_layer, n in ready:
        while layer >= ready_layer:
            clock += backward_s[layer]
            layer -= 1
        if overlap:
            clock += prepare_s(buckets[n])
            prepared[n] = clock
    while layer >= 0:
        clock += backward_s[layer]
        layer -= 1
    if not overlap:
        for n, b in enumerate(buckets):
            clock += prepare_s(b)
            prepared[n] = clock
    comm_end = clock if not overlap else forward_s
    busy = 0.0
    for n, b in enumerate(buckets):
        start = max(comm_end, prepared[n])
        seconds = comm_s(b)
        comm_end = start + seconds
        busy += seconds
    end = max(clock, comm_end)
    return Modelled(end + update_s, busy, end - clock if overlap else comm_end - clock)


def optimal_merge(units, forward_s, backward_s, update_s, comm_s, prepare_s=None):
    """DLGS's merge: from the top layer's bucket down, merge a bucket into the one below
    it (its gradients then travel with that bucket's) whenever the modelled iteration gets
    shorter. O(L^2) model evaluations. Returns the buckets (top first)."""
    buckets = [Bucket([u]) for u in units]

    def cost(candidate):
        return model_iteration(forward_s, backward_s, update_s, candidate, comm_s, prepare_s,
                               overlap=True).iteration_s

    best = cost(buckets)
    n = 0
    while n < len(buckets) - 1:
        merged = buckets[:n] + [Bucket(buckets[n].units + buckets[n + 1].units)] + \
            buckets[n + 2:]
        t = cost(merged)
        if t < best:
            buckets, best = merged, t
        else:
            n += 1
    return buckets


def merge_buckets(units, backward_ms, cost_model, ranks, itemsize=4):
    """`--merge auto`: DLGS's merge of layer buckets with each bucket's allreduce predicted
    by `cost_model` at `ranks`; returns (buckets, (modelled ms with a bucket per layer, with
    the merged buckets))."""
    backward_s = [t / 1e3 for t in backward_ms]

    def comm_s(bucket):
        return cost_model.collective_s("allreduce", ranks, bucket.count * itemsize)

    def modelled(buckets):
        return 1e3 * model_iteration(0.0, backward_s, 0.0, buckets, comm_s).iteration_s

    buckets = optimal_merge(units, 0.0, backward_s, 0.0, comm_s)
    return buckets, (modelled([Bucket([u]) for u in units]), modelled(buckets))


#: Gradient communication options the planner predicts, in the order it prints them.
OPTIONS = ("plain", "overlap", "overlap+merge", "top-k", "hierarchical")


def predict_options(units, forward_ms, backward_ms, update_ms, cost_model, ranks,
                    topk_ratio=0.01, ranks_per_node=None, node_model=None,
                    select_s_per_byte=0.0, itemsize=4):
    """{option: Modelled} of one data-parallel iteration with each gradient option, from
    per-layer compute (forward total, backward per layer in net order, update) and the cost
    model. Top-k sends ceil(ratio * n) (index, value) pairs per layer with an allgather, after a
    selection of `select_s_per_byte` per gradient byte on the backward's thread; hierarchical
    reduce-scatters in nodes of `ranks_per_node` ranks (`node_model`), allreduces the 1/R shards
    across nodes (`cost_model`) and allgathers in the node."""
    import math

    from caffepar.parallel.buckets import layer_buckets, one_bucket
    backward_s = [t / 1e3 for t in backward_ms]
    forward_s, update_s = forward_ms / 1e3, update_ms / 1e3

    def allreduce_s(bucket):
        return cost_model.collective_s("allreduce", ranks, bucket.count * itemsize)

    def topk_s(bucket):
        pairs = sum(math.ceil(topk_ratio * u.count) for u in bucket.units)
        return cost_model.collective_s("allgather", ranks, ranks * pairs * 2 * itemsize)

    def select_s(bucket):
        return select_s_per_byte * bucket.count * itemsize

    def hierarchical_s(bucket):
        r = ranks_per_node or ranks
        nodes = max(1, ranks // r)
        inner = node_model or cost_model
        n = bucket.count * itemsize
        return (inner.collective_s("reduce_scatter", r, n) +
                cost_model.collective_s("allreduce", nodes, n / r) +
                inner.collective_s("allgather", r, n))

    def run(buckets, comm_s, overlap, prepare_s=None):
        return model_iteration(forward_s, backward_s, update_s, buckets, comm_s, prepare_s,
                               overlap=overlap)

    merged, _gain = merge_buckets(units, backward_ms, cost_model, ranks, itemsize)
    return {"plain": run(one_bucket(units), allreduce_s, False),
            "overlap": run(layer_buckets(units), allreduce_s, True),
            "overlap+merge": run(merged, allreduce_s, True),
            "top-k": run(one_bucket(units), topk_s, False, select_s),
            "hierarchical": run(one_bucket(units), hierarchical_s, False)}
