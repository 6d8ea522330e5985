"""binaryproto <-> .npy: round trips through caffe_pb2.BlobProto (legacy 4-D fields and
``shape``), a Caffe mean file to .npy, and inputs that are refused (pickles, junk)."""

import numpy as np
import pytest

from purine.converters import ConvertError
from purine.converters.binaryproto import convert, main, read_binaryproto, write_binaryproto
from purine.formats import caffe_pb2 as pb


@pytest.mark.parametrize("shape", [(1, 3, 4, 5), (2, 1, 2, 2), (7,), (2, 3), (3, 2, 2)])
def test_npy_binaryproto_npy_round_trip(tmp_path, shape):
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    assert main([str(tmp_path / "a.npy"), str(tmp_path / "a.binaryproto")]) == 0
    blob = pb.BlobProto()
    blob.ParseFromString((tmp_path / "a.binaryproto").read_bytes())
    if len(shape) == 4:  # the legacy form Caffe's mean files use
        assert (blob.num, blob.channels, blob.height, blob.width) == shape
        assert not blob.HasField("shape")
    else:
        assert tuple(blob.shape.dim) == shape and not blob.HasField("num")
    assert np.array_equal(np.array(blob.data, np.float32).reshape(shape), a)
    assert main([str(tmp_path / "a.binaryproto"), str(tmp_path / "b.npy")]) == 0
    b = np.load(tmp_path / "b.npy", allow_pickle=False)
    assert b.dtype == np.float32 and b.shape == shape and np.array_equal(a, b)


def test_blobs_written_by_protobuf_read_back(tmp_path):
    legacy = pb.BlobProto(num=1, channels=2, height=1, width=2, data=[1, 2, 3, 4.5])
    (tmp_path / "mean.binaryproto").write_bytes(legacy.SerializeToString())
    assert read_binaryproto(tmp_path / "mean.binaryproto").tolist() == [[[[1, 2]], [[3, 4.5]]]]
    shaped = pb.BlobProto(shape=pb.BlobShape(dim=[3]), double_data=[0.5, 1.5, 2.5])
    (tmp_path / "d.binaryproto").write_bytes(shaped.SerializeToString())
    out = convert(tmp_path / "d.binaryproto", tmp_path / "d.npy")
    assert out.tolist() == [0.5, 1.5, 2.5]
    assert np.load(tmp_path / "d.npy").tolist() == [0.5, 1.5, 2.5]


def test_float64_and_int_arrays_are_stored_as_float32(tmp_path):
    write_binaryproto(tmp_path / "x.binaryproto", np.arange(6, dtype=np.int64).reshape(2, 3))
    assert read_binaryproto(tmp_path / "x.binaryproto").tolist() == [[0, 1, 2], [3, 4, 5]]


def test_refused_inputs(tmp_path, capsys):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert main([str(tmp_path / "obj.npy"), str(tmp_path / "o.binaryproto")]) == 1
    assert "not a plain .npy array" in capsys.readouterr().err
    assert not (tmp_path / "o.binaryproto").exists()
    np.save(tmp_path / "s.npy", np.array(["x"]))
    with pytest.raises(ConvertError, match="is not a real number type"):
        convert(tmp_path / "s.npy", tmp_path / "s.binaryproto")
    (tmp_path / "junk.binaryproto").write_bytes(b"\xff\xff\xff\xff")
    assert main([str(tmp_path / "junk.binaryproto"), str(tmp_path / "j.npy")]) == 1
    assert "not a binary BlobProto" in capsys.readouterr().err
    (tmp_path / "empty.binaryproto").write_bytes(b"")
    with pytest.raises(ConvertError, match="holds no data"):
        read_binaryproto(tmp_path / "empty.binaryproto")
    bad = pb.BlobProto(shape=pb.BlobShape(dim=[2, 2]), data=[1, 2, 3])
    (tmp_path / "bad.binaryproto").write_bytes(bad.SerializeToString())
    with pytest.raises(ConvertError, match=r"shape \(2, 2\) holds 3 values"):
        read_binaryproto(tmp_path / "bad.binaryproto")
    assert main([str(tmp_path / "missing.binaryproto"), str(tmp_path / "m.npy")]) == 1
    assert "cannot read" in capsys.readouterr().err
