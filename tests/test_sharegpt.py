"""ShareGPT datasets as `--trace` of bench throughput, serve and memory, against an independent truth: the rule of
vLLM's ShareGPTDataset computed here on the parsed file (json.load, the global `random.seed(seed);
random.shuffle(...)` vLLM calls, `tokenizer(text).input_ids`), on small synthetic files written by each test; bench
serve against a real `trtpaged serve` of the tiny engine, whose request log records the prompt token ids it got."""

from __future__ import annotations

import json
import random
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional

import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from trtpaged.bench import sharegpt
from trtpaged.bench.serve_bench import sharegpt_requests as serve_requests
from trtpaged.bench.throughput_bench import sharegpt_requests as throughput_requests
from trtpaged.cli import main

from runtime_helpers import one_line_failure

TINY_MAX_SEQ_LEN = 512  # examples/tiny.yaml
WORDS = "the of and to in is you that it he was for on are as with his they at be this have from or one had by".split()


def _text(rng: random.Random, chars: int) -> str:
    """About `chars` characters of words (the tiny tokenizer gives about a token a character)."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


def _dataset(seed: int = 1, size: int = 60) -> list[dict]:
    """Entries that reach every branch of the rule on the tiny engine: too-short prompts and outputs, prompts over
    1024 tokens, pairs over 2048 and over max_seq_len 512, entries with 0, 1 and 3+ turns, non-ASCII text."""
    rng = random.Random(seed)
    shapes = [(2, 40), (40, 3), (1100, 20), (1000, 1100), (300, 300), (10, 10), (60, 200), (150, 90), (5, 4),
              (400, 100), (30, 60), (4, 0)]  # fmt: skip
    entries = []
    for i in range(size):
        prompt_chars, output_chars = shapes[i % len(shapes)]
        turns = [_text(rng, prompt_chars), _text(rng, output_chars)]
        if i % 7 == 3:
            turns = turns[:i % 2]  # 0 or 1 turn: not a pair
        elif i % 5 == 0:
            turns += [_text(rng, 30)]
        if i % 9 == 4 and turns:
            turns[0] = "héllo wörld 日本語 😀 " + turns[0]
        entries.append({"id": f"e{i}", "conversations": [{"from": ("human", "gpt")[t % 2], "value": value}
                                                         for t, value in enumerate(turns)]})  # fmt: skip
    return entries


def _write(tmp_path: Path, entries, name: str = "sharegpt.json", indent: Optional[int] = 2) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(entries, indent=indent, ensure_ascii=False), encoding="utf-8")
    return path


def _vllm_count(tokenizer) -> Callable[[str], int]:
    """A text's token count as vLLM's ShareGPTDataset takes it."""
    return lambda text: len(tokenizer(text).input_ids)


def _expected(path: Path, count: Callable[[str], int], num_requests: int, seed: int, output_len: Optional[int] = None,
              model_len: Optional[int] = None) -> list[tuple[str, int, int]]:  # fmt: skip
    """(prompt, prompt_len, output_len) per request, as vLLM's ShareGPTDataset takes them (plus the engine's length),
    token counts from `count`."""
    with open(path, encoding="utf-8") as f:
        data = [e for e in json.load(f) if "conversations" in e and len(e["conversations"]) >= 2]
    state = random.getstate()
    random.seed(seed)
    random.shuffle(data)
    random.setstate(state)
    out = []
    for entry in data:
        if len(out) >= num_requests:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = count(prompt)
        new_output_len = count(completion) if output_len is None else output_len
        if (prompt_len < 4 or (output_len is None and new_output_len < 4) or prompt_len > 1024
                or prompt_len + new_output_len > 2048
                or (model_len is not None and prompt_len + new_output_len > model_len)):  # fmt: skip
            continue
        out.append((prompt, prompt_len, new_output_len))
    return out


@pytest.fixture(scope="module")
def tokenizer(tiny_engine_dir):
    return AutoTokenizer.from_pretrained(str(tiny_engine_dir / "tokenizer"))



# ---------------------------------------------------------------- the rule, through bench throughput's loading


@pytest.mark.parametrize("seed,num_requests,output_len", [(0, 5, None), (3, 1000, None), (7, 12, 6), (0, 1000, 2)])
def test_throughput_takes_the_requests_vllm_s_rule_takes(tiny_engine_dir, tokenizer, tmp_path, seed, num_requests,
                                                         output_len):  # fmt: skip
    path = _write(tmp_path, _dataset())
    expected = _expected(path, _vllm_count(tokenizer), num_requests, seed, output_len, TINY_MAX_SEQ_LEN)
    encode = lambda text: list(tokenizer.encode(text))  # noqa: E731 - what bench throughput passes
    requests, sample = throughput_requests(path, encode, num_requests, seed, output_len, TINY_MAX_SEQ_LEN)
    assert expected and len(expected) == len(requests) == len(sample.requests)
    for request, taken, (prompt, prompt_len, out_len) in zip(requests, sample.requests, expected):
        assert taken.prompt == prompt and (taken.prompt_len, taken.output_len) == (prompt_len, out_len)
        assert list(request.prompt_ids) == tokenizer(prompt).input_ids and request.output_len == out_len
        assert request.where.startswith(f"{path}[")
    if num_requests == 1000:  # the whole file: every reason to skip was met, the request count says so
        reasons = set(sample.skipped)
        if output_len is None:
            assert reasons == {"prompt < 4 tokens", "output < 4 tokens", "prompt > 1024 tokens",
                               "prompt + output > 2048 tokens", "prompt + output > max_seq_len 512"}  # fmt: skip
        assert sample.read == sample.pairs and "no more usable pairs" in sample.summary(num_requests)


def test_vllm_s_limits_alone_without_an_engine_length(tokenizer, tmp_path):
    """No model_len: pairs between 512 and 2048 tokens are taken (vLLM's rule as it is)."""
    path = _write(tmp_path, _dataset(seed=2))
    sample = sharegpt.sample_sharegpt(path, sharegpt.tokenizer_counter(tokenizer), 1000, 5)
    got = [(r.prompt, r.prompt_len, r.output_len) for r in sample.requests]
    assert got == _expected(path, _vllm_count(tokenizer), 1000, 5) and any(p + o > TINY_MAX_SEQ_LEN for _, p, o in got)


def test_the_same_selection_from_a_compact_file_with_a_bom_and_tiny_chunks(tokenizer, tmp_path, monkeypatch):
    """Chunk boundaries inside entries and inside multi-byte characters, a byte-order mark, no whitespace."""
    path = _write(tmp_path, _dataset(seed=4), indent=None)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    monkeypatch.setattr(sharegpt, "CHUNK_BYTES", 7)
    sample = sharegpt.sample_sharegpt(path, sharegpt.tokenizer_counter(tokenizer), 1000, 11)
    plain = _write(tmp_path, _dataset(seed=4), name="plain.json", indent=None)
    expected = _expected(plain, _vllm_count(tokenizer), 1000, 11)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in sample.requests] == expected


def test_cli_bench_throughput_runs_the_selected_requests(tiny_engine_dir, tokenizer, tmp_path):
    path = _write(tmp_path, _dataset())
    expected = _expected(path, _vllm_count(tokenizer), 3, 9, model_len=TINY_MAX_SEQ_LEN)
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(path),
                                       "--num-requests", "3", "--seed", "9", "--baseline", "none",
                                       "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("\n{") + 1:])
    assert report["requests"] == 3
    assert report["prompt_tokens"] == sum(p for _, p, _ in expected)
    assert report["output_tokens"] == sum(o for _, _, o in expected)
    assert f"{path}: 3 ShareGPT requests (seed 9) from " in result.output


def test_cli_output_len_is_for_a_sharegpt_trace_only(tiny_engine_dir, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 20, "output_len": 4}\n')
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(trace),
                                       "--output-len", "8", "--baseline", "none"])  # fmt: skip
    one_line_failure(result, "--output-len: with a ShareGPT --trace only")


# ---------------------------------------------------------------- bench serve, against a real server


@pytest.mark.parametrize("seed,num_requests,output_len", [(0, 6, None), (5, 1000, None), (2, 4, 9)])
def test_serve_counts_with_the_server_s_tokenize(logged_server, tokenizer, tmp_path, seed, num_requests,
                                                 output_len):  # fmt: skip
    """The prompts are the entries' own texts; lengths from the server's /tokenize, whose max_model_len (512) skips
    the longer pairs, as the engine's max_seq_len does for bench throughput."""
    server, _ = logged_server
    path = _write(tmp_path, _dataset(seed=3))
    requests, sample = serve_requests(str(path), server.url, num_requests, seed, output_len)
    expected = _expected(path, _vllm_count(tokenizer), num_requests, seed, output_len, TINY_MAX_SEQ_LEN)
    assert expected and [(r.prompt, r.max_tokens) for r in requests] == [(p, o) for p, _, o in expected]
    assert [r.prompt_len for r in sample.requests] == [p for _, p, _ in expected]
    assert all(r.n == 1 and r.beam_width == 1 for r in requests)


def test_cli_bench_serve_sends_the_texts_and_lengths(logged_server, tokenizer, tmp_path):
    """The server's log of the run: each selected prompt's token ids (the text as sent) and its output length."""
    server, lines = logged_server
    path = _write(tmp_path, _dataset(seed=5))
    expected = _expected(path, _vllm_count(tokenizer), 4, 1, model_len=TINY_MAX_SEQ_LEN)
    seen = len(lines(0, timeout=0))
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--trace", str(path),
                                       "--num-requests", "4", "--seed", "1", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("\n{") + 1:])
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["total_input_tokens"] == sum(p for _, p, _ in expected)
    assert report["total_output_tokens"] == sum(o for _, _, o in expected)
    run = lines(seen + 5)[seen + 1:]  # the uncounted warm-up first
    got = sorted((line["prompt_token_ids"], line["output_len"]) for line in run)
    assert got == sorted((tokenizer(p).input_ids, o) for p, _, o in expected)


class _NoTokenize(BaseHTTPRequestHandler):
    """An OpenAI-compatible server's stand-in that has no /tokenize."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(404)
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"not found")

    def log_message(self, *args) -> None:
        pass


def test_cli_bench_serve_refuses_a_server_without_tokenize(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoTokenize)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = CliRunner().invoke(main, ["bench", "serve", "--base-url", url, "--trace",
                                           str(_write(tmp_path, _dataset()))])  # fmt: skip
        one_line_failure(result, "--trace: a ShareGPT dataset", "POST /tokenize", "HTTP 404")
    finally:
        server.shutdown()
        server.server_close()


def test_cli_bench_serve_refuses_an_output_len_range(logged_server, tmp_path):
    server, _ = logged_server
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--trace",
                                       str(_write(tmp_path, _dataset())), "--output-len", "8:16"])  # fmt: skip
    one_line_failure(result, "--output-len: one length N with a ShareGPT --trace")


# ---------------------------------------------------------------- bench memory


@pytest.mark.parametrize("sharegpt, args, words", [
    (False, ["--prompt-len", "8", "--num-requests", "3"], "--num-requests, --prompt-len: synthetic workload options"),
    (False, ["--output-len", "9"], "--output-len: synthetic workload options"),
    (True, ["--prompt-len", "8"], "--prompt-len: synthetic workload options"),
    (False, ["--multi-turn", "2:2"], "--multi-turn, --trace: give one workload"),
])  # fmt: skip
def test_cli_bench_serve_refuses_options_a_trace_would_ignore(tmp_path, sharegpt, args, words):
    """Options of a synthetic workload given with --trace changed nothing (the trace's lengths were sent): refused,
    naming them, before any request (no server listens at the URL)."""
    if sharegpt:
        path = _write(tmp_path, _dataset())
    else:
        path = tmp_path / "trace.jsonl"
        path.write_text('{"prompt_len": 8, "output_len": 4}\n')
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--trace", str(path),
                                       *args])  # fmt: skip
    one_line_failure(result, words)


def test_cli_bench_memory_replays_the_selected_lengths(tiny_engine_dir, tokenizer, tmp_path, monkeypatch):
    from trtpaged.bench import memory_bench

    path = _write(tmp_path, _dataset())
    replayed = []
    real = memory_bench.run_memory_bench
    monkeypatch.setattr(memory_bench, "run_memory_bench",
                        lambda requests, *a, **k: replayed.append((requests, k["prompts"])) or real(requests, *a, **k))
    result = CliRunner().invoke(main, ["bench", "memory", str(tiny_engine_dir), "--trace", str(path),
                                       "--num-requests", "7", "--seed", "4", "--n", "2", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    expected = _expected(path, _vllm_count(tokenizer), 7, 4, model_len=TINY_MAX_SEQ_LEN)
    requests, prompts = replayed[0]
    assert [(r.prompt_len, r.output_len, r.n) for r in requests] == [(p, o, 2) for _, p, o in expected]
    assert prompts == [tokenizer(text).input_ids for text, _, _ in expected]  # the texts' own tokens are replayed


def test_cli_bench_memory_finds_the_prefix_that_sharegpt_prompts_share(tiny_engine_dir, tmp_path):
    """Two prompts whose texts open with the same 80 characters (5 whole blocks of 16 on the tiny byte-level
    tokenizer), one request at a time: the second finds the first's shared blocks cached (was: generated prompts,
    nothing shared)."""
    shared = "the system prompt " * 5
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": shared[:80] + tail},
                                                {"from": "gpt", "value": "an answer of some length"}]}
               for i, tail in enumerate(["first question", "another question"])]  # fmt: skip
    result = CliRunner().invoke(main, ["bench", "memory", str(tiny_engine_dir),
                                       "--trace", str(_write(tmp_path, entries)),
                                       "--max-batch-size", "1", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    policies = {p["policy"]: p for p in report["policies"]}
    assert policies["paged + sharing"]["prefix_hit_tokens"] == 80, policies["paged + sharing"]


def test_cli_bench_memory_needs_an_engine_for_a_sharegpt_trace(tmp_path):
    path = _write(tmp_path, _dataset())
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path)])
    one_line_failure(result, f"--trace {path}: a ShareGPT dataset's lengths are token counts", "give the engine dir")


def test_cli_bench_memory_refuses_synthetic_options_with_a_sharegpt_trace(tiny_engine_dir, tmp_path):
    path = _write(tmp_path, _dataset())
    result = CliRunner().invoke(main, ["bench", "memory", str(tiny_engine_dir), "--trace", str(path), "--prompt-len",
                                       "8"])  # fmt: skip
    one_line_failure(result, "--prompt-len: synthetic workload options; they cannot apply to the ShareGPT --trace")


# ---------------------------------------------------------------- hostile files

PAIR = {"conversations": [{"from": "human", "value": "tell me about the sea"}, {"from": "gpt", "value": "it is wet"}]}
HOSTILE = {
    "an entry that is no object": ([PAIR, "x"], "sharegpt.json[1]: must be an object with \"conversations\""),
    "an entry without conversations": ([PAIR, PAIR, {"id": "a"}], "sharegpt.json[2].conversations: required"),
    "conversations not a list": ([PAIR, {"conversations": "hi"}],
                                 "sharegpt.json[1].conversations: must be a list of turns, got a string"),
    "a turn that is no object": ([PAIR, {"conversations": [{"value": "hello there"}, 5]}],
                                 "sharegpt.json[1].conversations[1]: must be an object with a \"value\" string"),
    "a turn without value": ([PAIR, {"conversations": [{"from": "human"}, {"value": "x"}]}],
                             "sharegpt.json[1].conversations[0].value: required"),
    "a value that is no string": ([PAIR, {"conversations": [{"value": "hello there"}, {"value": 7}]}],
                                  "sharegpt.json[1].conversations[1].value: must be a string, got a number"),
    "no usable pair": ([{"conversations": [{"value": "hi"}, {"value": "yes it is"}]}, {"conversations": []}],
                       "sharegpt.json: no usable ShareGPT pair: of 2 entries, 1 with two turns or more, all skipped "
                       "(1 prompt < 4 tokens)"),
    "no entries": ([], "sharegpt.json: a ShareGPT dataset with no entries"),
}
HOSTILE_BYTES = {
    "not UTF-8": (b'[{"conversations": [{"value": "caf\xe9 au lait"}, {"value": "x"}]}]',
                  "sharegpt.json: not UTF-8 text (invalid continuation byte at byte 34)"),
    "a lone surrogate": (b'[{"conversations": [{"value": "hello \\udce9 there"}, {"value": "yes it is"}]}]',
                         "sharegpt.json[0].conversations[0].value: not valid Unicode text"),
    "truncated": (json.dumps([PAIR, PAIR]).encode()[:-30], "sharegpt.json[1]: not valid JSON"),
    "text after the array": (json.dumps([PAIR]).encode() + b" []", "sharegpt.json: text after the array's closing"),
    "deep nesting": (b'[{"conversations": []}, ' + b"[" * 100_000 + b"]" * 100_000 + b"]",
                     "sharegpt.json[1]: nested too deeply to read"),
}


def _hostile_file(tmp_path: Path, kind: str) -> tuple[Path, str]:
    path = tmp_path / "sharegpt.json"
    if kind in HOSTILE:
        entries, words = HOSTILE[kind]
        path.write_text(json.dumps(entries))
    else:
        content, words = HOSTILE_BYTES[kind]
        path.write_bytes(content)
    return path, words


@pytest.mark.parametrize("kind", [*HOSTILE, *HOSTILE_BYTES])
@pytest.mark.parametrize("command", ["throughput", "memory"])
def test_a_bad_sharegpt_file_is_refused_in_one_line_naming_the_entry_and_field(tiny_engine_dir, tmp_path, command,
                                                                              kind):  # fmt: skip
    path, words = _hostile_file(tmp_path, kind)
    args = ["bench", command, str(tiny_engine_dir), "--trace", str(path)]
    one_line_failure(CliRunner().invoke(main, args + (["--baseline", "none"] if command == "throughput" else [])),
                      words)  # fmt: skip


def test_an_entry_over_the_bound_is_refused_before_it_is_read_whole(tiny_engine_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sharegpt, "MAX_ENTRY_BYTES", 4096)
    monkeypatch.setattr(sharegpt, "CHUNK_BYTES", 256)
    big = {"conversations": [{"value": "word " * 2000}, {"value": "yes it is"}]}
    path = _write(tmp_path, [PAIR, big])
    result = CliRunner().invoke(main, ["bench", "throughput", str(tiny_engine_dir), "--trace", str(path)])
    one_line_failure(result, "sharegpt.json[1]: no whole JSON value in the 4096 bytes from byte")


def test_a_json_array_of_trace_lines_is_still_the_json_lines_refusal(tmp_path):
    """An array whose first entry has no "conversations" is no ShareGPT file: the trace reader's message, naming the
    ShareGPT form it could have been."""
    path = tmp_path / "trace.jsonl"
    path.write_text('[{"prompt_len": 5, "output_len": 5}]\n')
    result = CliRunner().invoke(main, ["bench", "memory", "--trace", str(path)])
    one_line_failure(result, "trace.jsonl:1: expected JSON Lines", "ShareGPT")


def test_reading_a_large_file_holds_a_few_chunks_not_the_file(tmp_path, monkeypatch):
    """The scan keeps byte spans, not entries: its peak is far below the file's size (json.load's is several times
    it), with the same selection."""
    rng = random.Random(0)
    entries = [{"id": str(i), "conversations": [{"from": "human", "value": "word " * rng.randint(1, 400)}
                                                for _ in range(rng.randint(0, 4))]} for i in range(3000)]  # fmt: skip
    path = _write(tmp_path, entries)
    del entries
    size = path.stat().st_size
    monkeypatch.setattr(sharegpt, "CHUNK_BYTES", 1 << 16)
    count = lambda text: len(text) // 5  # noqa: E731 - a stand-in tokenizer: the same one on both sides
    tracemalloc.start()
    try:
        sample = sharegpt.sample_sharegpt(path, count, 20, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 5 << 20 and peak < size / 4, (size, peak)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in sample.requests] == _expected(path, count, 20, 0)
