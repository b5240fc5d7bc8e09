"""Which gradients travel together: the replicated gradient of each layer (a unit), grouped into
buckets of consecutive units in the order backward completes them.

A unit's gradient is complete once backward has passed the lowest layer that uses its
parameters (a shared parameter collects gradients from every layer that holds it). Buckets are
contiguous ranges of the net's flat diff buffer, so each is one message.
"""
from dataclasses import dataclass, field

import numpy as np

ALEXNET_SHARE = 0.10
"""The AlexNet-like rule of the patent application "Model training method and device for
AlexNet-like networks": backward time share of the top part, parameter share of the bottom
part."""


@dataclass
class Unit:
    layer: str
    index: int
    lo: int
    hi: int
    ready: int

    @property
    def count(self):
        return self.hi - self.lo


@dataclass
class Bucket:
    units: list = field(default_factory=list)

    @property
    def lo(self):
        return min(u.lo for u in self.units)

    @property
    def hi(self):
        return max(u.hi for u in self.units)

    @property
    def count(self):
        return self.hi - self.lo

    @property
    def ready(self):
        """Complete once backward has finished this layer index."""
        return min(u.ready for u in self.units)

    @property
    def name(self):
        first, last = self.units[-1].layer, self.units[0].layer
        return first if first == last else f"{first}..{last}"


def gradient_units(net):
    """The replicated gradient of every layer that owns parameters, in backward order
    (top layer first): [Unit], each a contiguous range of net.param_diff."""
    users = {}
    for n, (i, _k) in enumerate(net.param_layer_index):
        owner = n if net.param_owner[n] < 0 else net.param_owner[n]
        users.setdefault(owner, []).append(i)
    by_layer = {}
    for n, owner in enumerate(net.param_owner):
        if owner >= 0:
            continue
        j = net.learnable_index[n]
        lo = net.param_offsets[j]
        if lo >= net.replicated_count:
            continue
        hi = lo + net.learnable_params[j].count
        i = net.param_layer_index[n][0]
        unit = by_layer.get(i)
        if unit is None:
            by_layer[i] = Unit(net.layers[i].name, i, lo, hi, min(users[n]))
        else:
            assert unit.hi == lo, "a layer's replicated parameters are contiguous"
            unit.hi = hi
            unit.ready = min(unit.ready, min(users[n]))
    return sorted((u for u in by_layer.values() if u.count), key=lambda u: -u.lo)


def one_bucket(units):
    return [Bucket(list(units))] if units else []


def layer_buckets(units):
    return [Bucket([u]) for u in units]


def fixed_buckets(units, bucket_bytes, itemsize=4):
    """Consecutive units gathered until a bucket holds at least `bucket_bytes` (as PyTorch DDP
    fills its buckets); a larger layer is a bucket of its own."""
    buckets, current, size = [], [], 0
    for u in units:
        current.append(u)
        size += u.count * itemsize
        if size >= bucket_bytes:
            buckets.append(Bucket(current))
            current, size = [], 0
    if current:
        buckets.append(Bucket(current))
    return buckets


def split_buckets(units, split_index):
    """Two buckets: the units of layers from the top down to layer `split_index`, then the
    rest."""
    top = [u for u in units if u.index >= split_index]
    rest = [u for u in units if u.index < split_index]
    return [Bucket(part) for part in (top, rest) if part]


@dataclass
class AlexNetLike:
    """The AlexNet-like detection on a profile: `split` (layer p) is the layer where backward time,
    summed from the top layer down, first passes 10% of the total; the net is AlexNet-like
    when the layers below p hold < 10% of the parameters. The layers from the top down to p
    are then its FC part, the rest its convolution part."""
    alexnet_like: bool
    split: str
    split_index: int
    top_time_share: float
    bottom_param_share: float
    top_layers: list

    def describe(self):
        verdict = "AlexNet-like" if self.alexnet_like else "not AlexNet-like"
        return (f"{verdict}: backward from the top passes {100 * ALEXNET_SHARE:.0f}% of its time "
                f"at {self.split} ({100 * self.top_time_share:.1f}% up to and including it); the "
                f"layers below {self.split} hold {100 * self.bottom_param_share:.1f}% of the "
                f"parameters" + (f"; {', '.join(self.top_layers)} form the FC part, whose "
                                 "gradients are sent while the layers below run backward"
                                 if self.alexnet_like else ""))


def detect_alexnet_like(names, backward_ms, params):
    """AlexNetLike from per-layer backward times and parameter counts (net order)."""
    backward_ms = np.asarray(backward_ms, np.float64)
    params = np.asarray(params, np.float64)
    total_time = backward_ms.sum()
    total_params = max(params.sum(), 1.0)
    acc = 0.0
    split = 0
    for i in range(len(names) - 1, -1, -1):
        acc += backward_ms[i]
        if acc > ALEXNET_SHARE * total_time:
            split = i
            break
    bottom = params[:split].sum() / total_params
    top = [names[i] for i in range(split, len(names)) if params[i]]
    return AlexNetLike(bool(bottom < ALEXNET_SHARE), names[split], split,
                       float(acc / total_time) if total_time else 0.0, float(bottom), top)


def size_text(nbytes):
    return f"{nbytes / 2 ** 20:.2f} MiB" if nbytes >= 2 ** 20 else f"{nbytes / 2 ** 10:.1f} KiB"


def describe_buckets(buckets, itemsize=4):
    return ", ".join(f"[{b.name}: {size_text(b.count * itemsize)}]" for b in buckets)
