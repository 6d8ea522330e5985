"""pycaffe's ``caffe.io``: BlobProto / Datum <-> array conversion, image loading and
resizing, oversampling, and the ``Transformer`` that turns (H, W, K) images into net inputs.
Images are read and resized with OpenCV where pycaffe uses scikit-image."""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import cv2
import numpy as np
from google.protobuf.message import DecodeError

from purine.data import DataError
from purine.data.datum import encode_datum, imdecode_quiet
from purine.errors import ProtoError, PurineError
from purine.formats import caffe_pb2
from purine.formats.caffemodel import array_to_blob, shape_problem
from purine.formats.files import BINARY_LIMIT, read_bounded
from purine.graph import CPU
from purine.runtime.memory import check_capacity

__all__ = [
    "IOArgumentError", "ImageReadError", "Transformer", "UnknownInputError",
    "array_to_blobproto", "array_to_datum", "arraylist_to_blobprotovector_str",
    "blobproto_to_array", "blobprotovector_str_to_arraylist", "caffe_pb2", "datum_to_array",
    "load_image", "oversample", "resize_image",
]

# scikit-image's rgb2gray weights (ITU-R 709 luma), which pycaffe's load_image uses.
_GRAY = np.array([0.2125, 0.7154, 0.0721])


# -- errors: each a PurineError and the builtin type pycaffe's own code raises there ------------
class IOArgumentError(PurineError, ValueError):
    """A ``caffe.io`` argument of the wrong shape or value (dims, crops, channel orders,
    means, scales); a ValueError, as pycaffe's checks and numpy's raise."""


class IOTypeError(PurineError, TypeError):
    """A ``caffe.io`` argument of the wrong kind (not a BlobProto, not an array of numbers)."""


class EmptyImagesError(IOArgumentError, IndexError):
    """``oversample`` of no images (pycaffe fails there with an IndexError)."""


class UnknownInputError(PurineError, KeyError):
    """A Transformer call naming no input of the net; a KeyError, shown as plain text."""

    __str__ = PurineError.__str__


class IOSizeError(PurineError, MemoryError):
    """An output (resized image, crops) larger than the host's memory, refused before it is
    allocated."""


class ImageReadError(PurineError, OSError):
    """``load_image`` of a file that is missing or no image OpenCV decodes (scikit-image
    raises an OSError there)."""


def _dims(what: str, dims: Any, n: int = 2) -> tuple[int, ...]:
    """``dims`` as ``n`` integers >= 0, or an IOArgumentError naming ``what``."""
    try:
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise IOArgumentError(f"{what}: expected {n} integer sizes, got {dims!r}") from None
    if len(out) != n or any(d < 0 for d in out):
        raise IOArgumentError(f"{what}: expected {n} integer sizes >= 0, got {out}")
    return out


def _image(what: str, im: Any, ndim: int = 3) -> np.ndarray:
    """``im`` as a numeric array of ``ndim`` axes, or an IOArgumentError naming ``what``."""
    a = _numbers(what, im, IOArgumentError)
    if a.ndim != ndim:
        want = "(H, W, K)" if ndim == 3 else f"{ndim}-d"
        raise IOArgumentError(f"{what}: expected an {want} array, got shape {a.shape}")
    return a


def _number(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise IOArgumentError(f"{what}: expected a number, got {value!r}")
    return float(value)


def _host_room(what: str, shape: Sequence[int], itemsize: int = 4) -> None:
    """Refuse an array of ``shape`` that cannot fit in host memory, before allocating it."""
    try:
        check_capacity(CPU, math.prod(int(d) for d in shape) * itemsize, 0,
                       f"{what} {tuple(int(d) for d in shape)}")
    except PurineError as e:
        raise IOSizeError(str(e)) from None


# -- proto / datum / ndarray conversion -----------------------------------------------------
class BlobShapeError(ProtoError, ValueError):
    """A BlobProto whose shape cannot hold its values (none given, or the wrong count); a
    ValueError, as pycaffe raises."""


def blobproto_to_array(blob: caffe_pb2.BlobProto, return_diff: bool = False) -> np.ndarray:
    """The blob's data (or diff) as a float64 array, shaped by the legacy num/channels/
    height/width when any of them is set, else by ``shape`` (pycaffe's order). A shape
    that cannot hold the values is a ProtoError, by the rules of the caffemodel reader."""
    if not isinstance(blob, caffe_pb2.BlobProto):
        raise IOTypeError(f"blobproto_to_array: expected a BlobProto, got {type(blob).__name__}")
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
    arr = _numbers("array_to_blobproto", arr)
    blob = array_to_blob(arr)
    if diff is not None:
        diff = _numbers("array_to_blobproto: diff", diff)
        if diff.shape != arr.shape:
            raise IOArgumentError(f"array_to_blobproto: diff of shape {diff.shape} for data of "
                                  f"shape {arr.shape}")
        blob.diff.extend(np.asarray(diff, dtype=np.float64).ravel().tolist())
    return blob


def _numbers(what: str, value: Any, error: type[PurineError] | None = None) -> np.ndarray:
    """``value`` as an array of numbers, or an ``error`` (default IOTypeError) naming
    ``what``."""
    error = error or IOTypeError
    try:
        a = np.asarray(value)
    except (TypeError, ValueError) as e:  # ragged nesting
        raise error(f"{what}: expected an array, got {type(value).__name__} ({e})") from None
    if a.dtype.kind not in "biuf":
        raise error(f"{what}: expected numbers, got an array of dtype {a.dtype}")
    return a


def arraylist_to_blobprotovector_str(arraylist: Sequence[np.ndarray]) -> bytes:
    """A serialized BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    if isinstance(arraylist, str | bytes | np.ndarray) or not isinstance(arraylist, Sequence):
        raise IOTypeError(f"arraylist_to_blobprotovector_str: expected a list of arrays, got "
                          f"{type(arraylist).__name__}")
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(s: bytes) -> list[np.ndarray]:
    vec = caffe_pb2.BlobProtoVector()
    if not isinstance(s, bytes | bytearray | memoryview):
        raise IOTypeError(f"blobprotovector_str_to_arraylist: expected bytes, got "
                          f"{type(s).__name__}")
    try:
        vec.ParseFromString(bytes(s))
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
    arr = _numbers("array_to_datum", arr)
    if label is not None:
        try:
            label = operator.index(label)
        except TypeError:
            raise IOTypeError(f"array_to_datum: label {label!r} is not an integer") from None
        if not -(2 ** 31) <= label < 2 ** 31:
            raise IOArgumentError(f"array_to_datum: label {label} is outside Datum's int32")
    if arr.ndim != 3:
        raise IOArgumentError(f"array_to_datum: expected a 3-d (channels, height, width) array, "
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
    path = os.fspath(filename)
    if not os.path.isfile(path):  # a directory or a device is not read at all
        raise ImageReadError(f"load_image: cannot read '{path}' (no such file)")
    try:
        data = read_bounded(path, BINARY_LIMIT, error=ImageReadError)
    except ImageReadError as e:
        raise ImageReadError(f"load_image: {e}") from None
    img, said = imdecode_quiet(data, cv2.IMREAD_UNCHANGED) if data else (None, "")
    if img is None or img.size == 0:
        raise ImageReadError(f"load_image: cannot read '{path}' (not an image OpenCV "
                             f"decodes, or damaged{': ' + said if said else ''})")
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


_INT_MAX = 2 ** 31 - 1
_INTERP = {0: cv2.INTER_NEAREST, 1: cv2.INTER_LINEAR, 3: cv2.INTER_CUBIC}


def resize_image(im: np.ndarray, new_dims: Sequence[int], interp_order: int = 1) -> np.ndarray:
    """(H, W, K) -> (new_dims[0], new_dims[1], K) float32, interpolated (order 0 nearest,
    1 bilinear, 3 bicubic). OpenCV's resize aligns pixel centres and repeats the edge, as
    scikit-image does inside the image; it does not blur before shrinking."""
    if isinstance(interp_order, bool) or interp_order not in _INTERP:
        raise IOArgumentError(f"resize_image: interp_order {interp_order!r} is not supported; "
                              "use 0 (nearest), 1 (linear) or 3 (cubic)")
    im = _image("resize_image", im)
    h, w = _dims("resize_image: new_dims", new_dims)
    _host_room("resize_image: an output of shape", (h, w, im.shape[2]))
    if max(h, w) > _INT_MAX:  # an empty output can still name a side OpenCV cannot hold
        raise IOArgumentError(f"resize_image: new_dims {(h, w)} past OpenCV's 2^31-1")
    lo, hi = (im.min(), im.max()) if im.size else (0, 0)
    if lo == hi or h == 0 or w == 0:  # a constant image stays exactly constant
        return np.full((h, w, im.shape[2]), lo, dtype=np.float32)
    src = im.astype(np.float32, copy=False)
    try:
        # OpenCV takes at most 512 channels at once.
        parts = [cv2.resize(src[:, :, c:c + 512], (w, h), interpolation=_INTERP[interp_order])
                 for c in range(0, im.shape[2], 512)]
    except cv2.error as e:  # sizes past OpenCV's int arithmetic
        raise IOArgumentError(f"resize_image: OpenCV cannot resize {im.shape} to {(h, w)}: "
                              f"{str(e).strip().splitlines()[-1]}") from None
    parts = [p[:, :, np.newaxis] if p.ndim == 2 else p for p in parts]
    return np.concatenate(parts, axis=2).astype(np.float32, copy=False)


def oversample(images: Sequence[np.ndarray], crop_dims: Sequence[int]) -> np.ndarray:
    """The four corner crops, the centre crop and their mirror images (flipped left-right)
    of each (H, W, K) image: (10 * N, crop_h, crop_w, K) float32, ten per image."""
    if isinstance(images, np.ndarray):
        images = _image("oversample: images", images, ndim=4)
    else:
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise IOArgumentError(f"oversample: expected a sequence of (H, W, K) images, got "
                                  f"{type(images).__name__}")
        images = [_image(f"oversample: image {n}", im) for n, im in enumerate(images)]
    if len(images) == 0:
        raise EmptyImagesError("oversample: no images to crop")
    shape = np.array(images[0].shape)
    for n, im in enumerate(images):
        if im.shape != images[0].shape:
            raise IOArgumentError(f"oversample: image {n} has shape {im.shape}, image 0 "
                                  f"{images[0].shape}; crops of one call share one geometry")
    ch, cw = _dims("oversample: crop_dims", crop_dims)
    if ch > shape[0] or cw > shape[1]:
        raise IOArgumentError(f"oversample: crop_dims {(ch, cw)} larger than the images "
                              f"{tuple(int(d) for d in shape[:2])}")
    _host_room("oversample: crops of shape", (10 * len(images), ch, cw, shape[-1]))
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
        if not isinstance(inputs, Mapping):
            raise IOArgumentError(f"Transformer: expected a mapping of input names to blob "
                                  f"shapes, got {type(inputs).__name__}")
        self.inputs = {}
        for k, v in inputs.items():
            try:
                shape = tuple(operator.index(d) for d in v)
            except TypeError:
                raise IOArgumentError(f"Transformer: input {k!r} has shape {v!r}; expected "
                                      "integers") from None
            if len(shape) < 2 or any(d < 0 for d in shape):
                raise IOArgumentError(f"Transformer: input {k!r} has shape {shape}; expected "
                                      "(N, K, ...) sizes >= 0")
            self.inputs[k] = shape
        self.transpose: dict[str, tuple[int, ...]] = {}
        self.channel_swap: dict[str, tuple[int, ...]] = {}
        self.raw_scale: dict[str, float] = {}
        self.mean: dict[str, np.ndarray] = {}
        self.input_scale: dict[str, float] = {}

    def _check_input(self, in_: str) -> None:
        try:
            known = in_ in self.inputs
        except TypeError:  # an unhashable name
            known = False
        if not known:
            raise UnknownInputError(f"{in_!r} is not one of the net inputs: "
                                    f"{sorted(self.inputs)}")

    def _order(self, in_: str, what: str, order: Any, n: int, unit: str
               ) -> tuple[int, ...]:
        """``order`` as a permutation of range(n), or an IOArgumentError."""
        try:
            out = tuple(operator.index(d) for d in order)
        except TypeError:
            raise IOArgumentError(f"{what} for {in_!r}: expected integers, got {order!r}"
                                  ) from None
        if len(out) != n:
            raise IOArgumentError(f"{what} {out} for {in_!r} needs {n} {unit}")
        if sorted(out) != list(range(n)):
            raise IOArgumentError(f"{what} {out} for {in_!r} is not an order of 0..{n - 1}")
        return out

    def preprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        self._check_input(in_)
        # Unlike pycaffe, never scale the caller's float32 array in place.
        caffe_in = np.array(_image(f"preprocess {in_!r}", data), dtype=np.float32)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, _dims(f"preprocess {in_!r}: input dims",
                                                    in_dims))
        if in_ in self.transpose:
            caffe_in = caffe_in.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            swap = self.channel_swap[in_]
            if caffe_in.shape[0] != len(swap):
                raise IOArgumentError(f"preprocess {in_!r}: channel swap {swap} for an image "
                                      f"with {caffe_in.shape[0]} channels after the transpose")
            caffe_in = caffe_in[list(swap), :, :]
        if in_ in self.raw_scale:
            caffe_in *= self.raw_scale[in_]
        if in_ in self.mean:
            mean = self.mean[in_]
            try:
                fits = np.broadcast_shapes(mean.shape, caffe_in.shape) == caffe_in.shape
            except ValueError:  # numpy's broadcast error
                fits = False
            if not fits:
                raise IOArgumentError(f"preprocess {in_!r}: mean of shape {mean.shape} for an "
                                      f"image of shape {caffe_in.shape}")
            caffe_in -= mean
        if in_ in self.input_scale:
            caffe_in *= self.input_scale[in_]
        return caffe_in

    def deprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        self._check_input(in_)
        decaf_in = np.array(_numbers(f"deprocess {in_!r}", data))
        decaf_in = decaf_in.astype(np.float64 if decaf_in.dtype == np.float64 else np.float32)
        # pycaffe squeezes every unit axis, which breaks one-channel or one-row inputs; only
        # the batch axis of a (1, K, H, W) blob is dropped here.
        if decaf_in.ndim == len(self.inputs[in_]) and decaf_in.shape[0] == 1:
            decaf_in = decaf_in[0]
        if decaf_in.ndim != len(self.inputs[in_]) - 1:
            raise IOArgumentError(f"deprocess {in_!r}: expected a (K, H, W) array or a batch "
                                  f"of one, got shape {np.shape(data)}")
        try:
            if in_ in self.input_scale:
                decaf_in /= self.input_scale[in_]
            if in_ in self.mean:
                decaf_in += self.mean[in_]
            if in_ in self.raw_scale:
                decaf_in /= self.raw_scale[in_]
        except ValueError:  # numpy's broadcast error, for a mean of another shape
            raise IOArgumentError(f"deprocess {in_!r}: mean of shape {self.mean[in_].shape} "
                                  f"for an array of shape {decaf_in.shape}") from None
        if in_ in self.channel_swap:
            swap = self.channel_swap[in_]
            if decaf_in.shape[0] != len(swap):
                raise IOArgumentError(f"deprocess {in_!r}: channel swap {swap} for an array "
                                      f"with {decaf_in.shape[0]} channels")
            decaf_in = decaf_in[np.argsort(swap), :, :]
        if in_ in self.transpose:
            decaf_in = decaf_in.transpose(np.argsort(self.transpose[in_]))
        return decaf_in

    def set_transpose(self, in_: str, order: Sequence[int]) -> None:
        """The axis order taking the (H, W, K) image to the blob's (K, H, W): (2, 0, 1)."""
        self._check_input(in_)
        self.transpose[in_] = self._order(in_, "transpose order", order,
                                          len(self.inputs[in_]) - 1, "axes, as the input has")

    def set_channel_swap(self, in_: str, order: Sequence[int]) -> None:
        """The channel order after the transpose: (2, 1, 0) turns RGB into BGR."""
        self._check_input(in_)
        self.channel_swap[in_] = self._order(in_, "channel swap", order, self.inputs[in_][1],
                                              "entries, one per input channel")

    def set_raw_scale(self, in_: str, scale: float) -> None:
        """Multiply the raw input (before the mean): 255 for models trained on [0, 255]
        pixels fed images from load_image, which are in [0, 1]."""
        self._check_input(in_)
        self.raw_scale[in_] = _number(f"raw_scale for {in_!r}", scale)

    def set_mean(self, in_: str, mean: np.ndarray) -> None:
        """Subtract ``mean``: (K,) per channel, or (K, H, W) / (H, W) per element; an
        element-wise mean of another size is resized to the input's (H, W)."""
        self._check_input(in_)
        try:
            mean = np.asarray(mean)
        except (TypeError, ValueError):
            mean = np.asarray(None)
        if mean.dtype.kind not in "biuf":
            raise IOArgumentError(f"mean for {in_!r}: expected numbers, got {type(mean)}")
        ms = mean.shape
        channels = self.inputs[in_][1]
        if mean.ndim == 1:
            if ms[0] != channels:
                raise IOArgumentError(f"mean has {ms[0]} channels, the input {channels}")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3 or len(self.inputs[in_]) != 4 or ms[0] not in (1, channels):
                raise IOArgumentError(f"mean of shape {mean.shape} for input {in_!r} "
                                      f"{self.inputs[in_]}: expected (K,), (H, W) or (K, H, W)")
            if ms != self.inputs[in_][1:]:
                in_hw = self.inputs[in_][2:]
                m = mean.reshape(ms).transpose(1, 2, 0)
                mean = resize_image(m, in_hw).transpose(2, 0, 1)
        self.mean[in_] = mean

    def set_input_scale(self, in_: str, scale: float) -> None:
        """Multiply the blob after the mean subtraction (raw_scale acts before it)."""
        self._check_input(in_)
        self.input_scale[in_] = _number(f"input_scale for {in_!r}", scale)
