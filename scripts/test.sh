#!/usr/bin/env bash
# Sets up trtpaged and runs the test suite (GPU- and TensorRT-marked tests skip without them).
set -euo pipefail
cd "$(dirname "$0")/.."
# TRTPAGED_SETUP_DONE=1: the caller has just run setup.sh (.ci/run does, to start the Redis it installs)
if [ "${TRTPAGED_SETUP_DONE:-}" != 1 ]; then
  bash scripts/setup.sh
fi
# one pytest-xdist worker per core, at most 4 (a worker's kernels and torch use every core: more would only
# contend); whole test files go to one worker, and the workers share the engine dirs that tests/conftest.py
# builds. TRTPAGED_TEST_WORKERS=0 runs everything in this one process, without pytest-xdist (e.g. for --pdb).
cores=$(nproc 2>/dev/null || echo 1)
workers=${TRTPAGED_TEST_WORKERS:-$((cores > 4 ? 4 : cores))}
parallel=()
if [ "$workers" -gt 0 ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
exec ${PYTHON:-python3} -m pytest -q -ra --durations=20 "${parallel[@]}" "$@"
