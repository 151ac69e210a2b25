"""Loading the source model with transformers: local HF dir, GGUF file, package GGUF, tiny preset.

transformers reads configs, weights and tokenizers (never from a hub: every
source is a local path); its own forward is the reference trtpaged's step
model is checked against. `source_architecture` is the cheap pre-flight check
(reads config.json, or the GGUF header only, checked against the file: gguf_header.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trtpaged.config import ConfigError, ModelSpec
from trtpaged.manifest import Manifest
from trtpaged.models import gguf_once
from trtpaged.models.checkpoint_files import check_safetensors_files, check_tokenizer_files, refused_pickle
from trtpaged.models.gguf_header import (
    F32,
    GGUFHeaderError,
    GGUFLayout,
    dequantizable_types,
    read_f32_tensor,
    read_layout,
    type_name,
)
from trtpaged.models.dims import (
    ARCHITECTURES_BY_MODEL_TYPE,
    MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
    rope_settings,
)
from trtpaged.models.rope import SUPPORTED_ROPE_TYPES, rope_type


@dataclass
class HFModel:
    """A transformers causal LM (eval mode), its tokenizer and config."""

    model: Any
    tokenizer: Any
    config: Any


def source_architecture(spec: ModelSpec) -> str:
    """The HF architecture of a model source without loading weights; raises ConfigError if unsupported/unreadable."""
    if spec.kind == "tiny":
        arch = str((spec.tiny or {}).get("architecture"))
        key = "model.tiny.architecture"
    elif spec.kind == "hf_dir":
        key = "model.hf_dir"
        try:
            hf_config = json.loads((spec.path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: cannot read {spec.path / 'config.json'}: {e}") from None
        if not isinstance(hf_config, dict):
            raise ConfigError(f"{key}: {spec.path / 'config.json'} holds a JSON {type(hf_config).__name__}; expected "
                              "an object (a transformers config)")
        archs = hf_config.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{key}: config.json's architectures is {str(archs)[:80]!r}; expected a list of class "
                              "names such as [\"LlamaForCausalLM\"]")
        arch = archs[0] if archs else "(none listed in config.json)"
    else:
        key = f"model.{spec.kind}"
        gguf_arch = _gguf_architecture(spec.path, key)
        # transformers converts a GGUF to the architecture whose model_type is its general.architecture
        arch = ARCHITECTURES_BY_MODEL_TYPE.get(gguf_arch, f"GGUF architecture {gguf_arch!r}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"{key}: architecture {arch} is not supported; "
                          f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if spec.kind == "hf_dir":
        _check_config_values(hf_config, arch, key)
    return arch


# rope types a family's config class renames as it loads (transformers' Phi3Config: the names of early releases)
_ROPE_TYPE_ALIASES = {"Phi3ForCausalLM": {"su": "longrope", "yarn": "longrope"}}


def _bad_value(key: str, name: str, got: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key}: config.json's {name} is {got!r:.60}; expected {expected}")


def _check_config_values(raw: dict, arch: str, key: str) -> None:
    """config.json's values transformers would fail on with a bare ZeroDivisionError, KeyError or TypeError (or
    load as another family), refused naming the key before transformers reads it."""
    wanted_type = MODEL_TYPES[arch]
    model_type = raw.get("model_type")
    if model_type is not None and model_type != wanted_type and ARCHITECTURES_BY_MODEL_TYPE.get(model_type) != arch:
        raise _bad_value(key, "model_type", model_type, f"{wanted_type!r}, the model_type of architectures[0] {arch}")
    _check_sizes(types.SimpleNamespace(**raw), f"{key}: config.json's")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype != "auto" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise _bad_value(key, "dtype" if "dtype" in raw else "torch_dtype", dtype, "a torch dtype name such as "
                         "float32, bfloat16 or float16 (trtpaged loads in float32 whatever it says)")  # fmt: skip
    _check_theta(raw.get("rope_theta"), "rope_theta", key)
    for rope_key in ("rope_parameters", "rope_scaling"):  # transformers 5's name, and 4's (read by 5 as well)
        _check_rope_values(raw, raw.get(rope_key), rope_key, key, _ROPE_TYPE_ALIASES.get(arch, {}))


def _check_theta(theta: Any, name: str, key: str) -> None:
    number = isinstance(theta, (int, float)) and not isinstance(theta, bool)
    if theta is not None and not (number and 0 < theta < math.inf):
        raise _bad_value(key, name, theta, "a finite number > 0")


def _check_rope_values(raw: dict, rope: Any, rope_key: str, key: str, aliases: dict[str, str]) -> None:
    """One rope dict of config.json: its theta, a rope type trtpaged implements (after the family's `aliases`),
    longrope's factor counts."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise _bad_value(key, rope_key, rope, "an object such as {\"rope_type\": \"linear\", \"factor\": 2.0}")
    if any(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3): checked once loaded
        return
    _check_theta(rope.get("rope_theta"), f"{rope_key}.rope_theta", key)
    kind = aliases.get(rope_type(rope), rope_type(rope))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise _bad_value(key, f"{rope_key}.rope_type", kind, f"one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    heads, hidden = raw.get("num_attention_heads"), raw.get("hidden_size")
    head_dim = raw.get("head_dim") or (hidden // heads if hidden and heads else None)
    # transformers 5 keeps partial_rotary_factor in rope_parameters too (there it wins over the top-level key)
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
    numeric = isinstance(partial, (int, float)) and not isinstance(partial, bool) and 0 < partial <= 1
    rotated = int(head_dim * partial) if head_dim and numeric else None  # else: refused once loaded (dims)
    for name in ("short_factor", "long_factor"):
        factors = rope.get(name)
        if kind == "longrope" and rotated and isinstance(factors, list) and len(factors) != rotated // 2:
            raise ConfigError(f"{key}: config.json's {rope_key}.{name} holds {len(factors)} factors; expected "
                              f"{rotated // 2}, one per rotated pair of head_dim {head_dim}")


def _gguf_architecture(path: Path, key: str) -> str:
    try:
        layout = read_layout(path)
    except GGUFHeaderError as e:
        raise ConfigError(f"{key}: {path} is not a readable GGUF file: {e}") from None
    _check_gguf_types(layout, path, key)
    return layout.architecture


def _check_gguf_types(layout: GGUFLayout, path: Path, key: str) -> None:
    """Every tensor is of a type transformers' GGUF loader de-quantizes (it reads them all, used or not); else a
    ConfigError naming the first other tensor and its type, before the load (was: gguf's NotImplementedError, which
    names the type but not the tensor)."""
    readable = dequantizable_types()
    unreadable = [t for t in layout.tensors if t.ggml_type not in readable]
    if not unreadable:
        return
    first, others = unreadable[0], len(unreadable) - 1
    more = f" (and {others} more tensor{'s' if others > 1 else ''} of types it cannot read)" if others else ""
    names = ", ".join(sorted(type_name(t) for t in readable))
    raise ConfigError(f"{key}: {path.name}: tensor {first.name!r} is ggml type {type_name(first.ggml_type)} "
                      f"({first.ggml_type}), which transformers' GGUF loader cannot read (the gguf package has no "
                      f"de-quantization for it){more}; types it reads: {names}")


def spec_from_manifest(manifest: Manifest) -> ModelSpec:
    """The model source an engine was built from (manifest.source), to reload the HF reference in tests."""
    src = manifest.source
    path = Path(src["path"]) if src.get("path") else None
    tiny = dict(src["tiny"]) if src.get("tiny") else None
    return ModelSpec(kind=src["kind"], path=path, package=src.get("package"), tiny=tiny)


def load_hf(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> HFModel:
    """Loads the transformers model, tokenizer and config of a model source (local only)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source_architecture(spec)
    if spec.kind == "tiny":
        return _load_tiny(dict(spec.tiny or {}), dtype)
    # never run code a model dir ships (auto_map): transformers would otherwise ask at a terminal
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}
    if spec.kind == "hf_dir":
        where = str(spec.path)
    else:
        kwargs["gguf_file"] = spec.path.name
        where = str(spec.path.parent)
        layout = _check_gguf_sizes(spec)
    with _no_progress_bars(), gguf_once.parsed_once():
        config = AutoConfig.from_pretrained(where, **kwargs)
        if spec.kind == "hf_dir":
            _check_config_against_checkpoint(spec.path, config)
            check_tokenizer_files(spec.path)
            check_safetensors_files(spec.path)
        else:
            _check_config_against_gguf(spec, config, layout)
            _take_gguf_rope_factors(spec, config, layout)
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        # the config loaded above: from_pretrained would parse the GGUF's metadata again for it
        # a tensor whose shape is not the config's is reported in `info` (and refused below, naming it and both
        # shapes), where transformers would raise with its report on the console only
        try:
            model, info = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype,
                                                               output_loading_info=True, ignore_mismatched_sizes=True,
                                                               **kwargs)  # fmt: skip
        except pickle.UnpicklingError as e:
            raise refused_pickle(spec.path, e) from None
    _check_loaded(spec, info)
    _tie_as_loaded(model, config)
    return HFModel(model=model.eval(), tokenizer=tokenizer, config=config)


def _tie_as_loaded(model: Any, config: Any) -> None:
    """config.tie_word_embeddings as the loaded model has it: transformers keeps a checkpoint's own lm_head.weight
    (a head of its own) even where config.json says the head is tied, and the engine's head must be that one."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight.data_ptr() == embedding.weight.data_ptr()
    config.tie_word_embeddings = tied


class MissingWeightsError(ValueError):
    """The checkpoint lacks weights the architecture needs (transformers would fill them with random values)."""


def _check_loaded(spec: ModelSpec, info: dict[str, Any]) -> None:
    """Refuses a checkpoint with missing or wrongly shaped tensors; unexpected extra tensors are ignored."""
    missing = sorted(k for k in info.get("missing_keys", ()) if "rotary_emb" not in k)
    mismatched = sorted(f"{k[0]} (checkpoint {list(k[1])}, config {list(k[2])})" if isinstance(k, (list, tuple))
                        and len(k) == 3 else str(k[0] if isinstance(k, (list, tuple)) else k)
                        for k in info.get("mismatched_keys", ()))  # fmt: skip
    if missing:
        raise MissingWeightsError(f"{spec.path} has no weights for {len(missing)} tensors of the architecture: "
                                  f"{', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}")
    if mismatched:
        sizes = "config.json's" if spec.kind == "hf_dir" else "the GGUF metadata's"
        raise MissingWeightsError(f"{spec.path}: {len(mismatched)} tensors have shapes other than {sizes} "
                                  f"sizes give: {', '.join(mismatched[:4])}{', ...' if len(mismatched) > 4 else ''}")


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' and the GGUF converter's tqdm bars would drown the builder's stage lines."""
    from transformers.utils import logging as hf_logging

    enabled, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its load report: what _check_loaded refuses, it says in one line
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # tqdm.auto bars of the GGUF converter
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if enabled:
            hf_logging.enable_progress_bar()


def _check_sizes(config: Any, where: str) -> None:
    """The config's sizes are positive integers, and its attention heads a multiple of its KV heads."""
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "vocab_size", "head_dim"):
        value = getattr(config, name, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{where} {name} is {value!r:.40}; expected a positive integer")
    heads, kv_heads = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise ConfigError(f"{where} num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")


_GGUF_SIZE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "context_length",
                   "attention.head_count", "attention.head_count_kv")  # fmt: skip


def _gguf_where(spec: ModelSpec) -> str:
    return f"model.{spec.kind}: {spec.path.name}: its metadata's"


def _check_gguf_sizes(spec: ModelSpec) -> GGUFLayout:
    """The GGUF's size entries are positive, before transformers turns them into a config (it divides by some);
    returns its checked layout."""
    layout = read_layout(spec.path)  # checked at the check stage; cached
    where = _gguf_where(spec)
    for name in _GGUF_SIZE_KEYS:
        key = f"{layout.architecture}.{name}"
        if layout.integers.get(key, 1) < 1:
            raise ConfigError(f"{where} {key} is {layout.integers[key]}; expected a positive integer")
    vocabulary = layout.array_lengths.get("tokenizer.ggml.tokens")
    for name in ("bos", "eos", "padding", "unknown", "eot"):  # the model's embedding takes the padding id
        key = f"tokenizer.ggml.{name}_token_id"
        if vocabulary is not None and not 0 <= layout.integers.get(key, 0) < vocabulary:
            raise ConfigError(f"{where} {key} is {layout.integers[key]}; the vocabulary (tokenizer.ggml.tokens) has "
                              f"{vocabulary} tokens")
    return layout


def _check_config_against_gguf(spec: ModelSpec, config: Any, layout: GGUFLayout) -> None:
    """Refuses a GGUF whose metadata does not describe its tensors, before transformers allocates the model at the
    metadata's sizes (a block_count of 10^6 or a feed_forward_length of 2^28 in a small file would take the
    machine's memory; a block_count below the file's layers would drop layers without a word)."""
    where = _gguf_where(spec)
    _check_sizes(config, where)
    blocks = layout.block_indices
    if blocks != set(range(config.num_hidden_layers)):
        held = f"blocks {min(blocks)} to {max(blocks)} ({len(blocks)})" if blocks else "no blk.N tensors"
        raise ConfigError(f"{where} block_count gives {config.num_hidden_layers} layers, but its tensors are for "
                          f"{held}")  # fmt: skip
    wanted, held_elements = _config_parameters(config), layout.num_elements
    if wanted > held_elements + held_elements // 4 + (16 << 20):
        raise ConfigError(f"{where} sizes give about {wanted:,} parameters (hidden_size {config.hidden_size}, "
                          f"intermediate_size {config.intermediate_size}, num_hidden_layers "
                          f"{config.num_hidden_layers}, vocab_size {config.vocab_size}), but its tensors hold "
                          f"{held_elements:,}")  # fmt: skip


# llama.cpp's per-frequency rotary divisors: its form of Llama 3.1's rope scaling (and of any scaling of the
# frequencies alone), computed from the HF config when the GGUF was made. transformers' GGUF loader drops the
# tensor and the config it came from says nothing of it, so a model loaded without it rotates by other angles.
ROPE_FREQS = "rope_freqs.weight"
_UNREAD_ROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE, by length


def _take_gguf_rope_factors(spec: ModelSpec, config: Any, layout: GGUFLayout) -> None:
    """A GGUF's rope_freqs into the config, as the rope scaling transformers (and the step model) compute from:
    LongRoPE with those factors at every length and no attention scaling, inv_freq_i = 1 / (factor_i *
    theta^(2i/d)), which is llama.cpp's theta_i / factor_i. Phi-3's length-dependent factors are refused."""
    where = f"model.{spec.kind}: {spec.path.name}"
    tensors = {t.name: t for t in layout.tensors}
    unread = [name for name in _UNREAD_ROPE_TENSORS if name in tensors]
    if unread:
        raise ConfigError(f"{where} holds {', '.join(unread)} (LongRoPE factors by sequence length), which "
                          "transformers' GGUF loader drops and trtpaged does not read: the model would rotate by other "
                          "angles than its own; build it from its HF checkpoint dir (model.hf_dir)")  # fmt: skip
    info = tensors.get(ROPE_FREQS)
    _take_gguf_rope_scaling(spec, config, layout, also_freqs=info is not None)
    if info is None:
        return
    theta, scaling, partial = rope_settings(config)
    if scaling is not None:
        raise ConfigError(f"{where} holds {ROPE_FREQS} and a rope scaling ({rope_type(scaling)}) both; one scaling of "
                          "the rotary frequencies is read, not two")  # fmt: skip
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pairs = int(head_dim * partial) // 2
    if info.shape != (pairs,) or info.ggml_type != F32:
        raise ConfigError(f"{where}: {ROPE_FREQS} has shape {list(info.shape)} and ggml type {info.ggml_type}; "
                          f"expected {pairs} float32 factors, one per rotated pair of head_dim {head_dim}")
    factors = read_f32_tensor(spec.path, layout, info)
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ConfigError(f"{where}: {ROPE_FREQS} holds a factor that is not a finite number > 0")
    config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), "rope_type": "longrope",
                              "rope_theta": theta, "short_factor": factors, "long_factor": factors,
                              "original_max_position_embeddings": config.max_position_embeddings, "factor": 1.0,
                              "attention_factor": 1.0}  # fmt: skip


def _take_gguf_rope_scaling(spec: ModelSpec, config: Any, layout: GGUFLayout, also_freqs: bool) -> None:
    """A GGUF's `{arch}.rope.scaling.type` into the config: transformers' GGUF loader drops it (it reads gpt-oss's
    alone), and the model loaded without it rotates by other angles than its own. Linear scaling (positions / factor,
    llama.cpp's freq_scale = 1 / factor) is read; other types are refused naming the key."""
    where = f"model.{spec.kind}: {spec.path.name}: its metadata's"
    key = f"{layout.architecture}.rope.scaling.type"
    kind = layout.strings.get(key, "none")
    if kind == "none":
        return
    if kind != "linear":
        raise ConfigError(f"{where} {key} is {kind!r}, which transformers' GGUF loader drops and trtpaged does not "
                          "read from a GGUF (linear is read): the model would rotate by other angles than its own; "
                          "build it from its HF checkpoint dir (model.hf_dir)")  # fmt: skip
    factor_key = f"{layout.architecture}.rope.scaling.factor"
    factor = layout.floats.get(factor_key)
    if factor is None or not (math.isfinite(factor) and factor >= 1):
        raise ConfigError(f"{where} {factor_key} is {factor!r}; expected a finite number >= 1 with {key} linear")
    if also_freqs:
        raise ConfigError(f"{where} {key} is linear and the file holds {ROPE_FREQS} too; one scaling of the rotary "
                          "frequencies is read, not two")  # fmt: skip
    theta, _, _ = rope_settings(config)
    config.rope_parameters = {**(getattr(config, "rope_parameters", None) or {}), "rope_type": "linear",
                              "rope_theta": theta, "factor": float(factor)}  # fmt: skip


def _check_config_against_checkpoint(path: Path, config: Any) -> None:
    """Refuses a config.json whose sizes are not positive integers, or make a model far larger than the
    checkpoint's files, before transformers allocates it (a vocab_size of 10^9 beside a small checkpoint would
    take the machine's memory): the model in float32 may be up to 4x a checkpoint of 8-bit files, and no more
    than that plus a margin."""
    _check_sizes(config, "model.hf_dir: config.json's")
    held = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern) if f.is_file())
    wanted = _config_parameters(config) * 4
    if held and wanted > 4 * held + (256 << 20):
        why = ("the weight files are Git LFS pointers, not weights (git lfs pull)" if _lfs_pointers(path) else
               "a quantized checkpoint (quantization_config) is not supported; give its float weights or a GGUF"
               if getattr(config, "quantization_config", None) else "config.json does not describe them")
        raise ConfigError(f"model.hf_dir: config.json's sizes give about {wanted / 2**30:.1f} GiB of float32 weights "
                          f"(hidden_size {config.hidden_size}, intermediate_size {config.intermediate_size}, "
                          f"num_hidden_layers {config.num_hidden_layers}, vocab_size {config.vocab_size}), but the "
                          f"checkpoint's files hold {held / 2**30:.2f} GiB; {why}")


def _lfs_pointers(path: Path) -> bool:
    """Whether a weights file in `path` is a Git LFS pointer (a clone without `git lfs pull`)."""
    for f in (*path.glob("*.safetensors"), *path.glob("*.bin")):
        try:
            with open(f, "rb") as handle:
                if handle.read(24) == b"version https://git-lfs.":
                    return True
        except OSError:
            continue
    return False


MAX_TINY_BYTES = 4 << 30  # a random test model's weights; past this the build would page or be OOM-killed


def _config_parameters(config: Any) -> int:
    """The decoder's parameter count from its config (attention, gated MLP, embedding and an untied LM head)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // max(heads, 1)
    layer = hidden * head_dim * 2 * (heads + kv_heads) + 3 * hidden * config.intermediate_size
    embeddings = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return config.num_hidden_layers * layer + embeddings


def _load_tiny(tiny: dict[str, Any], dtype: torch.dtype) -> HFModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    from trtpaged.models.tiny_tokenizer import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

    arch, seed = tiny.pop("architecture"), tiny.pop("seed")
    try:
        config = AutoConfig.for_model(
            MODEL_TYPES[arch], architectures=[arch], bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
            **tiny
        )
    except Exception as e:  # noqa: BLE001  (transformers' config validators raise their own error types)
        cause = e.__cause__ or e
        raise ConfigError(f"model.tiny: transformers rejects this {arch} config: {cause}") from None
    size = _config_parameters(config) * torch.empty((), dtype=dtype).element_size()
    if size > MAX_TINY_BYTES:  # before a random model of that size is allocated (keys left out take HF's defaults)
        raise ConfigError(f"model.tiny: about {size / 2**30:.1f} GiB of {str(dtype).removeprefix('torch.')} "
                          "weights exceed a tiny model's "
                          f"{MAX_TINY_BYTES >> 30} GiB; set smaller hidden_size, intermediate_size, num_hidden_layers "
                          f"or vocab_size (now {config.hidden_size}, {config.intermediate_size}, "
                          f"{config.num_hidden_layers}, {config.vocab_size})", limit=MAX_TINY_BYTES)
    torch.manual_seed(int(seed))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return HFModel(model=model.eval(), tokenizer=make_tiny_tokenizer(), config=config)
