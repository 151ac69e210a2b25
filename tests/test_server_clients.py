"""Clients the server must work with unchanged: the official `openai` package, and `trtpaged bench serve`."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from tests.test_server import wait_idle
from trtpaged import LLM, SamplingParams
from trtpaged.bench.serve_bench import ServeRequest, format_report, run_serve_bench
from trtpaged.cli import main
from trtpaged.server import ServerOptions, start_server

KEY = "sk-clients-test"


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name="tiny", device="cpu",
                          options=ServerOptions(api_key=KEY))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu")


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_openai_client_chat_completions_streaming_n(client, llm):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == llm.chat(messages, greedy).outputs[0].text
    assert chat.usage.prompt_tokens == len(llm.chat_prompt(messages))

    comp = client.completions.create(model="tiny", prompt="once upon", max_tokens=8, temperature=0)
    assert comp.choices[0].text == llm.generate(["once upon"], greedy)[0].outputs[0].text

    pieces = client.completions.create(model="tiny", prompt="once upon", max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == comp.choices[0].text
    assert chunks[-1].usage.completion_tokens == comp.usage.completion_tokens

    deltas = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == chat.choices[0].message.content

    many = client.completions.create(model="tiny", prompt="sample", max_tokens=6, temperature=1.0, n=3, seed=5)
    truth = llm.generate(["sample"], SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5))[0]
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == [c.text for c in truth.outputs]
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_stream_interval_joins_tokens_into_fewer_chunks(tiny_engine_dir, llm):
    """`--stream-interval 4` through a real server and the official client: the first token's chunk at once,
    then 4 tokens a chunk (counted by their log-prob entries), the last chunk at the end; joined, the chunks
    are the non-streamed text (also with a stop string the runtime holds back, and for chat)."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
    with pytest.raises(ValueError, match="stream_interval: must be positive"):
        ServerOptions(stream_interval=0)
    handle = start_server(tiny_engine_dir, port=0, served_model_name="tiny", device="cpu",
                          options=ServerOptions(stream_interval=4))  # fmt: skip
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0, timeout=60)
        body = dict(model="tiny", prompt="once upon", max_tokens=11, temperature=0, extra_body={"ignore_eos": True})
        whole = client.completions.create(**body).choices[0].text
        truth = llm.generate(["once upon"], SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True))[0]
        assert whole == truth.outputs[0].text
        chunks = [c for c in client.completions.create(**body, logprobs=1, stream=True) if c.choices]
        assert [len(c.choices[0].logprobs.tokens) for c in chunks] == [1, 4, 4, 2]
        assert "".join(c.choices[0].text for c in chunks) == whole
        stop = whole[3:5]
        streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stop=stop, stream=True))
        assert streamed == client.completions.create(**body, stop=stop).choices[0].text == whole[: whole.index(stop)]
        messages = [{"role": "user", "content": "hello"}]
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
        deltas = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                                stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in deltas) == chat.choices[0].message.content
        wait_idle(handle)
    finally:
        handle.shutdown(timeout=0)


def test_openai_client_sees_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**9)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_bench_serve_against_the_server(server):
    requests = [ServeRequest(f"word {i} " * (4 + i), 8 + i) for i in range(6)]
    wait_idle(server)

    def steps_and_seconds(engine):
        return engine.num_steps, sum(engine.phase_seconds.values())

    steps0, seconds0 = server.loop.call(steps_and_seconds)
    report = asyncio.run(run_serve_bench(server.url, requests, float("inf"), max_concurrency=3, api_key=KEY))
    steps1, seconds1 = server.loop.call(steps_and_seconds)
    assert report["engine_step_ms"] == pytest.approx(1000 * (seconds1 - seconds0) / (steps1 - steps0), rel=1e-6)
    assert 0 < report["server_tpot_ms"] and "Mean engine step (ms):" in format_report(report)
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(r.max_tokens for r in requests)  # ignore_eos: exact lengths
    assert report["total_input_tokens"] > 0
    assert 0 < report["p50_ttft_ms"] <= report["p99_ttft_ms"] and report["mean_itl_ms"] > 0
    assert report["mean_tpot_ms"] > 0 and report["p90_e2el_ms"] >= report["p50_e2el_ms"]
    assert "Successful requests:" in format_report(report)
    wait_idle(server)
    wrong = asyncio.run(run_serve_bench(server.url, requests[:2], 100.0, api_key="wrong"))
    assert wrong["completed"] == 0 and wrong["errors"] == {"HTTP 401": 2}


def test_cli_bench_serve_json(server):
    result = CliRunner().invoke(main, ["bench", "serve", "--base-url", server.url, "--num-requests", "4",
                                       "--prompt-len", "3:6", "--output-len", "4", "--request-rate", "50",
                                       "--api-key", KEY, "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["completed"] == 4 and report["total_output_tokens"] == 16 and report["request_rate"] == 50.0


def test_bare_reader_refuses_an_error_answer(server):
    """The bare reader of `bench serve-ratio` reports a refused stream by its status, not as an empty text
    (this server wants an API key, which the reader does not send)."""
    from trtpaged.bench.sse_reader import bare_batch_rate

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    with pytest.raises(ValueError, match="401"):
        bare_batch_rate(server.url, [body])


def test_bench_serve_ratio_runs_both_sides_on_the_same_prompts(tiny_engine_dir):
    """`bench serve-ratio` on the tiny engine: a real `trtpaged serve` child and the Python API give the same
    greedy texts, and every figure is a measured rate."""
    from trtpaged.bench.serve_ratio import format_ratio, run_serve_ratio

    report = run_serve_ratio(tiny_engine_dir, repeats=2, max_tokens=6, concurrency=3)
    assert report["same_text_single"] is True and report["same_text_batch"] == "3/3"
    assert report["same_text_bare"] == "3/3" and report["bare_ratio"] > 0  # the bare reader's texts are the API's
    assert all(len(v) == 2 and min(v) > 0 for v in report["series"].values())
    assert all(min(v) > 0 for v in report["step_ms"].values())
    assert report["single_ratio"] > 0 and report["batch_ratio"] > 0
    assert "serve / LLM.generate" in format_ratio(report)
    # CPU per token by side (/proc's 10 ms ticks: only the 3-stream runs are long enough to be sure of a tick)
    us = report["cpu_us_per_token"]["batch"]
    assert us["api"] > 0 and us["engine"] > 0 and us["client"] > 0, us
    assert "HTTP/event loop" in format_ratio(report)
    assert "bare reader" in format_ratio(report) and report["cpu_us_per_token"]["bare"]["engine"] > 0
