"""pycaffe's Detector: a TEST-phase Net that classifies windows of images (R-CNN style), each
window cropped, optionally with `context_pad` pixels of surrounding context (the part outside
the image filled with the mean), and warped to the net's input size."""
import os

import numpy as np

from caffepar.classifier import _configured_transformer
from caffepar.io import pycaffe_io
from caffepar.pycaffe import TEST, Net


class Detector(Net):
    """mean, input_scale, raw_scale, channel_swap: as caffe.io.Transformer's; context_pad:
    pixels of context around each window in the net's input, as in R-CNN."""

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None, context_pad=None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        self.transformer = _configured_transformer(self, mean, input_scale, raw_scale,
                                                   channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """[(image file, [window (ymin, xmin, ymax, xmax), ...]), ...] -> a list of
        {"window", "prediction", "filename"} dicts, in order."""
        images_windows = [(name, list(windows)) for name, windows in images_windows]
        crops = []
        for name, windows in images_windows:
            image = pycaffe_io.load_image(name).astype(np.float32)
            crops.extend(self.crop(image, window) for window in windows)
        in_ = self.inputs[0]
        batch = np.zeros((len(crops), crops[0].shape[2]) + self.blobs[in_].data.shape[2:],
                         np.float32)
        for i, crop in enumerate(crops):
            batch[i] = self.transformer.preprocess(in_, crop)
        predictions = self.forward_all(**{in_: batch})[self.outputs[0]]
        detections = []
        for name, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[len(detections)],
                                   "filename": name})
        return detections

    def detect_selective_search(self, image_fnames):
        """detect_windows over Selective Search proposals (needs the
        selective_search_ijcv_with_python package and MATLAB, as pycaffe)."""
        import selective_search_ijcv_with_python as selective_search
        image_fnames = [os.path.abspath(f) for f in image_fnames]
        windows = selective_search.get_windows(image_fnames, cmd="selective_search_rcnn")
        return self.detect_windows(zip(image_fnames, windows))

    def crop(self, im, window):
        """The window (ymin, xmin, ymax, xmax) of an H x W x K image, with context padding
        when configured: the box grows so that after warping to the input size context_pad
        pixels surround it; what falls outside the image is the mean."""
        window = np.asarray(window)
        if not self.context_pad:
            return im[window[0]:window[2], window[1]:window[3]]
        crop_size = self.blobs[self.inputs[0]].width
        scale = crop_size / (crop_size - self.context_pad * 2.0)
        half_h = (window[2] - window[0] + 1) / 2.0
        half_w = (window[3] - window[1] + 1) / 2.0
        center = np.array([window[0] + half_h, window[1] + half_w])
        box = np.round(np.tile(center, 2) + scale * np.array([-half_h, -half_w, half_h, half_w]))
        scale_h = crop_size / (box[2] - box[0] + 1)
        scale_w = crop_size / (box[3] - box[1] + 1)
        pad_y = round(max(0, -box[0]) * scale_h)
        pad_x = round(max(0, -box[1]) * scale_w)
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0, [im_h, im_w, im_h, im_w]).astype(int)
        crop_h = min(round((box[2] - box[0] + 1) * scale_h), crop_size - pad_y)
        crop_w = min(round((box[3] - box[1] + 1) * scale_w), crop_size - pad_x)
        if crop_h <= 0 or crop_w <= 0 or box[2] <= box[0] or box[3] <= box[1]:
            raise ValueError(f"window {tuple(window)} lies outside the {im_h} x {im_w} image")
        context = pycaffe_io.resize_image(im[box[0]:box[2], box[1]:box[3]], (crop_h, crop_w))
        crop = np.ones(self.crop_dims, np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context
        return crop

    def configure_crop(self, context_pad):
        """Set the crop size (the input's H x W x K) and context padding; with context, the
        mean in unprocessed image space fills what lies outside the image."""
        in_ = self.inputs[0]
        inverse = np.argsort(self.transformer.transpose[in_])
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inverse]
        self.context_pad = context_pad
        if not context_pad:
            return
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, np.float32)
            return
        crop_mean = mean.copy().transpose(inverse)
        swap = self.transformer.channel_swap.get(in_)
        if swap is not None:
            crop_mean = crop_mean[:, :, np.argsort(swap)]
        raw_scale = self.transformer.raw_scale.get(in_)
        if raw_scale is not None:
            crop_mean = crop_mean / raw_scale
        self.crop_mean = crop_mean
