"""`trtpaged bench serve`: a streaming load client for any OpenAI-compatible server.

Sends a workload (a `bench memory` JSON Lines trace, or a synthetic mix) to
`--base-url` at a Poisson request rate (`inf`: all at once) under a concurrency cap,
streams every answer, and reports what vLLM's `bench serve` reports, under the same
names: request and token throughput, TTFT, TPOT, ITL and E2E latency (mean, median =
p50, p90, p99, in ms) and the failed requests. Where the server is trtpaged, its `/metrics`
read before and after the run add the engine's side: the mean engine step and the server's
own TPOT (measured on the engine thread), next to the client's TPOT.

Prompts are text made of common words (about one token per word with BPE tokenizers),
identical across requests for a shared prefix_id; token counts come from the server's
`usage` (stream_options.include_usage), so they are exact. A trace's `arrival` (a step
number for `bench memory`) is ignored: arrivals come from the request rate.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from trtpaged.bench.server_metrics import parse_prometheus
from trtpaged.bench.workload import TraceRequest

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do how their if will up "
          "other about out many then them these so some her would make like him into time has look two more write "
          "go see number no way could people my than first water been call who oil its now find long down day did "
          "get come made may part").split()  # fmt: skip
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class ServeRequest:
    """One request of the workload: a text prompt, how many tokens to generate, parallel samples."""

    prompt: str
    max_tokens: int
    n: int = 1


@dataclass
class RequestResult:
    """What one request measured (times in seconds from its start)."""

    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""  # the first choice's generated text


def prompts_from_trace(trace: Sequence[TraceRequest], seed: int = 0) -> list[ServeRequest]:
    """Text prompts of about `prompt_len` words; requests with the same prefix_id share the first prefix_len."""
    rng = random.Random(seed)
    prefixes: dict[int, list[str]] = {}
    out = []
    for r in trace:
        words: list[str] = []
        if r.prefix_id is not None and r.prefix_len:
            words = list(prefixes.setdefault(r.prefix_id, [rng.choice(_WORDS) for _ in range(r.prefix_len)]))
        words += [rng.choice(_WORDS) for _ in range(r.prompt_len - len(words))]
        out.append(ServeRequest(" ".join(words), r.output_len, r.n))
    return out


def _body(req: ServeRequest, model: Optional[str], chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": 0.0 if req.n == 1 else 1.0}  # fmt: skip
    if req.n > 1:
        body["n"] = req.n
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _first_choice_text(chunk: dict[str, Any]) -> str:
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) == 0:
            return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return ""


async def _one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last: Optional[float] = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                result.text += _first_choice_text(chunk)
                if _has_text(chunk):
                    now = time.perf_counter()
                    chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not the end of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    if not result.ok:
        result.error = "stream ended without [DONE]"
    elif not result.output_tokens:
        result.output_tokens = chunks  # the server sent no usage: one chunk is about one token
    return result


async def _scrape(client: Any, base_url: str) -> dict[str, float]:
    """The server's Prometheus metrics, or {} where it has none."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics")
        return parse_prometheus(resp.text) if resp.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - not every OpenAI-compatible server has /metrics
        return {}


def engine_side(before: dict[str, float], after: dict[str, float]) -> dict[str, Optional[float]]:
    """Mean engine step and server-side TPOT (ms) between two scrapes of a trtpaged server; None if unknown."""

    def delta(name: str) -> float:
        return after.get(f"trtpaged:{name}", 0.0) - before.get(f"trtpaged:{name}", 0.0)

    steps, tpots = delta("engine_steps_total"), delta("request_time_per_output_token_seconds_count")
    return {
        "engine_step_ms": 1000.0 * delta("engine_step_seconds_total") / steps
        if steps and "trtpaged:engine_step_seconds_total" in after else None,
        "server_tpot_ms": 1000.0 * delta("request_time_per_output_token_seconds_sum") / tpots if tpots else None,
        "handoff_wait_ms": 1000.0 * delta("engine_handoff_wait_seconds_total") / steps
        if steps and "trtpaged:engine_handoff_wait_seconds_total" in after else None,
    }


def _stats(name: str, values: Sequence[float], out: dict[str, Any]) -> None:
    """mean/median/pXX of `values` (seconds) into `out` as `<stat>_<name>_ms`, vLLM's spelling."""
    ms = sorted(v * 1000.0 for v in values)
    out[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else 0.0
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = _percentile(ms, p)
    out[f"median_{name}_ms"] = out[f"p50_{name}_ms"]


def _percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return 0.0
    k = (len(sorted_values) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


async def run_serve_bench(
    base_url: str,
    requests: Sequence[ServeRequest],
    request_rate: float = math.inf,
    max_concurrency: Optional[int] = None,
    model: Optional[str] = None,
    api_key: Optional[str] = None,
    chat: bool = False,
    ignore_eos: bool = True,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """Sends `requests` (Poisson arrivals at `request_rate` req/s, at most `max_concurrency` in flight) and
    returns the report as a dict (see `format_report`)."""
    import httpx

    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def run(req: ServeRequest) -> RequestResult:
            body = _body(req, model, chat, ignore_eos)
            if limit is None:
                return await _one(client, url, body, headers)
            async with limit:
                return await _one(client, url, body, headers)

        before = await _scrape(client, base_url)
        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(run(req)))
            if math.isfinite(request_rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(request_rate))
        if progress:
            progress(f"sent {len(tasks)} requests; waiting for the answers")
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        server = engine_side(before, await _scrape(client, base_url))
    report = make_report(results, duration, request_rate, max_concurrency, base_url)
    report.update(server)
    return report


def make_report(results: Sequence[RequestResult], duration: float, request_rate: float,
                max_concurrency: Optional[int], base_url: str) -> dict[str, Any]:  # fmt: skip
    """vLLM `bench serve` figures from the per-request results."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error.split(":")[0] for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    report: dict[str, Any] = {
        "base_url": base_url,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors),
        "error_examples": sorted({r.error for r in results if not r.ok})[:5],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    _stats("ttft", [r.ttft for r in ok], report)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    _stats("tpot", tpots, report)
    _stats("itl", [gap for r in ok for gap in r.itl], report)
    _stats("e2el", [r.e2e for r in ok], report)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as vLLM prints it."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", report["completed"])
    row("Failed requests:", report["failed"])
    row("Request rate configured (RPS):", report["request_rate"])
    row("Maximum request concurrency:", report["max_concurrency"])
    row("Benchmark duration (s):", report["duration"])
    row("Total input tokens:", report["total_input_tokens"])
    row("Total generated tokens:", report["total_output_tokens"])
    row("Request throughput (req/s):", report["request_throughput"])
    row("Output token throughput (tok/s):", report["output_throughput"])
    row("Total token throughput (tok/s):", report["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):  # fmt: skip
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        measured = report["completed"] > 0  # with none, the figures' zeros are no measurement
        row(f"Mean {key.upper()} (ms):", report[f"mean_{key}_ms"] if measured else "n/a")
        for p in PERCENTILES:
            row(f"P{p} {key.upper()} (ms):", report[f"p{p}_{key}_ms"] if measured else "n/a")
    lines.append("{s:{c}^60}".format(s=" Server side (trtpaged /metrics) ", c="-"))
    for key, label in (("engine_step_ms", "Mean engine step (ms):"), ("handoff_wait_ms", "Mean hand-over wait (ms):"),
                       ("server_tpot_ms", "Mean server-side TPOT (ms):")):  # fmt: skip
        value = report.get(key)
        row(label, "n/a" if value is None else float(value))
    row("Mean client-side TPOT (ms):", report["mean_tpot_ms"] if report["completed"] else "n/a")
    for example in report["error_examples"]:
        lines.append(f"error: {example}")
    lines.append("=" * 60)
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
