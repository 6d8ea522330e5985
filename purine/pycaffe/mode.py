"""pycaffe's process-wide settings: CPU/GPU mode, the device, and the random seed that
nets and solvers made afterwards start from (Caffe's ``Caffe::set_random_seed``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass
class Settings:
    mode: str = "cpu"
    device: int = 0
    seed: int | None = None  # None: nets take seed 0, solvers their random_seed


settings = Settings()


def set_mode_cpu() -> None:
    settings.mode = "cpu"


def set_mode_gpu() -> None:
    """Record GPU mode. purine-caffe's pycaffe face has no GPU backend yet: nets still run
    on the CPU, and this warns so that a script timing itself is not misled."""
    settings.mode = "gpu"
    warnings.warn("purine.pycaffe.set_mode_gpu: no GPU backend yet; nets and solvers run "
                  "on the CPU", RuntimeWarning, stacklevel=2)


def set_device(device: int) -> None:
    """Record the GPU index that GPU mode would use (Caffe::SetDevice)."""
    device = int(device)
    if device < 0:
        raise ValueError(f"set_device: device index must be >= 0, got {device}")
    settings.device = device


def set_random_seed(seed: int) -> None:
    """The seed of the nets made afterwards (their fillers and random layers) and of the
    solvers whose prototxt leaves random_seed unset."""
    settings.seed = int(seed)
