"""Caffe's data pipeline: DataTransformer (transform), record readers (sources), background
prefetching (prefetch) and the data tools convert_cifar10 / convert_mnist / convert_imageset /
compute_image_mean (tools). The data layers themselves live in caffepar.nn.data."""
