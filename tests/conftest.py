"""Settings for the whole test suite.

The suite's numbers are the numpy kernels' (bit-exact references, strict tolerances,
threaded runs equal to sequential ones), so every test and every subprocess a test starts
runs the convolutions on numpy: ``PURINE_ONEDNN=0`` turns the optional oneDNN kernels off
unless the environment already says otherwise (set here, before any import: purine reads it
once, when ``purine.backend.onednn`` loads). ``tests/ops/test_onednn.py`` turns them on
where it compares the two.
"""

import os

os.environ.setdefault("PURINE_ONEDNN", "0")

# BVLC's own pycaffe tests, stored unchanged: tests/pycaffe/test_bvlc_pycaffe_tests.py runs
# them under `purine-caffe python`, where `import caffe` is purine's.
collect_ignore_glob = ["fixtures/*"]
