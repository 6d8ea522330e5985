"""The ImageData layer's source: a list file of ``path label`` lines, images read with
OpenCV (color or gray, optionally resized), in list order or shuffled anew every epoch.
Position p of the stream is line ``perm_e[p % N]`` of epoch ``e = p // N``; each epoch's
permutation is drawn from (seed, layer index, e), so a resumed run sees the same order."""

from __future__ import annotations

import os
import re

import cv2
import numpy as np

from purine.data import DataError
from purine.data.datum import Image, check_depth, decode_image
from purine.data.prefetch import Batch, BufferPool, PooledBatches, stream_batch
from purine.data.transformer import Transformer
from purine.formats.files import BINARY_LIMIT, read_bounded, read_bounded_text

_LINE = re.compile(r"(.*)\s(\S+)")  # path, then the label after the last whitespace
_SHUFFLE = 0x5E1F  # keeps the epoch permutations' streams apart from the transforms'


def read_list(path: str | os.PathLike) -> list[tuple[str, int, int]]:
    """(image path, label, line number) per non-blank line of a Caffe list file; the label
    is the integer after the last space (or tab), as Caffe's ImageDataLayer and
    convert_imageset split a line, so paths may hold spaces."""
    path = os.fspath(path)
    text = read_bounded_text(path, what="the list file", error=DataError)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        split = _LINE.fullmatch(line)
        if split is None:
            why = "it has no label"
        else:
            name, label = split.groups()
            try:
                value = int(label)
            except ValueError:
                why = f"label '{label}' of '{name}' is not an integer"
            else:
                if -2**31 <= value < 2**31:
                    out.append((name, value, n))
                    continue
                why = f"label {value} does not fit Datum's int32"
        raise DataError(f"{path}:{n}: expected 'path label' (an integer label after the last "
                        f"space), got {line!r}: {why}")
    return out


class ImageList:
    """The images of one ImageData layer and the order they are read in."""

    def __init__(self, source: str | os.PathLike, *, root_folder: str = "", is_color: bool = True,
                 new_height: int = 0, new_width: int = 0, shuffle: bool = False,
                 seed: int = 0, index: int = 0):
        self.source = os.fspath(source)
        self.lines = read_list(self.source)
        if not self.lines:
            raise DataError(f"image list '{self.source}' lists no images")
        self.root, self.is_color = root_folder, is_color
        self.size = (new_width, new_height) if new_height > 0 and new_width > 0 else None
        self.shuffle, self.seed, self.index = shuffle, seed, index
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.lines)

    def line(self, pos: int) -> tuple[str, int, int]:
        n = len(self.lines)
        epoch, i = divmod(pos, n)
        if not self.shuffle:
            return self.lines[i]
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 2:
                self._perms.clear()
            rng = np.random.default_rng([self.seed, self.index, _SHUFFLE, epoch])
            perm = self._perms[epoch] = rng.permutation(n)
        return self.lines[perm[i]]

    def where(self, entry: tuple[str, int, int]) -> str:
        return f"{self.source}:{entry[2]}: image '{self.root + entry[0]}'"

    def image(self, entry: tuple[str, int, int]) -> Image:
        """Caffe's ReadImageToCVMat: imread color or gray, then cv2.resize if asked."""
        where = self.where(entry)
        try:
            data = read_bounded(self.root + entry[0], BINARY_LIMIT, error=DataError)
        except DataError as e:
            raise DataError(f"{where}: cannot read the image ({str(e).rsplit(': ', 1)[-1]})") \
                from None
        img = decode_image(data, cv2.IMREAD_COLOR if self.is_color else cv2.IMREAD_GRAYSCALE,
                           where)  # (C, H, W), a view of OpenCV's (H, W, C)
        if self.size is not None:
            img = check_depth(cv2.resize(img.transpose(1, 2, 0), self.size), where)
        return img


class ImageBatches(PooledBatches):
    """Batch k of replica r of R holds stream positions [skip + (k*R + r)*batch_size, ...)."""

    def __init__(self, images: ImageList, batch_size: int, transformer: Transformer,
                 *, dtype: str, seed: int, index: int,
                 replica: tuple[int, int] = (0, 1), skip: int = 0):
        self.images, self.batch_size, self.transformer = images, batch_size, transformer
        self.dtype = np.dtype(dtype)
        self.seed, self.index, self.replica, self.skip = seed, index, replica, skip

    def read(self, k: int, pool: BufferPool) -> Batch:
        g = stream_batch(k, self.replica)
        first = self.skip + g * self.batch_size
        entries = [self.images.line(first + i) for i in range(self.batch_size)]
        images = [self.images.image(e) for e in entries]
        labels = np.array([e[1] for e in entries], self.dtype)
        # Shaped by its first image, as Caffe's batches are (see DatumBatches.read).
        shape = self.transformer.output_shape(images[0].shape, self.images.where(entries[0]))
        out = pool.array((self.batch_size,) + shape, self.dtype)
        rng = (np.random.default_rng([self.seed, self.index, g])
               if self.transformer.random else None)
        self.transformer(images, out, rng, lambda i: self.images.where(entries[i]))
        return out, labels
