#!/usr/bin/env bash
# Sets up trtpaged and runs the test suite (GPU- and TensorRT-marked tests skip without them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m pytest -q -ra --durations=20 "$@"
