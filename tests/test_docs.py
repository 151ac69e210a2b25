"""The README and docs/ say what the code does: the commands table is the CLI's, links stay in the repo,
the Python snippet answers, and importing trtpaged sets OpenMP waiting before libgomp loads."""

from __future__ import annotations

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
