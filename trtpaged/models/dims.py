"""HF config -> ModelDims, refusing what the step model does not implement."""

from __future__ import annotations

from typing import Any, Optional

from trtpaged.manifest import ModelDims
from trtpaged.models.rope import SUPPORTED_ROPE_TYPES, rope_type

# HF architecture -> its transformers model_type (also the GGUF general.architecture name)
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
ARCHITECTURES_BY_MODEL_TYPE = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 16, 256  # what the CPU attention kernel implements
# What the CUDA kernels (and so TensorRT engines) implement: plugins/src/cuda/head_dims.h.
# A model with another head_dim builds and runs with the torch backend on CPU only.
CUDA_HEAD_DIMS = (64, 80, 96, 128)


class UnsupportedModelError(ValueError):
    """The HF model uses a feature trtpaged's step model does not implement."""


def _rope(config: Any) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling or None) from a transformers 4.x (rope_theta, rope_scaling)
    or 5.x (rope_parameters) config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("factor"):
        params.update(legacy)
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return theta, (params if rope_type(params) != "default" else None)


def dims_from_hf_config(config: Any, max_seq_len: Optional[int] = None) -> ModelDims:
    """Maps a transformers Llama/Mistral/Qwen2 config to ModelDims; raises UnsupportedModelError."""
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else ARCHITECTURES_BY_MODEL_TYPE.get(config.model_type, config.model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act: got {act!r}; the step model implements SwiGLU with silu only")
    theta, scaling = _rope(config)
    if rope_type(scaling) not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type: got {rope_type(scaling)!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float((scaling or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor: only 1.0 (full rotary) is supported")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"head_dim: got {head_dim}; the trtpaged kernels support multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
        )
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", arch == "MistralForCausalLM")
    if uses_window and window and max_seq_len and max_seq_len > window:
        raise UnsupportedModelError(
            f"max_seq_len: {max_seq_len} exceeds the model's sliding_window {window}; sliding-window attention is "
            f"not implemented, use max_seq_len <= {window}"
        )
    qwen = arch == "Qwen2ForCausalLM"
    llama_bias = bool(getattr(config, "attention_bias", False)) and not qwen
    return ModelDims(
        architecture=arch,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=qwen or llama_bias,
        o_proj_bias=llama_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
