"""The engine dir manifest (`trtpaged.json`): the contract between builder and runtime.

The builder writes it; the runtime, `trtpaged inspect` and C++ embedders read it.
Field names follow TensorRT-LLM where one exists (max_batch_size, max_num_tokens,
max_seq_len). Bumping FORMAT_VERSION is required for incompatible changes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import pydantic

from trtpaged.kv_formats import FLOAT_KV_CACHE_DTYPES, KV_CACHE_DTYPES, KV_FORMATS, kv_format
from trtpaged.names import renamed_keys
from trtpaged.sampling_defaults import SamplingDefaultError
from trtpaged.sampling_defaults import check as check_sampling_defaults
from trtpaged.step_io import MAX_KV_BLOCKS

FORMAT_VERSION = 1
MANIFEST_NAME = "trtpaged.json"
# the sha256 of the manifest's own fields, written by the build: an edit after the build (a rope_theta changed by
# hand) is refused at load instead of changing the model's outputs. It catches edits, not tampering: whoever
# rewrites the manifest can rewrite this hash too (or drop it: a manifest without it, as builds before it wrote
# them, is read without the check). The files' hashes are under `files`
CONTENT_HASH = "content_sha256"

# what runs an engine dir; "auto" (the default wherever a backend is chosen) takes TensorRT where its
# plan, TensorRT, a GPU and the plugin exist, else torch
BACKENDS = ("auto", "torch", "tensorrt")
DTYPE_BYTES = {name: KV_FORMATS[name].element_bytes for name in FLOAT_KV_CACHE_DTYPES}  # compute dtypes
MAX_MANIFEST_BYTES = 16 << 20
BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV block an engine may have
DEFAULT_BLOCK_SIZE = 16  # model.yaml's when it gives none
MAX_KV_MEMORY = 1 << 50
# upper bounds of the dims and limits a manifest may state (far above any model trtpaged runs)
_DIM_BOUNDS = {"num_layers": 1024, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_heads": 1024,
               "num_kv_heads": 1024, "head_dim": 1024, "vocab_size": 1 << 22, "max_position_embeddings": 1 << 24}
_LIMIT_BOUNDS = {"max_batch_size": 1 << 16, "max_num_tokens": 1 << 24, "max_seq_len": 1 << 24}


class EngineDirError(ValueError):
    """An engine dir that cannot be used as it is.

    `path` is the file at fault (trtpaged.json, a weights file, the tokenizer dir), `field` the manifest
    field or tensor that names or describes it; `limit` the bound it broke, when there is one. The
    message is one line for people; code reads the attributes.
    """

    def __init__(self, path: str | Path, field: str, message: str, limit: Any = None) -> None:
        super().__init__(f"{path}: {field}: {message}")
        self.path = Path(path)
        self.field = field
        self.limit = limit


def kv_row_bytes(head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one token's K (or V) for one head: head_dim values, or head_dim codes and a scale."""
    return kv_format(kv_cache_dtype).row_bytes(head_dim)


@dataclass(frozen=True)
class ModelDims:
    """Architecture of the step model (Llama family)."""

    architecture: str  # HF architecture name, e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict] = None  # as in the HF config, or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v biases
    o_proj_bias: bool = False  # Llama with attention_bias=True also biases o_proj (Qwen2 does not)
    mlp_bias: bool = False  # Llama's mlp_bias: biases on gate/up/down projections
    # Families beyond Llama (models/dims.py maps each HF config; the defaults are Llama's)
    layer_windows: tuple[int, ...] = ()  # sliding window of each layer, 0: global; (): every layer global
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3's no_rope_layers)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims (Phi-4-mini)
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_tanh (Gemma)
    gemma_norms: bool = False  # (1 + w) RMSNorms and the post-attention / pre- and post-MLP norms of Gemma 2/3
    embed_scale: float = 1.0  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    attention_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float = 0.0  # attention score soft-cap (Gemma 2); 0: none
    final_logit_softcap: float = 0.0  # output logit soft-cap (Gemma 2); 0: none
    local_rope_theta: float = 0.0  # RoPE base of windowed layers (Gemma 3, default RoPE there); 0: rope_theta

    def window_of(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to the whole sequence)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def max_window(self) -> int:
        """The largest window when every layer is windowed, else 0 (some layer reads the whole sequence)."""
        if not self.layer_windows or 0 in self.layer_windows:
            return 0
        return max(self.layer_windows)

    def kv_bytes_per_token(self, kv_cache_dtype: str) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_dim, kv_cache_dtype)


# the fields beyond Llama's (written to trtpaged.json only where they differ from their default)
FAMILY_FIELDS = ("layer_windows", "nope_layers", "qk_norm", "partial_rotary_factor", "hidden_act", "gemma_norms",
                 "embed_scale", "attention_scale", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta")


@dataclass(frozen=True)
class Limits:
    """Build-time limits (TensorRT-LLM's names)."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int

    @property
    def max_blocks_per_seq(self) -> int:
        """KV blocks one sequence of max_seq_len tokens holds."""
        return -(-self.max_seq_len // self.block_size)


@dataclass(frozen=True)
class KVCacheBudget:
    """How many KV blocks the runtime allocates: exactly one of the three is set."""

    num_kv_blocks: Optional[int] = None
    memory_bytes: Optional[int] = None
    fraction: Optional[float] = None  # of free device memory at serve time


@dataclass(frozen=True)
class Manifest:
    """Everything the runtime needs to serve an engine dir."""

    dims: ModelDims
    limits: Limits
    kv_cache: KVCacheBudget
    dtype: str  # compute dtype of the weights / activations
    kv_cache_dtype: str
    tokenizer_dir: str = "tokenizer"  # relative to the engine dir, HF tokenizer files
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: Optional[str] = None
    weights_file: str = "weights.safetensors"
    onnx_file: Optional[str] = "model.onnx"
    plan_file: Optional[str] = None  # "engine.plan" once TensorRT built it
    backends: list[str] = field(default_factory=list)  # e.g. ["torch"], ["torch", "tensorrt"]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    source: dict[str, Any] = field(default_factory=dict)  # where the model came from
    verification: dict[str, Any] = field(default_factory=dict)  # max abs diff etc.
    # weight-only quantization: {"weights", "group_size", "lm_head", "modules": {module: [bits, group_size]},
    # "weight_bytes", "carried": {...}}; empty for a float engine
    quantization: dict[str, Any] = field(default_factory=dict)
    # tensor parallelism: ranks the model is split over; above 1, `shards` names each rank's files
    # ({"weights_file", "onnx_file"}, rank order) and weights_file / onnx_file are rank 0's
    tensor_parallel: int = 1
    shards: list[dict[str, Any]] = field(default_factory=list)
    # the model.yaml's `tensorrt:` forms ({"graph", "kv_pool", "quantized_pool"}) and "graph_written": whether
    # model.onnx holds the TensorRT graph form of quantized weights (model-tensorrt.safetensors)
    tensorrt: dict[str, Any] = field(default_factory=dict)
    # the model's recommended sampling settings (its generation_config.json; trtpaged/sampling_defaults.py):
    # SamplingParams field -> value, used where a request sets none; left out of the JSON when empty
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return self.dims.kv_bytes_per_token(self.kv_cache_dtype)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.limits.block_size

    @property
    def kv_bytes_per_token_per_rank(self) -> int:
        """What one rank's pool holds per token: its KV heads only (total / tensor_parallel)."""
        return self.kv_bytes_per_token // self.tensor_parallel

    @property
    def kv_bytes_per_block_per_rank(self) -> int:
        """One block of one rank's pool; the KV budget (memory, fraction) is per rank, so it sets the block count."""
        return self.kv_bytes_per_token_per_rank * self.limits.block_size

    def rank_files(self, rank: int) -> dict[str, Any]:
        """{"weights_file", "onnx_file"} of one rank (rank 0 of an unsplit engine: the engine's own files)."""
        if not 0 <= rank < self.tensor_parallel:
            raise ValueError(f"rank: got {rank}; the engine has tensor_parallel {self.tensor_parallel}")
        if self.tensor_parallel == 1:
            return {"weights_file": self.weights_file, "onnx_file": self.onnx_file}
        return dict(self.shards[rank])

    def to_json(self) -> str:
        data = asdict(self)
        # a family field at its Llama default is left out: a Llama engine's manifest is what it was before the
        # families existed (readers that know only Llama's fields, such as the C runtime, still read it)
        defaults = ModelDims.__dataclass_fields__
        for name in FAMILY_FIELDS:
            if data["dims"][name] == defaults[name].default or data["dims"][name] == ():
                del data["dims"][name]
        if not data["sampling_defaults"]:  # as builds before the field wrote them (and the C runtime reads them)
            del data["sampling_defaults"]
        data["kv_bytes_per_token"] = self.kv_bytes_per_token
        data["kv_bytes_per_block"] = self.kv_bytes_per_block
        data["kv_bytes_per_token_per_rank"] = self.kv_bytes_per_token_per_rank
        data[CONTENT_HASH] = content_sha256(data)
        return json.dumps(data, indent=2, sort_keys=True)

    def file_fields(self) -> list[tuple[str, str]]:
        """(manifest field, relative path) of every file or dir the manifest names, shards included."""
        named = [("tokenizer_dir", self.tokenizer_dir), ("weights_file", self.weights_file)]
        named += [(name, value) for name, value in (("onnx_file", self.onnx_file), ("plan_file", self.plan_file))
                  if value is not None]
        for rank, shard in enumerate(self.shards):
            named += [(f"shards[{rank}].{key}", value) for key, value in sorted(shard.items()) if value is not None]
        return named + [(f"files[{name!r}]", name) for name in sorted(self.files)]

    def weight_files(self) -> list[str]:
        """Every rank's weights file (one for an unsplit engine)."""
        return [self.rank_files(rank)["weights_file"] for rank in range(self.tensor_parallel)]

    @classmethod
    def from_dict(cls, data: Any, where: str | Path = MANIFEST_NAME) -> "Manifest":
        """A manifest from parsed JSON; raises EngineDirError naming `where` and the field."""
        return cls.from_json(json.dumps(data), where)

    @classmethod
    def from_json(cls, text: str | bytes, where: str | Path = MANIFEST_NAME) -> "Manifest":
        """A manifest from the text of trtpaged.json: types checked strictly, unknown fields refused, values
        bounded; raises EngineDirError naming `where` and the field."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise EngineDirError(where, "(file)", f"not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise EngineDirError(where, "(file)", f"expected a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineDirError(where, "format_version", f"engine dir has {version!r}, this trtpaged reads "
                                 f"{FORMAT_VERSION}; rebuild the engine")
        stated = data.pop(CONTENT_HASH, None)
        if stated is not None and not (isinstance(stated, str) and _SHA256.fullmatch(stated)):
            raise EngineDirError(where, CONTENT_HASH, f"got {str(stated)[:80]!r}; expected a sha256 hex digest")
        written = content_sha256(data) if stated is not None else None
        data = _renamed({k: v for k, v in data.items() if k not in _DERIVED}, where)
        try:
            manifest = _adapter().validate_json(json.dumps(data))
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            name = ".".join(str(part) for part in first["loc"]) or "(file)"
            message = "unknown field" if first["type"] == "unexpected_keyword_argument" else first["msg"]
            raise EngineDirError(where, name, message) from None
        _check_values(manifest, where)
        # after the value checks, so that a value no engine has is named by its own field
        if stated is not None and stated != written:
            raise EngineDirError(where, CONTENT_HASH, "the manifest's fields no longer match the hash its build "
                                 "wrote (edited after the build); rebuild the engine")
        return manifest


def _renamed(data: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """The fields an older build spelled the deprecated way (names.py) under their one name."""
    def fail(name: str, message: str) -> EngineDirError:
        return EngineDirError(where, name, message)

    if isinstance(data.get("kv_cache"), dict):
        data["kv_cache"] = renamed_keys(data["kv_cache"], "kv_cache.", fail)
    checked = data.get("verification")
    if isinstance(checked, dict) and isinstance(checked.get("kv_cache"), dict):
        kv_checked = renamed_keys(checked["kv_cache"], "verification.kv_cache.", fail)
        data["verification"] = {**checked, "kv_cache": kv_checked}
    return data


def content_sha256(data: dict[str, Any]) -> str:
    """sha256 of a manifest's fields (all but CONTENT_HASH itself) in one canonical JSON form: whitespace, key
    order and number spelling do not change it, any field's value does."""
    fields = {k: v for k, v in data.items() if k != CONTENT_HASH}
    try:
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except ValueError:  # a NaN the value checks refuse; the hash then cannot match
        text = repr(fields)
    return hashlib.sha256(text.encode()).hexdigest()


_DERIVED = ("kv_bytes_per_token", "kv_bytes_per_block", "kv_bytes_per_token_per_rank")  # written by to_json
_STRICT = pydantic.ConfigDict(extra="forbid", strict=True)
_ADAPTER: Optional[pydantic.TypeAdapter] = None


def _adapter() -> pydantic.TypeAdapter:
    global _ADAPTER
    if _ADAPTER is None:
        for cls in (ModelDims, Limits, KVCacheBudget, Manifest):
            cls.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]
        _ADAPTER = pydantic.TypeAdapter(Manifest)
    return _ADAPTER


def as_float32(value: float) -> float:
    """`value` rounded to float32, as the kernels take it (an infinity of its sign past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_dim_values(d: ModelDims, bad: Any) -> None:
    """The model dims' values as an engine's manifest must hold them (sizes in bounds, finite positive epsilon
    and rope theta); `bad(field, message, limit)` makes the error to raise (the build's, or a reader's)."""
    for name, high in _DIM_BOUNDS.items():
        value = getattr(d, name)
        if not 1 <= value <= high:
            raise bad(f"dims.{name}", f"got {value}; expected 1 to {high}", high)
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(d, name)
        if not (math.isfinite(value) and value > 0 and 0 < as_float32(value) < math.inf):
            raise bad(f"dims.{name}", f"got {value}; expected a positive number, finite and not 0 in float32 (the "
                      "kernels' type)")  # fmt: skip
    if d.num_heads % d.num_kv_heads:
        raise bad("dims.num_kv_heads", f"{d.num_kv_heads} does not divide num_heads {d.num_heads}")
    _check_family_values(d, bad)


HIDDEN_ACTS = ("silu", "gelu_tanh")  # the gated MLP activations the step model implements


def _check_family_values(d: ModelDims, bad: Any) -> None:
    """The fields beyond Llama's: values the step model can run (a hand-made manifest got tracebacks, or ran
    something else than it said)."""
    factor = d.partial_rotary_factor
    rotary = int(d.head_dim * factor) if math.isfinite(factor) else 0
    if not (0 < factor <= 1 and rotary >= 2 and rotary % 2 == 0):
        raise bad("dims.partial_rotary_factor", f"got {factor}; expected a number in (0, 1] leaving an even number "
                  f"(>= 2) of head_dim {d.head_dim}'s dims rotated")  # fmt: skip
    if d.layer_windows and len(d.layer_windows) != d.num_layers:
        raise bad("dims.layer_windows", f"{len(d.layer_windows)} windows for {d.num_layers} layers; one per layer "
                  "(0: global) or none")  # fmt: skip
    if any(w < 0 for w in d.layer_windows):
        raise bad("dims.layer_windows", f"got {list(d.layer_windows)[:16]}; a window is a number of tokens >= 0 "
                  "(0: global)")  # fmt: skip
    outside = [n for n in d.nope_layers if not 0 <= n < d.num_layers]
    if outside or len(set(d.nope_layers)) != len(d.nope_layers):
        raise bad("dims.nope_layers", f"got {list(d.nope_layers)[:16]}; expected distinct layer indices in [0, "
                  f"{d.num_layers})")  # fmt: skip
    if d.hidden_act not in HIDDEN_ACTS:
        raise bad("dims.hidden_act", f"got {d.hidden_act!r:.40}; one of {', '.join(HIDDEN_ACTS)}")
    gemma = d.architecture.startswith("Gemma")
    if d.gemma_norms != gemma:
        raise bad("dims.gemma_norms", f"got {d.gemma_norms} for {d.architecture:.60}; Gemma's norms go with Gemma only")
    # Gemma's embeddings are scaled by sqrt(hidden_size) (transformers computes it); other families' are not
    scale = math.sqrt(d.hidden_size) if gemma else 1.0
    if not (math.isfinite(d.embed_scale) and math.isclose(d.embed_scale, scale, rel_tol=1e-6)):
        raise bad("dims.embed_scale", f"got {d.embed_scale}; {d.architecture:.60} scales embeddings by {scale:g}"
                  + (" (sqrt(hidden_size))" if gemma else ""))  # fmt: skip
    for name in ("attention_scale", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta"):
        value = getattr(d, name)
        if value != 0 and not (gemma and math.isfinite(value) and value > 0 and 0 < as_float32(value) < math.inf):
            raise bad(f"dims.{name}", f"got {value}; expected 0 (none) or, for Gemma, a positive number, finite and "
                      "not 0 in float32")  # fmt: skip
    scaling = d.rope_scaling or {}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = scaling.get(key)
        if value is not None and not _finite_positive(value):
            raise bad(f"dims.rope_scaling.{key}", f"got {value!r:.40}; expected a finite positive number")
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    if kind in ("yarn", "longrope"):
        _check_long_context_rope(scaling, kind, rotary // 2, bad)


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_long_context_rope(scaling: dict, kind: str, pairs: int, bad: Any) -> None:
    """yarn's and longrope's own keys: values models/rope.py computes the frequencies from (were tracebacks from the
    step model: a zero division, a broadcast error); the C runtime checks the same."""
    original = scaling.get("original_max_position_embeddings")
    if original is not None and original < 1:
        raise bad("dims.rope_scaling.original_max_position_embeddings", f"got {original!r:.40}; expected a number of "
                  "positions >= 1")  # fmt: skip
    for key in ("beta_fast", "beta_slow"):
        value = scaling.get(key)
        if value is not None and not _finite_positive(value):
            raise bad(f"dims.rope_scaling.{key}", f"got {value!r:.40}; expected a finite positive number")
    value = scaling.get("attention_factor")  # multiplies cos and sin: as the kernels take it, a float32
    if value is not None and not (_finite_positive(value) and 0 < as_float32(value) < math.inf):
        raise bad("dims.rope_scaling.attention_factor", f"got {value!r:.40}; expected a positive number, finite and "
                  "not 0 in float32")  # fmt: skip
    for key in ("mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value)):  # fmt: skip
            raise bad(f"dims.rope_scaling.{key}", f"got {value!r:.40}; expected a finite number")
    if kind == "yarn":
        if scaling.get("factor") is None:
            raise bad("dims.rope_scaling.factor", "missing; yarn scales the frequencies by it")
        if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
            raise bad("dims.rope_scaling.truncate", f"got {scaling['truncate']!r:.40}; expected true or false")
        return
    for key in ("short_factor", "long_factor"):  # the long factors are checked, not used (rope.py)
        factors = scaling.get(key)
        if key == "long_factor" and key not in scaling:
            continue
        if not (isinstance(factors, list) and len(factors) == pairs and all(_finite_positive(f) for f in factors)):
            shown = f"a list of {len(factors)} items" if isinstance(factors, list) else f"{factors!r:.40}"
            raise bad(f"dims.rope_scaling.{key}", f"got {shown}; expected {pairs} finite positive numbers, one per "
                      f"rotated pair of the {2 * pairs} rotary dims")  # fmt: skip


def _check_values(m: Manifest, where: str | Path) -> None:
    """What the types allow but no engine has: sizes out of bounds, non-finite numbers, inconsistent counts."""
    def bad(name: str, message: str, limit: Any = None) -> EngineDirError:
        return EngineDirError(where, name, message, limit)

    d = m.dims
    check_dim_values(d, bad)
    lim = m.limits
    for name, high in _LIMIT_BOUNDS.items():
        value = getattr(lim, name)
        if not 1 <= value <= high:
            raise bad(f"limits.{name}", f"got {value}; expected 1 to {high}", high)
    if lim.block_size not in BLOCK_SIZES:
        raise bad("limits.block_size", f"got {lim.block_size}; one of {', '.join(map(str, BLOCK_SIZES))}")
    if lim.max_num_tokens < lim.max_batch_size:
        raise bad("limits.max_num_tokens", f"{lim.max_num_tokens} is less than max_batch_size {lim.max_batch_size}")
    kv = m.kv_cache
    if [kv.num_kv_blocks, kv.memory_bytes, kv.fraction].count(None) != 2:
        raise bad("kv_cache", "exactly one of num_kv_blocks, memory_bytes, fraction must be set")
    if kv.num_kv_blocks is not None and not 1 <= kv.num_kv_blocks <= MAX_KV_BLOCKS:
        raise bad("kv_cache.num_kv_blocks", f"got {kv.num_kv_blocks}; expected 1 to {MAX_KV_BLOCKS} (int32 block ids)",
                  MAX_KV_BLOCKS)
    if kv.memory_bytes is not None and not 1 <= kv.memory_bytes <= MAX_KV_MEMORY:
        raise bad("kv_cache.memory_bytes", f"got {kv.memory_bytes}; expected 1 to {MAX_KV_MEMORY}", MAX_KV_MEMORY)
    if kv.fraction is not None and not (math.isfinite(kv.fraction) and 0 < kv.fraction <= 1):
        raise bad("kv_cache.fraction", f"got {kv.fraction}; expected a number in (0, 1]")
    if m.dtype not in DTYPE_BYTES:
        raise bad("dtype", f"got {m.dtype!r}; one of {', '.join(DTYPE_BYTES)}")
    if m.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise bad("kv_cache_dtype", f"got {m.kv_cache_dtype!r}; one of {', '.join(KV_CACHE_DTYPES)}")
    eos = [(f"eos_token_ids[{i}]", t) for i, t in enumerate(m.eos_token_ids)]
    for name, token in [("bos_token_id", m.bos_token_id)] + eos:
        if token is not None and not 0 <= token < d.vocab_size:
            raise bad(name, f"token id {token} is outside the vocabulary (vocab_size {d.vocab_size})")
    n = m.tensor_parallel
    if not 1 <= n <= 64 or d.num_heads % n or d.num_kv_heads % n or d.intermediate_size % n:
        raise bad("tensor_parallel", f"got {n}; it must divide num_heads {d.num_heads}, num_kv_heads "
                  f"{d.num_kv_heads} and intermediate_size {d.intermediate_size} (at most 64)")
    if n > 1 and len(m.shards) != n:
        raise bad("shards", f"{len(m.shards)} shards for tensor_parallel {n}")
    for rank, shard in enumerate(m.shards):
        if (set(shard) != {"weights_file", "onnx_file"} or not isinstance(shard["weights_file"], str)
                or not isinstance(shard["onnx_file"], (str, type(None)))):
            raise bad(f"shards[{rank}]", "expected {\"weights_file\": NAME, \"onnx_file\": NAME or null}")
    _check_summaries(m, bad)
    try:
        check_sampling_defaults(m.sampling_defaults)
    except SamplingDefaultError as e:
        raise bad(f"sampling_defaults.{e.field}", e.message) from None
    for name, digest in m.files.items():
        if not _SHA256.fullmatch(digest):
            raise bad(f"files[{name!r}]", f"got {digest[:80]!r}; expected a sha256 hex digest")
    for name, rel in m.file_fields():
        _check_relative(rel, name, where)


_SHA256 = re.compile(r"[0-9a-f]{64}")
QUANTIZED_WEIGHTS = ("int8", "int4")


def _check_summaries(m: Manifest, bad: Any) -> None:
    """The verification and quantization summaries, which inspect prints and the runtime reads: the types their
    readers assume (a hand-edited manifest got a traceback from `inspect`)."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    v = m.verification
    if v and not v.get("skipped"):
        for key in ("max_abs_diff", "tolerance"):
            if not number(v.get(key)):
                raise bad(f"verification.{key}", f"got {v.get(key)!r:.80}; expected a finite number")
    q = m.quantization
    if not q:
        return
    if q.get("weights") not in QUANTIZED_WEIGHTS:
        raise bad("quantization.weights", f"got {q.get('weights')!r:.80}; one of {', '.join(QUANTIZED_WEIGHTS)}")
    group = q.get("group_size")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool) or group < 1):
        raise bad("quantization.group_size", f"got {group!r:.80}; expected a positive integer or null")
    for key in ("lm_head", "activations"):
        if q.get(key) is not None and not isinstance(q[key], str):
            raise bad(f"quantization.{key}", f"got {q[key]!r:.80}; expected a string")
    origin = q.get("origin", {})
    if not isinstance(origin, dict) or not all(isinstance(k, str) and isinstance(n, int) for k, n in origin.items()):
        raise bad("quantization.origin", f"got {origin!r:.80}; expected {{how: module count}}")
    if not isinstance(q.get("modules", {}), dict):
        raise bad("quantization.modules", f"got {q.get('modules')!r:.80}; expected {{module: [bits, group_size]}}")


def _check_relative(rel: str, name: str, where: str | Path) -> None:
    """A path inside the engine dir as written: relative, no `..`, no backslashes or NUL."""
    parts = PurePosixPath(rel).parts
    if (not rel or not parts or "\0" in rel or "\\" in rel or PurePosixPath(rel).is_absolute() or ".." in parts
            or len(rel) > 4096):
        raise EngineDirError(where, name, f"{rel[:200]!r} is not a path inside the engine dir "
                             "(absolute paths and '..' are refused)")


def engine_path(engine_dir: str | Path, rel: str, name: str) -> Path:
    """`engine_dir / rel` once it is known to stay inside the engine dir, symlinks resolved; raises EngineDirError."""
    root = Path(engine_dir).resolve()
    _check_relative(rel, name, root / MANIFEST_NAME)
    full = root / rel
    try:
        real = full.resolve()
    except (OSError, RuntimeError) as e:
        raise EngineDirError(full, name, f"cannot be resolved ({e})") from None
    if real != root and root not in real.parents:
        raise EngineDirError(full, name, f"resolves to {real}, outside the engine dir (a symlink out of it)")
    return real


def read_manifest(engine_dir: str | Path) -> Manifest:
    """Reads and checks `trtpaged.json` of an engine dir (or the dir holding a given engine.plan).

    Raises FileNotFoundError when there is no manifest, EngineDirError when it is unusable: a field of the
    wrong type or out of bounds, an unknown field, or a path that leaves the engine dir.
    """
    path = Path(engine_dir)
    if path.is_file():
        path = path.parent
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        if manifest_path.exists() or manifest_path.is_symlink():  # a FIFO, a dir, a dangling link: not "missing"
            raise EngineDirError(manifest_path, "(file)", "is not a regular file")
        raise FileNotFoundError(f"{path}: not an engine dir (no {MANIFEST_NAME}); build one with `trtpaged build`")
    real = engine_path(path, MANIFEST_NAME, "(manifest)")  # read as checked (resolved): no link swapped in between
    try:
        with open(real, "rb") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise EngineDirError(manifest_path, "(file)", f"cannot be read ({e.strerror or e})") from None
    if len(text) > MAX_MANIFEST_BYTES:
        raise EngineDirError(manifest_path, "(file)", f"larger than {MAX_MANIFEST_BYTES} bytes", MAX_MANIFEST_BYTES)
    manifest = Manifest.from_json(text, manifest_path)
    for name, rel in manifest.file_fields():
        engine_path(path, rel, name)
    return manifest
