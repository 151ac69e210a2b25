"""The build's quantize stage: float step-model weights (+ a GGUF source's blocks) -> quantized state.

Each linear module (fused q/k/v, o, fused gate/up, down) becomes codes, scales
and offsets (trtpaged.models.quant). Where the source is a GGUF whose tensors
are already in a format the target holds exactly (Q4_0/Q4_1 in int4 group 32,
Q8_0 in int8 group 32), the blocks are carried over bit for bit, and the build
checks that their de-quantized values equal the float weights transformers
loaded; everything else is quantized from the float weights. The embedding and
the LM head are int8 (`lm_head: int8`): per row, or GGUF Q8_0 exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from trtpaged.config import QuantizationConfig
from trtpaged.manifest import ModelDims
from trtpaged.models.loading import hf_module_names
from trtpaged.models.quant import GGUF_BLOCK, GGUF_EXACT_TYPES, QuantizedWeight, concat_rows, from_gguf_blocks, quantize

# GGUF tensor name pieces -> HF module names (without `model.`)
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v
}
_GGUF_NAMES = {"token_embd": "embed_tokens", "output": "lm_head"}


@dataclass
class QuantizedState:
    """The quantized step-model state, its plan (module -> (bits, group_size)) and where each weight came from."""

    state: dict[str, torch.Tensor]
    plan: dict[str, tuple[int, int]]
    origin: dict[str, str] = field(default_factory=dict)  # module -> "gguf Q4_1 exact" | "quantized from float"

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def summary(self) -> str:
        counts = Counter(self.origin.values())
        return ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))

    def describe(self, config: QuantizationConfig) -> dict:
        return {**config.describe(), "modules": {k: list(v) for k, v in self.plan.items()},
                "weight_bytes": self.weight_bytes, "origin": dict(Counter(self.origin.values()))}


def check_dims(config: QuantizationConfig, dims: ModelDims) -> Optional[str]:
    """Why these dims cannot be quantized as configured (the kernels need inputs in multiples of 32), or None."""
    unit = config.group_size or 32
    for name, size in (("hidden_size", dims.hidden_size), ("intermediate_size", dims.intermediate_size),
                       ("num_heads * head_dim", dims.num_heads * dims.head_dim)):
        if size % unit or size % 32:
            return (f"quantization.group_size: the model's {name} {size} is not a multiple of "
                    f"{max(unit, 32)}; pick a group size that divides it or weights: none")
    return None


def _reverse_permute_rows(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation for RoPE (as transformers does on GGUF load)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def read_gguf_exact(path: Path, dims: ModelDims, model_type: str) -> dict[str, tuple[str, QuantizedWeight]]:
    """HF module name -> (GGUF type, weight) for every GGUF tensor of a type carried exactly (Q8_0, Q4_0, Q4_1)."""
    from gguf import GGUFReader

    out: dict[str, tuple[str, QuantizedWeight]] = {}
    for tensor in GGUFReader(str(path)).tensors:
        type_name = tensor.tensor_type.name
        parts = tensor.name.split(".")
        if type_name not in GGUF_EXACT_TYPES or parts[-1] != "weight":
            continue
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
            fused_up = model_type == "phi3" and parts[2] == "ffn_up"  # Phi-3's ffn_up holds gate and up, fused
            module = f"layers.{parts[1]}.{'mlp.gate_up_proj' if fused_up else _GGUF_LAYER_NAMES[parts[2]]}"
        elif parts[0] in _GGUF_NAMES and len(parts) == 2:
            module = _GGUF_NAMES[parts[0]]
        else:
            continue
        in_features = int(tensor.shape[0])
        if in_features % GGUF_BLOCK:
            continue
        try:
            weight = from_gguf_blocks(type_name, tensor.data, in_features)
        except ValueError as exc:
            raise ValueError(f"{tensor.name}: {exc}") from None
        if model_type == "llama" and parts[-2] in ("attn_q", "attn_k"):
            heads = dims.num_heads if parts[-2] == "attn_q" else dims.num_kv_heads
            weight = weight.rows(_reverse_permute_rows(weight.out_features, heads))
        out[module] = (type_name, weight)
    return out


def _holds_exactly(type_name: str, bits: int, group_size: Optional[int]) -> bool:
    return GGUF_EXACT_TYPES[type_name] == bits and group_size == GGUF_BLOCK


def _carry(parts: tuple[str, ...], floats: list[torch.Tensor], gguf: dict[str, tuple[str, QuantizedWeight]],
           bits: int, group_size: Optional[int]) -> Optional[tuple[QuantizedWeight, str]]:
    """The GGUF blocks of `parts` stacked, when all are held exactly by (bits, group_size) and match the floats."""
    found = [gguf.get(p) for p in parts]
    if any(f is None or not _holds_exactly(f[0], bits, group_size) for f in found):
        return None
    weights = [w for _, w in found]  # type: ignore[misc]
    if not all(torch.equal(w.dequantize(), f.to(torch.float32)) for w, f in zip(weights, floats)):
        return None  # the float weights are not these blocks (another conversion): quantize them instead
    types = sorted({t for t, _ in found})  # type: ignore[misc]
    return concat_rows(weights), f"gguf {'+'.join(types)} exact"


def checkpoint_parts(module: str, parts: tuple[str, ...], present: Mapping[str, Any]) -> tuple[str, ...]:
    """The HF modules a step-model linear is made of, as the checkpoint names them: `parts` (q/k/v, gate/up), or
    the fused module itself where the checkpoint holds it fused (Phi-3's qkv_proj and gate_up_proj)."""
    if f"{parts[0]}.weight" not in present and f"{module}.weight" in present:
        return (module,)
    return parts


def quantize_state(
    state: dict[str, torch.Tensor],
    hf_parts: dict[str, torch.Tensor],
    dims: ModelDims,
    config: QuantizationConfig,
    gguf: Optional[dict[str, tuple[str, QuantizedWeight]]] = None,
) -> QuantizedState:
    """Quantizes the step-model float `state` (fused names) as `config` says.

    hf_parts: the HF float weights by HF module name (unfused, `<module>.weight`), to check GGUF blocks against.
    """
    gguf = gguf or {}
    out = dict(state)
    plan: dict[str, tuple[int, int]] = {}
    origin: dict[str, str] = {}

    def put(module: str, prefix: str, weight: QuantizedWeight, how: str) -> None:
        del out[f"{module}.weight"]
        out[f"{prefix}.codes"], out[f"{prefix}.scales"] = weight.codes.contiguous(), weight.scales.contiguous()
        if weight.offsets is not None:
            out[f"{prefix}.offsets"] = weight.offsets.contiguous()
        plan[module] = (weight.bits, weight.group_size)
        origin[module] = how

    def one(module: str, parts: tuple[str, ...], bits: int, group_size: Optional[int]) -> tuple[QuantizedWeight, str]:
        parts = checkpoint_parts(module, parts, hf_parts)
        floats = [hf_parts[f"{p}.weight"] for p in parts]
        carried = _carry(parts, floats, gguf, bits, group_size)
        if carried is not None:
            return carried
        return quantize(state[f"{module}.weight"], bits, group_size), "quantized from float"

    for module, parts in hf_module_names(dims).items():
        weight, how = one(module, parts, config.bits, config.group_size)
        put(module, module, weight, how)
    if config.lm_head == "int8":
        # Q8_0 is held exactly by int8 group 32; otherwise one scale per row (per vocabulary entry)
        def head_group(name: str) -> Optional[int]:
            return GGUF_BLOCK if gguf.get(name, ("",))[0] == "Q8_0" else None

        weight, how = one("embed_tokens", ("embed_tokens",), 8, head_group("embed_tokens"))
        put("embed_tokens", "embed_tokens.head", weight, how)
        if not dims.tie_word_embeddings:
            weight, how = one("lm_head", ("lm_head",), 8, head_group("lm_head"))
            put("lm_head", "lm_head", weight, how)
    return QuantizedState(out, plan, origin)


def quantized_step_model(hf_model, spec, dims: ModelDims, config: QuantizationConfig, dtype: torch.dtype):
    """(LlamaStepModel with quantized weights, QuantizedState) from the loaded HF model and its source."""
    from trtpaged.models.loading import hf_state_dict, with_weights

    floats = {k: v.detach().to(torch.float32) for k, v in hf_state_dict(hf_model, dims).items()}
    hf_parts = {k.removeprefix("model."): v.detach() for k, v in hf_model.state_dict().items()}
    gguf = None
    if spec.kind in ("gguf", "package"):
        gguf = read_gguf_exact(spec.path, dims, getattr(hf_model.config, "model_type", ""))
    quantized = quantize_state(floats, hf_parts, dims, config, gguf)
    state = {k: (v.to(dtype) if v.is_floating_point() and not _is_quant_buffer(k) else v)
             for k, v in quantized.state.items()}
    from trtpaged.models.qlinear import set_activations

    model = with_weights(dims, dtype, state, "cpu", quantized.plan)
    set_activations(model, config.activations)
    return model, quantized


def _is_quant_buffer(name: str) -> bool:
    return name.endswith((".codes", ".scales", ".offsets"))


def dequantized_hf_model(hf_model, dims: ModelDims, quantized: QuantizedState):
    """A copy of the HF model whose weights are the de-quantized ones (the reference with the same weights);
    the model itself when every weight was carried exactly."""
    import copy

    if all(how.endswith("exact") for how in quantized.origin.values()):
        return hf_model
    model = copy.deepcopy(hf_model)
    params = {name.removeprefix("model."): p for name, p in model.named_parameters()}  # the checkpoint's names
    for module, parts in {**hf_module_names(dims), "embed_tokens": ("embed_tokens",), "lm_head": ("lm_head",)}.items():
        if module not in quantized.plan:
            continue
        prefix = "embed_tokens.head" if module == "embed_tokens" else module
        bits, group = quantized.plan[module]
        weight = QuantizedWeight(bits, group, quantized.state[f"{prefix}.codes"], quantized.state[f"{prefix}.scales"],
                                 quantized.state.get(f"{prefix}.offsets")).dequantize()
        start = 0
        for part in checkpoint_parts(module, parts, params):
            target = params[f"{part}.weight"]
            rows = target.shape[0]
            with torch.no_grad():
                target.copy_(weight[start:start + rows].to(target.dtype))
            start += rows
    return model
