"""pycaffe's ``caffe.Detector``: R-CNN style windowed detection with a deploy net. Each
(ymin, xmin, ymax, xmax) window of an image is cropped, optionally with a border of context
around it (mean-filled where it leaves the image), warped to the net input and classified."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from purine.caffe import TEST
from purine.errors import PurineError
from purine.pycaffe import io
from purine.pycaffe.classifier import first_input, input_transformer
from purine.pycaffe.net import Net

__all__ = ["Detector"]


class Detector(Net):
    """``Detector(model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
    channel_swap=None, context_pad=None)``: the net in the TEST phase. With ``context_pad``
    p, a window is enlarged so that, once warped, a p-pixel border of the net input is the
    context around it (R-CNN's feature extraction)."""

    def __init__(self, model_file: str | os.PathLike, pretrained_file: str | os.PathLike | None
                 = None, mean: np.ndarray | None = None, input_scale: float | None = None,
                 raw_scale: float | None = None, channel_swap: Sequence[int] | None = None,
                 context_pad: int | None = None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        first_input(self, model_file)
        self.transformer = input_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows: Iterable[tuple[str, Sequence[Sequence[float]]]]
                       ) -> list[dict[str, Any]]:
        """Classify every window of every image: ``images_windows`` holds (image filename,
        windows) pairs, a window being (ymin, xmin, ymax, xmax). Returns one dict per
        window, in order: ``filename``, ``window`` and the net's ``prediction`` for it."""
        # A list, as the pairs are read twice (pycaffe's loops over a zip would find it empty).
        pairs = [(fname, list(windows)) for fname, windows in images_windows]
        crops = []
        for fname, windows in pairs:
            image = io.load_image(fname).astype(np.float32)
            crops.extend(self.crop(image, w) for w in windows)
        if not crops:
            raise PurineError("Detector.detect_windows: no windows to detect in")

        in_ = self.inputs[0]
        caffe_in = np.stack([self.transformer.preprocess(in_, c) for c in crops])
        predictions = self.forward_all(**{in_: caffe_in})[self.outputs[0]]
        placed = [(fname, w) for fname, windows in pairs for w in windows]
        return [{"window": w, "prediction": p, "filename": fname}
                for (fname, w), p in zip(placed, predictions)]

    def detect_selective_search(
            self, image_fnames: Iterable[str]) -> list[dict[str, Any]]:  # noqa: ARG002
        """pycaffe proposes windows with the MATLAB selective search code of R-CNN; purine
        does not ship it, so this always raises."""
        raise PurineError(
            "Detector.detect_selective_search: selective search window proposals (the MATLAB "
            "package selective_search_ijcv_with_python) are not part of purine; compute the "
            "windows elsewhere and call detect_windows([(filename, windows), ...]), or run "
            "detect.py with --crop_mode list")

    def crop(self, im: np.ndarray, window: Sequence[float]) -> np.ndarray:
        """The (H', W', K) crop of ``im`` for ``window`` (ymin, xmin, ymax, xmax; ymax and
        xmax exclusive). With ``context_pad`` it is the net input's size: the window
        enlarged by the context and scaled into it, the part outside ``im`` left as the
        mean (in raw image units, so that it pre-processes to zero)."""
        win = np.asarray(window, dtype=np.float64).ravel()
        if win.shape != (4,):
            raise PurineError(f"Detector.crop: window {tuple(win.tolist())} must be (ymin, "
                              "xmin, ymax, xmax)")
        y0, x0, y1, x1 = (int(v) for v in win)
        im_hw = np.array(im.shape[:2], dtype=np.float64)
        if not self.context_pad:
            crop = im[y0:y1, x0:x1]
            if crop.size == 0:
                raise PurineError(f"Detector.crop: window {(y0, x0, y1, x1)} holds no pixel of "
                                  f"the {im.shape[0]} x {im.shape[1]} image")
            return crop

        # Caffe's arithmetic: a window's size counts both ends (ymax - ymin + 1) while the
        # slices below exclude them; kept so that crops match pycaffe's pixel for pixel.
        # pycaffe scales both axes by the input width (square inputs); each axis has its own
        # size here, which agrees with it there.
        size = self.crop_dims[:2].astype(np.float64)
        scale = size / (size - 2.0 * self.context_pad)
        half = (win[2:] - win[:2] + 1) / 2.0
        centre = win[:2] + half
        box = np.round(np.concatenate([centre - scale * half, centre + scale * half]))
        fit = size / (box[2:] - box[:2] + 1)
        pad = np.round(np.maximum(0.0, -box[:2]) * fit)  # rows / columns left of the image
        box = np.clip(box, 0.0, np.tile(im_hw, 2))
        inside = np.minimum(np.round((box[2:] - box[:2] + 1) * fit), size - pad)
        b = box.astype(int)
        context = im[b[0]:b[2], b[1]:b[3]]
        if context.size == 0 or np.any(inside <= 0):
            raise PurineError(f"Detector.crop: window {(y0, x0, y1, x1)} with context_pad "
                              f"{self.context_pad} holds no pixel of the {im.shape[0]} x "
                              f"{im.shape[1]} image")
        (py, px), (h, w) = pad.astype(int), inside.astype(int)
        crop = np.ones(tuple(self.crop_dims), dtype=np.float32) * self.crop_mean
        crop[py:py + h, px:px + w] = io.resize_image(context, (h, w))
        return crop

    def configure_crop(self, context_pad: int | None) -> None:
        """Set ``crop_dims`` (the net input as (H, W, K)), ``context_pad`` and, with context,
        ``crop_mean``: the transformer's mean taken back to raw image units and layout
        (channels unswapped, divided by raw_scale), or zeros without a mean."""
        in_ = self.inputs[0]
        t = self.transformer
        back = np.argsort(t.transpose[in_])  # blob axes -> image axes
        self.crop_dims = np.array(self.blobs[in_].shape[1:])[back]
        self.context_pad = context_pad
        if not context_pad:
            return
        if 2 * context_pad >= min(self.crop_dims[:2]):
            raise PurineError(f"Detector: context_pad {context_pad} leaves no room for the "
                              f"window in the {self.crop_dims[0]} x {self.crop_dims[1]} input "
                              "(expected 2 * context_pad below the input's height and width)")
        mean = t.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(tuple(self.crop_dims), dtype=np.float32)
            return
        mean = np.asarray(mean, dtype=np.float32)
        if mean.ndim == 2:  # an (H, W) mean of a one-channel input
            mean = mean[np.newaxis]
        crop_mean = mean.transpose(back)
        if in_ in t.channel_swap:
            crop_mean = crop_mean[:, :, np.argsort(t.channel_swap[in_])]
        if in_ in t.raw_scale:
            crop_mean = crop_mean / t.raw_scale[in_]
        self.crop_mean = crop_mean
