"""Datum records: raw bytes and float_data as (C, H, W), encoded PNG/JPEG decoded by OpenCV
natively or forced to color / gray (Caffe's DecodeDatumToCVMat), and the errors a broken
record gives."""

import cv2
import numpy as np
import pytest

from purine.data import DataError
from purine.data.datum import datum_image, decode_flag, parse_datum, read_mean, stack
from purine.formats import caffe_pb2 as pb
from tests.data.helpers import encoded_datum, images, raw_datum, write_mean

NATIVE = decode_flag(False, False)


def test_raw_and_float_records():
    img = images(1, (3, 4, 5))[0]
    np.testing.assert_array_equal(datum_image(raw_datum(img), NATIVE, "r"), img)
    f = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    got = datum_image(raw_datum(f), NATIVE, "r")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, f)


def test_encoded_png_natively_and_forced():
    rng = np.random.default_rng(0)
    bgr = rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)
    got = datum_image(encoded_datum(bgr), NATIVE, "r")
    np.testing.assert_array_equal(got, bgr.transpose(2, 0, 1))  # BGR order kept, as Caffe
    gray = rng.integers(0, 256, (5, 6), dtype=np.uint8)
    np.testing.assert_array_equal(datum_image(encoded_datum(gray), NATIVE, "r"), gray[None])
    as_color = datum_image(encoded_datum(gray), decode_flag(True, False), "r")
    np.testing.assert_array_equal(as_color, np.repeat(gray[None], 3, 0))
    d = encoded_datum(bgr)
    as_gray = datum_image(d, decode_flag(False, True), "r")
    want = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_GRAYSCALE)
    assert as_gray.shape == (1, 5, 6)
    np.testing.assert_array_equal(as_gray, want[None])


def test_encoded_jpeg_is_opencvs_decoding():
    bgr = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    d = encoded_datum(bgr, ext=".jpg")
    want = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED)
    np.testing.assert_array_equal(datum_image(d, NATIVE, "r"), want.transpose(2, 0, 1))


def test_broken_records():
    bgr = np.zeros((8, 8, 3), np.uint8)
    d = encoded_datum(bgr, ext=".jpg")
    d.data = d.data[: len(d.data) // 2]
    with pytest.raises(DataError, match="key 7: cannot decode the encoded image"):
        datum_image(d, NATIVE, "key 7")
    with pytest.raises(DataError, match="key 8: not a serialized Datum"):
        parse_datum(b"\xff\xff\xff\xff", "key 8")
    short = pb.Datum(channels=3, height=2, width=2, data=b"\x00" * 11)
    with pytest.raises(DataError, match="11 data bytes .* needs 12"):
        datum_image(short, NATIVE, "k")
    with pytest.raises(DataError, match=r"channels, height, width = \(0, 0, 0\)"):
        datum_image(pb.Datum(), NATIVE, "k")
    sixteen = encoded_datum(np.zeros((4, 4), np.uint16))
    with pytest.raises(DataError, match="uint16; Caffe's transformer takes 8-bit"):
        datum_image(sixteen, NATIVE, "k")


def test_read_mean(tmp_path):
    m = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    np.testing.assert_array_equal(read_mean(write_mean(tmp_path / "a", m)), m)
    np.testing.assert_array_equal(read_mean(write_mean(tmp_path / "b", m[None], legacy=False)),
                                  m)
    with pytest.raises(DataError, match=r"shape \(2, 6\)"):
        read_mean(write_mean(tmp_path / "c", m.reshape(2, 6), legacy=False))
    with pytest.raises(DataError, match=r"shape \(2, 1, 2, 3\)"):
        read_mean(write_mean(tmp_path / "d", m.reshape(2, 1, 2, 3), legacy=False))


def test_stack_of_opencv_views_is_nchw():
    hwc = images(3, (4, 5, 3))
    views = [im.transpose(2, 0, 1) for im in hwc]
    s = stack(views)
    assert s.shape == (3, 3, 4, 5)
    np.testing.assert_array_equal(s, np.stack([np.ascontiguousarray(v) for v in views]))
    mixed = stack([views[0], np.ascontiguousarray(views[1])])
    np.testing.assert_array_equal(mixed, hwc[:2].transpose(0, 3, 1, 2))
