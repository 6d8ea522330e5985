"""Settings for the whole test suite.

The suite's numbers are the numpy kernels' (bit-exact references, strict tolerances,
threaded runs equal to sequential ones), so every test and every subprocess a test starts
runs the convolutions on numpy: ``PURINE_ONEDNN=0`` turns the oneDNN kernels (a default
dependency on Linux x86-64) off
unless the environment already says otherwise (set here, before any import: purine reads it
once, when ``purine.backend.onednn`` loads). ``tests/ops/test_onednn.py`` turns them on
where it compares the two.
"""

import logging
import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("PURINE_ONEDNN", "0")


@pytest.fixture
def quiet_log() -> Iterator[None]:
    """purine's log at WARNING while the test runs (its nets' set-up lines by the thousand),
    its level restored after."""
    from purine.log import get_logger

    log = get_logger()
    level = log.level
    log.setLevel(logging.WARNING)
    yield
    log.setLevel(level)

# BVLC's own pycaffe tests, stored unchanged: tests/pycaffe/test_bvlc_pycaffe_tests.py runs
# them under `purine-caffe python`, where `import caffe` is purine's.
collect_ignore_glob = ["fixtures/*"]
