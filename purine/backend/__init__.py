"""The array module of each location: numpy on ``cpu``, cupy on ``gpu``, and how an op picks
its code for the memory its arrays live in.

An op whose host and GPU code differ is two named functions side by side, a host body (the
public op, decorated) and a device body with the same signature, joined by
``@device_variant(device_body)``: a call whose first array lives on a GPU runs the device
body, any other call the host body. Host bodies may use numpy directly; device bodies get
cupy from their arrays (``get_array_module``). Code that is the same on both sides is written
once over an array module ``xp`` and called from both bodies. A single library call that
differs (``scatter_add``, ``stable_argsort``) is a helper here rather than a branch in an op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from purine.errors import PurineError
from purine.graph import Location


def array_module(location: Location) -> ModuleType:
    if location.device == "cpu":
        return np
    if location.device == "gpu":
        try:
            import cupy
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise PurineError(
                f"location {location} needs CuPy: install purine-caffe[gpu]"
            ) from e
        return cupy
    raise PurineError(f"unknown device kind '{location.device}' in location {location}")


def get_array_module(*arrays: Any) -> ModuleType:
    """numpy, or cupy when any argument is a cupy array."""
    for a in arrays:
        if is_device_array(a):
            import cupy

            return cupy
    return np


_GPU_REASON: list[str | None] = []


def gpu_unavailable() -> str | None:
    """None when CuPy is installed and sees at least one CUDA device; otherwise why not, in
    words a user can act on (GPU tests skip with this reason)."""
    if not _GPU_REASON:
        try:
            import cupy
        except ImportError:
            _GPU_REASON.append("CuPy is not installed (pip install 'purine-caffe[gpu]')")
        else:
            try:
                n = cupy.cuda.runtime.getDeviceCount()
            except Exception as e:  # no driver, or a driver older than CuPy's CUDA
                _GPU_REASON.append(f"no usable CUDA GPU ({type(e).__name__}: {e})")
            else:
                _GPU_REASON.append(None if n > 0 else "no CUDA GPU on this machine")
    return _GPU_REASON[0]


def gpu_count() -> int:
    if gpu_unavailable() is not None:
        return 0
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def gpu_device_properties(index: int) -> dict[str, Any]:
    """What ``device_query`` prints of one GPU, in Caffe's terms."""
    import cupy

    p = cupy.cuda.runtime.getDeviceProperties(index)
    name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
    return {
        "Device id:": index,
        "Name:": name,
        "Major revision number:": p["major"],
        "Minor revision number:": p["minor"],
        "Total global memory:": p["totalGlobalMem"],
        "Number of multiprocessors:": p["multiProcessorCount"],
        "Clock rate:": p.get("clockRate", "n/a"),
        "Concurrent copy and execution:": "Yes" if p.get("asyncEngineCount", 0) else "No",
    }


def set_tf32(on: bool) -> None:
    """TF32 tensor cores for float32 matrix products on GPUs (CuPy's matmul through cuBLAS):
    about 8x the FP32 rate on Hopper, with inputs rounded to 10 mantissa bits (relative
    error ~1e-3 per product instead of ~1e-7). Off unless asked for."""
    if gpu_unavailable() is not None:
        return
    from cupy._core import _routines_linalg as linalg

    linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32 if on
                            else linalg.COMPUTE_TYPE_DEFAULT)


def is_device_array(a: Any) -> bool:
    """Whether ``a`` is a CuPy array. A numpy array is answered by a type identity check:
    reading a builtin type's ``__module__`` costs a few times more, on every op call."""
    t = type(a)
    return t is not np.ndarray and t.__module__.startswith("cupy")


F = TypeVar("F", bound=Callable[..., Any])


def device_variant(device_body: Callable[..., Any]) -> Callable[[F], F]:
    """Decorate an op's host body with its device body: the op runs ``device_body`` when its
    first argument is a GPU array and the host body otherwise, with the same arguments. The
    first argument decides because all of an op's arrays live where the op runs. The host
    path pays one call and one type check (``is_device_array``, looked up at each call, so
    that a test may count numpy arrays as device arrays to run device bodies on the CPU)."""

    def decorate(host_body: F) -> F:
        @functools.wraps(host_body)
        def op(*args: Any, **kwargs: Any) -> Any:
            if is_device_array(args[0]):
                return device_body(*args, **kwargs)
            return host_body(*args, **kwargs)

        return op  # type: ignore[return-value]

    return decorate


def _scatter_add_device(target: Any, index: Any, values: Any) -> None:
    import cupyx

    cupyx.scatter_add(target, index, values)


@device_variant(_scatter_add_device)
def scatter_add(target: Any, index: Any, values: Any) -> None:
    """``target[index[i]] += values[i]`` for every i, repeated indices summed (a plain
    ``target[index] += values`` would keep only one of them)."""
    np.add.at(target, index, values)


def _stable_argsort_device(a: Any, axis: int = -1) -> Any:
    # CuPy's sort is always stable and takes no other kind than the default.
    return a.argsort(axis=axis)


@device_variant(_stable_argsort_device)
def stable_argsort(a: Any, axis: int = -1) -> Any:
    """The indices that sort ``a`` along ``axis``, equal values kept in index order."""
    return np.argsort(a, axis=axis, kind="stable")


def to_host(a: Any) -> np.ndarray:
    """A numpy array of ``a``'s values (a copy when ``a`` lives on a GPU; this waits for
    the GPU work that writes it)."""
    if is_device_array(a):
        return a.get()
    return np.asarray(a)


def assign(dst: Any, value: Any) -> None:
    """``dst[...] = value`` wherever ``dst`` lives; ``value`` may be a host array, a device
    array or a scalar."""
    if is_device_array(dst) and not is_device_array(value):
        import cupy

        value = np.asarray(value, dtype=dst.dtype)
        with dst.device:
            if value.shape == dst.shape and dst.flags.c_contiguous:
                # ordered on the current stream (a Copy op's); from pageable host memory
                # the call returns once the host array has been read
                # (np.asarray, not np.ascontiguousarray: that makes a 0-d value 1-d)
                dst.set(np.asarray(value, order="C"), stream=cupy.cuda.get_current_stream())
                return
            value = cupy.asarray(value)
    dst[...] = value


# -- GPU streams and events ---------------------------------------------------------------
# Each GPU location (device index, thread) is one CUDA stream. The streams are "blocking"
# ones (CuPy's default): work issued on the legacy default stream, as the main thread's
# reads of a loss are, waits for them, so a host read never sees a value still being written.

_STREAMS: dict[tuple[int, int], Any] = {}
_STREAMS_LOCK = threading.Lock()
_CURRENT = threading.local()


def stream(location: Location) -> Any:
    """The CUDA stream of a GPU location, made on first use."""
    key = (location.index, location.thread)
    s = _STREAMS.get(key)
    if s is None:
        import cupy

        with _STREAMS_LOCK:
            s = _STREAMS.get(key)
            if s is None:
                with cupy.cuda.Device(location.index):
                    s = _STREAMS[key] = cupy.cuda.Stream()
    return s


def activate(location: Location) -> None:
    """Make ``location``'s device and stream current in the calling thread (CuPy keeps both
    per thread), so that kernels launched here run on that stream. Cheap when already so."""
    if location.device != "gpu" or getattr(_CURRENT, "location", None) == location:
        return
    import cupy

    cupy.cuda.Device(location.index).use()
    stream(location).use()
    _CURRENT.location = location


def record(location: Location) -> Any:
    """An event marking the work issued so far on ``location``'s stream."""
    import cupy

    with cupy.cuda.Device(location.index):
        e = cupy.cuda.Event(block=False, disable_timing=True)
        e.record(stream(location))
    return e


def wait(location: Location, event: Any) -> None:
    """Order ``location`` after ``event``: a GPU stream waits on the device, the host (a CPU
    location) blocks until the event has happened."""
    if location.device == "gpu":
        stream(location).wait_event(event)
    else:
        event.synchronize()


def synchronize(location: Location | None = None) -> None:
    """Wait until the GPU work issued for ``location``'s device (every device if None) is
    done; nothing to wait for on a CPU location."""
    if location is not None and location.device != "gpu":
        return
    if gpu_unavailable() is not None:
        return
    import cupy

    indices = [location.index] if location is not None else range(gpu_count())
    for i in indices:
        cupy.cuda.Device(i).synchronize()


def copy_array(src: Any, dst: Any) -> None:
    """The Copy op's kernel: ``dst[...] = src`` between any two memory spaces. Host to
    device and device to device run on the current stream (the Copy op's location); device
    to host blocks until the value has arrived, since a host op will read it next."""
    src_dev, dst_dev = is_device_array(src), is_device_array(dst)
    if not src_dev and not dst_dev:
        dst[...] = src
    elif not src_dev:
        assign(dst, src)
    elif not dst_dev:
        with src.device:
            if dst.flags.c_contiguous and src.flags.c_contiguous:
                src.get(out=dst)
            else:
                dst[...] = src.get()
    elif src.device.id == dst.device.id:
        dst[...] = src
    else:  # between devices: a peer copy on the current stream
        import cupy

        if not (src.flags.c_contiguous and dst.flags.c_contiguous):
            raise PurineError("a copy between GPUs needs contiguous arrays")
        dst.data.copy_from_device_async(src.data, src.nbytes,
                                        cupy.cuda.get_current_stream())


def allocate(location: Location, shape: tuple[int, ...], dtype: str) -> Any:
    xp = array_module(location)
    if location.device == "gpu":
        with xp.cuda.Device(location.index):
            return xp.zeros(shape, dtype=dtype)
    return xp.zeros(shape, dtype=dtype)


@dataclass(frozen=True)
class StreamPart:
    """Part ``index`` of ``count`` equal parts along ``axis`` of a layer's draws: what a
    tower (channels) or a replica (batch rows) of a rewritten layer holds of the layer."""

    axis: int
    index: int
    count: int


# Skipping over the draws between two runs of a part costs a Python call (about 2.5 us, as
# much as drawing some 800 doubles): below this gap the runs and gaps are drawn together.
SKIP_GAP = 1024


class RandomStream:
    """The random numbers of one op: its n-th draw comes from a generator seeded with
    (seed, key, n). The draw count is all the state there is, so a resumed run that restores
    it continues the stream exactly, whatever order ops ran in.

    A stream with a ``part`` belongs to a tower or replica of a layer: ``uniform`` gives
    exactly its part of what the whole layer's stream (the same seed and key) draws, so the
    split net draws the unsplit net's numbers."""

    def __init__(self, seed: int, key: int, part: StreamPart | None = None):
        self.seed, self.key, self.count, self.part = seed, key, 0, part

    def next(self) -> np.random.Generator:
        """The next draw's generator. A part's is its own (the parts of a layer whose op
        draws through ``next`` draw independently, not the whole layer's numbers)."""
        own = [] if self.part is None or self.part.count == 1 else \
            [self.part.axis, self.part.index, self.part.count]
        g = np.random.default_rng([self.seed, self.key, self.count, *own])
        self.count += 1
        return g

    def uniform(self, shape: tuple[int, ...]) -> np.ndarray:
        """The next draw as float64 uniforms in [0, 1) of ``shape`` (C order): the whole
        layer's ``next().random(shape)``, or for a part the part's elements of the whole
        layer's draw (whose shape is ``shape`` with the part's axis ``count`` times longer)."""
        g = np.random.default_rng([self.seed, self.key, self.count])  # the whole layer's
        self.count += 1
        if self.part is None or self.part.count == 1:
            return g.random(shape)
        return _part_uniform(g, tuple(int(d) for d in shape), self.part)

    def state(self) -> dict:
        return {"count": self.count}

    def restore(self, state: dict) -> None:
        count = int(state["count"])
        if count < 0:  # the generator's seed sequence takes no negative entry
            raise ValueError(f"count {count} is below 0")
        self.count = count


def stream_key(index: int, n: int) -> int:
    """The key of the ``n``-th random stream of the layer at ``index`` in its net (after
    Caffe's Split layers are inserted; purine.caffe.layer.LayerBuild.random_stream): with
    the net's seed it names the stream's draws."""
    return 1_000_003 * (index + 1) + n


def random_stream_key(state_key: str) -> tuple[str, int] | None:
    """(layer name, n) of the state key a net registers its layers' random streams under
    (``<layer>/random#<n>``), else None."""
    layer, _, tail = state_key.rpartition("/random#")
    return (layer, int(tail)) if layer and tail.isdecimal() else None


def _part_uniform(g: np.random.Generator, shape: tuple[int, ...], part: StreamPart
                  ) -> np.ndarray:
    """Part ``part`` of ``g.random(whole)``, drawing only what it must: each double is one
    64-bit output of the PCG64 generator, so skipping k of them is ``advance(k)``. The part
    is ``runs`` contiguous runs of ``run`` elements, ``stride`` apart in the whole draw."""
    if not 0 <= part.axis < len(shape):
        raise PurineError(f"a stream part along axis {part.axis} of a draw of shape {shape}")
    inner = int(np.prod(shape[part.axis + 1:], dtype=np.int64))
    runs = int(np.prod(shape[:part.axis], dtype=np.int64))
    run = shape[part.axis] * inner
    stride = run * part.count
    bits = g.bit_generator
    bits.advance(part.index * run)
    if runs == 1:  # a replica's rows: one run
        return g.random(shape)
    if stride - run < SKIP_GAP:  # short gaps: draw runs and gaps, keep the runs
        return np.ascontiguousarray(g.random((runs, stride))[:, :run]).reshape(shape)
    out = np.empty((runs, run))
    for i in range(runs):  # one call per run (a batch row), skipping the other parts
        if i:
            bits.advance(stride - run)
        g.random(out=out[i])
    return out.reshape(shape)


_HOST_POOL: ThreadPoolExecutor | None = None
HOST_WORKERS = os.cpu_count() or 1
PARALLEL_MIN_WORK = 1 << 16


def host_parallel(fn: Callable[[slice], None], n: int, work: int = 1 << 30) -> None:
    """Run ``fn`` over slices of ``range(n)`` (the batch) on the host's cores: numpy's
    memory-bound loops (pooling, copies) are single-threaded but release the GIL, and a
    slice small enough to stay in cache is faster even alone. Each slice writes its own
    samples with the same arithmetic, so the result does not depend on the split. Below
    PARALLEL_MIN_WORK elements of ``work`` the hand-off costs more than it saves."""
    global _HOST_POOL
    if n < 2 or work < PARALLEL_MIN_WORK:
        fn(slice(0, n))
        return
    parts = min(n, 2 * HOST_WORKERS)
    step = -(-n // parts)
    slices = [slice(i, min(i + step, n)) for i in range(0, n, step)]
    if HOST_WORKERS == 1:
        for s in slices:
            fn(s)
        return
    if _HOST_POOL is None:
        _HOST_POOL = ThreadPoolExecutor(HOST_WORKERS, thread_name_prefix="purine-host")
    for f in [_HOST_POOL.submit(fn, s) for s in slices]:
        f.result()


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS single-threaded for a while: N replicas calling a multi-threaded BLAS at once
    oversubscribe the cores (OpenBLAS's spinning threads made 2 LeNet replicas on 2 cores
    about 6x slower). threadpoolctl when it is installed, else numpy's OpenBLAS found among
    the loaded libraries; otherwise nothing changes."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass
    else:
        with threadpool_limits(1, user_api="blas"):
            yield
        return
    before = set_blas_threads(1)
    try:
        yield
    finally:
        if before is not None:
            set_blas_threads(before)


def set_blas_threads(n: int) -> int | None:
    """Let numpy's OpenBLAS use ``n`` threads from now on; the count it had, or None where
    no OpenBLAS is found (then nothing changes)."""
    get_set = _openblas_threads()
    if get_set is None:
        return None
    get, set_ = get_set
    before = int(get())
    set_(n)
    return before


@functools.cache  # numpy (imported above) has loaded its OpenBLAS: the answer cannot change
def _openblas_threads():
    """OpenBLAS's (get_num_threads, set_num_threads) from the libraries this process has
    loaded (Linux's /proc/self/maps), under any of the names numpy's builds export."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower()})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    return get, set_
    return None
