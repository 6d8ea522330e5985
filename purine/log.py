"""Log lines in Caffe's (glog's) format, ``I1121 05:17:00.123456  4242 file.py:88] message``,
so tools written for Caffe logs read ours."""

from __future__ import annotations

import logging
import os
import sys
import time

_LEVELS = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
           logging.CRITICAL: "F"}


class GlogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1e6)
        prefix = (f"{_LEVELS.get(record.levelno, 'I')}{t.tm_mon:02d}{t.tm_mday:02d} "
                  f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{micros:06d} "
                  f"{os.getpid():5d} {record.filename}:{record.lineno}] ")
        return prefix + record.getMessage()


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each line (a script or test that
    swaps it, and closes the old one, keeps getting our lines)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


# glog's severities (GLOG_minloglevel, pycaffe's init_log): 0 INFO ... 3 FATAL.
GLOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}


def _min_level() -> int:
    """GLOG_minloglevel's level, as Caffe users silence Caffe's INFO lines (INFO if unset)."""
    text = os.environ.get("GLOG_minloglevel", "0").strip()
    return GLOG_LEVELS.get(int(text) if text.isdigit() else 0, logging.INFO)


def get_logger() -> logging.Logger:
    log = logging.getLogger("purine")
    if not log.handlers:
        handler = _Stderr()
        handler.setFormatter(GlogFormatter())
        log.addHandler(handler)
        log.setLevel(_min_level())
        log.propagate = False
    return log
