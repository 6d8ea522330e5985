"""The progress bar's line fits 80 columns (a narrower terminal's width less one): the bar
keeps 30 cells where there is room, narrows to no less than 10, then a long description is
shortened from the left; the counts, the times and the rate always stay whole."""

import io
import os
import re

import pytest

from purine.converters import progress
from purine.converters.progress import MAX_WIDTH, Progress, width
from tests.converters.test_progress import FakeTTY, screen

LONG = "/data/experiments/2026-11-27/imagenet/ilsvrc12_train_lmdb_resized_256x256_" \
    "with_a_rather_long_name/train_lmdb"  # 110 characters


def _lines(total, desc, stream=None, steps=None, unit="record"):
    """Every line a terminal shows while a bar counts to ``total`` (None: a plain counter)."""
    stream = FakeTTY() if stream is None else stream
    with Progress(total, desc, stream=stream, enabled=True, unit=unit) as bar:
        for done in steps or [0, (total or 7) // 2, total or 7]:
            bar.update(done, force=True)
    return screen(stream.getvalue()), stream.getvalue()


def _drawn(text):
    """Every state the bar was drawn in (each redraw starts at column 0 with '\\r')."""
    return [s for s in re.split(r"[\r\n]", text) if s.strip()]


def test_a_short_description_keeps_the_30_cell_bar():
    shown, _ = _lines(10, "items")
    assert re.fullmatch(r"items \[#{30}\] 10/10 100% \d\d:\d\d<\d\d:\d\d [\d.]+record/s",
                        shown[-1])


@pytest.mark.parametrize("total, unit", [(5, "record"), (1_234_567, "record"),
                                         (12, "layer")])
def test_a_long_description_gives_way_and_the_line_fits(total, unit):
    shown, raw = _lines(total, LONG, unit=unit)
    for state in _drawn(raw):
        assert len(state) <= MAX_WIDTH, state
    last = shown[-1]
    # the tail of the name, the whole bar of at least 10 cells, counts, times, rate
    m = re.fullmatch(rf"\.\.\.(.*) \[(#{{10,30}})\] {total}/{total} 100% "
                     rf"\d\d:\d\d<\d\d:\d\d [\d.]+{unit}/s", last)
    assert m, last
    assert m.group(1) and LONG.endswith(m.group(1))
    assert len(last) == MAX_WIDTH  # the room left went to the description


def test_a_long_name_on_a_plain_counter_fits():
    shown, raw = _lines(None, LONG, steps=[3, 1_000_000])
    for state in _drawn(raw):
        assert len(state) <= MAX_WIDTH, state
    assert re.fullmatch(r"\.\.\..*/train_lmdb: 1000000record \[\d\d:\d\d, [\d.]+record/s\]",
                        shown[-1]), shown[-1]


class _Terminal(io.StringIO):
    """A terminal stream with a file descriptor, whose width the test decides."""

    def isatty(self):
        return True

    def fileno(self):
        return 2


@pytest.mark.parametrize("columns, expect", [(200, 80), (81, 80), (80, 79), (50, 49),
                                             (0, 80)])
def test_width_follows_a_narrower_terminal(monkeypatch, columns, expect):
    monkeypatch.setattr(progress.os, "get_terminal_size",
                        lambda fd: os.terminal_size((columns, 24)))
    stream = _Terminal()
    assert width(stream) == expect
    assert width(FakeTTY()) == MAX_WIDTH  # no file descriptor: 80
    _, raw = _lines(5, LONG, stream=stream)
    for state in _drawn(raw):
        assert len(state) <= expect, state
