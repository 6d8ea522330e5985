#!/usr/bin/env bash
# Check that purine/formats/caffe_pb2.py works with the oldest and the newest
# supported protobuf runtimes (4.21.12 and the latest 7.x), each with both the
# default (upb) backend and the pure-Python backend.
#
# For each runtime a throwaway venv gets only protobuf + pytest, and
# tests/formats/test_proto.py runs with PYTHONPATH set to the repo root (purine is
# not installed, so nothing beyond caffe_pb2's own imports is required).
# grpcio-tools is deliberately absent there, so the staleness test skips.
#
# Usage: bash tests/protobuf_compat.sh        (PYTHON=python3.X to pick the interpreter)
# Exits non-zero if any run fails.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
RUNTIMES=("protobuf==4.21.12" "protobuf>=7,<8")

WORK="$(mktemp -d "${TMPDIR:-/tmp}/purine-protobuf-compat.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

failed=()
i=0
for spec in "${RUNTIMES[@]}"; do
    i=$((i + 1))
    venv="$WORK/venv$i"
    echo "=== $spec: creating venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "$spec" pytest
    version="$("$venv/bin/python" -c 'import google.protobuf as p; print(p.__version__)')"
    for impl in default python; do
        if [ "$impl" = python ]; then
            impl_env=(PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python)
        else
            impl_env=(-u PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION)
        fi
        backend="$(env "${impl_env[@]}" "$venv/bin/python" -c \
            'from google.protobuf.internal import api_implementation as a; print(a.Type())')"
        echo "=== protobuf $version, $impl backend ($backend)"
        if (cd "$REPO_ROOT" && env "${impl_env[@]}" PYTHONPATH="$REPO_ROOT" \
                PYTHONDONTWRITEBYTECODE=1 \
                "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --noconftest \
                -o addopts="" tests/formats/test_proto.py); then
            :
        else
            failed+=("protobuf $version ($impl backend)")
        fi
    done
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "protobuf compatibility FAILED for: ${failed[*]}" >&2
    exit 1
fi
echo "protobuf compatibility OK (${RUNTIMES[*]})"
