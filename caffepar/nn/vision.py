"""Convolution, Deconvolution and Im2col: Caffe's layer parameters and blob handling over the
array kernels in caffepar.nn.conv."""
import numpy as np

from caffepar.blob import canonical_axis
from caffepar.nn import calibrate, conv
from caffepar.nn.base import Layer, register, reshaped_by_shape


def _geometry(layer, p, num_spatial):
    """Kernel, stride, pad and dilation per spatial axis from a ConvolutionParameter,
    with Caffe's rules for the repeated and the _h/_w forms."""

    def per_axis(name, values, h, w, has_hw, default):
        if has_hw:
            if num_spatial != 2:
                raise layer.error(f"{name}_h/{name}_w can only be used for 2-D convolution")
            if values:
                raise layer.error(f"give either {name} or {name}_h/{name}_w, not both")
            return (h, w)
        if not values:
            if default is None:
                raise layer.error(f"{name} is required")
            return (default,) * num_spatial
        if len(values) not in (1, num_spatial):
            raise layer.error(f"{name} must be given once or once per spatial axis "
                              f"({num_spatial}), got {len(values)} values")
        return tuple(values) * num_spatial if len(values) == 1 else tuple(values)

    kernel = per_axis("kernel_size", list(p.kernel_size), p.kernel_h, p.kernel_w,
                      p.HasField("kernel_h") or p.HasField("kernel_w"), None)
    for k in kernel:
        if k <= 0:
            raise layer.error(f"kernel_size must be > 0, got {k}")
    stride = per_axis("stride", list(p.stride), p.stride_h, p.stride_w,
                      p.HasField("stride_h") or p.HasField("stride_w"), 1)
    for s in stride:
        if s <= 0:
            raise layer.error(f"stride must be > 0, got {s}")
    pad = per_axis("pad", list(p.pad), p.pad_h, p.pad_w,
                   p.HasField("pad_h") or p.HasField("pad_w"), 0)
    dilation = per_axis("dilation", list(p.dilation), 1, 1, False, 1)
    for d in dilation:
        if d <= 0:
            raise layer.error(f"dilation must be > 0, got {d}")
    return kernel, stride, pad, dilation


class _ConvolutionBase(Layer):
    """Shared set-up of Convolution and Deconvolution: one set of weights applied to each
    bottom, giving the top of the same index."""

    min_bottoms = 1
    min_tops = 1
    transposed = False

    def check_blob_counts(self, bottom, top):
        super().check_blob_counts(bottom, top)
        if len(bottom) != len(top):
            raise self.error(f"needs one top per bottom, got {len(bottom)} bottoms and "
                             f"{len(top)} tops")

    def layer_setup(self, bottom, top):
        p = self.param.convolution_param
        self.axis = canonical_axis(p.axis, bottom[0].num_axes)
        self.num_spatial = bottom[0].num_axes - self.axis - 1
        if self.num_spatial < 1:
            raise self.error(f"bottom shape {bottom[0].shape} has no spatial axes after axis "
                             f"{self.axis}")
        self.kernel, self.stride, self.pad, self.dilation = _geometry(self, p, self.num_spatial)
        self.channels = bottom[0].shape[self.axis]
        self.num_output = self.positive(self.conv_num_output(p), "num_output")
        self.group = self.positive(self.conv_group(p), "group")
        if self.channels % self.group:
            raise self.error(f"input channels ({self.channels}) must be divisible by group "
                             f"({self.group})")
        if self.num_output % self.group:
            raise self.error(f"num_output ({self.num_output}) must be divisible by group "
                             f"({self.group})")
        self.bias_term = p.bias_term
        if self.transposed:
            wshape = (self.channels, self.num_output // self.group) + self.kernel
        else:
            wshape = (self.num_output, self.channels // self.group) + self.kernel
        if self.blobs_already_set(1 + self.bias_term):
            if self.blobs[0].shape != wshape:
                raise self.error(f"weight shape {self.blobs[0].shape}, expected {wshape}")
            return
        self.add_param_blob(wshape, p.weight_filler)
        if self.bias_term:
            self.add_param_blob((self.num_output,), p.bias_filler)

    def conv_num_output(self, p):
        return p.num_output

    def conv_group(self, p):
        return p.group

    def output_spatial(self, spatial):
        raise NotImplementedError

    @reshaped_by_shape
    def reshape(self, bottom, top):
        first = bottom[0].shape
        if len(first) != self.axis + 1 + self.num_spatial:
            raise self.error(f"bottom has {len(first)} axes, expected "
                             f"{self.axis + 1 + self.num_spatial}")
        if first[self.axis] != self.channels:
            raise self.error(f"bottom has {first[self.axis]} channels, the weights expect "
                             f"{self.channels}")
        for b in bottom[1:]:
            if b.shape != first:
                raise self.error(f"all bottoms must have the same shape; got {b.shape} and {first}")
        spatial = self.output_spatial(first[self.axis + 1:])
        if any(s <= 0 for s in spatial):
            raise self.error(f"output size {spatial} is not positive for input "
                             f"{first[self.axis + 1:]} (kernel {self.kernel}, stride "
                             f"{self.stride}, pad {self.pad}, dilation {self.dilation})")
        self.batch = int(np.prod(first[:self.axis], dtype=np.int64))
        for t in top:
            t.reshape(first[:self.axis] + (self.num_output,) + spatial)

    def _as_nc(self, array):
        return array.reshape((self.batch,) + array.shape[self.axis:])

    def _nc_view(self, array, source):
        """A (N, C, *S) view of a blob array for the kernels to write into, or None
        if the array's layout has none or it overlaps the kernel's input (in place)."""
        if np.may_share_memory(array, source):
            return None
        try:
            return np.reshape(array, (self.batch,) + array.shape[self.axis:], copy=False)
        except ValueError:
            return None

    def _kernels(self):
        return self.stride, self.pad, self.dilation, self.group

    def engine(self, bottom_shape):
        """The convolution engines this layer's shape runs on, in words (`caffepar time`
        prints it)."""
        return calibrate.describe(self.engine_choices(bottom_shape))

    def engine_choices(self, bottom_shape):
        """{pass: (engine, its measured choice or None)} (`caffepar time --engines`)."""
        spatial = tuple(bottom_shape[self.axis + 1:])
        if self.transposed:     # runs as the backward pass of the convolution top -> bottom
            spatial = self.output_spatial(spatial)
        need_dx = bool((self.bottom_need_diff or [True])[0])
        need_dw = bool(self.param_propagate_down[0]) if self.param_propagate_down else True
        return conv.conv_engines(spatial, self.blobs[0].shape, *self._kernels(),
                                 batch=self.batch, dtype=self.blobs[0].data.dtype,
                                 need_dx=need_dx, need_dw=need_dw, transposed=self.transposed)

    def folds_relu(self, top, slope):
        """A convolution (not a deconvolution) with one bottom and top: a ReLU after it in
        forward, or before it in backward (inside the direct engine's passes)."""
        return not self.transposed and len(self.param.bottom) == 1

    def takes_image_steps(self):
        """A convolution (not a deconvolution) with one bottom and top: the next layer's
        passes on each image inside the direct engine's loops."""
        return self.folds_relu(True, 0.0)

    def forward(self, bottom, top):
        w = self.blobs[0].data
        b = self.blobs[1].data if self.bias_term else None
        for bt, tp in zip(bottom, top):
            out = self._nc_view(tp.data, bt.data)
            if self.transposed:
                y = conv.deconv_forward(self._as_nc(bt.data), w, b, *self._kernels(), out=out)
            else:
                y = conv.conv_forward(self._as_nc(bt.data), w, b, *self._kernels(), out=out,
                                      relu=self.relu_top,
                                      after=None if out is None else self.step_top)
            if out is None:
                tp.data[...] = y.reshape(tp.shape)
                if self.step_top is not None:
                    self.step_top.run()

    def prepare_forward(self, bottom, top, epilogue=None):
        """A convolution (not a deconvolution) with one bottom and top along axis 1: the
        prepared call of caffepar.nn.conv (prepare_conv_forward), with `epilogue` (an Epilogue
        whose shift holds this layer's bias, if any) or, without one, its bias alone."""
        if self.transposed or len(bottom) != 1 or self.axis != 1:
            return None
        x, y = bottom[0].data, top[0].data
        if np.may_share_memory(x, y):
            return None
        if epilogue is None and self.bias_term:
            epilogue = conv.Epilogue(shift=self.blobs[1].data)
        return conv.prepare_conv_forward(x, self.blobs[0].data, *self._kernels(), y, epilogue)

    def backward(self, top, propagate_down, bottom):
        run = conv.deconv_backward if self.transposed else conv.conv_backward
        need_w = self.param_propagate_down[0]
        need_b = self.bias_term and self.param_propagate_down[1]
        for i, (bt, tp) in enumerate(zip(bottom, top)):
            step = {} if self.step_top_diff is None else {"before": self.step_top_diff}
            if not (propagate_down[i] or need_w or need_b or step):
                continue
            dx_out = self._nc_view(bt.diff, tp.diff) if propagate_down[i] else None
            relu = {} if self.relu_bottom is None else {
                "dx_relu": (self._as_nc(bt.data), self.relu_bottom)}
            dx, dw, db = run(self._as_nc(tp.diff), self._as_nc(bt.data), self.blobs[0].data,
                             *self._kernels(), need_dx=bool(propagate_down[i]),
                             need_dw=bool(need_w), need_db=bool(need_b), dx_out=dx_out, **relu,
                             **step)
            if need_w:
                self.blobs[0].diff += dw
            if need_b:
                self.blobs[1].diff += db
            if propagate_down[i] and dx_out is None:
                bt.diff[...] = dx.reshape(bt.shape)


@register("Convolution")
class ConvolutionLayer(_ConvolutionBase):
    def output_spatial(self, spatial):
        return conv.conv_output_shape(spatial, self.kernel, self.stride, self.pad,
                                      self.dilation)


@register("Deconvolution")
class DeconvolutionLayer(_ConvolutionBase):
    transposed = True

    def output_spatial(self, spatial):
        return tuple(s * (i - 1) + d * (k - 1) + 1 - 2 * p for i, k, s, p, d in
                     zip(spatial, self.kernel, self.stride, self.pad, self.dilation))


@register("Im2col")
class Im2colLayer(Layer):
    """Caffe's Im2col: each output position's receptive field as a column of channels x taps."""

    exact_bottoms = 1
    exact_tops = 1

    def layer_setup(self, bottom, top):
        p = self.param.convolution_param
        self.axis = canonical_axis(p.axis, bottom[0].num_axes)
        self.num_spatial = bottom[0].num_axes - self.axis - 1
        self.kernel, self.stride, self.pad, self.dilation = _geometry(self, p, self.num_spatial)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        spatial = conv.conv_output_shape(shape[self.axis + 1:], self.kernel, self.stride,
                                         self.pad, self.dilation)
        channels = shape[self.axis] * int(np.prod(self.kernel))
        top[0].reshape(shape[:self.axis] + (channels,) + spatial)

    def forward(self, bottom, top):
        x = bottom[0].data
        n = int(np.prod(x.shape[:self.axis], dtype=np.int64))
        cols = conv.im2col(x.reshape((n,) + x.shape[self.axis:]), self.kernel, self.stride,
                           self.pad, self.dilation)
        top[0].data[...] = cols.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x_shape = bottom[0].shape
        n = int(np.prod(x_shape[:self.axis], dtype=np.int64))
        dy = top[0].diff
        dx = conv.col2im(dy.reshape((n,) + dy.shape[self.axis:]),
                         (n,) + x_shape[self.axis:], self.kernel, self.stride, self.pad,
                         self.dilation)
        bottom[0].diff[...] = dx.reshape(x_shape)
