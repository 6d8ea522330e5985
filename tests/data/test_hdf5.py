"""HDF5Data's source: rows file after file and wrapping, batches across file ends, seeded
shuffling of file and row order per epoch, the checks made when the net is built, and the
message without h5py."""

import re
import sys

import h5py
import numpy as np
import pytest

from purine.data import DataError
from purine.data.hdf5 import HDF5Batches, HDF5Source


def exactly(text: str) -> str:
    return "^" + re.escape(text) + "$"


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


# -- hostile sources: refused when the source is opened, before iteration 0 ----------------
def hostile(tmp_path, build):
    """A list naming one file that ``build`` fills beside a good 'label' dataset."""
    path = tmp_path / "h.h5"
    with h5py.File(path, "w") as f:
        f["label"] = np.arange(3, dtype="<f4")
        build(f)
    (tmp_path / "h.txt").write_text(str(path))
    return tmp_path / "h.txt", str(path)


@pytest.mark.parametrize("build, message", [
    (lambda f: f.__setitem__("data", h5py.ExternalLink("/nonexistent/x.h5", "/data")),
     "'data' is an external link to '/data' in '/nonexistent/x.h5', which cannot be opened; "
     "expected a dataset"),
    (lambda f: f.__setitem__("data", h5py.SoftLink("/data")),
     "'data' cannot be read: a soft or external link that loops (too many links)"),
    (lambda f: (f.__setitem__("data", h5py.SoftLink("/other")),
                f.__setitem__("other", h5py.SoftLink("/data"))),
     "'data' cannot be read: a soft or external link that loops (too many links)"),
    (lambda f: f.create_dataset("data", data=np.zeros(3, [("a", "<f4"), ("b", "<i2")])),
     "dataset '/data' holds compound values; expected integers or floats"),
    (lambda f: f.create_dataset("data", data=np.array(["a", "b", "c"], dtype=object),
                                dtype=h5py.string_dtype()),
     "dataset '/data' holds strings; expected integers or floats"),
    (lambda f: f.create_dataset("data", shape=(3,), dtype=h5py.vlen_dtype("<f4")),
     "dataset '/data' holds variable-length sequences; expected integers or floats"),
    (lambda f: f.create_dataset("data", data=np.ones(3, bool)),
     "dataset '/data' holds enumerated values (h5py's booleans); expected integers or floats"),
    (lambda f: f.create_dataset("data", shape=(2**30, 4), dtype="<f4", chunks=(2**16, 4)),
     "dataset '/data' of shape (1073741824, 4) is stored in 16384 chunks, the file holds 0 "
     "of them; expected every value written"),
    (lambda f: f.create_dataset("data", data=h5py.Empty("<f4")),
     "dataset '/data' has a null dataspace; expected an array"),
])
def test_hostile_datasets_are_refused_when_the_source_opens(tmp_path, build, message):
    lst, path = hostile(tmp_path, build)
    with pytest.raises(DataError) as e:
        HDF5Source(lst, ["data", "label"], shuffle=False, dtype="float32")
    assert str(e.value) == f"HDF5 file '{path}' (listed in '{lst}'): {message}"


def test_wrong_ranks_are_refused_when_the_source_opens(tmp_path):
    lst, path = hostile(tmp_path, lambda f: f.__setitem__("data", np.float32(2)))
    with pytest.raises(DataError, match=r"^HDF5 file '.*h.h5': dataset 'data' is a scalar; it "
                                        r"needs at least 1 axis$"):
        HDF5Source(lst, ["data", "label"], shuffle=False, dtype="float32")
    write_h5(tmp_path / "a.h5", np.zeros((3, 2), "<f4"), np.zeros(3))
    write_h5(tmp_path / "b.h5", np.zeros((3, 2, 1), "<f4"), np.zeros(3))
    (tmp_path / "ab.txt").write_text(f"{tmp_path}/a.h5 {tmp_path}/b.h5")
    with pytest.raises(DataError, match=r"b.h5': dataset 'data' rows are \(2, 1\), in .*a.h5' "
                                        r"they are \(2,\)$"):
        HDF5Source(tmp_path / "ab.txt", ["data"], shuffle=False, dtype="float32")


def test_a_damaged_file_is_refused_when_the_source_opens(tmp_path):
    path = tmp_path / "a.h5"
    write_h5(path, np.zeros((3, 2), "<f4"), np.zeros(3))
    path.write_bytes(path.read_bytes()[:900])  # the superblock and no more
    (tmp_path / "a.txt").write_text(str(path))
    with pytest.raises(DataError, match=r"^HDF5 file '.*a.h5' \(listed in '.*a.txt'\): cannot "
                                        r"be read: "):
        HDF5Source(tmp_path / "a.txt", ["data"], shuffle=False, dtype="float32")


def test_an_external_link_to_a_file_that_exists_is_followed(tmp_path):
    write_h5(tmp_path / "a.h5", np.arange(6, dtype="<f4").reshape(3, 2), np.arange(3))
    with h5py.File(tmp_path / "l.h5", "w") as f:
        f["data"] = h5py.ExternalLink(str(tmp_path / "a.h5"), "/data")
        f["label"] = h5py.SoftLink("/alias")
        f["alias"] = np.array([7, 8, 9], "<i8")
    (tmp_path / "l.txt").write_text(str(tmp_path / "l.h5"))
    src = HDF5Source(tmp_path / "l.txt", ["data", "label"], shuffle=False, dtype="float64")
    data, label = HDF5Batches(src, 2).reader()(1)
    assert data.tolist() == [[4, 5], [0, 1]] and label.tolist() == [9, 7]


def test_a_file_changed_after_the_build_is_one_line_at_its_batch(tmp_path):
    lst = two_files(tmp_path)
    src = HDF5Source(lst, ["data", "label"], shuffle=False, dtype="float32")
    write_h5(tmp_path / "b.h5", np.zeros((4, 2), dtype=[("a", "<f4"), ("b", "<f4")]),
             np.arange(4))
    read = HDF5Batches(src, 3).reader()
    assert read(0)[1].tolist() == [0, 1, 2]
    with pytest.raises(DataError, match=exactly(
            f"HDF5 file '{tmp_path / 'b.h5'}' (listed in '{lst}'): dataset '/data' holds "
            "compound values; expected integers or floats")):
        read(1)


def test_a_hostile_source_stops_the_net_build_naming_the_layer(tmp_path):
    from purine.caffe import TRAIN, Net
    from purine.errors import LayerError

    lst, path = hostile(tmp_path, lambda f: f.__setitem__("data", h5py.SoftLink("/data")))
    net = f"""layer {{ name: "in" type: "HDF5Data" top: "data" top: "label"
      hdf5_data_param {{ source: "{lst}" batch_size: 2 }} }}"""
    with pytest.raises(LayerError, match=exactly(
            f"layer 'in' (type HDF5Data): HDF5 file '{path}' (listed in '{lst}'): 'data' "
            "cannot be read: a soft or external link that loops (too many links)")):
        Net(net, phase=TRAIN)
