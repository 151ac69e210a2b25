"""Mooncake traces (timestamp, input_length, output_length, hash_ids) as `--trace` of bench memory, throughput and
serve: the prompts' sharing is exactly the hash ids' (token equality of the shared blocks, a difference at the first
block whose ids differ), the replays' prefix-cache hits are what block arithmetic on those prompts predicts, bench
serve sends each request at its timestamp (a real tiny-engine server's request log says when each arrived), and a
bad file is refused in one line naming the line, the field and the bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from trtpaged.bench.mooncake import is_mooncake, read_mooncake
from trtpaged.bench.serve_bench import prompts_from_trace
from trtpaged.bench.token_blocks import BLOCK_TOKENS
from trtpaged.bench.workload import TraceRequest, load_trace, prompt_token_ids
from trtpaged.cli import main

from runtime_helpers import one_line_failure

TINY_VOCAB, TINY_BLOCK = 320, 16  # examples/tiny.yaml


def _line(timestamp: int, input_length: int, hash_ids: list[int], output_length: int = 4) -> dict:
    return {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids}


def _write(tmp_path: Path, lines: list, name: str = "mooncake.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _common(a: list, b: list) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# a tree of shared prefixes, out of timestamp order in the file: [1] is every request's root but two
TREE = [_line(2000, 700, [1, 3]), _line(0, 600, [1, 2]), _line(1000, 1000, [1, 2]), _line(3000, 300, [4]),
        _line(3000, 512, [1])]  # fmt: skip


# ---------------------------------------------------------------- the prompts: sharing exactly the hash ids'


@pytest.mark.parametrize("seed", [0, 3])
def test_prompts_share_exactly_their_leading_blocks_with_equal_ids(tmp_path, seed):
    trace = read_mooncake(_write(tmp_path, TREE))
    assert [r.time_ns // 10**6 for r in trace.requests] == [0, 1000, 2000, 3000, 3000] and trace.reordered == 2
    assert [r.where.rsplit(":", 1)[1] for r in trace.requests] == ["2", "3", "1", "4", "5"]  # ties in file order
    a, b, c, d, e = prompt_token_ids(trace.trace(), TINY_VOCAB, seed)  # [1,2] 600, [1,2] 1000, [1,3], [4], [1] 512
    assert [len(p) for p in (a, b, c, d, e)] == [600, 1000, 700, 300, 512]
    assert all(1 <= t < TINY_VOCAB for p in (a, b, c, d, e) for t in p)
    assert b[:600] == a and e == a[:512]  # [1, 2] cut at 600 is the start of [1, 2] at 1000; [1] is their block 1
    assert _common(b, c) == BLOCK_TOKENS  # equal through block 1, different from block 3's first token on
    assert _common(a, d) == 0 and _common(d, c) == 0  # no id in common: nothing shared
    # one id, one block: the same tokens whatever the requests around it and their order
    again = prompt_token_ids([trace.trace()[i] for i in (4, 2, 0)], TINY_VOCAB, seed)
    assert again == [e, c, a]
    other = prompt_token_ids(trace.trace(), TINY_VOCAB, seed + 1)
    assert other[0] != a and _common(other[1], other[2]) == BLOCK_TOKENS  # another seed: other blocks, same sharing


def test_serve_prompts_share_exactly_their_leading_blocks_of_words(tmp_path):
    trace = read_mooncake(_write(tmp_path, TREE))
    a, b, c, d, e = (r.prompt.split(" ") for r in prompts_from_trace(trace.trace(), seed=5))
    assert [len(w) for w in (a, b, c, d, e)] == [600, 1000, 700, 300, 512]
    assert b[:600] == a and e == a[:512] and _common(b, c) == BLOCK_TOKENS and _common(a, d) == 0


def test_the_other_trace_forms_read_as_before(tmp_path):
    """A trace line of trtpaged's own form is no Mooncake line, and reads unchanged (no hash_ids)."""
    path = _write(tmp_path, [{"prompt_len": 20, "output_len": 4, "prefix_id": 1, "prefix_len": 8}], "trace.jsonl")
    assert not is_mooncake(path)
    assert load_trace(path) == [TraceRequest(20, 4, prefix_id=1, prefix_len=8)]
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(_line(0, 10, [1])).encode() + b"\n")
    assert is_mooncake(bom) and read_mooncake(bom).trace() == [TraceRequest(10, 4, hash_ids=(1,))]


# ---------------------------------------------------------------- bench memory and throughput: the prefix-cache hits


def _predicted_hits(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens a prefix cache finds when the requests run one after another, each prompt's full blocks cached
    once computed (a block holding output tokens matches no prompt): per request, the longest run of full blocks it
    shares with an earlier prompt's full blocks, never its last token (its logits are needed)."""
    hits = 0
    for i, p in enumerate(prompts):
        cached = max((min(_common(p, q), len(q)) // block_size for q in prompts[:i]), default=0)
        hits += min(cached, (len(p) - 1) // block_size) * block_size
    return hits


def test_cli_bench_memory_finds_the_hits_the_blocks_predict(tiny_engine_dir, tmp_path):
    """Arrivals 100 steps apart (10 ms a step): each request runs alone after the ones before it finished, so every
    prefix hit is one that block arithmetic on the prompts predicts (1600 of 3112 prompt tokens)."""
    path = _write(tmp_path, TREE)
    prompts = prompt_token_ids(read_mooncake(path).trace())  # bench memory's own prompts (vocab 30000, seed 0)
    expected = _predicted_hits(prompts, TINY_BLOCK)
    assert expected == 592 + 512 + 0 + 496  # [1,2] 1000 after [1,2] 600: 37 blocks; [1,3]: block 1; [1] 512: 31
    result = CliRunner().invoke(main, ["bench", "memory", str(tiny_engine_dir), "--trace", str(path), "--step-time",
                                       "0.01", "--max-seq-len", "2048", "--num-kv-blocks", "1024",
                                       "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "5 Mooncake requests, 4 distinct 512-token blocks (2 in more than one request)" in result.output
    assert "2 lines earlier than a line before, taken in timestamp order" in result.output
    assert "--step-time 0.01: arrivals at steps 0 to 300" in result.output
    report = json.loads(result.output[result.output.index("\n{") + 1:])
    policies = {p["policy"]: p for p in report["policies"]}
    assert policies["paged + sharing"]["prefix_hit_tokens"] == expected
    assert policies["paged + sharing"]["prefix_query_tokens"] == sum(len(p) for p in prompts) == 3112
    assert policies["paged"]["prefix_hit_tokens"] == 0 and policies["paged"]["preemptions"] == 0



def test_a_request_no_replay_runs_gets_no_prompt_drawn(tmp_path):
    """bench memory on Mooncake's FAST'25 conversation trace (12,031 requests, every one past the tiny engine's 512
    tokens) took 59 s and 5.2 GB to report all of them refused: the paged replays drew each refused request's blocks
    (tens of thousands of tokens) and never read them. Now only the requests that can run get prompts: 40 refused
    requests of 64 blocks each beside TREE allocate well under what their prompts would hold, and TREE's hits are
    the ones its blocks predict (test_cli_bench_memory_finds_the_hits_the_blocks_predict)."""
    import tracemalloc

    from trtpaged.bench.memory_bench import Budget, simulate_paged

    tree = read_mooncake(_write(tmp_path, TREE)).arrival_steps(0.01)
    refused = [TraceRequest(64 * BLOCK_TOKENS, 4, hash_ids=tuple(range(1000 + 64 * i, 1064 + 64 * i)))
               for i in range(40)]  # fmt: skip
    budget = Budget(num_kv_blocks=1024, block_size=TINY_BLOCK, max_seq_len=2048, max_batch_size=8,
                    max_num_tokens=2048)  # fmt: skip
    tracemalloc.start()
    try:
        result = simulate_paged(refused + tree, budget, sharing=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.refused == 40 and result.prefix_hit_tokens == 592 + 512 + 0 + 496
    assert peak < 16 << 20, peak  # the refused prompts alone: 40 x 32768 token ids, over 40 MB as Python lists


def test_cli_bench_memory_fills_n_on_every_mooncake_line(tmp_path):
    path = _write(tmp_path, [_line(0, 40, [1]), _line(0, 30, [1])])
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path), "--n", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("\n{") + 1:])["sequences"] == 6


def test_cli_bench_throughput_finds_the_hits_the_blocks_predict(tiny_engine_dir, tmp_path):
    """One request at a time (--sequential): 688 prompt tokens found cached, as predicted, and the row with prefix
    caching off computes exactly those 688 tokens more (max_seq_len 512: one block a prompt)."""
    path = _write(tmp_path, [_line(30, 450, [7]), _line(0, 300, [7]), _line(10, 400, [7]), _line(20, 200, [8])])
    prompts = prompt_token_ids(read_mooncake(path).trace(), TINY_VOCAB, seed=2)
    expected = _predicted_hits(prompts, TINY_BLOCK)
    assert expected == 288 + 0 + 400  # 300 -> 400: 18 blocks; 400 -> 450: 25
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(path),
                                       "--baseline", "none", "--sequential", "--no-prefix-caching-row", "--seed", "2",
                                       "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "timestamps not replayed" in result.output
    report = json.loads(result.output[result.output.index("\n{") + 1:])
    on, off = report["systems"]
    assert report["prompt_tokens"] == sum(len(p) for p in prompts) == 1350
    assert on["prefix_hit_tokens"] == expected and off["prefix_hit_tokens"] == 0
    assert off["computed_tokens"] - on["computed_tokens"] == expected


# ---------------------------------------------------------------- bench serve: each request at its timestamp


def _second_run_and_its_peak(args: list[str]) -> tuple[Any, int]:
    """The CLI run with `args` a second time, and the peak of the Python memory it allocated (the first run, untraced,
    leaves its imports out of the count)."""
    import tracemalloc

    CliRunner().invoke(main, args)
    tracemalloc.start()
    try:
        result = CliRunner().invoke(main, args)
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("form", ["Mooncake", "trtpaged"])
def test_bench_throughput_refuses_a_long_request_before_drawing_any_prompt(tiny_engine_dir, tmp_path, form):
    """bench throughput on Mooncake's FAST'25 conversation trace (12,031 requests, line 1 past the tiny engine's 512
    tokens) took 52 s and 3.2 GB to say line 1 was too long: every prompt was drawn first, then checked. A trace's
    lengths are checked first: 160 requests of 32k tokens are refused naming line 1 with well under what their
    prompts would hold allocated (the command run once before, untraced, so its imports are not counted)."""
    lines = [_line(0, 64 * BLOCK_TOKENS, list(range(64 * i, 64 * i + 64))) if form == "Mooncake"
             else {"prompt_len": 64 * BLOCK_TOKENS, "output_len": 4} for i in range(160)]  # fmt: skip
    args = ["bench", "throughput", str(tiny_engine_dir), "--baseline", "none", "--trace", str(_write(tmp_path, lines))]
    result, peak = _second_run_and_its_peak(args)
    one_line_failure(result, "mooncake.jsonl:1: 32768 prompt tokens + output_len 4 exceed the engine's max_seq_len")
    assert peak < 32 << 20, peak  # the command's own ~17 MB; the prompts: 160 x 32768 token ids, 100 MB more


def test_diagnose_refuses_a_request_it_can_never_run_by_its_line_before_drawing_prompts(tiny_engine_dir, tmp_path):
    """diagnose on Mooncake's FAST'25 conversation trace (every request past the tiny engine's 512 tokens) took 24 s
    and 2.9 GB to say 'request 1: prompt_len 6758 leaves no room ...': every prompt was drawn before the budget was
    checked, and a timed trace's requests did not carry their lines. The first request in replay order (line 2, the
    earliest timestamp) is named by its line, with well under what 160 prompts of 32k tokens would hold allocated
    (the command run once before, untraced, so its imports are not counted)."""
    lines = [_line(5000 - i, 64 * BLOCK_TOKENS, list(range(64 * i, 64 * i + 64))) for i in range(160)]
    lines[1]["timestamp"] = 0
    args = ["diagnose", str(_write(tmp_path, lines)), "--engine", str(tiny_engine_dir), "--step-time", "0.01"]
    result, peak = _second_run_and_its_peak(args)
    one_line_failure(result, "mooncake.jsonl:2: prompt_len 32768 leaves no room for output under max_seq_len 512")
    assert peak < 32 << 20, peak  # the prompts: 160 x 32768 token ids, 100 MB more


def test_cli_bench_serve_sends_each_request_at_its_timestamp(logged_server, tiny_engine_dir, tmp_path):
    """The server's log: the requests arrived in timestamp order (not the file's), 0.5 s apart as the timestamps
    say (counted from the first, 1000 ms here), with the prompts their blocks make (the shorter [1] a prefix of the
    longer, in tokens)."""
    server, lines = logged_server
    path = _write(tmp_path, [_line(2000, 30, [1]), _line(1500, 25, [2]), _line(1000, 20, [1]), _line(2500, 35, [1])])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_engine_dir / "tokenizer"))
    sent = prompts_from_trace(read_mooncake(path).trace(), seed=4)  # timestamp order: 1000, 1500, 2000, 2500
    expected = [tokenizer(r.prompt).input_ids for r in sent]
    seen = len(lines(0, timeout=0))
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--trace", str(path), "--seed", "4",
                                       "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("\n{") + 1:])
    assert report["completed"] == 4 and report["failed"] == 0 and report["request_rate"] == "trace"
    assert report["duration"] >= 1.5
    run = sorted(lines(seen + 5)[seen + 1:], key=lambda line: line["arrival"])  # the uncounted warm-up first
    assert [line["prompt_token_ids"] for line in run] == expected
    gaps = [line["arrival"] - run[0]["arrival"] for line in run]
    # sent late on a loaded machine perhaps, never early: all at once (timestamps ignored) reads gaps of 0
    assert all(want - 0.1 < gap < want + 0.45 for gap, want in zip(gaps, (0.0, 0.5, 1.0, 1.5))), gaps
    assert expected[0] == expected[2][:len(expected[0])] and expected[2] == expected[3][:len(expected[2])]


# ---------------------------------------------------------------- refused, in one line


GOOD = _line(0, 600, [1, 2])
HOSTILE = {
    "negative input_length": ({**GOOD, "input_length": -5}, "input_length: must be from 1 to 16777216, got -5"),
    "huge input_length": ({**GOOD, "input_length": 10**15}, "input_length: must be from 1 to 16777216, got 10000"),
    "input_length not an integer": ({**GOOD, "input_length": 600.5},
                                    "input_length: must be an integer from 1 to 16777216, got 600.5"),
    "input_length a string": ({**GOOD, "input_length": "600"},
                              "input_length: must be an integer from 1 to 16777216, got '600'"),
    "zero output_length": ({**GOOD, "output_length": 0}, "output_length: must be from 1 to 16777216, got 0"),
    "output_length true": ({**GOOD, "output_length": True},
                           "output_length: must be an integer from 1 to 16777216, got True"),
    "negative timestamp": ({**GOOD, "timestamp": -1}, "timestamp: must be from 0 to 2147483647 (milliseconds"),
    "huge timestamp": ({**GOOD, "timestamp": 10**20}, "timestamp: must be from 0 to 2147483647"),
    "negative fractional timestamp": ({**GOOD, "timestamp": -0.5}, "timestamp: must be from 0 to 2147483647 "
                                                                   "(milliseconds since the trace's start), got -0.5"),
    "huge fractional timestamp": ({**GOOD, "timestamp": 3e9}, "timestamp: must be from 0 to 2147483647 (milliseconds "
                                                              "since the trace's start), got 3000000000.0"),
    "string timestamp": ({**GOOD, "timestamp": "1.5"}, "timestamp: must be a number from 0 to 2147483647 "
                                                       "(milliseconds since the trace's start), got '1.5'"),
    "infinite timestamp": ('{"timestamp": 1e400, "input_length": 5, "output_length": 4, "hash_ids": [1]}',
                           "timestamp: must be a number from 0 to 2147483647 (milliseconds since the trace's "
                           "start), got inf"),
    "NaN timestamp": ('{"timestamp": NaN, "input_length": 5, "output_length": 4, "hash_ids": [1]}',
                      "timestamp: must be a number from 0 to 2147483647 (milliseconds since the trace's start), "
                      "got nan"),
    "hash_ids not a list": ({**GOOD, "hash_ids": 7}, "hash_ids: must be a list of integers (one block id per 512"),
    "empty hash_ids": ({**GOOD, "input_length": 5, "hash_ids": []}, "hash_ids: must name at least one block"),
    "a string hash id": ({**GOOD, "hash_ids": [1, "2"]},
                         "hash_ids[1]: must be an integer from 0 to 9223372036854775807, got '2'"),
    "a nested hash id": ({**GOOD, "hash_ids": [[1], 2]},
                         "hash_ids[0]: must be an integer from 0 to 9223372036854775807, got [1]"),
    "a negative hash id": ({**GOOD, "hash_ids": [1, -2]}, "hash_ids[1]: must be from 0 to 9223372036854775807, got -2"),
    "a huge hash id": ({**GOOD, "hash_ids": [2**64, 2]}, "hash_ids[0]: must be from 0 to 9223372036854775807"),
    "more tokens than blocks": ({**GOOD, "input_length": 1025}, "input_length: 1025 tokens over 2 hash_ids: must be "
                                                                "from 513 to 1024"),
    "a block with no token": ({**GOOD, "input_length": 512}, "input_length: 512 tokens over 2 hash_ids: must be from "
                                                             "513 to 1024"),
    "no hash_ids": ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "hash_ids: required (a Mooncake line is"),
    "no timestamp nor output_length": ({"input_length": 5, "hash_ids": [1]}, "timestamp, output_length: required"),
    "an unknown field": ({**GOOD, "text_input": "hi"}, "unknown field(s) ['text_input']"),
    "a repeated field": ('{"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [1], "timestamp": 9}',
                         "field 'timestamp' given twice"),
    "a trtpaged line in a Mooncake file": ({"prompt_len": 5, "output_len": 4},
                                           "a trtpaged trace line (prompt_len, output_len) in a file whose first line "
                                           "(line 1) is a Mooncake one: one trace form per file"),
    "one line of both forms": ({**GOOD, "prompt_len": 600}, "mixes a Mooncake line's fields (timestamp, "
                                                            "input_length, output_length, hash_ids) with a trtpaged "
                                                            "trace line's (prompt_len)"),
    "not JSON": ("{timestamp: 0}", "not JSON"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize("command", ["memory", "throughput", "serve"])
def test_a_bad_mooncake_line_is_refused_in_one_line_naming_it(tiny_engine_dir, tmp_path, command, kind):
    """Line 2 is the bad one (line 1 makes the file a Mooncake trace), refused before any replay, load or request
    (no server listens at bench serve's URL)."""
    bad, words = HOSTILE[kind]
    path = _write(tmp_path, [GOOD, bad])
    one_line_failure(_bench(command, path, tiny_engine_dir), "mooncake.jsonl:2: ", words)


def _bench(command: str, path: Path, engine: Path, *args: str):
    if command == "serve":
        argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--trace", str(path)]
    else:
        argv = ["bench", command, str(engine), "--trace", str(path)] + (["--baseline", "none"]
                                                                       if command == "throughput" else [])  # fmt: skip
    return CliRunner().invoke(main, argv + list(args))


@pytest.mark.parametrize("command", ["memory", "throughput", "serve"])
def test_a_mooncake_line_in_a_trtpaged_trace_is_refused_naming_it(tiny_engine_dir, tmp_path, command):
    path = _write(tmp_path, [{"prompt_len": 20, "output_len": 4}, GOOD], "trace.jsonl")
    one_line_failure(_bench(command, path, tiny_engine_dir), "trace.jsonl:2: a Mooncake trace line (timestamp, "
                     "input_length, output_length, hash_ids) in a file whose first line (line 1) is a trtpaged one")


@pytest.mark.parametrize("command,args,words", [
    ("memory", [], ("--step-time: ", "'s timestamps span 1000 ms and a replay's arrivals are engine steps: give "
                    "--step-time SECONDS")),
    ("memory", ["--step-time", "1e-300"], ("mooncake.jsonl:2: timestamp: 1000 ms is past step 2147483647 at 1e-300 s "
                                           "per step",)),
    ("memory", ["--num-requests", "3"], ("--num-requests: synthetic workload options",)),
    ("memory", ["--seed", "3"], ("--seed: synthetic workload options",)),
    ("memory", ["--n", "2", "--beam-width", "2"], ("--n, --beam-width: give one of them",)),
    ("throughput", ["--num-requests", "3"], ("--num-requests: synthetic workload options",)),
    ("throughput", ["--output-len", "3"], ("--output-len: with a ShareGPT --trace only",)),
    ("serve", ["--request-rate", "4"], ("--request-rate: the Mooncake --trace",)),
    ("serve", ["--output-len", "3"], ("--output-len: synthetic workload options",)),
])  # fmt: skip
def test_options_a_mooncake_trace_would_ignore_are_refused(tiny_engine_dir, tmp_path, command, args, words):
    """Before: a Mooncake file was an unknown-fields error; now options that could not apply to it are refused."""
    path = _write(tmp_path, [GOOD, {**GOOD, "timestamp": 1000}])
    one_line_failure(_bench(command, path, tiny_engine_dir, *args), *words)


@pytest.mark.parametrize("trace", [None, "trace.jsonl"])
def test_step_time_is_for_a_timed_trace_only(tmp_path, trace: Optional[str]):
    args = ["bench", "memory", "--step-time", "0.02", "--num-kv-blocks", "64"]
    if trace:
        args += ["--trace", str(_write(tmp_path, [{"prompt_len": 20, "output_len": 4}], trace))]
    one_line_failure(CliRunner().invoke(main, args), "--step-time: turns a timed --trace's timestamps (Mooncake, "
                     "Azure, BurstGPT) into replay steps; ", "has none" if trace else "a synthetic workload arrives at "
                     "step 0")


def test_fractional_millisecond_timestamps_are_read_to_the_nanosecond(tmp_path):
    """aiperf's Mooncake loader types timestamp int | float (milliseconds), and trace synthesizers write fractions:
    they were refused ("must be an integer"). The times are the file's, by hand: 0, 1000, 1500.5, 2000 ms (the last
    written 2000.0), in timestamp order."""
    path = _write(tmp_path, [_line(0, 40, [1]), '{"timestamp": 1500.5, "input_length": 30, "output_length": 4, '
                             '"hash_ids": [2]}', _line(1000, 20, [1]), {**_line(0, 10, [3]), "timestamp": 2000.0}])
    trace = read_mooncake(path)
    assert [r.time_ns for r in trace.requests] == [0, 1_000_000_000, 1_500_500_000, 2_000_000_000]
    assert [r.request.prompt_len for r in trace.requests] == [40, 20, 30, 10]
    assert trace.seconds() == [0.0, 1.0, 1.5005, 2.0] and trace.reordered == 1
    assert trace.span_text() == "2000 ms"
    steps = [r.arrival for r in trace.arrival_steps(0.5)]  # 1.5005 s is past step 3 (1.5 s): it joins step 4
    assert steps == [0, 2, 4, 4]
    late = _write(tmp_path, [_line(0, 40, [1]), {**_line(0, 10, [3]), "timestamp": 0.25}], "late.jsonl")
    with pytest.raises(ValueError, match=r"late.jsonl:2: timestamp: 0.25 ms is past step 2147483647"):
        read_mooncake(late).arrival_steps(1e-300)


def test_the_same_timestamp_everywhere_needs_no_step_time(tmp_path):
    path = _write(tmp_path, [_line(500, 40, [1]), _line(500, 30, [1])])
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path), "--num-kv-blocks", "64"])
    assert result.exit_code == 0 and "arrivals over 0 s" in result.output, result.output
