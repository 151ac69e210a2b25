"""/metrics counts what the clients got: tokens of every choice of an aborted n>1 request, one inter-token gap per
token-making engine step of each sample at any --stream-interval, no time per output token for an answer that came
in one output (beam search), nothing generated for echo with max_tokens 0; vLLM's load gauges count samples and
beams. The truth is the client's own count."""

from __future__ import annotations

import http.client
import json
import logging
import time

import pytest

from tests.test_server import metrics, request, wait_idle
from trtpaged.errors import FatalEngineError
from trtpaged.server import ServerOptions, start_server

from runtime_helpers import slowed_steps

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu",
                          options=ServerOptions(stream_interval=4))  # fmt: skip
    yield handle
    handle.shutdown(timeout=0)


def _delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_aborted_n3_stream_counts_every_choices_tokens(server):
    before = metrics(server)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 300, "n": 3, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # fmt: skip
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    received: dict[int, int] = {}
    while len(received) < 3 or min(received.values()) < 9:
        line = resp.readline().decode()
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                received[c["index"]] = received.get(c["index"], 0) + len(c.get("token_ids") or [])
    conn.close()  # the client is gone mid-stream: the request is aborted
    after = wait_idle(server)
    assert _delta(before, after, 'request_success_total{finished_reason="abort"}') == 3  # each sample
    counted = _delta(before, after, "generation_tokens_total")
    # every choice's tokens (at most a step or an interval more than the client read before it hung up)
    assert sum(received.values()) <= counted <= sum(received.values()) + 3 * 8
    assert _delta(before, after, "request_generation_tokens_sum") == counted


def test_inter_token_gaps_are_per_token_at_stream_interval_4(server):
    before = metrics(server)
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                                           "max_tokens": 41, "ignore_eos": True, "stream": True})
    assert status == 200
    after = wait_idle(server)
    # one request of 41 tokens, one token a step: 40 gaps, though the stream sent them 4 at a time
    assert _delta(before, after, "inter_token_latency_seconds_count") == 40
    assert _delta(before, after, "generation_tokens_total") == 41


def test_inter_token_gaps_are_per_sample_as_vllm_times_each_child_request(server):
    """vLLM v1 runs each of n samples as an engine request of its own and observes an inter-token gap for each of
    its outputs after the first (vllm/v1/metrics/stats.py, IterationStats.update_from_output): a sample of T tokens
    made one a step is T - 1 gaps. Here an n=3 request's steps counted once, for all its samples: 40, not 120."""
    before = metrics(server)
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": "gaps of three", "n": 3,
                                                           "max_tokens": 41, "ignore_eos": True})  # fmt: skip
    assert status == 200
    after = wait_idle(server)
    gaps = answer["usage"]["completion_tokens"] - len(answer["choices"])
    assert _delta(before, after, "inter_token_latency_seconds_count") == gaps == 120


def _send_each_once_the_last_is_in(server, bodies, threads):
    """Sends completions `bodies` on threads (appended to `threads`, for the caller to join whatever happens), each
    once the one before runs or waits; returns their answers (filled as they end) and, per request, when it was
    sent and when /metrics first counted it."""
    import threading

    answers: list = [None] * len(bodies)
    sent, seen = [], []
    for i, body in enumerate(bodies):
        def send(i=i, body=body):
            answers[i] = request(server, "/v1/completions", {"model": MODEL, "ignore_eos": True, **body})

        threads.append(threading.Thread(target=send))
        sent.append(time.monotonic())
        threads[-1].start()
        deadline = time.monotonic() + 30
        while (m := metrics(server))["num_requests_running"] + m["num_requests_waiting"] < i + 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        seen.append(time.monotonic())
    return answers, sent, seen


def _gauges_while(server, bodies, step_seconds=0.01):
    """One scrape of /metrics taken while the requests `bodies` (completions, sent in order, each once the one
    before runs or waits) are all in the engine, two steps after the last came, each step slowed by
    `step_seconds`; and their answers."""
    threads: list = []
    restore = slowed_steps(server, step_seconds)
    try:
        answers, _, _ = _send_each_once_the_last_is_in(server, [{"max_tokens": 200, **b} for b in bodies], threads)
        deadline = time.monotonic() + 20
        steps = metrics(server)["engine_steps_total"]  # two more: the running ones past their prompts (beams forked)
        while (m := metrics(server))["engine_steps_total"] < steps + 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        restore()
        for thread in threads:
            thread.join(60)
    wait_idle(server)
    assert all(status == 200 for status, _, _ in answers), answers
    return m, [answer for _, _, answer in answers]


@pytest.fixture(scope="module")
def small_pool(tiny_engine_dir):
    """24 blocks of 16 tokens: a 200-token prompt's 6 samples of 8 tokens hold 18 (12 shared, 6 last blocks), and
    another 200-token prompt, 13 more, waits for them."""
    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu", num_kv_blocks=24)
    yield handle
    handle.shutdown(timeout=0)


def test_vllm_load_gauges_count_each_sample_as_vllm_counts_child_requests(small_pool):
    """vLLM v1 fans an n > 1 request out into n engine requests, and its gauges count those
    (vllm/v1/core/sched/scheduler.py, make_stats: len(self.running), len(self.waiting)). An n=6 request runs, an
    n=4 one waits for its blocks: vLLM's gauges read 6 and 4 (they read 1 and 1, this server's own
    num_requests_*, which still count requests)."""
    server = small_pool
    bodies = [{"prompt": [5 + i % 7 for i in range(200)], "n": 6, "max_tokens": 8},
              {"prompt": [6 + i % 11 for i in range(200)], "n": 4, "max_tokens": 8}]  # fmt: skip
    m, (running, waiting) = _gauges_while(server, bodies, step_seconds=0.3)
    label = f'{{model_name="{server.model_name}"}}'
    assert m[f"vllm:num_requests_running{label}"] == len(running["choices"]) == bodies[0]["n"]
    assert m[f"vllm:num_requests_waiting{label}"] == len(waiting["choices"]) == bodies[1]["n"]
    assert (m["num_sequences_running"], m["num_sequences_waiting"]) == (bodies[0]["n"], bodies[1]["n"])
    assert m["num_requests_running"] == m["num_requests_waiting"] == 1


def test_vllm_running_gauge_counts_each_beam(server):
    """A beam search of width 3 (best_of) returning 2: vLLM runs each live beam's step as an engine request
    (vllm/entrypoints/openai/serving_engine.py, beam_search), so its running gauge reads the beams, 3."""
    body = {"prompt": "beams", "n": 2, "use_beam_search": True, "best_of": 3, "temperature": 0}
    m, (answer,) = _gauges_while(server, [body])
    assert len(answer["choices"]) == 2
    assert m[f'vllm:num_requests_running{{model_name="{server.model_name}"}}'] == body["best_of"]


def test_beam_search_answer_has_no_time_per_output_token(server):
    before = metrics(server)
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": "abc def", "max_tokens": 12,
                                                           "n": 2, "use_beam_search": True, "best_of": 3,
                                                           "ignore_eos": True, "temperature": 0})  # fmt: skip
    assert status == 200
    after = wait_idle(server)
    assert _delta(before, after, "generation_tokens_total") == answer["usage"]["completion_tokens"] == 24
    # the answer came whole at the end: no per-token time to report (it was recorded as 0 s)
    assert _delta(before, after, "request_time_per_output_token_seconds_count") == 0
    # one request whose returned beams are its samples (README: vLLM counts each beam's every step instead)
    beams = len(answer["choices"])
    assert _delta(before, after, "inter_token_latency_seconds_count") == 0
    assert _delta(before, after, "time_to_first_token_seconds_count") == beams
    assert _delta(before, after, 'request_success_total{finished_reason="length"}') == beams
    assert _delta(before, after, "prompt_tokens_total") == beams * answer["usage"]["prompt_tokens"]
    assert _delta(before, after, "request_params_n_count") == 1


@pytest.mark.parametrize("n", [1, 2])
def test_echo_with_max_tokens_0_generates_nothing(server, n):
    before = metrics(server)
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": "echo this", "max_tokens": 0,
                                                           "echo": True, "logprobs": 1, "n": n})  # fmt: skip
    assert status == 200 and answer["usage"]["completion_tokens"] == 0
    after = wait_idle(server)
    assert _delta(before, after, "generation_tokens_total") == 0
    assert _delta(before, after, "time_to_first_token_seconds_count") == 0
    assert _delta(before, after, 'request_success_total{finished_reason="length"}') == n
    assert [c["finish_reason"] for c in answer["choices"]] == ["length"] * n


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_ends_with_length_whatever_ended_its_dropped_token(server, stream):
    """The token sampled to score the prompt is dropped, and so is what ended it: forced to be a stop token
    (allowed_token_ids), the answer said "stop" and that token as its stop_reason, for a completion of 0 tokens."""
    body = {"model": MODEL, "prompt": "echo this", "max_tokens": 0, "echo": True, "n": 2, "allowed_token_ids": [7],
            "stop_token_ids": [7], "stream": stream}  # fmt: skip
    if not stream:
        status, _, answer = request(server, "/v1/completions", body)
        assert status == 200, answer
        assert [(c["finish_reason"], c["stop_reason"]) for c in answer["choices"]] == [("length", None)] * 2
        return
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    ends = []
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("data: {"):
            ends += [(c["finish_reason"], c.get("stop_reason")) for c in json.loads(line[6:])["choices"]
                     if c.get("finish_reason")]  # fmt: skip
    conn.close()
    assert ends == [("length", None)] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_logs_the_finish_reason_its_answer_gave(server, stream, caplog):
    """The access log line's finish= is the answer's: it said "stop" (the dropped token's) where the answer said
    "length"."""
    body = {"model": MODEL, "prompt": f"log this {stream}", "max_tokens": 0, "echo": True, "n": 2,
            "allowed_token_ids": [7], "stop_token_ids": [7], "stream": stream}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trtpaged.server"):
        status, _, answer = request(server, "/v1/completions", body)
        assert status == 200, answer
        rid = json.loads(answer.split("data: ", 2)[1].splitlines()[0])["id"] if stream else answer["id"]
        for _ in range(50):  # the line is written once the response has ended
            lines = [r.getMessage() for r in caplog.records if f" 200 {rid} " in r.getMessage()]
            if lines:
                break
            time.sleep(0.1)
    assert len(lines) == 1 and " completion=0 finish=length " in lines[0], lines


def test_every_prompt_that_fails_in_the_same_step_is_counted(server):
    """Two prompts of one request that both find no token to sample in their first step: the first failure ended
    the request's other prompt, whose own end in that step was then never counted (1 error, 1 prompt's tokens)."""
    before = metrics(server)
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7], [8, 9]],
                                                           "max_tokens": 3, "allowed_token_ids": [0],
                                                           "guided_choice": ["yes"]})  # fmt: skip
    assert status == 400 and answer["error"]["param"] == "guided_choice"
    after = wait_idle(server)
    assert _delta(before, after, 'request_success_total{finished_reason="error"}') == 2
    assert _delta(before, after, "prompt_tokens_total") == 5
    assert _delta(before, after, "generation_tokens_total") == 0


def test_vllm_load_gauges_carry_the_same_values_under_vllms_names(server):
    """What autoscalers and inference gateways scrape from vLLM (KEDA, the Gateway API inference extension):
    vllm:num_requests_running / _waiting and vllm:kv_cache_usage_perc (and its older name gpu_cache_usage_perc),
    labelled with the served model's name, equal to this server's own gauges in the same scrape, idle and busy.
    The busy request's steps are slowed (300 tokens >= 3 s): at full speed it lasted 0.25 s, and ended as little
    as 0.23 s after the busy scrape with a CPU hog beside the test."""
    import threading

    body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True}
    busy = threading.Thread(target=lambda: request(server, "/v1/completions", body))
    restore = slowed_steps(server, 0.01)
    try:
        for state in ("idle", "busy"):
            if state == "busy":
                busy.start()
                deadline = time.monotonic() + 20
                while metrics(server)["num_requests_running"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            m = metrics(server)
            label = f'{{model_name="{server.model_name}"}}'
            assert m[f"vllm:num_requests_running{label}"] == m["num_requests_running"], (state, m)
            assert m[f"vllm:num_requests_waiting{label}"] == m["num_requests_waiting"], (state, m)
            for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
                assert m[f"vllm:{name}{label}"] == m["kv_cache_usage_perc"], (state, name, m)
        assert m["kv_cache_usage_perc"] > 0 and m["num_requests_running"] == 1
    finally:
        restore()  # the rest of the request at full speed
        if busy.is_alive():
            busy.join(60)
    wait_idle(server)


def test_vllm_names_of_the_request_series_count_the_same(server):
    """Dashboards written for vLLM read its request histograms and counters (vllm:time_to_first_token_seconds,
    vllm:e2e_request_latency_seconds, vllm:prompt_tokens_total, vllm:request_success_total{finished_reason}, ...,
    vllm:num_preemptions_total, vllm:prefix_cache_hits_total): each series equals this server's own in the same
    scrape, labelled with the model's name, and moves with a request the client counted."""
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": "count me", "max_tokens": 9,
                                                           "ignore_eos": True})  # fmt: skip
    assert status == 200
    m = wait_idle(server)
    label = f'model_name="{server.model_name}"'
    names = ["time_to_first_token_seconds", "inter_token_latency_seconds", "request_time_per_output_token_seconds",
             "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens"]
    for name in names:
        for part in ("_count", "_sum"):
            assert m[f"vllm:{name}{part}{{{label}}}"] == m[name + part], (name, m)
        assert m[f'vllm:{name}_bucket{{le="+Inf",{label}}}'] == m[name + "_count"]
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert m[f"vllm:{name}{{{label}}}"] == m[name], (name, m)
    length = 'finished_reason="length"'
    assert m[f"vllm:request_success_total{{{length},{label}}}"] == m[f"request_success_total{{{length}}}"] >= 1
    assert m["generation_tokens_total"] >= answer["usage"]["completion_tokens"] == 9


def test_parallel_samples_count_as_vllm_counts_its_child_requests(server):
    """vLLM v1 runs each of n samples as an engine request of its own (vllm/v1/engine/output_processor.py): each
    finished sample is one request_success with its own finish reason, one observation of the e2e, token-count and
    phase histograms and of time to first token, and its prompt counts in prompt_tokens; request_params_n and
    request_max_num_generation_tokens count the request once. Here the request counted once, with choice 0's
    reason, its samples' tokens summed into one request_generation_tokens observation."""
    before = metrics(server)
    status, _, answer = request(server, "/v1/completions", {"model": MODEL, "prompt": "three samples", "n": 3,
                                                           "max_tokens": 7, "ignore_eos": True})  # fmt: skip
    assert status == 200
    after = wait_idle(server)
    prompt = answer["usage"]["prompt_tokens"]
    assert _delta(before, after, 'request_success_total{finished_reason="length"}') == 3
    for name in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "time_to_first_token_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_params_max_tokens"):
        assert _delta(before, after, name + "_count") == 3, name
    generated, prompts = _delta(before, after, "generation_tokens_total"), _delta(before, after, "prompt_tokens_total")
    assert _delta(before, after, "request_generation_tokens_sum") == 21 == generated
    assert _delta(before, after, "request_prompt_tokens_sum") == 3 * prompt == prompts
    assert _delta(before, after, "request_params_max_tokens_sum") == 21
    assert _delta(before, after, "request_params_n_count") == 1 and _delta(before, after, "request_params_n_sum") == 3
    assert _delta(before, after, "request_max_num_generation_tokens_count") == 1
    assert _delta(before, after, "request_max_num_generation_tokens_sum") == 7


# what vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json and its newer copy under
# examples/observability/) and its metrics design doc (docs/design/metrics.md) query, by type
DASHBOARD = {
    "e2e_request_latency_seconds": "histogram", "time_to_first_token_seconds": "histogram",
    "time_per_output_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
    "num_requests_running": "gauge", "num_requests_waiting": "gauge", "gpu_cache_usage_perc": "gauge",
    "kv_cache_usage_perc": "gauge", "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
}  # fmt: skip


def test_every_series_of_vllms_dashboard_is_there_with_its_type_and_moves(server):
    """Each panel's series exists under vLLM's name with its type and the model_name label the dashboard selects
    on; the phase panels' histograms (queue, prefill, decode, max generation tokens) were missing, and so was
    vllm:time_per_output_token_seconds, the older dashboard's name of the inter-token latency histogram
    (vllm/v1/metrics/loggers.py: deprecated for vllm:inter_token_latency_seconds, the same per-step gaps)."""
    before = metrics(server)
    status, _, _ = request(server, "/v1/completions", {"model": MODEL, "prompt": "dashboard", "max_tokens": 6,
                                                      "ignore_eos": True})  # fmt: skip
    assert status == 200
    after = wait_idle(server)
    status, _, text = request(server, "/metrics")
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE vllm:"))
    label = f'{{model_name="{server.model_name}"}}'
    for name, kind in DASHBOARD.items():
        exposed = "vllm:" + name + ("_total" if kind == "counter" else "")
        assert types.get(exposed) == kind, (name, types.get(exposed))
        if kind == "histogram":
            assert f'vllm:{name}_bucket{{le="+Inf",model_name="{server.model_name}"}}' in after, name
            assert _delta(before, after, f"vllm:{name}_count{label}") >= 1, name
    for phase in ("queue", "prefill", "decode"):
        assert _delta(before, after, f"vllm:request_{phase}_time_seconds_sum{label}") > 0, phase
    assert after[f"vllm:time_per_output_token_seconds_count{label}"] == after["inter_token_latency_seconds_count"]


def test_histogram_buckets_reach_as_far_as_vllms(server):
    """A quantile never reads past a histogram's last finite bound: vLLM's time to first token reaches 2560 s and
    its request latencies 7680 s (vllm/v1/metrics/loggers.py); here both stopped at 80 s, so a P99 over requests
    that queued or ran for minutes read 80 s. Token counts are bucketed 1, 2, 5, ... up to the model's length."""
    m = metrics(server)

    def bounds(name):
        prefix = f'vllm:{name}_bucket{{le="'
        return [float(k[len(prefix) :].split('"')[0]) for k in m if k.startswith(prefix) and '"+Inf"' not in k]

    assert max(bounds("time_to_first_token_seconds")) == 2560.0
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert max(bounds(name)) == 7680.0, name
    max_len = server.llm.engine.config.max_seq_len
    top = max(bounds("request_prompt_tokens"))
    assert top <= max_len < top * 2.5 and bounds("request_generation_tokens") == bounds("request_prompt_tokens")


def test_a_scrape_during_a_long_step_gets_the_last_counters_at_once(server):
    """/metrics read the engine's counters on the engine thread, after the step in flight: a step of seconds (a long
    prefill on a busy CPU took 12.7 s) held every scrape as long, past Prometheus' 10 s timeout. A scrape now waits
    at most a second and gets the counters read last (those of before the step); the next one after it, fresh ones."""
    idle = wait_idle(server)
    restore = slowed_steps(server, 5.0)
    try:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 2}),
                     {"Content-Type": "application/json"})  # fmt: skip
        time.sleep(0.3)  # the request's first (slowed) step is running
        t0 = time.monotonic()
        during = metrics(server)
        waited = time.monotonic() - t0
        assert waited < 2.5, f"/metrics waited {waited:.1f} s for the step"
        assert during["kv_cache_blocks_used"] == idle["kv_cache_blocks_used"] == 0  # the counters of before it
        assert during["num_requests_running"] == 0
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        restore()
    after = wait_idle(server)  # read after the steps: fresh
    assert _delta(idle, after, "engine_steps_total") >= 2
    assert _delta(idle, after, 'request_success_total{finished_reason="length"}') == 1


def test_a_scrape_after_a_timed_out_one_gets_the_counters_that_read_fetched(server):
    """A scrape that timed out left its read of the counters in flight; the next scrape, one step later, found it
    done and started another, dropping what it had read: during a run of long steps every scrape served the
    counters of before the first (0 running while a request ran), not those of one step before."""
    idle = wait_idle(server)
    restore = slowed_steps(server, 2.0)
    try:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 3,
                                                            "ignore_eos": True}),
                     {"Content-Type": "application/json"})  # fmt: skip
        start = time.monotonic()
        time.sleep(0.3)  # the first (slowed) step runs
        assert metrics(server)["num_requests_running"] == idle["num_requests_running"] == 0  # read before the step
        time.sleep(max(0.0, start + 2.6 - time.monotonic()))  # the counters were read after the first step
        t0 = time.monotonic()
        during = metrics(server)
        assert time.monotonic() - t0 < 1.8
        assert during["num_requests_running"] == 1, during["num_requests_running"]
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        restore()
    wait_idle(server)


def test_a_read_that_fails_after_its_scrape_stopped_waiting_is_not_left_unretrieved(tiny_engine_dir, caplog):
    """A scrape that timed out left its read in flight; when the engine loop then stopped, the read failed with
    nobody to take its error, and asyncio logged 'Task exception was never retrieved' with a traceback at ERROR."""
    import asyncio
    import gc

    from trtpaged.server.app import EngineStats

    handle = start_server(tiny_engine_dir, port=0, served_model_name=MODEL, device="cpu")
    conn = http.client.HTTPConnection(handle.host, handle.port, timeout=60)
    try:
        async def scrapes() -> None:
            stats = EngineStats(handle.loop)
            await stats.latest()
            runner = handle.llm.engine.runner

            def fatal_step(batch: object) -> None:  # a step that ends the engine (a tensor-parallel rank died)
                time.sleep(2.0)
                raise FatalEngineError("rank 1 died")

            handle.loop.call(lambda e: setattr(runner, "step", fatal_step))
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "abc", "max_tokens": 4}),
                         {"Content-Type": "application/json"})  # fmt: skip
            await asyncio.sleep(0.3)  # the first (slowed) step runs
            await stats.latest()  # times out: its read waits for the step's end
            await asyncio.sleep(2.5)  # the engine loop stopped: the read was answered ShuttingDown
            assert not handle.loop.alive
            del stats
            gc.collect()

        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(scrapes())
    finally:
        conn.close()
        handle.shutdown(timeout=0)
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_the_oldest_waiting_and_running_requests_ages(small_pool):
    """trtpaged:oldest_{waiting,running}_request_age_seconds: a running request and one waiting for its blocks are
    as old as the client's clock says (between its sending and /metrics first counting it, and the scrape); 0 once
    none is there (a request stuck in the queue or the batch showed in no series: the histograms count finished
    ones)."""
    server = small_pool
    bodies = [{"prompt": [5 + i % 7 for i in range(200)], "n": 6, "max_tokens": 24},
              {"prompt": [6 + i % 11 for i in range(200)], "n": 4, "max_tokens": 8}]  # fmt: skip
    threads: list = []
    restore = slowed_steps(server, 0.2)
    try:
        answers, sent, seen = _send_each_once_the_last_is_in(server, bodies, threads)
        time.sleep(0.5)
        t0 = time.monotonic()
        m = metrics(server)
        t1 = time.monotonic()
    finally:
        restore()
        for thread in threads:
            thread.join(60)
    assert (m["num_requests_running"], m["num_requests_waiting"]) == (1, 1), m
    assert t0 - seen[0] <= m["oldest_running_request_age_seconds"] <= t1 - sent[0]
    assert t0 - seen[1] <= m["oldest_waiting_request_age_seconds"] <= t1 - sent[1]
    assert all(status == 200 for status, _, _ in answers), answers
    idle = wait_idle(server)
    assert idle["oldest_running_request_age_seconds"] == idle["oldest_waiting_request_age_seconds"] == 0


def test_a_request_held_by_a_long_step_ages_in_the_counters_read_before_it(server):
    """A scrape during a long step gets the counters read before it (at once, not after the step); the request's
    age in them (waiting or running, as it was when they were read) has grown by the time since, as the client's
    clock has (a stuck step would otherwise freeze the age that should show it)."""

    def age() -> float:
        m = metrics(server)
        return max(m["oldest_waiting_request_age_seconds"], m["oldest_running_request_age_seconds"])

    wait_idle(server)
    threads: list = []
    restore = slowed_steps(server, 4.0)
    try:
        answers, sent, seen = _send_each_once_the_last_is_in(server, [{"prompt": "abc", "max_tokens": 3}], threads)
        a0 = time.monotonic()
        first = age()
        a1 = time.monotonic()
        time.sleep(1.5)
        b0 = time.monotonic()
        second = age()
        b1 = time.monotonic()
    finally:
        restore()
        for thread in threads:
            thread.join(60)
    assert a0 - seen[0] <= first <= a1 - sent[0] and b0 - seen[0] <= second <= b1 - sent[0], (first, second)
    assert second - first >= b0 - a1, (first, second)
    assert answers[0][0] == 200
    wait_idle(server)
