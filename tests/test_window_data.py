"""Caffe's WindowData layer on a tiny window file and PNG images made here: which windows are
foreground or background, the fg/bg split of a batch, mean_file and scale, context padding
(clipped at the image border, mirrored with the window) and square crops, all against crops
worked out by hand."""
import numpy as np
import pytest
from PIL import Image

import caffepar as caffe
from caffepar.data.sources import cv_resize
from caffepar.errors import DataError, LayerError
from caffepar.io import array_to_blobproto

NET = """
layer {{ name: "data" type: "WindowData" top: "data" top: "label"
  transform_param {{ crop_size: {crop} mirror: {mirror} {mean} }}
  window_data_param {{ source: "{source}" root_folder: "{root}" batch_size: {batch}
    fg_threshold: 0.5 bg_threshold: 0.3 fg_fraction: {fg} scale: {scale}
    context_pad: {pad} crop_mode: "{mode}" {extra} }} }}
"""


def image(tmp_path, name, h, w, seed):
    """A random RGB PNG; returns its pixels as Caffe reads them (H x W x 3 BGR)."""
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / name)
    return rgb[:, :, ::-1]


def window_file(tmp_path, records):
    lines = []
    for i, (name, (h, w), windows) in enumerate(records):
        lines += [f"# {i}", name, "3", str(h), str(w), str(len(windows))]
        lines += [" ".join(str(v) for v in win) for win in windows]
    path = tmp_path / "windows.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def layer_net(tmp_path, source, crop, batch, fg, pad=0, mode="warp", mirror=False, mean="",
              scale=1, extra=""):
    path = tmp_path / "net.prototxt"
    path.write_text(NET.format(crop=crop, mirror=str(mirror).lower(), mean=mean, source=source,
                               root=f"{tmp_path}/", batch=batch, fg=fg, scale=scale, pad=pad,
                               mode=mode, extra=extra))
    return caffe.Net(str(path), caffe.TRAIN)


def chw(hwc):
    return hwc.transpose(2, 0, 1).astype(np.float32)


def test_foreground_background_split_mean_file_and_scale(tmp_path):
    img0 = image(tmp_path, "a.png", 10, 12, 0)
    img1 = image(tmp_path, "b.png", 10, 12, 1)
    source = window_file(tmp_path, [
        ("a.png", (10, 12), [(1, 0.9, 2, 1, 5, 4),     # foreground, label 1
                             (0, 0.1, 6, 5, 9, 8),     # background
                             (2, 0.4, 0, 0, 3, 3)]),   # between the thresholds: unused
        ("b.png", (10, 12), [(3, 0.7, 7, 6, 10, 9),    # foreground, label 3
                             (5, 0.2, 0, 6, 3, 9)]),   # background: label forced to 0
    ])
    mean = np.arange(3 * 6 * 6, dtype=np.float32).reshape(1, 3, 6, 6)
    (tmp_path / "mean.binaryproto").write_bytes(array_to_blobproto(mean).SerializeToString())
    net = layer_net(tmp_path, source, crop=4, batch=6, fg=0.5, scale=0.5,
                    mean=f'mean_file: "{tmp_path}/mean.binaryproto"')
    assert net.blobs["data"].shape == (6, 3, 4, 4) and net.blobs["label"].shape == (6,)
    centre = mean[0, :, 1:5, 1:5]  # (6 - 4) / 2 = 1 in from the mean's corner

    def expected(img, x1, y1):
        return (chw(img[y1:y1 + 4, x1:x1 + 4]) - centre) * 0.5

    background = [expected(img0, 6, 5), expected(img1, 0, 6)]
    foreground = {1: expected(img0, 2, 1), 3: expected(img1, 7, 6)}
    seen = set()
    for _ in range(4):
        out = net.forward()
        data, labels = out["data"], out["label"]
        assert list(labels[:3]) == [0, 0, 0]
        for item in data[:3]:
            match = [i for i, b in enumerate(background) if np.array_equal(item, b)]
            assert match, "a background item is no background window"
            seen.add(("bg", match[0]))
        for item, label in zip(data[3:], labels[3:]):
            assert int(label) in foreground
            np.testing.assert_array_equal(item, foreground[int(label)])
            seen.add(("fg", int(label)))
    assert seen == {("bg", 0), ("bg", 1), ("fg", 1), ("fg", 3)}


def test_context_padding_clips_at_the_border_and_mirrors_its_padding(tmp_path):
    """Window (0, 0)-(3, 3) of a 10 x 10 image, crop 8, context_pad 2: the box doubles to
    (-2, -2)-(6, 6), 9 pixels warped by 8/9; inside the image are pixels 0..6 (7 of them,
    warped to round(7 * 8/9) = 6), outside 2 (round(2 * 8/9) = 2 pixels of zeros before them).
    Mirrored, the zeros move to the other side (the box does not leave the image there)."""
    img = image(tmp_path, "a.png", 10, 10, 2)
    source = window_file(tmp_path, [("a.png", (10, 10), [(1, 1.0, 0, 0, 3, 3)])])
    net = layer_net(tmp_path, source, crop=8, batch=4, fg=1, pad=2, mirror=True)
    warped = chw(cv_resize(np.ascontiguousarray(img[:7, :7]), 6, 6))
    plain = np.zeros((3, 8, 8), np.float32)
    plain[:, 2:, 2:] = warped
    mirrored = np.zeros((3, 8, 8), np.float32)
    mirrored[:, 2:, :6] = warped[:, :, ::-1]
    seen = set()
    for _ in range(4):
        for item in net.forward()["data"]:
            if np.array_equal(item, plain):
                seen.add("plain")
            else:
                np.testing.assert_array_equal(item, mirrored)
                seen.add("mirrored")
    assert seen == {"plain", "mirrored"}


@pytest.mark.parametrize("mode, cache", [("square", False), ("warp", True)])
def test_square_crop_widens_the_short_side(tmp_path, mode, cache):
    """Window (2, 3)-(5, 4) is 4 wide, 2 tall. Square: half sizes 2 and 2 around centre (4, 4)
    give the box (2, 2)-(6, 6), 5 x 5, a crop of 5 with no resizing. Warp: the 2 x 4 window
    itself, resized to 5 x 5 (here from images cached in memory)."""
    img = image(tmp_path, "a.png", 10, 10, 3)
    source = window_file(tmp_path, [("a.png", (10, 10), [(1, 1.0, 2, 3, 5, 4)])])
    net = layer_net(tmp_path, source, crop=5, batch=1, fg=1, mode=mode,
                    mean="mean_value: 10 mean_value: 20 mean_value: 30",
                    extra=f"cache_images: {str(cache).lower()}")
    if cache:
        (tmp_path / "a.png").unlink()
    mean = np.array([10, 20, 30], np.float32)[:, None, None]
    region = img[2:7, 2:7] if mode == "square" else cv_resize(np.ascontiguousarray(img[3:5, 2:6]),
                                                              5, 5)
    np.testing.assert_array_equal(net.forward()["data"][0], chw(region) - mean)


def test_bad_window_files_and_settings_are_clear_errors(tmp_path):
    image(tmp_path, "a.png", 10, 10, 4)
    bad = tmp_path / "bad.txt"
    bad.write_text("# 0\na.png\n3\n10\nten\n1\n1 0.9 0 0 3 3\n")
    with pytest.raises(DataError, match="line 5: width must be int, got 'ten'"):
        layer_net(tmp_path, bad, crop=4, batch=1, fg=1)
    zero = window_file(tmp_path, [("a.png", (10, 10), [(0, 0.9, 0, 0, 3, 3)])])
    with pytest.raises(DataError, match="foreground labels must be > 0"):
        layer_net(tmp_path, zero, crop=4, batch=1, fg=1)
    only_fg = window_file(tmp_path, [("a.png", (10, 10), [(1, 0.9, 0, 0, 3, 3)])])
    with pytest.raises(DataError, match="no background windows"):
        layer_net(tmp_path, only_fg, crop=4, batch=2, fg=0.5)
    with pytest.raises(LayerError, match="crop_size"):
        layer_net(tmp_path, only_fg, crop=0, batch=1, fg=1)
    missing = window_file(tmp_path, [("gone.png", (10, 10), [(1, 0.9, 0, 0, 3, 3)])])
    net = layer_net(tmp_path, missing, crop=4, batch=1, fg=1)
    with pytest.raises(DataError, match="gone.png"):
        net.forward()


def test_rcnn_finetuning_net_with_an_anonymous_loss_top_trains(tmp_path):
    """BVLC's finetune_pascal_detection shape: WindowData, a classifier, and a
    SoftmaxWithLoss written without a top (Caffe's AutoTopBlobs)."""
    image(tmp_path, "a.png", 12, 12, 5)
    source = window_file(tmp_path, [("a.png", (12, 12), [(1, 0.9, 0, 0, 5, 5),
                                                         (2, 0.8, 4, 4, 11, 11),
                                                         (0, 0.0, 2, 6, 9, 11)])])
    path = tmp_path / "rcnn.prototxt"
    path.write_text(NET.format(crop=6, mirror="true", mean="mean_value: 128", source=source,
                               root=f"{tmp_path}/", batch=8, fg=0.25, scale=0.01, pad=1,
                               mode="warp", extra="")
                    + 'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" '
                      'inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }'
                      'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" '
                      'bottom: "label" }')
    net = caffe.Net(str(path), caffe.TRAIN)
    assert net.outputs == [] and "(automatic)" in net.blobs
    loss = net.forward_backward()
    assert np.isfinite(loss) and loss > 0
    assert np.abs(net.params["fc"][0].diff).max() > 0
