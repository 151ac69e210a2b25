"""trtpaged: a compiled paged-attention engine builder and runtime for Hugging Face causal LMs."""

from __future__ import annotations

import os

# OpenMP threads that finish early wait for the others. libgomp's default spins for up to ~300k
# iterations; on a busy machine (more runnable threads than cores) a spinning waiter takes the core a
# descheduled worker needs and a step stalls. Sleeping waiters (OMP_WAIT_POLICY=passive) avoid that,
# but wake up too slowly for the ~150 short parallel regions of a decode step on a quiet machine. A
# short bounded spin keeps the quiet-machine speed and bounds the busy-machine waste (measured on the
# SmolLM2 int4 engine, 2 cores, decode tok/s quiet / with one competing busy process: default 123 / 26,
# GOMP_SPINCOUNT=10000 125 / 15, passive 40 / 62; docs/architecture.md). libgomp reads this once, when
# it is first loaded (by torch or the kernel library), so it is set at package import; a value the user
# set wins (OMP_WAIT_POLICY=passive for a machine shared with other work), and TRTPAGED_OMP_DEFAULT=1
# keeps OpenMP's own default (benchmarks run baselines such as HF transformers that way).
OMP_DEFAULT_KEEP = "TRTPAGED_OMP_DEFAULT"
SPIN_COUNT = "10000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ and not os.environ.get(OMP_DEFAULT_KEEP):
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    os.environ["TRTPAGED_SET_GOMP_SPINCOUNT"] = "1"

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams",
           "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
# Where each public name lives (the names vLLM's scripts import from `vllm` and `vllm.sampling_params`).
_EXPORTS = {"LLM": "trtpaged.runtime.llm", "SamplingParams": "trtpaged.runtime.sampling_params",
            "StructuredOutputsParams": "trtpaged.runtime.sampling_params",
            "GuidedDecodingParams": "trtpaged.runtime.sampling_params", "BeamSearchParams": "trtpaged.runtime.beam_api",
            "RequestOutput": "trtpaged.runtime.outputs", "CompletionOutput": "trtpaged.runtime.outputs",
            "Logprob": "trtpaged.runtime.outputs"}  # fmt: skip


def __getattr__(name: str):
    # Imported lazily so that `trtpaged --version` and the builder don't pay for the runtime.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trtpaged' has no attribute {name!r}")
