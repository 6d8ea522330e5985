"""Gradient reduction between GPUs of one process through NCCL (cupy.cuda.nccl).

Each replica on its own GPU gets one reduce op per parameter, at a communication stream of
its GPU: the op is ready as soon as that replica's gradient is, so the reductions overlap
the rest of the backward pass. NCCL needs every GPU to issue the same collectives in the
same order; the ops of one replica are chained through a token blob in the order the
backward pass finishes the gradients, which is the same on every replica."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from purine.errors import PurineError


class NcclGroup:
    """The communicators of the GPUs ``devices`` (rank r is ``devices[r]``), made on first
    use by whichever replica's op runs first."""

    def __init__(self, devices: Sequence[int]):
        if len(set(devices)) != len(devices):
            raise PurineError(f"NCCL needs distinct GPUs, got {list(devices)}")
        self.devices = list(devices)
        self._comms: list[Any] | None = None
        self._lock = threading.Lock()

    def comm(self, rank: int) -> Any:
        with self._lock:
            if self._comms is None:
                from cupy.cuda import nccl

                if not nccl.available:
                    raise PurineError("several GPUs need NCCL, which CuPy cannot load: "
                                      "pip install nvidia-nccl-cu13 (or the cu12 package "
                                      "matching your CuPy)")
                self._comms = nccl.NcclCommunicator.initAll(self.devices)
        return self._comms[rank]


def nccl_reduce_mean(grad: Any, token: Any, grad_out: Any, token_out: Any, *, group: NcclGroup,
                     rank: int) -> None:
    """Sum ``grad`` over the group's GPUs into rank 0's (in place), which then divides by
    the number of GPUs: the mean, as Caffe's data parallelism averages. The other ranks'
    gradients are left as they were."""
    import cupy
    from cupy.cuda import nccl

    types = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}
    if grad.dtype.name not in types:
        raise PurineError(f"NCCL reduce of {grad.dtype} gradients is not supported")
    stream = cupy.cuda.get_current_stream()
    group.comm(rank).reduce(grad.data.ptr, grad.data.ptr, grad.size, types[grad.dtype.name],
                            nccl.NCCL_SUM, 0, stream.ptr)
    if rank == 0:
        grad *= 1.0 / len(group.devices)
