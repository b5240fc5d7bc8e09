"""Blob-shuffling and combining layers: numeric gradient checks and NumPy forward references."""
import numpy as np
import pytest

from caffepar.errors import CaffeparError
from caffepar.graph.net import TEST, Net
from caffepar.proto import caffe_pb2
from caffepar.proto.text import parse_text
from gradcheck import check_net_gradients

pytestmark = pytest.mark.usefixtures("kernel_path")


def net_text(inputs, layers, force=True):
    """An Input layer with one top per (name, shape), then the given layer texts."""
    tops = " ".join(f'top: "{n}"' for n, _ in inputs)
    shapes = " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }" for _, s in inputs)
    body = "\n".join(layers) if isinstance(layers, (list, tuple)) else layers
    return f"""
name: "t"
force_backward: {"true" if force else "false"}
layer {{ name: "input" type: "Input" {tops} input_param {{ {shapes} }} }}
{body}
"""


def layer(ltype, bottoms, tops, params="", name="l"):
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    return f'layer {{ name: "{name}" type: "{ltype}" {b} {t} {params} }}'


def copy_layer(src, dst):
    """An identity Power layer: lets a later in-place layer run without overwriting the input."""
    return layer("Power", [src], [dst], name=f"copy_{dst}")


def build(text, phase=TEST, dtype=np.float64):
    return Net(parse_text(text, caffe_pb2.NetParameter()), phase=phase, dtype=dtype)


def forward(text, values, dtype=np.float64):
    net = build(text, dtype=dtype)
    for name, value in values.items():
        net.blobs[name].reshape(value.shape)
        net.blobs[name].data[...] = value
    net.reshape()
    net.forward_from_to()
    return net


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def distinct(k, shape, seed=0, gap=0.1):
    """k arrays whose values differ element-wise by at least `gap` (no ties within a step)."""
    rng = np.random.default_rng(seed)
    ranks = np.argsort(rng.random((k,) + shape), axis=0)
    return list(ranks * gap + rng.standard_normal(shape))


# ---------------------------------------------------------------- Softmax
@pytest.mark.parametrize("shape,axis", [((2, 5, 3, 2), 1), ((2, 5, 3, 2), -1), ((4, 6), 0),
                                        ((3, 7), 1)])
def test_softmax(shape, axis):
    text = net_text([("x", shape)], layer("Softmax", ["x"], ["y"],
                                          f"softmax_param {{ axis: {axis} }}"))
    x = randn(*shape) * 3
    y = forward(text, {"x": x}).blobs["y"].data
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=axis, keepdims=True), rtol=1e-12)
    check_net_gradients(text, {"x": x})


def test_softmax_large_inputs_stay_finite():
    text = net_text([("x", (1, 3))], layer("Softmax", ["x"], ["y"]))
    y = forward(text, {"x": np.array([[1000.0, 1000.0, -1000.0]])}, np.float32).blobs["y"].data
    np.testing.assert_allclose(y, [[0.5, 0.5, 0.0]])


# ---------------------------------------------------------------- Concat / Slice / Split
@pytest.mark.parametrize("params,axis", [("", 1), ("concat_param { axis: 0 }", 0),
                                         ("concat_param { axis: -1 }", 3),
                                         ("concat_param { concat_dim: 2 }", 2)])
def test_concat(params, axis):
    shapes = []
    for k in (1, 2, 3):
        s = [2, 3, 2, 2]
        s[axis] = k
        shapes.append(tuple(s))
    names = ["a", "b", "c"]
    text = net_text(list(zip(names, shapes)), layer("Concat", names, ["y"], params))
    values = {n: randn(*s, seed=i) for i, (n, s) in enumerate(zip(names, shapes))}
    y = forward(text, values).blobs["y"].data
    np.testing.assert_array_equal(y, np.concatenate([values[n] for n in names], axis=axis))
    check_net_gradients(text, values)


def test_concat_single_bottom_and_errors():
    text = net_text([("a", (2, 3))], layer("Concat", ["a"], ["y"]))
    check_net_gradients(text, {"a": randn(2, 3)})
    bad = net_text([("a", (2, 3)), ("b", (3, 3))], layer("Concat", ["a", "b"], ["y"]))
    with pytest.raises(CaffeparError, match="concat axis"):
        build(bad)
    both = net_text([("a", (2, 3))],
                    layer("Concat", ["a"], ["y"], "concat_param { axis: 1 concat_dim: 1 }"))
    with pytest.raises(CaffeparError, match="not both"):
        build(both)


@pytest.mark.parametrize("params,axis,sizes", [
    ("slice_param { axis: 1 slice_point: 1 slice_point: 4 }", 1, [1, 3, 2]),
    ("", 1, [2, 2, 2]),
    ("slice_param { axis: -1 }", 3, [2, 2, 2]),
    ("slice_param { slice_dim: 0 slice_point: 2 slice_point: 3 }", 0, [2, 1, 3])])
def test_slice(params, axis, sizes):
    shape = [6, 6, 3, 6]
    tops = ["a", "b", "c"]
    text = net_text([("x", shape)], layer("Slice", ["x"], tops, params))
    x = randn(*shape)
    net = forward(text, {"x": x})
    parts = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    for t, want in zip(tops, parts):
        np.testing.assert_array_equal(net.blobs[t].data, want)
    check_net_gradients(text, {"x": randn(*shape, seed=1)})


def test_slice_errors():
    uneven = net_text([("x", (2, 5))], layer("Slice", ["x"], ["a", "b"]))
    with pytest.raises(CaffeparError, match="evenly"):
        build(uneven)
    count = net_text([("x", (2, 5))], layer("Slice", ["x"], ["a", "b"],
                                            "slice_param { slice_point: 1 slice_point: 2 }"))
    with pytest.raises(CaffeparError, match="slice_point"):
        build(count)


def test_split_sums_diffs_and_shares_data():
    text = net_text([("x", (2, 3, 4))], layer("Split", ["x"], ["a", "b", "c"]))
    x = randn(2, 3, 4)
    net = forward(text, {"x": x})
    for t in "abc":
        assert np.shares_memory(net.blobs[t].data, net.blobs["x"].data)
    check_net_gradients(text, {"x": x})
    two = net_text([("x", (2, 3))], layer("Split", ["x"], ["a", "b"]))
    check_net_gradients(two, {"x": randn(2, 3)})
    one = net_text([("x", (2, 3))], layer("Split", ["x"], ["a"]))
    check_net_gradients(one, {"x": randn(2, 3)})


def test_implicit_split():
    text = net_text([("x", (2, 3, 4))], [layer("Sigmoid", ["x"], ["s"], name="sig"),
                                         layer("TanH", ["x"], ["t"], name="tanh")])
    net = build(text)
    assert "Split" in [l.type for l in net.layers]
    check_net_gradients(text, {"x": randn(2, 3, 4)})


# ---------------------------------------------------------------- Eltwise
@pytest.mark.parametrize("coeff", [None, (1.0, -0.5, 2.0)])
def test_eltwise_sum(coeff):
    params = "eltwise_param { operation: SUM " + \
        ("".join(f"coeff: {c} " for c in coeff) if coeff else "") + "}"
    names = ["a", "b", "c"]
    text = net_text([(n, (2, 3, 4)) for n in names], layer("Eltwise", names, ["y"], params))
    values = {n: randn(2, 3, 4, seed=i) for i, n in enumerate(names)}
    y = forward(text, values).blobs["y"].data
    c = coeff or (1, 1, 1)
    np.testing.assert_allclose(y, sum(ci * values[n] for ci, n in zip(c, names)), rtol=1e-12)
    check_net_gradients(text, values)


@pytest.mark.parametrize("stable", [True, False])
@pytest.mark.parametrize("k", [2, 3])
def test_eltwise_prod(stable, k):
    names = ["a", "b", "c"][:k]
    params = f"eltwise_param {{ operation: PROD stable_prod_grad: {str(stable).lower()} }}"
    text = net_text([(n, (2, 3, 4)) for n in names], layer("Eltwise", names, ["y"], params))
    values = {n: np.sign(v) * (0.5 + np.abs(v))
              for n, v in ((n, randn(2, 3, 4, seed=i)) for i, n in enumerate(names))}
    y = forward(text, values).blobs["y"].data
    np.testing.assert_allclose(y, np.prod([values[n] for n in names], axis=0), rtol=1e-12)
    check_net_gradients(text, values)


@pytest.mark.parametrize("k", [2, 3])
def test_eltwise_max(k):
    names = ["a", "b", "c"][:k]
    text = net_text([(n, (2, 3, 4)) for n in names],
                    layer("Eltwise", names, ["y"], "eltwise_param { operation: MAX }"))
    values = dict(zip(names, distinct(k, (2, 3, 4))))
    y = forward(text, values).blobs["y"].data
    np.testing.assert_array_equal(y, np.max([values[n] for n in names], axis=0))
    check_net_gradients(text, values)


def test_eltwise_max_ties_go_to_later_of_first_two():
    text = net_text([("a", (3,)), ("b", (3,))],
                    layer("Eltwise", ["a", "b"], ["y"], "eltwise_param { operation: MAX }"))
    net = forward(text, {"a": np.array([1.0, 2.0, 0.0]), "b": np.array([1.0, 1.0, 3.0])})
    net.blobs["y"].diff[...] = 1
    net.backward_from_to()
    np.testing.assert_array_equal(net.blobs["a"].diff, [0, 1, 0])
    np.testing.assert_array_equal(net.blobs["b"].diff, [1, 0, 1])


def test_eltwise_errors():
    shapes = [("a", (2, 3)), ("b", (2, 3))]
    with pytest.raises(CaffeparError, match="coeff"):
        build(net_text(shapes, layer("Eltwise", ["a", "b"], ["y"], "eltwise_param { coeff: 1 }")))
    with pytest.raises(CaffeparError, match="SUM"):
        build(net_text(shapes, layer("Eltwise", ["a", "b"], ["y"],
                                     "eltwise_param { operation: PROD coeff: 1 coeff: 2 }")))
    with pytest.raises(CaffeparError, match="same shape"):
        build(net_text([("a", (2, 3)), ("b", (3, 2))], layer("Eltwise", ["a", "b"], ["y"])))


# ---------------------------------------------------------------- Flatten / Reshape
@pytest.mark.parametrize("params,want", [("", (2, 60)),
                                         ("flatten_param { axis: 1 end_axis: 2 }", (2, 12, 5)),
                                         ("flatten_param { axis: 0 end_axis: -2 }", (24, 5)),
                                         ("flatten_param { axis: 2 }", (2, 3, 20))])
def test_flatten(params, want):
    text = net_text([("x", (2, 3, 4, 5))], layer("Flatten", ["x"], ["y"], params))
    x = randn(2, 3, 4, 5)
    net = forward(text, {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data, x.reshape(want))
    check_net_gradients(text, {"x": x})


@pytest.mark.parametrize("params,want", [
    ("shape { dim: 0 dim: -1 dim: 2 }", (2, 30, 2)),
    ("shape { dim: 6 dim: 2 } axis: 1 num_axes: 2", (2, 6, 2, 5)),
    ("shape { dim: -1 } axis: -3", (2, 3, 20)),
    ("shape { dim: -1 } axis: -1 num_axes: 0", (2, 3, 4, 5, 1)),
    ("shape { dim: 1 } axis: 1 num_axes: 0", (2, 1, 3, 4, 5)),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 }", (2, 3, 4, 5)),
    ("shape { dim: 3 dim: -1 } axis: 0 num_axes: 2", (3, 2, 4, 5))])
def test_reshape(params, want):
    text = net_text([("x", (2, 3, 4, 5))],
                    layer("Reshape", ["x"], ["y"], f"reshape_param {{ {params} }}"))
    x = randn(2, 3, 4, 5)
    net = forward(text, {"x": x})
    assert net.blobs["y"].shape == want
    np.testing.assert_array_equal(net.blobs["y"].data.reshape(-1), x.reshape(-1))
    assert np.shares_memory(net.blobs["y"].data, net.blobs["x"].data)
    check_net_gradients(text, {"x": x})


def test_reshape_follows_input_reshape():
    text = net_text([("x", (2, 3, 4))],
                    layer("Reshape", ["x"], ["y"], "reshape_param { shape { dim: 0 dim: -1 } }"))
    net = forward(text, {"x": randn(5, 3, 4)})
    assert net.blobs["y"].shape == (5, 12)


@pytest.mark.parametrize("params,match", [
    ("shape { dim: -1 dim: -1 }", "more than one -1"),
    ("shape { dim: 7 dim: -1 }", "divisible"),
    ("shape { dim: 7 dim: 3 }", "count"),
    ("shape { dim: 0 } axis: 4", "no axis")])
def test_reshape_errors(params, match):
    text = net_text([("x", (2, 3, 4, 5))],
                    layer("Reshape", ["x"], ["y"], f"reshape_param {{ {params} }}"))
    with pytest.raises(CaffeparError, match=match):
        build(text)


# ---------------------------------------------------------------- Crop / Tile
@pytest.mark.parametrize("params,index", [
    ("crop_param { axis: 1 offset: 1 }", np.s_[:, 1:3, 1:4, 1:3]),
    ("crop_param { axis: 2 offset: 2 offset: 0 }", np.s_[:, :, 2:5, 0:2]),
    ("", np.s_[:, :, 0:3, 0:2]),
    ("crop_param { axis: -1 offset: 3 }", np.s_[:, :, :, 3:5])])
def test_crop(params, index):
    shape_b = {"crop_param { axis: 1 offset: 1 }": (2, 2, 3, 2)}.get(params, (2, 4, 3, 2))
    text = net_text([("a", (2, 4, 5, 5)), ("b", shape_b)], layer("Crop", ["a", "b"], ["y"], params))
    a = randn(2, 4, 5, 5)
    net = forward(text, {"a": a, "b": randn(*shape_b)})
    np.testing.assert_array_equal(net.blobs["y"].data, a[index])
    net = check_net_gradients(text, {"a": a, "b": randn(*shape_b)})
    assert not net.blobs["b"].diff.any()


def test_crop_out_of_bounds():
    text = net_text([("a", (2, 4, 5, 5)), ("b", (2, 4, 3, 3))],
                    layer("Crop", ["a", "b"], ["y"], "crop_param { offset: 3 }"))
    with pytest.raises(CaffeparError, match="out of bounds"):
        build(text)


@pytest.mark.parametrize("axis,tiles", [(1, 3), (-1, 2), (0, 2)])
def test_tile(axis, tiles):
    text = net_text([("x", (2, 3, 4))],
                    layer("Tile", ["x"], ["y"], f"tile_param {{ axis: {axis} tiles: {tiles} }}"))
    x = randn(2, 3, 4)
    net = forward(text, {"x": x})
    reps = [1, 1, 1]
    reps[axis] = tiles
    np.testing.assert_array_equal(net.blobs["y"].data, np.tile(x, reps))
    check_net_gradients(text, {"x": x})


def test_tile_needs_tiles():
    with pytest.raises(CaffeparError, match="tiles"):
        build(net_text([("x", (2, 3))], layer("Tile", ["x"], ["y"])))


# ---------------------------------------------------------------- Reduction
@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis,coeff", [(0, 1.0), (1, 0.5), (-1, -2.0), (2, 3.0)])
def test_reduction(op, axis, coeff):
    text = net_text([("x", (2, 3, 4))], layer(
        "Reduction", ["x"], ["y"],
        f"reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}"))
    x = randn(2, 3, 4)
    x = np.sign(x) * (0.05 + np.abs(x))
    ax = axis % 3
    flat = x.reshape(x.shape[:ax] + (-1,))
    ref = {"SUM": flat.sum(-1), "ASUM": np.abs(flat).sum(-1), "SUMSQ": (flat ** 2).sum(-1),
           "MEAN": flat.mean(-1)}[op] * coeff
    y = forward(text, {"x": x}).blobs["y"].data
    assert y.shape == x.shape[:ax]
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    check_net_gradients(text, {"x": x})


# ---------------------------------------------------------------- Silence / ArgMax
def test_silence_zeroes_diffs():
    text = net_text([("a", (2, 3)), ("b", (4,))], layer("Silence", ["a", "b"], []))
    net = forward(text, {"a": randn(2, 3), "b": randn(4)})
    assert net.outputs == []
    net.blobs["a"].diff[...] = 5
    net.blobs["b"].diff[...] = 5
    net.backward_from_to()
    assert not net.blobs["a"].diff.any() and not net.blobs["b"].diff.any()


@pytest.mark.parametrize("params", ["", "argmax_param { top_k: 3 }",
                                    "argmax_param { out_max_val: true top_k: 2 }",
                                    "argmax_param { axis: 1 top_k: 2 }",
                                    "argmax_param { axis: -1 out_max_val: true }",
                                    "argmax_param { axis: 0 top_k: 3 out_max_val: true }"])
def test_argmax(params):
    shape = (3, 4, 5)
    text = net_text([("x", shape)], layer("ArgMax", ["x"], ["y"], params), force=False)
    x = randn(*shape)
    y = forward(text, {"x": x}).blobs["y"].data
    p = caffe_pb2.ArgMaxParameter()
    if params:
        p = parse_text(params[len("argmax_param {"):-1], caffe_pb2.ArgMaxParameter())
    k = p.top_k
    if p.HasField("axis"):
        v = np.moveaxis(x, p.axis, -1)
        order = np.argsort(-v, axis=-1)[..., :k]
        res = np.take_along_axis(v, order, -1) if p.out_max_val else order
        np.testing.assert_array_equal(y, np.moveaxis(res, -1, p.axis))
    else:
        flat = x.reshape(3, -1)
        order = np.argsort(-flat, axis=-1)[:, :k]
        if p.out_max_val:
            assert y.shape == (3, 2, k)
            np.testing.assert_array_equal(y[:, 0], order)
            np.testing.assert_array_equal(y[:, 1], np.take_along_axis(flat, order, -1))
        else:
            assert y.shape == (3, 1, k)
            np.testing.assert_array_equal(y[:, 0], order)


def test_argmax_ties_prefer_larger_index():
    text = net_text([("x", (1, 4))], layer("ArgMax", ["x"], ["y"], "argmax_param { top_k: 2 }"),
                    force=False)
    y = forward(text, {"x": np.array([[2.0, 1.0, 2.0, 0.5]])}).blobs["y"].data
    np.testing.assert_array_equal(y.reshape(-1), [2, 0])


def test_argmax_top_k_too_large():
    with pytest.raises(CaffeparError, match="top_k"):
        build(net_text([("x", (2, 3))], layer("ArgMax", ["x"], ["y"], "argmax_param { top_k: 4 }"),
                       force=False))


# ---------------------------------------------------------------- BatchReindex / Filter
def test_batch_reindex():
    text = net_text([("x", (4, 3, 2)), ("idx", (6,))], layer("BatchReindex", ["x", "idx"], ["y"]))
    x = randn(4, 3, 2)
    idx = np.array([3, 0, 3, 1, 1, 3], dtype=float)
    net = forward(text, {"x": x, "idx": idx})
    np.testing.assert_array_equal(net.blobs["y"].data, x[idx.astype(int)])
    check_net_gradients(text, {"x": x, "idx": idx}, skip_bottoms=("idx",))
    with pytest.raises(CaffeparError, match="indices"):
        forward(text, {"x": x, "idx": np.array([0, 4, 0, 0, 0, 0.0])})


def test_filter():
    text = net_text([("a", (5, 3)), ("b", (5, 2, 2)), ("sel", (5, 1))],
                    layer("Filter", ["a", "b", "sel"], ["fa", "fb"]))
    net = build(text)
    assert net.blobs["fa"].shape == (5, 3)
    a, b = randn(5, 3), randn(5, 2, 2, seed=1)
    sel = np.array([[1.0], [0.0], [0.0], [2.0], [1.0]])
    for name, value in (("a", a), ("b", b), ("sel", sel)):
        net.blobs[name].data[...] = value
    net.forward_from_to()
    keep = [0, 3, 4]
    np.testing.assert_array_equal(net.blobs["fa"].data, a[keep])
    np.testing.assert_array_equal(net.blobs["fb"].data, b[keep])
    net.blobs["fa"].diff[...] = 1
    net.blobs["fb"].diff[...] = 2
    net.blobs["a"].diff[...] = 7
    net.backward_from_to()
    np.testing.assert_array_equal(net.blobs["a"].diff[:, 0], [1, 0, 0, 1, 1])
    np.testing.assert_array_equal(net.blobs["b"].diff[:, 0, 0], [2, 0, 0, 2, 2])
    assert not net.blobs["sel"].diff.any()
    check_net_gradients(text, {"a": a, "b": b, "sel": sel}, skip_bottoms=("sel",))


# ---------------------------------------------------------------- Parameter / Embed
def test_parameter():
    text = net_text([("x", (2, 3))], [
        'layer { name: "p" type: "Parameter" top: "p" '
        'parameter_param { shape { dim: 2 dim: 3 } } }',
        layer("Eltwise", ["x", "p"], ["y"], "eltwise_param { operation: PROD }", name="mul")])
    w = randn(2, 3, seed=4)

    def prepare(net):
        net.params["p"][0].data[...] = w

    net = check_net_gradients(text, {"x": randn(2, 3)}, prepare=prepare)
    assert net.params["p"][0].shape == (2, 3)
    np.testing.assert_array_equal(net.blobs["p"].data, w)


@pytest.mark.parametrize("bias", [True, False])
def test_embed(bias):
    params = (f"embed_param {{ num_output: 4 input_dim: 5 bias_term: {str(bias).lower()} "
              "weight_filler { type: 'gaussian' std: 1 } bias_filler { type: 'gaussian' std: 1 } }")
    text = net_text([("idx", (2, 3))], layer("Embed", ["idx"], ["y"], params))
    idx = np.array([[0, 4, 2], [2, 2, 1]], dtype=float)
    net = forward(text, {"idx": idx})
    w = net.params["l"][0].data
    want = w[idx.astype(int)] + (net.params["l"][1].data if bias else 0)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-12)
    assert net.bottom_need_backward[1] == [False]
    check_net_gradients(text, {"idx": idx}, skip_bottoms=("idx",))
    with pytest.raises(CaffeparError, match="indices"):
        forward(text, {"idx": np.full((2, 3), 5.0)})


# ---------------------------------------------------------------- Bias / Scale
BIAS_CASES = [
    ("", (3,)), ("bias_param { axis: 1 num_axes: 2 }", (3, 4)),
    ("bias_param { num_axes: 0 }", ()), ("bias_param { axis: 0 num_axes: -1 }", (2, 3, 4, 2)),
    ("bias_param { axis: -1 }", (2,))]


@pytest.mark.parametrize("params,pshape", BIAS_CASES)
@pytest.mark.parametrize("in_place", [False, True])
def test_bias_learned(params, pshape, in_place):
    filler = "filler { type: 'gaussian' std: 1 }"
    params = params.replace("}", f" {filler} }}") if params else f"bias_param {{ {filler} }}"
    src = "c" if in_place else "x"
    layers = ([copy_layer("x", "c")] if in_place else []) + \
        [layer("Bias", [src], ["c" if in_place else "y"], params)]
    text = net_text([("x", (2, 3, 4, 2))], layers)
    x = randn(2, 3, 4, 2)
    net = forward(text, {"x": x})
    b = net.params["l"][0].data
    assert b.shape == pshape
    out = net.blobs["c" if in_place else "y"].data
    expect = x + _broadcast(b, params, x.ndim)
    np.testing.assert_allclose(out, expect, rtol=1e-12)
    check_net_gradients(text, {"x": x})


def _broadcast(p, params, ndim):
    """Aligns a bias/scale parameter with the bottom axes it applies to."""
    if p.ndim == 0:
        return p
    axis = 1
    if "axis: 0" in params:
        axis = 0
    elif "axis: -1" in params:
        axis = ndim - 1
    return p.reshape((1,) * axis + p.shape + (1,) * (ndim - axis - p.ndim))


@pytest.mark.parametrize("axis,bshape", [(1, (3, 4)), (0, (2,)), (2, (4, 2))])
def test_bias_two_bottoms(axis, bshape):
    text = net_text([("x", (2, 3, 4, 2)), ("b", bshape)],
                    layer("Bias", ["x", "b"], ["y"], f"bias_param {{ axis: {axis} }}"))
    x, b = randn(2, 3, 4, 2), randn(*bshape, seed=1)
    y = forward(text, {"x": x, "b": b}).blobs["y"].data
    np.testing.assert_allclose(y, x + b.reshape((1,) * axis + bshape + (1,) * (4 - axis - b.ndim)))
    check_net_gradients(text, {"x": x, "b": b})


def test_bias_shape_mismatch():
    text = net_text([("x", (2, 3, 4)), ("b", (4,))], layer("Bias", ["x", "b"], ["y"]))
    with pytest.raises(CaffeparError, match="does not match"):
        build(text)


@pytest.mark.parametrize("params,pshape", BIAS_CASES)
@pytest.mark.parametrize("bias_term", [False, True])
def test_scale_learned(params, pshape, bias_term):
    extra = "filler { type: 'gaussian' std: 1 } " + \
        ("bias_term: true bias_filler { type: 'gaussian' std: 1 }" if bias_term else "")
    params = params.replace("bias_param", "scale_param")
    params = params.replace("}", f" {extra} }}") if params else f"scale_param {{ {extra} }}"
    text = net_text([("x", (2, 3, 4, 2))], layer("Scale", ["x"], ["y"], params))
    x = randn(2, 3, 4, 2)
    net = forward(text, {"x": x})
    blobs = net.params["l"]
    assert len(blobs) == 1 + bias_term
    assert all(b.shape == pshape for b in blobs)
    want = x * _broadcast(blobs[0].data, params, 4)
    if bias_term:
        want = want + _broadcast(blobs[1].data, params, 4)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-12)
    check_net_gradients(text, {"x": x})


def test_scale_default_filler_is_one_and_bias_zero():
    text = net_text([("x", (2, 3))],
                    layer("Scale", ["x"], ["y"], "scale_param { bias_term: true }"))
    net = build(text)
    np.testing.assert_array_equal(net.params["l"][0].data, np.ones(3))
    np.testing.assert_array_equal(net.params["l"][1].data, np.zeros(3))


@pytest.mark.parametrize("axis,sshape,bias_term", [(1, (3, 4), True), (0, (2,), False),
                                                   (0, (2, 3), True), (1, (), True)])
def test_scale_two_bottoms(axis, sshape, bias_term):
    params = f"scale_param {{ axis: {axis} bias_term: {str(bias_term).lower()} " \
             "bias_filler { type: 'gaussian' std: 1 } }"
    text = net_text([("x", (2, 3, 4, 2)), ("s", sshape)], layer("Scale", ["x", "s"], ["y"], params))
    x, s = randn(2, 3, 4, 2), randn(*sshape, seed=1)
    net = forward(text, {"x": x, "s": s})
    ax = 0 if not sshape else axis
    bshape = (1,) * ax + sshape + (1,) * (4 - ax - len(sshape))
    want = x * s.reshape(bshape)
    if bias_term:
        assert net.params["l"][0].shape == sshape
        want = want + net.params["l"][0].data.reshape(bshape)
    np.testing.assert_allclose(net.blobs["y"].data, want, rtol=1e-12)
    check_net_gradients(text, {"x": x, "s": s})


@pytest.mark.parametrize("bias_term", [False, True])
def test_scale_in_place(bias_term):
    params = "scale_param { filler { type: 'gaussian' std: 1 } " + \
        ("bias_term: true bias_filler { type: 'gaussian' std: 1 } }" if bias_term else "}")
    text = net_text([("x", (2, 3, 4))],
                    [copy_layer("x", "c"), layer("Scale", ["c"], ["c"], params)])
    x = randn(2, 3, 4)
    net = forward(text, {"x": x})
    want = x * net.params["l"][0].data.reshape(1, 3, 1)
    if bias_term:
        want += net.params["l"][1].data.reshape(1, 3, 1)
    np.testing.assert_allclose(net.blobs["c"].data, want, rtol=1e-12)
    check_net_gradients(text, {"x": x})
    two = net_text([("x", (2, 3, 4)), ("s", (3,))],
                   [copy_layer("x", "c"), layer("Scale", ["c", "s"], ["c"])])
    check_net_gradients(two, {"x": x, "s": randn(3, seed=2)})


def test_scale_param_diff_accumulates():
    text = net_text([("x", (2, 3, 4))],
                    layer("Scale", ["x"], ["y"], "scale_param { bias_term: true }"))
    net = forward(text, {"x": randn(2, 3, 4)})
    net.blobs["y"].diff[...] = randn(2, 3, 4, seed=3)
    net.backward_from_to()
    once = [b.diff.copy() for b in net.params["l"]]
    net.backward_from_to()
    for b, g in zip(net.params["l"], once):
        np.testing.assert_allclose(b.diff, 2 * g)


def test_float32_layers_keep_dtype():
    text = net_text([("x", (2, 3, 4))], [
        layer("Scale", ["x"], ["s"], "scale_param { bias_term: true }", name="scale"),
        layer("Softmax", ["s"], ["p"], name="sm"),
        layer("Reduction", ["p"], ["r"], "reduction_param { operation: SUMSQ axis: 1 }",
              name="red")])
    net = forward(text, {"x": randn(2, 3, 4).astype(np.float32)}, np.float32)
    net.blobs["r"].diff[...] = 1
    net.backward_from_to()
    for name in ("s", "p", "r"):
        assert net.blobs[name].data.dtype == np.float32
    assert net.blobs["x"].diff.dtype == np.float32
