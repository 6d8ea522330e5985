"""Caffe's DataTransformer over a whole batch: mean subtraction (mean file at the full-size
index, or per-channel mean values), then scale, with crops (random offsets in TRAIN, the
centre in TEST) and random mirroring, done as array operations on the stacked batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from purine.data import DataError
from purine.data.datum import Image, read_mean, stack
from purine.formats import caffe_pb2 as pb

Shape = tuple[int, int, int]


class Transformer:
    """``Transformer(transform_param, phase, dtype)``; calling it on a batch of decoded
    images writes the transformed batch into ``out``.

    Caffe's arithmetic per element is ``(pixel - mean) * scale`` in the net's dtype, with the
    mean taken at the pixel's position in the full image; a mirrored sample is the unmirrored
    result reversed along the width, so the flip is applied last."""

    def __init__(self, param: pb.TransformationParameter, phase: int, dtype: str = "float32"):
        if param.HasField("mean_file") and len(param.mean_value):
            raise DataError("transform_param: cannot specify mean_file and mean_value at the "
                            "same time")
        if param.force_color and param.force_gray:
            raise DataError("transform_param: cannot set both force_color and force_gray")
        self.dtype = np.dtype(dtype)
        t = self.dtype.type
        self.crop = int(param.crop_size)
        self.scale = t(np.float32(param.scale))
        self.mirror = bool(param.mirror)
        # Caffe crops at random offsets only in TRAIN; it mirrors at random in both phases.
        self.random_crop = phase == pb.TRAIN and self.crop > 0
        self.force_color, self.force_gray = bool(param.force_color), bool(param.force_gray)
        self.mean_file = param.mean_file if param.HasField("mean_file") else None
        self.mean = read_mean(self.mean_file).astype(self.dtype) if self.mean_file else None
        self._pair: np.ndarray | None = None
        self.mean_values = (np.asarray(param.mean_value, np.float32).astype(self.dtype)
                            if len(param.mean_value) else None)

    @property
    def random(self) -> bool:
        """Whether a batch needs random draws (its generator)."""
        return self.mirror or self.random_crop

    def output_shape(self, shape: Sequence[int], where: str) -> Shape:
        """The transformed shape of one (C, H, W) image, after Caffe's checks."""
        c, h, w = (int(d) for d in shape)
        if self.crop and (h < self.crop or w < self.crop):
            raise DataError(f"{where}: crop_size {self.crop} is larger than the image "
                            f"(channels, height, width) = {(c, h, w)}")
        if self.mean is not None and self.mean.shape != (c, h, w):
            raise DataError(f"{where}: image (channels, height, width) = {(c, h, w)}, but the "
                            f"mean file '{self.mean_file}' is {self.mean.shape}; the mean "
                            "must have the full (uncropped) image size")
        if self.mean_values is not None and len(self.mean_values) not in (1, c):
            raise DataError(f"{where}: {len(self.mean_values)} mean_value entries for an image "
                            f"of {c} channels; give 1 mean_value or one per channel")
        return (c, self.crop, self.crop) if self.crop else (c, h, w)

    def __call__(self, images: Sequence[Image], out: np.ndarray,
                 rng: np.random.Generator | None, where: Callable[[int], str]) -> None:
        """Transform ``images`` (each (C, H, W)) into ``out`` (B, C, h, w). Sizes may
        differ between images when cropping, as in Caffe; images of one size are
        transformed together. ``where(i)`` names image ``i`` in error messages."""
        n = len(images)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, im in enumerate(images):
            groups.setdefault(im.shape, []).append(i)
        for shape, idx in groups.items():
            got = self.output_shape(shape, where(idx[0]))
            if got != out.shape[1:]:
                raise DataError(f"{where(idx[0])}: image (channels, height, width) = {shape} "
                                f"gives {got}; its batch takes {out.shape[1:]} (the batch's "
                                "first record's size): the records of one batch must have "
                                "one size, as in Caffe")
        mirror = (rng.integers(0, 2, size=n).astype(bool) if self.mirror
                  else np.zeros(n, bool))
        if self.crop:
            hs = np.array([im.shape[1] for im in images])
            ws = np.array([im.shape[2] for im in images])
            if self.random_crop:
                h_off = rng.integers(0, hs - self.crop + 1)
                w_off = rng.integers(0, ws - self.crop + 1)
            else:
                h_off, w_off = (hs - self.crop) // 2, (ws - self.crop) // 2
        else:
            h_off = w_off = np.zeros(n, np.int64)
        for idx in groups.values():
            x = stack([images[i] for i in idx])
            if len(groups) == 1:
                self._apply(x, h_off, w_off, mirror, out)
            else:
                part = np.empty((len(idx),) + out.shape[1:], out.dtype)
                self._apply(x, h_off[idx], w_off[idx], mirror[idx], part)
                out[idx] = part

    def _apply(self, x: np.ndarray, h_off: np.ndarray, w_off: np.ndarray, mirror: np.ndarray,
               out: np.ndarray) -> None:
        """One group of equal-size images ``x`` (B, C, H, W), which may be overwritten."""
        c, mean = self.crop, self.mean
        n, _, _, width = x.shape
        flip = np.flatnonzero(mirror)
        same = h_off.min() == h_off.max() and w_off.min() == w_off.max()
        if c and not same:
            # One window per sample: index the (crop x crop) window views of the batch.
            x = sliding_window_view(x, (c, c), axis=(2, 3))[np.arange(n), :, h_off, w_off]
        elif c:
            h0, w0 = int(h_off[0]), int(w_off[0])
            x = x[:, :, h0:h0 + c, w0:w0 + c]
        if len(flip):
            # Mirror the 8-bit crops, and take the mirrored samples' mean from the mirrored
            # mean image, where the window of a crop at w starts at width - crop - w.
            x[flip] = x[flip, ..., ::-1]
        if mean is not None and (len(flip) or (c and not same)):
            m = mirror.astype(np.intp)
            if c:
                w_eff = np.where(mirror, width - c - w_off, w_off)
                windows = sliding_window_view(self._mean_pair(), (c, c), axis=(2, 3))
                # (pair, H', W', C, c, c): adjacent indices make one (C, c, c) copy each
                mean = windows.transpose(0, 2, 3, 1, 4, 5)[m, h_off, w_eff]
            else:
                mean = self._mean_pair()[m]
        elif mean is not None and c:
            mean = mean[:, h0:h0 + c, w0:w0 + c]
        if mean is not None:
            np.subtract(x, mean, out=out)
        elif self.mean_values is not None:
            np.subtract(x, self.mean_values[:, None, None], out=out)
        else:
            out[...] = x
        if self.scale != 1:
            np.multiply(out, self.scale, out=out)

    def _mean_pair(self) -> np.ndarray:
        """The mean image and its mirror image, (2, C, H, W)."""
        if self._pair is None:
            self._pair = np.stack([self.mean, self.mean[..., ::-1]])
        return self._pair
