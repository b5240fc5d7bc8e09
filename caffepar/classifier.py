"""pycaffe's Classifier: a TEST-phase Net that takes H x W x K images in [0, 1], resizes them
to image_dims, and predicts from the centre crop or from the average over 10 crops (four corners,
centre and their mirrors)."""
import numpy as np

from caffepar.io import pycaffe_io
from caffepar.pycaffe import TEST, Net


def _configured_transformer(net, mean, input_scale, raw_scale, channel_swap):
    """A Transformer for the net's first input: H x W x K -> K x H x W and the given
    preprocessing (shared by Classifier and Detector)."""
    in_ = net.inputs[0]
    transformer = pycaffe_io.Transformer({in_: net.blobs[in_].data.shape})
    transformer.set_transpose(in_, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(in_, mean)
    if input_scale is not None:
        transformer.set_input_scale(in_, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(in_, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(in_, channel_swap)
    return transformer


class Classifier(Net):
    """image_dims: size images are resized to before cropping (default: the net's input size);
    mean, input_scale, raw_scale, channel_swap: as caffe.io.Transformer's."""

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None,
                 input_scale=None, raw_scale=None, channel_swap=None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        self.transformer = _configured_transformer(self, mean, input_scale, raw_scale,
                                                   channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].data.shape[2:])
        self.image_dims = self.crop_dims if image_dims is None or not len(image_dims) \
            else np.asarray(image_dims)

    def predict(self, inputs, oversample=True):
        """N x classes probabilities (the net's first output) for a list of H x W x K images;
        oversample averages over the 10 crops, else the centre crop is used."""
        images = np.zeros((len(inputs), int(self.image_dims[0]), int(self.image_dims[1]),
                           inputs[0].shape[2]), np.float32)
        for i, image in enumerate(inputs):
            images[i] = pycaffe_io.resize_image(image, self.image_dims)
        if oversample:
            crops = pycaffe_io.oversample(images, self.crop_dims)
        else:
            top, left = ((np.asarray(self.image_dims) - self.crop_dims) / 2.0).astype(int)
            crops = images[:, top:top + self.crop_dims[0], left:left + self.crop_dims[1], :]
        in_ = self.inputs[0]
        batch = np.zeros((len(crops), crops.shape[3]) + tuple(self.crop_dims), np.float32)
        for i, crop in enumerate(crops):
            batch[i] = self.transformer.preprocess(in_, crop)
        predictions = self.forward_all(**{in_: batch})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape(len(predictions) // 10, 10, -1).mean(1)
        return predictions

