"""Hostile CLI option values: one error line naming the option, before any work starts, and nothing written.

Each case was accepted before (a FIFO deleted by `build -o`, a traceback after a whole replay, a run of 10**20
requests, a hang on a FIFO, a server bound to every interface)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpaged.cli import main

REPO = Path(__file__).resolve().parents[1]


def _refused(args: list[str], *words: str) -> str:
    r = CliRunner().invoke(main, args)
    last = r.output.strip().splitlines()[-1] if r.output.strip() else ""
    assert r.exit_code in (1, 2) and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "Traceback" not in r.output and last.startswith("Error: "), r.output
    for w in words:
        assert w in last, last
    return last


def test_build_never_replaces_what_is_not_a_directory(tmp_path):
    """`build -o FIFO` moved the FIFO aside and deleted it (only regular files were refused)."""
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    _refused(["build", str(REPO / "examples" / "tiny.yaml"), "-o", str(fifo)], "is not a directory")
    assert fifo.is_fifo()
    _refused(["build", str(fifo)], "not a regular file")  # a FIFO model.yaml blocked the read
    _refused(["build", str(REPO / "examples" / "tiny.yaml"), "-o", ""], "-o", "must not be empty")  # was: the cwd


@pytest.mark.parametrize("args,words", [
    (["bench", "memory", "--trace", "FIFO"], ("--trace", "is not a regular file")),
    (["bench", "memory", "--num-requests", str(10**20)], ("--num-requests", "1<=x<=1000000")),
    (["bench", "memory", "--num-prefixes", "0"], ("--num-prefixes",)),
    (["bench", "memory", "--num-kv-blocks", str(10**20)], ("--num-kv-blocks: must be at most 2147483647",)),
    (["bench", "memory", "--prompt-len", "64:"], ("--prompt-len: expected N or LOW:HIGH",)),
    (["bench", "serve", "--base-url", "abc"], ("--base-url", "is not an http(s) URL")),
    (["bench", "serve", "--base-url", "http://127.0.0.1:99999"], ("--base-url",)),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--think-time", "nan"], ("--think-time",)),
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "16", "--think-time", "inf"], ("--think-time",)),
    (["bench", "throughput", "ENGINE", "--engine2", "SCRATCH"], ("--engine2", "trtpaged.json")),
    (["diagnose", "LOG", "--engine", "ENGINE", "--metrics", "abc"], ("--metrics", "is not an http(s) URL")),
    (["diagnose", "LOG", "--engine", "ENGINE", "--metrics", "http://127.0.0.1:1/m", "--metrics-samples", "0"],
     ("--metrics-samples",)),
    (["serve", "ENGINE", "--host", ""], ("--host", "must not be empty")),
    (["serve", "ENGINE", "--served-model-name", " "], ("--served-model-name", "must not be empty")),
])
def test_a_bad_option_is_refused_before_any_work(tiny_engine_dir, tmp_path, args, words):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt_len": 5, "output_len": 3}\n')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    names = {"FIFO": str(fifo), "ENGINE": str(tiny_engine_dir), "LOG": str(log), "SCRATCH": str(scratch)}
    _refused([names.get(a, a) for a in args], *words)
