"""compute_image_mean: the mean of an LMDB (raw, encoded, gray, float_data) against numpy's
mean of the same images and a loop transcription of Caffe's float32 accumulation; the
.binaryproto parses as caffe_pb2.BlobProto (1, C, H, W); logs and errors."""

import cv2
import lmdb
import numpy as np
import pytest

from purine.converters import ConvertError
from purine.converters.compute_image_mean import compute_image_mean, main
from purine.converters.convert_imageset import convert_imageset, write_images
from purine.formats import caffe_pb2 as pb
from tests.converters.helpers import Lines, make_imageset


def caffe_float32_mean(images_chw):
    """Caffe's tool: sum_blob.data(i) + (uint8)data[i] in float, then / count, in float."""
    total = np.zeros(images_chw[0].size, np.float32)
    for image in images_chw:
        for i, v in enumerate(image.ravel()):
            total[i] = np.float32(total[i] + np.float32(v))
    return (total / np.float32(len(images_chw))).astype(np.float32)


@pytest.fixture
def imageset(tmp_path):
    listfile, entries = make_imageset(tmp_path / "images", n=7, shape=(4, 3), seed=3)
    images = [cv2.imread(str(tmp_path / "images" / n)) for n, _, _ in entries]
    return tmp_path, listfile, np.stack([im.transpose(2, 0, 1) for im in images])


def test_mean_of_raw_lmdb_against_numpy_and_caffe(imageset):
    tmp_path, listfile, chw = imageset
    convert_imageset(tmp_path / "images", listfile, tmp_path / "db", log=Lines().log)
    lines = Lines()
    mean = compute_image_mean(tmp_path / "db", tmp_path / "mean.binaryproto", log=lines.log)
    assert mean.shape == (1, 3, 4, 3) and mean.dtype == np.float32
    np.testing.assert_allclose(mean[0], chw.astype(np.float64).mean(axis=0), rtol=1e-7)
    assert np.array_equal(mean.ravel(), caffe_float32_mean(chw))

    blob = pb.BlobProto()
    blob.ParseFromString((tmp_path / "mean.binaryproto").read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 4, 3)
    assert not blob.HasField("shape")
    assert np.array_equal(np.array(blob.data, np.float32).reshape(1, 3, 4, 3), mean)
    # Caffe's own serialization of that message gives the same bytes.
    reference = pb.BlobProto(num=1, channels=3, height=4, width=3, data=mean.ravel().tolist())
    assert (tmp_path / "mean.binaryproto").read_bytes() == reference.SerializeToString()

    per_channel = chw.astype(np.float64).mean(axis=(0, 2, 3))
    assert lines.lines[0] == "Starting Iteration"
    assert "Processed 7 files." in lines.lines
    assert f"Write to {tmp_path / 'mean.binaryproto'}" in lines.lines
    assert "Number of channels: 3" in lines.lines
    assert lines.lines[-3:] == [f"mean_value channel [{c}]:{v:g}"
                                for c, v in enumerate(per_channel)]


def test_encoded_and_gray_lmdbs(imageset):
    tmp_path, listfile, chw = imageset
    convert_imageset(tmp_path / "images", listfile, tmp_path / "enc", encode_type="png",
                     log=Lines().log)
    lines = Lines()
    mean = compute_image_mean(tmp_path / "enc", log=lines.log)
    assert lines.lines[0] == "Decoding Datum"
    np.testing.assert_allclose(mean[0], chw.astype(np.float64).mean(axis=0), rtol=1e-7)

    convert_imageset(tmp_path / "images", listfile, tmp_path / "gray", gray=True,
                     log=Lines().log)
    gray = np.stack([cv2.imread(str(p), cv2.IMREAD_GRAYSCALE) for p in
                     sorted((tmp_path / "images").rglob("*.*")) if p.suffix != ".txt"])
    mean = compute_image_mean(tmp_path / "gray", log=Lines().log)
    assert mean.shape == (1, 1, 4, 3)
    np.testing.assert_allclose(mean[0, 0], gray.astype(np.float64).mean(axis=0), rtol=1e-7)


def test_many_records_in_batches(tmp_path):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (1000, 2, 2, 3), dtype=np.uint8)
    write_images(tmp_path / "db", ((f"{i:08d}", im, 0) for i, im in enumerate(images)),
                 log=Lines().log)
    mean = compute_image_mean(tmp_path / "db", log=Lines().log)
    expected = images.transpose(0, 3, 1, 2).astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(mean[0], expected, rtol=1e-7)


def test_float_data_datums(tmp_path):
    values = np.array([[0.5, -1.0, 2.25, 3.0], [1.5, 1.0, -0.25, 5.0]], np.float32)
    env = lmdb.open(str(tmp_path / "db"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        for i, v in enumerate(values):
            d = pb.Datum(channels=1, height=2, width=2, label=i, float_data=v.tolist())
            txn.put(b"%08d" % i, d.SerializeToString())
    env.close()
    mean = compute_image_mean(tmp_path / "db", log=Lines().log)
    assert mean.tolist() == [[[[1.0, 0.0], [1.0, 4.0]]]]


def test_command_and_errors(imageset, capsys):
    tmp_path, listfile, _ = imageset
    convert_imageset(tmp_path / "images", listfile, tmp_path / "db", log=Lines().log)
    assert main([str(tmp_path / "db"), str(tmp_path / "m.binaryproto"), "-backend=lmdb"]) == 0
    # 4 legacy dims (2 bytes each), data tag + 2-byte length, 36 floats
    assert (tmp_path / "m.binaryproto").stat().st_size == 4 * 2 + 3 + 4 * 36
    assert main([str(tmp_path / "db")]) == 0  # no output file: logs only
    assert main([str(tmp_path / "nope")]) == 1
    assert "no such LMDB folder" in capsys.readouterr().err
    assert main([str(tmp_path / "db"), "--backend", "leveldb"]) == 1
    assert "db: is an LMDB, not a LevelDB: give --backend lmdb" in capsys.readouterr().err

    lmdb.open(str(tmp_path / "empty"), map_size=1 << 20).close()
    with pytest.raises(ConvertError, match="holds no records"):
        compute_image_mean(tmp_path / "empty", log=Lines().log)
    write_images(tmp_path / "mixed", [("a", np.zeros((2, 2), np.uint8), 0),
                                      ("b", np.zeros((3, 2), np.uint8), 0)], log=Lines().log)
    with pytest.raises(ConvertError, match=r"record b'b': incorrect data field size 6; the "
                                           r"first datum is 1x2x2 \(CxHxW\) = 4"):
        compute_image_mean(tmp_path / "mixed", log=Lines().log)
