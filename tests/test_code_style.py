"""The Python sources pass ruff with pyproject.toml's [tool.ruff] rules: lines of at most 120 characters (E501),
pyflakes' checks (F: unused imports and variables, undefined names, redefinitions) and syntax errors (E9)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("trtpaged", "tests", "scripts", "examples", "plugins")


def _python_files() -> list[str]:
    """The git-tracked .py files under SOURCE_DIRS; the dirs themselves where this is not a git checkout."""
    dirs = [d for d in SOURCE_DIRS if (ROOT / d).is_dir()]
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *(f"{d}/*.py" for d in dirs)], cwd=ROOT,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return dirs  # ruff finds the .py files itself, skipping what .gitignore names
    return [name for name in listed.decode().split("\0") if name]


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install ruff; scripts/setup.sh installs it)")
    files = _python_files()
    assert files, "no Python files found under " + ", ".join(SOURCE_DIRS)
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             "--config", str(ROOT / "pyproject.toml"), *files], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, f"ruff check found violations:\n{result.stdout}{result.stderr}"
