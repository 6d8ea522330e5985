"""Fuzzing .binaryproto mean files: means in the legacy num/channels/height/width form (as
compute_image_mean writes them) and in the ``shape`` form, mutated as BlobProto messages and
as wire bytes, read by the data layers' read_mean and by the binaryproto converter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.converters.binaryproto import read_binaryproto
from purine.data.datum import read_mean
from purine.formats import caffe_pb2 as pb
from tests.fuzz.harness import Draw, check, counted, mutated_blob, mutated_bytes, share


def seed_means() -> list[pb.BlobProto]:
    values = np.arange(3 * 4 * 5, dtype=np.float32) / 7
    legacy = pb.BlobProto(num=1, channels=3, height=4, width=5, data=values)
    shaped = pb.BlobProto(shape=pb.BlobShape(dim=[1, 3, 4, 5]), data=values)
    three = pb.BlobProto(shape=pb.BlobShape(dim=[3, 4, 5]), double_data=values)
    return [legacy, shaped, three]


SEEDS = seed_means()


@st.composite
def mutated_mean(draw: Draw) -> bytes:
    """A seed mean after BlobProto mutations, byte mutations, or both."""
    blob = draw(st.sampled_from(SEEDS))
    how = draw(st.sampled_from(("message", "message", "bytes", "both")))
    if how != "bytes":
        blob = draw(mutated_blob(blob))
    data = blob.SerializeToString()
    if how != "message":
        data = draw(mutated_bytes(data))
    return data


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("binaryproto")


@share(0.6)
@given(data=mutated_mean())
@counted
def test_mutated_mean_file(case_dir: Path, data: bytes) -> None:
    path = case_dir / "mean.binaryproto"
    path.write_bytes(data)
    check(lambda: read_mean(path), path)
    check(lambda: read_binaryproto(path), path)
