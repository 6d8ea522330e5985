#!/bin/bash
# The GPU checks of one lent session, in one command (docs/gpus.md): the GPU tests, then the
# GPU bench, each under its own time limit, logs under $OUT (or ./gpu-out). Usage:
#   bash bench/gpu_session.sh [TEST_SECONDS] [BENCH_SECONDS] [PYTEST_ARGS...]
# Packages the machine lacks travel as wheels in .whl/ (lmdb, for the Data layer and its tests).
T_TESTS=${1:-240}; T_BENCH=${2:-200}; shift 2 2>/dev/null
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import cupy, numpy, google.protobuf as p; print("cupy", cupy.__version__, "numpy", numpy.__version__, "protobuf", p.__version__); print(cupy.cuda.runtime.getDeviceCount(), "GPU(s)")'
  nproc
} 2>&1 | tee "$OUT/env.txt"
timeout -k 5 "$T_TESTS" python3 -m pytest -q -rs -p no:cacheprovider --timeout 120 \
  --durations 15 tests/gpu "$@" 2>&1 | tee "$OUT/tests.txt" | tail -n 120
echo "tests rc=${PIPESTATUS[0]}"
timeout -k 5 "$T_BENCH" python3 bench/gpu_nets.py --iterations 10 --warmup 3 --timeout 90 \
  --nets lenet,cifar10_quick,alexnet,alexnet_lmdb --workdir /tmp/gpu-bench 2>&1 \
  | tee "$OUT/bench.txt"
echo "bench rc=${PIPESTATUS[0]}"
