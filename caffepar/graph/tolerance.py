"""How far two float32 forwards of one net may differ blob by blob and still be one computation:
the rule the onnxruntime engine's check and the inference benchmark apply.

A blob's own rounding is allowed RTOL |b| + ATOL_OF_SCALE max |b|. A blob that a sigmoid, tanh
or softmax makes from another also carries its input's allowance through the function's slope:
float32 knows a logit of scale 46 to about 1e-5 of that scale (5e-4), so its sigmoid near 0.5
is known to 1.2e-4 only -- more than 1e-4 of 0.5 -- whichever float32 code computed it.
Layers that only move values (Flatten, Reshape, Permute, Concat, Split) move the carried
allowance with them. Nothing else carries one, nor does a function in place (its input is
gone): those are held to their own rounding.
"""
import numpy as np

RTOL = 1e-4
ATOL_OF_SCALE = 1e-5

_MOVERS = ("Flatten", "Reshape", "Permute", "Concat", "Split")
_SQUASHERS = ("Sigmoid", "TanH", "Softmax")


def own_allowance(want):
    """What one float32 computation of `want` may be off by, element by element."""
    want = np.asarray(want)
    scale = float(np.nanmax(np.abs(want))) if want.size else 0.0
    return RTOL * np.abs(want) + ATOL_OF_SCALE * scale


def agree(got, want, carried=None):
    """Whether `got` is `want` within its own allowance plus the one it carries (same shape)."""
    if np.shape(got) != np.shape(want):
        return False
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    allowed = own_allowance(want)
    if carried is not None:
        allowed = allowed + carried
    diff = np.abs(got - want)
    return bool(np.all((diff <= allowed) | (np.isnan(got) & np.isnan(want))))


def carried_allowances(net, values, names=None):
    """{blob name: the allowance it carries from its inputs} for the blobs `names` (all of the
    net's by default) that carry one; `values(name)` gives a blob's reference array (the net's
    own forward)."""
    writers = {}
    for i, tops in enumerate(net.top_ids):
        for t in tops:
            writers.setdefault(t, []).append(i)
    memo = {}

    def value(bid):
        while len(writers.get(bid, ())) == 1 and net.layers[writers[bid][0]].type == "Split":
            bid = net.bottom_ids[writers[bid][0]][0]       # a split top holds its bottom
        return np.asarray(values(net.blob_names[bid]), np.float64)

    def carried(bid):
        if bid in memo:
            return memo[bid]
        memo[bid] = None
        writer = writers.get(bid, [])
        if len(writer) != 1:
            return None
        i = writer[0]
        layer, bottoms = net.layers[i], list(net.bottom_ids[i])
        if layer.type not in _MOVERS + _SQUASHERS or bid in bottoms:
            return None
        if layer.type in _MOVERS:
            parts = [carried(b) for b in bottoms]
            if all(p is None for p in parts):
                return None
            if layer.type == "Concat":
                parts = [np.zeros(net.blob_list[b].shape) if p is None else p
                         for b, p in zip(bottoms, parts)]
                extra = np.concatenate(parts, axis=layer.axis)
            elif layer.type == "Permute":
                extra = parts[0].transpose(layer.order)
            else:
                extra = parts[0]
            memo[bid] = extra.reshape(net.blob_list[bid].shape)
            return memo[bid]
        x = value(bottoms[0])
        t = own_allowance(x)
        more = carried(bottoms[0])
        if more is not None:
            t = t + more
        memo[bid] = _through(layer, x, t)
        return memo[bid]

    wanted = range(len(net.blob_list)) if names is None else \
        [net.blob_names.index(n) for n in names]
    out = {}
    for bid in wanted:
        extra = carried(bid)
        if extra is not None:
            out[net.blob_names[bid]] = extra
    return out


def _through(layer, x, t):
    """The most a squashing function's output moves when each input moves by at most t."""
    if layer.type == "Softmax":
        # y_i' / y_i = e^{d_i} / sum_j y_j e^{d_j} lies within e^{+-(t_i + max_j t_j)}
        y = np.exp(x - x.max(axis=layer.axis, keepdims=True))
        y /= y.sum(axis=layer.axis, keepdims=True)
        return y * np.expm1(t + t.max(axis=layer.axis, keepdims=True))
    nearest_zero = np.clip(0.0, x - t, x + t)   # where the slope is steepest within reach
    if layer.type == "Sigmoid":
        s = 1.0 / (1.0 + np.exp(-nearest_zero))
        return s * (1.0 - s) * t
    return (1.0 - np.tanh(nearest_zero) ** 2) * t
