"""Real trained Caffe models load from prototxt + caffemodel (binary and HDF5) and reproduce the
accuracies their MANIFEST states on the stored data."""
import gzip
import lzma

import numpy as np

import caffepar as caffe
from caffepar.proto.text import read_blob_proto
from conftest import DATA, need_shared

MODELS = DATA / "models"


def _accuracy(net, images, labels, batch):
    hits = 0
    for start in range(0, len(images), batch):
        x = images[start:start + batch]
        net.blobs["data"].reshape(*x.shape)
        net.reshape()
        prob = net.forward(data=x)["prob"]
        hits += int((prob.reshape(len(x), -1).argmax(axis=1) == labels[start:start + batch]).sum())
    return hits / len(images)


def _mnist_test():
    with gzip.open(DATA / "mnist/t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(DATA / "mnist/t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    return images, labels


def _cifar_test():
    raw = lzma.decompress((DATA / "cifar10/test_batch.first1017.bin.xz").read_bytes())
    records = np.frombuffer(raw, np.uint8).reshape(-1, 3073)
    return records[:, 1:].reshape(-1, 3, 32, 32), records[:, 0]


def _cifar_mean():
    blob = read_blob_proto(DATA / "cifar10/mean.binaryproto")
    return np.asarray(blob.data, np.float32).reshape(3, 32, 32)


def test_lenet_mnist_accuracy():
    need_shared(MODELS / "lenet")
    net = caffe.Net(str(MODELS / "lenet/lenet.prototxt"),
                    str(MODELS / "lenet/lenet_iter_10000.caffemodel"), caffe.TEST)
    images, labels = _mnist_test()
    acc = _accuracy(net, images.astype(np.float32) * np.float32(0.00390625), labels, 1000)
    assert round(acc * 100, 2) == 99.11, f"LeNet MNIST test accuracy {acc:.4%}, MANIFEST 99.11%"


def test_cifar10_quick_binary_caffemodel_accuracy():
    need_shared(MODELS / "cifar10_quick")
    net = caffe.Net(str(MODELS / "cifar10_quick/cifar10_quick.prototxt"), caffe.TEST,
                    weights=str(MODELS / "cifar10_quick/cifar10_quick_iter_5000.caffemodel"))
    images, labels = _cifar_test()
    acc = _accuracy(net, images.astype(np.float32) - _cifar_mean(), labels, 339)
    assert round(acc * 100, 1) == 77.1, f"cifar10_quick accuracy {acc:.4%}, MANIFEST 77.1%"


def test_cifar10_quick_hdf5_caffemodel_with_old_input_fields():
    need_shared(MODELS / "cifar10_quick_hdf5")
    d = MODELS / "cifar10_quick_hdf5"
    net = caffe.Net(str(d / "cifar10_quick.prototxt"),
                    str(d / "cifar10_quick_iter_5000.caffemodel.h5"), caffe.TEST)
    assert net.inputs == ["data"]
    images, labels = _cifar_test()
    acc = _accuracy(net, images.astype(np.float32) - _cifar_mean(), labels, 339)
    assert round(acc * 100, 1) == 76.3, f"cifar10_quick (HDF5) accuracy {acc:.4%}, MANIFEST 76.3%"


def test_binary_and_hdf5_weights_agree_after_round_trip(tmp_path):
    need_shared(MODELS / "cifar10_quick")
    src = MODELS / "cifar10_quick/cifar10_quick_iter_5000.caffemodel"
    net = caffe.Net(str(MODELS / "cifar10_quick/cifar10_quick.prototxt"), caffe.TEST,
                    weights=str(src))
    net.save(str(tmp_path / "copy.caffemodel"))
    net.save_hdf5(str(tmp_path / "copy.caffemodel.h5"))
    for path in ("copy.caffemodel", "copy.caffemodel.h5"):
        other = caffe.Net(str(MODELS / "cifar10_quick/cifar10_quick.prototxt"), caffe.TEST,
                          weights=str(tmp_path / path))
        for name, blobs in net.params.items():
            for a, b in zip(blobs, other.params[name]):
                assert np.array_equal(a.data, b.data), f"{path}: {name} differs"
