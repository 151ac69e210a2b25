"""The package's layers import in one direction: builder and runtime share a contract layer
(manifest, KV budget, memory plan, step I/O, TensorRT environment, setting names) and never import each other.

Read from the source (every import statement, also those inside functions), so a lazy import
cannot hide a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trtpaged"
CONTRACT = ("trtpaged.manifest", "trtpaged.kv_formats", "trtpaged.kv_budget", "trtpaged.memory_plan",
            "trtpaged.step_io", "trtpaged.tensorrt_env", "trtpaged.names", "trtpaged.kv_quant",
            "trtpaged.sampling_defaults", "trtpaged.json_input")  # docs/architecture.md's contract layer
# layer -> packages its modules must not import
FORBIDDEN = {
    "trtpaged.runtime": ("trtpaged.builder",),
    "trtpaged.builder": ("trtpaged.runtime", "trtpaged.server"),
    "trtpaged.models": ("trtpaged.builder", "trtpaged.runtime", "trtpaged.server"),
    **{name: ("trtpaged.builder", "trtpaged.runtime", "trtpaged.server") for name in CONTRACT},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_layers_import_in_one_direction() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        rules = [banned for layer, banned in FORBIDDEN.items() if _within(module, layer)]
        for lineno, imported in _imports(path):
            if any(_within(imported, b) for banned in rules for b in banned):
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{lineno} imports {imported}")
    assert not violations, "\n".join(sorted(set(violations)))


@pytest.mark.parametrize("module", CONTRACT)
def test_contract_modules_exist(module: str) -> None:
    assert (PACKAGE.parent / (module.replace(".", "/") + ".py")).is_file(), module
