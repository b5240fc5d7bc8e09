"""Caffe's WindowData layer (R-CNN fine-tuning): batches of image windows warped to
crop_size x crop_size, a fixed fraction of them foreground (object) windows.

As Caffe's window_data_layer: a window is foreground when its overlap >= fg_threshold (its label,
which must be > 0, is kept) and background when overlap < bg_threshold (label 0); others are
unused. Each batch draws (batch_size - int(batch_size * fg_fraction)) background then the
foreground windows, uniformly with replacement; with context_pad > 0 (or crop_mode "square",
which first makes the box square) the box grows so that after warping exactly context_pad pixels
of context surround it, the part outside the image is left zero and, when mirrored, the padding
is mirrored too. Images are read as 3-channel BGR; pixels become (pixel - mean) * scale with the
mean from transform_param (mean_file, centred on the crop, or mean_value) and the scale from
window_data_param (Caffe ignores transform_param's scale here). crop_size and mirror come from
transform_param. A window belongs to the image record it follows in the window file (Caffe looks
the image up by the record's "# index", which is the same for files numbered 0, 1, 2, ...).
"""
import math

import numpy as np

from caffepar.data.sources import (cv_resize, decode_image_bytes, read_image, read_window_file,
                                   resolve_path, root_prefix)
from caffepar.data.transform import blob_proto_array
from caffepar.errors import DataError
from caffepar.nn.base import register
from caffepar.nn.data import _StreamingDataLayer

LABEL, OVERLAP, X1, Y1, X2, Y2 = range(6)


def _round(x):
    """C's round(): halves away from zero."""
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def context_box(box, crop_size, context_pad, square, image_height, image_width, mirror):
    """Caffe's window expansion. Returns the clipped source box (x1, y1, x2, y2), the size it
    is warped to (height, width) and where it lands in the crop (pad_h, pad_w)."""
    f32 = np.float32
    x1, y1, x2, y2 = box
    context_scale = f32(crop_size) / f32(crop_size - 2 * context_pad)
    half_height = f32((y2 - y1 + 1) / 2.0)
    half_width = f32((x2 - x1 + 1) / 2.0)
    center_x = f32(x1) + half_width
    center_y = f32(y1) + half_height
    if square:
        half_height = half_width = max(half_height, half_width)
    x1 = _round(center_x - half_width * context_scale)
    x2 = _round(center_x + half_width * context_scale)
    y1 = _round(center_y - half_height * context_scale)
    y2 = _round(center_y + half_height * context_scale)
    unclipped_height, unclipped_width = y2 - y1 + 1, x2 - x1 + 1
    pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
    pad_x2, pad_y2 = max(0, x2 - image_width + 1), max(0, y2 - image_height + 1)
    x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
    scale_x = f32(crop_size) / f32(unclipped_width)
    scale_y = f32(crop_size) / f32(unclipped_height)
    height = _round(f32(y2 - y1 + 1) * scale_y)
    width = _round(f32(x2 - x1 + 1) * scale_x)
    pad_h = _round(f32(pad_y1) * scale_y)
    pad_w = _round(f32(pad_x2 if mirror else pad_x1) * scale_x)
    height = min(height, crop_size - pad_h)
    width = min(width, crop_size - pad_w)
    return (x1, y1, x2, y2), (height, width), (pad_h, pad_w)


@register("WindowData")
class WindowDataLayer(_StreamingDataLayer):
    exact_tops = 2

    def layer_setup(self, bottom, top):
        p = self.param.window_data_param
        tp = self.param.transform_param
        source = self.resolve(p.source, "window file")
        try:
            records = read_window_file(source)
        except DataError as e:
            e.layer, e.layer_type = self.name, self.param.type
            raise
        root = root_prefix(p.root_folder)
        self.images = [root + path for path, _, _ in records]
        channels = records[-1][1][0]
        if channels != 3:
            raise self.error(f"window file {source} gives {channels} channels; WindowData reads "
                             "images as 3-channel BGR")
        fg, bg = [], []
        for index, (path, _, windows) in enumerate(records):
            for w in windows:
                row = np.concatenate([[index], w])
                if w[OVERLAP] >= p.fg_threshold:
                    if w[LABEL] <= 0:
                        raise DataError(f"foreground window of {path} has label {int(w[LABEL])};"
                                        " foreground labels must be > 0", path=source,
                                        layer=self.name, layer_type=self.param.type)
                    fg.append(row)
                elif w[OVERLAP] < p.bg_threshold:
                    row[1 + LABEL] = row[1 + OVERLAP] = 0
                    bg.append(row)
        self.fg = np.array(fg).reshape(-1, 7)
        self.bg = np.array(bg).reshape(-1, 7)
        self.crop_size = int(tp.crop_size)
        if self.crop_size <= 0:
            raise self.error("transform_param { crop_size } must be > 0 (the warped window size)")
        self.context_pad = int(p.context_pad)
        if 2 * self.context_pad >= self.crop_size:
            raise self.error(f"context_pad {self.context_pad} leaves nothing of a "
                             f"{self.crop_size} crop")
        if p.crop_mode not in ("warp", "square"):
            raise self.error(f'crop_mode must be "warp" or "square", got "{p.crop_mode}"')
        self.square = p.crop_mode == "square"
        self.mirror = bool(tp.mirror)
        self.scale = self.dtype.type(p.scale)
        self.batch_size = p.batch_size
        self.num_fg = int(np.float32(p.batch_size) * np.float32(p.fg_fraction))
        for kind, count, have in (("foreground", self.num_fg, len(self.fg)),
                                  ("background", p.batch_size - self.num_fg, len(self.bg))):
            if count and not have:
                raise DataError(f"no {kind} windows (fg_threshold {p.fg_threshold}, "
                                f"bg_threshold {p.bg_threshold}) for the {count} a batch takes",
                                path=source, layer=self.name, layer_type=self.param.type)
        self._setup_mean(tp, channels)
        self.cache = None
        if p.cache_images:
            self.cache = [self._read_bytes(i) for i in range(len(self.images))]
        self.num_records = max(1, len(self.fg) + len(self.bg))
        self.start_stream()
        top[0].reshape((self.batch_size, channels, self.crop_size, self.crop_size))
        top[1].reshape((self.batch_size,))

    def _setup_mean(self, tp, channels):
        self.mean = self.mean_values = None
        if tp.HasField("mean_file"):
            if tp.mean_value:
                raise self.error("cannot specify mean_file and mean_value at the same time")
            from caffepar.proto.text import read_blob_proto
            mean = blob_proto_array(read_blob_proto(self.resolve(tp.mean_file, "mean_file")))
            mean = mean.reshape(mean.shape[-3:]) if mean.ndim >= 3 else mean
            # Caffe centres the crop on the mean by its width, for both axes.
            self.mean_off = (mean.shape[-1] - self.crop_size) // 2
            if mean.ndim != 3 or mean.shape[0] != channels or self.mean_off < 0 or \
                    mean.shape[1] < self.mean_off + self.crop_size:
                raise self.error(f"mean_file holds shape {mean.shape}; WindowData needs "
                                 f"{channels} x H x W with W >= crop_size {self.crop_size} and "
                                 f"H >= (W - crop_size) / 2 + crop_size")
            self.mean = mean.astype(self.dtype)
        elif tp.mean_value:
            values = np.asarray(tp.mean_value, self.dtype)
            if len(values) not in (1, channels):
                raise self.error(f"specify either 1 mean_value or as many as channels "
                                 f"({channels}), got {len(values)}")
            self.mean_values = np.broadcast_to(values, (channels,))[:, None, None]

    def _read_bytes(self, i):
        found = resolve_path(self.images[i], getattr(self, "net_dir", None))
        if found is None:
            raise DataError(f"could not open or find image {self.images[i]}",
                            path=self.images[i], layer=self.name, layer_type=self.param.type)
        with open(found, "rb") as f:
            return f.read()

    def _image(self, i):
        """Image i as H x W x 3 BGR uint8."""
        if self.cache is not None:
            return decode_image_bytes(self.cache[i], color=True)
        found = resolve_path(self.images[i], getattr(self, "net_dir", None))
        img = read_image(found, color=True) if found else None
        if img is None:
            raise DataError(f"could not load image {self.images[i]}", path=self.images[i],
                            layer=self.name, layer_type=self.param.type)
        return img

    def _window(self, row, mirror, out):
        """Warp one window (a row of self.fg/self.bg) into `out` (C x crop x crop, zeroed)."""
        img = self._image(int(row[0]))
        box = tuple(int(v) for v in row[1 + X1:1 + Y2 + 1])
        size, pad = (self.crop_size, self.crop_size), (0, 0)
        if self.context_pad > 0 or self.square:
            box, size, pad = context_box(box, self.crop_size, self.context_pad, self.square,
                                         img.shape[0], img.shape[1], mirror)
        x1, y1, x2, y2 = box
        if not (0 <= x1 <= x2 < img.shape[1] and 0 <= y1 <= y2 < img.shape[0]):
            raise DataError(f"window ({x1}, {y1}, {x2}, {y2}) is outside image "
                            f"{self.images[int(row[0])]} ({img.shape[1]} x {img.shape[0]})",
                            layer=self.name, layer_type=self.param.type)
        if size[0] <= 0 or size[1] <= 0:
            return
        patch = cv_resize(np.ascontiguousarray(img[y1:y2 + 1, x1:x2 + 1]), *size)
        if mirror:
            patch = patch[:, ::-1]
        patch = patch.transpose(2, 0, 1)
        rows = slice(pad[0], pad[0] + size[0])
        cols = slice(pad[1], pad[1] + size[1])
        if self.mean is not None:
            off = self.mean_off
            sub = self.mean[:, off + pad[0]:off + pad[0] + size[0],
                            off + pad[1]:off + pad[1] + size[1]]
        else:
            sub = self.mean_values
        region = out[:, rows, cols]
        if sub is None:
            np.copyto(region, patch, casting="unsafe")
        else:
            np.subtract(patch, sub, out=region, dtype=self.dtype)
        if self.scale != 1:
            region *= self.scale

    def make_batch(self, index):
        rng = self.batch_rng(index)
        data = np.zeros((self.batch_size, 3, self.crop_size, self.crop_size), self.dtype)
        labels = np.empty(self.batch_size, self.dtype)
        picks = [(self.bg, self.batch_size - self.num_fg), (self.fg, self.num_fg)]
        item = 0
        for windows, count in picks:
            for _ in range(count):
                row = windows[rng.integers(len(windows))]
                mirror = self.mirror and bool(rng.integers(2))
                self._window(row, mirror, data[item])
                labels[item] = row[1 + LABEL]
                item += 1
        return [data, labels]
