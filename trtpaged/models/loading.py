"""Building step models from HF models and from engine dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from trtpaged.manifest import Manifest, ModelDims, read_manifest
from trtpaged.models.all_reduce import RankReduce
from trtpaged.models.llama import LlamaStepModel, QuantPlan, Rotary
from trtpaged.models.tensor_parallel import shard_dims, shard_plan
from trtpaged.models.qlinear import set_activations

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# step-model module -> the HF modules stacked along its outputs, in order
FUSED_MODULES = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def hf_module_names(dims: ModelDims) -> dict[str, tuple[str, ...]]:
    """Every linear module of the step model -> the HF module names (without `model.`) it is made of."""
    out: dict[str, tuple[str, ...]] = {}
    for i in range(dims.num_layers):
        prefix = f"layers.{i}."
        for fused, parts in FUSED_MODULES.items():
            out[prefix + fused] = tuple(prefix + p for p in parts)
        out[prefix + "self_attn.o_proj"] = (prefix + "self_attn.o_proj",)
        out[prefix + "mlp.down_proj"] = (prefix + "mlp.down_proj",)
    return out


def hf_state_dict(hf_model: Any, dims: ModelDims) -> dict[str, torch.Tensor]:
    """The HF model's weights under the step model's names: prefix `model.` dropped, tied head dropped,
    q/k/v and gate/up stacked into the fused modules."""
    hf = {}
    for name, tensor in hf_model.state_dict().items():
        if "rotary_emb" in name or (dims.tie_word_embeddings and name == "lm_head.weight"):
            continue
        hf[name.removeprefix("model.")] = tensor
    for module, parts in hf_module_names(dims).items():
        if len(parts) == 1:
            continue
        for kind in ("weight", "bias"):
            if f"{parts[0]}.{kind}" in hf:
                hf[f"{module}.{kind}"] = torch.cat([hf.pop(f"{p}.{kind}") for p in parts])
    return hf


def step_model_from_hf(hf_model: Any, dims: ModelDims, dtype: torch.dtype = torch.float32) -> LlamaStepModel:
    """A LlamaStepModel carrying the HF model's weights (cast to dtype)."""
    state = {k: v.detach().to(dtype) for k, v in hf_state_dict(hf_model, dims).items()}
    return with_weights(dims, dtype, state, "cpu")


def with_weights(dims: ModelDims, dtype: torch.dtype, state: dict[str, torch.Tensor], device,
                 quant: Optional[QuantPlan] = None, reduce: Optional[RankReduce] = None) -> LlamaStepModel:
    """Builds the model on the meta device (no random init) and adopts `state` as its parameters and buffers.

    `reduce`: one tensor-parallel rank's all-reduce (dims, state and plan are then that rank's)."""
    with torch.device("meta"):
        model = LlamaStepModel(dims, dtype, quant=quant, reduce=reduce)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(dims).to(device)  # non-persistent buffers are not in the state dict
    return model.eval()


def load_step_model(engine_dir: str | Path, device: str | torch.device = "cpu",
                    reduce: Optional[RankReduce] = None) -> tuple[LlamaStepModel, Manifest]:
    """Reads `trtpaged.json` and the weights file of an engine dir; returns (eager step model, manifest).

    A tensor-parallel engine (manifest.tensor_parallel > 1) needs `reduce`, whose rank picks the shard."""
    from safetensors.torch import load_file

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    n = manifest.tensor_parallel
    if (reduce.world_size if reduce is not None else 1) != n:
        got = reduce.world_size if reduce is not None else 1
        raise ValueError(f"tensor_parallel: {engine_dir} is split over {n} ranks; got {got} "
                         f"(use LLM(..., tensor_parallel={n}) or serve --tensor-parallel-size {n})")
    rank = reduce.rank if reduce is not None else 0
    weights_file = manifest.rank_files(rank)["weights_file"]
    weights = engine_dir / weights_file
    if not weights.is_file():
        raise FileNotFoundError(f"{engine_dir}: weights_file {weights_file!r} is missing; rebuild the engine")
    state = load_file(str(weights), device=str(device))
    plan = {name: (int(bits), int(group)) for name, (bits, group) in manifest.quantization.get("modules", {}).items()}
    plan = shard_plan(plan, manifest.dims, n)
    model = with_weights(shard_dims(manifest.dims, n), TORCH_DTYPES[manifest.dtype], state, device, plan,
                         reduce if n > 1 else None)
    if plan:
        set_activations(model, manifest.quantization.get("activations", "int8"))
    return model, manifest
