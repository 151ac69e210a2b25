"""Building step models from HF models and from engine dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trtpaged.manifest import Manifest, ModelDims, read_manifest
from trtpaged.models.llama import LlamaStepModel, Rotary

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def hf_state_dict(hf_model: Any, dims: ModelDims) -> dict[str, torch.Tensor]:
    """The HF model's weights under the step model's names (prefix `model.` dropped, tied head dropped)."""
    out = {}
    for name, tensor in hf_model.state_dict().items():
        if "rotary_emb" in name or (dims.tie_word_embeddings and name == "lm_head.weight"):
            continue
        out[name.removeprefix("model.")] = tensor
    return out


def step_model_from_hf(hf_model: Any, dims: ModelDims, dtype: torch.dtype = torch.float32) -> LlamaStepModel:
    """A LlamaStepModel carrying the HF model's weights (cast to dtype)."""
    state = {k: v.detach().to(dtype) for k, v in hf_state_dict(hf_model, dims).items()}
    return _with_weights(dims, dtype, state, "cpu")


def _with_weights(dims: ModelDims, dtype: torch.dtype, state: dict[str, torch.Tensor], device) -> LlamaStepModel:
    """Builds the model on the meta device (no random init) and adopts `state` as its parameters."""
    with torch.device("meta"):
        model = LlamaStepModel(dims, dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(dims).to(device)  # non-persistent buffers are not in the state dict
    return model.eval()


def load_step_model(engine_dir: str | Path, device: str | torch.device = "cpu") -> tuple[LlamaStepModel, Manifest]:
    """Reads `trtpaged.json` and the weights file of an engine dir; returns (eager step model, manifest)."""
    from safetensors.torch import load_file

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    weights = engine_dir / manifest.weights_file
    if not weights.is_file():
        raise FileNotFoundError(f"{engine_dir}: weights_file {manifest.weights_file!r} is missing; rebuild the engine")
    state = load_file(str(weights), device=str(device))
    return _with_weights(manifest.dims, TORCH_DTYPES[manifest.dtype], state, device), manifest
