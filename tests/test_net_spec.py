"""pycaffe's NetSpec: nets written as Python calls become NetParameters whose text parses and
builds, with pycaffe's names and field placement."""
import numpy as np
import pytest

import caffepar as caffe
from caffepar import layers as L, params as P
from caffepar.net_spec import Function, to_proto
from caffepar.proto import caffe_pb2

LENET_NAMES = ["data", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]
ANON_NAMES = ["DummyData1", "Convolution1", "Pooling1", "Convolution2", "Pooling2",
              "InnerProduct1", "ReLU1", "InnerProduct2", "SoftmaxWithLoss1"]


def lenet_tops(batch):
    data, label = L.DummyData(shape=[dict(dim=[batch, 1, 28, 28]), dict(dim=[batch])],
                              data_filler=[dict(type="gaussian", std=50), dict(type="constant")],
                              transform_param=dict(scale=1. / 255), ntop=2)
    conv1 = L.Convolution(data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    pool1 = L.Pooling(conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    conv2 = L.Convolution(pool1, kernel_size=5, num_output=50, weight_filler=dict(type="xavier"))
    pool2 = L.Pooling(conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    ip1 = L.InnerProduct(pool2, num_output=500, weight_filler=dict(type="xavier"))
    relu1 = L.ReLU(ip1, in_place=True)
    ip2 = L.InnerProduct(relu1, num_output=10, weight_filler=dict(type="xavier"))
    loss = L.SoftmaxWithLoss(ip2, label)
    return [data, label, conv1, pool1, conv2, pool2, ip1, relu1, ip2, loss]


def named_lenet(batch):
    n = caffe.NetSpec()
    tops = lenet_tops(batch)
    n.data, n.label = tops[:2]
    for name, top in zip(LENET_NAMES[1:], tops[2:]):
        setattr(n, name, top)
    return n.to_proto()


def test_named_lenet_text_parses_and_builds_a_net(tmp_path):
    proto = named_lenet(4)
    assert [l.name for l in proto.layer] == LENET_NAMES
    assert list(proto.layer[0].top) == ["data", "label"]
    relu = proto.layer[6]
    assert list(relu.bottom) == list(relu.top) == ["ip1"]
    conv1 = proto.layer[1]
    assert list(conv1.convolution_param.kernel_size) == [5]
    assert conv1.convolution_param.num_output == 20
    assert conv1.convolution_param.weight_filler.type == "xavier"
    assert proto.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert proto.layer[0].transform_param.scale == pytest.approx(1 / 255)
    assert list(proto.layer[-1].bottom) == ["ip2", "label"]
    path = tmp_path / "lenet.prototxt"
    path.write_text(str(proto))
    net = caffe.Net(str(path), caffe.TRAIN)
    assert list(net.layer_dict) == LENET_NAMES
    assert net.blobs["ip2"].shape == (4, 10) and net.blobs["conv2"].shape == (4, 50, 8, 8)
    loss = net.forward()["loss"]
    assert np.isfinite(loss) and loss > 0


def test_anonymous_tops_are_named_as_pycaffe_names_them():
    proto = lenet_tops(2)[-1].to_proto()
    assert [l.name for l in proto.layer] == ANON_NAMES
    assert list(proto.layer[0].top) == ["DummyData1", "DummyData2"]
    assert list(proto.layer[6].top) == list(proto.layer[6].bottom) == ["InnerProduct1"]
    assert list(proto.layer[-1].bottom) == ["InnerProduct2", "DummyData2"]
    assert list(proto.layer[-1].top) == ["SoftmaxWithLoss1"]
    caffe.Net(proto, caffe.TRAIN)


def test_to_proto_of_several_tops_writes_shared_layers_once():
    data, label = L.DummyData(shape=[dict(dim=[2, 3]), dict(dim=[2])], ntop=2)
    fc = L.InnerProduct(data, num_output=4)
    proto = to_proto(L.SoftmaxWithLoss(fc, label), L.Accuracy(fc, label))
    assert [l.type for l in proto.layer] == ["DummyData", "InnerProduct", "SoftmaxWithLoss",
                                             "Accuracy"]
    assert list(proto.layer[3].bottom) == ["InnerProduct1", "DummyData2"]


def test_fields_go_to_the_type_param_or_to_the_layer():
    x = L.Input(shape=dict(dim=[1, 3, 8, 8]))
    conv = L.Convolution(x, num_output=4, kernel_size=(3, 3), pad=1, bias_term=False,
                         param=[dict(lr_mult=1), dict(lr_mult=2, decay_mult=0)],
                         include=dict(phase=caffe.TRAIN), loss_weight=0.5,
                         propagate_down=[True], engine=P.Convolution.CAFFE)
    layer = conv.to_proto().layer[1]
    p = layer.convolution_param
    assert list(p.kernel_size) == [3, 3] and list(p.pad) == [1] and p.bias_term is False
    assert p.engine == caffe_pb2.ConvolutionParameter.CAFFE
    assert [s.lr_mult for s in layer.param] == [1, 2] and layer.param[1].decay_mult == 0
    assert layer.include[0].phase == caffe.TRAIN
    assert list(layer.loss_weight) == [0.5] and list(layer.propagate_down) == [True]
    data = conv.to_proto().layer[0]
    assert list(data.input_param.shape[0].dim) == [1, 3, 8, 8]
    py = L.Python(x, module="mod", layer="Cls", param_str="3").to_proto().layer[1]
    assert (py.python_param.module, py.python_param.layer, py.python_param.param_str) == \
        ("mod", "Cls", "3")
    assert P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    with pytest.raises(AttributeError, match="NoSuchParameter"):
        P.NoSuch.X
    with pytest.raises(AttributeError, match="no value NOPE"):
        P.Pooling.NOPE


def test_layers_with_no_tops(tmp_path):
    n = caffe.NetSpec()
    n.data, n.data2 = L.DummyData(shape=dict(dim=3), ntop=2)
    n.silence_data = L.Silence(n.data, ntop=0)
    n.silence_data2 = L.Silence(n.data2, ntop=0)
    assert isinstance(n.silence_data, Function)
    proto = n.to_proto()
    assert [(l.name, list(l.top)) for l in proto.layer] == \
        [("data", ["data", "data2"]), ("silence_data", []), ("silence_data2", [])]
    assert caffe.Net(proto, caffe.TEST).forward() == {}


def test_bad_inputs_are_clear_errors():
    data = L.DummyData(ntop=2)
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(data, ntop=0)
    L.Silence(*data, ntop=0)
    n = caffe.NetSpec()
    with pytest.raises(AttributeError, match="no top named 'missing'"):
        n.missing
    n["x"] = data[0]
    assert n.x is data[0] and n["x"] is data[0]


def test_pycaffe_import_forms():
    import caffe as imported
    from caffe import layers as L2, params as P2, NetSpec, to_proto as tp
    from caffe.proto import caffe_pb2 as pb2
    assert imported is caffe and L2 is L and P2 is P and NetSpec is caffe.NetSpec
    assert tp is to_proto and pb2 is caffe_pb2
