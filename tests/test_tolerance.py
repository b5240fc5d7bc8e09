"""The agreement rule of two float32 forwards (caffepar/graph/tolerance.py): a sigmoid's, tanh's
or softmax's output carries its input's rounding through the function's slope, the layers
that move values move it along, and a real error still fails."""
import numpy as np

from caffepar.graph.net import TEST, Net
from caffepar.graph.tolerance import agree, carried_allowances, own_allowance
from test_inference import P, inp, layer

HEADS = (layer("sig", "Sigmoid", "data", "sig")
         + layer("perm", "Permute", "sig", "perm", "permute_param { order: 0 order: 2 order: 3 "
                 "order: 1 }")
         + layer("flat", "Flatten", "perm", "flat")
         + layer("plain", "Flatten", "data", "plain")
         + layer("cat", "Concat", ["plain", "flat"], "cat", "concat_param { axis: 1 }")
         + layer("th", "TanH", "data", "th")
         + layer("prob", "Softmax", "data", "prob"))


def numpy_forward(x):
    """Every blob of HEADS from the input x, in float64."""
    sig = 1 / (1 + np.exp(-x))
    flat = sig.transpose(0, 2, 3, 1).reshape(len(x), -1)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return {"data": x, "sig": sig, "perm": sig.transpose(0, 2, 3, 1), "flat": flat,
            "plain": x.reshape(len(x), -1),
            "cat": np.concatenate([x.reshape(len(x), -1), flat], axis=1), "th": np.tanh(x),
            "prob": e / e.sum(axis=1, keepdims=True)}


def logits(seed=0):
    """Logits of scale 46 as an SSD's class scores with random weights have."""
    x = np.random.default_rng(seed).uniform(-46, 46, (2, 5, 3, 4))
    x.flat[7] = 0.3                 # where the sigmoid is steepest
    return x


def test_the_rounding_of_its_input_carries_through_each_function():
    net = Net(P(inp(2, 5, 3, 4) + HEADS), phase=TEST)
    x = logits()
    want = numpy_forward(x)
    carried = carried_allowances(net, want.__getitem__)
    assert sorted(carried) == ["cat", "flat", "perm", "prob", "sig", "th"]
    np.testing.assert_array_equal(carried["perm"], carried["sig"].transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(carried["flat"], carried["perm"].reshape(2, -1))
    np.testing.assert_array_equal(carried["cat"][:, :60], 0)     # the input carries nothing
    np.testing.assert_array_equal(carried["cat"][:, 60:], carried["flat"])
    # Inputs moved by as much as their own rounding is allowed, every way: each blob agrees.
    t = own_allowance(x)
    strict_fails = set()
    rng = np.random.default_rng(1)
    edge = 0.999                    # all the way to the allowance, short of its last ulp
    for moves in [rng.uniform(-edge, edge, x.shape) for _ in range(20)] + \
            [np.full(x.shape, edge), np.full(x.shape, -edge)]:
        got = numpy_forward(x + moves * t)
        for name, w in want.items():
            assert agree(got[name], w, carried.get(name)), name
            if not agree(got[name], w):
                strict_fails.add(name)
    # Without the carried part the rule asks more than float32 logits of that scale can give.
    assert {"sig", "th", "prob"} <= strict_fails
    # A real error: three times what is allowed, at one element, fails.
    for name in ("sig", "cat", "th", "prob"):
        got = want[name].copy()
        got.flat[9] += 3 * (own_allowance(want[name]) + carried[name]).flat[9]
        assert not agree(got, want[name], carried[name]), name


def test_the_allowance_is_not_much_wider_than_the_rounding_can_move():
    """Tight where it matters: the worst move of the inputs reaches nearly all of it."""
    net = Net(P(inp(2, 5, 3, 4) + HEADS), phase=TEST)
    x = logits()
    want = numpy_forward(x)
    carried = carried_allowances(net, want.__getitem__)
    t = own_allowance(x)
    steepest = np.unravel_index(7, x.shape)
    moved = numpy_forward(x + 0.999 * t)["sig"][steepest] - want["sig"][steepest]
    assert 0.9 * carried["sig"][steepest] <= moved <= carried["sig"][steepest]


def test_nothing_is_carried_where_the_input_is_gone():
    # In place: the logits are not there to say what the sigmoid's input was allowed.
    text = inp(2, 5, 3, 4) + layer("sig", "Sigmoid", "data", "data") + \
        layer("flat", "Flatten", "data", "flat")
    net = Net(P(text), phase=TEST)
    assert carried_allowances(net, numpy_forward(logits()).__getitem__) == {}

