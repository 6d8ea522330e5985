"""pycaffe's ``caffe.io``: BlobProto / Datum <-> array conversion, image loading and
resizing, oversampling, and the ``Transformer`` that turns (H, W, K) images into net inputs.
Images are read and resized with OpenCV where pycaffe uses scikit-image."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import cv2
import numpy as np
from google.protobuf.message import DecodeError

from purine.data import DataError
from purine.data.datum import encode_datum
from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2
from purine.formats.caffemodel import array_to_blob, shape_problem

__all__ = [
    "Transformer", "array_to_blobproto", "array_to_datum", "arraylist_to_blobprotovector_str",
    "blobproto_to_array", "blobprotovector_str_to_arraylist", "caffe_pb2", "datum_to_array",
    "load_image", "oversample", "resize_image",
]

# scikit-image's rgb2gray weights (ITU-R 709 luma), which pycaffe's load_image uses.
_GRAY = np.array([0.2125, 0.7154, 0.0721])


# -- proto / datum / ndarray conversion -----------------------------------------------------
class BlobShapeError(ProtoError, ValueError):
    """A BlobProto whose shape cannot hold its values (none given, or the wrong count); a
    ValueError, as pycaffe raises."""


def blobproto_to_array(blob: caffe_pb2.BlobProto, return_diff: bool = False) -> np.ndarray:
    """The blob's data (or diff) as a float64 array, shaped by the legacy num/channels/
    height/width when any of them is set, else by ``shape`` (pycaffe's order). A shape
    that cannot hold the values is a ProtoError, by the rules of the caffemodel reader."""
    values = blob.diff if return_diff else blob.data
    if (blob.HasField("num") or blob.HasField("channels") or blob.HasField("height")
            or blob.HasField("width")):
        shape: tuple[int, ...] = (blob.num, blob.channels, blob.height, blob.width)
    else:
        shape = tuple(blob.shape.dim)
    problem = shape_problem(shape, len(values))
    if problem:
        raise BlobShapeError(f"BlobProto {'diff' if return_diff else 'data'} {problem}")
    return np.array(values, dtype=np.float64).reshape(shape)


def array_to_blobproto(arr: np.ndarray, diff: np.ndarray | None = None
                       ) -> caffe_pb2.BlobProto:
    """A BlobProto with ``arr``'s shape and data (and ``diff``, assumed of the same shape)."""
    blob = array_to_blob(np.asarray(arr))
    if diff is not None:
        blob.diff.extend(np.asarray(diff, dtype=np.float64).ravel().tolist())
    return blob


def arraylist_to_blobprotovector_str(arraylist: Sequence[np.ndarray]) -> bytes:
    """A serialized BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(s: bytes) -> list[np.ndarray]:
    vec = caffe_pb2.BlobProtoVector()
    try:
        vec.ParseFromString(s)
    except DecodeError as e:
        raise ProtoError(f"not a serialized BlobProtoVector ({len(s)} bytes: {e})") from None
    out = []
    for k, blob in enumerate(vec.blobs):
        try:
            out.append(blobproto_to_array(blob))
        except ProtoError as e:
            raise ProtoError(f"BlobProtoVector blob {k}: {e}") from None
    return out


def array_to_datum(arr: np.ndarray, label: int | None = None) -> caffe_pb2.Datum:
    """A Datum of a (C, H, W) array: uint8 as the ``data`` bytes, anything else as
    ``float_data``; the label only when given."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError(f"array_to_datum: expected a 3-d (channels, height, width) array, "
                         f"got shape {arr.shape}")
    return caffe_pb2.Datum.FromString(encode_datum(arr, label))


def datum_to_array(datum: caffe_pb2.Datum) -> np.ndarray:
    """The (C, H, W) array of a raw Datum: uint8 from ``data``, float64 from
    ``float_data``; the label stays in ``datum.label``."""
    shape = (datum.channels, datum.height, datum.width)
    values = datum.data if len(datum.data) else datum.float_data
    problem = shape_problem(shape, len(values))
    if problem:
        raise DataError(f"Datum {problem}")
    if len(datum.data):
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape).copy()
    return np.array(datum.float_data, dtype=np.float64).reshape(shape)


# -- image IO -------------------------------------------------------------------------------
def load_image(filename: str | os.PathLike, color: bool = True) -> np.ndarray:
    """An image as float32 in [0, 1], (H, W, 3) RGB, or (H, W, 1) intensity when ``color`` is
    False (a colour image is converted with scikit-image's luma weights, as pycaffe's
    ``as_grey`` read does). An alpha channel is dropped; 16-bit images scale by 65535."""
    img = cv2.imread(os.fspath(filename), cv2.IMREAD_UNCHANGED)
    if img is None:
        raise PurineError(f"load_image: cannot read '{os.fspath(filename)}' (missing, or not "
                          "an image OpenCV reads)")
    if img.dtype == np.uint8 or img.dtype == np.uint16:
        img = img.astype(np.float64) / np.iinfo(img.dtype).max
    else:
        img = img.astype(np.float64)
    if img.ndim == 3:
        img = img[:, :, :3][:, :, ::-1]  # OpenCV's BGR(A) -> RGB
        if img.shape[2] == 1:
            img = img[:, :, 0]
    if not color and img.ndim == 3:
        img = img @ _GRAY
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    return np.ascontiguousarray(img, dtype=np.float32)


_INTERP = {0: cv2.INTER_NEAREST, 1: cv2.INTER_LINEAR, 3: cv2.INTER_CUBIC}


def resize_image(im: np.ndarray, new_dims: Sequence[int], interp_order: int = 1) -> np.ndarray:
    """(H, W, K) -> (new_dims[0], new_dims[1], K) float32, interpolated (order 0 nearest,
    1 bilinear, 3 bicubic). OpenCV's resize aligns pixel centres and repeats the edge, as
    scikit-image does inside the image; it does not blur before shrinking."""
    if interp_order not in _INTERP:
        raise ValueError(f"resize_image: interp_order {interp_order} is not supported; use "
                         "0 (nearest), 1 (linear) or 3 (cubic)")
    im = np.asarray(im)
    if im.ndim != 3:
        raise ValueError(f"resize_image: expected an (H, W, K) array, got shape {im.shape}")
    h, w = int(new_dims[0]), int(new_dims[1])
    lo, hi = (im.min(), im.max()) if im.size else (0, 0)
    if lo == hi:  # a constant image stays exactly constant
        return np.full((h, w, im.shape[2]), lo, dtype=np.float32)
    src = im.astype(np.float32, copy=False)
    # OpenCV takes at most 512 channels at once.
    parts = [cv2.resize(src[:, :, c:c + 512], (w, h), interpolation=_INTERP[interp_order])
             for c in range(0, im.shape[2], 512)]
    parts = [p[:, :, np.newaxis] if p.ndim == 2 else p for p in parts]
    return np.concatenate(parts, axis=2).astype(np.float32, copy=False)


def oversample(images: Sequence[np.ndarray], crop_dims: Sequence[int]) -> np.ndarray:
    """The four corner crops, the centre crop and their mirror images (flipped left-right)
    of each (H, W, K) image: (10 * N, crop_h, crop_w, K) float32, ten per image."""
    shape = np.array(images[0].shape)
    ch, cw = int(crop_dims[0]), int(crop_dims[1])
    centre = shape[:2] / 2.0
    corners = [(i, j) for i in (0, shape[0] - ch) for j in (0, shape[1] - cw)]
    # pycaffe truncates the centre crop's float corner to an integer.
    corners.append((int(centre[0] - ch / 2.0), int(centre[1] - cw / 2.0)))
    crops = np.empty((10 * len(images), ch, cw, shape[-1]), dtype=np.float32)
    for n, im in enumerate(images):
        five = np.stack([im[i:i + ch, j:j + cw, :] for i, j in corners])
        crops[10 * n:10 * n + 5] = five
        crops[10 * n + 5:10 * n + 10] = five[:, :, ::-1, :]
    return crops


# -- pre-processing -------------------------------------------------------------------------
class Transformer:
    """pycaffe's input formatting for a net, per input blob name. ``preprocess`` takes an
    (H', W', K) image and, in this order: converts to float32, resizes to the input's
    (H, W), transposes, swaps channels, multiplies by raw_scale, subtracts the mean,
    multiplies by input_scale. ``deprocess`` undoes it (but not the resize) for one image,
(K, H, W) or a (1, K, H, W) batch."""

    def __init__(self, inputs: Mapping[str, Sequence[int]]):
        self.inputs = {k: tuple(int(d) for d in v) for k, v in inputs.items()}
        self.transpose: dict[str, tuple[int, ...]] = {}
        self.channel_swap: dict[str, tuple[int, ...]] = {}
        self.raw_scale: dict[str, float] = {}
        self.mean: dict[str, np.ndarray] = {}
        self.input_scale: dict[str, float] = {}

    def _check_input(self, in_: str) -> None:
        if in_ not in self.inputs:
            raise KeyError(f"{in_!r} is not one of the net inputs: {sorted(self.inputs)}")

    def preprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        self._check_input(in_)
        # Unlike pycaffe, never scale the caller's float32 array in place.
        caffe_in = np.array(data, dtype=np.float32)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if in_ in self.transpose:
            caffe_in = caffe_in.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            caffe_in = caffe_in[list(self.channel_swap[in_]), :, :]
        if in_ in self.raw_scale:
            caffe_in *= self.raw_scale[in_]
        if in_ in self.mean:
            caffe_in -= self.mean[in_]
        if in_ in self.input_scale:
            caffe_in *= self.input_scale[in_]
        return caffe_in

    def deprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        self._check_input(in_)
        decaf_in = np.array(data)
        # pycaffe squeezes every unit axis, which breaks one-channel or one-row inputs; only
        # the batch axis of a (1, K, H, W) blob is dropped here.
        if decaf_in.ndim == len(self.inputs[in_]) and decaf_in.shape[0] == 1:
            decaf_in = decaf_in[0]
        if in_ in self.input_scale:
            decaf_in /= self.input_scale[in_]
        if in_ in self.mean:
            decaf_in += self.mean[in_]
        if in_ in self.raw_scale:
            decaf_in /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            decaf_in = decaf_in[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            decaf_in = decaf_in.transpose(np.argsort(self.transpose[in_]))
        return decaf_in

    def set_transpose(self, in_: str, order: Sequence[int]) -> None:
        """The axis order taking the (H, W, K) image to the blob's (K, H, W): (2, 0, 1)."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise ValueError(f"transpose order {tuple(order)} needs "
                             f"{len(self.inputs[in_]) - 1} axes, as the input has")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_: str, order: Sequence[int]) -> None:
        """The channel order after the transpose: (2, 1, 0) turns RGB into BGR."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise ValueError(f"channel swap {tuple(order)} needs {self.inputs[in_][1]} "
                             "entries, one per input channel")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_: str, scale: float) -> None:
        """Multiply the raw input (before the mean): 255 for models trained on [0, 255]
        pixels fed images from load_image, which are in [0, 1]."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_: str, mean: np.ndarray) -> None:
        """Subtract ``mean``: (K,) per channel, or (K, H, W) / (H, W) per element; an
        element-wise mean of another size is resized to the input's (H, W)."""
        self._check_input(in_)
        mean = np.asarray(mean)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError(f"mean has {ms[0]} channels, the input "
                                 f"{self.inputs[in_][1]}")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError(f"mean of shape {mean.shape}: expected (K,), (H, W) or "
                                 "(K, H, W)")
            if ms != self.inputs[in_][1:]:
                in_hw = self.inputs[in_][2:]
                m = mean.reshape(ms).transpose(1, 2, 0)
                mean = resize_image(m, in_hw).transpose(2, 0, 1)
        self.mean[in_] = mean

    def set_input_scale(self, in_: str, scale: float) -> None:
        """Multiply the blob after the mean subtraction (raw_scale acts before it)."""
        self._check_input(in_)
        self.input_scale[in_] = scale
