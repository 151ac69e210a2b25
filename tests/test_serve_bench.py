"""`bench serve` and `bench serve-ratio` timings against independent truths: hand computations on chunk times
built here, and a real `trtpaged serve` (of the tiny engine; of SmolLM2 int4 where the ratios of timings need
decode steps longer than scheduling noise) whose request log records each request's server-side TTFT, latency,
per-sequence output lengths and beam width."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from click.testing import CliRunner

from trtpaged import LLM, SamplingParams
from trtpaged.bench.serve_bench import (RequestResult, ServeRequest, _body, _one, format_report, make_report,
                                        prompts_from_trace, run_serve_bench, stream_timings)  # fmt: skip
from trtpaged.bench.serve_ratio import SERVED_NAME, client_decode_points, window_rate
from trtpaged.bench.workload import TraceRequest
from trtpaged.cli import main
from trtpaged.server import ServerOptions, start_server

from runtime_helpers import server_with_request_log

# greedy on the tiny engine: 9 tokens whose text is empty (the server streams only the final, empty chunk)
NO_TEXT_PROMPT = ("then in there which come now be have first see will water for it was had made but that up of on "
                  "other go has said so like no day its word then was if but we no have them one how as it long to "
                  "look so")  # fmt: skip


def completion(index: int, text: str, finish: str | None = None, tokens: int | None = None) -> dict:
    """One streamed completions chunk of choice `index` (with continuous usage `tokens` so far when given)."""
    chunk: dict = {"choices": [{"index": index, "text": text, "finish_reason": finish}]}
    if tokens is not None:
        chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": tokens}
    return chunk


def usage(tokens: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}


# ---------------------------------------------------------------- hand computations on built streams


def test_ttft_is_the_first_output_chunk_and_a_stream_without_one_fails():
    """F1: a request whose only output chunk is its empty final one has its TTFT there (not 0) and no TPOT; the
    chat role-only chunk is no output; a stream with no output chunk at all is a failed request."""
    no_text = stream_timings(RequestResult(ok=True), 10.0, [(10.5, completion(0, "", "length")), (10.6, usage(9))],
                             10.7)  # fmt: skip
    assert no_text.ok and no_text.ttft == pytest.approx(0.5) and no_text.tpot is None and no_text.itl == []
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    chat = stream_timings(RequestResult(ok=True), 0.0, [
        (0.01, role), (0.2, {"choices": [{"index": 0, "delta": {"content": "a"}}]}),
        (0.3, {"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": "length"}]}), (0.31, usage(2))],
        0.32)  # fmt: skip
    assert chat.ttft == pytest.approx(0.2) and chat.tpot == pytest.approx(0.1) and chat.itl == pytest.approx([0.1])
    empty = stream_timings(RequestResult(ok=True), 0.0, [(0.1, role), (0.2, usage(0))], 0.3)
    assert not empty.ok and "no output chunk" in empty.error
    streamed = stream_timings(RequestResult(ok=True), 0.0, [(0.02, completion(0, "x")), (0.05, completion(0, "y")),
                                                            (0.06, usage(2))], 0.07)  # fmt: skip
    report = make_report([no_text, streamed, empty], 1.0, float("inf"), None, "u")
    # TTFT over both completed requests (0.5 s and 0.02 s); TPOT only the streamed one's 30 ms
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["mean_ttft_ms"] == pytest.approx(260.0) and report["mean_tpot_ms"] == pytest.approx(30.0)
    assert report["tpot_requests"] == 1 and "Requests timed for TPOT:" in format_report(report)


def test_tpot_and_itl_are_per_sequence_for_n_choices():
    """F2: n = 2 choices interleaved, 4 tokens each (usage 8): per choice TPOT = (last - first) / 3, ITL the gaps
    within a choice; with continuous usage, the tokens each chunk held count (choice 1's first chunk holds 2)."""
    events = [(1.0, completion(0, "a")), (1.1, completion(1, "a")), (1.2, completion(0, "b")),
              (1.4, completion(1, "b")), (1.5, completion(0, "c")), (1.7, completion(1, "c")),
              (1.8, completion(0, "d", "length")), (2.0, completion(1, "d", "length")), (2.01, usage(8))]  # fmt: skip
    r = stream_timings(RequestResult(ok=True), 0.5, events, 2.02, n=2)
    assert r.output_tokens == 8 and r.ttft == pytest.approx(0.5)
    # choice 0: (1.8 - 1.0) / 3; choice 1: (2.0 - 1.1) / 3
    assert r.tpot == pytest.approx(((1.8 - 1.0) / 3 + (2.0 - 1.1) / 3) / 2)
    assert sorted(r.itl) == pytest.approx(sorted([0.2, 0.3, 0.3, 0.3, 0.3, 0.3]))
    counted = [(1.0, completion(0, "a", tokens=1)), (1.1, completion(1, "ab", tokens=2)),
               (1.4, completion(0, "bcd", "length", tokens=4)), (1.5, completion(1, "cd", "length", tokens=4)),
               (1.51, usage(8))]  # fmt: skip
    r = stream_timings(RequestResult(ok=True), 0.5, counted, 1.52, n=2)
    assert r.tpot == pytest.approx(((1.4 - 1.0) / 3 + (1.5 - 1.1) / 2) / 2) and r.output_tokens == 8


def test_window_rate_counts_the_tokens_after_the_window_start():
    """F5, F6: the serve side's first chunk holds 9 of 16 tokens (stream interval 8): its rate is 7 tokens over
    its window, and the API's (one token a step) is taken over the same tokens; one chunk has no rate."""
    serve = [(1.0, 9), (1.7, 16)]
    assert window_rate(serve) == pytest.approx(7 / 0.7)  # the old formula: 15 / 0.7
    api = [(0.1 * k, k) for k in range(1, 17)]
    assert window_rate(api) == pytest.approx(15 / 1.5) and window_rate(api, 9) == pytest.approx(7 / 0.7)
    with pytest.raises(ValueError, match="--max-tokens .* --stream-interval"):
        window_rate([(1.0, 4)])


def test_serve_ratio_refuses_max_tokens_within_one_stream_interval(tiny_engine_dir):
    """F5: refused before anything loads, naming both options (was: ZeroDivisionError after the rounds)."""
    result = CliRunner().invoke(main, ["bench", "serve-ratio", str(tiny_engine_dir), "--repeats", "1", "--max-tokens",
                                       "4", "--concurrency", "2", "--stream-interval", "8"])  # fmt: skip
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit, result.output
    assert "--max-tokens 4" in result.output and "--stream-interval" in result.output


def test_serve_ratio_refuses_max_tokens_the_engine_has_no_room_for(tiny_engine_dir):
    """The tiny engine's 512 positions leave about 55 tokens beside the benchmark's longest chat prompt: 64 is
    refused before a server starts (was: every request refused, then the openai client's traceback)."""
    llm = LLM(tiny_engine_dir, device="cpu")
    from trtpaged.bench.serve_ratio import conversation

    room = llm.config.max_seq_len - max(len(llm.chat_prompt(conversation(i))) for i in range(2))
    result = CliRunner().invoke(main, ["bench", "serve-ratio", str(tiny_engine_dir), "--repeats", "1", "--max-tokens",
                                       str(room + 1), "--concurrency", "2"])  # fmt: skip
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit, result.output
    assert f"--max-tokens {room + 1}" in result.output and f"at most {room}" in result.output
    # a smaller max_seq_len given to the servers leaves less room
    smaller = CliRunner().invoke(main, ["bench", "serve-ratio", str(tiny_engine_dir), "--repeats", "1", "--max-tokens",
                                        str(room), "--concurrency", "2", "--server-arg=--max-model-len",
                                        f"--server-arg={llm.config.max_seq_len - 1}"])  # fmt: skip
    assert smaller.exit_code == 1 and f"at most {room - 1}" in smaller.output, smaller.output


def test_serve_ratio_says_which_server_failed_mid_run(tiny_engine_dir):
    """A server child that died during the rounds ended bench serve-ratio with the openai client's (or urllib's)
    traceback; it is now a one-line error naming the run, how the server ended and what it wrote last."""
    import click

    from trtpaged.bench.serve_ratio import ServeArm, client_batch_rate
    from trtpaged.commands.bench import _print_report

    arm = ServeArm(tiny_engine_dir, 1, (), 2)
    try:
        texts, _ = arm.measure("batch", lambda url: client_batch_rate(url, 2, 4), 8, 0.0)  # the server works
        assert len(texts) == 2
        arm.server.proc.kill()
        arm.server.proc.wait()
        with pytest.raises(click.ClickException) as failed:
            _print_report(lambda: arm.measure("single", lambda url: client_decode_points(url, 4), 4, 0.0), str, False)
        said = failed.value.message
        assert said.startswith("the single run against trtpaged serve (--stream-interval 1) failed: "), said
        assert "the server was killed by signal 9" in said
    finally:
        arm.server.close()


def test_serve_ratio_names_the_bare_run_a_server_refused(tiny_engine_dir):
    """The bare reader's error status (a ValueError, "the server answered 404") left measure as it was: the
    one-line error named neither the run nor the server, where the openai client's runs name both."""
    from trtpaged.bench.serve_ratio import SERVED_NAME, ServeArm, ServerError, bare_bodies
    from trtpaged.bench.sse_reader import bare_batch_rate

    arm = ServeArm(tiny_engine_dir, 1, (), 2)
    bodies = [dict(b, model=SERVED_NAME + "-missing") for b in bare_bodies(1, 4)]  # a model the server has not
    try:
        with pytest.raises(ServerError) as failed:
            arm.measure("bare", lambda url: bare_batch_rate(url, bodies), 4, 0.0)
        said = str(failed.value)
        assert said.startswith("the bare run against trtpaged serve (--stream-interval 1) failed: ValueError: the "
                               "server answered 404"), said
        assert "the server is still running" in said
    finally:
        arm.server.close()


def test_serve_ratio_s_cpu_per_token_leaves_out_its_own_metrics_scrapes(tiny_engine_dir):
    """A run's server CPU was read after its closing /metrics scrape, so the scrape (milliseconds of the HTTP
    thread) counted as the run's "HTTP/event loop" CPU; only what the server did between the scrapes counts."""
    from trtpaged.bench.serve_ratio import ServeArm, _cpu_delta

    arm = ServeArm(tiny_engine_dir, 1, (), 2)
    try:
        server = arm.server
        server.metrics()  # the first scrape builds what later ones reuse
        before = server.thread_cpu_seconds()
        for _ in range(3):
            server.metrics()
        scrapes = _cpu_delta(before, server.thread_cpu_seconds())["http"]  # three scrapes' HTTP-thread CPU
        assert scrapes > 0, "the server's threads' CPU is not readable here"
        for _ in range(3):  # runs that send nothing: the server is idle between the scrapes
            arm.measure("single", lambda url: (0.0, "", 0.0), 1, 0.0)
        assert arm.cpu["single"].seconds["http"] < scrapes / 3, (arm.cpu["single"].seconds, scrapes)
    finally:
        arm.server.close()


def test_serve_ratio_labels_a_noisy_run_s_ratios_indicative():
    """F11: the text of a report whose noise is not trustworthy says so on every ratio line."""
    from trtpaged.bench.serve_ratio import format_ratio

    us = dict.fromkeys(("api", "engine", "http", "other", "client"), 1.0)
    interval = {"single_ratio": 0.8, "batch_ratio": 0.9, "bare_ratio": 1.0, "same_text_single": True,
                "same_text_batch": "2/2", "same_text_bare": "2/2", "single_rounds": [0.8], "batch_rounds": [0.9],
                "cpu_us_per_token": dict.fromkeys(("single", "batch", "bare"), us), "api_single": [10.0],
                "verdict_single": "no verdict (noisy run: x)",
                "verdict_batch": "no verdict (noisy run: x)"}  # fmt: skip
    report = {"series": {}, "labels": {}, "step_ms": {}, "concurrency": 2, "by_interval": {"1": interval},
              "noise": {"trustworthy": False}, "noise_text": "noise: NOT trustworthy"}  # fmt: skip
    ratio_lines = [line for line in format_ratio(report).splitlines() if "serve / " in line]
    assert len(ratio_lines) == 3 and all("indicative only" in line for line in ratio_lines), ratio_lines
    report["noise"]["trustworthy"] = True
    assert "indicative only" not in format_ratio(report)


def test_trace_beam_width_and_n_reach_the_request_body():
    """F3: a trace line's beam_width is sent as the server's `beam_width` field (was: dropped)."""
    beam, sampled = prompts_from_trace([TraceRequest(10, 4, beam_width=8), TraceRequest(10, 4, n=3)])
    assert _body(beam, None, False, True)["beam_width"] == 8 and "n" not in _body(beam, None, False, True)
    assert _body(sampled, None, False, True)["n"] == 3 and "beam_width" not in _body(sampled, None, False, True)


# ---------------------------------------------------------------- against a real server and its request log


@pytest.fixture(scope="module")
def logged(tiny_engine_dir, tmp_path_factory):
    """A tiny-engine server writing its request log, and a reader of the lines logged so far."""
    with server_with_request_log(tiny_engine_dir, tmp_path_factory.mktemp("serve-bench") / "requests.jsonl") as served:
        yield served


def _one_request(url: str, body: dict) -> RequestResult:
    async def run() -> RequestResult:
        async with httpx.AsyncClient(timeout=60) as client:
            return await _one(client, url + "/v1/completions", body, {})

    return asyncio.run(run())


def test_a_request_that_streams_no_text_is_timed_by_its_first_chunk(logged, tiny_engine_dir):
    """F1 on the server: its 9 tokens have no text; the client's TTFT cannot precede the server's own (from the
    request log; was 0), and with one chunk it has no TPOT."""
    server, lines = logged
    out = LLM(tiny_engine_dir, device="cpu").generate([NO_TEXT_PROMPT], SamplingParams(
        max_tokens=9, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.text == "" and len(out.token_ids) == 9  # the precondition: a stream with no text
    seen = len(lines(0, timeout=0))
    result = _one_request(server.url, _body(ServeRequest(NO_TEXT_PROMPT, 9), "tiny", False, True))
    (line,) = lines(seen + 1)[seen:]
    assert result.ok and result.output_tokens == 9 and line["output_lens"] == [9]
    assert result.ttft >= line["ttft_s"] > 0 and result.tpot is None and result.itl == []


@pytest.mark.slow
def test_n_choices_get_a_per_sequence_tpot_and_itl(smollm2_int4_engine_dir, tmp_path):
    """F2 on the server: n = 4, 20 tokens each; the client's TPOT is near the server's own per-sequence decode
    time, (latency - ttft) / (tokens of a sequence - 1) from the request log, and the ITL gaps, taken within each
    choice, add up to about four times the server's decode span (the old client divided by all 80 tokens and took
    gaps across choices: about a quarter of both). A chunk may hold several tokens (text held back), so the gaps
    are not compared one by one. SmolLM2, not the tiny engine: the tiny one decodes these 19 steps in ~20 ms, and
    with CPU hogs beside it one late chunk moved single ratios to 0.27 and the median of three to 0.74 (bound 0.6);
    on SmolLM2 (hundreds of ms) they read 0.98-1.01 with two hogs."""
    ratios = []
    with server_with_request_log(smollm2_int4_engine_dir, tmp_path / "requests.jsonl") as (server, lines):
        for attempt in range(3):  # the median of three: one slow chunk on a shared machine moves one attempt
            seen = len(lines(0, timeout=0))
            body = _body(ServeRequest("word " * 12 + str(attempt), 20, n=4), "tiny", False, True)
            result = _one_request(server.url, body)
            (line,) = lines(seen + 1)[seen:]
            assert result.ok and result.output_tokens == 80 and line["output_lens"] == [20] * 4 and line["n"] == 4
            decode_s = line["latency_s"] - line["ttft_s"]
            ratios.append((result.tpot / (decode_s / 19), sum(result.itl) / (4 * decode_s)))
    tpot, itl = sorted(r[0] for r in ratios)[1], sorted(r[1] for r in ratios)[1]
    assert 0.6 < tpot < 1.6 and 0.6 < itl < 1.6, ratios


def test_bench_serve_sends_beam_width_and_a_warmup_it_does_not_count(logged):
    """F3, F10 on the server: the request log holds the uncounted warm-up, then the run's requests, the beam
    line as a beam search of width 3 (was: width 1); the beam request counts in E2E only."""
    server, lines = logged
    seen = len(lines(0, timeout=0))
    requests = prompts_from_trace([TraceRequest(12, 4, beam_width=3), TraceRequest(12, 6)], seed=4)
    report = asyncio.run(run_serve_bench(server.url, requests, float("inf"), max_concurrency=1, seed=4))
    logged_now = lines(seen + 3)[seen:]
    assert len(logged_now) == 3 and report["completed"] == 2 and report["failed"] == 0
    warm, *run = logged_now
    assert warm["n"] == 1 and warm["beam_width"] == 1 and warm["cached_tokens"] == 0
    assert sorted(line["beam_width"] for line in run) == [1, 3]
    assert report["beam_search_requests"] == 1 and report["total_output_tokens"] == 10
    assert report["tpot_requests"] == 1 and "Beam-search requests (E2E only):" in format_report(report)
    # the warm-up shares no prompt with the run: no run request found its blocks cached
    assert all(line["cached_tokens"] == 0 for line in run)


@pytest.mark.slow
def test_serve_ratio_single_stream_rate_counts_the_tokens_after_its_first_chunk(smollm2_int4_engine_dir):
    """F6 on the server: at stream interval 8 the first content chunk of this answer (emoji, several tokens a
    character) holds 9 tokens (its first token's text is held back); the client's rate over the tokens after that
    chunk stays near the server's own decode rate, (tokens - 1) / (latency - ttft) from the request log, where
    (tokens - 1) over the same window (the old formula) is 23 / 15 = 1.5x it. SmolLM2, not the tiny engine: at the
    tiny one's 0.4 ms a token, a few ms of scheduling beside another test worker moved the ratio past 1.25."""
    import tempfile
    from pathlib import Path

    emoji = [{"role": "user", "content": "Reply with \N{PARTY POPPER} only."}]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        server = start_server(smollm2_int4_engine_dir, port=0, served_model_name=SERVED_NAME, device="cpu",
                              options=ServerOptions(request_log=str(path), stream_interval=8))  # fmt: skip
        try:
            client_decode_points(server.url, 8, emoji)  # warm
            ratios = []
            for _ in range(3):
                points, _, _ = client_decode_points(server.url, 24, emoji)
                deadline = time.monotonic() + 10
                while len(path.read_text().splitlines()) < 2 + len(ratios) and time.monotonic() < deadline:
                    time.sleep(0.05)
                line = json.loads(path.read_text().splitlines()[-1])
                assert points[0][1] == 9 and points[-1][1] == 24 and line["output_lens"] == [24], points
                ratios.append(window_rate(points) / (23 / (line["latency_s"] - line["ttft_s"])))
        finally:
            server.shutdown(timeout=0)
    assert 0.7 < sorted(ratios)[1] < 1.25, ratios
