"""Convolution arithmetic with Caffe's semantics, built on BLAS GEMM.

Blobs are (N, C, *spatial); weights (O, C/group, *kernel). Five engines, one module each, and
``dispatch.conv_engine`` is the one place that picks one for a layer shape:

* ``grid``: per-tap GEMMs on a flat polyphase grid, no im2col (many channels, large images; any
  number of spatial axes);
* ``cols`` (engine "im2col"): one deep GEMM per block of columns (few channels per group, or
  small images where the grid's garbage share is large; any number of spatial axes);
* ``band``: im2col whose columns span a batch of small 2-D images, the row taps being shifted
  views (CIFAR-sized layers);
* ``winograd``: F(2x2, 3x3) for wide 3x3 stride-1 layers (2.25x fewer multiplies);
* ``pointwise``: 1x1 stride-1 layers on large images, one GEMM per image in place.

Temporary workspace is bounded: images are processed in chunks (``geometry.WORKSPACE_BYTES``),
column buffers in blocks, and the work arrays are reused across calls
(``blas.release_workspace`` frees them). Results can be written into the caller's arrays
(``out=``, ``dx_out=``), which saves the layer a copy. GEMMs go through ``caffepar.nn.blas`` on
strided views.
"""
from caffepar.nn.conv.dispatch import (conv_backward, conv_engine, conv_engines, conv_forward,
                                       deconv_backward, deconv_forward, prepare_conv_forward)
from caffepar.nn.conv.epilogue import Epilogue, apply_epilogue
from caffepar.nn.conv.geometry import conv_output_shape
from caffepar.nn.conv.cols import col2im, im2col

__all__ = [
    "conv_engine",
    "conv_engines",
    "conv_forward",
    "prepare_conv_forward",
    "Epilogue",
    "apply_epilogue",
    "conv_backward",
    "deconv_forward",
    "deconv_backward",
    "conv_output_shape",
    "im2col",
    "col2im",
]
