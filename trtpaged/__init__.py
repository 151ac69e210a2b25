"""trtpaged: a compiled paged-attention engine builder and runtime for Hugging Face causal LMs."""

from __future__ import annotations

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
