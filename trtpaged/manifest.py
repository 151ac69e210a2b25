"""The engine dir manifest (`trtpaged.json`): the contract between builder and runtime.

The builder writes it; the runtime, `trtpaged inspect` and C++ embedders read it.
Field names follow TensorRT-LLM where one exists (max_batch_size, max_num_tokens,
max_seq_len). Bumping FORMAT_VERSION is required for incompatible changes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

FORMAT_VERSION = 1
MANIFEST_NAME = "trtpaged.json"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# KV cache dtypes: the float ones, and the quantized ones (1-byte codes plus an fp16 scale per
# token row of each head, trtpaged.kv_quant)
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
KV_DTYPES = tuple(DTYPE_BYTES) + QUANTIZED_KV_DTYPES
KV_SCALE_BYTES = 2


def kv_row_bytes(head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one token's K (or V) for one head: head_dim values, or head_dim codes and a scale."""
    if kv_cache_dtype in QUANTIZED_KV_DTYPES:
        return head_dim + KV_SCALE_BYTES
    return head_dim * DTYPE_BYTES[kv_cache_dtype]


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

    def kv_bytes_per_token(self, kv_cache_dtype: str) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * kv_row_bytes(self.head_dim, kv_cache_dtype)


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

    num_blocks: Optional[int] = None
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
        data["kv_bytes_per_token"] = self.kv_bytes_per_token
        data["kv_bytes_per_block"] = self.kv_bytes_per_block
        data["kv_bytes_per_token_per_rank"] = self.kv_bytes_per_token_per_rank
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"format_version: engine dir has {version!r}, this trtpaged reads {FORMAT_VERSION}; rebuild the engine"
            )
        data = dict(data)
        data.pop("kv_bytes_per_token", None)
        data.pop("kv_bytes_per_block", None)
        data.pop("kv_bytes_per_token_per_rank", None)
        return cls(
            dims=ModelDims(**data.pop("dims")),
            limits=Limits(**data.pop("limits")),
            kv_cache=KVCacheBudget(**data.pop("kv_cache")),
            **data,
        )


def read_manifest(engine_dir: str | Path) -> Manifest:
    """Reads `trtpaged.json` from an engine dir (or the dir holding a given engine.plan)."""
    path = Path(engine_dir)
    if path.is_file():
        path = path.parent
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path}: not an engine dir (no {MANIFEST_NAME}); build one with `trtpaged build`")
    return Manifest.from_dict(json.loads(manifest_path.read_text()))
