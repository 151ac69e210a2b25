"""HF config -> ModelDims, refusing what the step model does not implement."""

from __future__ import annotations

from typing import Any, Optional

from trtpaged.manifest import ModelDims
from trtpaged.models.rope import SUPPORTED_ROPE_TYPES, rope_type

# HF architecture -> its transformers model_type (also the GGUF general.architecture name)
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3",
               "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the gated MLP activations the step model implements, by HF name
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # as ACT2FN
# config keys of variants no listed family's step model implements (MoE and friends): refused by name
# the families whose transformers attention reads attention_bias (q/k/v and o biased); Qwen2's always biases q/k/v
# alone, Mistral's and Phi-3's never read it
_LLAMA_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# the families whose transformers MLP reads mlp_bias; the others' have no bias whatever the config says
_MLP_BIAS = ("LlamaForCausalLM", "SmolLM3ForCausalLM")
_REFUSED_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# the layer kinds (config.layer_types) the step model implements; transformers allows others (chunked, linear, ...)
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
ARCHITECTURES_BY_MODEL_TYPE = {model_type: arch for arch, model_type in MODEL_TYPES.items()}
ARCHITECTURES_BY_MODEL_TYPE["gemma3"] = "Gemma3ForCausalLM"  # a Gemma 3 GGUF's general.architecture
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 16, 256  # what the CPU attention kernel implements
# What the CUDA kernels (and so TensorRT engines) implement: plugins/src/cuda/head_dims.h.
# A model with another head_dim builds and runs with the torch backend on CPU only.
CUDA_HEAD_DIMS = (64, 80, 96, 128)


class UnsupportedModelError(ValueError):
    """The HF model uses a feature trtpaged's step model does not implement."""


def rope_settings(config: Any, layer_type: str = "full_attention") -> tuple[float, Optional[dict], float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from a transformers 4.x (rope_theta,
    rope_scaling) or 5.x (rope_parameters, per layer type for Gemma 3) config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):
        # per layer type: transformers reads the layer type's dict alone (flat keys beside it are ignored), but
        # yarn's truncate from the top level
        nested = {key: value for key, value in params[layer_type].items() if key != "truncate"}
        params = {**nested, **({"truncate": params["truncate"]} if "truncate" in params else {})}
    else:
        legacy = getattr(config, "rope_scaling", None)
        if legacy and not params.get("factor") and layer_type == "full_attention":
            params.update(legacy)
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    return theta, (params if rope_type(params) != "default" else None), partial


# the families whose transformers model applies sliding_window, when set, to every layer, reading no layer_types
_EVERY_LAYER_WINDOW = ("MistralForCausalLM", "Phi3ForCausalLM")


def _layer_windows(config: Any, arch: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: global), or () when no layer has one. transformers 5 names each
    layer's kind in layer_types; Mistral and Phi-3 apply sliding_window, when set, to every layer; Llama has no
    window (transformers ignores a sliding_window in a Llama config). transformers' Llama, Mistral and Phi-3 models
    read no layer_types: a config's is ignored as they ignore it. But transformers' AutoConfig reads a mistral
    config.json that has layer_types as Ministral's (model_type "ministral"), whose model reads them: so do we."""
    if arch == "LlamaForCausalLM":
        return ()
    window = getattr(config, "sliding_window", None)
    ignored = arch in _EVERY_LAYER_WINDOW and getattr(config, "model_type", None) != "ministral"
    types = getattr(config, "layer_types", None) if not ignored else None
    if types:
        unknown = [t for t in types if t not in LAYER_TYPES]
        if unknown:  # read as global, such a layer would attend to other positions than transformers' does
            raise UnsupportedModelError(f"layer_types: got {unknown[0]!r} (layer {list(types).index(unknown[0])}); "
                                        f"implemented: {', '.join(LAYER_TYPES)}")
        slides = [t == "sliding_attention" for t in types]
    elif arch in _EVERY_LAYER_WINDOW:
        slides = [True] * config.num_hidden_layers
    elif arch in MODEL_TYPES and window:
        # transformers before 4.53 gives no layer_types; which layers slide then follows other keys per family
        # (max_window_layers, a layer-index pattern), which an empty answer here would silently drop
        import transformers

        raise UnsupportedModelError(
            f"layer_types: {arch} has sliding_window {window} but the config names no layer kinds; transformers "
            f"{transformers.__version__} does not give them: install transformers >= 5")
    else:
        return ()
    if window is None or not any(slides):
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise UnsupportedModelError(f"sliding_window: got {window!r}; expected a positive number of tokens, or "
                                    "null for no window")  # fmt: skip
    return tuple(window if slide else 0 for slide in slides)


def _softcap(config: Any, key: str) -> float:
    value = getattr(config, key, None)
    if value is None:
        return 0.0
    if not float(value) > 0:
        raise UnsupportedModelError(f"{key}: got {value!r}; expected a positive number or null")
    return float(value)


def dims_from_hf_config(config: Any, max_seq_len: Optional[int] = None) -> ModelDims:
    """Maps a transformers config of a supported family to ModelDims; raises UnsupportedModelError naming
    the config key of what the step model does not implement."""
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else ARCHITECTURES_BY_MODEL_TYPE.get(config.model_type, config.model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    for key in _REFUSED_KEYS:
        if getattr(config, key, None):
            raise UnsupportedModelError(f"{key}: got {getattr(config, key)!r}; mixture-of-experts layers are not "
                                        "implemented")
    if arch == "Gemma3ForCausalLM" and getattr(config, "use_bidirectional_attention", False):
        # transformers' Gemma 3 then lets every token attend to later ones (EmbeddingGemma): no causal decoder
        raise UnsupportedModelError("use_bidirectional_attention: got True; the step model attends causally only")
    gemma = arch in GEMMA
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = getattr(config, act_key, None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{act_key}: got {act!r}; the gated MLP implements {', '.join(ACTIVATIONS)}")
    theta, scaling, partial = rope_settings(config)
    if arch != "Phi3ForCausalLM":  # the other families' transformers models rotate whole heads whatever it says
        partial = 1.0
    if rope_type(scaling) not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_scaling.rope_type: got {rope_type(scaling)!r}; "
                                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type(scaling) == "longrope":
        original = int((scaling or {}).get("original_max_position_embeddings")
                       or getattr(config, "original_max_position_embeddings", 0) or 0)
        if not original:
            raise UnsupportedModelError("rope_scaling.original_max_position_embeddings: longrope needs it")
        scaling = {**(scaling or {}), "original_max_position_embeddings": original}
        if max_seq_len and max_seq_len > original:
            raise UnsupportedModelError(
                f"max_seq_len: {max_seq_len} exceeds longrope's original_max_position_embeddings {original}; "
                f"beyond it the long factors switch on with the sequence length, which is not implemented")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        raise UnsupportedModelError(
            f"head_dim: got {head_dim}; the trtpaged kernels support multiples of {HEAD_DIM_MULTIPLE} "
            f"up to {MAX_HEAD_DIM}"
        )
    rotary_dim = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary_dim % 2:
        raise UnsupportedModelError(f"partial_rotary_factor: got {partial}; head_dim * factor must be even and > 0")
    num_layers = config.num_hidden_layers
    nope: tuple[int, ...] = ()
    if arch == "SmolLM3ForCausalLM":
        flags = list(getattr(config, "no_rope_layers", None) or [1] * num_layers)
        if len(flags) != num_layers:
            raise UnsupportedModelError(f"no_rope_layers: {len(flags)} entries for {num_layers} layers")
        nope = tuple(i for i, use_rope in enumerate(flags) if not use_rope)
    windows = _layer_windows(config, arch)
    if windows and len(windows) != num_layers:
        raise UnsupportedModelError(f"layer_types: {len(windows)} entries for {num_layers} layers")
    local_theta = 0.0
    if gemma and windows and arch == "Gemma3ForCausalLM":
        local_theta, local_scaling, _ = rope_settings(config, "sliding_attention")
        if local_scaling is not None:
            raise UnsupportedModelError("rope_parameters.sliding_attention: only the default RoPE is implemented for "
                                        "the local layers")
        local_theta = float(getattr(config, "rope_local_base_freq", None) or local_theta)
    qwen = arch == "Qwen2ForCausalLM"
    llama_bias = bool(getattr(config, "attention_bias", False)) and arch in _LLAMA_BIAS
    scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
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
        mlp_bias=bool(getattr(config, "mlp_bias", False)) and arch in _MLP_BIAS,
        layer_windows=windows,
        nope_layers=nope,
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        partial_rotary_factor=partial,
        hidden_act=ACTIVATIONS[act],
        gemma_norms=gemma,
        embed_scale=float(config.hidden_size) ** 0.5 if gemma else 1.0,
        attention_scale=float(scalar) ** -0.5 if scalar else 0.0,
        # Gemma 3's config carries attn_logit_softcapping, but transformers' Gemma 3 attention never applies it
        attn_logit_softcap=_softcap(config, "attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else 0.0,
        final_logit_softcap=_softcap(config, "final_logit_softcapping") if gemma else 0.0,
        local_rope_theta=local_theta,
    )


def trained_max_seq_len(dims: ModelDims) -> tuple[int, str]:
    """The longest sequence the model is made for, and how that follows from the config (for a refusal's message),
    derived as vLLM derives it: max_position_embeddings, times the factor of linear and yarn RoPE scaling (yarn's
    from its original_max_position_embeddings when the config gives one); llama3 and longrope configs already state
    their extended length there."""
    scaling = dims.rope_scaling or {}
    kind = rope_type(scaling)
    base_key, base = "max_position_embeddings", dims.max_position_embeddings
    if kind == "yarn" and scaling.get("original_max_position_embeddings"):
        base_key, base = "original_max_position_embeddings", int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or 1.0) if kind in ("linear", "yarn") else 1.0
    tokens = int(base * factor)
    if base_key == "max_position_embeddings" and tokens == base:
        return tokens, f"max_position_embeddings {tokens}"
    return tokens, f"{tokens} tokens ({base_key} {base} with {kind} RoPE scaling factor {factor:g})"
