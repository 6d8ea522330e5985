"""Prefetching: a daemon thread makes batches k, k+1, ... ahead of the forward op into a
bounded queue, so that reading, decoding and transforming overlap computation. The batch
number handed out next is the data cursor a snapshot keeps; restoring it restarts the
thread there. An error in the thread is raised by the forward op, naming the record.
``close()`` joins the thread and releases the batches' source (its database handle). While
a trace is taken, the thread records a span per batch into the recorder it was given
(``Prefetcher(spans=...)``) or the one ``recording(...)`` installs for a block."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np

from purine.backend import assign, is_device_array
from purine.data import DataError
from purine.errors import PurineError

Batch = tuple[Any, ...]
Reader = Callable[[int], Batch]
"""``read(k)``: batch number ``k`` (a tuple of host arrays, one per top); it must depend on
``k`` only, so that a batch is the same whichever thread makes it and whenever. A ``close``
attribute, if it has one, is called when its thread is done with it."""


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


def stream_batch(k: int, replica: tuple[int, int]) -> int:
    """The number in the whole stream of replica r of R's batch ``k``: k*R + r, so that the
    replicas read disjoint batches which together are those of a single run."""
    rank, count = replica
    return k * count + rank


class PooledBatches:
    """Batches that ``read(k, pool)`` makes from ``k`` alone, keeping nothing per thread: a
    thread's reader is that method over its pool."""

    def reader(self, pool: BufferPool | None = None) -> Reader:
        pool = pool or BufferPool(0)
        return lambda k: self.read(k, pool)

    def read(self, k: int, pool: BufferPool) -> Batch:
        raise NotImplementedError


class NoSpans:
    """The span recorder until one is installed: its spans record nothing."""

    _none = nullcontext()

    def span(self, name: str, cat: str = "",  # noqa: ARG002
             args: dict | None = None) -> nullcontext:  # noqa: ARG002
        return self._none


spans: Any = NoSpans()
"""Where data threads without a recorder of their own record the spans of a trace: an object
whose ``span(name, cat, args)`` is a context manager (purine.runtime.trace.SPANS; data knows
nothing of the runtime, so the caller hands it in). While no trace is taken a span costs an
empty ``with`` block. Set it for a block with ``recording``."""

# The recorder a prefetch thread was given (Prefetcher(spans=...)): the readers it calls
# record their stages through data_span without being handed it.
_thread = threading.local()


@contextmanager
def recording(recorder: Any) -> Iterator[Any]:
    """``with recording(SPANS):`` data threads without a recorder of their own record into
    ``recorder`` for the block; the one before is back after it, whatever the block raised."""
    global spans
    before, spans = spans, recorder
    try:
        yield recorder
    finally:
        spans = before


def data_span(name: str, args: dict | None = None) -> AbstractContextManager:
    """``with data_span("decode"):`` records the block as a span of the data category, into
    the recorder this prefetch thread was given, else the module's ``spans``."""
    return (getattr(_thread, "spans", None) or spans).span(name, "data", args)


_POLL_S = 0.1  # how often a blocked thread checks whether it should stop
_LIVE: weakref.WeakSet = weakref.WeakSet()


class Prefetcher:
    """Batches ``read(position)``, ``read(position + 1)``, ... made ahead by a background
    thread into a queue of ``depth`` batches (``depth`` 0: made on demand in the caller).

    ``make_reader(pool)`` is called in the thread and returns its ``read`` function, so that
    each thread has its own database transaction and cursor; ``read`` takes its batch
    arrays from ``pool``, where the forward op gives them back (``recycle``). When
    ``make_reader`` is a method of an object with a ``close()`` (DatumBatches), ``close()``
    here calls it once the thread has ended.

    ``spans``: the recorder of this thread's spans (``span(name, cat, args)``, as
    purine.runtime.trace.SPANS); None follows the module's ``spans``, read at each span."""

    def __init__(self, make_reader: Callable[[BufferPool], Reader], depth: int, name: str,
                 spans: Any = None):
        self.make_reader, self.depth, self.name = make_reader, int(depth), name
        self.spans = spans
        self.closed = False
        self.pool = BufferPool(max(1, self.depth) + 1)
        self.uploader: Uploader | None = None  # batches for a GPU: copied there by the thread
        self.position = 0
        self._peeked: Batch | DeviceBatch | None = None  # taken from the queue, not handed out
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._read: Reader | None = None  # depth 0
        _LIVE.add(self)

    # -- the cursor the solver keeps -------------------------------------------------
    def state(self) -> dict:
        return {"batch": self.position - (self._peeked is not None)}

    def restore(self, state: dict) -> None:
        """Continue at batch ``state["batch"]``: prefetched batches are discarded."""
        batch = int(state["batch"])
        if batch < 0:  # batch numbers seed the transforms' random draws, which need k >= 0
            raise DataError(f"{self.name}: batch {batch}; a data cursor is 0 or more")
        self.stop()
        self.position = batch

    # -- consuming -------------------------------------------------------------------
    def peek(self) -> Batch | DeviceBatch:
        """The batch ``next()`` hands out next, without handing it out (a data layer settles
        its top shapes from it before its forward op)."""
        if self._peeked is None:
            self._peeked = self.next()
        return self._peeked

    def next(self) -> Batch:
        """The next batch; raises the reader's error (a PurineError naming the record)."""
        if self._peeked is not None:
            batch, self._peeked = self._peeked, None
            return batch
        if self.closed:
            raise DataError(f"{self.name}: the data source is closed (its net was closed)")
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

    def recycle(self, batch: Batch | DeviceBatch) -> None:
        """The forward op is done with ``batch``: its arrays may be filled again."""
        if isinstance(batch, DeviceBatch):
            if self.uploader is not None:
                self.uploader.give(batch)
        else:
            self.pool.give(batch)

    def upload_to(self, device: int) -> None:
        """Have the thread copy each batch to GPU ``device`` (on a stream of its own, so
        the copy overlaps the computation); batches already made for elsewhere are
        dropped and made again."""
        if self.depth <= 0 or (self.uploader is not None and self.uploader.device == device):
            return
        self.stop()
        self.uploader = Uploader(device, self.pool, limit=self.depth + 2)

    # -- the thread ------------------------------------------------------------------
    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        t = threading.Thread(target=_produce, name=self.thread_name(), daemon=True,
                             args=(self.make_reader, self.pool, self.position, self._queue,
                                   self._stop, self.uploader, self.spans))
        # The thread holds no reference to this object: once the layer is gone, it stops.
        weakref.finalize(self, self._stop.set)
        t.start()
        self._thread = t

    def thread_name(self) -> str:
        """The thread's name, its track in a trace: ``prefetch <name>``, with the replica
        when the batches' owner (whose ``reader`` makes them) reads for replica r of R > 1."""
        owner = getattr(self.make_reader, "__self__", None)
        r, count = getattr(owner, "replica", (0, 1))
        return f"prefetch {self.name}" + (f" (replica {r})" if count > 1 else "")

    def stop(self, wait: float = 0.0) -> None:
        """Stop the thread (at most ``wait`` seconds for it to finish) and drop its batches."""
        if self._peeked is not None:  # made again when asked for
            self._peeked = None
            self.position -= 1
        if self._stop is not None:
            self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(wait)
        self._thread = self._queue = self._stop = None
        _close_reader(self._read)
        self._read = None

    def close(self) -> None:
        """Stop the thread, wait until it has left its read, and release the source the
        batches come from: its database is free for other openers when this returns.
        Closing twice does nothing; ``next()`` after it is an error."""
        if self.closed:
            return
        self.closed = True
        thread = self._thread
        self.stop()
        if thread is not None:
            thread.join()  # at most one batch's read: the thread checks its stop between them
        release = getattr(getattr(self.make_reader, "__self__", None), "close", None)
        if release is not None:
            release()


def _produce(make_reader: Callable[[BufferPool], Reader], pool: BufferPool, first: int,
             q: queue.Queue, stop: threading.Event, upload: Uploader | None = None,
             recorder: Any = None) -> None:
    _thread.spans = recorder
    k = first
    try:
        read = make_reader(pool)
    except BaseException as e:  # handed to the consumer, which raises it
        _put(q, stop, (k, None, e))
        return
    try:
        while not stop.is_set():
            try:
                # One span per batch on this thread's track; the reader records its stages
                # (read, decode, transform) inside it while a trace is taken.
                with data_span(f"batch {k}", {"batch": k}):
                    batch = read(k)
                    if upload is not None:
                        with data_span("upload"):
                            batch = upload(batch)
                item = (k, batch, None)
            except BaseException as e:
                item = (k, None, e)
            if not _put(q, stop, item) or item[2] is not None:
                return
            k += 1
    finally:
        _close_reader(read)


def _close_reader(read: Reader | None) -> None:
    close = getattr(read, "close", None)
    if close is not None:
        close()


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


class DeviceBatch:
    """A batch already on a GPU: its arrays, the event after which they hold the batch,
    and (once the forward op has copied them) the event after which they may be refilled."""

    def __init__(self, arrays: tuple[Any, ...], ready: Any):
        self.arrays, self.ready, self.consumed = arrays, ready, None


class Uploader:
    """Called in the prefetch thread: copies a host batch to GPU ``device`` on the thread's
    own stream and gives the host arrays back at once (from pageable memory the copy call
    returns once it has read them). Device arrays are reused once the forward op's copy
    out of them has happened (its ``consumed`` event)."""

    def __init__(self, device: int, pool: BufferPool, limit: int):
        self.device, self.pool, self.limit = device, pool, limit
        self._free: list[DeviceBatch] = []
        self._lock = threading.Lock()
        self._stream = None

    def __call__(self, batch: Batch) -> DeviceBatch:
        import cupy

        with cupy.cuda.Device(self.device):
            if self._stream is None:
                self._stream = cupy.cuda.Stream(non_blocking=True)
            with self._stream:
                arrays = self._take([(np.shape(a), np.asarray(a).dtype) for a in batch])
                for dst, a in zip(arrays, batch, strict=True):
                    dst.set(np.asarray(a, order="C"), stream=self._stream)  # 0-d stays 0-d
                ready = cupy.cuda.Event(block=False, disable_timing=True)
                ready.record(self._stream)
        self.pool.give(batch)
        return DeviceBatch(arrays, ready)

    def _take(self, spec: list[tuple]) -> tuple[Any, ...]:
        import cupy

        with self._lock:
            for i, b in enumerate(self._free):
                if [(a.shape, a.dtype) for a in b.arrays] == spec:
                    del self._free[i]
                    if b.consumed is not None:
                        b.consumed.synchronize()  # the forward op's copy has read them
                    return b.arrays
        return tuple(cupy.empty(shape, dtype) for shape, dtype in spec)

    def give(self, batch: DeviceBatch) -> None:
        with self._lock:
            if len(self._free) < self.limit:
                self._free.append(batch)


def fill_tops(*tops: Any, source: Prefetcher | Any) -> None:
    """The data layers' forward kernel: copy ``source.next()``'s arrays into the tops. For
    tops on a GPU, a prefetching source uploads its batches ahead on its own stream; the
    op's stream waits for the upload and copies on the device."""
    on_gpu = is_device_array(tops[0])
    if on_gpu and isinstance(source, Prefetcher):
        source.upload_to(tops[0].device.id)
    batch = source.next()
    if isinstance(batch, DeviceBatch):
        import cupy

        current = cupy.cuda.get_current_stream()
        current.wait_event(batch.ready)
        for top, value in zip(tops, batch.arrays, strict=True):
            top[...] = value
        batch.consumed = cupy.cuda.Event(block=False, disable_timing=True)
        batch.consumed.record(current)
    else:
        for top, value in zip(tops, batch, strict=True):
            assign(top, value)
    recycle = getattr(source, "recycle", None)
    if recycle is not None:
        recycle(batch)
