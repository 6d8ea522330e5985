"""pycaffe's process-wide settings: CPU/GPU mode, the device, and the random seed that
nets and solvers made afterwards start from (Caffe's ``Caffe::set_random_seed``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from purine.backend import gpu_count, gpu_unavailable
from purine.graph import CPU, Location


@dataclass
class Settings:
    mode: str = "cpu"
    device: int = 0
    seed: int | None = None  # None: nets take seed 0, solvers their random_seed


settings = Settings()


def set_mode_cpu() -> None:
    settings.mode = "cpu"


def set_mode_gpu() -> None:
    """Nets and solvers made afterwards run on GPU ``set_device``'s index (0 unless set).
    Without a usable GPU (no CuPy, no CUDA device) this warns, saying why, and they run on
    the CPU, so that a script timing itself is not misled."""
    settings.mode = "gpu"
    why = gpu_unavailable()
    if why is not None:
        warnings.warn(f"purine.pycaffe.set_mode_gpu: no GPU backend available: {why}; nets "
                      "and solvers run on the CPU", RuntimeWarning, stacklevel=2)


def set_device(device: int) -> None:
    """The GPU index that GPU mode uses (Caffe::SetDevice), checked against the GPUs
    present when there are any."""
    device = int(device)
    if device < 0:
        raise ValueError(f"set_device: device index must be >= 0, got {device}")
    if gpu_unavailable() is None and device >= (n := gpu_count()):
        raise ValueError(f"set_device: no GPU {device}; this machine has {n} "
                         f"(indices 0 to {n - 1})")
    settings.device = device


def location() -> Location:
    """Where a net or solver made now runs: in GPU mode with a usable GPU, GPU
    ``settings.device``; otherwise the CPU."""
    if settings.mode == "gpu" and gpu_unavailable() is None:
        return Location("gpu", settings.device)
    return CPU


def set_random_seed(seed: int) -> None:
    """The seed of the nets made afterwards (their fillers and random layers) and of the
    solvers whose prototxt leaves random_seed unset."""
    settings.seed = int(seed)
