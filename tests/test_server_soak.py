"""Soak and shutdown: 32 concurrent streaming clients (a third hang up mid-stream); draining on shutdown."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest

from tests.test_server import metrics, request, wait_idle
from trtpaged.server import ServerOptions, start_server

from runtime_helpers import slowed_steps

CLIENTS = 32


@dataclass
class StreamResult:
    status: int = 0
    events: list = field(default_factory=list)
    hung_up: bool = False
    error: str = ""


def stream_client(server, body: dict, hang_up_after: int | None, out: StreamResult) -> None:
    """Streams one completion; with `hang_up_after`, closes the connection after that many events."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            return
        while True:
            line = resp.fp.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                out.events.append(data if data == "[DONE]" else json.loads(data))
                if data == "[DONE]":
                    return
                if hang_up_after is not None and len(out.events) >= hang_up_after:
                    out.hung_up = True
                    conn.sock.close()
                    return
    except Exception as exc:  # noqa: BLE001 - recorded and asserted on
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, device="cpu")
    yield handle
    handle.shutdown(timeout=0)


def test_soak_32_streams_a_third_hang_up(server):
    restore = slowed_steps(server, 0.002)
    try:
        results = [StreamResult() for _ in range(CLIENTS)]
        threads = []
        for i in range(CLIENTS):
            hang_up = 3 if i % 3 == 0 else None
            body = {"prompt": f"client {i} says hello", "max_tokens": 200 if hang_up else 16 + i, "ignore_eos": True,
                    "temperature": 0.7, "seed": i}  # fmt: skip
            threads.append(threading.Thread(target=stream_client, args=(server, body, hang_up, results[i])))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    finally:
        restore()
    m = wait_idle(server, timeout=30)
    assert all(r.status == 200 and not r.error for r in results), [(r.status, r.error) for r in results]
    finished = [r for r in results if not r.hung_up]
    assert len(finished) == CLIENTS - len(range(0, CLIENTS, 3))
    assert all(r.events[-1] == "[DONE]" for r in finished)
    for i, r in enumerate(results):
        if not r.hung_up:
            assert sum(1 for e in r.events[:-1] if e["choices"][0]["finish_reason"] == "length") == 1, i
    assert m["kv_cache_blocks_used"] == 0 and m["num_requests_running"] == 0
    assert not any(k.startswith("http_requests_total") and 'status="5' in k for k in m)
    assert m['request_success_total{finished_reason="abort"}'] == CLIENTS - len(finished)


def test_shutdown_drains_in_flight_then_aborts_the_rest(tiny_engine_dir):
    handle = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(shutdown_timeout_s=30))
    slowed_steps(handle, 0.01)  # the server is thrown away afterwards
    short, long = StreamResult(), StreamResult()
    try:
        threads = [threading.Thread(target=stream_client, args=(handle, body, None, out)) for body, out in (
            ({"prompt": "short", "max_tokens": 40, "ignore_eos": True}, short),
            ({"prompt": "long", "max_tokens": 400, "ignore_eos": True}, long))]  # fmt: skip
        for t in threads:
            t.start()
        while metrics(handle)["num_requests_running"] < 2:
            time.sleep(0.02)
        stopper = threading.Thread(target=handle.shutdown, kwargs={"timeout": 1.5})
        stopper.start()
        assert handle.draining.event.wait(10)  # the drain has begun (a 0.2 s sleep assumed the thread ran by then)
        status, headers, out = request(handle, "/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert status == 503 and headers["Retry-After"] and out["error"]["code"] == "overloaded"
        # not Anthropic's 529 (a busy server's): a draining one is unavailable, what a proxy in front reads
        status, headers, out = request(handle, "/v1/messages", {"model": handle.model_name, "max_tokens": 2,
                                                                "messages": [{"role": "user", "content": "late"}]})
        assert status == 503 and headers["Retry-After"] and out["error"]["type"] == "overloaded_error", out
        assert request(handle, "/health")[0] == 503
        for t in (*threads, stopper):
            t.join(30)
    finally:
        handle.shutdown(timeout=0)
    assert short.events[-1] == "[DONE]" and short.events[-2]["choices"][0]["finish_reason"] == "length"
    assert long.events[-1] == "[DONE]" and long.events[-2]["error"]["code"] == "overloaded"  # aborted at the deadline
    stats = handle.llm.stats()  # the engine thread has stopped: safe to read directly
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0


def test_a_cut_drain_aborts_what_is_in_flight_at_once(tiny_engine_dir):
    """What a second Ctrl-C does (`cut_drain`): a shutdown waiting up to 60 s for a 400-token stream stops at once,
    the stream ends with an error event, and its blocks return (was: the second signal waited the whole drain)."""
    handle = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(shutdown_timeout_s=60))
    slowed_steps(handle, 0.01)  # 400 tokens take >= 4 s
    result = StreamResult()
    try:
        client = threading.Thread(target=stream_client, args=(handle, {"prompt": "long", "max_tokens": 400,
                                                                       "ignore_eos": True}, None, result))  # fmt: skip
        client.start()
        while metrics(handle)["num_requests_running"] < 1:
            time.sleep(0.02)
        stopper = threading.Thread(target=handle.shutdown)
        stopper.start()
        time.sleep(0.3)
        assert stopper.is_alive()  # draining
        start = time.monotonic()
        handle.cut_drain()
        stopper.join(30)
        client.join(30)
        assert not stopper.is_alive() and time.monotonic() - start < 15
    finally:
        handle.shutdown(timeout=0)
    assert result.events[-1] == "[DONE]" and result.events[-2]["error"]["code"] == "overloaded"
    stats = handle.llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0


def test_request_timeout_aborts_and_frees(tiny_engine_dir, caplog):
    handle = start_server(tiny_engine_dir, port=0, device="cpu", options=ServerOptions(request_timeout_s=0.5))
    try:
        restore = slowed_steps(handle, 0.01)  # 400 tokens take >= 4 s
        body = {"prompt": "forever", "max_tokens": 400, "ignore_eos": True}
        status, _, out = request(handle, "/v1/completions", body)
        assert status == 504 and out["error"]["type"] == "timeout_error"
        result = StreamResult()
        stream_client(handle, body, None, result)
        assert result.events[-1] == "[DONE]" and result.events[-2]["error"]["type"] == "timeout_error"
        m = wait_idle(handle)
        assert m['request_success_total{finished_reason="abort"}'] == 2 and m["kv_cache_blocks_used"] == 0
        # a stream that times out before its first output logs its prompt's tokens (was prompt=0)
        restore()
        slowed_steps(handle, 1.0)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trtpaged.server"):
            stream_client(handle, body, None, StreamResult())
            wait_idle(handle)
        prompt = len(handle.llm.tokenizer("forever")["input_ids"])
        assert any(f"prompt={prompt} completion=0 finish=RequestTimeout" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        handle.shutdown(timeout=0)


def test_a_body_still_arriving_when_shutdown_begins_is_answered_at_once(tiny_engine_dir):
    """Clients that have sent a head and part of a body when shutdown begins (a slow upload): one read as JSON is
    answered 503, one refused before it was read (over --max-body-bytes: 413; not JSON: 415) gets its refusal, at
    once, and the shutdown takes no longer than its drain (was: the HTTP server waited its graceful timeout, 5 s, for
    the bodies, then cancelled the requests with a traceback each and answered 500)."""
    handle = start_server(tiny_engine_dir, port=0, device="cpu",
                          options=ServerOptions(shutdown_timeout_s=0.5, max_body_bytes=1000))  # fmt: skip
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n{{"
    cases = {(503, "the server is shutting down"): head.format("application/json", 100),
             (413, "body: 5000 bytes exceeds the limit (1000)"): head.format("application/json", 5000),
             (415, "content-type: 'text/plain' is not JSON; send the body as application/json"):
             head.format("text/plain", 100)}  # fmt: skip
    socks = {case: socket.create_connection((handle.host, handle.port), timeout=30) for case in cases}
    answers = {}
    try:
        for case, sock in socks.items():
            sock.sendall(cases[case].encode())
        time.sleep(0.3)  # the server reads the heads and waits for the rest of the bodies
        start = time.monotonic()
        handle.shutdown()
        elapsed = time.monotonic() - start
        for case, sock in socks.items():
            answers[case] = b""
            while chunk := sock.recv(65536):
                answers[case] += chunk
    finally:
        for sock in socks.values():
            sock.close()
        handle.shutdown(timeout=0)
    for (status, message), answer in answers.items():
        assert answer.startswith(b"HTTP/1.1 %d" % status), answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["message"] == message
    assert elapsed < 3, elapsed
