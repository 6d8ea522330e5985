"""Prefetching: a daemon thread makes batches k, k+1, ... ahead of the forward op into a
bounded queue, so that reading, decoding and transforming overlap computation. The batch
number handed out next is the data cursor a snapshot keeps; restoring it restarts the
thread there. An error in the thread is raised by the forward op, naming the record."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from purine.backend import get_array_module
from purine.data import DataError
from purine.errors import PurineError

Batch = tuple[Any, ...]
Reader = Callable[[int], Batch]
"""``read(k)``: batch number ``k`` (a tuple of host arrays, one per top); it must depend on
``k`` only, so that a batch is the same whichever thread makes it and whenever."""


class BufferPool:
    """Batch arrays handed back by the forward op after copying, for the reader to fill
    again: a fresh array of a few hundred MB per batch costs page faults every time."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: dict[tuple, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype))
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        return np.empty(shape, dtype)

    def give(self, arrays: Batch) -> None:
        with self._lock:
            for a in arrays:
                if isinstance(a, np.ndarray) and a.base is None:
                    free = self._free.setdefault((a.shape, a.dtype), [])
                    if len(free) < self.limit:
                        free.append(a)

_POLL_S = 0.1  # how often a blocked thread checks whether it should stop
_LIVE: weakref.WeakSet = weakref.WeakSet()


class Prefetcher:
    """Batches ``read(position)``, ``read(position + 1)``, ... made ahead by a background
    thread into a queue of ``depth`` batches (``depth`` 0: made on demand in the caller).

    ``make_reader(pool)`` is called in the thread and returns its ``read`` function, so that
    each thread has its own database transaction and cursor; ``read`` takes its batch
    arrays from ``pool``, where the forward op gives them back (``recycle``)."""

    def __init__(self, make_reader: Callable[[BufferPool], Reader], depth: int, name: str):
        self.make_reader, self.depth, self.name = make_reader, int(depth), name
        self.pool = BufferPool(max(1, self.depth) + 1)
        self.position = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._read: Reader | None = None  # depth 0
        _LIVE.add(self)

    # -- the cursor the solver keeps -------------------------------------------------
    def state(self) -> dict:
        return {"batch": self.position}

    def restore(self, state: dict) -> None:
        """Continue at batch ``state["batch"]``: prefetched batches are discarded."""
        self.stop()
        self.position = int(state["batch"])

    # -- consuming -------------------------------------------------------------------
    def next(self) -> Batch:
        """The next batch; raises the reader's error (a PurineError naming the record)."""
        if self.depth <= 0:
            if self._read is None:
                self._read = self.make_reader(self.pool)
            batch = self._read(self.position)
            self.position += 1
            return batch
        if self._thread is None:
            self._start()
        while True:
            try:
                k, batch, err = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._thread = None
                    raise DataError(f"{self.name}: the prefetch thread stopped without a "
                                    "batch") from None
        if err is not None:
            self._thread = None  # it has exited; the next call retries this batch
            if isinstance(err, PurineError):
                raise err
            raise DataError(f"{self.name}: batch {k}: {type(err).__name__}: {err}") from err
        assert k == self.position, (k, self.position)
        self.position += 1
        return batch

    def recycle(self, batch: Batch) -> None:
        """The forward op is done with ``batch``: its arrays may be filled again."""
        self.pool.give(batch)

    # -- the thread ------------------------------------------------------------------
    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        t = threading.Thread(target=_produce, name=f"prefetch {self.name}", daemon=True,
                             args=(self.make_reader, self.pool, self.position, self._queue,
                                   self._stop))
        # The thread holds no reference to this object: once the layer is gone, it stops.
        weakref.finalize(self, self._stop.set)
        t.start()
        self._thread = t

    def stop(self, wait: float = 0.0) -> None:
        """Stop the thread (at most ``wait`` seconds for it to finish) and drop its batches."""
        if self._stop is not None:
            self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(wait)
        self._thread = self._queue = self._stop = None
        self._read = None


def _produce(make_reader: Callable[[BufferPool], Reader], pool: BufferPool, first: int,
             q: queue.Queue, stop: threading.Event) -> None:
    k = first
    try:
        read = make_reader(pool)
    except BaseException as e:  # handed to the consumer, which raises it
        _put(q, stop, (k, None, e))
        return
    while not stop.is_set():
        try:
            item = (k, read(k), None)
        except BaseException as e:
            item = (k, None, e)
        if not _put(q, stop, item) or item[2] is not None:
            return
        k += 1


def _put(q: queue.Queue, stop: threading.Event, item: tuple) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


@atexit.register
def _stop_all() -> None:
    """Let the threads leave their database reads before the interpreter tears down."""
    live = list(_LIVE)
    for p in live:
        if p._stop is not None:
            p._stop.set()
    for p in live:
        t = p._thread
        if t is not None:
            t.join(1.0)


def fill_tops(*tops: Any, source: Prefetcher | Any) -> None:
    """The data layers' forward kernel: copy ``source.next()``'s arrays into the tops."""
    batch = source.next()
    for top, value in zip(tops, batch, strict=True):
        if get_array_module(top) is not get_array_module(value):
            top.set(np.ascontiguousarray(value, dtype=top.dtype))  # host to device (cupy)
        else:
            top[...] = value
    recycle = getattr(source, "recycle", None)
    if recycle is not None:
        recycle(batch)
