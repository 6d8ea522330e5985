"""What the GPU tests share: the skip reason when this machine has no usable GPU."""

from __future__ import annotations

import pytest

from purine.backend import gpu_unavailable
from purine.graph import Location

REASON = gpu_unavailable()
requires_gpu = pytest.mark.skipif(REASON is not None, reason=f"needs a CUDA GPU: {REASON}")
GPU0 = Location("gpu", 0)
