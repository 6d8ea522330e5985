"""Fuzzing pycaffe's API with wrong kinds, shapes and values: Net.forward / backward /
forward_all / forward_backward_all, blob and parameter reshapes, the io.Transformer setters,
oversample, resize_image, load_image of damaged files and the BlobProto conversions. Each
call succeeds or raises one line of PurineError, never a bare numpy or OpenCV error."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import purine.pycaffe as caffe
from purine.formats import caffe_pb2 as pb
from purine.pycaffe import io
from tests.fuzz.harness import EXTREME_INTS, Draw, check, counted, mutated_bytes, share

NET = """name: "misuse"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""
SHAPE = (2, 3, 4, 4)
BOUND = 64 << 20
"""Bytes a reshape may really allocate: past it (and under the host's memory, which the
net refuses) a case is skipped, as the harness skips sizes past its bound."""


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[caffe.Net]:
    path = tmp_path_factory.mktemp("misuse") / "net.prototxt"
    path.write_text(NET)
    with caffe.Net(str(path), caffe.TEST) as n:
        n.force_backward = True
        yield n


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("images")


# -- values ----------------------------------------------------------------------------------
NAMES = ("data", "conv", "ip", "prob", "nosuch", "", "a\nb")
LAYERS = ("conv", "ip", "prob", "data", "nosuch", None, 3)


def _shape_near(draw: Draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape``, or with one axis changed, dropped or added."""
    s = list(shape)
    how = draw(st.sampled_from(("same", "same", "change", "drop", "add", "empty")))
    if how == "change" and s:
        s[draw(st.integers(0, len(s) - 1))] = draw(st.integers(0, 5))
    elif how == "drop" and s:
        del s[draw(st.integers(0, len(s) - 1))]
    elif how == "add":
        s.insert(draw(st.integers(0, len(s))), draw(st.integers(0, 3)))
    elif how == "empty":
        s = []
    return tuple(s)


@st.composite
def values(draw: Draw, shape: tuple[int, ...]) -> Any:
    """An array near ``shape`` of some dtype and content, or something that is no array."""
    kind = draw(st.sampled_from(("array",) * 6 + ("none", "str", "bytes", "int", "float",
                                                  "list", "ragged", "object")))
    if kind != "array":
        return {"none": None, "str": "abc", "bytes": b"\x00", "int": 3, "float": 2.5,
                "list": [[1.0, 2.0]], "ragged": [[1.0], [1.0, 2.0]],
                "object": np.array([object()])}[kind]
    s = _shape_near(draw, shape)
    dtype = draw(st.sampled_from(("float32", "float64", "int64", "uint8", "bool", "complex64",
                                  "U3", "float16")))
    fill = draw(st.sampled_from((0.0, 1.0, -1.0, math.nan, math.inf, 1e30)))
    if dtype == "U3":
        return np.full(s, "ab")
    with np.errstate(all="ignore"):
        return np.full(s, fill).astype(dtype)


def _dims(draw: Draw) -> list[Any]:
    small = st.integers(-1, 6)
    odd = st.sampled_from((2.5, "3", None, (2, 2), 2 ** 31, 2 ** 62, -(2 ** 31)))
    return draw(st.lists(st.one_of(small, small, small, odd), max_size=5))


# -- calls -----------------------------------------------------------------------------------
def _net_call(draw: Draw, net: caffe.Net) -> Any:
    call = draw(st.sampled_from(("forward", "backward", "forward_all", "forward_backward_all",
                                 "reshape", "param_reshape")))
    names = draw(st.lists(st.sampled_from(NAMES), max_size=2, unique=True))
    kwargs = {}
    for n in names:
        base = net.blobs[n].shape if n in net.blobs else SHAPE
        if call.endswith("_all") and draw(st.booleans()):
            base = (draw(st.integers(0, 7)),) + tuple(base[1:])
        kwargs[n] = draw(values(base))
    listing = draw(st.one_of(st.none(), st.lists(st.sampled_from(NAMES + (None, 3)),
                                                 max_size=2), st.just("prob")))
    start, end = draw(st.sampled_from(LAYERS)), draw(st.sampled_from(LAYERS))
    if draw(st.booleans()):
        start = end = None
    if call == "forward":
        return lambda: net.forward(blobs=listing, start=start, end=end, **kwargs)
    if call == "backward":
        return lambda: net.backward(diffs=listing, start=start, end=end, **kwargs)
    if call == "forward_all":
        return lambda: net.forward_all(blobs=listing, **kwargs)
    if call == "forward_backward_all":
        return lambda: net.forward_backward_all(blobs=listing, diffs=listing, **kwargs)
    dims = _dims(draw)
    ints = [d for d in dims if isinstance(d, int)]
    if len(ints) == len(dims) and all(d >= 0 for d in ints) \
            and BOUND < 4 * math.prod(ints) < (16 << 30):
        return None  # a real allocation of gigabytes: skipped
    if call == "reshape":
        blob = net.blobs[draw(st.sampled_from(("data", "conv", "prob")))]
    else:
        blob = net.params[draw(st.sampled_from(("conv", "ip")))][0]
    as_tuple = draw(st.booleans())
    return lambda: blob.reshape(tuple(dims)) if as_tuple else blob.reshape(*dims)


def _io_call(draw: Draw, case_dir: Path) -> Any:
    call = draw(st.sampled_from(("transformer", "oversample", "resize", "load", "blobproto",
                                 "datum")))
    if call == "transformer":
        t = io.Transformer({"data": SHAPE})
        name = draw(st.sampled_from(("data", "data", "nope", None)))
        setter = draw(st.sampled_from(("set_transpose", "set_channel_swap", "set_raw_scale",
                                       "set_mean", "set_input_scale")))
        arg = draw(st.one_of(
            st.lists(st.integers(-1, 4), max_size=4).map(tuple), values((3,)),
            values((3, 4, 4)), st.sampled_from((255, 0, -1.5, math.nan, "x", None))))
        image = draw(values((4, 4, 3)))
        direction = draw(st.sampled_from(("preprocess", "deprocess")))

        def run() -> None:
            t.set_transpose("data", (2, 0, 1))
            getattr(t, setter)(name, arg)
            if direction == "preprocess":
                t.preprocess("data", image)
            else:
                t.deprocess("data", np.asarray(image).transpose()[np.newaxis]
                            if isinstance(image, np.ndarray) else image)
        return run
    if call == "oversample":
        images = draw(st.one_of(st.lists(values((5, 6, 3)), max_size=3),
                                values((2, 5, 6, 3)), st.just(None)))
        crop = draw(st.one_of(st.lists(st.integers(-1, 8), max_size=3),
                              st.sampled_from(((2 ** 31, 2 ** 31), (2.5, 2), None))))
        return lambda: io.oversample(images, crop)
    if call == "resize":
        im = draw(values((4, 5, 3)))
        dims = draw(st.one_of(st.lists(st.one_of(st.integers(-1, 9),
                                                 st.sampled_from(EXTREME_INTS)), max_size=3),
                              st.sampled_from(("ab", None, (2.5, 3)))))
        order = draw(st.sampled_from((0, 1, 3, 2, -1, "1", None, True)))
        return lambda: io.resize_image(im, dims, order)
    if call == "load":
        seed = draw(st.sampled_from(list(_SEED_IMAGES)))
        data = draw(mutated_bytes(_SEED_IMAGES[seed]))
        path = case_dir / f"damaged{seed}"
        path.write_bytes(data)
        color = draw(st.booleans())
        return lambda: io.load_image(path, color=color)
    if call == "blobproto":
        arr, diff = draw(values((2, 3))), draw(st.one_of(st.none(), values((2, 3))))
        blob = draw(st.sampled_from((pb.BlobProto(num=2, channels=3), pb.BlobProto(), None,
                                     "blob")))
        which = draw(st.integers(0, 3))
        return [lambda: io.array_to_blobproto(arr, diff),
                lambda: io.blobproto_to_array(blob, return_diff=True),
                lambda: io.arraylist_to_blobprotovector_str([arr]),
                lambda: io.blobprotovector_str_to_arraylist(arr)][which]
    arr = draw(values((3, 2, 2)))
    label = draw(st.sampled_from((None, 1, -1, 2 ** 40, "x", 2.5)))
    return lambda: io.datum_to_array(io.array_to_datum(arr, label))


def _encoded(ext: str, image: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(ext, image)
    assert ok
    return buf.tobytes()


_PIXELS = (np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5)
_SEED_IMAGES = {".png": _encoded(".png", _PIXELS), ".jpg": _encoded(".jpg", _PIXELS),
                ".bmp": _encoded(".bmp", _PIXELS)}


@share(0.08)
@given(data=st.data())
@counted
def test_pycaffe_net_misuse(net: caffe.Net, data: st.DataObject) -> None:
    net.blobs["data"].reshape(*SHAPE)  # each case starts from the net's own shapes
    run = _net_call(data.draw, net)
    if run is not None:
        with np.errstate(all="ignore"):
            check(run, None)


@share(0.15)
@given(data=st.data())
@counted
def test_pycaffe_io_misuse(case_dir: Path, data: st.DataObject) -> None:
    run = _io_call(data.draw, case_dir)
    with np.errstate(all="ignore"):
        check(run, None)
