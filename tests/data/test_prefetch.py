"""The prefetch thread: batches in order, a bounded lead, restore discarding prefetched
batches, errors raised by the consumer (never a hang) and retried, a thread that ends with
its prefetcher, batch arrays recycled through the pool, and a trace's spans recorded into the
recorder handed in (per prefetcher, or for a block) without rebinding anything for good."""

import gc
import threading
import time

import numpy as np
import pytest

from purine.data import DataError, prefetch
from purine.data.prefetch import BufferPool, Prefetcher, data_span, fill_tops
from purine.errors import PurineError


class Recorder:
    def __init__(self, fail_at=None, exc=None):
        self.calls: list[int] = []
        self.threads: set[str] = set()
        self.fail_at, self.exc = fail_at, exc

    def __call__(self, pool):
        def read(k):
            self.threads.add(threading.current_thread().name)
            self.calls.append(k)
            if k == self.fail_at:
                raise self.exc
            return (np.full(2, k),)
        return read


def wait_until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_in_order_with_a_bounded_lead(depth):
    rec = Recorder()
    p = Prefetcher(rec, depth, "layer 'x'")
    got = [int(p.next()[0][0]) for _ in range(6)]
    assert got == list(range(6)) and p.state() == {"batch": 6}
    if depth:
        assert rec.threads == {"prefetch layer 'x'"}
        wait_until(lambda: len(rec.calls) >= 6 + depth)
        time.sleep(0.05)
        # depth batches in the queue plus the one the thread holds waiting for a slot
        assert 6 + depth <= len(rec.calls) <= 6 + depth + 1
    else:
        assert rec.calls == list(range(6))
    p.stop(wait=1.0)


def test_restore_discards_prefetched_batches():
    rec = Recorder()
    p = Prefetcher(rec, 3, "layer 'x'")
    for _ in range(3):
        p.next()
    p.restore({"batch": 10})
    assert [int(p.next()[0][0]) for _ in range(3)] == [10, 11, 12]
    p.restore({"batch": 1})
    assert int(p.next()[0][0]) == 1
    p.stop(wait=1.0)


@pytest.mark.parametrize("depth", [0, 2])
def test_errors_surface_and_retry(depth):
    rec = Recorder(fail_at=2, exc=DataError("LMDB 'db': record 'key2': broken"))
    p = Prefetcher(rec, depth, "layer 'x'")
    p.next(), p.next()
    t0 = time.monotonic()
    with pytest.raises(DataError, match="record 'key2': broken"):
        p.next()
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(DataError, match="record 'key2'"):  # the same batch again
        p.next()
    p.restore({"batch": 0})
    assert int(p.next()[0][0]) == 0
    p.stop(wait=1.0)


def test_foreign_exceptions_are_named():
    p = Prefetcher(Recorder(fail_at=0, exc=ValueError("bad value")), 2, "layer 'x'")
    with pytest.raises(PurineError, match="layer 'x': batch 0: ValueError: bad value"):
        p.next()

    def broken(pool):
        raise OSError("cannot open")

    p = Prefetcher(broken, 2, "layer 'y'")
    with pytest.raises(PurineError, match="layer 'y': batch 0: OSError: cannot open"):
        p.next()


def test_thread_ends_with_its_prefetcher():
    rec = Recorder()
    p = Prefetcher(rec, 2, "layer 'gc'")
    p.next()
    thread = p._thread
    assert thread.is_alive()
    del p
    gc.collect()
    thread.join(2.0)
    assert not thread.is_alive() and thread.daemon


def test_fill_tops_copies_and_recycles():
    seen = []

    def make(pool):
        def read(k):
            a = pool.array((2, 3), np.float32)
            seen.append(a)
            a[...] = k
            return (a, np.full(2, -k, np.float32))
        return read

    p = Prefetcher(make, 0, "layer 'x'")
    top, label = np.empty((2, 3), np.float32), np.empty(2, np.float32)
    for k in range(3):
        fill_tops(top, label, source=p)
        assert (top == k).all() and (label == -k).all()
    assert seen[0] is seen[1] is seen[2]  # the pool handed the same array back


def test_pool_limit():
    pool = BufferPool(1)
    a, b = np.empty(3), np.empty(3)
    pool.give((a, b, np.empty(3)[1:]))  # views are never pooled
    assert pool.array((3,), np.float64) is a
    assert pool.array((3,), np.float64) is not b


class Spans:
    """A span recorder by hand: the (name, cat, args, thread) of each span as it ends."""

    def __init__(self):
        self.seen: list[tuple] = []

    def span(self, name, cat="", args=None):
        seen, thread = self.seen, threading.current_thread().name

        class Block:
            def __enter__(self):
                pass

            def __exit__(self, *exc):
                seen.append((name, cat, args, thread))
        return Block()


def staged(pool):
    def read(k):
        with data_span("decode"):  # a reader's stage, recorded without a recorder in hand
            return (np.full(2, k),)
    return read


def test_a_prefetcher_records_into_the_recorder_it_was_given():
    mine, default = Spans(), prefetch.spans
    p = Prefetcher(staged, 1, "layer 'x'", spans=mine)
    assert [int(p.next()[0][0]) for _ in range(2)] == [0, 1]
    p.close()
    t = "prefetch layer 'x'"
    assert mine.seen[:4] == [("decode", "data", None, t), ("batch 0", "data", {"batch": 0}, t),
                             ("decode", "data", None, t), ("batch 1", "data", {"batch": 1}, t)]
    assert prefetch.spans is default  # nothing process-wide was touched
    with data_span("main"):  # this thread was given none: the module's recorder, records nothing
        pass
    assert [s for s in mine.seen if s[3] == "MainThread"] == []


def test_recording_installs_a_recorder_for_a_block_and_puts_the_old_one_back():
    block, default = Spans(), prefetch.spans
    with pytest.raises(RuntimeError, match="stop"), prefetch.recording(block) as into:
        assert into is block and prefetch.spans is block
        p = Prefetcher(staged, 1, "layer 'y'")
        assert int(p.next()[0][0]) == 0
        with data_span("in the block", {"k": 1}):
            pass
        raise RuntimeError("stop")
    assert prefetch.spans is default
    p.close()
    t = "prefetch layer 'y'"
    assert block.seen[:2] == [("decode", "data", None, t), ("batch 0", "data", {"batch": 0}, t)]
    assert ("in the block", "data", {"k": 1}, "MainThread") in block.seen
