"""How the eager step model runs its layers on this machine: decided once, in one place.

Three forms compute the same step (tests check they agree):

- `c_layers`: every decoder layer in one C call (`kernels.LlamaLayers`): float32 on the CPU, every
  layer's linears quantized with packed CPU weights, one rank (a tensor-parallel rank all-reduces
  between the layers' kernels, which one call would skip).
- `fused`: a Python loop over the layers whose norms, RoPE and SwiGLU are the kernel library's fused
  CPU ops (and the few element-wise steps of other families, in torch ops): float32 on the CPU.
- `torch`: plain torch ops (any dtype, any device).

Attention is the kernel library's in all three; the plain torch reference (`trtpaged.reference`) runs
only where a plan asks for it (`attention="reference"`, for tests). The runner decides the plan when
it loads the model (`TorchRunner`), logs it and reports it (`LLM.execution_plan`, `trtpaged generate
--stats`); a model used on its own (the builder's verification) decides at its first eager step with the
same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trtpaged.models.llama import LlamaStepModel

LAYER_MODES = ("c_layers", "fused", "torch")
ATTENTION_MODES = ("kernels", "reference")


@dataclass(frozen=True)
class ExecutionPlan:
    """Which form runs the layers (`LAYER_MODES`) and the attention (`ATTENTION_MODES`), and why."""

    layers: str
    reason: str
    attention: str = "kernels"

    def __post_init__(self) -> None:
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers: got {self.layers!r}; allowed: {', '.join(LAYER_MODES)}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention: got {self.attention!r}; allowed: {', '.join(ATTENTION_MODES)}")

    def __str__(self) -> str:
        attention = "" if self.attention == "kernels" else f", {self.attention} attention"
        return f"{self.layers} ({self.reason}{attention})"


def family_features(dims) -> list[str]:
    """What a model has beyond Llama's layer (ModelDims fields by name), which the one-call runner does not compute.
    The fused form runs them, making the C runtime's calls: Gemma's (1 + w) norms through the rmsnorm kernel, its
    attention scale and soft-cap through the attention's options; partial rotary and tanh GELU in torch ops that the
    C runtime's loops round alike. (Sliding windows, q/k norms and layers without RoPE: c_layers_blocker.)"""
    plain = {"partial_rotary_factor": 1.0, "hidden_act": "silu", "gemma_norms": False, "embed_scale": 1.0,
             "attention_scale": 0.0, "attn_logit_softcap": 0.0, "final_logit_softcap": 0.0, "local_rope_theta": 0.0}
    return [name for name, value in plain.items() if getattr(dims, name) != value]


def _fused_blocker(model: "LlamaStepModel") -> str | None:
    """Why the fused CPU ops cannot run this model, or None (its activations have the norms' dtype and device)."""
    from trtpaged import kernels

    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    if dtype is not torch.float32:
        return f"dtype {str(dtype).removeprefix('torch.')}: the fused CPU ops are float32"
    if device.type != "cpu":
        return f"device {device.type}: the fused ops are CPU kernels"
    if not kernels.available() or not kernels.has_fused_ops():
        return "the kernel library has no fused CPU ops"
    return None


def c_layers_blocker(model: "LlamaStepModel") -> str | None:
    """Why the one-call layer runner cannot run this (float32 CPU) model, or None."""
    from trtpaged import kernels
    from trtpaged.models.qlinear import QuantizedLinear

    if not model.layers:
        return "no decoder layers"
    if not kernels.has_llama_layers():
        return "the kernel library has no one-call layer runner"
    if model.reduce is not None:
        return "a tensor-parallel rank all-reduces between the layers' kernels"
    features = family_features(model.dims)
    if features:
        return f"{', '.join(features)}: the one-call runner computes Llama's layer only"
    if any(model.dims.layer_windows):
        return "sliding-window layers (the one-call runner's attention reads whole sequences)"
    if model.dims.qk_norm or model.dims.nope_layers:
        return "q/k norms or layers without RoPE (the one-call runner computes Llama's layer)"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(m, QuantizedLinear) for m in linears):
            return "float linears (the one-call runner takes quantized layers)"
        if any(m.cpu_op() is None for m in linears):
            return "a quantized linear without packed CPU weights (in_features not a multiple of 32)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.weight.dtype is not torch.float32 or not n.weight.is_cpu for n in norms):
            return "norm weights not float32 on the CPU"
    eps = model.layers[0].input_layernorm.eps
    if any(n.eps != eps for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)):
        return "layers with different norm epsilons"
    return None


def decide_execution_plan(model: "LlamaStepModel", attention: str = "kernels") -> ExecutionPlan:
    """The fastest form that runs `model` where its weights are; raises KernelError when the kernel
    library (which every form's attention needs, unless `attention="reference"`) cannot be loaded."""
    from trtpaged import kernels

    if attention == "kernels":
        kernels.library()  # KernelLibraryNotFound names how to build it; no silent slow fallback
    blocker = _fused_blocker(model)
    if blocker is not None:
        return ExecutionPlan("torch", blocker, attention)
    blocker = c_layers_blocker(model)
    if blocker is not None:
        return ExecutionPlan("fused", f"not c_layers: {blocker}", attention)
    return ExecutionPlan("c_layers", f"{len(model.layers)} quantized layers in one C call", attention)


def same_bits_on_any_thread_count(model: torch.nn.Module) -> bool:
    """Whether `model`'s eager CPU step gives the same bits on any OpenMP thread count: every matrix product is
    the kernel library's (quantized linears with packed CPU weights, the LM head too, float32). torch's float GEMM
    is not: F.linear of 5 to 11 rows differs in the last bits between 1 and 2 threads."""
    from trtpaged.models.llama import LlamaStepModel
    from trtpaged.models.qlinear import QuantizedEmbedding, QuantizedLinear

    if not isinstance(model, LlamaStepModel):
        return False
    if model.lm_head is None and not isinstance(model.embed_tokens, QuantizedEmbedding):
        return False  # the tied float head: F.linear
    if any(p.is_floating_point() and p.dtype is not torch.float32 for p in model.parameters()):
        return False  # the kernels take float32 activations
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantizedLinear))]
    return all(isinstance(m, QuantizedLinear) and m.runs_on_cpu_kernels() for m in linears)  # packs nothing
