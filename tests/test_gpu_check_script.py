"""scripts/gpu_check.sh runs only where a GPU is lent, so CI checks what it can without one: the shell
parses, every embedded Python program compiles, and every name it imports from trtpaged exists."""

from __future__ import annotations

import ast
import importlib
import re
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
E2E = SCRIPT.with_name("gpu_e2e.py")
HEREDOC = re.compile(r"<<'(\w+)'[^\n]*\n(.*?)\n\1\n", re.S)


def _python_blocks() -> list[tuple[int, str]]:
    text = SCRIPT.read_text()
    blocks = [(text[: m.start()].count("\n") + 2, m.group(2)) for m in HEREDOC.finditer(text) if m.group(1) == "PY"]
    assert blocks, "gpu_check.sh has no embedded Python (<<'PY' ... PY): the pattern here is out of date"
    return blocks


def test_shell_syntax() -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("line,source", _python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_embedded_python_compiles_and_its_trtpaged_imports_exist(line: int, source: str) -> None:
    tree = compile(source, f"{SCRIPT.name}:{line}", "exec", ast.PyCF_ONLY_AST)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trtpaged"):
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("trtpaged"):
                    importlib.import_module(a.name)
    assert not missing, f"gpu_check.sh (Python block at line {line}) imports names that do not exist: {missing}"


def _trtpaged_imports_missing(tree: ast.AST) -> list[str]:
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trtpaged"):
            module = importlib.import_module(node.module)
            missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    return missing


def test_e2e_script_is_run_by_the_check_and_its_imports_exist() -> None:
    """scripts/gpu_e2e.py (the end-to-end step): called by gpu_check.sh, compiles, its trtpaged names exist, its
    --help runs without a GPU, and its build settings parse as a model.yaml."""
    assert "scripts/gpu_e2e.py" in SCRIPT.read_text()
    tree = compile(E2E.read_text(), str(E2E), "exec", ast.PyCF_ONLY_AST)
    assert not _trtpaged_imports_missing(tree)
    r = subprocess.run([sys.executable, str(E2E), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--seconds" in r.stdout, r.stderr
    spec = importlib.util.spec_from_file_location("gpu_e2e", E2E)
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    from trtpaged.config import parse_config

    for scheme, quantization in e2e.SCHEMES.items():
        data = {"model": {"tiny": {}}, "dtype": "float16", "max_batch_size": 64, "max_num_tokens": 4096,
                "max_seq_len": 512, "kv_cache": {"memory": "8GiB"}, "backend": "torch"}
        if quantization:
            data["quantization"] = quantization
        assert parse_config(data).quantization.enabled == (scheme != "fp16")


def test_e2e_step_profile_runs_on_the_cpu(tiny_engine_dir) -> None:
    """The profile step's code path without a GPU: a wall time per token, no kernel launches, no device time."""
    spec = importlib.util.spec_from_file_location("gpu_e2e", E2E)
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    got = e2e.step_profile(tiny_engine_dir, list(range(5, 21)), new=4, device="cpu")
    assert got["wall_ms_per_token"] > 0 and got["launches_per_token"] == 0 == got["device_busy_ms_per_token"]
    assert "kernel launches" in e2e.PROFILE_LINE.format(**got)
