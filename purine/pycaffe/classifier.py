"""pycaffe's ``caffe.Classifier``: a deploy net that takes (H, W, K) images, scales them to
``image_dims``, and predicts from the centre crop or from the average of ten crops (corners,
centre and their mirror images), with the ``caffe.io.Transformer`` pre-processing."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from purine.caffe import TEST
from purine.errors import PurineError
from purine.pycaffe import io
from purine.pycaffe.net import Net

__all__ = ["Classifier", "input_transformer"]


def input_transformer(net: Net, mean: np.ndarray | None = None,
                      input_scale: float | None = None, raw_scale: float | None = None,
                      channel_swap: Sequence[int] | None = None) -> io.Transformer:
    """The Transformer that Classifier and Detector set up for the net's first input:
    (H, W, K) -> (K, H, W), then each step that was given."""
    in_ = net.inputs[0]
    transformer = io.Transformer({in_: net.blobs[in_].shape})
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


def first_input(net: Net, model_file: str | os.PathLike) -> str:
    """The net's first input blob, which must be (N, K, H, W) for images."""
    if not net.inputs:
        raise PurineError(f"{os.fspath(model_file)}: the net has no input blob to feed images "
                          "to (expected an Input layer or 'input' fields)")
    in_ = net.inputs[0]
    if len(net.blobs[in_].shape) != 4:
        raise PurineError(f"{os.fspath(model_file)}: input blob '{in_}' has shape "
                          f"{net.blobs[in_].shape}, expected (N, K, H, W) for images")
    return in_


class Classifier(Net):
    """``Classifier(model_file, pretrained_file, image_dims=None, mean=None,
    input_scale=None, raw_scale=None, channel_swap=None)``: the net in the TEST phase.
    ``image_dims`` (height, width) is the size images are scaled to before cropping; it
    defaults to the net input's, so that the crop is the whole image."""

    def __init__(self, model_file: str | os.PathLike, pretrained_file: str | os.PathLike | None
                 = None, image_dims: Sequence[int] | None = None,
                 mean: np.ndarray | None = None, input_scale: float | None = None,
                 raw_scale: float | None = None, channel_swap: Sequence[int] | None = None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        in_ = first_input(self, model_file)
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].shape[2:])
        if image_dims is None or len(image_dims) == 0:
            image_dims = self.crop_dims
        if len(image_dims) != 2 or np.any(np.asarray(image_dims) < self.crop_dims):
            raise PurineError(f"Classifier: image_dims {tuple(int(d) for d in image_dims)} "
                              "must be (height, width), each at least the net input's "
                              f"{tuple(int(d) for d in self.crop_dims)}")
        self.image_dims = image_dims

    def predict(self, inputs: Sequence[np.ndarray], oversample: bool = True) -> np.ndarray:
        """(N, classes) predictions of the net's first output for N (H, W, K) images:
        each scaled to ``image_dims``, then the mean over its ten crops (``oversample``)
        or its centre crop alone."""
        if len(inputs) == 0:
            raise PurineError("Classifier.predict: no input images")
        channels = np.shape(inputs[0])[-1]
        for k, im in enumerate(inputs):
            if np.ndim(im) != 3 or np.shape(im)[2] != channels:
                raise PurineError(f"Classifier.predict: input {k} has shape {np.shape(im)}, "
                                  f"expected (height, width, {channels})")
        h, w = (int(d) for d in self.image_dims)
        scaled = np.stack([io.resize_image(im, (h, w)) for im in inputs])

        ch, cw = (int(d) for d in self.crop_dims)
        if oversample:
            crops = io.oversample(scaled, (ch, cw))
        else:
            # pycaffe's centre crop: the float corner (centre - crop / 2) truncated.
            top, left = int(h / 2.0 - ch / 2.0), int(w / 2.0 - cw / 2.0)
            crops = scaled[:, top:top + ch, left:left + cw, :]

        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        if oversample:
            # pycaffe flattens each crop's output before averaging the ten.
            predictions = predictions.reshape((len(inputs), 10, -1)).mean(axis=1)
        return predictions
