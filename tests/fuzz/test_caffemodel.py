"""Fuzzing .caffemodel files: a small net's weights, mutated as NetParameter messages (blob
shapes and payloads, layers repeated, renamed, emptied, moved to the V1 ``layers`` field)
and as wire bytes, loaded by load_weights and by Net.copy_from."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.caffe import TEST, Net
from purine.formats import caffe_pb2 as pb
from purine.formats.caffemodel import load_weights
from tests.fuzz.harness import Draw, check, counted, mutated_blob, mutated_bytes, share

NET = """name: "small"
layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: 2 dim: 2 dim: 5 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" }
  bias_filler { type: "constant" value: 0.1 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    with Net(NET, phase=TEST) as n:
        yield n


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("caffemodel")


def seed_model() -> pb.NetParameter:
    """The small net's weights as Net.save writes them."""
    with tempfile.TemporaryDirectory() as d, Net(NET, phase=TEST) as n:
        n.save(Path(d) / "seed.caffemodel")
        return pb.NetParameter.FromString((Path(d) / "seed.caffemodel").read_bytes())


SEED = seed_model()
NAMES = ("", "conv", "bn", "ip", "prob", "data", "nope", "a\nb")


def _blob(draw: Draw, m: pb.NetParameter) -> None:
    layer = draw(st.sampled_from([x for x in m.layer if x.blobs] or list(m.layer)))
    if layer.blobs:
        k = draw(st.integers(0, len(layer.blobs) - 1))
        layer.blobs[k].CopyFrom(draw(mutated_blob(layer.blobs[k])))


def _drop_blob(draw: Draw, m: pb.NetParameter) -> None:
    layer = draw(st.sampled_from(list(m.layer)))
    if layer.blobs:
        del layer.blobs[draw(st.integers(0, len(layer.blobs) - 1))]


def _extra_blob(draw: Draw, m: pb.NetParameter) -> None:
    src = draw(st.sampled_from(list(m.layer)))
    dst = draw(st.sampled_from(list(m.layer)))
    if src.blobs:
        dst.blobs.add().CopyFrom(src.blobs[draw(st.integers(0, len(src.blobs) - 1))])


def _repeat_layer(draw: Draw, m: pb.NetParameter) -> None:
    m.layer.add().CopyFrom(draw(st.sampled_from(list(m.layer))))


def _rename(draw: Draw, m: pb.NetParameter) -> None:
    draw(st.sampled_from(list(m.layer))).name = draw(st.sampled_from(NAMES))


def _swap_blobs(draw: Draw, m: pb.NetParameter) -> None:
    a, b = draw(st.sampled_from(list(m.layer))), draw(st.sampled_from(list(m.layer)))
    blobs_a, blobs_b = list(a.blobs), list(b.blobs)
    a.ClearField("blobs")
    b.ClearField("blobs")
    a.blobs.extend(blobs_b)
    b.blobs.extend(blobs_a)


def _to_v1(draw: Draw, m: pb.NetParameter) -> None:
    """Some layers in the V1 form (NetParameter.layers, blobs in field 6)."""
    keep = []
    for layer in m.layer:
        if draw(st.booleans()):
            v1 = m.layers.add(name=layer.name)
            v1.blobs.extend(layer.blobs)
        else:
            keep.append(layer)
    m.ClearField("layer")
    m.layer.extend(keep)


def _no_layers(draw: Draw, m: pb.NetParameter) -> None:
    m.ClearField("layer")


MODEL_OPS = (_blob, _blob, _blob, _drop_blob, _extra_blob, _repeat_layer, _rename,
             _swap_blobs, _to_v1, _no_layers)


@st.composite
def mutated_model(draw: Draw) -> bytes:
    """The seed caffemodel after 1..3 message mutations, or byte mutations, or both."""
    m = pb.NetParameter()
    m.CopyFrom(SEED)
    how = draw(st.sampled_from(("message", "message", "bytes", "both")))
    if how != "bytes":
        for _ in range(draw(st.integers(1, 3))):
            if m.layer:
                draw(st.sampled_from(MODEL_OPS))(draw, m)
    data = m.SerializeToString()
    if how != "message":
        data = draw(mutated_bytes(data))
    return data


@share(1.0)
@given(data=mutated_model())
@counted
def test_mutated_caffemodel(net: Net, case_dir: Path, data: bytes) -> None:
    path = case_dir / "weights.caffemodel"
    path.write_bytes(data)
    check(lambda: load_weights(path), path)
    check(lambda: net.copy_from(path), path)
