"""TensorRT-LLM's trtllm-bench datasets (JSON Lines of task_id, prompt or input_ids, output_tokens) as `--trace` of
bench memory, throughput and serve, and of diagnose: each line read into exactly the request it gives (token ids as
given, `logits` as their older name, text tokenized by the engine's tokenizer), the prompts' shared prefixes real in
every replay, all requests at t = 0, and a bad file refused in one line naming the line, the field and the bound.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from trtpaged.bench import trtllm_dataset
from trtpaged.bench.sharegpt import is_sharegpt
from trtpaged.bench.timed_trace import timed_form
from trtpaged.bench.trtllm_dataset import DatasetLine, is_trtllm_dataset, read_trtllm_dataset
from trtpaged.cli import main

from runtime_helpers import one_line_failure, run_trace_command as _run

SHARED = list(range(3, 43))  # 40 tokens: two whole 16-token blocks shared
TEXT = "Generate an infinite response to the following: Na, na, na, na"


def _write(tmp_path: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _line(**fields) -> str:
    return json.dumps(fields)


def _dataset(tmp_path: Path) -> Path:
    """Two prompts of ids sharing 40 leading tokens, one of text (the form prepare_dataset.py writes, and the one
    its guide shows)."""
    return _write(tmp_path, [_line(task_id=0, input_ids=SHARED + [50, 51], output_tokens=4),
                             _line(task_id=1, logits=SHARED + [60], output_tokens=3),
                             _line(task_id=2, prompt=TEXT, output_tokens=5)])  # fmt: skip


def _report(output: str) -> dict:
    return json.loads(output[output.index("\n{") + 1:])


# ---------------------------------------------------------------- read into exactly its lines' requests


def test_a_dataset_is_its_lines_requests(tmp_path):
    """Compact lines as prepare_dataset.py writes them, a blank line, MT-Bench's metadata (not read), a null prompt
    next to ids (absent, as trtllm-bench reads it), a byte-order mark."""
    path = tmp_path / "trace.jsonl"
    path.write_text("\ufeff" + "\n".join([
        '{"task_id":0,"input_ids":[863,22056,25603],"output_tokens":128}', "",
        '{"task_id":-7,"logits":[0,1],"output_tokens":1,"prompt":null}',
        '{"task_id":9,"prompt":"Na, na","output_tokens":16777216,"category":"writing","question_id":81}']) + "\n")
    assert is_trtllm_dataset(path) and not timed_form(path) and not is_sharegpt(path)
    dataset = read_trtllm_dataset(path)
    assert dataset.lines == [DatasetLine(f"{path}:1", 0, 128, input_ids=(863, 22056, 25603)),
                             DatasetLine(f"{path}:3", -7, 1, input_ids=(0, 1), ids_field="logits"),
                             DatasetLine(f"{path}:4", 9, 16777216, prompt="Na, na")]  # fmt: skip


def test_a_line_ends_at_a_newline_alone(tmp_path):
    """A prompt holding U+2028, U+2029 or U+0085 raw (json.dumps(ensure_ascii=False) writes them so, and JSON
    allows them in a string) is one line, CRLF line ends are line ends, and lines after them keep their numbers
    (was: the file was split as str.splitlines splits, each such prompt two broken lines, 'not JSON')."""
    path = tmp_path / "trace.jsonl"
    odd = "a\u2028b\u0085c\u2029d"
    path.write_bytes((json.dumps({"task_id": 0, "prompt": odd, "output_tokens": 2}, ensure_ascii=False) + "\r\n"
                      + _line(task_id=1, input_ids=[5, 6], output_tokens=3) + "\n").encode())
    assert f'"{odd}"'.encode() in path.read_bytes()  # raw in the file, not escaped
    dataset = read_trtllm_dataset(path)
    assert dataset.lines == [DatasetLine(f"{path}:1", 0, 2, prompt=odd),
                             DatasetLine(f"{path}:2", 1, 3, input_ids=(5, 6))]  # fmt: skip


def test_prompt_ids_are_as_given_and_text_is_tokenized(tmp_path):
    dataset = read_trtllm_dataset(_dataset(tmp_path))
    prompts = dataset.prompt_ids(lambda text: [len(word) for word in text.split()], vocab_size=320)
    assert prompts == [SHARED + [50, 51], SHARED + [60], [len(word) for word in TEXT.split()]]
    assert dataset.summary(prompts) == (f"{dataset.path}: 3 trtllm-bench requests (2 as token ids, 1 as text), 40 of "
                                        "94 prompt tokens in a prefix an earlier prompt shares; no arrival times: all "
                                        "at t=0")  # fmt: skip
    with pytest.raises(ValueError, match=r"trace.jsonl:1: input_ids: token id 50 is outside the engine's vocabulary "
                                         r"\[0, 50\)"):  # fmt: skip
        dataset.prompt_ids(len, vocab_size=50)
    with pytest.raises(ValueError, match="trace.jsonl:3: prompt: a text prompt is tokenized by the engine's tokenizer: "
                                         "give it"):  # fmt: skip
        dataset.prompt_ids(None, missing_tokenizer="give it")


@pytest.mark.parametrize("first,form", [('{"task_id": 0, "prompt": "a", "output_tokens": 1}', True),
                                        ('{"output_tokens": 1}', True), ('{"logits": [1]}', True),
                                        ('{"prompt": "a", "output_len": 4}', False),
                                        ('{"prompt_len": 5, "output_len": 4}', False),
                                        ('{"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [1]}',
                                         False), ("[]", False), ("TIMESTAMP,ContextTokens,GeneratedTokens", False),
                                        ("{not json", False)])  # fmt: skip
def test_the_form_is_the_first_lines(tmp_path, first, form):
    assert is_trtllm_dataset(_write(tmp_path, ["", first])) is form


def test_ids_past_max_seq_len_are_refused_before_they_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm_dataset, "MAX_SEQ_LEN", 8)
    path = _write(tmp_path, [_line(task_id=0, input_ids=list(range(9)), output_tokens=1)])
    with pytest.raises(ValueError, match="trace.jsonl:1: input_ids: 9 token ids; a prompt is at most 8"):
        read_trtllm_dataset(path)
    with pytest.raises(ValueError, match="trace.jsonl:1: prompt: 9 tokens; a prompt is 1 to 8"):
        read_trtllm_dataset(_write(tmp_path, [_line(task_id=0, prompt="x", output_tokens=1)])).prompt_ids(
            lambda text: [1] * 9)  # fmt: skip


# ---------------------------------------------------------------- the commands


def test_cli_bench_memory_replays_the_real_shared_prefix(tiny_engine_dir, tmp_path):
    """One request at a time (--max-batch-size 1): the second finds the first's two whole shared blocks cached."""
    result = CliRunner().invoke(main, ["bench", "memory", str(tiny_engine_dir), "--trace", str(_dataset(tmp_path)),
                                       "--max-batch-size", "1", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 trtllm-bench requests (2 as token ids, 1 as text), 40 of" in result.output
    report = _report(result.output)
    assert report["requests"] == 3
    policies = {p["policy"]: p for p in report["policies"]}
    assert policies["paged + sharing"]["prefix_hit_tokens"] == 32


def test_cli_diagnose_counts_the_shared_prefix(tiny_engine_dir, tmp_path):
    path = _dataset(tmp_path)
    tokens = len(AutoTokenizer.from_pretrained(str(tiny_engine_dir / "tokenizer"))(TEXT).input_ids)
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["log"]["form"] == "trtllm-bench" and report["log"]["prompt_tokens"] == 42 + 41 + tokens
    assert report["sharing"]["prompt_tokens_in_shared_prefixes"] == 40 and report["sharing"]["prefix_sharing_known"]
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir)])
    assert "trtllm-bench dataset: its prompts' own token ids" in result.output
    one_line_failure(_run("diagnose", path, tiny_engine_dir, "--step-time", "0.1"),
                     "--step-time: ", "is a trtllm-bench dataset, which has no arrival times")  # fmt: skip


def test_cli_diagnose_names_the_line_of_a_request_it_can_never_run(tiny_engine_dir, tmp_path):
    """diagnose named such a request by its number alone ('request 2: prompt_len 600 leaves no room ...'): a
    trtllm-bench dataset's requests carry their lines, as a request log's do."""
    path = _write(tmp_path, [json.dumps({"task_id": 0, "input_ids": [1, 2], "output_tokens": 3}),
                             json.dumps({"task_id": 1, "input_ids": [5] * 600, "output_tokens": 3})])  # fmt: skip
    one_line_failure(CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir)]),
                     "trace.jsonl:2: prompt_len 600 leaves no room for output under max_seq_len 512")  # fmt: skip


def test_cli_bench_throughput_runs_the_ids_as_given(tiny_engine_dir, tmp_path):
    tokens = len(AutoTokenizer.from_pretrained(str(tiny_engine_dir / "tokenizer"))(TEXT).input_ids)
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(_dataset(tmp_path)),
                                       "--baseline", "none", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 trtllm-bench requests" in result.output and "all at t=0" in result.output
    report = _report(result.output)
    assert report["prompt_tokens"] == 42 + 41 + tokens and report["output_tokens"] == 12


def test_cli_bench_serve_sends_ids_as_ids_and_text_as_text(logged_server, tiny_engine_dir, tmp_path):
    """The server's log: each prompt's token ids are the line's own, or its text's tokens."""
    server, lines = logged_server
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_engine_dir / "tokenizer"))
    seen = len(lines(0, timeout=0))
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--trace", str(_dataset(tmp_path)),
                                       "--max-concurrency", "1", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 trtllm-bench requests" in result.output and "sent at --request-rate inf" in result.output
    assert _report(result.output)["completed"] == 3
    run = lines(seen + 4)[seen + 1:]  # the uncounted warm-up first
    assert [line["prompt_token_ids"] for line in run] == [SHARED + [50, 51], SHARED + [60], tokenizer(TEXT).input_ids]
    one_line_failure(_run("serve", _dataset(tmp_path), tiny_engine_dir, "--endpoint", "chat"),
                     "--endpoint chat: ", "trace.jsonl:1: input_ids: a prompt of token ids")  # fmt: skip


# ---------------------------------------------------------------- refused, in one line


HOSTILE = {  # kind: (line 2 of the file, the words of its error after "trace.jsonl:2: ")
    "no task_id": (_line(prompt="a", output_tokens=4), "task_id: required (a trtllm-bench line is"),
    "a string task_id": (_line(task_id="a", prompt="a", output_tokens=4),
                         "task_id: must be an integer from -9223372036854775808 to 9223372036854775807, got 'a'"),
    "a boolean task_id": (_line(task_id=True, prompt="a", output_tokens=4), "task_id: must be an integer"),
    "task_id 2^63": (_line(task_id=1 << 63, prompt="a", output_tokens=4),
                     "task_id: must be from -9223372036854775808 to 9223372036854775807, got 9223372036854775808"),
    "no output_tokens": (_line(task_id=1, prompt="a"), "output_tokens: required"),
    "output_tokens 0": (_line(task_id=1, prompt="a", output_tokens=0),
                        "output_tokens: must be from 1 to 16777216, got 0"),
    "10^12 output_tokens": (_line(task_id=1, prompt="a", output_tokens=10**12),
                            "output_tokens: must be from 1 to 16777216, got 1000000000000"),
    "fractional output_tokens": (_line(task_id=1, prompt="a", output_tokens=4.5),
                                 "output_tokens: must be an integer from 1 to 16777216, got 4.5"),
    "prompt and input_ids": (_line(task_id=1, prompt="a", input_ids=[1], output_tokens=4),
                             "prompt, input_ids: give one prompt, as text (prompt) or as token ids (input_ids, or "
                             "logits), got both"),
    "input_ids and logits": (_line(task_id=1, input_ids=[1], logits=[1], output_tokens=4),
                             "input_ids, logits: give one prompt"),
    "no prompt": (_line(task_id=1, output_tokens=4), "prompt: give one prompt, as text (prompt) or as token ids "
                                                     "(input_ids, or logits), got neither"),
    "an empty prompt": (_line(task_id=1, prompt="", output_tokens=4), "prompt: must be a non-empty string, got ''"),
    "a number prompt": (_line(task_id=1, prompt=5, output_tokens=4), "prompt: must be a non-empty string, got 5"),
    "a lone surrogate": ('{"task_id": 1, "prompt": "a\\ud800", "output_tokens": 4}',
                         "prompt: not valid Unicode text"),
    "empty input_ids": (_line(task_id=1, input_ids=[], output_tokens=4),
                        "input_ids: must be a non-empty list of token ids, got []"),
    "input_ids a string": (_line(task_id=1, input_ids="1 2", output_tokens=4),
                           "input_ids: must be a non-empty list of token ids, got '1 2'"),
    "a negative id": (_line(task_id=1, input_ids=[3, -1], output_tokens=4),
                      "input_ids[1]: must be a token id, an integer from 0 to 2147483647, got -1"),
    "a fractional id": (_line(task_id=1, logits=[1.5], output_tokens=4), "logits[0]: must be a token id"),
    "a 2^40 id": (_line(task_id=1, logits=[1 << 40], output_tokens=4),
                  "logits[0]: must be a token id, an integer from 0 to 2147483647, got 1099511627776"),
    "lora_request": (_line(task_id=1, input_ids=[1], output_tokens=4, lora_request={"lora_name": "lora_1"}),
                     "lora_request: a LoRA adapter's request; trtpaged's benchmarks run the engine's own weights; "
                     "remove the field"),
    "turns": (_line(task_id=1, turns=["a", "b"], output_tokens=4), "turns: a multi-turn conversation"),
    "media_paths": (_line(task_id=1, prompt="a", media_paths=["x.png"], output_tokens=4),
                    "media_paths: a multimodal prompt"),
    "an unknown field": (_line(task_id=1, prompt="a", output_tokens=4, temperature=0.5),
                         "unknown field(s) ['temperature']"),
    "a trtpaged trace line": (_line(prompt_len=5, output_len=4), "another trace form's field(s) (prompt_len, "
                                                                 "output_len) in a file whose first line (line 1) is "
                                                                 "a trtllm-bench one: one trace form per file"),
    "a Mooncake line": (_line(timestamp=0, input_length=5, output_length=4, hash_ids=[1]),
                        "another trace form's field(s) (timestamp, input_length, output_length, hash_ids)"),
    "not JSON": ('{"task_id": 1, "prompt": "a",', "not JSON"),
    "a field twice": ('{"task_id": 1, "task_id": 2, "prompt": "a", "output_tokens": 4}',
                      "field 'task_id' given twice"),
}
GOOD_LINE = _line(task_id=0, input_ids=[5, 6, 7], output_tokens=2)


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize("command", ["memory", "throughput", "serve", "diagnose"])
def test_a_bad_dataset_is_refused_in_one_line_naming_it(tiny_engine_dir, tmp_path, command, kind):
    """Refused before any replay, load or request (no server listens at bench serve's URL)."""
    bad, words = HOSTILE[kind]
    one_line_failure(_run(command, _write(tmp_path, [GOOD_LINE, bad]), tiny_engine_dir), "trace.jsonl:2: " + words)


@pytest.mark.parametrize("command", ["memory", "throughput", "diagnose"])
def test_an_id_outside_the_engines_vocabulary_is_refused(tiny_engine_dir, tmp_path, command):
    path = _write(tmp_path, [GOOD_LINE, _line(task_id=1, logits=[5, 320], output_tokens=2)])
    one_line_failure(_run(command, path, tiny_engine_dir),
                     "trace.jsonl:2: logits: token id 320 is outside the engine's vocabulary [0, 320)")  # fmt: skip


def test_a_dataset_line_in_a_trtpaged_trace_is_refused_naming_it(tmp_path, tiny_engine_dir):
    path = _write(tmp_path, ['{"prompt_len": 5, "output_len": 4}', GOOD_LINE])
    one_line_failure(_run("memory", path, tiny_engine_dir), "trace.jsonl:2: unknown field(s)", "'task_id'")


@pytest.mark.parametrize("command,args,words", [
    ("memory", ["--num-requests", "3"], "--num-requests: synthetic workload options"),
    ("memory", ["--step-time", "0.1"], "--step-time: turns a timed --trace's timestamps"),
    ("throughput", ["--num-requests", "3"], "--num-requests: synthetic workload options"),
    ("throughput", ["--output-len", "3"], "--output-len: with a ShareGPT --trace only"),
    ("serve", ["--output-len", "3"], "--output-len: synthetic workload options"),
])  # fmt: skip
def test_options_a_dataset_would_ignore_are_refused(tiny_engine_dir, tmp_path, command, args, words):
    one_line_failure(_run(command, _dataset(tmp_path), tiny_engine_dir, *args), words)


def test_bench_memory_without_an_engine_takes_ids_and_refuses_text(tmp_path):
    path = _dataset(tmp_path)
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path)])
    one_line_failure(result, "trace.jsonl:3: prompt: a text prompt is tokenized by the engine's tokenizer: give the "
                             "engine dir (bench memory ENGINE --trace")  # fmt: skip
    ids_only = _write(tmp_path, [GOOD_LINE, _line(task_id=1, input_ids=[5, 6, 9], output_tokens=2)], "ids.jsonl")
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(ids_only), "--json"])
    assert result.exit_code == 0, result.output
    assert _report(result.output)["requests"] == 2
