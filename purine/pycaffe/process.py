"""pycaffe's process-wide functions beyond the mode: glog's ``init_log`` and ``log``,
``Timer``, the multi-process solver count and rank, and ``NCCL`` / ``has_nccl`` as a Caffe
built without NCCL has them (several GPUs train through purine's own data parallelism)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from purine.errors import PurineError
from purine.log import GLOG_LEVELS, get_logger


def init_log(level: int = 0, stderr: bool = True) -> None:
    """Caffe's ``caffe.init_log([level[, stderr]])``: log lines of severity ``level`` and
    above (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL), in glog's format, on stderr. Purine's lines
    always go to stderr; ``stderr=False`` (Caffe: pipe to a log file only) silences them."""
    if level not in GLOG_LEVELS:
        raise ValueError(f"caffe.init_log: level must be 0 (INFO) to 3 (FATAL), got {level!r}")
    log = get_logger()
    log.setLevel(GLOG_LEVELS[level] if stderr else logging.CRITICAL + 1)


def log(message: str) -> None:
    """Caffe's ``caffe.log(msg)``: one INFO line in glog's format."""
    get_logger().info("%s", message)


class Timer:
    """Caffe's ``caffe.Timer``: ``start()``, ``stop()``, and ``ms``, the milliseconds from
    the last start to the last stop (a running timer is stopped first, as Caffe's)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._stop: float | None = None

    def start(self) -> None:
        self._start, self._stop = time.perf_counter(), None

    def stop(self) -> None:
        if self._start is not None and self._stop is None:
            self._stop = time.perf_counter()

    @property
    def ms(self) -> float:
        if self._start is None:
            return 0.0
        self.stop()
        return (self._stop - self._start) * 1e3  # type: ignore[operator]


@dataclass
class _Solvers:
    count: int = 1
    rank: int = 0
    multiprocess: bool = False


solvers = _Solvers()


def solver_count() -> int:
    return solvers.count


def set_solver_count(count: int) -> None:
    """How many solvers train together (Caffe's multi-GPU bookkeeping); purine's own
    replicas (``caffe.SGDSolver(path, replicas=n)``) do not need it."""
    if int(count) < 1:
        raise ValueError(f"caffe.set_solver_count: need a count >= 1, got {count!r}")
    solvers.count = int(count)


def solver_rank() -> int:
    return solvers.rank


def set_solver_rank(rank: int) -> None:
    if int(rank) < 0:
        raise ValueError(f"caffe.set_solver_rank: need a rank >= 0, got {rank!r}")
    solvers.rank = int(rank)


def set_multiprocess(multiprocess: bool) -> None:
    solvers.multiprocess = bool(multiprocess)


def has_nccl() -> bool:
    """False: purine's pycaffe is a Caffe built without NCCL. Several GPUs train through
    ``purine-caffe train --gpu 0,1`` or ``caffe.SGDSolver(path, replicas=2,
    replica_locations=...)`` instead of BVLC's python/train.py processes."""
    return False


class NCCLUnavailable(PurineError):
    """``caffe.NCCL`` asked of a build without it."""


_NO_NCCL = ("caffe.NCCL: this pycaffe (purine-caffe) has no NCCL solver hooks, as a Caffe "
            "built without USE_NCCL (caffe.has_nccl() is False); train on several GPUs with "
            "`purine-caffe train --gpu 0,1` or caffe.SGDSolver(path, replicas=N)")


class NCCL:
    """Caffe's ``caffe.NCCL(solver, uid)``; as in a Caffe built without NCCL, making one (or
    a uid) is an error that says what to use instead."""

    def __init__(self, solver: object = None, uid: object = None) -> None:  # noqa: ARG002
        raise NCCLUnavailable(_NO_NCCL)

    @staticmethod
    def new_uid() -> bytes:
        raise NCCLUnavailable(_NO_NCCL)
