"""Request bodies from hypothesis against a real server on loopback: valid and hostile values for every field.

Whatever the body, the answer is below 500 (a stream has no error event), the server stays up, a
greedy request running alongside keeps getting the same text, and no KV block is left in use.
Deterministic (derandomize) and bounded: 300 bodies, about half of them run, 10-20 s on 2 cores.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_server import request, wait_idle
from trtpaged.server import ServerOptions, start_server

MAX_WAITING = 6
INT_EDGES = [0, 1, -1, 2, 8, 9, 20, 21, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**18, 10**30]
FLOAT_EDGES = [0.0, -0.0, 1.0, 0.5, 2.0, -2.0, 1e-5, 1e-6, 5e-324, 1e-300, -1e-300, 1e308, -1e308, 100.0, 0.01, 10.0,
               -10.0, 2000.0, 1.7976931348623157e308]


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    options = ServerOptions(max_waiting=MAX_WAITING, max_prompt_tokens=300, request_timeout_s=None)
    handle = start_server(tiny_engine_dir, port=0, served_model_name="tiny", options=options, device="cpu")
    yield handle
    handle.shutdown(timeout=0)


ints = st.one_of(st.integers(-3, 12), st.sampled_from(INT_EDGES))
floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(FLOAT_EDGES))
text = st.one_of(st.text(max_size=12), st.sampled_from(["hi", "\x00", "\ud800", "é世🙂", "\u202e", "x" * 300]))
junk = st.recursive(st.none() | st.booleans() | ints | floats | text,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=6)  # fmt: skip
hostile = st.one_of(ints, floats, text, st.booleans(), st.none(), junk, st.just([1] * 2000),
                    st.just(["s"] * 70), st.just(["x" * 129]), st.just(["hi"] * 300))  # fmt: skip


def between(lo: float, hi: float):
    return st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi]))


token_ids = st.lists(st.integers(0, 319), min_size=1, max_size=20)
prompt = st.one_of(text, token_ids, st.lists(st.one_of(text, token_ids), min_size=1, max_size=MAX_WAITING))
message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)),
})  # fmt: skip
# Valid values of every field (output lengths small, so that the bodies that run finish quickly);
# each body also gets, a third of the time, one field set to a hostile value instead.
COMMON = {
    "temperature": st.one_of(between(0.0, 2.0), st.sampled_from([1e-6, 1e-5, 1e308, 5e-324])),
    "top_p": st.one_of(between(1e-300, 1.0), st.just(5e-324)), "top_k": st.one_of(st.integers(-1, 400), st.just(2**63)),
    "min_p": between(0.0, 1.0), "n": st.integers(1, 3), "seed": st.one_of(ints, st.just(-(2**63))),
    "presence_penalty": between(-2.0, 2.0), "frequency_penalty": between(-2.0, 2.0),
    "repetition_penalty": between(0.01, 100.0), "length_penalty": between(-10.0, 10.0),
    "stop": st.one_of(text.filter(bool), st.lists(st.text(min_size=1, max_size=128), max_size=32)),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, 319), st.sampled_from(INT_EDGES)), max_size=8),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "use_beam_search": st.booleans(), "best_of": st.integers(1, 4), "beam_width": st.integers(1, 4),
    "early_stopping": st.sampled_from([True, False, "never"]), "user": text, "model": st.just("tiny"),
    "max_tokens": st.integers(1, 12),
}
COMPLETION = {**COMMON, "prompt": prompt, "logprobs": st.integers(0, 20), "echo": st.just(False)}
CHAT = {**COMMON, "messages": st.lists(message, min_size=1, max_size=3), "max_completion_tokens": st.integers(1, 12),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)}  # fmt: skip


@st.composite
def bodies(draw) -> tuple[str, object]:
    """(path, body): the endpoint's required field and up to 5 others, mostly valid; now and then not an object."""
    chat = draw(st.booleans())
    path, fields, required = ("/v1/chat/completions", CHAT, "messages") if chat else ("/v1/completions", COMPLETION,
                                                                                     "prompt")  # fmt: skip
    if draw(st.integers(0, 19)) == 0:
        return path, draw(junk)
    body = {required: draw(fields[required]), "max_tokens": draw(fields["max_tokens"])}
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 2)) == 0:
        name = draw(st.sampled_from(sorted(fields) + ["evil"]))
        body[name] = draw(hostile)
    return path, body


def post(server, path: str, body) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type", "")
    finally:
        conn.close()


class Steady:
    """A greedy request sent again and again while the fuzzing runs; every answer must equal the first."""

    BODY = {"prompt": "a steady request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def __init__(self, server) -> None:
        self.server, self.answers, self.stop = server, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            status, _, out = request(self.server, "/v1/completions", self.BODY)
            self.answers.append((status, out["choices"][0]["text"] if status == 200 else out))


@pytest.fixture(scope="module")
def steady(server):
    truth = request(server, "/v1/completions", Steady.BODY)[2]["choices"][0]["text"]
    s = Steady(server)
    s.thread.start()
    yield s, truth
    s.stop.set()
    s.thread.join(60)


@settings(max_examples=300, derandomize=True, database=None, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])  # fmt: skip
@given(case=bodies())
def test_fuzzed_bodies_never_5xx(server, steady, case):
    path, body = case
    status, data, content_type = post(server, path, body)
    assert status < 500, (status, data[:300])
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in data.split(b"\n\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", data[-300:]
        assert all(b'"error"' not in e[:12] for e in events), data[:300]
    else:
        out = json.loads(data)
        assert ("error" in out) == (status != 200), out
        if status != 200:
            assert set(out["error"]) == {"message", "type", "param", "code"}
            assert "Traceback" not in out["error"]["message"]


def test_after_the_fuzzing_the_server_is_healthy_and_leak_free(server, steady):
    s, truth = steady
    deadline = time.monotonic() + 30
    while not s.answers and time.monotonic() < deadline:
        time.sleep(0.05)
    s.stop.set()
    s.thread.join(60)
    assert s.answers and all(a == (200, truth) for a in s.answers), s.answers[:5]
    assert request(server, "/health")[0] == 200
    m = wait_idle(server)
    assert m["kv_cache_blocks_used"] == 0
    assert not any(k.startswith("http_requests_total") and 'status="5' in k for k in m), m
