"""What the GPU tests share: the skip reason when this machine has no usable GPU, and the
CPU stand-in that checks the GPU tables' own logic on a machine without one."""

from __future__ import annotations

import os

import pytest

from purine.backend import gpu_unavailable
from purine.graph import Location

REASON = gpu_unavailable()
requires_gpu = pytest.mark.skipif(REASON is not None, reason=f"needs a CUDA GPU: {REASON}")
GPU0 = Location("gpu", 0)

STAND_IN = os.environ.get("PURINE_GPU_STAND_IN") == "cpu"
"""With PURINE_GPU_STAND_IN=cpu, the table tests (each layer type against the CPU, each op
kernel against numpy) run with the CPU in the GPU's place. They then compare the CPU with
itself, so a pass shows the tables well formed (shapes, labels, indices, tolerances, the
comparison code), never that a GPU computes right; without the variable they need a GPU."""
requires_gpu_or_stand_in = pytest.mark.skipif(
    REASON is not None and not STAND_IN,
    reason=f"needs a CUDA GPU (or PURINE_GPU_STAND_IN=cpu to check the table): {REASON}")
TABLE_LOCATION = Location() if STAND_IN else GPU0
"""Where the table tests put the 'GPU' side: the CPU under the stand-in."""
