"""Region pooling layers of the detection forks of Caffe: ROIPooling (Fast/Faster R-CNN) and
PSROIPooling (R-FCN). The second bottom holds one region a row, (batch index, x1, y1, x2, y2) in
image coordinates; spatial_scale maps them onto the feature map. Backward reaches the features
only (the regions get no gradient, as in the forks)."""
import math

import numpy as np

from caffepar.nn.base import Layer, register


def c_round(value):
    """C's round(): halves away from zero."""
    return math.copysign(math.floor(abs(value) + 0.5), value)


class _RegionPooling(Layer):
    exact_bottoms = 2
    exact_tops = 1

    def check_blob_counts(self, bottom, top):
        if len(bottom) != 2:
            raise self.error(f"takes 2 bottoms, the features and the regions of interest "
                             f"(rows of batch index, x1, y1, x2, y2); got {len(bottom)}")
        super().check_blob_counts(bottom, top)

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error(f"the feature bottom must have 4 axes, got shape {bottom[0].shape}")
        rois = bottom[1].shape
        if len(rois) < 2 or int(np.prod(rois[1:])) != 5:
            raise self.error(f"the regions bottom must hold 5 values a row (batch index, x1, y1, "
                             f"x2, y2), got shape {rois}")
        top[0].reshape((rois[0], self.out_channels(bottom[0].shape[1])) + self.pooled)

    def rois(self, bottom):
        rois = bottom[1].data.reshape(-1, 5)
        batch = rois[:, 0].astype(np.int64)
        if batch.size and (batch.min() < 0 or batch.max() >= bottom[0].shape[0]):
            raise self.error(f"a region's batch index is outside 0..{bottom[0].shape[0] - 1}")
        return rois, batch

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0


@register("ROIPooling")
class ROIPoolingLayer(_RegionPooling):
    """Max pooling of each region into pooled_h x pooled_w bins (Fast R-CNN's rounding)."""

    def layer_setup(self, bottom, top):
        p = self.param.roi_pooling_param
        self.pooled = (self.positive(p.pooled_h, "pooled_h"),
                       self.positive(p.pooled_w, "pooled_w"))
        self.scale = self.dtype.type(p.spatial_scale)

    def out_channels(self, channels):
        return channels

    def _region(self, roi):
        """Start and end (inclusive) of a region on the feature map, and its bin sizes."""
        start_w, start_h, end_w, end_h = (int(c_round(v * self.scale)) for v in roi[1:5])
        height, width = max(end_h - start_h + 1, 1), max(end_w - start_w + 1, 1)
        dt = self.dtype.type
        bins = (dt(height) / dt(self.pooled[0]), dt(width) / dt(self.pooled[1]))
        return (start_h, start_w), (end_h, end_w), bins

    def _bins(self, start, bin_size, pooled, limit):
        dt = self.dtype.type
        for p in range(pooled):
            lo = int(math.floor(dt(p) * bin_size)) + start
            hi = int(math.ceil(dt(p + 1) * bin_size)) + start
            yield p, min(max(lo, 0), limit), min(max(hi, 0), limit)

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        n, c, h, w = x.shape
        rois, batch = self.rois(bottom)
        self.argmax = np.full(y.shape, -1, np.int64)
        for r, roi in enumerate(rois):
            (sh, sw), _end, (bh, bw) = self._region(roi)
            plane = x[batch[r]].reshape(c, -1)
            for ph, h0, h1 in self._bins(sh, bh, self.pooled[0], h):
                for pw, w0, w1 in self._bins(sw, bw, self.pooled[1], w):
                    if h1 <= h0 or w1 <= w0:
                        y[r, :, ph, pw] = 0
                        continue
                    index = (np.arange(h0, h1)[:, None] * w + np.arange(w0, w1)).reshape(-1)
                    window = plane[:, index]
                    best = np.argmax(window, axis=1)
                    y[r, :, ph, pw] = window[np.arange(c), best]
                    self.argmax[r, :, ph, pw] = index[best]

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        dx[...] = 0
        n, c, h, w = dx.shape
        rois, batch = self.rois(bottom)
        flat = dx.reshape(n, c, -1)
        dy = top[0].diff
        for r, roi in enumerate(rois):
            (sh, sw), (eh, ew), _bins = self._region(roi)
            if eh < sh or ew < sw:      # the fork passes no gradient through a reversed region
                continue
            arg = self.argmax[r].reshape(c, -1)
            grad = dy[r].reshape(c, -1)
            rows = np.broadcast_to(np.arange(c)[:, None], arg.shape)
            keep = arg >= 0
            np.add.at(flat[batch[r]], (rows[keep], arg[keep]), grad[keep])


@register("PSROIPooling")
class PSROIPoolingLayer(_RegionPooling):
    """R-FCN's position-sensitive pooling: bin (i, j) of output channel k averages input channel
    (k * group_size + i) * group_size + j over its part of the region."""

    def layer_setup(self, bottom, top):
        p = self.param.psroi_pooling_param
        for name in ("spatial_scale", "output_dim", "group_size"):
            if not p.HasField(name):
                raise self.error(f"psroi_pooling_param.{name} is required")
        self.output_dim = self.positive(p.output_dim, "output_dim")
        self.group_size = self.positive(p.group_size, "group_size")
        self.pooled = (self.group_size, self.group_size)
        self.scale = self.dtype.type(p.spatial_scale)

    def out_channels(self, channels):
        if channels != self.output_dim * self.group_size ** 2:
            raise self.error(f"input channels ({channels}) must be output_dim x group_size^2 "
                             f"= {self.output_dim} x {self.group_size}^2")
        return self.output_dim

    def _windows(self, roi, h, w):
        """(i, j, h0, h1, w0, w1) of each bin, clipped to the feature map (R-FCN's rounding)."""
        dt, g = self.dtype.type, self.group_size
        start_w, start_h = dt(c_round(roi[1])) * self.scale, dt(c_round(roi[2])) * self.scale
        end_w = dt(c_round(roi[3]) + 1.0) * self.scale
        end_h = dt(c_round(roi[4]) + 1.0) * self.scale
        bin_h = max(end_h - start_h, dt(0.1)) / dt(g)
        bin_w = max(end_w - start_w, dt(0.1)) / dt(g)
        for i in range(g):
            h0 = min(max(int(math.floor(dt(i) * bin_h + start_h)), 0), h)
            h1 = min(max(int(math.ceil(dt(i + 1) * bin_h + start_h)), 0), h)
            for j in range(g):
                w0 = min(max(int(math.floor(dt(j) * bin_w + start_w)), 0), w)
                w1 = min(max(int(math.ceil(dt(j + 1) * bin_w + start_w)), 0), w)
                yield i, j, h0, h1, w0, w1

    def _channels(self, i, j):
        g = self.group_size
        return (np.arange(self.output_dim) * g + i) * g + j

    def forward(self, bottom, top):
        x, y = bottom[0].data, top[0].data
        h, w = x.shape[2:]
        rois, batch = self.rois(bottom)
        for r, roi in enumerate(rois):
            for i, j, h0, h1, w0, w1 in self._windows(roi, h, w):
                if h1 <= h0 or w1 <= w0:
                    y[r, :, i, j] = 0
                    continue
                y[r, :, i, j] = x[batch[r], self._channels(i, j), h0:h1, w0:w1].mean(axis=(1, 2))

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx, dy = bottom[0].diff, top[0].diff
        dx[...] = 0
        h, w = dx.shape[2:]
        rois, batch = self.rois(bottom)
        for r, roi in enumerate(rois):
            for i, j, h0, h1, w0, w1 in self._windows(roi, h, w):
                if h1 > h0 and w1 > w0:
                    area = (h1 - h0) * (w1 - w0)
                    dx[batch[r], self._channels(i, j), h0:h1, w0:w1] += \
                        (dy[r, :, i, j] / area)[:, None, None]
