"""The profiler trace of a run as a Chrome trace (chrome://tracing, Perfetto): one track per
location, one complete event per op."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from purine.runtime.dispatcher import TraceEvent


def chrome_trace(events: Sequence[TraceEvent]) -> dict:
    t0 = min((e.start for e in events), default=0.0)
    tracks: dict[str, int] = {}
    out = []
    for e in events:
        loc = str(e.op.location)
        tid = tracks.setdefault(loc, len(tracks))
        out.append({"name": e.op.name, "cat": e.op.type, "ph": "X", "pid": e.op.location.host,
                    "tid": tid, "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6})
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": loc}}
             for loc, tid in tracks.items()]
    return {"traceEvents": names + out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[TraceEvent], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)
