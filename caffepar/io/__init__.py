"""Files in and out: caffemodels (weights.py) and pycaffe's `caffe.io` helpers (with its
`caffe.io.caffe_pb2`, which scripts reach the messages through)."""
from caffepar.proto import caffe_pb2
from caffepar.io.pycaffe_io import (Transformer, array_to_blobproto, array_to_datum,
                                    arraylist_to_blobprotovector_str, blobproto_to_array,
                                    blobprotovector_str_to_arraylist, datum_to_array, load_image,
                                    oversample, resize_image)

__all__ = ["caffe_pb2", "Transformer", "array_to_blobproto", "array_to_datum",
           "arraylist_to_blobprotovector_str", "blobproto_to_array",
           "blobprotovector_str_to_arraylist", "datum_to_array", "load_image", "oversample",
           "resize_image"]
