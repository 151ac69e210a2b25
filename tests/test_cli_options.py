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
    # generate's errors name its flags, not SamplingParams' fields (max_tokens, beam_width)
    (["generate", "ENGINE", "--prompt", "hi", "--max-tokens", "0"], ("--max-tokens: must be >= 1",)),
    (["generate", "ENGINE", "--prompt", "hi", "--n", "3", "--beam-width", "2"], ("--n: at most --beam-width (2)",)),
    (["generate", "ENGINE", "--prompt", "hi", "--top-p", "2"], ("--top-p: must be in (0, 1]",)),
    (["generate", "ENGINE", "--prompt", "hi", "--speculative-config", '{"method": "x"}'],
     ("--speculative-config: method",)),
    # a prompt limit max_seq_len never lets through was accepted (--device bogus: before the fix, fail, not serve)
    (["serve", "ENGINE", "--port", "0", "--device", "bogus", "--max-prompt-tokens", "512"],
     ("--max-prompt-tokens", "512 is more than the engine's max_seq_len 512", "at most 511")),
    (["serve", "ENGINE", "--port", "0", "--device", "bogus", "--max-seq-len", "256", "--max-prompt-tokens", "300"],
     ("--max-prompt-tokens", "--max-seq-len 256", "at most 255")),
    # the KV tier flags' errors named kv_tiers.host_memory / kv_tiers.disk.size
    (["serve", "ENGINE", "--port", "0", "--kv-host-memory", "abc"], ("--kv-host-memory", "is not a size")),
    (["serve", "ENGINE", "--port", "0", "--kv-host-memory", "100"], ("--kv-host-memory: 100 bytes hold no block",)),
    (["serve", "ENGINE", "--port", "0", "--kv-disk-path", "SCRATCH", "--kv-disk-size", "10"],
     ("--kv-disk-size: 10 bytes hold no block",)),
    # inspect's --avg-len and --memory were unbounded (0 sequences of 10**29 tokens; 10**42 bytes)
    (["inspect", "ENGINE", "--avg-len", str(10**29)], ("--avg-len", "1<=x<=16777216")),
    (["inspect", "ENGINE", "--avg-len", "513"], ("--avg-len", "more than the engine's max_seq_len 512")),
    (["inspect", "ENGINE", "--memory", "2PiB"], ("--memory", "1 PiB")),
    (["inspect", "ENGINE", "--memory", "0"], ("--memory", "0 bytes")),
    # --plot: a suffix matplotlib cannot write failed as a traceback after the whole replay
    (["bench", "memory", "--num-requests", "2", "--plot", "SCRATCH/plot.xyz"], ("--plot", "no .xyz file")),
    (["bench", "memory", "--num-requests", "2", "--plot", "FIFO"], ("--plot", "is not a regular file")),
    (["bench", "memory", "--num-requests", "2", "--plot", "SCRATCH/none/plot.png"], ("--plot", "does not exist")),
    # bench kv-tiers: --rows ran a row given twice once; sizes were refused only when their row's server started
    # (--multi-turn 0:0: before the fix, a quick error without the words, instead of a run)
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "16", "--rows", "host,host", "--multi-turn", "0:0"],
     ("--rows", "host given more than once")),
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "16", "--rows", "off,", "--multi-turn", "0:0"],
     ("--rows", "an empty name")),
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "16", "--host-memory", "abc", "--multi-turn", "0:0"],
     ("--host-memory", "is not a size")),
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "16", "--rows", "off,host", "--host-memory", "100"],
     ("--host-memory: 100 bytes hold no block",)),
    # every turn failed (HTTP 400: the prompt needs more blocks than the whole pool), then a table of zeros, exit 0
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "16", "--rows", "off", "--multi-turn", "2:1",
      "--think-time", "0"], ("--num-kv-blocks 16: the pool holds 256 tokens", "turn 1's prompt has", "give at least")),
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "64", "--rows", "off", "--multi-turn", "2:2",
      "--think-time", "0"], ("turn 2's prompt", "more than the engine's max_seq_len 512")),
    # bench: a dir that is no engine was a read_manifest traceback; huge values ran for ever, overflowed or allocated
    *[(["bench", cmd, "SCRATCH", *more], ("ENGINE", "not an engine dir")) for cmd, more in
      (("structured", ()), ("serve-ratio", ()), ("kv-tiers", ("--num-kv-blocks", "4")))],
    (["bench", "structured", "ENGINE", "--repeats", str(10**12)], ("--repeats", "1<=x<=1000")),
    (["bench", "serve-ratio", "ENGINE", "--repeats", str(10**12)], ("--repeats", "1<=x<=1000")),
    (["bench", "throughput", "ENGINE", "--peer-time-limit", "1e300"], ("--peer-time-limit", "0<x<=604800")),
    (["bench", "throughput", "ENGINE", "--baseline", "none", "--hf-batch-size", "4"],
     ("--hf-batch-size", "--baseline none runs no baseline")),
    (["bench", "throughput", "ENGINE", "--sequential", "--hf-batch-size", "4"], ("--hf-batch-size", "--sequential")),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--request-rate", "abc"],
     ("--request-rate: must be > 0 or inf, got 'abc'",)),
    (["bench", "serve", "--base-url", "http://127.0.0.1:1", "--multi-turn", f"{10**12}:{10**12}"],
     ("--multi-turn", "at most 1000000")),
    (["bench", "kv-tiers", "ENGINE", "--num-kv-blocks", "8", "--multi-turn", f"{10**12}:4"],
     ("--multi-turn", "at most 1000000")),
    (["bench", "qlinear", "--working-set-mb", str(1 << 20)], ("--working-set-mb", "available memory", "at most")),
    # bench memory's synthetic requests: were refused naming the trace fields (beam_width, n, prefix_len, prompt_len)
    (["bench", "memory", "ENGINE", "--beam-width", "100000"], ("--beam-width", "1<=x<=65536")),
    (["bench", "memory", "ENGINE", "--n", "5", "--beam-width", "2"], ("--n 5", "at most --beam-width (2)")),
    (["bench", "memory", "ENGINE", "--shared-prefix", "-5"], ("--shared-prefix", "0<=x<=16777216")),
    (["bench", "memory", "ENGINE", "--shared-prefix", "16777000", "--prompt-len", "300"],
     ("--shared-prefix 16777000 + --prompt-len up to 300", "at most 16777216")),
])
def test_a_bad_option_is_refused_before_any_work(tiny_engine_dir, tmp_path, args, words):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt_len": 5, "output_len": 3}\n')
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    names = {"FIFO": str(fifo), "ENGINE": str(tiny_engine_dir), "LOG": str(log), "SCRATCH": str(scratch)}
    _refused([names.get(a, a).replace("SCRATCH/", f"{scratch}/") for a in args], *words)
    assert not any(scratch.iterdir()), list(scratch.iterdir())  # nothing written


def test_serve_refuses_a_fifo_request_log(tiny_engine_dir, tmp_path):
    """`serve --request-log FIFO` blocked in open() until a reader came: a server that never started, silent."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the fix: the open goes through, --device fails
    try:
        _refused(["serve", str(tiny_engine_dir), "--port", "0", "--device", "bogus", "--request-log", str(fifo)],
                 "--request-log", "is not a regular file")
    finally:
        os.close(reader)
    assert fifo.is_fifo()


@pytest.mark.parametrize("name, magic", [("plot", b"\x89PNG"), ("plot.png", b"\x89PNG"), ("plot.svg", b"<?xml")])
def test_plot_writes_exactly_the_path_given(tmp_path, name, magic):
    """`bench memory --plot PATH` wrote PATH.png when PATH had no suffix."""
    r = CliRunner().invoke(main, ["bench", "memory", "--num-requests", "2", "--plot", str(tmp_path / name)])
    assert r.exit_code == 0, r.output
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no PATH.png beside it, no temporary file left
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_serve_takes_vllms_spellings_of_its_limits(tiny_engine_dir):
    """A vLLM user's `--max-model-len`, `--max-num-seqs`, `--max-num-batched-tokens` and `--no-enable-prefix-caching`
    set trtpaged's own limits (they were 'no such option', with suggestions of other limits)."""
    from trtpaged.commands.serve import command as serve

    ctx = serve.make_context("serve", [str(tiny_engine_dir), "--max-model-len", "256", "--max-num-seqs", "4",
                                       "--max-num-batched-tokens", "128", "--no-enable-prefix-caching",
                                       "--gpu-memory-utilization", "0.5"])  # fmt: skip
    got = {k: ctx.params[k] for k in ("max_seq_len", "max_batch_size", "max_num_tokens", "enable_prefix_caching",
                                      "gpu_memory_utilization")}  # fmt: skip
    assert got == {"max_seq_len": 256, "max_batch_size": 4, "max_num_tokens": 128, "enable_prefix_caching": False,
                   "gpu_memory_utilization": 0.5}  # fmt: skip


def test_build_of_a_checkpoint_dir_says_which_yaml_builds_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(main, ["build", str(tmp_path)])
    assert result.exit_code == 2 and f"model: {{hf_dir: {tmp_path}}}" in result.output


def test_generate_says_greedy_samples_are_one_answer_repeated(tiny_engine_dir):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--n", "2", "--max-tokens",
                                       "2", "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0 and "the samples are one answer repeated" in result.output
    sampled = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--n", "2", "--max-tokens",
                                        "2", "--temperature", "1", "--device", "cpu"])  # fmt: skip
    assert sampled.exit_code == 0 and "one answer repeated" not in sampled.output
