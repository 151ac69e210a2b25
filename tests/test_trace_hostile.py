"""Trace and request-log files are untrusted input (`bench memory --trace`, `diagnose`, `bench throughput --trace`).

Each bad file is refused in one line naming the file (and the line and field where there is one), before any
replay or engine load; a request that no KV budget could run is refused by every replay alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpaged.bench.memory_bench import Budget, run_memory_bench
from trtpaged.bench.workload import TraceRequest
from trtpaged.cli import main

from runtime_helpers import one_line_failure



def _file(tmp_path: Path, content: bytes) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(content)
    return str(path)


# what the file holds -> words of the one-line error (the file name is checked too)
BAD = {
    "binary": (b"\xff\xfe\x00{" * 40, "not UTF-8 text (invalid start byte at byte 0)"),
    "deep nesting": (b'{"prompt_len": ' + b"[" * 100_000 + b"]" * 100_000 + b', "output_len": 5}\n',
                     "trace.jsonl:1: not JSON this reader takes (nested too deeply)"),
    "huge prompt_len": (b'{"prompt_len": 1000000000000, "output_len": 5}\n',
                         "trace.jsonl:1: prompt_len: must be at most 16777216, got 1000000000000"),
    "huge n": (b'{"prompt_len": 5, "output_len": 5, "n": 1000000000}\n',
               "trace.jsonl:1: n: must be at most 65536, got 1000000000"),
    # was: "line 1: not JSON", with nothing said about the one-object-per-line form
    "JSON array": (b'[{"prompt_len": 5, "output_len": 5}]\n', "trace.jsonl:1: expected JSON Lines, one request object"),
    "pretty-printed": (b'{\n  "prompt_len": 5,\n  "output_len": 5\n}\n', "trace.jsonl:1: expected JSON Lines"),
    "huge arrival": (b'{"prompt_len": 5, "output_len": 5, "arrival": 100000000000000000000}\n',
                      "arrival: must be at most 2147483647, got 100000000000000000000"),
    # json keeps the last of a repeated field without a word
    "repeated field": (b'{"prompt_len": 5, "output_len": 5, "prompt_len": 9}\n',
                       "trace.jsonl:1: field 'prompt_len' given twice"),
    # was: "TraceRequest.__init__() missing 1 required positional argument" (bench memory)
    "no output_len": (b'{"prompt_len": 5}\n', "trace.jsonl:1: output_len: required"),
    # the replays built a 4-token shared prefix from line 1 and counted line 2's 8 as shared
    "two lengths of one prefix": (b'{"prompt_len": 9, "output_len": 5, "prefix_id": 1, "prefix_len": 4}\n'
                                  b'{"prompt_len": 9, "output_len": 5, "prefix_id": 1, "prefix_len": 8}\n',
                                  "trace.jsonl:2: prefix_len: 8 for prefix_id 1, which"),
    "prefix without an id": (b'{"prompt_len": 9, "output_len": 5, "prefix_len": 4}\n',
                             "trace.jsonl:1: prefix_len: 4 shared with no one"),
    "more beams returned than searched": (b'{"prompt_len": 9, "output_len": 5, "n": 3, "beam_width": 2}\n',
                                          "trace.jsonl:1: n: 3 beams returned of beam_width 2"),
}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("command", ["bench memory", "diagnose", "bench throughput"])
def test_a_bad_trace_is_refused_in_one_line(tiny_engine_dir, tmp_path, command, kind):
    """bench throughput guesses a prompts file from the first line; a first line that was no JSON object (a
    pretty-printed document's "{") was json's own "trace.jsonl:1: Expecting property name enclosed in double quotes"
    there, where the other commands say what form is expected."""
    content, words = BAD[kind]
    path = _file(tmp_path, content)
    args = {"bench memory": ["bench", "memory", "--trace", path, "--num-kv-blocks", "64"],
            "diagnose": ["diagnose", path, "--engine", str(tiny_engine_dir)],
            "bench throughput": ["bench", "throughput", str(tiny_engine_dir), "--trace", path, "--baseline", "none"]}
    one_line_failure(CliRunner().invoke(main, args[command]), words)


@pytest.mark.parametrize("line,words", [
    ('{"prompt_token_ids": [1, -1], "output_len": 5}', "trace.jsonl:1: prompt_token_ids: token id -1 is outside the "
                                                       "vocabulary [0, 320)"),
    ('{"prompt": "caf\\udce9", "output_len": 5}', "trace.jsonl:1: prompt: not valid Unicode text"),
    ('{"prompt_len": 600, "output_len": 5}', "trace.jsonl:1: prompt_len 600 leaves no room for output under "
                                             "max_seq_len 512"),
])
def test_diagnose_refuses_log_lines_the_engine_could_never_run(tiny_engine_dir, tmp_path, line, words):
    # before: each was silently dropped from the replay ("requests queued in 0 of 0 steps"), or a TypeError
    path = _file(tmp_path, (line + "\n").encode())
    one_line_failure(CliRunner().invoke(main, ["diagnose", path, "--engine", str(tiny_engine_dir)]), words)


def test_a_bom_starts_a_trace_as_it_starts_any_utf8_file(tiny_engine_dir, tmp_path):
    """The BOM was stripped for the form check but the line parsed with it: "Unexpected UTF-8 BOM"."""
    path = _file(tmp_path, "\ufeff".encode() + b'{"prompt_len": 5, "output_len": 3}\n')
    r = CliRunner().invoke(main, ["bench", "memory", "--trace", path, "--num-kv-blocks", "64"])
    assert r.exit_code == 0 and "1 requests" in r.output, r.output
    from trtpaged.bench.throughput_bench import load_requests  # bench throughput's reader guesses the form first

    assert len(load_requests(path, lambda text: [5] * len(text), 320)) == 1


@pytest.mark.parametrize("arrival,step_time", [("1e308", "0.1"), ("2.5", "1e-320")])
def test_diagnose_refuses_seconds_past_the_last_step(tiny_engine_dir, tmp_path, arrival, step_time):
    """Seconds over the step time past float's range were an OverflowError traceback (ceil of inf)."""
    path = _file(tmp_path, b'{"prompt_len": 5, "output_len": 3, "arrival": 0.0}\n'
                           + f'{{"prompt_len": 5, "output_len": 3, "arrival": {arrival}}}\n'.encode())
    one_line_failure(CliRunner().invoke(main, ["diagnose", path, "--engine", str(tiny_engine_dir), "--step-time",
                                                step_time]), "trace.jsonl:2: arrival:", "is past step 2147483647")


def test_diagnose_with_a_dir_that_is_not_an_engine_is_one_line(tmp_path):
    path = _file(tmp_path, b'{"prompt_len": 5, "output_len": 5}\n')
    one_line_failure(CliRunner().invoke(main, ["diagnose", path, "--engine", str(tmp_path)]),
                      "not an engine dir (no trtpaged.json)")


@pytest.mark.parametrize("flag,value,words", [
    ("--num-kv-blocks", "0", "--num-kv-blocks: must be an integer >= 1, got 0"),
    ("--block-size", "-3", "--block-size: must be an integer >= 1, got -3"),
    ("--max-num-tokens", "1", "--max-num-tokens: must be >= max_batch_size (256), got 1"),
])
def test_bench_memory_refuses_a_budget_without_room_in_one_line(flag, value, words):
    one_line_failure(CliRunner().invoke(main, ["bench", "memory", "--num-requests", "3", flag, value]), words)


def test_every_replay_refuses_the_same_requests_and_cuts_the_same_outputs():
    # max_seq_len 512: a 600-token prompt and 16 samples (max_batch_size 8) can never run; a 400-token prompt
    # asking for 300 tokens is cut at 112, as a server's length limit cuts it. Before, the paged replays also
    # refused the cut one (and reported the steps of a smaller workload than the contiguous ones ran).
    budget = Budget(num_kv_blocks=128, block_size=16, max_seq_len=512, max_batch_size=8, max_num_tokens=512)
    trace = [TraceRequest(prompt_len=600, output_len=5), TraceRequest(prompt_len=10, output_len=5, n=16),
             TraceRequest(prompt_len=400, output_len=300), TraceRequest(prompt_len=20, output_len=8)]
    report = run_memory_bench(trace, budget)
    policies = {p["policy"]: p for p in report["policies"]}
    assert {name: p["refused"] for name, p in policies.items()} == dict.fromkeys(policies, 2)
    # one decode token per running sequence per step: the longest runs 112 steps from its prompt step
    assert {name: p["steps"] for name, p in policies.items()} == dict.fromkeys(policies, 112)
    r = CliRunner().invoke(main, ["bench", "memory", "--trace", _trace_file(trace), "--num-kv-blocks", "128",
                                  "--max-seq-len", "512", "--max-batch-size", "8", "--max-num-tokens", "512"])
    assert r.exit_code == 0 and "refused, of 4 requests (this budget can never run them)" in r.output, r.output


def _trace_file(trace: list[TraceRequest]) -> str:
    import json
    import tempfile

    path = Path(tempfile.mkdtemp()) / "trace.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": t.prompt_len, "output_len": t.output_len, "n": t.n}) + "\n"
                            for t in trace))
    return str(path)


def test_a_budget_that_refuses_everything_still_reports(tmp_path):
    path = _file(tmp_path, b'{"prompt_len": 100, "output_len": 5}\n')
    r = CliRunner().invoke(main, ["bench", "memory", "--trace", path, "--num-kv-blocks", "2"])  # was: a TypeError
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "refused, of 1 requests (this budget can never run them): contiguous, reserve max_seq_len 1" in r.output


def test_bench_throughput_refuses_a_trace_beyond_max_seq_len_before_loading(tiny_engine_dir, tmp_path, monkeypatch):
    from trtpaged.runtime import llm

    monkeypatch.setattr(llm.LLM, "__init__", lambda *a, **k: pytest.fail("the engine was loaded"))
    path = _file(tmp_path, b'{"prompt": "hello there", "output_len": 600}\n')
    r = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", path, "--baseline", "none"])
    one_line_failure(r, "trace.jsonl:1:", "prompt tokens + output_len 600 exceed the engine's max_seq_len (512)")


COMPRESSED = {  # a file of each form as published, then compressed by hand
    "trace.jsonl": b'{"timestamp": 0, "input_length": 20, "output_length": 4, "hash_ids": [1]}\n',
    "sharegpt.json": b'[{"id": "a", "conversations": [{"from": "human", "value": "hello there, friend"}, '
                     b'{"from": "gpt", "value": "hello to you as well"}]}]',
    "trace.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,20,4\n",
}


@pytest.mark.parametrize("name", list(COMPRESSED))
@pytest.mark.parametrize("command", ["memory", "throughput"])
def test_a_compressed_trace_is_named_as_one(tiny_engine_dir, tmp_path, name, command):
    """A gzip file was "not UTF-8 text (invalid start byte at byte 1)", nothing said of what it is; no published trace
    form is compressed and no reader (vLLM's, aiperf's) decompresses, so it is refused saying how to get its text.
    The decompressed file is read."""
    import gzip

    path = tmp_path / (name + ".gz")
    path.write_bytes(gzip.compress(COMPRESSED[name]))
    args = {"memory": ["bench", "memory", str(tiny_engine_dir), "--num-kv-blocks", "64"],
            "throughput": ["bench", "throughput", str(tiny_engine_dir), "--baseline", "none"]}[command]
    one_line_failure(CliRunner().invoke(main, [*args, "--trace", str(path)]), f"{name}.gz: a gzip-compressed file, "
                     f"not UTF-8 text (invalid start byte at byte 1): decompress it first (gunzip {path}); expected")
    (tmp_path / name).write_bytes(gzip.decompress(path.read_bytes()))
    result = CliRunner().invoke(main, [*args, "--trace", str(tmp_path / name)])
    assert result.exit_code == 0, result.output



FORM_OPTIONS = {"trace.jsonl": ["--step-time", "0.01"], "sharegpt.json": ["--num-requests", "2"],
                "trace.csv": ["--step-time", "0.01"]}  # the option a user gives each form (COMPRESSED's)


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_a_compressed_trace_is_named_as_one_beside_its_forms_option(tiny_engine_dir, tmp_path, name):
    """With the option its form takes (--step-time for a Mooncake or Azure trace, --num-requests for ShareGPT), a
    gzip'd trace was refused for that option ("--step-time: ... --trace trace.csv.gz has none", "--num-requests:
    synthetic workload options"): the form is told by a first line a compressed file does not have in text. It is
    named as compressed, as without the option; the decompressed file takes the option."""
    import gzip

    path = tmp_path / (name + ".gz")
    path.write_bytes(gzip.compress(COMPRESSED[name]))
    memory = ["bench", "memory", str(tiny_engine_dir), "--num-kv-blocks", "64", *FORM_OPTIONS[name]]
    commands = [memory]
    if name == "sharegpt.json":  # throughput takes --num-requests with a ShareGPT trace alone
        commands.append(["bench", "throughput", str(tiny_engine_dir), "--baseline", "none", *FORM_OPTIONS[name]])
    for args in commands:
        one_line_failure(CliRunner().invoke(main, [*args, "--trace", str(path)]), f"{name}.gz: a gzip-compressed "
                         f"file, not UTF-8 text (invalid start byte at byte 1): decompress it first (gunzip {path})")
    (tmp_path / name).write_bytes(gzip.decompress(path.read_bytes()))
    result = CliRunner().invoke(main, [*memory, "--trace", str(tmp_path / name)])
    assert result.exit_code == 0, result.output


SHAREGPT_ENTRY = {"id": "a", "conversations": [{"from": "human", "value": "hello there, friend"},
                                               {"from": "gpt", "value": "hello to you as well"}]}
# TensorRT-LLM's prepare_dataset.py --output (its C++ benchmark's workload); --stdout writes the requests as lines
WORKLOAD = {"metadata": {"workload_type": "token-norm-dist", "max_input_len": 3, "max_output_len": 4},
            "samples": [{"input_len": 3, "input_ids": [7, 8, 9], "output_len": 4, "task_id": -1}]}


@pytest.mark.parametrize("document,words,fixed", [
    (SHAREGPT_ENTRY, "a ShareGPT conversation as a JSON line: a ShareGPT dataset is read as vLLM's benchmarks read it, "
                     "one JSON array of conversations", json.dumps([SHAREGPT_ENTRY])),
    ({"version": 3, "data": [SHAREGPT_ENTRY]}, "a JSON object holding ShareGPT conversations under 'data': a "
                                                "ShareGPT dataset is the array itself", json.dumps([SHAREGPT_ENTRY])),
    (WORKLOAD, "TensorRT-LLM's C++ benchmark workload (prepare_dataset.py --output), which trtllm-bench does not read "
               "either: give the JSON Lines that prepare_dataset.py --stdout", json.dumps(
                   {"task_id": 0, "input_ids": [7, 8, 9], "output_tokens": 4})),
])
@pytest.mark.parametrize("command", ["memory", "throughput", "serve"])
def test_another_tools_document_as_json_lines_is_named(tiny_engine_dir, tmp_path, command, document, words, fixed):
    """Was "unknown field(s) ['conversations', 'id']; allowed: ['arrival', ...]": the line is now named for what it
    is, with what to give; that (the conversations as an array, the workload's sample as a request line) is read."""
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(document) + "\n")
    args = {"memory": ["bench", "memory", str(tiny_engine_dir), "--num-kv-blocks", "64"],
            "throughput": ["bench", "throughput", str(tiny_engine_dir), "--baseline", "none"],
            "serve": ["bench", "serve", "--base-url", "http://127.0.0.1:9"]}[command]
    one_line_failure(CliRunner().invoke(main, [*args, "--trace", str(path)]), "trace.jsonl:1: " + words)
    if command != "serve":  # no server: the fixed file's requests would fail to send
        path.write_text(fixed + "\n")
        result = CliRunner().invoke(main, [*args, "--trace", str(path)])
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("document,words", [
    (SHAREGPT_ENTRY, "a ShareGPT conversation as a JSON line: a ShareGPT dataset is read as vLLM's benchmarks read it"),
    ({"version": 3, "data": [SHAREGPT_ENTRY]}, "a JSON object holding ShareGPT conversations under 'data'"),
])
@pytest.mark.parametrize("command", ["memory", "throughput", "serve"])
def test_sharegpt_lines_given_with_a_sharegpt_option_are_named(tiny_engine_dir, tmp_path, command, document, words):
    """With --num-requests, which a ShareGPT dataset takes, ShareGPT conversations one a line (or held under a key)
    were refused for the option ("--num-requests: synthetic workload options; they cannot apply to --trace ..."),
    and only without it named for what they are: the form decides which options apply, and these have none. Now
    named either way."""
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(document) + "\n" + json.dumps(document) + "\n")
    args = {"memory": ["bench", "memory", str(tiny_engine_dir), "--num-kv-blocks", "64"],
            "throughput": ["bench", "throughput", str(tiny_engine_dir), "--baseline", "none"],
            "serve": ["bench", "serve", "--base-url", "http://127.0.0.1:9"]}[command]  # fmt: skip
    result = CliRunner().invoke(main, [*args, "--trace", str(path), "--num-requests", "4"])
    one_line_failure(result, "trace.jsonl:1: " + words)

@pytest.mark.parametrize("encoding,order", [("utf-16", "little-endian"), ("utf-16-be", "big-endian")])
def test_a_utf16_trace_is_named_as_one(tiny_engine_dir, tmp_path, encoding, order):
    """`prepare_dataset.py --stdout > dataset.jsonl` in Windows PowerShell 5 writes UTF-16 with a byte-order mark: it
    was "not UTF-8 text (invalid start byte at byte 0)", nothing said of what it is. Its UTF-8 text is read."""
    text = '{"task_id": 0, "input_ids": [7, 8, 9], "output_tokens": 4}\r\n'
    path = tmp_path / "dataset.jsonl"
    path.write_bytes(("\ufeff" if encoding == "utf-16-be" else "").encode(encoding) + text.encode(encoding))
    args = ["bench", "throughput", str(tiny_engine_dir), "--baseline", "none", "--trace", str(path)]
    one_line_failure(CliRunner().invoke(main, args), f"dataset.jsonl: UTF-16 text ({order}), not UTF-8 text (invalid "
                     f"start byte at byte 0): convert it first (iconv -f UTF-16 -t UTF-8 {path}); expected")
    path.write_text(path.read_bytes().decode("utf-16"))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "1 trtllm-bench requests (1 as token ids" in result.output, result.output
