"""trtpaged: a compiled paged-attention engine builder and runtime for Hugging Face causal LMs."""

from __future__ import annotations

import os

# OpenMP threads that finish early wait for the others. libgomp's default is to spin for a while
# first; on a busy machine (more runnable threads than cores) a spinning waiter takes the core a
# descheduled worker needs, and one step stalls for tens to hundreds of ms. Sleeping waiters avoid
# that (measured on 2 shared cores: median step 112-169 ms -> 1.4-8 ms; docs/architecture.md).
# libgomp reads this once, when it is first loaded (by torch or the kernel library), so it is set
# at package import; a value the user set wins, as does GOMP_SPINCOUNT. TRTPAGED_OMP_DEFAULT=1 keeps
# OpenMP's own default (benchmarks run baselines such as HF transformers that way, as users run them).
OMP_DEFAULT_KEEP = "TRTPAGED_OMP_DEFAULT"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ and not os.environ.get(OMP_DEFAULT_KEEP):
    os.environ["OMP_WAIT_POLICY"] = "passive"
    os.environ["TRTPAGED_SET_OMP_WAIT_POLICY"] = "1"

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Imported lazily so that `trtpaged --version` and the builder don't pay for the runtime.
    if name == "LLM":
        from trtpaged.runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from trtpaged.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'trtpaged' has no attribute {name!r}")
