"""pycaffe's Classifier and Detector: predictions equal the net run on crops made by hand,
and context padding fills what lies outside the image with the mean."""
import numpy as np
import pytest
from PIL import Image

import caffepar as caffe

DEPLOY = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""
MEAN = np.array([30.0, 60.0, 90.0], np.float32)  # BGR, in the net's 0..255 space


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "deploy.prototxt"
    path.write_text(DEPLOY)
    caffe.set_random_seed(7)
    net = caffe.Net(str(path), caffe.TEST)
    weights = str(tmp_path / "w.caffemodel")
    net.save(weights)
    return str(path), weights


def net_input(crop):
    """An H x W x 3 RGB crop in [0, 1] as the net's BGR, 0..255, mean-subtracted input."""
    return crop.transpose(2, 0, 1)[::-1] * 255 - MEAN[:, None, None]


def probs(model, batch):
    net = caffe.Net(model[0], caffe.TEST, weights=model[1])
    return net.forward_all(data=np.asarray(batch, np.float32))["prob"]


def test_classifier_centre_crop_and_oversample(model):
    clf = caffe.Classifier(*model, image_dims=(10, 10), mean=MEAN, raw_scale=255,
                           channel_swap=(2, 1, 0))
    rng = np.random.default_rng(0)
    images = [rng.uniform(0, 1, (10, 10, 3)).astype(np.float32) for _ in range(3)]
    centre = clf.predict(images, oversample=False)
    assert centre.shape == (3, 5)
    np.testing.assert_allclose(centre, probs(model, [net_input(im[1:9, 1:9]) for im in images]),
                               rtol=1e-5, atol=1e-7)
    crops = []
    for im in images:
        corners = [im[y:y + 8, x:x + 8] for y in (0, 2) for x in (0, 2)] + [im[1:9, 1:9]]
        crops.append(corners + [c[:, ::-1] for c in corners])
    want = probs(model, [net_input(c) for cs in crops for c in cs]).reshape(3, 10, 5).mean(1)
    np.testing.assert_allclose(clf.predict(images), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(clf.predict(images).sum(1), 1, rtol=1e-5)


def test_detector_windows_and_context_padding(model, tmp_path):
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "im.png")
    image = pixels.astype(np.float32) / 255
    det = caffe.Detector(*model, mean=MEAN, raw_scale=255, channel_swap=(2, 1, 0))
    windows = [np.array([1, 2, 9, 10]), np.array([0, 0, 8, 8])]
    found = det.detect_windows([(str(tmp_path / "im.png"), windows)])
    assert [d["filename"] for d in found] == [str(tmp_path / "im.png")] * 2
    assert found[0]["window"] is windows[0]
    want = probs(model, [net_input(image[1:9, 2:10]), net_input(image[0:8, 0:8])])
    np.testing.assert_allclose([d["prediction"] for d in found], want, rtol=1e-5, atol=1e-7)

    # Context 2 around window (0, 0, 3, 3) on an 8-pixel input: the box doubles to
    # (-2, -2, 6, 6), 9 pixels scaled by 8/9; 2 pixels of it lie outside the image (mean),
    # pixels 0..5 inside (6 = min(round(7 * 8/9), 8 - 2)) keep their size.
    padded = caffe.Detector(*model, mean=MEAN, raw_scale=255, channel_swap=(2, 1, 0),
                            context_pad=2)
    crop = padded.crop(image, np.array([0, 0, 3, 3]))
    assert crop.shape == (8, 8, 3)
    np.testing.assert_allclose(crop[2:, 2:], image[:6, :6], atol=1e-6)
    np.testing.assert_allclose(crop[:2], np.broadcast_to(MEAN[::-1] / 255, (2, 8, 3)),
                               rtol=1e-6)
    net_space = padded.transformer.preprocess("data", crop)
    np.testing.assert_allclose(net_space[:, :2], 0, atol=1e-4)
