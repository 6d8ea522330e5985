"""Gradient reduction between GPUs through NCCL (cupy.cuda.nccl): the GPUs of one process,
or the GPUs of every MPI rank in one communicator.

Each replica on its own GPU gets one collective op per parameter, at a communication stream
of its GPU: the op is ready as soon as that replica's gradient is, so the reductions overlap
the rest of the backward pass. NCCL needs every GPU to issue the same collectives in the
same order; the ops of one GPU are chained through a token blob in the order the backward
pass finishes the gradients, which is the same on every replica and every rank (each rank
builds the same graph).

In one process the communicators come from ``NcclCommunicator.initAll`` and each parameter
is reduced to the first GPU, where the update runs. Across R MPI ranks of G GPUs each, the
GPU j of rank k is NCCL rank ``k*G + j`` of one communicator of R*G GPUs: rank 0 makes the
unique id, MPI broadcasts it, and each rank joins with ``NcclCommunicator(R*G, id, k*G + j)``
per GPU inside ``groupStart``/``groupEnd``. Every rank updates its own weights on its first
GPU, so every rank needs the mean there: each parameter is all-reduced over all R*G GPUs
(a sum, then the first GPU of each rank scales it). One flat all-reduce rather than a reduce
within each rank followed by an all-reduce among the ranks' first GPUs: it is one collective
per parameter instead of two in sequence, and NCCL lays its rings and trees over NVLink and
the network itself, which a two-level scheme would do by hand."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from purine.errors import PurineError

NCCL_HINT = "pip install nvidia-nccl-cu13 (or the cu12 package matching your CuPy)"


class CupyCalls:
    """The few CuPy calls NCCL needs, in one place (tests put a recording stand-in here)."""

    def nccl(self) -> Any:
        """The ``cupy.cuda.nccl`` module, or an error saying how to get it."""
        from cupy.cuda import nccl

        if not nccl.available:
            raise PurineError(f"several GPUs need NCCL, which CuPy cannot load: {NCCL_HINT}")
        return nccl

    def device(self, index: int) -> AbstractContextManager:
        import cupy

        return cupy.cuda.Device(index)

    def stream(self) -> int:
        """The current stream's handle: the stream of the op that runs."""
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def gpu_id(self, index: int) -> str:
        """Which physical GPU ``index`` is, unique across machines: host and PCI bus id
        (device indices differ between ranks when CUDA_VISIBLE_DEVICES does)."""
        import cupy

        return f"{socket.gethostname()}/{cupy.cuda.runtime.deviceGetPCIBusId(index)}"


CUDA = CupyCalls()


class NcclGroup:
    """The communicators of this process's GPUs ``devices`` (local GPU j is ``devices[j]``).
    With ``comm`` (an mpi4py communicator of several ranks) the group spans every rank's
    GPUs: constructing it is collective (every rank at the same point, on the main thread).
    The communicators are made on first use, by whichever local GPU's op runs first."""

    def __init__(self, devices: Sequence[int], comm: Any = None):
        if len(set(devices)) != len(devices):
            raise PurineError(f"NCCL needs distinct GPUs, got {list(devices)}")
        self.devices = list(devices)
        self.first, self.size = 0, len(self.devices)  # NCCL rank of devices[0]; GPUs in all
        self.uid: tuple | None = None  # the unique id, across ranks only
        self._comms: list[Any] | None = None
        self._lock = threading.Lock()
        if comm is not None and comm.size > 1:
            self._join(comm)

    @property
    def across_ranks(self) -> bool:
        return self.uid is not None

    def _join(self, comm: Any) -> None:
        """Check that the ranks' GPUs make one valid communicator, then share rank 0's id."""
        nccl = CUDA.nccl()  # on every rank before any collective: all fail alike
        everyone = comm.allgather([CUDA.gpu_id(d) for d in self.devices])
        counts = [len(ids) for ids in everyone]
        differ = [k for k, n in enumerate(counts) if n != counts[0]]
        if differ:
            raise PurineError("NCCL across MPI ranks needs the same number of GPUs on every "
                              f"rank: rank 0 has {counts[0]}, " +
                              ", ".join(f"rank {k} has {counts[k]}" for k in differ))
        owner: dict[str, tuple[int, int]] = {}
        for k, ids in enumerate(everyone):
            for j, gpu in enumerate(ids):
                if gpu in owner:
                    raise PurineError(f"NCCL cannot share a GPU between ranks: {gpu} is local "
                                      f"GPU {owner[gpu][1]} of rank {owner[gpu][0]} and GPU "
                                      f"{j} of rank {k}; give each rank its own (--gpu local)")
                owner[gpu] = (k, j)
        g = len(self.devices)
        self.first, self.size = comm.rank * g, comm.size * g
        self.uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None, root=0)

    def comm(self, local: int) -> Any:
        """The communicator of local GPU ``local``."""
        with self._lock:
            if self._comms is None:
                self._comms = self._make()
        return self._comms[local]

    def _make(self) -> list[Any]:
        nccl = CUDA.nccl()
        if self.uid is None:
            return nccl.NcclCommunicator.initAll(self.devices)
        # One process joins for several GPUs: the inits wait for each other, so they go in
        # one group; each is made on its own device.
        comms = []
        nccl.groupStart()
        try:
            for j, device in enumerate(self.devices):
                with CUDA.device(device):
                    comms.append(nccl.NcclCommunicator(self.size, self.uid, self.first + j))
        finally:
            nccl.groupEnd()
        return comms


def _address(a: Any) -> int:
    """The address of an array's first element (a CuPy array's device pointer)."""
    face = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return face["data"][0]


def _datatype(nccl: Any, grad: Any) -> int:
    types = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}
    if grad.dtype.name not in types:
        raise PurineError(f"NCCL reduce of {grad.dtype} gradients is not supported")
    return types[grad.dtype.name]


def nccl_reduce_mean(grad: Any, token: Any, grad_out: Any, token_out: Any,  # noqa: ARG001
                     *, group: NcclGroup, local: int) -> None:
    """One process: sum ``grad`` over the group's GPUs into GPU 0's (in place), which then
    divides by the number of GPUs: the mean, as Caffe's data parallelism averages. The
    other GPUs' gradients are left as they were."""
    nccl = CUDA.nccl()
    group.comm(local).reduce(_address(grad), _address(grad), grad.size, _datatype(nccl, grad),
                             nccl.NCCL_SUM, 0, CUDA.stream())
    if local == 0:
        grad *= 1.0 / len(group.devices)


def nccl_all_reduce_mean(grad: Any, token: Any, grad_out: Any, token_out: Any, *,  # noqa: ARG001
                         group: NcclGroup, local: int) -> None:
    """Across ranks: sum ``grad`` over every rank's GPUs, in place on each; the first GPU
    of the rank divides by their number (its update reads the mean; the other GPUs' sums
    are not read). The division follows the sum on the op's stream."""
    nccl = CUDA.nccl()
    group.comm(local).allReduce(_address(grad), _address(grad), grad.size,
                                _datatype(nccl, grad), nccl.NCCL_SUM, CUDA.stream())
    if local == 0:
        grad *= 1.0 / group.size
