#!/usr/bin/env bash
# Sets up trtpaged and runs the test suite (GPU- and TensorRT-marked tests skip without them).
set -euo pipefail
cd "$(dirname "$0")/.."
# TRTPAGED_SETUP_DONE=1: the caller has just run setup.sh (.ci/run does, to start the Redis it installs)
if [ "${TRTPAGED_SETUP_DONE:-}" != 1 ]; then
  bash scripts/setup.sh
fi
exec ${PYTHON:-python3} -m pytest -q -ra --durations=20 "$@"
