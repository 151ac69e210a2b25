"""`trtpaged run-batch` (vLLM's run-batch, OpenAI's batch file format): each line answered as `LLM` answers the same
request greedily on the same engine, in the input's order; lines that are no request get an error of their own and
do not stop the rest; the output file is written whole."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from click.testing import CliRunner

from trtpaged import LLM, SamplingParams
from trtpaged.cli import main

MODEL = "tiny-batch"


def _line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _greedy_text(llm, prompt_ids, max_tokens):
    (out,) = llm.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)  # fmt: skip
    return out.outputs[0].text


def test_a_batch_file_is_answered_line_by_line_in_order(tiny_engine_dir, tmp_path):
    messages = [{"role": "user", "content": "hello there"}]
    lines = [
        _line("chat", "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True}),
        _line("text", "/v1/completions", {"model": MODEL, "prompt": "once upon", "max_tokens": 5, "temperature": 0,
                                          "ignore_eos": True}),
        "",
        "{not json",
        _line("bad", "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": -1}),
        _line("chat", "/v1/completions", {"model": MODEL, "prompt": "x"}),
        _line("route", "/v1/embeddings", {"model": MODEL, "input": "x"}),
        _line("stream", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}),
        _line("anthropic", "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": messages,
                                            "temperature": 0}),
    ]  # fmt: skip
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(source), "-o", str(target),
                                       "--served-model-name", MODEL, "--device", "cpu", "--max-concurrency", "3"])
    assert result.exit_code == 0, result.output
    assert "9 requests, 3 answered, 6 failed" in result.output
    outputs = [json.loads(line) for line in target.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == ["chat", "text", None, "bad", "chat", "route", "stream", "get",
                                                 "anthropic"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]  # no temporary file left
    assert len({o["id"] for o in outputs}) == len(outputs) and all(o["id"].startswith("batch_req_") for o in outputs)
    by_order = iter(outputs)

    llm = LLM(tiny_engine_dir, device="cpu")
    chat = next(by_order)
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    want = _greedy_text(llm, llm.chat_prompt(messages), 6)
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == want
    assert chat["response"]["request_id"] and chat["response"]["body"]["model"] == MODEL
    text = next(by_order)
    want = _greedy_text(llm, llm.tokenizer.encode("once upon", add_special_tokens=True), 5)
    assert text["response"]["body"]["choices"][0]["text"] == want
    not_json = next(by_order)
    assert not_json["response"] is None and "line 4: not JSON" in not_json["error"]["message"]
    bad = next(by_order)
    assert bad["error"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    for words in ("used by an earlier line", "url: must be one of", "body.stream", "method: must be POST"):
        out = next(by_order)
        assert out["response"] is None and words in out["error"]["message"], out
    anthropic = next(by_order)
    assert anthropic["response"]["status_code"] == 200 and anthropic["response"]["body"]["type"] == "message"


def test_stdin_to_stdout_and_vllms_model_flag(tiny_engine_dir):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    result = CliRunner().invoke(main, ["run-batch", "--model", str(tiny_engine_dir), "-i", "-", "-o", "-",
                                       "--served-model-name", MODEL, "--device", "cpu"],
                                input=_line("only", "/v1/completions", body) + "\n")  # fmt: skip
    assert result.exit_code == 0, result.output
    (only,) = result.stdout.splitlines()  # the results alone: progress and the summary go to stderr
    out = json.loads(only)
    assert out["custom_id"] == "only" and out["response"]["body"]["usage"]["completion_tokens"] == 3


def test_an_unreadable_input_or_engine_twice_is_refused(tiny_engine_dir, tmp_path):
    runner = CliRunner()
    missing = runner.invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(tmp_path / "nope"), "-o", "-"])
    assert missing.exit_code == 2 and "--input-file" in missing.output
    twice = runner.invoke(main, ["run-batch", str(tiny_engine_dir), "--model", str(tiny_engine_dir), "-i", "-",
                                 "-o", "-"], input="")  # fmt: skip
    assert twice.exit_code == 2 and "ENGINE or --model" in twice.output


def test_lines_end_at_newlines_only_and_a_line_that_cannot_be_sent_fails_alone(tiny_engine_dir, tmp_path):
    """JSON Lines end at "\\n": a prompt holding U+2028 or U+0085 unescaped is one request; an escaped lone surrogate
    is that line's 400, not the batch's end; an output path that cannot be written is refused before any work."""
    body = {"model": MODEL, "prompt": "a\u2028b\x85c", "max_tokens": 2, "temperature": 0}
    lines = [json.dumps({"custom_id": "sep", "method": "POST", "url": "/v1/completions", "body": body},
                        ensure_ascii=False),
             _line("lone", "/v1/completions", {"model": MODEL, "prompt": "\ud800x", "max_tokens": 2})]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    result = CliRunner().invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(source), "-o", "-",
                                       "--served-model-name", MODEL, "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    sep, lone = (json.loads(line) for line in result.stdout.splitlines())
    assert sep["custom_id"] == "sep" and sep["response"]["status_code"] == 200
    assert lone["custom_id"] == "lone" and lone["response"]["status_code"] == 400
    unwritable = CliRunner().invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(source), "-o",
                                           str(tmp_path / "missing" / "out.jsonl")])  # fmt: skip
    assert unwritable.exit_code == 2 and "--output-file" in unwritable.output


def test_results_stdout_cannot_take_are_one_error_line(tiny_engine_dir, tmp_path):
    """`-o -` into a full disk (/dev/full) was a Python traceback ending in OSError after the whole batch ran."""
    source = tmp_path / "in.jsonl"
    source.write_text(_line("one", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) + "\n")
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "trtpaged.cli", "run-batch", str(tiny_engine_dir), "-i",
                                 str(source), "-o", "-", "--device", "cpu"], stdout=full, stderr=subprocess.PIPE,
                                text=True, timeout=300)  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "Error: cannot write the results to stdout (No space left on device)" in result.stderr.splitlines()


def test_the_results_file_gets_the_mode_open_would_give_it(tiny_engine_dir, tmp_path):
    """The results went through a mkstemp file renamed into place and kept its 0600: a new file was readable by its
    owner alone, whatever the umask, and an existing one lost its mode. Now: 0666 less the umask, or the old mode."""
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("one", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) + "\n")
    args = ["run-batch", str(tiny_engine_dir), "-i", str(source), "-o", str(target), "--device", "cpu"]
    old = os.umask(0o022)
    try:
        assert CliRunner().invoke(main, args).exit_code == 0
        assert stat.S_IMODE(target.stat().st_mode) == 0o644
        target.chmod(0o640)
        assert CliRunner().invoke(main, args).exit_code == 0
        assert stat.S_IMODE(target.stat().st_mode) == 0o640
    finally:
        os.umask(old)


def test_results_to_a_closed_stdout_are_refused_before_the_batch(tiny_engine_dir, tmp_path):
    """`-o -` with stdout closed (>&-) failed with "Unable to configure formatter 'default'" (uvicorn's logging)."""
    source = tmp_path / "in.jsonl"
    source.write_text(_line("one", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) + "\n")
    result = subprocess.run([sys.executable, "-m", "trtpaged.cli", "run-batch", str(tiny_engine_dir), "-i",
                             str(source), "-o", "-", "--device", "cpu"], stderr=subprocess.PIPE, text=True,
                            timeout=300, preexec_fn=lambda: os.close(1))  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == ("Error: Invalid value for --output-file: '-' is stdout, which is "
                                              "closed: nowhere to write the results")


def test_a_batch_runs_with_stdout_closed_when_its_results_go_to_a_file(tiny_engine_dir, tmp_path):
    """`-o FILE` with stdout closed (a daemon's >&-): the batch is answered (was: "Error: Unable to configure
    formatter 'default'", uvicorn asking the missing stdout whether it is a terminal; `serve` failed the same way)."""
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("one", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) + "\n")
    result = subprocess.run([sys.executable, "-m", "trtpaged.cli", "run-batch", str(tiny_engine_dir), "-i",
                             str(source), "-o", str(target), "--served-model-name", MODEL, "--device", "cpu"],
                            stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))  # fmt: skip
    assert result.returncode == 0, result.stderr
    answer = json.loads(target.read_text())
    assert answer["custom_id"] == "one" and answer["response"]["status_code"] == 200, answer


def test_a_line_giving_a_field_twice_fails_alone_naming_it(tiny_engine_dir, tmp_path):
    """A served body giving a field twice is a 400 naming it (which one was meant?); a batch line doing so ran with
    the last value (json.loads keeps it silently): it now fails alone, as that body would, and the next line runs.
    So does a line with an integer of more digits than Python reads, naming its place and the limit, as a served
    body's 400 does (was: 'not JSON (...)', which the line is). Truth: sys.get_int_max_str_digits."""
    twice = ('{"custom_id": "twice", "method": "POST", "url": "/v1/completions", "body": {"model": "%s", '
             '"prompt": "x", "max_tokens": 2, "max_tokens": 400}}' % MODEL)  # fmt: skip
    digits = sys.get_int_max_str_digits() + 1
    long = _line("long", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    long = long.replace('"max_tokens": 0', '"max_tokens": ' + "9" * digits)  # json.dumps cannot write it
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    source = tmp_path / "in.jsonl"
    source.write_text(twice + "\n" + long + "\n" + _line("next", "/v1/completions", body) + "\n")
    result = CliRunner().invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(source), "-o", "-",
                                       "--served-model-name", MODEL, "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    first, second, after = (json.loads(line) for line in result.stdout.splitlines())
    assert first["response"] is None and "'max_tokens' given twice" in first["error"]["message"], first
    assert second["response"] is None and second["error"]["message"] == (
        f"line 2: body.max_tokens: a number of {digits} digits; at most {digits - 1} digits are read"), second
    assert after["custom_id"] == "next" and after["response"]["body"]["usage"]["completion_tokens"] == 3


def test_a_byte_order_mark_is_no_part_of_the_first_request(tiny_engine_dir, tmp_path):
    """A batch file saved by a Windows editor (a UTF-8 byte-order mark, CRLF line ends) lost its first request: 'line 1:
    not JSON (Unexpected UTF-8 BOM ...)'. The trace readers drop the mark (workload.read_lines); so does run-batch. The
    answer is the one the same file without the mark gets."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    lines = [_line("first", "/v1/completions", body), _line("second", "/v1/completions", body)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    result = CliRunner().invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(source), "-o", "-",
                                       "--served-model-name", MODEL, "--device", "cpu"])  # fmt: skip
    assert result.exit_code == 0, result.output
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["custom_id"] == "first" and first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["text"] == second["response"]["body"]["choices"][0]["text"]


def test_a_compressed_or_empty_input_is_refused_before_the_engine_loads(tiny_engine_dir, tmp_path, monkeypatch):
    """A gzip'd batch file was "cannot read ...: 'utf-8' codec can't decode byte 0x8b in position 1", nothing said of
    what it is; an empty one (or blank lines) loaded the engine and wrote an empty result file, exit 0, where vLLM's
    run-batch and OpenAI's Batch API refuse it. Both are refused naming --input-file, before the engine loads."""
    import gzip

    from trtpaged import server

    monkeypatch.setattr(server, "start_server", lambda *a, **k: pytest.fail("the engine was loaded"))
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(_line("a", "/v1/completions", {"model": MODEL, "prompt": "x"}).encode()))
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text("\n \r\n\n")
    for path, words in ((packed, f"{packed}: a gzip-compressed file, not UTF-8 text (invalid start byte at byte 1): "
                                 f"decompress it first (gunzip {packed})"),
                        (empty, f"{str(empty)!r} holds no request"), (blank, f"{str(blank)!r} holds no request")):
        result = CliRunner().invoke(main, ["run-batch", str(tiny_engine_dir), "-i", str(path), "-o", "-"])
        assert result.exit_code == 2 and "--input-file" in result.output and words in result.output, result.output
        assert "Traceback" not in result.output



def test_a_compressed_stdin_is_refused_before_the_engine_loads(tiny_engine_dir):
    """`-i -` read stdin as text, which a shell's Python decodes with surrogateescape (C and C.UTF-8 locales): a gzip'd
    batch file piped in was read as lines of garbage, the engine loaded and each answered "not JSON", exit 0. Its bytes
    are decoded strictly and it is named as what it is, exit 2; a byte-order mark on stdin is dropped, as a file's."""
    import gzip

    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    text = _line("only", "/v1/completions", body) + "\n"
    args = [sys.executable, "-m", "trtpaged.cli", "run-batch", str(tiny_engine_dir), "-i", "-", "-o", "-",
            "--served-model-name", MODEL, "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:surrogateescape"}  # a shell's stdin, whatever runs the tests
    packed = subprocess.run(args, input=gzip.compress(text.encode()), capture_output=True, env=env, timeout=300)
    stderr = packed.stderr.decode()
    assert packed.returncode == 2 and not packed.stdout and "Traceback" not in stderr, stderr
    assert ("--input-file: stdin: a gzip-compressed file, not UTF-8 text (invalid start byte at byte 1): decompress "
            "it first (gunzip); expected JSON Lines of batch requests") in stderr, stderr
    marked = subprocess.run(args, input=b"\xef\xbb\xbf" + text.encode(), capture_output=True, env=env, timeout=300)
    assert marked.returncode == 0, marked.stderr.decode()
    assert json.loads(marked.stdout)["response"]["status_code"] == 200
