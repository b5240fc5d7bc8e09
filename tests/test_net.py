"""Net construction: the filter and split passes (text in, text out), wiring rules, which layers
run backward, weight sharing and the flat parameter buffers."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffepar.errors import LayerError, NetError
from caffepar.graph.net import TRAIN, Net
from caffepar.graph.passes import filter_net, insert_splits
from caffepar.proto import caffe_pb2


def P(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def same(a, b):
    assert text_format.MessageToString(a) == text_format.MessageToString(b)


def test_filter_by_phase_level_stage():
    net = P("""
      state { phase: TRAIN level: 2 stage: "a" }
      layer { name: "always" type: "Input" top: "x" }
      layer { name: "train" type: "ReLU" include { phase: TRAIN } }
      layer { name: "test" type: "ReLU" include { phase: TEST } }
      layer { name: "lvl3" type: "ReLU" include { min_level: 3 } }
      layer { name: "lvl1" type: "ReLU" include { max_level: 1 } }
      layer { name: "stage_a" type: "ReLU" include { stage: "a" } }
      layer { name: "not_a" type: "ReLU" include { not_stage: "a" } }
      layer { name: "ex_train" type: "ReLU" exclude { phase: TRAIN } }
      layer { name: "either" type: "ReLU" include { phase: TEST } include { stage: "a" } }
    """)
    kept = [l.name for l in filter_net(net).layer]
    assert kept == ["always", "train", "stage_a", "either"]
    same(filter_net(filter_net(net)), filter_net(net))


def test_insert_splits_text_in_text_out():
    net = P("""
      layer { name: "data" type: "Input" top: "data" }
      layer { name: "a" type: "ReLU" bottom: "data" top: "a" }
      layer { name: "b" type: "ReLU" bottom: "data" top: "b" }
      layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" }
    """)
    want = P("""
      layer { name: "data" type: "Input" top: "data" }
      layer { name: "data_data_0_split" type: "Split" bottom: "data"
              top: "data_data_0_split_0" top: "data_data_0_split_1" }
      layer { name: "a" type: "ReLU" bottom: "data_data_0_split_0" top: "a" }
      layer { name: "b" type: "ReLU" bottom: "data_data_0_split_1" top: "b" }
      layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" }
    """)
    got = insert_splits(net)
    same(got, want)
    same(insert_splits(got), got)


def test_split_of_weighted_loss_top_carries_weight_on_first_split_only():
    net = P("""
      layer { name: "data" type: "Input" top: "x" }
      layer { name: "l" type: "ReLU" bottom: "x" top: "y" loss_weight: 2 }
      layer { name: "c" type: "ReLU" bottom: "y" top: "z" }
    """)
    got = insert_splits(net)
    split = got.layer[2]
    assert split.type == "Split" and list(split.loss_weight) == [2.0, 0.0]
    assert not got.layer[1].loss_weight
    assert got.layer[3].bottom[0] == "y_l_0_split_1"


def test_in_place_inputs_outputs_and_backward_rule():
    net = Net(P("""
      layer { name: "in" type: "Input" top: "x" top: "label"
              input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
      layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
              inner_product_param { num_output: 4 } }
      layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
      layer { name: "side" type: "InnerProduct" bottom: "x" top: "side"
              inner_product_param { num_output: 2 } }
      layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """), TRAIN)
    assert net.inputs == ["x", "label"]
    assert net.outputs == ["loss", "side"]
    need = dict(zip(net._layer_names, net.layer_need_backward))
    assert need["ip"] and need["relu"] and need["loss"]
    assert not need["side"], "a layer that feeds no loss does not run backward"
    assert net.bottom_need_backward[net.layer_index("loss")] == [True, False]
    assert net.bottom_need_backward[net.layer_index("ip")] == [False]
    for i, layer in enumerate(net.layers):        # the layers' hint (a conv picks its engine)
        assert layer.bottom_need_diff == net.bottom_need_backward[i]


def test_force_backward_and_propagate_down():
    text = """
      {force}
      layer { name: "in" type: "Input" top: "x" top: "label"
              input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
      layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
              inner_product_param { num_output: 4 } }
      layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
              {pd} }
    """
    net = Net(P(text.replace("{force}", "force_backward: true").replace("{pd}", "")), TRAIN)
    assert net.bottom_need_backward[net.layer_index("ip")] == [True]
    assert net.layers[net.layer_index("ip")].bottom_need_diff == [True]
    assert net.bottom_need_backward[net.layer_index("loss")] == [True, False]
    net = Net(P(text.replace("{force}", "").replace(
        "{pd}", "propagate_down: false propagate_down: false")), TRAIN)
    assert not net.layer_need_backward[net.layer_index("ip")]


def test_unknown_bottom_and_duplicate_top_name_the_layer():
    with pytest.raises(NetError, match=r'layer "b".*unknown bottom blob "nope"'):
        Net(P('layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } }\n'
              'layer { name: "b" type: "ReLU" bottom: "nope" top: "y" }'))
    with pytest.raises(NetError, match=r'top blob "x" produced by multiple sources'):
        Net(P('layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } }\n'
              'layer { name: "b" type: "Input" top: "x" input_param { shape { dim: 1 } } }'))


def test_weight_sharing_and_flat_buffers():
    net = Net(P("""
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "a" type: "InnerProduct" bottom: "x" top: "a"
              param { name: "w" lr_mult: 1 } param { name: "b" lr_mult: 2 }
              inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1 } } }
      layer { name: "b" type: "InnerProduct" bottom: "a" top: "b"
              param { name: "w" } param { name: "b" }
              inner_product_param { num_output: 3 } }
      layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" }
    """), TRAIN)
    wa, wb = net.params["a"][0], net.params["b"][0]
    assert np.shares_memory(wa.data, wb.data) and np.shares_memory(wa.diff, wb.diff)
    assert len(net.learnable_params) == 2
    assert net.param_data.size == 3 * 3 + 3
    for blob in net.learnable_params:
        assert np.shares_memory(blob.data, net.param_data)
        assert np.shares_memory(blob.diff, net.param_diff)
    assert [m[0] for m in net.lr_mults] == [1.0, 2.0]
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    net.forward(x=x)
    net.clear_param_diffs()
    net.backward()
    assert np.abs(net.param_diff).sum() > 0


def test_shared_param_shape_mismatch_is_an_error():
    with pytest.raises(NetError, match="cannot share param"):
        Net(P("""
          layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
          layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" param { name: "w" }
                  inner_product_param { num_output: 3 } }
          layer { name: "b" type: "InnerProduct" bottom: "a" top: "b" param { name: "w" }
                  inner_product_param { num_output: 4 } }
        """))


def test_loss_weight_scales_loss_and_gradient():
    text = """
      layer { name: "in" type: "Input" top: "a" top: "b"
              input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" %s }
      force_backward: true
    """
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 2, 3)).astype(np.float32)
    losses, grads = [], []
    for lw in ("", "loss_weight: 3"):
        net = Net(P(text % lw), TRAIN)
        net.blobs["a"].data[...] = a
        net.blobs["b"].data[...] = b
        losses.append(net.forward_from_to())
        net.backward_from_to()
        grads.append(net.blobs["a"].diff.copy())
    assert np.isclose(losses[1], 3 * losses[0])
    np.testing.assert_allclose(grads[1], 3 * grads[0], rtol=1e-6)


def test_loss_layer_without_top_gets_an_anonymous_one():
    """Caffe's AutoTopBlobs: the loss still counts (same value and gradients as with a named
    top) but the top is no output and no later layer can read it."""
    text = """
      layer { name: "in" type: "Input" top: "x" top: "label"
              input_param { shape { dim: 4 dim: 5 } shape { dim: 4 } } }
      layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
              inner_product_param { num_output: 3 weight_filler { type: "gaussian" } } }
      layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" %s }
      layer { name: "l2" type: "EuclideanLoss" bottom: "ip" bottom: "ip" loss_weight: 0.5 }
    """
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    results = []
    for top in ('top: "loss"', ""):
        net = Net(P(text % top), TRAIN)
        if results:
            net.params["ip"][0].data[...] = results[0][2]
        net.blobs["x"].data[...] = x
        net.blobs["label"].data[...] = [0, 2, 1, 2]
        loss = net.forward_from_to()
        net.backward_from_to()
        results.append((loss, net.params["ip"][0].diff.copy(), net.params["ip"][0].data.copy(),
                        net.outputs))
    (named, named_grad, _, named_outputs), (anon, anon_grad, _, anon_outputs) = results
    assert named_outputs == ["loss"] and anon_outputs == []
    assert np.isclose(named, anon) and anon > 0
    np.testing.assert_allclose(anon_grad, named_grad, rtol=1e-6)
    assert net.blob_names.count("(automatic)") == 2
    with pytest.raises(NetError, match=r'unknown bottom blob "\(automatic\)"'):
        Net(P(text % "" + """layer { name: "s" type: "Silence" bottom: "(automatic)" }"""), TRAIN)
    with pytest.raises(LayerError, match="at least 1 top"):
        Net(P("""layer { name: "in" type: "Input" top: "x" top: "y"
                         input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
                 layer { name: "acc" type: "Accuracy" bottom: "x" bottom: "y" }"""), TRAIN)


def test_bottom_whose_producers_the_rules_drop_names_the_stage_that_keeps_them(tmp_path):
    from caffepar.graph.net import TEST
    path = tmp_path / "staged.prototxt"
    path.write_text('layer { name: "data" type: "Input" top: "data" include { stage: "deploy" }\n'
                    '        input_param { shape { dim: 1 dim: 3 } } }\n'
                    'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
                    '        inner_product_param { num_output: 2 } }\n')
    with pytest.raises(NetError) as info:
        Net(str(path), phase=TEST)
    assert str(info.value) == (
        f'{path}:3: error: layer "ip" (InnerProduct): bottom blob "data" (bottom index 0) is made '
        'only by layer "data" (Input), which the include/exclude rules drop in this state '
        '(phase TEST, level 0, stages: none); --stage deploy keeps layer "data"')
    assert Net(str(path), phase=TEST, stages=("deploy",)).blobs["ip"].shape == (1, 2)


def test_producers_one_per_state_are_named_once_with_every_state_that_keeps_one(tmp_path):
    from caffepar.graph.net import TEST
    path = tmp_path / "autoencoder.prototxt"
    data = ('layer {{ name: "data" type: "Input" top: "data" include {{ {} }}\n'
            '        input_param {{ shape {{ dim: 1 dim: 3 }} }} }}\n')
    path.write_text(data.format("phase: TRAIN") + data.format('phase: TEST stage: "on-train"')
                    + data.format('phase: TEST stage: "on-test"') +
                    'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"\n'
                    '        inner_product_param { num_output: 2 } }\n')
    with pytest.raises(NetError) as info:
        Net(str(path), phase=TEST)
    assert str(info.value).endswith(
        'is made only by 3 layers "data" (Input), which the include/exclude rules drop in this '
        'state (phase TEST, level 0, stages: none); --phase TRAIN keeps layer "data"; --stage '
        'on-train keeps layer "data"; or --stage on-test keeps layer "data"')
    assert Net(str(path), phase=TEST, stages=("on-test",)).blobs["ip"].shape == (1, 2)


def _relu_chain(path, layers):
    path.write_text('layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 1 '
                    'dim: 4 } } }\n' + "".join(f'layer {{ name: "r{i}" type: "ReLU" bottom: "x" '
                                               'top: "x" }\n' for i in range(layers)))
    return path


def test_huge_net_build_shows_progress_and_too_huge_is_refused_up_front(tmp_path, monkeypatch,
                                                                         capsys):
    """Building a net of many layers says how far it has got (convert info, time: every
    command); a net whose layers would need more memory than the machine has is refused in one
    line before it is built."""
    from caffepar import logs
    from caffepar.cli import main
    path = _relu_chain(tmp_path / "chain.prototxt", 1999)
    # As in a fresh process with no log set up (an earlier test's may still hold its stream).
    monkeypatch.setattr(logs.LOGGER, "disabled", True)
    monkeypatch.setattr(Net, "PROGRESS_LAYERS", 100)
    with pytest.raises(SystemExit) as ended:
        main(["convert", "info", str(path)])
    err = capsys.readouterr().err
    assert ended.value.code == 0
    assert f"Building {path}: 50% (1,000 of 2,000 layers)" in err.splitlines()
    monkeypatch.setattr(logs, "available_memory", lambda: 2 << 20)
    with pytest.raises(SystemExit) as ended:
        main(["time", "--model", str(path), "--iterations", "1"])
    err = capsys.readouterr().err
    assert ended.value.code == 1
    assert err.strip() == (f"caffepar: {path}: error: the net has 2,000 layers: building them "
                           "needs about 3 MB, and this machine has 2 MB available")


FOLD_NET = """
  layer { name: "in" type: "Input" top: "x" top: "t"
          input_param { shape { dim: 6 dim: 3 dim: 12 dim: 12 } shape { dim: 6 dim: 8 dim: 6 dim: 6 } } }
  layer { name: "conv1" type: "Convolution" bottom: "x" top: "conv1"
          convolution_param { num_output: 16 kernel_size: 3 pad: 1
                              weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" %(relu)s }
  layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
          pooling_param { pool: %(pool)s kernel_size: 3 stride: 2 } }
  layer { name: "relu2" type: "ReLU" bottom: "pool1" top: "pool1" %(relu)s }
  layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
          convolution_param { num_output: 8 kernel_size: 3 pad: 1
                              weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "relu3" type: "ReLU" bottom: "conv2" top: "conv2" %(relu)s }
  layer { name: "loss" type: "EuclideanLoss" bottom: "conv2" bottom: "t" top: "loss" }
  force_backward: true
"""


def _use_kernels(kernels, engine, threads, monkeypatch):
    """Run on `kernels` ("native": skip where they cannot be built), the convolution engine
    `engine` (empty: the measured choice) and `threads` direct-engine threads."""
    from caffepar.nn import native
    from caffepar.nn.conv import direct
    if kernels == "native":
        try:
            with native.use("native"):
                native.kernels("float32")
        except native.KernelBuildError as e:
            pytest.skip(f"compiled kernels unavailable: {e}")
    monkeypatch.setenv("CAFFEPAR_KERNELS", kernels)
    if engine:
        monkeypatch.setenv("CAFFEPAR_CONV_ENGINES", engine)
    monkeypatch.setattr(direct, "blas_threads", lambda: threads)


#: The kernel paths a fold test runs on: the direct engine on 2 threads and 1, im2col (which
#: takes no fold), the NumPy kernels.
FOLD_KERNELS = pytest.mark.parametrize("kernels,engine,threads", [("native", "direct", 2),
                                                                  ("native", "direct", 1),
                                                                  ("native", "im2col", 2),
                                                                  ("numpy", "", 1)])


def _steps_taken(monkeypatch):
    """A list of the results of each image step the direct engine's kernels run, filled as
    they run them."""
    from caffepar.nn.conv import direct
    taken = []
    ran = direct._ran
    monkeypatch.setattr(direct, "_ran", lambda step, results: (taken.append(sum(results)),
                                                               ran(step, results)))
    return taken


def _alone_then_spanned(net, seed, check_alone=lambda: True):
    """Random inputs x and t; each layer's forward and backward run alone, then the net's
    passes over every layer (stale values in every other blob first): every blob's data and
    diff and every parameter diff must be the same bits. check_alone() is asserted between
    the two. Returns the blobs' (data, diff) as the layers alone left them."""
    rng = np.random.default_rng(seed)
    for name in ("x", "t"):
        net.blobs[name].data[...] = rng.standard_normal(net.blobs[name].shape)

    def state():
        return ({n: (b.data.copy(), b.diff.copy()) for n, b in net.blobs.items()},
                net.param_diff.copy())

    net.clear_param_diffs()
    for i in range(len(net.layers)):
        net.forward_layer(i)
    for i in reversed(range(len(net.layers))):
        net.backward_layer(i, net.layer_need_backward[i])
    alone = state()
    assert check_alone()
    for name, blob in net.blobs.items():      # stale values wherever a pass fails to write
        if name not in ("x", "t", "loss"):
            blob.data[...] = blob.diff[...] = 7
    net.clear_param_diffs()
    net.forward_from_to()
    net.backward_from_to()
    spanned = state()
    for name, (data, diff) in alone[0].items():
        np.testing.assert_array_equal(spanned[0][name][0], data, err_msg=f"{name} data")
        np.testing.assert_array_equal(spanned[0][name][1], diff, err_msg=f"{name} diff")
    np.testing.assert_array_equal(spanned[1], alone[1])
    return alone[0]


AVE_STEP_NET = """
  layer { name: "in" type: "Input" top: "x" top: "t"
          input_param { shape { dim: 6 dim: 3 dim: 16 dim: 16 } shape { dim: 6 dim: 4 dim: 4 dim: 4 } } }
  layer { name: "conv1" type: "Convolution" bottom: "x" top: "conv1"
          convolution_param { num_output: 10 kernel_size: 5 pad: 2
                              weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
  layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
          pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
  layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
          convolution_param { num_output: 8 kernel_size: 3 pad: 1
                              weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
          pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
  layer { name: "relu3" type: "ReLU" bottom: "pool2" top: "pool2"
          relu_param { negative_slope: 0.1 } }
  layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
          convolution_param { num_output: 4 kernel_size: 3 pad: 1
                              weight_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "loss" type: "EuclideanLoss" bottom: "conv3" bottom: "t" top: "loss" }
  force_backward: true
"""


@FOLD_KERNELS
def test_ave_pooling_runs_inside_the_convolution_with_the_same_bits(
        kernels, engine, threads, monkeypatch):
    """An AVE Pooling right after a Convolution, or behind a ReLU that runs inside it, runs
    inside that Convolution's forward too, on each image as it is written: on the direct
    engine's rows kernels (conv1, relu1 between) and its image-by-image kernels (conv2, with
    the ReLU after the pooling, relu3). Its backward, with a ReLU's before it, runs as a pass
    of its own before the convolution reads its diff. Every blob and parameter diff: the bits
    of layers run alone."""
    _use_kernels(kernels, engine, threads, monkeypatch)
    taken = _steps_taken(monkeypatch)
    net = Net(P(AVE_STEP_NET), TRAIN)
    assert net.step_forward == net.step_backward == {3: 1, 5: 4}
    assert net.relu_in_producer == {2: 0.0, 6: np.float32(0.1)}
    alone = _alone_then_spanned(net, 6, lambda: not taken)
    assert taken == ([0, 0] if engine == "direct" else [])     # conv1's and conv2's forward

    assert (alone["pool2"][0] < 0).any()            # relu3 has work to do
    net.blobs["pool2"].data[...] = 7
    net.forward(end="conv2")
    assert (net.blobs["pool2"].data == 7).all()     # pool2 not in the span: not run
    np.testing.assert_array_equal(net.blobs["conv2"].data, alone["conv2"][0])
    net.forward(start="pool2", end="relu3")
    np.testing.assert_array_equal(net.blobs["pool2"].data, alone["pool2"][0])


@pytest.mark.parametrize("pool", ["MAX", "AVE"])
@pytest.mark.parametrize("slope", [0.0, 0.25])
@FOLD_KERNELS
def test_folded_relus_give_the_bits_of_relu_layers_run_alone(pool, slope, kernels, engine,
                                                             threads, monkeypatch):
    """In-place ReLUs run inside the Convolution or Pooling beside them when the net runs a
    span of layers (forward into the layer before, backward into the layer after), and every
    blob's data and diff and every parameter diff come out bit for bit as when each layer runs
    alone; a span ending at the layer before a ReLU leaves its top as that layer made it."""
    _use_kernels(kernels, engine, threads, monkeypatch)
    relu = f"relu_param {{ negative_slope: {slope} }}" if slope else ""
    net = Net(P(FOLD_NET % {"relu": relu, "pool": pool}), TRAIN)
    folds_back = pool == "AVE" or slope == 0       # a MAX backward folds slope 0 alone
    assert net.relu_in_producer == {2: slope, 4: slope, 6: slope}
    assert net.relu_in_consumer == ({2: slope, 4: slope} if folds_back else {4: slope})
    alone = _alone_then_spanned(net, 3)

    net.forward(end="conv1")
    assert (net.blobs["conv1"].data < 0).any()      # relu1 not in the span: not applied
    net.forward(start="relu1", end="relu1")
    np.testing.assert_array_equal(net.blobs["conv1"].data, alone["conv1"][0])


STEP_NET = """
  layer { name: "in" type: "Input" top: "x" top: "t"
          input_param { shape { dim: 6 dim: 3 dim: 16 dim: 16 } shape { dim: 6 dim: 4 dim: 8 dim: 8 } } }
  layer { name: "conv1" type: "Convolution" bottom: "x" top: "conv1"
          convolution_param { num_output: 10 kernel_size: 5 pad: 2
                              weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
          pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
  layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
  layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
          convolution_param { num_output: 4 kernel_size: 3 pad: 1
                              weight_filler { type: "gaussian" std: 0.3 } } }
  layer { name: "loss" type: "EuclideanLoss" bottom: "conv2" bottom: "t" top: "loss" }
  force_backward: true
"""


@FOLD_KERNELS
def test_pooling_run_inside_the_convolution_gives_the_bits_of_layers_run_alone(
        kernels, engine, threads, monkeypatch):
    """A MAX Pooling right after a Convolution runs inside it when the net runs both: forward
    on each image as the convolution writes it, backward on each run of images just before the
    weight gradient reads their diff (on the direct engine's rows kernels, 6 images in runs
    and tiles; on other engines as a pass of its own). Every blob's data and diff and every
    parameter diff come out bit for bit as when each layer runs alone."""
    _use_kernels(kernels, engine, threads, monkeypatch)
    taken = _steps_taken(monkeypatch)
    net = Net(P(STEP_NET), TRAIN)
    assert net.step_forward == net.step_backward == {2: 1}
    assert net.relu_in_producer == {3: 0.0}
    alone = _alone_then_spanned(net, 5, lambda: not taken)
    assert taken == ([0, 0] if engine == "direct" else [])     # forward, backward

    net.blobs["pool1"].data[...] = 7
    net.forward(end="conv1")
    assert (net.blobs["pool1"].data == 7).all()     # pool1 not in the span: not run
    net.forward(start="pool1", end="relu1")
    np.testing.assert_array_equal(net.blobs["pool1"].data, alone["pool1"][0])


def test_layers_share_their_lists_of_blob_ids_which_cannot_be_changed_in_place(tmp_path):
    """Layers wired alike share one list of blob ids (a huge net's memory); it compares as a
    list, and changing it in place, which would rewire every layer sharing it, is an error."""
    net = Net(str(_relu_chain(tmp_path / "chain.prototxt", 3)))
    assert net.bottom_ids[1] is net.bottom_ids[2] and net.bottom_ids[1] == [0]
    assert net.top_ids[1] == net.bottom_ids[1]
    with pytest.raises(TypeError, match="shared by several layers"):
        net.bottom_ids[1][0] = 5
    with pytest.raises(TypeError, match="shared by several layers"):
        net.top_ids[2].append(0)
