"""The profiler trace of a run as a Chrome trace (chrome://tracing, Perfetto): the
dispatcher's op events and the spans any thread records (``SPANS``), one track for each
worker that does work, one process id per MPI rank."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from purine.graph import Location
    from purine.runtime.dispatcher import TraceEvent

# Communication ops get a track of their own, named for what moves the data, even where they
# share a worker thread with other ops (MPI's exchange runs at the update ops' location):
# their time is what a user looks for when asking whether communication keeps up.
COMMUNICATION = {"MPI": "mpi", "Nccl": "nccl"}  # op type prefix -> track
SERVER = "parameter server"


@dataclass(frozen=True)
class Span:
    """A stretch of work a thread did: ``track`` is the thread's name, ``thread`` its id."""

    name: str
    cat: str
    track: str
    thread: int
    start: float
    end: float
    args: dict | None = None


class _Off:
    """The span handed out while no trace is taken: entering and leaving it does nothing."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class _On:
    def __init__(self, into: list[Span], name: str, cat: str, args: dict | None):
        self.into, self.name, self.cat, self.args = into, name, cat, args

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        end = time.perf_counter()
        t = threading.current_thread()
        # list.append is atomic: threads record without a lock
        self.into.append(Span(self.name, self.cat, t.name, t.ident or 0, self.start, end,
                              self.args))


class SpanRecorder:
    """Spans from any thread while on (``start()`` .. ``stop()``), on the clock the
    dispatcher's profiler uses. Off, a span is an empty ``with`` block (no clock read)."""

    def __init__(self) -> None:
        self._spans: list[Span] | None = None

    @property
    def on(self) -> bool:
        return self._spans is not None

    def span(self, name: str, cat: str = "", args: dict | None = None) -> _On | _Off:
        """``with SPANS.span("decode", "data"):`` records the block as one span."""
        spans = self._spans
        return _OFF if spans is None else _On(spans, name, cat, args)

    def start(self) -> None:
        self._spans = []

    def stop(self) -> list[Span]:
        """The spans recorded since ``start()``; a span still open then is left out."""
        spans, self._spans = self._spans or [], None
        return list(spans)


SPANS = SpanRecorder()


def _where(loc: Location) -> str:
    return f"{loc.device}:{loc.index}/t{loc.thread}"


def op_track(loc: Location, op_type: str, servers: Collection[Location] = ()) -> str:
    """The track of an op: its communication kind, the parameter server (where the update
    ops run apart from every replica's pass), or its location's worker (a GPU stream)."""
    kind = next((k for prefix, k in COMMUNICATION.items() if op_type.startswith(prefix)), None)
    if kind is not None:
        return kind if loc.device == "cpu" else f"{kind} {loc.device}:{loc.index}"
    if loc in servers:
        return SERVER if len(servers) == 1 else f"{SERVER} {_where(loc)}"
    return f"{'stream' if loc.device == 'gpu' else 'worker'} {_where(loc)}"


def trace_rows(events: Sequence[TraceEvent], spans: Sequence[Span] = (),
               servers: Collection[Location] = ()) -> list[dict[str, Any]]:
    """One process's trace as plain rows (name, cat, track, start, end in seconds, pid 0,
    args): what ranks send each other and ``chrome_trace`` lays out. Threads of one name
    (two replicas' prefetchers) get tracks ``name``, ``name #2``, ..."""
    rows = [{"name": e.op.name, "cat": e.op.type, "pid": 0,
             "track": op_track(e.op.location, e.op.type, servers),
             "start": e.start, "end": e.end} for e in events]
    named: dict[tuple[str, int], str] = {}
    count: dict[str, int] = {}
    for s in spans:
        track = named.get((s.track, s.thread))
        if track is None:
            n = count[s.track] = count.get(s.track, 0) + 1
            track = named[s.track, s.thread] = s.track if n == 1 else f"{s.track} #{n}"
        row = {"name": s.name, "cat": s.cat, "pid": 0, "track": track, "start": s.start,
               "end": s.end}
        if s.args:
            row["args"] = s.args
        rows.append(row)
    return rows


def chrome_trace(rows: Sequence[dict[str, Any]]) -> dict:
    """The Chrome trace of ``rows``: times from the earliest start in microseconds, a
    thread per (pid, track), each pid named "rank k" when there are several."""
    t0 = min((r["start"] for r in rows), default=0.0)
    tids: dict[tuple[int, str], int] = {}
    for pid, track in sorted({(r["pid"], r["track"]) for r in rows},
                             key=lambda t: (t[0], _order(t[1]), t[1])):
        tids[pid, track] = len(tids)
    out = []
    for r in rows:
        e = {"name": r["name"], "cat": r["cat"], "ph": "X", "pid": r["pid"],
             "tid": tids[r["pid"], r["track"]], "ts": (r["start"] - t0) * 1e6,
             "dur": (r["end"] - r["start"]) * 1e6}
        if "args" in r:
            e["args"] = r["args"]
        out.append(e)
    meta = []
    for (pid, track), tid in tids.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"name": track}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                     "args": {"sort_index": tid}})
    pids = sorted({pid for pid, _ in tids})
    if len(pids) > 1:
        meta += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                  "args": {"name": f"rank {pid}"}} for pid in pids]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def _order(track: str) -> int:
    """Workers first, then the parameter server and communication, then other threads."""
    kinds = ("worker", "stream", SERVER, *COMMUNICATION.values())
    return next((i for i, k in enumerate(kinds) if track.startswith(k)), len(kinds))


def write_chrome_trace(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(rows), f)
