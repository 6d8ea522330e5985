"""pycaffe misuse (issue 28): each call refused in one line, by an exception that is a
PurineError and the builtin type pycaffe's own code raises there, before any allocation."""

from __future__ import annotations

import numpy as np
import pytest

import purine.pycaffe as caffe
from purine.errors import PurineError
from purine.pycaffe import io

NET = """name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


@pytest.fixture
def net(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    with caffe.Net(str(path), caffe.TEST) as n:
        yield n


def refused(builtin, match, call):
    """``call`` raises one line that is both a PurineError and ``builtin``."""
    with pytest.raises(PurineError, match=match) as info:
        call()
    assert isinstance(info.value, builtin), type(info.value).__mro__
    assert "\n" not in str(info.value)
    return info.value


def test_backward_checks_diff_shapes_as_forward_checks_inputs(net):
    refused(ValueError, r"^backward: blob 'prob' has shape \(2, 5\), the diff has \(3, 5\)$",
            lambda: net.backward(prob=np.ones((3, 5))))
    refused(ValueError, r"forward: blob 'data' has shape \(2, 3, 4, 4\), the input has \(2, 48\)",
            lambda: net.forward(data=np.ones((2, 48))))
    # A right shape runs: Softmax's backward of a diff of ones is zero (rows sum to 1).
    out = net.forward(data=np.ones((2, 3, 4, 4)))
    assert out["prob"].shape == (2, 5)
    np.testing.assert_allclose(net.blobs["prob"].data.sum(axis=1), [1, 1], rtol=1e-6)


def test_unknown_names(net):
    e = refused(KeyError, r"^backward: net 'small' has no blob 'nosuch'$",
                lambda: net.backward(nosuch=np.ones((2, 5))))
    assert str(e) == "backward: net 'small' has no blob 'nosuch'"  # not KeyError's repr
    refused(KeyError, "has no blob 'x'", lambda: net.forward(blobs=["x"]))
    refused(ValueError, r"no layer named 'nope' in net 'small'", lambda: net.forward(end="nope"))
    refused(TypeError, "expected a list of blob names", lambda: net.forward(blobs="prob"))


def test_forward_all_refuses_what_is_no_batch(net):
    refused(TypeError, r"^forward_all: blob 'data' needs an array, got None$",
            lambda: net.forward_all(data=None))
    refused(TypeError, "needs numbers, got an array of dtype <U1",
            lambda: net.forward_all(data=np.full((2, 3, 4, 4), "a")))
    refused(ValueError, r"takes items of shape \(3, 4, 4\), the input has \(5, 3, 4\)",
            lambda: net.forward_all(data=np.zeros((5, 3, 4))))
    # Five items in batches of 2: three passes, the padding dropped.
    got = net.forward_all(data=np.zeros((5, 3, 4, 4)))
    assert got["prob"].shape == (5, 5)
    np.testing.assert_allclose(got["prob"].sum(axis=1), np.ones(5), rtol=1e-6)
    assert net.forward_all(data=np.zeros((0, 3, 4, 4)))["prob"].shape == (0, 5)


def test_blob_reshape_checks_memory_before_allocating(net):
    # 2^31 x 3 x 227 x 227 float32 is 1.2 PiB: refused before numpy reserves any of it.
    refused(MemoryError, r"^blob 'data' reshape\(2147483648, 3, 227, 227\) \(float32\) asks "
                         r"for 1\.2 PiB; this machine has ",
            lambda: net.blobs["data"].reshape(2 ** 31, 3, 227, 227))
    assert net.blobs["data"].shape == (2, 3, 4, 4)
    refused(TypeError, r"blob 'data': reshape\('a', 3\) needs integer sizes",
            lambda: net.blobs["data"].reshape("a", 3))
    refused(ValueError, "negative dimension", lambda: net.blobs["data"].reshape(-1, 3, 4, 4))
    refused(ValueError, "only the net's input blobs", lambda: net.blobs["ip"].reshape(3, 5))
    refused(TypeError, "needs integer sizes", lambda: net.params["ip"][0].reshape(None))
    net.blobs["data"].reshape(1, 3, 4, 4)
    assert net.forward(data=np.zeros((1, 3, 4, 4)))["prob"].shape == (1, 5)


def test_io_oversample_and_resize_arguments():
    refused(IndexError, "^oversample: no images to crop$", lambda: io.oversample([], (2, 2)))
    refused(ValueError, r"crop_dims \(5, 2\) larger than the images \(4, 4\)",
            lambda: io.oversample([np.zeros((4, 4, 3))], (5, 2)))
    refused(ValueError, r"image 1 has shape \(4, 5, 3\), image 0 \(4, 4, 3\)",
            lambda: io.oversample([np.zeros((4, 4, 3)), np.zeros((4, 5, 3))], (2, 2)))
    im = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    refused(ValueError, r"^resize_image: new_dims: expected 2 integer sizes >= 0, got \(3,\)$",
            lambda: io.resize_image(im, (3,)))
    refused(ValueError, "expected an \\(H, W, K\\) array, got shape \\(2, 2\\)",
            lambda: io.resize_image(im[..., 0], (3, 3)))
    refused(MemoryError, r"resize_image: an output of shape \(2147483647, 2147483647, 3\) "
                         "asks for", lambda: io.resize_image(im, (2 ** 31 - 1, 2 ** 31 - 1)))
    assert io.resize_image(im, (0, 3)).shape == (0, 3, 3)


def test_transformer_channel_swap_and_setters():
    t = io.Transformer({"data": (1, 3, 2, 2)})
    refused(ValueError, r"channel swap \(0, 1\) for 'data' needs 3 entries",
            lambda: t.set_channel_swap("data", (0, 1)))
    refused(ValueError, r"channel swap \(0, 0, 1\) for 'data' is not an order of 0\.\.2",
            lambda: t.set_channel_swap("data", (0, 0, 1)))
    refused(ValueError, r"is not an order", lambda: t.set_channel_swap("data", (0, 5, 1)))
    e = refused(KeyError, r"^'nope' is not one of the net inputs: \['data'\]$",
                lambda: t.set_channel_swap("nope", (2, 1, 0)))
    assert str(e) == "'nope' is not one of the net inputs: ['data']"
    refused(ValueError, "expected integers", lambda: t.set_channel_swap("data", "abc"))
    refused(ValueError, "raw_scale for 'data': expected a number",
            lambda: t.set_raw_scale("data", "255"))
    # A valid swap reverses the channels: (K, H, W) after the transpose.
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    image = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    np.testing.assert_array_equal(t.preprocess("data", image),
                                  image.transpose(2, 0, 1)[::-1])


def test_load_image_of_damaged_bytes(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
    refused(OSError, r"load_image: cannot read '.*bad\.png' \(not an image",
            lambda: io.load_image(bad))
    refused(OSError, "no such file", lambda: io.load_image(tmp_path))


def test_blobproto_conversions_refuse_non_numbers():
    refused(TypeError, "expected numbers, got an array of dtype <U1",
            lambda: io.array_to_blobproto(np.array(["a"])))
    refused(ValueError, r"diff of shape \(3,\) for data of shape \(2,\)",
            lambda: io.array_to_blobproto(np.zeros(2), np.zeros(3)))
    refused(TypeError, "expected a BlobProto, got NoneType",
            lambda: io.blobproto_to_array(None))
    refused(TypeError, "label 'x' is not an integer",
            lambda: io.array_to_datum(np.zeros((1, 1, 1)), "x"))


def test_deprocess_of_ragged_or_non_numeric_data_is_one_line():
    """Found by the long fuzz profile: a ragged list reached numpy's ValueError."""
    t = io.Transformer({"data": (1, 3, 4, 4)})
    t.set_raw_scale("data", 255)
    with pytest.raises(TypeError, match=r"^deprocess 'data': expected an array, got list"):
        t.deprocess("data", [[1.0], [1.0, 2.0]])
    with pytest.raises(PurineError, match=r"^deprocess 'data': expected numbers, got an array "
                                          r"of dtype <U1$"):
        t.deprocess("data", np.array(["a"]))
