"""Source-model loading (transformers) and trtpaged's own step models."""

from __future__ import annotations

from trtpaged.models.dims import SUPPORTED_ARCHITECTURES, UnsupportedModelError, dims_from_hf_config
from trtpaged.models.hf import HFModel, load_hf, source_architecture, spec_from_manifest
from trtpaged.models.llama import LlamaStepModel
from trtpaged.models.loading import TORCH_DTYPES, hf_state_dict, load_step_model, step_model_from_hf

__all__ = [
    "HFModel",
    "LlamaStepModel",
    "SUPPORTED_ARCHITECTURES",
    "TORCH_DTYPES",
    "UnsupportedModelError",
    "dims_from_hf_config",
    "hf_state_dict",
    "load_hf",
    "load_step_model",
    "source_architecture",
    "spec_from_manifest",
    "step_model_from_hf",
]
