"""caffe.io against hand-computed values: BlobProto and Datum conversions, load_image's
[0, 1] RGB floats, resize_image, oversample's ten crops, and the Transformer's steps."""

import cv2
import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.errors import PurineError
from purine.formats import caffe_pb2 as pb

io = caffe.io


# -- BlobProto --------------------------------------------------------------------------------
def test_blobproto_to_array_legacy_and_shaped():
    legacy = pb.BlobProto(num=1, channels=2, height=1, width=2, data=[1, 2, 3, 4],
                          diff=[5, 6, 7, 8])
    a = io.blobproto_to_array(legacy)
    assert a.shape == (1, 2, 1, 2) and a.dtype == np.float64
    np.testing.assert_array_equal(a.ravel(), [1, 2, 3, 4])
    np.testing.assert_array_equal(io.blobproto_to_array(legacy, return_diff=True).ravel(),
                                  [5, 6, 7, 8])
    shaped = pb.BlobProto(shape=pb.BlobShape(dim=[2, 3]), data=range(6))
    np.testing.assert_array_equal(io.blobproto_to_array(shaped), [[0, 1, 2], [3, 4, 5]])


def test_array_to_blobproto_and_back():
    arr = np.arange(6, dtype=np.float64).reshape(2, 3) / 4
    blob = io.array_to_blobproto(arr, diff=np.full((2, 3), 2.0))
    assert list(blob.shape.dim) == [2, 3] and not blob.HasField("num")
    assert list(blob.data) == [0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert list(blob.diff) == [2.0] * 6
    np.testing.assert_array_equal(io.blobproto_to_array(blob), arr)
    four = np.arange(24).reshape(1, 2, 3, 4)
    np.testing.assert_array_equal(io.blobproto_to_array(io.array_to_blobproto(four)), four)


def test_blobprotovector_round_trip():
    arrays = [np.arange(4.0).reshape(2, 2), np.array([[[1.5]]])]
    s = io.arraylist_to_blobprotovector_str(arrays)
    assert isinstance(s, bytes)
    vec = pb.BlobProtoVector()
    vec.ParseFromString(s)
    assert [list(b.shape.dim) for b in vec.blobs] == [[2, 2], [1, 1, 1]]
    back = io.blobprotovector_str_to_arraylist(s)
    for a, b in zip(arrays, back):
        np.testing.assert_array_equal(a, b)


# -- Datum --------------------------------------------------------------------------------------
def test_uint8_datum_holds_bytes():
    arr = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    d = io.array_to_datum(arr, label=5)
    assert (d.channels, d.height, d.width, d.label) == (2, 2, 3, 5)
    assert d.data == bytes(range(12)) and len(d.float_data) == 0
    back = io.datum_to_array(d)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, arr)


def test_float_datum_holds_float_data_and_no_label_unless_given():
    arr = np.array([[[0.5, -1.0], [2.0, 0.25]]])
    d = io.array_to_datum(arr)
    assert not d.HasField("label") and d.data == b""
    assert list(d.float_data) == [0.5, -1.0, 2.0, 0.25]
    back = io.datum_to_array(d)
    assert back.dtype == np.float64
    np.testing.assert_array_equal(back, arr)
    with pytest.raises(ValueError, match="3-d"):
        io.array_to_datum(np.zeros((2, 2)))


# -- images ---------------------------------------------------------------------------------
def test_load_image_gives_rgb_floats_in_unit_range(tmp_path):
    bgr = np.array([[[0, 0, 255], [255, 0, 0]], [[0, 255, 0], [51, 102, 204]]], np.uint8)
    path = str(tmp_path / "im.png")
    cv2.imwrite(path, bgr)
    img = io.load_image(path)
    assert img.dtype == np.float32 and img.shape == (2, 2, 3)
    np.testing.assert_allclose(img[0, 0], [1, 0, 0])  # red
    np.testing.assert_allclose(img[0, 1], [0, 0, 1])  # blue
    np.testing.assert_allclose(img[1, 1], [0.8, 0.4, 0.2], rtol=1e-6)
    gray = io.load_image(path, color=False)
    assert gray.shape == (2, 2, 1)
    # scikit-image's luma weights, as pycaffe's as_grey read uses.
    np.testing.assert_allclose(gray[0, 0, 0], 0.2125)
    np.testing.assert_allclose(gray[1, 1, 0], 0.2125 * 0.8 + 0.7154 * 0.4 + 0.0721 * 0.2,
                               rtol=1e-6)


def test_load_image_gray_alpha_and_16_bit(tmp_path):
    gray = str(tmp_path / "g.png")
    cv2.imwrite(gray, np.array([[0, 255], [51, 102]], np.uint8))
    img = io.load_image(gray)
    assert img.shape == (2, 2, 3)
    np.testing.assert_allclose(img[1, 0], [0.2] * 3, rtol=1e-6)
    assert io.load_image(gray, color=False).shape == (2, 2, 1)
    rgba = str(tmp_path / "a.png")
    cv2.imwrite(rgba, np.array([[[255, 0, 0, 7]]], np.uint8))  # BGRA
    np.testing.assert_allclose(io.load_image(rgba), [[[0, 0, 1]]])
    deep = str(tmp_path / "d.png")
    cv2.imwrite(deep, np.array([[65535, 0]], np.uint16))
    np.testing.assert_allclose(io.load_image(deep, color=False)[..., 0], [[1, 0]])
    with pytest.raises(PurineError, match="cannot read"):
        io.load_image(str(tmp_path / "missing.jpg"))


def test_resize_image_hand_values():
    im = np.array([[[0.0], [1.0]]])  # 1 x 2 x 1
    # Pixel centres: output x samples the source at (x + 0.5) / 2 - 0.5, clamped.
    np.testing.assert_allclose(io.resize_image(im, (1, 4))[0, :, 0], [0, 0.25, 0.75, 1])
    np.testing.assert_allclose(io.resize_image(im, (1, 4), interp_order=0)[0, :, 0],
                               [0, 0, 1, 1])
    five = np.concatenate([im * k for k in range(1, 6)], axis=2)  # 5 channels
    out = io.resize_image(five, (2, 4))
    assert out.shape == (2, 4, 5) and out.dtype == np.float32
    np.testing.assert_allclose(out[1, :, 4], [0, 1.25, 3.75, 5])
    const = io.resize_image(np.full((3, 3, 3), 0.7), (5, 2))
    assert const.shape == (5, 2, 3) and np.all(const == np.float32(0.7))
    with pytest.raises(ValueError, match="interp_order"):
        io.resize_image(im, (2, 2), interp_order=2)


def test_oversample_gives_corners_centre_and_mirrors():
    im = np.arange(20, dtype=np.float32).reshape(4, 5, 1)
    crops = io.oversample([im, im + 100], (2, 3))
    assert crops.shape == (20, 2, 3, 1) and crops.dtype == np.float32
    corners = [(0, 0), (0, 2), (2, 0), (2, 2), (1, 1)]  # centre: (2 - 1, 2.5 - 1.5)
    for n, base in enumerate((im, im + 100)):
        for k, (i, j) in enumerate(corners):
            want = base[i:i + 2, j:j + 3]
            np.testing.assert_array_equal(crops[10 * n + k], want)
            np.testing.assert_array_equal(crops[10 * n + 5 + k], want[:, ::-1])


# -- Transformer -------------------------------------------------------------------------------
def transformer():
    t = io.Transformer({"d": (1, 2, 1, 2)})
    t.set_transpose("d", (2, 0, 1))
    t.set_channel_swap("d", (1, 0))
    t.set_raw_scale("d", 10)
    t.set_mean("d", np.array([1.0, 2.0]))
    t.set_input_scale("d", 0.5)
    return t


def test_transformer_preprocess_in_pycaffes_order():
    image = np.array([[[0.1, 0.2], [0.3, 0.4]]], dtype=np.float32)  # H=1, W=2, K=2
    keep = image.copy()
    x = transformer().preprocess("d", image)
    # channel 0 <- image channel 1: ([0.2, 0.4] * 10 - 1) * 0.5; channel 1 <- channel 0.
    np.testing.assert_allclose(x, [[[0.5, 1.5]], [[-0.5, 0.5]]], rtol=1e-6)
    assert x.dtype == np.float32
    np.testing.assert_array_equal(image, keep)
    np.testing.assert_allclose(transformer().deprocess("d", x), image, rtol=1e-6)


def test_transformer_resizes_to_the_input_and_takes_elementwise_means():
    t = io.Transformer({"d": (1, 2, 1, 2)})
    t.set_transpose("d", (2, 0, 1))
    t.set_mean("d", np.array([[[1.0, 2.0]], [[3.0, 4.0]]]))
    image = np.arange(16, dtype=np.float32).reshape(2, 4, 2)
    x = t.preprocess("d", image)
    # Halving both sides bilinearly averages each 2 x 2 block.
    block = image.reshape(1, 2, 2, 2, 2).mean(axis=(1, 3))  # (1, 2, K)
    np.testing.assert_allclose(x, block.transpose(2, 0, 1) - [[[1, 2]], [[3, 4]]], rtol=1e-6)
    t.set_mean("d", np.stack([np.full((3, 3), 5.0), np.full((3, 3), 7.0)]))
    np.testing.assert_allclose(t.mean["d"], [[[5, 5]], [[7, 7]]], rtol=1e-6)


def test_transformer_errors():
    t = io.Transformer({"d": (1, 3, 4, 4)})
    with pytest.raises(KeyError, match="not one of the net inputs"):
        t.set_raw_scale("x", 255)
    with pytest.raises(ValueError, match="3 entries"):
        t.set_channel_swap("d", (1, 0))
    with pytest.raises(ValueError, match="needs 3 axes"):
        t.set_transpose("d", (1, 0))
    with pytest.raises(ValueError, match="mean has 2 channels"):
        t.set_mean("d", np.array([1.0, 2.0]))
