"""HDF5Data's source: rows file after file and wrapping, batches across file ends, seeded
shuffling of file and row order per epoch, the checks made when the net is built, and the
message without h5py."""

import sys

import h5py
import numpy as np
import pytest

from purine.data import DataError
from purine.data.hdf5 import HDF5Batches, HDF5Source


def write_h5(path, data, label):
    with h5py.File(path, "w") as f:
        f["data"] = data
        f["label"] = label
    return str(path)


def two_files(tmp_path):
    write_h5(tmp_path / "a.h5", np.arange(3 * 2, dtype=np.float32).reshape(3, 2),
             np.arange(3))
    write_h5(tmp_path / "b.h5", 100 + np.arange(4 * 2, dtype=np.float64).reshape(4, 2),
             np.arange(3, 7))
    (tmp_path / "list.txt").write_text("a.h5\n  b.h5")  # names relative to the list file
    return tmp_path / "list.txt"


def test_rows_across_files_and_wrap(tmp_path):
    src = HDF5Source(two_files(tmp_path), ["data", "label"], shuffle=False, dtype="float64")
    assert src.rows == [3, 4] and src.row_shapes == [(2,), ()]
    read = HDF5Batches(src, 3).reader()
    labels = [read(k)[1].tolist() for k in range(4)]
    assert labels == [[0, 1, 2], [3, 4, 5], [6, 0, 1], [2, 3, 4]]
    data = read(1)[0]
    assert data.dtype == np.float64
    np.testing.assert_array_equal(data, 100 + np.arange(6).reshape(3, 2))
    # Replica 1 of 2 reads the odd batches.
    odd = HDF5Batches(src, 3, replica=(1, 2)).reader()
    assert [odd(k)[1].tolist() for k in range(2)] == [labels[1], labels[3]]


def test_shuffle_is_seeded_and_a_permutation_per_epoch(tmp_path):
    lst = two_files(tmp_path)
    src = HDF5Source(lst, ["label"], shuffle=True, dtype="float32", seed=5, index=2)
    read = HDF5Batches(src, 7).reader()
    epochs = [read(k)[0].astype(int).tolist() for k in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(7))
        # Rows of one file stay together: a file is read whole before the next.
        assert sorted(e[:3]) in ([0, 1, 2], [3, 4, 5]) or sorted(e[:4]) == [3, 4, 5, 6]
    assert len({tuple(e) for e in epochs}) > 1
    again = HDF5Batches(HDF5Source(lst, ["label"], shuffle=True, dtype="float32", seed=5,
                                   index=2), 7).reader()
    assert again(2)[0].astype(int).tolist() == epochs[2]


def test_build_time_checks(tmp_path):
    write_h5(tmp_path / "a.h5", np.zeros((3, 2)), np.zeros(3))
    write_h5(tmp_path / "b.h5", np.zeros((3, 5)), np.zeros(3))
    write_h5(tmp_path / "c.h5", np.zeros((3, 2)), np.zeros(4))
    (tmp_path / "ab.txt").write_text(f"{tmp_path}/a.h5 {tmp_path}/b.h5")
    with pytest.raises(DataError, match=r"b.h5': dataset 'data' rows are \(5,\), in .*a.h5"):
        HDF5Source(tmp_path / "ab.txt", ["data"], shuffle=False, dtype="float32")
    (tmp_path / "c.txt").write_text(f"{tmp_path}/c.h5")
    with pytest.raises(DataError, match="dataset 'label' has 4 rows, dataset 'data' has 3"):
        HDF5Source(tmp_path / "c.txt", ["data", "label"], shuffle=False, dtype="float32")
    (tmp_path / "a.txt").write_text(f"{tmp_path}/a.h5")
    with pytest.raises(DataError, match="a.h5' .*has no dataset 'target' for top 'target'"):
        HDF5Source(tmp_path / "a.txt", ["target"], shuffle=False, dtype="float32")
    (tmp_path / "x.txt").write_text(f"{tmp_path}/nothere.h5")
    with pytest.raises(DataError, match="nothere.h5' .*cannot be read"):
        HDF5Source(tmp_path / "x.txt", ["data"], shuffle=False, dtype="float32")
    (tmp_path / "e.txt").write_text("\n")
    with pytest.raises(DataError, match="lists no files"):
        HDF5Source(tmp_path / "e.txt", ["data"], shuffle=False, dtype="float32")


def test_without_h5py(monkeypatch, tmp_path):
    lst = two_files(tmp_path)
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py now raises ImportError
    with pytest.raises(DataError, match=r"pip install purine-caffe\[hdf5\]"):
        HDF5Source(lst, ["data"], shuffle=False, dtype="float32")
