"""The WindowData layer's source: a window file listing images and their labelled boxes with
overlaps, split into foreground and background windows, and batches of windows sampled at
random, padded with context, clipped to the image and warped to a square as Caffe does."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import cv2
import numpy as np

from purine.data import DataError
from purine.data.datum import decode_image
from purine.data.prefetch import Batch, BufferPool, PooledBatches, stream_batch
from purine.formats.files import BINARY_LIMIT, read_bounded, read_bounded_text

_SAMPLE = 0x3D1A  # the window draws' stream, apart from the other layers' streams
_FIELDS = ("channels", "height", "width", "num_windows")


@dataclass
class WindowFile:
    """A parsed window file: per image its path (root folder prepended) and the line of that
    path; per window its image, class, corners x1 y1 x2 y2 (inclusive, in pixels), overlap
    and line."""

    path: str
    images: list[str]
    image_lines: list[int]
    boxes: np.ndarray  # (N, 6) int64: image, class, x1, y1, x2, y2
    overlap: np.ndarray  # (N,) float32, as Caffe reads it
    lines: np.ndarray  # (N,) int64

    def where(self, i: int) -> str:
        return f"{self.path}:{self.lines[i]}"


# Caffe reads the file with C++ streams: tokens are split at C's whitespace, and integers
# are C ints of ASCII digits. Python's str.split(), str.isdigit() and int() accept more
# (Unicode spaces, superscript and other scripts' digits, '1_000'), so fields are matched here.
_WS = " \t\n\v\f\r"
_INT = r"[+-]?[0-9]+"
_FLOAT = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_SP = _WS.replace("\n", "")  # within one line
_SEP = f"[{_SP}]+"
_WINDOW = f"[{_SP}]*{_INT}{_SEP}{_FLOAT}(?:{_SEP}{_INT}){{4}}[{_SP}]*"
_SPLIT = re.compile(_SEP)
_WINDOWS = re.compile(f"{_WINDOW}(?:\n{_WINDOW})*", re.ASCII)
_IS_INT = re.compile(_INT, re.ASCII)
_IS_FLOAT = re.compile(_FLOAT, re.ASCII)
_IS_COUNT = re.compile(r"\+?[0-9]+", re.ASCII)
INT_MAX = 2**31 - 1  # Caffe reads every number of the file into a C int


def _value(text: str) -> int:
    """The value of an ASCII integer (``_INT``); past 20 digits it is only known to be out
    of a C int's range (int() refuses past 4300 digits), so it stands as +-2**64."""
    digits = text.lstrip("+-").lstrip("0")
    if len(digits) > 20:
        return -(2**64) if text.startswith("-") else 2**64
    return int(text)
_WINDOW_FIELDS = ("class_index", "x1", "y1", "x2", "y2")
_EXPECTED = "a window 'class_index overlap x1 y1 x2 y2' (integers and a number)"


def _ints_fit(ints: np.ndarray) -> bool:
    return bool(((ints >= -INT_MAX - 1) & (ints <= INT_MAX)).all())


def _fast_rows(chunk: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """The (n, 5) ints and (n,) overlaps of ``chunk``, converted at once, when every line
    is a well-formed window whose numbers fit; None sends the chunk to the line walk."""
    if not _WINDOWS.fullmatch("\n".join(chunk)):
        return None
    # numpy's own float parser is the fast one; ints within a C int are exact in float64,
    # and the regex above has made sure that they are integers.
    table = np.array(" ".join(chunk).split(), np.float64).reshape(len(chunk), 6)
    values = table[:, [0, 2, 3, 4, 5]]
    if not _ints_fit(values):
        return None
    ints = values.astype(np.int64)
    with np.errstate(over="ignore"):
        overlap = table[:, 1].astype(np.float32)
    if not np.isfinite(overlap).all():
        return None
    return ints, overlap


def _window(path: str, line: str, number: int) -> tuple[list[int], np.float32]:
    """One window line's five integers and overlap, each checked as Caffe reads it."""
    parts = _SPLIT.split(line.strip(_WS))
    if len(parts) != 6 or not all(_IS_INT.fullmatch(s) for s in parts[:1] + parts[2:]) \
            or not _IS_FLOAT.fullmatch(parts[1]):
        raise DataError(f"{path}:{number}: expected {_EXPECTED}, found {line.strip(_WS)!r}")
    ints = [_value(parts[0])] + [_value(s) for s in parts[2:]]
    for name, v, s in zip(_WINDOW_FIELDS, ints, parts[:1] + parts[2:]):
        if not -INT_MAX - 1 <= v <= INT_MAX:
            shown = s if len(s) <= 40 else s[:40] + "..."
            raise DataError(f"{path}:{number}: window {name} = {shown}; expected an integer from "
                            f"{-INT_MAX - 1} to {INT_MAX} (a C int, as Caffe reads it)")
    with np.errstate(over="ignore"):
        overlap = np.float32(float(parts[1]))
    if not np.isfinite(overlap):
        raise DataError(f"{path}:{number}: window overlap {parts[1]} does not fit a float; "
                        "expected a fraction from 0 to 1")
    return ints, overlap


def _rows(path: str, lines: list[str], first: int, n: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``n`` window lines from index ``first``: (int fields, overlaps, line numbers, next
    index). All rows are converted at once; the per-line walk only runs on a bad row.
    ``n`` is at most the lines left (the caller checks), so nothing here outgrows the file."""
    chunk = lines[first:first + n]
    if len(chunk) == n:
        fast = _fast_rows(chunk)
        if fast is not None:
            return (*fast, np.arange(first + 1, first + n + 1), first + n)
    ints, overlap, where = np.empty((n, 5), np.int64), np.empty(n, np.float32), []
    i = first
    for k in range(n):
        while i < len(lines) and not lines[i].strip(_WS):
            i += 1
        if i == len(lines):
            raise DataError(f"{path}:{i}: expected window {k + 1} of {n} "
                            "('class_index overlap x1 y1 x2 y2'), found the end of the file")
        ints[k], overlap[k] = _window(path, lines[i], i + 1)
        i += 1
        where.append(i)
    return ints, overlap, np.array(where, np.int64), i


def read_window_file(path: str | os.PathLike, root_folder: str = "") -> WindowFile:
    """Parse a window file: blocks of ``# image_index``, the image path, its channels,
    height and width, the number of windows, then one ``class_index overlap x1 y1 x2 y2``
    line per window. Image indices must count 0, 1, 2, ... as the blocks do, since a
    window names its image by that index. Every number is a C int of ASCII digits, as
    Caffe's stream reads it, and a window count is checked against the lines left."""
    path = os.fspath(path)
    text = read_bounded_text(path, what="the window file", error=DataError)
    # Lines end at '\n' only (and a '\r' before it is whitespace): str.splitlines() would
    # also split at characters that are no line end to Caffe (\x1c, \x85, \u2028).
    lines = text.split("\n")
    if lines[-1] == "":  # the '\n' that ends the last line
        lines.pop()
    i = 0

    def field(what: str) -> tuple[str, int]:
        nonlocal i
        while i < len(lines) and not lines[i].strip(_WS):
            i += 1
        if i == len(lines):
            raise DataError(f"{path}:{i}: expected {what}, found the end of the file")
        i += 1
        return lines[i - 1].strip(_WS), i

    images, image_lines, parts = [], [], []
    while True:
        while i < len(lines) and not lines[i].strip(_WS):
            i += 1
        if i == len(lines):
            break
        n = len(images)
        text, line = field(f"'# {n}' opening image block {n}")
        head = _SPLIT.split(text)
        if len(head) != 2 or head[0] != "#" or not _IS_INT.fullmatch(head[1]):
            raise DataError(f"{path}:{line}: expected '# {n}' opening image block {n}, "
                            f"found {text!r}")
        if _value(head[1]) != n:
            raise DataError(f"{path}:{line}: image index {head[1]}, expected {n}: windows "
                            "name their image by index, so the blocks must count 0, 1, 2, ...")
        name, line = field(f"the image path of image {n}")
        images.append(root_folder + name)
        image_lines.append(line)
        dims, at = [], []
        for what in _FIELDS:
            text, line = field(f"the {what} of image {n}")
            if not _IS_COUNT.fullmatch(text):
                raise DataError(f"{path}:{line}: expected the {what} of image {n} (a "
                                f"non-negative integer), found {text!r}")
            if _value(text) > INT_MAX:
                shown = text if len(text) <= 40 else text[:40] + "..."
                raise DataError(f"{path}:{line}: the {what} of image {n} is {shown}; expected "
                                f"a non-negative integer up to {INT_MAX} (a C int, as Caffe "
                                "reads it)")
            dims.append(_value(text))
            at.append(line)
        if dims[0] != 3:
            raise DataError(f"{path}:{at[0]}: image {n} has {dims[0]} channels; WindowData "
                            "reads every image in color, so the window file must give 3")
        if dims[3] > len(lines) - i:  # before allocating: each window takes one line
            k = sum(1 for s in lines[i:] if s.strip(_WS)) + 1
            raise DataError(f"{path}:{len(lines)}: expected window {k} of {dims[3]} "
                            "('class_index overlap x1 y1 x2 y2'), found the end of the file "
                            f"(line {at[3]} gives {dims[3]} windows)")
        ints, overlap, where, i = _rows(path, lines, i, dims[3])
        index = np.full((len(ints), 1), n, np.int64)
        parts.append((np.hstack([index, ints]), overlap, where))
    if not images:
        raise DataError(f"{path}: the window file is empty")
    return WindowFile(path, images, image_lines,
                      np.concatenate([p[0] for p in parts]).reshape(-1, 6),
                      np.concatenate([p[1] for p in parts]),
                      np.concatenate([p[2] for p in parts]).astype(np.int64))


def c_round(x: np.ndarray) -> np.ndarray:
    """C's round: halves away from zero (numpy's rounds them to even)."""
    x = np.asarray(x, np.float64)
    r = np.trunc(x)
    return (r + np.where(np.abs(x - r) >= 0.5, np.sign(x), 0)).astype(np.int64)


def warp_geometry(boxes: np.ndarray, rows: np.ndarray, cols: np.ndarray, mirror: np.ndarray,
                  *, crop: int, context_pad: int, square: bool, dtype: np.dtype
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For windows ``boxes`` (B, 4) = x1 y1 x2 y2 in images of ``rows`` x ``cols``: the
    region to cut (B, 4), the size (B, 2) = (height, width) to warp it to, and its offset
    (B, 2) = (top, left) inside the crop x crop square. With context padding or square
    mode the box is first grown about its centre (to its enclosing square, then by
    crop / (crop - 2 context_pad)), clipped to the image, and the part cut off outside the
    image becomes zero padding at the warped scale, mirrored with the window. The
    arithmetic is done in the net's ``dtype``, rounding as C does, as Caffe does."""
    x1, y1, x2, y2 = (boxes[:, j].astype(np.int64) for j in range(4))
    n = len(boxes)
    if not context_pad and not square:
        return (np.stack([x1, y1, x2, y2], 1), np.full((n, 2), crop, np.int64),
                np.zeros((n, 2), np.int64))
    t = np.dtype(dtype).type
    grow = t(crop) / t(crop - 2 * context_pad)
    half_h = (y2 - y1 + 1).astype(t) / t(2)
    half_w = (x2 - x1 + 1).astype(t) / t(2)
    cx, cy = x1.astype(t) + half_w, y1.astype(t) + half_h
    if square:
        half_h = half_w = np.maximum(half_h, half_w)
    x1, x2 = c_round(cx - half_w * grow), c_round(cx + half_w * grow)
    y1, y2 = c_round(cy - half_h * grow), c_round(cy + half_h * grow)
    full_h, full_w = y2 - y1 + 1, x2 - x1 + 1
    left, top = np.maximum(0, -x1), np.maximum(0, -y1)
    right, bottom = np.maximum(0, x2 - cols + 1), np.maximum(0, y2 - rows + 1)
    x1, x2, y1, y2 = x1 + left, x2 - right, y1 + top, y2 - bottom
    # The scale that would warp the whole grown box to the crop, applied to the part kept.
    sx, sy = t(crop) / full_w.astype(t), t(crop) / full_h.astype(t)
    out_w = c_round((x2 - x1 + 1).astype(t) * sx)
    out_h = c_round((y2 - y1 + 1).astype(t) * sy)
    pad_h = c_round(top.astype(t) * sy)
    pad_w = np.where(mirror, c_round(right.astype(t) * sx), c_round(left.astype(t) * sx))
    # Rounding may push the warped part past the square's edge: Caffe shrinks it to fit.
    out_h = np.minimum(out_h, crop - pad_h)
    out_w = np.minimum(out_w, crop - pad_w)
    return (np.stack([x1, y1, x2, y2], 1), np.stack([out_h, out_w], 1),
            np.stack([pad_h, pad_w], 1))


class WindowBatches(PooledBatches):
    """Batch k of replica r of R is drawn from the stream (seed, layer index, k*R + r):
    ``batch_size - int(batch_size * fg_fraction)`` background windows, then the foreground
    ones, each picked uniformly with replacement, and a coin per window when mirroring.
    A batch depends on its number only, so a resumed run continues with the same batches."""

    def __init__(self, windows: WindowFile, batch_size: int, *, crop: int,
                 context_pad: int = 0, square: bool = False, mirror: bool = False,
                 fg_threshold: float = 0.5, bg_threshold: float = 0.5,
                 fg_fraction: float = 0.25, scale: float = 1.0,
                 mean: np.ndarray | None = None, mean_file: str = "",
                 mean_values: list[float] | None = None, cache_images: bool = False,
                 dtype: str = "float32", seed: int = 0, index: int = 0,
                 replica: tuple[int, int] = (0, 1)):
        self.windows, self.batch_size, self.crop = windows, batch_size, crop
        self.context_pad, self.square, self.mirror = context_pad, square, mirror
        self.dtype = np.dtype(dtype)
        self.scale = self.dtype.type(np.float32(scale))
        self.seed, self.index, self.replica = seed, index, replica
        w = windows
        overlap = w.overlap
        fg = overlap >= np.float32(fg_threshold)
        bg = ~fg & (overlap < np.float32(bg_threshold))
        bad = np.flatnonzero(fg & (w.boxes[:, 1] <= 0))
        if len(bad):
            i = bad[0]
            raise DataError(f"{w.where(i)}: a foreground window (overlap {overlap[i]:g} >= "
                            f"fg_threshold {fg_threshold:g}) has class {w.boxes[i, 1]}; "
                            "classes of objects must be positive, 0 is the background")
        for name, sel, rule in (("foreground", fg, f">= fg_threshold {fg_threshold:g}"),
                                ("background", bg, f"< bg_threshold {bg_threshold:g}")):
            if not sel.any():
                raise DataError(f"window file '{w.path}' has no {name} windows (overlap "
                                f"{rule}); a batch needs both kinds")
        kept = fg | bg
        flat = np.flatnonzero(kept & ((w.boxes[:, 4] < w.boxes[:, 2])
                                      | (w.boxes[:, 5] < w.boxes[:, 3])))
        if len(flat):
            i = flat[0]
            raise DataError(f"{w.where(i)}: window x1 y1 x2 y2 = {tuple(w.boxes[i, 2:].tolist())}; "
                            "expected x1 <= x2 and y1 <= y2")
        self.fg, self.bg = np.flatnonzero(fg), np.flatnonzero(bg)
        self.labels = np.where(fg, w.boxes[:, 1], 0)
        self.num_fg = int(np.float32(batch_size) * np.float32(fg_fraction))
        self.mean = self.mean_values = None
        if mean is not None:
            c, h, width = mean.shape
            off = (width - crop) // 2  # Caffe centres the crop by the width on both axes
            if c != 3 or width < crop or off + crop > h:
                raise DataError(f"mean file '{mean_file}' is (channels, height, width) = "
                                f"{mean.shape}; WindowData needs 3 channels and a centre "
                                f"crop of {crop} x {crop}")
            self.mean = mean[:, off:off + crop, off:off + crop].astype(self.dtype)
        elif mean_values:
            if len(mean_values) not in (1, 3):
                raise DataError(f"{len(mean_values)} mean_value entries for images of 3 "
                                "channels; give 1 mean_value or 3")
            mv = np.broadcast_to(np.asarray(mean_values, np.float32), (3,))
            self.mean_values = mv.astype(self.dtype)[:, None, None]
        used = np.unique(w.boxes[kept, 0]).tolist()
        for i in used:
            if not os.path.isfile(w.images[i]):
                raise DataError(f"{w.path}:{w.image_lines[i]}: image '{w.images[i]}' does "
                                "not exist")
        # Caffe's cache keeps the encoded files in memory and decodes them per batch.
        self.cache: dict[int, np.ndarray] | None = None
        if cache_images:
            try:
                self.cache = {i: np.fromfile(w.images[i], np.uint8) for i in used}
            except OSError as e:
                raise DataError(f"window file '{w.path}': cannot cache image "
                                f"'{e.filename}': {e.strerror}") from None

    def class_counts(self) -> dict[int, int]:
        """How many usable windows each class has (0: background), as Caffe logs them."""
        picked = np.concatenate([self.bg, self.fg])
        classes, counts = np.unique(self.labels[picked], return_counts=True)
        return dict(zip(classes.tolist(), counts.tolist()))

    def image(self, i: int) -> np.ndarray:
        w = self.windows
        where = f"{w.path}:{w.image_lines[i]}: image '{w.images[i]}'"
        try:
            data = self.cache[i] if self.cache is not None else \
                read_bounded(w.images[i], BINARY_LIMIT, error=DataError)
            # decode_image: no codec prints on stderr; it gives (C, H, W), OpenCV's own
            # (H, W, C) transposed, so transposing back is free.
            return decode_image(data, cv2.IMREAD_COLOR, where).transpose(1, 2, 0)
        except DataError:
            raise DataError(f"{where}: cannot read the image (missing, unreadable or not an "
                            "image)") from None

    def read(self, k: int, pool: BufferPool) -> Batch:
        g = stream_batch(k, self.replica)
        b, crop = self.batch_size, self.crop
        rng = np.random.default_rng([self.seed, self.index, _SAMPLE, g])
        picked = np.concatenate([self.bg[rng.integers(0, len(self.bg), b - self.num_fg)],
                                 self.fg[rng.integers(0, len(self.fg), self.num_fg)]])
        flip = (rng.integers(0, 2, b).astype(bool) if self.mirror else np.zeros(b, bool))
        boxes = self.windows.boxes[picked]
        decoded = {i: self.image(i) for i in dict.fromkeys(boxes[:, 0].tolist())}
        shapes = np.array([decoded[i].shape[:2] for i in boxes[:, 0].tolist()])
        roi, size, pad = warp_geometry(boxes[:, 2:], shapes[:, 0], shapes[:, 1], flip,
                                       crop=crop, context_pad=self.context_pad,
                                       square=self.square, dtype=self.dtype)
        pixels = np.zeros((b, crop, crop, 3), np.uint8)
        inside = np.zeros((b, crop, crop), bool)
        for j in range(b):
            img = decoded[int(boxes[j, 0])]
            x1, y1, x2, y2 = roi[j].tolist()
            h, w = size[j].tolist()
            if (x1 < 0 or y1 < 0 or x2 >= img.shape[1] or y2 >= img.shape[0] or x2 < x1
                    or y2 < y1 or h <= 0 or w <= 0):
                i = int(picked[j])
                raise DataError(f"{self.windows.where(i)}: window x1 y1 x2 y2 = "
                                f"{tuple(boxes[j, 2:].tolist())} leaves no region of "
                                f"'{self.windows.images[boxes[j, 0]]}' (height, width = "
                                f"{img.shape[:2]}) to warp: the window must lie in the image")
            warped = cv2.resize(img[y1:y2 + 1, x1:x2 + 1], (w, h),
                                interpolation=cv2.INTER_LINEAR)
            if flip[j]:
                warped = warped[:, ::-1]
            top, left = pad[j].tolist()
            pixels[j, top:top + h, left:left + w] = warped
            inside[j, top:top + h, left:left + w] = True
        x = pixels.transpose(0, 3, 1, 2).astype(self.dtype)
        if self.mean is not None:
            x -= self.mean
        elif self.mean_values is not None:
            x -= self.mean_values
        x *= self.scale
        out = pool.array((b, 3, crop, crop), self.dtype)
        # The square around the warped part stays zero, as Caffe zeroes the batch first.
        out[...] = 0
        np.copyto(out, x, where=inside[:, None])
        return out, self.labels[picked].astype(self.dtype)
