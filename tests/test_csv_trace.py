"""Azure LLM inference traces and BurstGPT (CSV) as `--trace` of bench memory, throughput and serve, and of diagnose:
each form read into exactly the requests its rows give (the 100 ns of Azure's seventh fractional digit kept, failed
rows skipped and counted, rows out of order taken in timestamp order), the timestamps used as a Mooncake trace's are
(serve sends at them, memory and diagnose map them to steps, throughput submits all at t=0 and says so), diagnose
says that prefix sharing is unknown, and a bad file is refused in one line naming the line, the column and the bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from trtpaged.bench.csv_trace import read_csv_trace
from trtpaged.bench.serve_bench import prompts_from_trace
from trtpaged.bench.timed_trace import TimedRequest, timed_form
from trtpaged.bench.workload import TraceRequest, prompt_token_ids
from trtpaged.cli import main

from runtime_helpers import one_line_failure, run_trace_command as _run

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens"
BURSTGPT = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"


def _write(tmp_path: Path, lines: list[str], name: str = "trace.csv", newline: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes("".join(line + newline for line in lines).encode())
    return path


def _report(output: str) -> dict:
    return json.loads(output[output.index("\n{") + 1:])


# ---------------------------------------------------------------- each form read into exactly its rows' requests


def test_an_azure_trace_is_its_rows_in_timestamp_order(tmp_path):
    """A 2023 file's rows (seven fractional digits: 100 ns apart are two times), one out of order, one with no
    output (skipped and counted), a 2024 row with a UTC offset; CRLF line ends and a blank line as Windows tools
    write them."""
    path = _write(tmp_path, [AZURE, "2023-11-16 18:15:46.6805900,4808,10", "2023-11-16 18:15:46.6805901,30,7",
                             "", "2023-11-16 18:15:46.1805900,110,27", "2023-11-16 18:15:47,50,0",
                             "2023-11-16T20:15:48.5+02:00,7,1"], newline="\r\n")  # fmt: skip
    assert timed_form(path) == "Azure"
    trace = read_csv_trace(path)
    first = 1700158546180590000  # 2023-11-16 18:15:46.18059 UTC, in ns since 1970
    assert trace.requests == [TimedRequest(f"{path}:5", first, TraceRequest(110, 27)),
                              TimedRequest(f"{path}:2", first + 500_000_000, TraceRequest(4808, 10)),
                              TimedRequest(f"{path}:3", first + 500_000_100, TraceRequest(30, 7)),
                              TimedRequest(f"{path}:7", first + 2_319_410_000, TraceRequest(7, 1))]  # fmt: skip
    assert trace.seconds() == [0.0, 0.5, 0.5000001, 2.31941] and trace.reordered == 1
    assert (trace.skipped_no_output, trace.skipped_no_prompt) == (1, 0)
    assert trace.summary() == (f"{path}: 4 Azure requests (no prompt text or prefix ids: each prompt is random tokens "
                               "of its length, sharing nothing), arrivals over 2.31941 s; skipped 1 row with "
                               "GeneratedTokens 0 (failed requests); 1 line earlier than a line before, taken in "
                               "timestamp order")  # fmt: skip


def test_a_burstgpt_trace_is_its_rows_with_the_failures_skipped(tmp_path):
    """Timestamps are seconds from the trace's start (counted here from the first row, as every timed trace's);
    rows with Response tokens 0 are BurstGPT's failed requests: skipped, and said."""
    path = _write(tmp_path, ["\ufeff" + BURSTGPT, "5.0,ChatGPT,472,18,490,Conversation log",
                             "45,GPT-4,1000,0,1000,API log", '46.25,"GPT-4",10,3,13,"API log, retried"',
                             "46.25,ChatGPT,0,9,9,API log", "47.000000001,ChatGPT,9,9,18,API log"])  # fmt: skip
    assert timed_form(path) == "BurstGPT"
    trace = read_csv_trace(path)
    assert trace.requests == [TimedRequest(f"{path}:2", 5_000_000_000, TraceRequest(472, 18)),
                              TimedRequest(f"{path}:4", 46_250_000_000, TraceRequest(10, 3)),
                              TimedRequest(f"{path}:6", 47_000_000_001, TraceRequest(9, 9))]  # fmt: skip
    assert trace.seconds() == [0.0, 41.25, 42.000000001] and trace.reordered == 0
    assert trace.summary().endswith("arrivals over 42 s; skipped 1 row with Response tokens 0 (failed requests) and "
                                    "1 row with Request tokens 0 (no prompt to send)")  # fmt: skip


def test_columns_in_another_order_read_the_same(tmp_path):
    path = _write(tmp_path, ["GeneratedTokens, TIMESTAMP ,ContextTokens", "10,2023-11-16 18:15:46,4808"])
    assert read_csv_trace(path).trace() == [TraceRequest(4808, 10)]


def test_prompts_are_random_and_share_nothing(tmp_path):
    """No prompt content: each prompt is its length of random token ids (words for bench serve), none a prefix of
    another's beyond chance."""
    path = _write(tmp_path, [AZURE] + [f"2023-11-16 18:15:4{i},64,4" for i in range(4)])
    prompts = prompt_token_ids(read_csv_trace(path).trace(), 320)
    assert [len(p) for p in prompts] == [64] * 4 and len({tuple(p[:8]) for p in prompts}) == 4
    words = [r.prompt.split(" ") for r in prompts_from_trace(read_csv_trace(path).trace())]
    assert [len(w) for w in words] == [64] * 4 and len({tuple(w[:8]) for w in words}) == 4


@pytest.mark.parametrize("first,form", [(AZURE, "Azure"), (BURSTGPT, "BurstGPT"), ("time,prompt,output", "CSV"),
                                        ('{"prompt_len": 5, "output_len": 4}', None),
                                        ('{"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [1]}',
                                         "Mooncake"), ("[]", None)])  # fmt: skip
def test_the_form_is_the_first_lines(tmp_path, first, form):
    assert timed_form(_write(tmp_path, ["", first], "trace.txt")) == form


# ---------------------------------------------------------------- the commands


def test_cli_bench_memory_replays_an_azure_trace_at_the_step_time(tiny_engine_dir, tmp_path):
    path = _write(tmp_path, [AZURE, "2023-11-16 18:15:46.0,100,20", "2023-11-16 18:15:46.2500001,40,8",
                             "2023-11-16 18:15:46.5,60,0"])  # fmt: skip
    result = CliRunner().invoke(main, ["bench", "memory", str(tiny_engine_dir), "--trace", str(path), "--step-time",
                                       "0.05", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 Azure requests (no prompt text or prefix ids" in result.output
    assert "skipped 1 row with GeneratedTokens 0 (failed requests)" in result.output
    assert "--step-time 0.05: arrivals at steps 0 to 6" in result.output  # 0.2500001 s / 0.05 s: joins step 6
    report = _report(result.output)
    assert report["requests"] == 2 and report["sequences"] == 2
    policies = {p["policy"]: p for p in report["policies"]}
    assert policies["paged + sharing"]["prefix_hit_tokens"] == 0


def test_cli_diagnose_says_prefix_sharing_is_unknown(tiny_engine_dir, tmp_path):
    """No prompt content: diagnose does not claim sharing would save nothing; it says the sharing is unknown."""
    path = _write(tmp_path, [BURSTGPT, "0.5,ChatGPT,100,20,120,API log", "0.5,ChatGPT,100,20,120,API log",
                             "1.0,GPT-4,60,0,60,API log", "1.5,GPT-4,60,12,72,API log"])  # fmt: skip
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir), "--step-time",
                                       "0.1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "BurstGPT trace: no prompt text or prefix ids, its prompts random tokens" in result.output
    assert "what prefix sharing would save is unknown" in result.output and "of little use" not in result.output
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir), "--step-time", "0.1",
                                       "--json"])  # fmt: skip
    report = json.loads(result.output[result.output.index("{"):])
    assert report["requests"] == 3 and report["log"]["form"] == "BurstGPT" and report["log"]["step_time_s"] == 0.1
    assert report["sharing"]["prefix_sharing_known"] is False
    one_line_failure(CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir)]),
                     "--step-time: ", "timestamps span 1 s and a replay's arrivals are engine steps")


def test_cli_bench_throughput_submits_a_burstgpt_trace_at_once(tiny_engine_dir, tmp_path):
    path = _write(tmp_path, [BURSTGPT, "9.0,ChatGPT,30,4,34,API log", "3.0,ChatGPT,20,3,23,API log",
                             "4.0,ChatGPT,25,0,25,API log"])  # fmt: skip
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(path),
                                       "--baseline", "none", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "2 BurstGPT requests" in result.output and "timestamps not replayed" in result.output
    report = _report(result.output)
    assert report["prompt_tokens"] == 50 and report["systems"][0]["computed_tokens"] >= 50


def test_cli_bench_serve_sends_each_row_at_its_timestamp(logged_server, tiny_engine_dir, tmp_path):
    """The server's log: the requests arrived in timestamp order, 0.5 s apart as the Azure timestamps say."""
    server, lines = logged_server
    path = _write(tmp_path, [AZURE, "2024-05-10 00:00:01.000000+00:00,30,3", "2024-05-10 00:00:00.500000+00:00,20,3",
                             "2024-05-10 00:00:01.500000+00:00,25,3"])  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_engine_dir / "tokenizer"))
    expected = [tokenizer(r.prompt).input_ids for r in prompts_from_trace(read_csv_trace(path).trace(), seed=4)]
    seen = len(lines(0, timeout=0))
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--trace", str(path), "--seed", "4",
                                       "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 Azure requests" in result.output and "each sent at its timestamp" in result.output
    report = _report(result.output)
    assert report["completed"] == 3 and report["request_rate"] == "trace"
    run = sorted(lines(seen + 4)[seen + 1:], key=lambda line: line["arrival"])  # the uncounted warm-up first
    assert [line["prompt_token_ids"] for line in run] == expected
    gaps = [line["arrival"] - run[0]["arrival"] for line in run]
    assert all(want - 0.1 < gap < want + 0.45 for gap, want in zip(gaps, (0.0, 0.5, 1.0))), gaps


# ---------------------------------------------------------------- refused, in one line


HOSTILE = {  # kind: (header, bad line 3 or None for a file of the header alone, where the error is, its words)
    "negative ContextTokens": (AZURE, "2023-11-16 18:15:47,-5,10", 3,
                               "ContextTokens: must be an integer from 0 to 16777216 (tokens), got '-5'"),
    "10^12 ContextTokens": (AZURE, "2023-11-16 18:15:47,1000000000000,10", 3,
                            "ContextTokens: must be from 0 to 16777216 (tokens), got '1000000000000'"),
    "a 40-digit count": (AZURE, "2023-11-16 18:15:47,5," + "9" * 40, 3,
                         "GeneratedTokens: must be from 0 to 16777216 (tokens), got '9999"),
    "fractional GeneratedTokens": (AZURE, "2023-11-16 18:15:47,5,10.5", 3,
                                   "GeneratedTokens: must be an integer from 0 to 16777216 (tokens), got '10.5'"),
    "empty GeneratedTokens": (AZURE, "2023-11-16 18:15:47,5,", 3, "GeneratedTokens: must be an integer"),
    "month 13": (AZURE, "2023-13-16 18:15:47,5,5", 3, "TIMESTAMP: must be a date and time, YYYY-MM-DD HH:MM:SS"
                                                      "[.fraction][+HH:MM], got '2023-13-16 18:15:47' (month must be "
                                                      "in 1..12)"),
    "not a date": (AZURE, "yesterday,5,5", 3, "TIMESTAMP: must be a date and time"),
    "too few columns": (AZURE, "2023-11-16 18:15:47,5", 3, "2 columns where the header has 3 (TIMESTAMP,ContextTokens"
                                                           ",GeneratedTokens)"),
    "too many columns": (AZURE, "2023-11-16 18:15:47,5,5,5", 3, "4 columns where the header has 3"),
    "a JSON line": (AZURE, '{"prompt_len": 5, "output_len": 4}', 3, "a JSON line in this Azure trace (a CSV file, "
                                                                    "known by its header): one trace form per file"),
    "a Mooncake line": (BURSTGPT, '{"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [1]}', 3,
                        "a JSON line in this BurstGPT trace"),
    "the header again": (AZURE, AZURE, 3, "the header again (two files joined?)"),
    "an unclosed quote": (AZURE, '"2023-11-16 18:15:47,5,5', 3, "not CSV this reader takes (unexpected end of data)"),
    "negative Timestamp": (BURSTGPT, "-1,ChatGPT,5,5,10,API log", 3, "Timestamp: must be from 0 to 2147483647 "
                                                                     "seconds, got '-1'"),
    "infinite Timestamp": (BURSTGPT, "inf,ChatGPT,5,5,10,API log", 3, "Timestamp: must be a number of seconds since "
                                                                      "the trace's start, got 'inf'"),
    "NaN Timestamp": (BURSTGPT, "nan,ChatGPT,5,5,10,API log", 3, "Timestamp: must be a number of seconds"),
    "huge Timestamp": (BURSTGPT, "1e400,ChatGPT,5,5,10,API log", 3, "Timestamp: must be from 0 to 2147483647 seconds"),
    "huge Response tokens": (BURSTGPT, "1,ChatGPT,5,20000000,10,API log", 3, "Response tokens: must be from 0 to "
                                                                             "16777216 (tokens), got '20000000'"),
    "Total tokens not a count": (BURSTGPT, "1,ChatGPT,5,5,ten,API log", 3, "Total tokens: must be an integer"),
    "a header of neither form": ("time,prompt,output", "1,5,5", 1, "not a trace header: 'time,prompt,output'; "
                                                                   "expected JSON Lines, or a CSV trace whose first "
                                                                   "line is Azure's TIMESTAMP,ContextTokens,"
                                                                   "GeneratedTokens or BurstGPT's Timestamp,Model,"),
    "a missing column": ("TIMESTAMP,ContextTokens", "2023-11-16 18:15:47,5", 1, "column(s) 'GeneratedTokens' "
                                                                               "missing: Azure's header is TIMESTAMP,"
                                                                               "ContextTokens,GeneratedTokens"),
    "an unknown column": (AZURE + ",Region", "2023-11-16 18:15:47,5,5,eu", 1, "column(s) 'Region' unknown"),
    # Azure's 2025 multimodal trace (AzureLMMInferenceDataset2025.md's schema) was "column(s) 'NumImages' unknown"
    "the multimodal trace": ("TIMESTAMP,NumImages,ContextTokens,GeneratedTokens", "2024-10-15 00:00:00.0123,1,900,20",
                             1, "column 'NumImages': the Azure multimodal trace's (AzureLMMInferenceTrace_multimodal"
                                ".csv, 2025): its requests carry images, and trtpaged's engines and benchmarks take "
                                "text; no such trace is replayed"),
    "a column twice": (AZURE + ",ContextTokens", "2023-11-16 18:15:47,5,5,5", 1, "column(s) 'ContextTokens' given "
                                                                                 "twice"),
    "no rows": (AZURE, None, None, "trace.csv: no requests"),
    "every row failed": (BURSTGPT, "1,ChatGPT,5,0,5,API log", None, "trace.csv: no requests (every row has Response "
                                                                    "tokens 0 or Request tokens 0)"),
}
GOOD_ROW = {AZURE: "2023-11-16 18:15:46,5,4", BURSTGPT: "0,ChatGPT,5,4,9,API log"}


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize("command", ["memory", "throughput", "serve", "diagnose"])
def test_a_bad_csv_trace_is_refused_in_one_line_naming_it(tiny_engine_dir, tmp_path, command, kind):
    """Refused before any replay, load or request (no server listens at bench serve's URL)."""
    header, bad, line, words = HOSTILE[kind]
    path = _write(tmp_path, [header] + ([] if bad is None else [GOOD_ROW[header], bad] if line == 3 else [bad]))
    where = f"trace.csv:{line}: " if line else "trace.csv"
    one_line_failure(_run(command, path, tiny_engine_dir), where, words)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path, tiny_engine_dir):
    path = tmp_path / "trace.csv"
    path.write_bytes(AZURE.encode() + b"\n2023-11-16 18:15:46,5,4\n2023-11-16 18:15:47,\xff\xfe,4\n")
    one_line_failure(_run("memory", path, tiny_engine_dir), "trace.csv: not UTF-8 text", "expected a CSV trace")


def test_the_byte_that_is_not_utf8_is_counted_from_the_files_start(tmp_path, tiny_engine_dir):
    """The text-mode reader's decode error counts from its last buffer: the bad byte below, 40060 bytes in, was reported
    "at byte 7292"."""
    good = (AZURE + "\n" + "2023-11-16 18:15:46.6805900,5,4\n" * 1250).encode()
    path = tmp_path / "trace.csv"
    path.write_bytes(good + b"2023-11-16 18:15:47,\xff,4\n")
    bad = len(good) + len("2023-11-16 18:15:47,")
    one_line_failure(_run("memory", path, tiny_engine_dir), f"trace.csv: not UTF-8 text (invalid start byte at byte "
                     f"{bad}); expected a CSV trace")


def test_a_csv_row_in_a_json_lines_trace_is_refused_naming_it(tmp_path, tiny_engine_dir):
    path = _write(tmp_path, ['{"prompt_len": 5, "output_len": 4}', "2023-11-16 18:15:46,5,4"], "trace.jsonl")
    one_line_failure(_run("memory", path, tiny_engine_dir), "trace.jsonl:2: ", "not JSON")


@pytest.mark.parametrize("command,args,words", [
    ("memory", [], ("--step-time: ", "'s timestamps span 1 s and a replay's arrivals are engine steps",)),
    ("memory", ["--step-time", "1e-300"], ("trace.csv:3: TIMESTAMP: 1 s after the first is past step 2147483647",)),
    ("memory", ["--num-requests", "3"], ("--num-requests: synthetic workload options",)),
    ("throughput", ["--num-requests", "3"], ("--num-requests: synthetic workload options",)),
    ("serve", ["--request-rate", "4"], ("--request-rate: the Azure --trace", "sends each request at its timestamp")),
    ("serve", ["--output-len", "3"], ("--output-len: synthetic workload options",)),
])  # fmt: skip
def test_options_a_csv_trace_would_ignore_are_refused(tiny_engine_dir, tmp_path, command, args, words):
    path = _write(tmp_path, [AZURE, "2023-11-16 18:15:46,5,4", "2023-11-16 18:15:47,5,4"])
    one_line_failure(_run(command, path, tiny_engine_dir, *args), *words)
