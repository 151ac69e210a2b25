"""The README and docs/ say what the code does: the commands table is the CLI's, links stay in the repo,
the Python snippet answers, and importing trtpaged sets OpenMP waiting before libgomp loads."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_commands_table_is_the_cli_s():
    from trtpaged.commands.reference import END, START, commands_table

    readme = (REPO / "README.md").read_text()
    assert readme.count(START) == 1 and readme.count(END) == 1  # one table (a regeneration once left extra markers)
    table = readme.split(START, 1)[1].split(END, 1)[0].strip()
    assert table == commands_table(), "regenerate it: python -m trtpaged.commands.reference"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_stay_inside_the_repository_and_resolve(doc):
    """Every link is a file of the repository (a web address only on loopback), and its #anchor a heading there."""
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            assert re.match(r"https?://(127\.0\.0\.1|localhost)[:/]", target), f"{doc.name} links out: {target}"
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        assert path.is_relative_to(REPO), f"{doc.name} links outside the repository: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"
        if anchor and path.suffix == ".md":
            assert anchor in heading_anchors(path), f"{doc.name} links to a missing heading: {target}"


def heading_anchors(doc: Path) -> set[str]:
    """The anchors a Markdown renderer gives `doc`'s headings: lower case, punctuation but - and _ dropped, spaces
    as -, a repeated one numbered -1, -2, ... (code blocks' # lines are not headings)."""
    anchors: set[str] = set()
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("env, expected", [({}, "unset 10000"), ({"OMP_WAIT_POLICY": "passive"}, "passive unset"),
                                           ({"GOMP_SPINCOUNT": "1000"}, "unset 1000"),
                                           ({"TRTPAGED_OMP_DEFAULT": "1"}, "unset unset")])
def test_importing_trtpaged_bounds_openmp_spinning_unless_the_user_chose(env, expected):
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TRTPAGED_OMP_DEFAULT")}  # fmt: skip
    code = ("import os, trtpaged; print(os.environ.get('OMP_WAIT_POLICY', 'unset'), "
            "os.environ.get('GOMP_SPINCOUNT', 'unset'))")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == expected


@pytest.mark.slow
def test_readme_python_snippet_answers(smollm2_int4_engine_dir, capsys):
    readme = (REPO / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    snippet = snippet.replace('"engines/smollm2-int4"', repr(str(smollm2_int4_engine_dir)))
    exec(compile(snippet, "README.md", "exec"), {})
    answer = capsys.readouterr().out.splitlines()[0]
    assert "Paris" in answer


TOPIC_DOCS = [doc for doc in DOCS if doc.name != "benchmarks.md"]  # benchmarks.md logs runs of past code too
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu", ".cuh", ".c", ".sh")
# paths the docs name that belong to other projects or to the reader's machine, not to this repository
FOREIGN_PATHS = {"include/NvInfer.h", "include/NvInferRuntime.h", "NvInferRuntime.h", "cuda_fp8.h", "my_app.cpp",
                 "llama.cpp", "vllm/entrypoints/openai/serving_engine.py"}
# a path (a glob, {a,b} alternatives) and its `::test` or `:function`; not a key such as `x/<rank>`
_PATH = re.compile(r"(?<![\w./$-])((?:\.\.?/)?(?:[\w*.{},-]+/)*[\w*{},-]+(?:\.[a-z]+)?/?)(?![<\w/])(::?\w+)?")


def expand_braces(text: str) -> list[str]:
    """`a_{x,y}.cpp` as the names it stands for (`a_x.cpp`, `a_y.cpp`)."""
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    return [name for part in match.group(1).split(",")
            for name in expand_braces(text[:match.start()] + part + text[match.end():])]  # fmt: skip


def named_code_paths(doc: Path):
    """(line, path, name) for each repository path a doc names in code spans or blocks: a source file
    (`x.py`, `src/cpu/`), or a folder under the repository's top-level folders; name is the `::test` or
    `:function` after a file, else None."""
    tops = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    text = re.sub(r"```(?!bash|python|c\b|yaml)\w*\n.*?```", lambda m: "\n" * m.group().count("\n"), doc.read_text(),
                  flags=re.S)  # diagrams and printed output
    for number, line in enumerate(text.splitlines(), 1):
        for match in _PATH.finditer(line):
            path, name = match.group(1), (match.group(2) or "").lstrip(":") or None
            if path.startswith(("http", "engines/")) or "//" in path:
                continue
            # engines/ and build/ hold what the reader builds (absent from a clean checkout, or another build's)
            if path.endswith(SOURCE_SUFFIXES) or ("/" in path and path.split("/")[0] in tops - {"engines", "build"}):
                yield number, path, name


def resolves(path: str, doc: Path) -> list[Path]:
    """The files a named path may mean: from the repository root, trtpaged/ (the docs' `runtime/x.py`),
    plugins/ (`src/cpu/`) or the doc's folder; a bare file name anywhere in the repository."""
    found = []
    for name in expand_braces(path):
        bases = [REPO, REPO / "trtpaged", REPO / "plugins", doc.parent]
        found += [hit for base in bases for hit in base.glob(name.rstrip("/")) if hit.exists()]
        if "/" not in name and not found:
            found += [hit for hit in REPO.rglob(name) if ".git" not in hit.parts and "engines" not in hit.parts]
    return found


@pytest.mark.parametrize("doc", TOPIC_DOCS, ids=lambda p: p.name)
def test_code_paths_the_docs_name_exist(doc):
    """A module renamed or split leaves its old name in the map of the code: every path a doc names is a
    file or folder of the repository, and a `file.py::test` / `file.py:function` is in that file."""
    stale = []
    for number, path, name in named_code_paths(doc):
        if path in FOREIGN_PATHS:
            continue
        hits = resolves(path, doc)
        if not hits:
            stale.append(f"{doc.name}:{number}: {path}")
        elif name and not any(re.search(rf"\b{name}\b", hit.read_text()) for hit in hits if hit.is_file()):
            stale.append(f"{doc.name}:{number}: {path} has no {name}")
    assert not stale, "\n".join(stale)


def cli_options() -> dict[str, set[str]]:
    """Each (sub)command's path ("bench memory") and every option spelling it takes, hidden ones included."""
    import click

    from trtpaged.cli import main

    options: dict[str, set[str]] = {}

    def walk(prefix: str, group: click.Group, ctx: click.Context) -> None:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            path = f"{prefix} {name}".strip()
            if isinstance(command, click.Group):
                walk(path, command, click.Context(command, parent=ctx, info_name=name))
            elif command is not None:
                spellings = (opt for param in command.params
                             for opt in (*param.opts, *getattr(param, "secondary_opts", ())))  # fmt: skip
                options[path] = {"--help", *spellings}

    walk("", main, click.Context(main, info_name="trtpaged"))
    return options


def command_lines(doc: Path):
    """(line, command, text after it) for each trtpaged command a doc shows: `trtpaged CMD ...` or
    `python -m trtpaged.cli CMD ...` anywhere (a shell line continued with a backslash joined), and a code span
    that begins with a command's name (`serve --kv-*`)."""
    commands = sorted(cli_options(), key=len, reverse=True)
    names = "|".join(re.escape(c) for c in commands)
    lines = doc.read_text().replace("\\\n", " ").splitlines()  # a continued line counts as its first line
    for number, line in enumerate(lines, 1):
        for match in re.finditer(rf"(?:\btrtpaged |trtpaged\.cli |`)({names})((?: [^`|;&#\n]*)?)", line):
            yield number, match.group(1), match.group(2)


@pytest.mark.parametrize("doc", TOPIC_DOCS, ids=lambda p: p.name)
def test_options_the_docs_give_a_command_are_its_own(doc):
    """Every option (`--name`, `-o`) a doc shows after a command is one that command takes (`--kv-*`: some
    option so named)."""
    options = cli_options()
    wrong = []
    for number, command, rest in command_lines(doc):
        for flag in re.findall(r"(?<![\w-])(?:--[a-z][a-z0-9-]*\*?|-[a-zA-Z](?![\w-]))", rest):
            known = options[command]
            if not (flag in known or flag.endswith("*") and any(o.startswith(flag[:-1]) for o in known)):
                wrong.append(f"{doc.name}:{number}: `{command}` has no {flag}")
    assert not wrong, "\n".join(wrong)


@functools.cache
def defined_names() -> tuple[dict[str, list[tuple[set[str], list[str]]]], dict[str, list[set[str]]]]:
    """trtpaged's classes (their names: methods, fields, attributes set on self; their bases' names) and
    modules (the names each defines or imports at its top level), by name."""
    import ast

    classes: dict[str, list[tuple[set[str], list[str]]]] = {}
    modules: dict[str, list[set[str]]] = {}
    for path in (REPO / "trtpaged").rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules.setdefault(path.stem, []).append({name for node in tree.body for name in bound_names(node)})
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {name for inner in ast.walk(node) for name in bound_names(inner, attributes=True)}
                classes.setdefault(node.name, []).append((names, [b.id for b in node.bases if isinstance(b, ast.Name)]))
    return classes, modules


def bound_names(node, attributes: bool = False) -> list[str]:
    """The names a statement binds (`x = `, `x: int`, `def x`, `class x`, `import x`; `self.x = ` too)."""
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    found = []
    for target in targets:
        for part in ast.walk(target):
            if isinstance(part, ast.Name):
                found.append(part.id)
            elif attributes and isinstance(part, ast.Attribute):
                found.append(part.attr)
    return found


# names the docs use for an instance rather than the module of that name (`llm.generate`, `dims.max_window`)
INSTANCE_NAMES = {"llm", "dims", "config", "reasoning", "weights"}
FILE_SUFFIXES = {"py", "json", "jsonl", "safetensors", "onnx", "plan", "yaml", "md", "h", "c", "cpp", "so", "gguf"}


@pytest.mark.parametrize("doc", TOPIC_DOCS, ids=lambda p: p.name)
def test_class_and_module_members_the_docs_name_exist(doc):
    """A code span's `Class.member` is defined in that trtpaged class (or a base), and `module.name` at the top
    of that module: a method moved to another class, or a constant renamed, leaves no stale name behind."""
    classes, modules = defined_names()

    def class_has(cls: str, name: str) -> bool:
        return any(name in names or any(class_has(base, name) for base in bases if base != cls)
                   for names, bases in classes.get(cls, []))  # fmt: skip

    stale = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            for owner, name in re.findall(r"(?<![\w/.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b(?![./])", span):
                if name in FILE_SUFFIXES:
                    continue
                if owner in classes and not class_has(owner, name):
                    stale.append(f"{doc.name}:{number}: {owner}.{name}")
                elif (owner not in classes and owner in modules and owner not in INSTANCE_NAMES
                      and not any(name in names for names in modules[owner])):  # fmt: skip
                    stale.append(f"{doc.name}:{number}: {owner}.{name} (module)")
    assert not stale, "\n".join(stale)


def exported_functions(header: str) -> set[str]:
    """The functions a public header of plugins/include/trtpaged declares (TRTPAGED_API)."""
    text = (REPO / "plugins/include/trtpaged" / header).read_text()
    return set(re.findall(r"TRTPAGED_API\b[^;{]*?\b(trtpaged_\w+)\s*\(", text))


@pytest.mark.parametrize("header, doc", [("trtpaged.h", "docs/architecture.md"), ("runtime.h", "docs/embedding.md")])
def test_each_c_function_is_documented_and_each_documented_one_exists(header, doc):
    """The kernel library's C ABI table (architecture.md) and the C runtime's API (embedding.md) name every
    function their header exports, and every `trtpaged_...(` function the docs name is exported or defined."""
    named = {name for word in re.findall(r"\btrtpaged_[\w{},]+", (REPO / doc).read_text())
             for name in expand_braces(word)}  # fmt: skip
    assert exported_functions(header) <= named, f"{doc} omits {sorted(exported_functions(header) - named)}"
    sources = "\n".join(p.read_text() for p in (REPO / "plugins").rglob("*") if p.suffix in (".h", ".cpp", ".cu"))
    called = {name for doc in TOPIC_DOCS for name in re.findall(r"\b(trtpaged_\w+)\(", doc.read_text())}
    assert not {name for name in called if not re.search(rf"\b{name}\b", sources)}


@pytest.mark.parametrize("doc", TOPIC_DOCS, ids=lambda p: p.name)
def test_dotted_trtpaged_names_the_docs_give_import(doc):
    """`trtpaged.runtime.outputs.RequestOutputKind` and the like: the module imports and has the name (ONNX
    and torch op names such as `trtpaged.DequantizeWeight`, whose first part is no module, are not Python's)."""
    import importlib

    missing = []
    for name in sorted(set(re.findall(r"(?<![\w.])trtpaged(?:\.[A-Za-z_]\w*)+", doc.read_text()))):
        parts = name.split(".")
        if not ((REPO / "trtpaged" / parts[1]).is_dir() or (REPO / "trtpaged" / f"{parts[1]}.py").is_file()):
            continue
        obj = importlib.import_module("trtpaged")
        for i, attr in enumerate(parts[1:], 2):
            try:  # a submodule is imported; anything else is an attribute of what came before
                obj = getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(".".join(parts[:i]))
            except ImportError:
                missing.append(name)
                break
    assert not missing, f"{doc.name}: {missing}"
