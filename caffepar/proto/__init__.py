"""Caffe's schema (generated from proto/caffe.proto) and the readers built on it."""
from caffepar.proto import caffe_pb2

__all__ = ["caffe_pb2"]
