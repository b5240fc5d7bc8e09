"""What communication costs: an alpha-beta model of each collective caffepar runs, and from it the
comm time of an InnerProduct layer run DATA or MODEL parallel (the paper's volumes plus latency).

A collective on P ranks moving a buffer of n bytes takes

    t = alpha * hops(op, P) + beta * traffic(op, P, n)

with the textbook algorithm forms MPI libraries use for large messages (Thakur, Rabenseifner and
Gropp, "Optimization of collective communication operations in MPICH", IJHPCA 2005):

    op              hops           traffic (bytes through each rank's link)   n is
    allreduce       2 ceil(lg P)   2 (P-1)/P n   (reduce-scatter + allgather)  the buffer
    allgather       ceil(lg P)     (P-1)/P n                                   what is received
    reduce_scatter  ceil(lg P)     (P-1)/P n                                   what is sent
    alltoall        P-1            (P-1)/P n                                   what is sent
    bcast           ceil(lg P)     2 (P-1)/P n   (scatter + allgather)         the buffer

n is the byte count caffepar's communicator records for the call (`CommStats`), so measured
and predicted figures line up call by call. alpha (s per hop) and beta (s per byte) are fitted
per collective from measurements (`caffepar calibrate`), or taken from a network preset.
"""
import json
import math
from dataclasses import dataclass, field

import numpy as np

from caffepar.errors import CaffeparError

OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "bcast")
DATA, MODEL = "DATA", "MODEL"
FORMAT = "caffepar-calibration/1"

#: Cluster networks: (alpha in s, beta in s/byte, source). Latency is the one-way MPI
#: small-message latency and bandwidth the large-message MPI bandwidth as the cited sources
#: publish them for such links.
NETWORKS = {
    # 10 Gb/s Ethernet, MPI over TCP: ~1.17 GB/s of the 1.25 GB/s line rate and ~20 us
    # latency (OSU osu_latency/osu_bw figures for MPICH over TCP on 10GbE NICs; cf. Intel
    # MPI and Open MPI TCP tuning guides, which quote 15-25 us).
    "10gbe": (20e-6, 1 / 1.17e9, "10 Gb/s Ethernet, MPI over TCP: 20 us, 1.17 GB/s"),
    # 25 Gb/s Ethernet, MPI over TCP: ~2.9 GB/s of 3.125 GB/s line rate, ~12 us latency
    # (OSU micro-benchmarks on 25GbE Mellanox ConnectX-4 Lx, TCP path).
    "25gbe": (12e-6, 1 / 2.9e9, "25 Gb/s Ethernet, MPI over TCP: 12 us, 2.9 GB/s"),
    # 100 Gb/s InfiniBand EDR: ~1.1 us latency and ~12.3 GB/s bandwidth (MVAPICH project's
    # published OSU micro-benchmark results on ConnectX-4 EDR; 12.5 GB/s line rate).
    "100gb-ib": (1.1e-6, 1 / 12.3e9, "100 Gb/s InfiniBand EDR: 1.1 us, 12.3 GB/s"),
    # The network lab's links (`caffepar netlab`: veth shaped by tc tbf, MPICH over UCX's TCP),
    # the allreduce fit of `caffepar calibrate` run on 2 lab nodes (results/netlab.md,
    # results/calibration_netlab_<rate>.json): a cluster of small Ethernet links.
    "lab-100mbit": (4.8e-6, 1 / 11.6e6,
                    "lab link at 100 Mbit/s, MPI over TCP (measured): 4.8 us, 11.6 MB/s"),
    "lab-1gbit": (8.8e-6, 1 / 119.6e6,
                  "lab link at 1 Gbit/s, MPI over TCP (measured): 8.8 us, 120 MB/s"),
}

#: Inside a node (hierarchical reduction's reduce-scatter and allgather): MPI over shared
#: memory, ~0.4 us and ~10 GB/s per rank pair as OSU intra-node figures show on current
#: x86 servers (copies by the cores themselves).
NODE = (0.4e-6, 1 / 10e9, "shared memory inside a node: 0.4 us, 10 GB/s")


def node_model():
    alpha, beta, source = NODE
    return CostModel({0: {op: (alpha, beta) for op in OPS}}, source, "node")


def hops(op, ranks):
    lg = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    return {"allreduce": 2 * lg, "allgather": lg, "reduce_scatter": lg,
            "alltoall": ranks - 1, "bcast": lg}[op]


def traffic(op, ranks, nbytes):
    share = (ranks - 1) / ranks
    return (2 if op in ("allreduce", "bcast") else 1) * share * nbytes


@dataclass
class CostModel:
    """alpha and beta per collective (and per measured P when calibrated: the nearest measured
    P's fit predicts another P, so shared-memory effects of oversubscription stay where they
    were measured)."""
    fits: dict                      # {P or 0 (any P): {op: (alpha, beta)}}
    source: str = ""
    transport: str = ""
    info: dict = field(default_factory=dict)

    # ---- making one
    @classmethod
    def from_alpha_beta(cls, alpha, beta, source=None):
        if not (alpha >= 0 and beta > 0):
            raise CaffeparError(f"--alpha must be >= 0 and --beta > 0 (got {alpha}, {beta})")
        return cls({0: {op: (alpha, beta) for op in OPS}},
                   source or f"alpha {alpha * 1e6:g} us, beta {beta:g} s/byte "
                             f"({1 / beta / 1e9:.3g} GB/s)")

    @classmethod
    def preset(cls, name):
        key = name.lower()
        if key not in NETWORKS:
            raise CaffeparError(f"unknown network {name!r}: expected one of "
                                f"{', '.join(NETWORKS)} (or --alpha/--beta, --calibration)")
        alpha, beta, source = NETWORKS[key]
        return cls({0: {op: (alpha, beta) for op in OPS}}, source, transport=key)

    @classmethod
    def load(cls, path):
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise CaffeparError(f"cannot read calibration {path}: {e.strerror}") from None
        except ValueError as e:
            raise CaffeparError(f"{path}: not a calibration file (bad JSON: {e})") from None
        try:
            if doc.get("format") != FORMAT:
                raise ValueError(f'"format" is {doc.get("format")!r}, expected "{FORMAT}"')
            fits = {}
            for ranks, ops in doc["fits"].items():
                fits[int(ranks)] = {op: (float(ops[op]["alpha_s"]), float(ops[op]["beta_s_per_byte"]))
                                    for op in OPS}
                for op, (a, b) in fits[int(ranks)].items():
                    if not (a >= 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)):
                        raise ValueError(f"P={ranks} {op}: alpha and beta must be finite and >= 0")
            if not fits:
                raise ValueError("no fits")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing {e}" if isinstance(e, KeyError) else str(e)
            raise CaffeparError(f"{path}: not a valid calibration file ({what})") from None
        return cls(fits, doc.get("source", str(path)), doc.get("transport", ""),
                   doc.get("info", {}))

    def save(self, path):
        """Write the calibration file (atomically: `calibrate` adds fits to a file users
        keep, and a crash must not lose the ones already in it)."""
        doc = {"format": FORMAT, "source": self.source, "transport": self.transport,
               "info": self.info,
               "fits": {str(p): {op: {"alpha_s": a, "beta_s_per_byte": b}
                                 for op, (a, b) in ops.items()}
                        for p, ops in sorted(self.fits.items())}}
        from caffepar.io.weights import atomic_write
        text = json.dumps(doc, indent=1) + "\n"
        atomic_write(path, lambda f: f.write(text.encode("utf-8")))

    def merged(self, other):
        """This model with `other`'s fits added (a calibration at another P)."""
        fits = dict(self.fits)
        fits.update(other.fits)
        return CostModel(fits, other.source, other.transport or self.transport,
                         {**self.info, **other.info})

    # ---- predicting
    def fit_for(self, ranks):
        if ranks in self.fits:
            return self.fits[ranks]
        return self.fits[min(self.fits, key=lambda p: (abs(p - ranks), -p))]

    def alpha_beta(self, op, ranks):
        return self.fit_for(ranks)[op]

    def collective_s(self, op, ranks, nbytes):
        if ranks <= 1:
            return 0.0
        alpha, beta = self.alpha_beta(op, ranks)
        return alpha * hops(op, ranks) + beta * traffic(op, ranks, nbytes)

    def collective_ms(self, op, ranks, nbytes):
        return 1e3 * self.collective_s(op, ranks, nbytes)


def inner_product_calls(fan_in, num_output, batch, ranks, mode, bias=True, bottom_diff=True,
                        itemsize=4):
    """The collectives one iteration of an InnerProduct runs, as (op, bytes recorded): DATA
    reduces its weight and bias gradients (K*N + N values); MODEL allgathers the bottoms, sends
    the outputs and top diffs back and forth (all-to-all) and reduce-scatters the bottom diff.
    Sizes are each rank's buffers (2*P*M*K + 2*M*N values): the paper's 3*M*K*P + 2*M*N*P
    counts the outputs of all P ranks and a second broadcast of the bottoms, which caffepar
    keeps from forward instead."""
    if ranks <= 1:
        return []
    if mode == DATA:
        return [("allreduce", (fan_in * num_output + (num_output if bias else 0)) * itemsize)]
    m = batch
    calls = [("allgather", ranks * m * fan_in * itemsize),
             ("alltoall", m * num_output * itemsize),
             ("alltoall", m * num_output * itemsize)]
    if bottom_diff:
        calls.append(("reduce_scatter", ranks * m * fan_in * itemsize))
    return calls


def layer_comm_ms(model, fan_in, num_output, batch, ranks, mode, **kw):
    """Predicted comm ms of one iteration of an InnerProduct layer in `mode`."""
    return sum(model.collective_ms(op, ranks, n)
               for op, n in inner_product_calls(fan_in, num_output, batch, ranks, mode, **kw))


def choose_mode(model, fan_in, num_output, batch, ranks, **kw):
    """(mode, DATA ms, MODEL ms): the mode predicted to communicate less time; ties to DATA."""
    data = layer_comm_ms(model, fan_in, num_output, batch, ranks, DATA, **kw)
    mp = layer_comm_ms(model, fan_in, num_output, batch, ranks, MODEL, **kw)
    return (MODEL if mp < data else DATA), data, mp


def fit_alpha_beta(op, samples, large=2 ** 20, small=2 ** 16):
    """(alpha, beta) >= 0 for one collective from (P, bytes, seconds) samples. beta: least
    squares through the origin over messages of at least `large` bytes (the bandwidth of
    messages that leave the caches, as the gradients of big layers do); alpha: the median
    over messages of at most `small` bytes of what beta leaves per hop. With fewer than two
    large messages, non-negative least squares on the relative error of all of them."""
    big = [(p, n, t) for p, n, t in samples if n >= large]
    if len(big) >= 2:
        x = np.array([traffic(op, p, n) for p, n, _ in big])
        h = np.array([hops(op, p) for p, _, _ in big])
        t = np.array([t for _, _, t in big])
        alpha = 0.0
        for _ in range(3):          # each estimate refines the other
            beta = max(float(x @ (t - alpha * h) / (x @ x)), 1e-15)
            left = [(s - beta * traffic(op, p, n)) / hops(op, p)
                    for p, n, s in samples if n <= small and hops(op, p)]
            alpha = max(0.0, float(np.median(left))) if left else 0.0
        return alpha, beta
    rows = np.array([[hops(op, p), traffic(op, p, n)] for p, n, _ in samples], float)
    t = np.array([s for _, _, s in samples], float)
    w = 1.0 / np.maximum(t, 1e-9)
    a, w_rows = rows * w[:, None], t * w
    best = None
    for cols in ([0, 1], [1], [0]):         # non-negative least squares over 2 unknowns
        sol, *_ = np.linalg.lstsq(a[:, cols], w_rows, rcond=None)
        if np.all(sol >= 0):
            x = np.zeros(2)
            x[cols] = sol
            err = float(np.sum((a @ x - w_rows) ** 2))
            if best is None or err < best[0]:
                best = (err, x)
    x = best[1] if best is not None else np.zeros(2)
    return float(x[0]), float(max(x[1], 1e-15))


def describe(model):
    """One line: where the model's alpha and beta come from."""
    if len(model.fits) == 1 and 0 in model.fits:
        return model.source
    ps = ", ".join(f"P={p}" for p in sorted(model.fits))
    return f"calibration {model.source} ({model.transport or 'transport ?'}; fitted at {ps})"


def iteration_comm_ms(plans, modes, model, ranks):
    """Predicted comm ms of one iteration: one allreduce of every replicated gradient (the
    layers run DATA) plus each MODEL layer's collectives. `plans`: LayerPlans, `modes`:
    {layer name: DATA or MODEL}."""
    replicated = sum(p.params for p in plans if modes[p.name] == DATA) * 4
    total = model.collective_ms("allreduce", ranks, replicated) if replicated else 0.0
    for p in plans:
        if modes[p.name] == MODEL:
            total += layer_comm_ms(model, p.fan_in, p.num_output, p.batch, ranks, MODEL)
    return total
