"""Fuzzing convert_imageset's flags: seeds over the whole int64 range and past it, resize
sizes up to 2^31-1 and beyond, encode types OpenCV writes or not, backends, gray, encoded,
check_size and shuffle together. A run writes every image once with its label, in the shape
the flags ask for; a refusal is one line, and it leaves no database behind."""

from __future__ import annotations

import itertools
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.converters.convert_imageset import MAX_DATUM_PIXELS, convert_imageset
from tests.converters.helpers import datums
from tests.fuzz.harness import EXTREME_INTS, Draw, check, counted, share

ENCODINGS = ("", "", "png", "jpg", "bmp", "tiff", "exr", "hdr", "pfm", "ppm", "pgm", "webp",
             "nope", "PNG", "png/x", ".png")
SIZE_BOUND = 64 * 64  # resized pixels a case may ask for (bigger ones are skipped)
_case = itertools.count()


@pytest.fixture(scope="module")
def imageset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    root = tmp_path_factory.mktemp("imageset")
    rng = np.random.default_rng(7)
    entries = []
    for i, name in enumerate(("a.png", "b.jpg", "c d.png")):
        assert cv2.imwrite(str(root / name), rng.integers(0, 256, (6, 5, 3), np.uint8))
        entries.append((name, i - 1))
    listfile = root / "list.txt"
    listfile.write_text("".join(f"{n} {label}\n" for n, label in entries))
    return root, listfile, entries


@st.composite
def flags(draw: Draw) -> dict:
    size = st.one_of(st.integers(-3, 9), st.sampled_from(EXTREME_INTS),
                     st.sampled_from((2**31 - 1, -(2**31), 2**31)))
    return dict(
        gray=draw(st.booleans()), shuffle=draw(st.booleans()),
        seed=draw(st.one_of(st.integers(-3, 9), st.sampled_from(EXTREME_INTS),
                            st.integers(-(2**70), 2**70))),
        resize=(draw(size), draw(size)), check_size=draw(st.booleans()),
        encoded=draw(st.booleans()), encode_type=draw(st.sampled_from(ENCODINGS)),
        backend=draw(st.sampled_from(("lmdb", "lmdb", "leveldb", "rocksdb"))))


def _too_big(resize: tuple[int, int], gray: bool) -> bool:
    """A resize that passes the Datum bound but would take seconds and gigabytes here."""
    h, w = resize
    if not (0 < h < 2**31 and 0 < w < 2**31):
        return False  # not resized at all, or refused as no int32
    pixels = h * w * (1 if gray else 3)
    return SIZE_BOUND < pixels <= MAX_DATUM_PIXELS


@given(flags())
@share(0.15)
@counted
def test_flags(imageset: tuple[Path, Path, list], tmp_path_factory: pytest.TempPathFactory,
               kw: dict) -> None:
    root, listfile, entries = imageset
    if _too_big(kw["resize"], kw["gray"]):
        return
    db = root / f"db{next(_case)}"
    outcome = check(lambda: convert_imageset(root, listfile, db, **kw), listfile,
                    also=("encode_type", "--resize_", "backend", str(db)))
    if outcome != "success":
        assert not db.exists()  # refused before it was made, or removed
        return
    assert db.exists()
    if kw["backend"] != "lmdb":  # read back with the lmdb package alone: lmdb only
        return
    got = datums(db)
    assert sorted((k[9:], d.label) for k, d in got) == sorted(entries)
    assert [k[:8] for k, _ in got] == [f"{i:08d}" for i in range(len(entries))]
    h, w = kw["resize"]
    shape = (1 if kw["gray"] else 3, h, w) if h > 0 and w > 0 else (1 if kw["gray"] else 3, 6, 5)
    for _, d in got:
        if d.encoded:
            img = cv2.imdecode(np.frombuffer(d.data, np.uint8), cv2.IMREAD_UNCHANGED)
            assert img.dtype == np.uint8
            assert (img.shape[2] if img.ndim == 3 else 1, *img.shape[:2]) == shape
        else:
            assert (d.channels, d.height, d.width) == shape
            assert len(d.data) == shape[0] * shape[1] * shape[2]
