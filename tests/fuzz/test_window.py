"""Fuzzing WindowData's window files: counts and coordinates up to 2^64, digits of other
scripts (superscripts, Arabic-Indic, fullwidth), '1_000' and '1e3', blank lines and
truncation. A file built from values in range must parse to exactly those values; any other
file parses or is refused in one line naming it."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from purine.data.window import read_window_file
from tests.fuzz.harness import EXTREME_INTS, Draw, check, counted, share

INT_MAX = 2**31 - 1
# Spellings of 3 (or of a number) that Python's int(), float() or str.isdigit() take and a
# C++ stream does not.
FOREIGN: tuple[str, ...] = ("\u00b3", "\u0663", "\uff13", "1_0", "1e1", "0x3", "nan", "inf", "\u00b9\u2070",
           "3\u00a0", "", "9" * 5000, "-" + "9" * 5000)
_case = itertools.count()


@pytest.fixture(scope="module")
def case_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("window")


def _int(draw: Draw, lo: int, hi: int) -> tuple[str, int | None]:
    """An integer's text and its value when it lies in [lo, hi] (None: expect a refusal)."""
    kind = draw(st.sampled_from(("small", "small", "extreme", "foreign")))
    if kind == "foreign":
        return draw(st.sampled_from(FOREIGN)), None
    v = draw(st.integers(lo, min(hi, 50))) if kind == "small" else \
        draw(st.sampled_from(EXTREME_INTS)) * draw(st.sampled_from((1, -1)))
    text = str(v)
    if v >= 0 and draw(st.booleans()) and kind == "small":
        text = draw(st.sampled_from(("+", "0", ""))) + text  # C++ reads both forms
    return text, (v if lo <= v <= hi else None)


@st.composite
def window_file(draw: Draw) -> tuple[str, list | None]:
    """A window file and, when every value is in range and nothing was damaged, the
    (image, class, x1, y1, x2, y2, overlap) rows it holds."""
    lines, rows, sound = [], [], True
    for n in range(draw(st.integers(1, 3))):
        lines += [f"# {n}", f"img{n}.png", "3"]
        for _ in range(2):  # height, width
            text, v = _int(draw, 0, INT_MAX)
            lines.append(text)
            sound &= v is not None
        count = draw(st.one_of(st.integers(0, 4), st.sampled_from(EXTREME_INTS)))
        lines.append(str(count))
        sound &= 0 <= count <= 4
        for _ in range(min(count, 4)):
            fields = [_int(draw, -INT_MAX - 1, INT_MAX) for _ in range(5)]
            overlap = draw(st.sampled_from(("0.5", "0.25", ".75", "1", "0", "1e-3", "1e39")))
            sound &= all(v is not None for _, v in fields) and overlap != "1e39"
            lines.append(" ".join([fields[0][0], overlap] + [t for t, _ in fields[1:]]))
            with np.errstate(over="ignore"):
                value = float(np.float32(float(overlap)))
            rows.append([n] + [v for _, v in fields] + [value])
    text = "\n".join(lines) + "\n"
    damage = draw(st.sampled_from(("none", "none", "truncate", "blank", "drop", "superscript")))
    if damage == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    elif damage == "blank":  # blank lines are skipped: still sound
        at = draw(st.integers(0, len(lines)))
        lines.insert(at, draw(st.sampled_from(("", "  ", "\t"))))
        text = "\n".join(lines) + "\n"
    elif damage == "drop" and len(lines) > 1:
        del lines[draw(st.integers(0, len(lines) - 1))]
        text = "\n".join(lines) + "\n"
    elif damage == "superscript":
        text = text.replace("3", "\u00b3", 1)
    sound &= damage in ("none", "blank")
    return text, (rows if sound and rows else None)


@given(window_file())
@share(0.3)
@counted
def test_window_files(case_dir: Path, case: tuple[str, list | None]) -> None:
    text, rows = case
    path = case_dir / f"w{next(_case)}.txt"
    path.write_text(text, encoding="utf-8")
    outcome = check(lambda: read_window_file(path), path)
    if rows is not None:
        assert outcome == "success", text
        w = read_window_file(path)
        got = np.hstack([w.boxes, w.overlap[:, None].astype(np.float64)]).tolist()
        assert got == rows
