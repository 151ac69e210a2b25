"""A bare streaming reader for `bench serve-ratio`: what `serve` costs with a client that spends almost no CPU.

The official `openai` client spends a few hundred microseconds of CPU per streamed chunk (its model
construction per chunk and httpx's reading), which on a small machine shares the cores the kernels run on.
This reader only waits for `data: [DONE]` while the stream runs (a byte search per socket read); the
chunked body is decoded with h11 and the SSE events with `json` after the stream ended, so the texts can
still be compared with the Python API's.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlparse

import h11

DONE = b"data: [DONE]"


async def _raw_stream(host: str, port: int, path: str, body: dict[str, Any]) -> bytes:
    """The raw HTTP response (status line, headers, chunked body) of one streamed request, read until `[DONE]`."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head.encode() + payload)
        parts: list[bytes] = []
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                break
            parts.append(data)
            tail = (tail + data)[-(len(DONE) + 16):]  # [DONE] may straddle two reads
            if DONE in tail:
                break
        return b"".join(parts)
    finally:
        writer.close()


def sse_payloads(raw: bytes) -> list[Any]:
    """The JSON payloads of the `data:` events of one raw HTTP response (up to `[DONE]`); raises ValueError
    on a status other than 200."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw)
    body = bytearray()
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response) and event.status_code != 200:
            raise ValueError(f"the server answered {event.status_code}")
        if isinstance(event, h11.Data):
            body += event.data
        if event is h11.NEED_DATA or isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    payloads = []
    for event in bytes(body).split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[len(b"data: "):]
        if data == b"[DONE]":
            break
        payloads.append(json.loads(data))
    return payloads


def chat_text(payloads: list[Any]) -> tuple[str, int]:
    """(the joined content of a chat stream's chunks, completion tokens from its usage chunk, 0 without one)."""
    text, tokens = "", 0
    for p in payloads:
        for choice in p.get("choices") or ():
            text += choice.get("delta", {}).get("content") or ""
        if p.get("usage"):
            tokens = p["usage"]["completion_tokens"]
    return text, tokens


async def _batch(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[str], float]:
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    start, cpu = time.perf_counter(), time.thread_time()
    raws = await asyncio.gather(*(_raw_stream(host, port, "/v1/chat/completions", b) for b in bodies))
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    results = [chat_text(sse_payloads(raw)) for raw in raws]  # after the clock: not part of the run
    tokens = sum(t for _, t in results)
    return tokens / wall, [text for text, _ in results], cpu


def bare_batch_rate(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[str], float]:
    """(output tok/s over the wall time, texts, the reader's CPU seconds while the streams ran) of the chat
    request `bodies` streamed concurrently (each with `stream_options.include_usage`)."""
    return asyncio.run(_batch(url, bodies))
