"""purine-caffe: Caffe's nets and solvers as bi-graphs of blobs and ops (arXiv 1412.6249)."""

import os as _os

__version__ = "0.1.0"

# numpy's OpenBLAS keeps its threads spinning for 2^28 cycles after each call, waiting for
# the next; beside another busy process they take the cores that call needs. CIFAR-10 quick
# on numpy's kernels (2 cores, one busy process beside it) took 300-479 ms a pass, and
# 189-223 ms with 2^4 cycles; on a quiet machine 99-108 ms either way. OpenBLAS reads it
# when it loads: this holds where purine is imported before numpy (the command line always).
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
