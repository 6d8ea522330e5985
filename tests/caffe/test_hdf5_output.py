"""HDF5Output: the file created when the net is built, the batch of a forward pass written
as "data" and "label" with Caffe's 4 legacy axes, the error of a second forward pass (Caffe
cannot create a dataset twice), no gradient of its own, and the build errors."""

import sys

import h5py
import numpy as np
import pytest

from purine.caffe import TEST, TRAIN, Net
from purine.errors import LayerError, PurineError


def output_net(path, data=(2, 3), label=(2,), dtype="float32", extra=""):
    dims = [" ".join(f"dim: {d}" for d in s) for s in (data, label)]
    return Net(f'''{extra}
    layer {{ name: "in" type: "Input" top: "data" top: "label"
             input_param {{ shape {{ {dims[0]} }} shape {{ {dims[1]} }} }} }}
    layer {{ name: "out" type: "HDF5Output" bottom: "data" bottom: "label"
             hdf5_output_param {{ file_name: "{path}" }} }}''', phase=TEST, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("data, label, saved", [
    ((2, 3), (2,), ((2, 3, 1, 1), (2, 1, 1, 1))),
    ((3, 2, 4, 5), (3, 2), ((3, 2, 4, 5), (3, 2, 1, 1))),
    ((1, 2, 3), (1,), ((1, 2, 3, 1), (1, 1, 1, 1))),
])
def test_forward_writes_the_batch(tmp_path, dtype, data, label, saved):
    path = tmp_path / "out.h5"
    net = output_net(path, data, label, dtype)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=data), rng.integers(0, 9, label).astype(float)
    net.forward(data=x, label=y)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["data", "label"]
        assert f["data"].shape == saved[0] and f["label"].shape == saved[1]
        assert f["data"].dtype == dtype and f["label"].dtype == dtype
        np.testing.assert_array_equal(f["data"][...].reshape(data), x.astype(dtype))
        np.testing.assert_array_equal(f["label"][...].reshape(label), y)


def test_file_is_emptied_at_build_and_a_second_forward_fails(tmp_path):
    path = tmp_path / "out.h5"
    with h5py.File(path, "w") as f:
        f["old"] = np.arange(3)
    net = output_net(path)
    with h5py.File(path, "r") as f:
        assert list(f) == []
    net.forward(data=np.ones((2, 3)), label=np.array([4.0, 5.0]))
    with pytest.raises(PurineError, match=r"op 'out/HDF5Output': HDF5 output file '.*out.h5' "
                                          r"already holds the datasets 'data' and 'label'"):
        net.forward(data=np.zeros((2, 3)), label=np.zeros(2))
    with h5py.File(path, "r") as f:  # the first batch stays as it was
        np.testing.assert_array_equal(f["data"][...].reshape(2, 3), 1)
        np.testing.assert_array_equal(f["label"][...].ravel(), [4, 5])


@pytest.mark.parametrize("propagate", ["", "propagate_down: true propagate_down: false"])
def test_no_gradient_of_its_own(tmp_path, propagate):
    """Beside a loss, the layer adds nothing to the gradient of a shared bottom, whether
    force_backward is set or propagate_down asks it for one (Caffe's backward is empty)."""
    net = Net(f'''force_backward: true
    layer {{ name: "in" type: "Input" top: "x" top: "label" top: "t"
             input_param {{ shape {{ dim: 2 dim: 3 }} shape {{ dim: 2 }}
                            shape {{ dim: 2 dim: 3 }} }} }}
    layer {{ name: "out" type: "HDF5Output" bottom: "x" bottom: "label" {propagate}
             hdf5_output_param {{ file_name: "{tmp_path}/o.h5" }} }}
    layer {{ name: "loss" type: "EuclideanLoss" bottom: "x" bottom: "t" top: "loss" }}''',
              phase=TRAIN, dtype="float64")
    x = np.arange(6.0).reshape(2, 3)
    t = np.full((2, 3), 1.5)
    net.forward(x=x, label=np.zeros(2), t=t)
    net.backward()
    np.testing.assert_allclose(net.blobs["x"].diff, (x - t) / 2)


@pytest.mark.parametrize("data, label, file, message", [
    ((2, 3), (3,), "out.h5", r"data and label must have the same batch size; got data \(2, 3\), "
     r"label \(3,\)"),
    ((2, 3, 1, 1, 1), (2,), "out.h5", r"bottom 'data' \(2, 3, 1, 1, 1\) has 5 axes"),
    ((2, 3), (2,), "missing/out.h5", r"HDF5 output file '.*missing/out.h5' cannot be created"),
])
def test_build_errors(tmp_path, data, label, file, message):
    with pytest.raises(LayerError, match=r"layer 'out' \(type HDF5Output\): " + message):
        output_net(tmp_path / file, data, label)


def test_empty_file_name():
    with pytest.raises(LayerError, match="hdf5_output_param.file_name is empty"):
        output_net("")


def test_without_h5py(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py now raises ImportError
    with pytest.raises(LayerError, match=r"HDF5Output needs the h5py package: pip install "
                                         r"purine-caffe\[hdf5\]"):
        output_net(tmp_path / "out.h5")
