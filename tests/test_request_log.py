"""`trtpaged serve --request-log`: a real server on loopback writes one line per finished request, checked
against what the client sent and got, and `trtpaged diagnose` reads that very log."""

from __future__ import annotations

import json
import statistics
import time

import pytest
from click.testing import CliRunner

from trtpaged import LLM, SamplingParams
from trtpaged.cli import main
from trtpaged.server import ServerOptions, start_server
from tests.test_server import request, wait_idle

BLOCK_SIZE = 16  # examples/tiny.yaml


def cached_prefix(prompt_len: int) -> int:
    """Prompt tokens the prefix cache can serve when the whole prompt is cached: full blocks, never the last token."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def read_lines(path, count: int, timeout: float = 10.0) -> list[dict]:
    """The log's lines once it has `count` (the writer thread flushes on its own)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            assert len(lines) == count, lines
            return lines
        time.sleep(0.05)


def test_prefix_hits_are_exposed_per_request(tiny_engine_dir) -> None:
    llm = LLM(tiny_engine_dir, device="cpu")
    prompt = list(range(3, 3 + 54))
    first = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    again = llm.generate([prompt, prompt[:20], list(range(200, 230))], SamplingParams(max_tokens=2, temperature=0.0))
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in again] == [cached_prefix(54), cached_prefix(20), 0]
    assert [o.outputs[0].token_ids for o in again[:1]] == [first.outputs[0].token_ids]  # same tokens, from the cache


@pytest.fixture(scope="module")
def logged(tiny_engine_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("request-log") / "requests.jsonl"
    handle = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(request_log=str(path)))
    yield handle, path
    handle.shutdown()


def test_log_lines_match_what_the_client_sent_and_got(logged, tiny_engine_dir) -> None:
    server, path = logged
    prompt = list(range(5, 5 + 54))  # 54 tokens: 3 full blocks and a partial one
    other = list(range(100, 133))
    bodies = [
        {"prompt": prompt, "max_tokens": 6, "ignore_eos": True},
        {"prompt": prompt, "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 1},  # its prompt is cached now
        {"prompt": [prompt[:20], other], "max_tokens": 4, "beam_width": 2, "use_beam_search": True},
        {"prompt": other, "max_tokens": 7, "temperature": 0.0},
        {"prompt": list(range(140, 150)), "max_tokens": 0, "echo": True},  # scores its prompt: no output
    ]
    answers = []
    for body in bodies:
        status, _, answer = request(server, "/v1/completions", body)
        assert status == 200, answer
        answers.append(answer)
    wait_idle(server)
    lines = read_lines(path, 6)
    lines[2:4] = sorted(lines[2:4], key=lambda line: line["prompt_len"])  # one request's two prompts: either order
    per_prompt = [(0, [0]), (1, [0, 1, 2]), (2, [0]), (2, [1]), (3, [0]), (4, [0])]  # (request, its choices) a line
    expected_cached = [0, cached_prefix(54), cached_prefix(20), 0, cached_prefix(33), 0]
    prompt_lens = [54, 54, 20, 33, 33, 10]
    for line, (r, choices), cached, plen in zip(lines, per_prompt, expected_cached, prompt_lens):
        body, answer = bodies[r], answers[r]
        assert line["prompt_len"] == plen and "prompt_token_ids" not in line  # prompts are not logged by default
        assert line["n"] == body.get("n", 1) and line["beam_width"] == body.get("beam_width", 1)
        assert line["finish_reasons"] == [answer["choices"][c]["finish_reason"] for c in choices]
        assert line["output_len"] == max(line["output_lens"]) and len(line["output_lens"]) == len(choices)
        assert line["cached_tokens"] == cached
        assert line["step_time_s"] > 0
        assert line["steps"] >= line["output_len"]  # a step per token at least (the last token's step included)
        if body.get("max_tokens") != 0:
            assert 0 < line["ttft_s"] <= line["latency_s"]
    for r, answer in enumerate(answers):  # usage sums the request's lines
        mine = [line for line, (i, _) in zip(lines, per_prompt) if i == r]
        assert answer["usage"]["prompt_tokens"] == sum(line["prompt_len"] for line in mine)
        assert answer["usage"]["completion_tokens"] == sum(sum(line["output_lens"]) for line in mine)
    assert lines[0]["output_lens"] == [6]  # ignore_eos: exactly max_tokens
    assert lines[5]["output_lens"] == [0] and lines[5]["ttft_s"] is None  # echo, max_tokens 0: no token output
    assert all(a["arrival"] <= b["arrival"] for a, b in zip(lines, lines[1:]))  # sent one after another

    # `trtpaged diagnose` on that very log: the same requests and tokens, arrivals in seconds
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    log = report["log"]
    assert report["requests"] == log["requests"] == 6  # the scored prompt replayed (as one token), not skipped
    assert log["skipped_without_output"] == 0
    assert log["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert log["output_tokens"] == sum(a["usage"]["completion_tokens"] for a in answers)
    assert log["arrival_unit"] == "seconds"
    assert log["step_time_s"] == statistics.median(line["step_time_s"] for line in lines)
    assert log["observed_cached_tokens"] == sum(expected_cached)
    assert report["sharing"]["sequences"] == 1 + 3 + 2 + 2 + 1 + 1  # n samples and beam widths, as logged
    text = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir)])
    assert text.exit_code == 0 and "arrivals in seconds" in text.output


def test_prompts_are_logged_only_when_asked(tiny_engine_dir, tmp_path) -> None:
    path = tmp_path / "with-prompts.jsonl"
    options = ServerOptions(request_log=str(path), request_log_prompts=True)
    with start_server(tiny_engine_dir, port=0, device="cpu", options=options) as server:
        status, _, answer = request(server, "/v1/completions", {"prompt": [7, 8, 9, 10], "max_tokens": 3})
        assert status == 200, answer
        (line,) = read_lines(path, 1)
    assert line["prompt_token_ids"] == [7, 8, 9, 10] and line["prompt_len"] == 4
    # and diagnose reads the ids (the shared-prefix answer uses them)
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir), "--json"])
    assert result.exit_code == 0, result.output


def test_a_failing_disk_never_fails_a_request(tiny_engine_dir) -> None:
    # /dev/full opens for appending and fails every write with ENOSPC
    options = ServerOptions(request_log="/dev/full")
    with start_server(tiny_engine_dir, port=0, device="cpu", options=options) as server:
        for _ in range(3):
            status, _, answer = request(server, "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2})
            assert status == 200, answer
        wait_idle(server)
        deadline = time.monotonic() + 10
        while server.request_log.failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "No space left" in server.request_log.failed
        status, _, _ = request(server, "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 2})
        assert status == 200
        assert server.request_log.dropped >= 1


def test_cli_request_log_errors_are_one_line_before_loading(tiny_engine_dir, tmp_path) -> None:
    start = time.monotonic()
    missing = tmp_path / "no-such-dir" / "log.jsonl"
    result = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--port", "0", "--device", "cpu",
                                       "--request-log", str(missing)])  # fmt: skip
    assert result.exit_code != 0 and "--request-log: cannot open" in result.output and str(missing) in result.output
    assert len(result.output.strip().splitlines()) == 1 and time.monotonic() - start < 5
    result = CliRunner().invoke(main, ["serve", str(tiny_engine_dir), "--port", "0", "--request-log-prompts"])
    assert result.exit_code != 0 and "request_log_prompts: needs request_log" in result.output


def test_a_restarted_server_continues_the_log_after_a_cut_last_line(tiny_engine_dir, tmp_path) -> None:
    """A log written by a run that was killed mid-line, then appended to by a restarted server: the cut line is
    removed (appended to, it made a line no reader parses), and the new run's arrivals follow the old run's end,
    so `diagnose` reads the two runs one after the other instead of overlaid."""
    log_path = tmp_path / "requests.jsonl"
    earlier = {"arrival": 100.0, "prompt_len": 5, "output_len": 2, "output_lens": [2], "n": 1, "beam_width": 1,
               "cached_tokens": 0, "finish_reasons": ["length"], "ttft_s": 0.01, "latency_s": 0.5, "steps": 2,
               "step_time_s": 0.01}  # fmt: skip
    log_path.write_text(json.dumps(earlier) + "\n" + json.dumps(earlier)[:40])
    server = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(request_log=str(log_path)))
    try:
        status, _, _ = request(server, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200
        lines = read_lines(log_path, 2)
    finally:
        server.shutdown(timeout=0)
    assert lines[0] == earlier
    assert lines[1]["arrival"] >= earlier["arrival"] + earlier["latency_s"]
    result = CliRunner().invoke(main, ["diagnose", str(log_path), "--engine", str(tiny_engine_dir)])
    assert result.exit_code == 0, result.output


def test_a_whole_last_line_without_its_newline_is_kept(tmp_path) -> None:
    from trtpaged.server.request_log import RequestLog

    line = {"arrival": 5.0, "prompt_len": 5, "output_len": 2, "output_lens": [2], "n": 1, "beam_width": 1,
            "cached_tokens": 0, "finish_reasons": ["length"], "ttft_s": 0.01, "latency_s": 1.0, "steps": 2,
            "step_time_s": 0.01}  # fmt: skip
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps(line))
    log = RequestLog(path)
    log.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [line, line]
    assert time.monotonic() - log.started >= 6.0  # arrivals go on after the last line's end


def test_a_log_that_fills_its_disk_ends_at_its_last_whole_line(tmp_path) -> None:
    """A disk filling mid-batch left part of a line in the log, and `diagnose` then refused the whole log. The
    log is now cut back to its last whole line: every line it keeps parses. A real full disk: a 16 KiB tmpfs."""
    from runtime_helpers import small_tmpfs
    from trtpaged.server.request_log import RequestLog

    with small_tmpfs(tmp_path / "small", "16k") as small:
        log = RequestLog(small / "requests.jsonl")
        with open(small / "requests.jsonl", "a") as other:  # another writer (a /dev/stdout log gets the ready line)
            other.write("a line of another writer\n")
        for i in range(400):  # about 100 bytes a line: the disk fills within the first 200; small batches
            log.record({"arrival": float(i), "latency_s": 0.5, "pad": "x" * 80})
            time.sleep(0.002)
        log.close()
        assert log.failed is not None and "No space left" in log.failed and log.dropped > 0
        data = (small / "requests.jsonl").read_bytes()
        assert data.startswith(b"a line of another writer\n") and data.endswith(b"\n")  # cut from the real end
        kept = [json.loads(line) for line in data.splitlines()[1:]]
        assert [r["arrival"] for r in kept] == [float(i) for i in range(len(kept))] and kept
        assert len(kept) + log.dropped == 400


def test_aborted_requests_get_their_line(tiny_engine_dir, tmp_path) -> None:
    """A request aborted (client gone, request timeout, shutdown) got no line, so the log (and `diagnose`) lost the
    work it had done while /metrics counted it. Now its line holds the tokens made until then, "abort" for each
    completion still running, and the log's token sums equal the metrics' counters."""
    import http.client
    import socket

    from runtime_helpers import slowed_steps
    from tests.test_server import metrics

    path = tmp_path / "requests.jsonl"
    options = ServerOptions(request_log=str(path), request_timeout_s=1.0)
    server = start_server(tiny_engine_dir, port=0, device="cpu", options=options)
    try:
        restore = slowed_steps(server, 0.02)  # 400 tokens take 8 s: every abort lands mid-generation
        # a stream of two samples whose client hangs up after its first chunks
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "n": 2, "temperature": 1.0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        (gone,) = read_lines(path, 1)
        # one that runs into the server's request timeout
        status, _, answer = request(server, "/v1/completions",
                                    {"prompt": [8, 9], "max_tokens": 400, "ignore_eos": True})
        assert status == 504, answer
        timed_out = read_lines(path, 2)[1]
        wait_idle(server)
        m = metrics(server)
        restore()
        assert m['request_success_total{finished_reason="abort"}'] == 3  # each sample, as vLLM counts them
        for line, prompt_len, n in ((gone, 3, 2), (timed_out, 2, 1)):
            assert line["prompt_len"] == prompt_len and line["n"] == n and line["finish_reasons"] == ["abort"] * n
            assert len(line["output_lens"]) == n and all(0 < k < 400 for k in line["output_lens"])
            assert line["output_len"] == max(line["output_lens"]) and line["ttft_s"] <= line["latency_s"]
        assert m["prompt_tokens_total"] == sum(line["prompt_len"] * line["n"] for line in (gone, timed_out))
        assert m["generation_tokens_total"] == sum(sum(line["output_lens"]) for line in (gone, timed_out))
        # one still running at shutdown (no drain time) is aborted too
        slowed_steps(server, 0.02)
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({**body, "n": 1}), {"Content-Type": "application/json"})
        assert conn.getresponse().readline().startswith(b"data: ")
    finally:
        server.shutdown(timeout=0)
    lines = read_lines(path, 3)
    assert lines[2]["finish_reasons"] == ["abort"] and lines[2]["output_len"] > 0
    result = CliRunner().invoke(main, ["diagnose", str(path), "--engine", str(tiny_engine_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output[result.output.index("{"):])["requests"] == 3
