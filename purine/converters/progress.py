"""The progress bar of the long commands (convert_imageset, compute_image_mean, extract_features,
the exporters, ``test``): a tqdm bar on stderr when stderr is a terminal, nothing in logs and
pipes, never wider than 80 columns (or the terminal, if narrower). ``PURINE_PROGRESS=1``
forces it on, ``PURINE_PROGRESS=0`` off."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tqdm import tqdm

ENV = "PURINE_PROGRESS"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
# Caffe-tool style: "train_lmdb [###############...............] 1000/2000  50% ...".
BAR_FORMAT = ("{desc} [{bar:30}] {n_fmt}/{total_fmt} {percentage:3.0f}% "
              "{elapsed}<{remaining} {rate_fmt}")
MAX_WIDTH = 80  # columns: a line fits a classic terminal and stays whole in a narrow pane
MIN_BAR = 10  # below this many cells the bar says little: the description gives way first
_bar_class = None


def wanted(stream: TextIO | None = None) -> bool:
    """Whether a bar is drawn on ``stream`` (default stderr): ``PURINE_PROGRESS`` when it
    says 0/1 (or false/true, no/yes, off/on), else whether the stream is a terminal."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in _ON or env in _OFF:
        return env in _ON
    isatty = getattr(sys.stderr if stream is None else stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(total: int | None, desc: str, *, unit: str = "it",
                 stream: TextIO | None = None, enabled: bool | None = None) -> tqdm:
    """A tqdm bar of ``total`` items (None: a plain counter) on ``stream`` (default stderr),
    disabled (every call a no-op) unless ``enabled`` or, when that is None, ``wanted``.
    Its line is at most ``width(stream)`` columns whatever the description's length."""
    stream = sys.stderr if stream is None else stream
    on = wanted(stream) if enabled is None else enabled
    return _fitted_tqdm()(total=total, desc=desc, unit=unit, file=stream, ascii=".#",
                          leave=True, bar_format=BAR_FORMAT if total else None,
                          disable=not on or total == 0, ncols=width(stream))


def width(stream: TextIO) -> int:
    """The bar's line width on ``stream``: ``MAX_WIDTH``, or a narrower terminal's width
    less one (a line reaching the last column wraps on some terminals). A terminal that
    reports no width (0 columns, as some ptys do) and a stream without one get MAX_WIDTH."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no file descriptor, not a terminal
        return MAX_WIDTH
    return MAX_WIDTH if columns < 2 else min(MAX_WIDTH, columns - 1)


def _fitted_tqdm() -> type[tqdm]:
    """tqdm whose lines fit ``ncols``: the bar keeps its 30 cells where the line has room,
    narrows to no less than ``MIN_BAR``, then the description is shortened from the left
    ("...tail": a path's file name survives); tqdm's own trim is the last resort."""
    global _bar_class
    if _bar_class is not None:
        return _bar_class
    from tqdm import tqdm  # here, so that importing purine never imports tqdm
    from tqdm.utils import disp_len

    class FittedTqdm(tqdm):
        @staticmethod
        def format_meter(n, total, elapsed, ncols=None, prefix="", bar_format=None, **kw):
            # Untrimmed (tqdm would cut the line at ncols): the bar's 30 cells, if they fit.
            line = tqdm.format_meter(n, total, elapsed, prefix=prefix, bar_format=bar_format,
                                     **kw)
            if not ncols or disp_len(line) <= ncols:
                return line
            if bar_format:  # let the bar take what is left, down to MIN_BAR cells
                bar_format = bar_format.replace("{bar:30}", "{bar}")
                bare = tqdm.format_meter(n, total, elapsed, prefix="",
                                         bar_format=bar_format.replace("{bar}", ""), **kw)
                room = ncols - disp_len(bare) - MIN_BAR
            else:  # a plain counter: "desc: 5record [00:01, 4.1record/s]"
                room = ncols - disp_len(tqdm.format_meter(n, total, elapsed, **kw)) - 2
            if prefix and disp_len(prefix) > room:
                prefix = "..." + prefix[-max(room - 3, 1):]
            return tqdm.format_meter(n, total, elapsed, ncols=ncols, prefix=prefix,
                                     bar_format=bar_format, **kw)

    _bar_class = FittedTqdm
    return FittedTqdm


def _console(logger: logging.Logger) -> bool:
    return any(isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.stderr)
               for h in logger.handlers)


class Progress:
    """A tqdm bar counting done items, by their running total (``update(done)``). As a
    context manager it moves the console lines of ``log`` and of the project's logger above
    the bar while it is drawn, and erases the bar when the block raises, so an error message
    starts its own line; a clean exit leaves the final bar and a newline."""

    def __init__(self, total: int | None, label: str, stream: TextIO | None = None,
                 enabled: bool | None = None, *, unit: str = "it",
                 log: logging.Logger | None = None):
        self.bar = progress_bar(total, label, unit=unit, stream=stream, enabled=enabled)
        self.enabled = not self.bar.disable
        loggers = {id(lg): lg for lg in (log, logging.getLogger("purine")) if lg is not None}
        self._loggers = [lg for lg in loggers.values() if _console(lg)]
        self._redirect: contextlib.ExitStack | None = None

    def update(self, done: int, force: bool = False) -> None:
        """``done`` items so far; tqdm redraws at most every 0.1 s unless ``force``."""
        self.bar.update(done - self.bar.n)
        if force:
            self.bar.refresh()

    def clear(self) -> None:
        """Erase the bar (before a line is written below it without going through ``log``)."""
        self.bar.clear()

    def close(self, done: int | None = None) -> None:
        """Draw the final count and end the bar's line."""
        if done is not None:
            self.update(done)
        self.bar.close()

    def __enter__(self) -> Progress:
        if self.enabled and self._loggers:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm(self._loggers))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self.bar.leave = False  # closing then erases the bar's line
        self.bar.close()
        if self._redirect is not None:
            self._redirect.close()
