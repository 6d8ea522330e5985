"""Fuzzing Datum records: raw (uint8 ``data`` or ``float_data``) and encoded (PNG, JPEG)
records, mutated in their dims, payloads, flags and wire bytes, decoded by the Datum
functions directly and read through a Data layer over a small LMDB."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import lmdb
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.caffe import TRAIN, Net
from purine.data.datum import datum_image, decode_flag, parse_datum
from purine.formats import caffe_pb2 as pb
from tests.fuzz.harness import (
    EXTREME_FLOATS,
    INT32,
    Draw,
    check,
    counted,
    ints_in,
    mutated_bytes,
    share,
)


def seed_records() -> list[pb.Datum]:
    rng = np.random.default_rng(0)
    color = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    raw = pb.Datum(channels=3, height=4, width=5, data=color.transpose(2, 0, 1).tobytes(),
                   label=1)
    floats = pb.Datum(channels=1, height=3, width=3, float_data=np.arange(9) / 2, label=2)
    png = pb.Datum(channels=3, height=4, width=5, encoded=True, label=3,
                   data=cv2.imencode(".png", color)[1].tobytes())
    jpeg = pb.Datum(channels=1, height=4, width=5, encoded=True, label=4,
                    data=cv2.imencode(".jpg", color[..., 0])[1].tobytes())
    return [raw, floats, png, jpeg]


SEEDS = seed_records()


def _dims(draw: Draw, d: pb.Datum) -> None:
    setattr(d, draw(st.sampled_from(("channels", "height", "width"))), draw(ints_in(INT32)))


def _data(draw: Draw, d: pb.Datum) -> None:
    keep = draw(st.integers(0, len(d.data)))
    d.data = d.data[:keep] + draw(st.binary(max_size=8))


def _image_bytes(draw: Draw, d: pb.Datum) -> None:
    d.data = draw(mutated_bytes(d.data)) if d.data else d.data


def _encoded(draw: Draw, d: pb.Datum) -> None:
    d.encoded = not d.encoded


def _other_payload(draw: Draw, d: pb.Datum) -> None:
    """Another seed's payload: PNG bytes in a raw record, pixels in an encoded one."""
    other = draw(st.sampled_from(SEEDS))
    d.data = other.data
    d.ClearField("float_data")
    d.float_data.extend(other.float_data)


def _float_data(draw: Draw, d: pb.Datum) -> None:
    d.float_data.extend(draw(st.lists(st.sampled_from(EXTREME_FLOATS), min_size=1,
                                      max_size=12)))


def _clear(draw: Draw, d: pb.Datum) -> None:
    d.ClearField(draw(st.sampled_from(("data", "float_data", "channels", "encoded"))))


def _label(draw: Draw, d: pb.Datum) -> None:
    d.label = draw(ints_in(INT32))


DATUM_OPS = (_dims, _dims, _data, _image_bytes, _encoded, _other_payload, _float_data, _clear,
             _label)


@st.composite
def mutated_record(draw: Draw) -> bytes:
    """A seed record after 1..3 Datum mutations, then possibly byte mutations."""
    d = pb.Datum()
    d.CopyFrom(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        draw(st.sampled_from(DATUM_OPS))(draw, d)
    data = d.SerializeToString()
    if draw(st.integers(0, 3)) == 0:
        data = draw(mutated_bytes(data))
    return data


DB = "fuzz_lmdb"


@share(0.6)
@given(value=mutated_record(), force=st.sampled_from(((False, False), (True, False),
                                                      (False, True))))
@counted
def test_mutated_datum_record(value: bytes, force: tuple[bool, bool]) -> None:
    where = f"lmdb '{DB}': record '00000000'"

    def decode() -> None:
        datum_image(parse_datum(value, where), decode_flag(*force), where)

    check(decode, DB)


TRANSFORMS = ("", "scale: 0.5", "crop_size: 2", "crop_size: 100", "mirror: true",
              "mean_value: 1 mean_value: 2 mean_value: 3", "mean_value: 1", "force_color: true",
              "force_gray: true", "crop_size: 3 mirror: true mean_value: 4")


def data_net(db: Path, batch: int, transform: str) -> str:
    return (f'layer {{ name: "data" type: "Data" top: "data" top: "label" data_param {{ '
            f'source: "{db}" backend: LMDB batch_size: {batch} }} '
            f"transform_param {{ {transform} }} }}")


def write_db(path: Path, records: list[bytes]) -> None:
    shutil.rmtree(path, ignore_errors=True)
    env = lmdb.open(str(path), map_size=1 << 22)
    with env.begin(write=True) as txn:
        for i, value in enumerate(records):
            txn.put(f"{i:08d}".encode(), value)
    env.close()


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("datum")


def read_twice(model: str) -> None:
    with Net(model, phase=TRAIN) as net:
        net.forward()
        net.forward()


@share(0.4)
@given(records=st.lists(st.one_of(mutated_record(), st.sampled_from(SEEDS).map(
           pb.Datum.SerializeToString)), min_size=1, max_size=3),
       batch=st.integers(1, 3), transform=st.sampled_from(TRANSFORMS))
@counted
def test_mutated_records_through_a_data_layer(case_dir: Path, records: list[bytes],
                                              batch: int, transform: str) -> None:
    db = case_dir / "db"
    write_db(db, records)
    check(lambda: read_twice(data_net(db, batch, transform)), db)
