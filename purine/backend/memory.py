"""How much memory a location's memory space has: the host's RAM (or the container's limit,
when lower), a GPU's device memory. The runtime and the net builder refuse what cannot fit
before they allocate it, instead of failing deep inside numpy or being killed by the OS."""

from __future__ import annotations

import functools
import os

from purine.graph import Location

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",                     # cgroup v2
                  "/sys/fs/cgroup/memory/memory.limit_in_bytes")   # cgroup v1


@functools.cache  # a machine's memory does not change while a process runs
def _host_bytes() -> int | None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without these names
        total = None
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit
            limit = int(text)
            total = limit if total is None else min(total, limit)
        break
    return total


def capacity(location: Location) -> int | None:
    """Bytes of memory in ``location``'s memory space; None when it cannot be told."""
    if location.device == "gpu":
        return _device_bytes(location.index)
    return _host_bytes()


@functools.cache
def _device_bytes(index: int) -> int | None:
    try:
        import cupy

        with cupy.cuda.Device(index):
            return int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception:  # no CuPy or no such device: allocation reports it  # noqa: BLE001
        return None


def show_bytes(n: float) -> str:
    """``n`` bytes in binary units, as people read memory sizes: "12.5 TiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
