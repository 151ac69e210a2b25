"""`trtpaged bench serve`: a streaming load client for any OpenAI-compatible server.

Sends a workload (a `bench memory` JSON Lines trace, a ShareGPT dataset, or a synthetic mix) to
`--base-url` at a Poisson request rate (`inf`: all at once) under a concurrency cap,
streams every answer, and reports what vLLM's `bench serve` reports, under the same
names: request and token throughput, TTFT, TPOT, ITL and E2E latency (mean, median =
p50, p90, p99, in ms) and the failed requests. Where the server is trtpaged, its `/metrics`
read before and after the run add the engine's side: the mean engine step and the server's
own TPOT (measured on the engine thread), next to the client's TPOT.

Prompts are text made of common words (about one token per word with BPE tokenizers),
identical across requests for a shared prefix_id; token counts come from the server's
`usage` (stream_options.include_usage), so they are exact. A trace's `arrival` (a step
number for `bench memory`) is ignored: arrivals come from the request rate. A Mooncake trace's
requests are sent at their timestamps instead (`arrivals`), its prompts words in 512-word blocks,
one block per hash id (trtpaged.bench.token_blocks: the same words wherever an id appears, so
prompts share exactly their leading blocks with equal ids); an Azure or BurstGPT trace's (trtpaged.bench.csv_trace)
at theirs too, their prompts random words of each request's length. A trace's `n` is sent as
`n`, its `beam_width` as `beam_width` (trtpaged's and TensorRT-LLM's field). The prompts
depend on `seed` only: a second run with the same seed sends the same prompts, which a
server with prefix caching then finds cached (use another seed for a cold run). A ShareGPT dataset's prompts are its
conversations' own texts, chosen by vLLM's rule (trtpaged.bench.sharegpt) with token counts from the server's
POST /tokenize (`sharegpt_requests`).

Timing, per request (`stream_timings`), as vLLM's client times it where the two agree: TTFT is the
time to the first chunk that carries generated output (text, a finish reason, token ids: a chat
stream's role-only first chunk does not count); a request whose stream carried none failed.
ITL are the gaps between consecutive chunks of one choice; TPOT is per sequence: a choice's time
from its first chunk to its last over its tokens after the first (tokens per choice from
`stream_options.continuous_usage_stats`, asked for with n > 1, else usage / n), the mean over the
request's choices. A choice that arrived in one chunk (all of its text held back until its end, or
a stream interval as long as the answer) has no TPOT or ITL. A beam search arrives whole at its
end: it counts in the throughput and the E2E latency only. One warm-up request (fresh words, not
counted) goes first, as vLLM's benchmark sends one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from trtpaged.bench.server_metrics import parse_prometheus
from trtpaged.bench.sharegpt import ShareGPTRule, ShareGPTSample, sample_sharegpt
from trtpaged.bench.timed_trace import TimedTrace, read_timed_trace
from trtpaged.bench.token_blocks import block_prompt
from trtpaged.bench.trtllm_dataset import TrtllmDataset, read_trtllm_dataset
from trtpaged.bench.workload import TraceRequest

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do how their if will up "
          "other about out many then them these so some her would make like him into time has look two more write "
          "go see number no way could people my than first water been call who oil its now find long down day did "
          "get come made may part").split()  # fmt: skip
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class ServeRequest:
    """One request of the workload: a prompt (text, or token ids sent as they are), how many tokens to generate,
    parallel samples."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    n: int = 1
    beam_width: int = 1  # > 1: a beam search of that width (one sequence returned)


@dataclass
class RequestResult:
    """What one request measured (times in seconds from its start)."""

    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks of one choice, every choice's
    prompt_tokens: int = 0
    output_tokens: int = 0  # all choices' together
    text: str = ""  # the first choice's generated text
    tpot: Optional[float] = None  # per sequence, the mean over the choices; None: no choice streamed two chunks
    streamed: bool = True  # False: a beam search, sent whole at its end (no TTFT, TPOT or ITL)


def prompts_from_trace(trace: Sequence[TraceRequest], seed: int = 0) -> list[ServeRequest]:
    """Text prompts of about `prompt_len` words; requests with the same prefix_id share the first prefix_len, those
    with `hash_ids` their ids' blocks of words (drawn with `seed`)."""
    rng = random.Random(seed)
    prefixes: dict[int, list[str]] = {}
    blocks: dict[int, list[str]] = {}
    out = []
    for r in trace:
        if r.hash_ids is not None:
            text = " ".join(block_prompt(r.hash_ids, r.prompt_len, _WORDS, seed, blocks))
            out.append(ServeRequest(text, r.output_len, r.n, r.beam_width))
            continue
        words: list[str] = []
        if r.prefix_id is not None and r.prefix_len:
            words = list(prefixes.setdefault(r.prefix_id, [rng.choice(_WORDS) for _ in range(r.prefix_len)]))
        words += [rng.choice(_WORDS) for _ in range(r.prompt_len - len(words))]
        out.append(ServeRequest(" ".join(words), r.output_len, r.n, r.beam_width))
    return out


def timed_requests(path: str, seed: int = 0) -> tuple[list[ServeRequest], TimedTrace]:
    """A timed trace's requests (Mooncake, Azure, BurstGPT) in timestamp order (`prompts_from_trace`), and the
    trace: its `seconds()` are their send times."""
    trace = read_timed_trace(path)
    return prompts_from_trace(trace.trace(), seed), trace


def trtllm_requests(path: str) -> tuple[list[ServeRequest], TrtllmDataset]:
    """A trtllm-bench dataset's requests (trtpaged.bench.trtllm_dataset) in file order: text prompts sent as text,
    input_ids as token ids (the completions endpoint takes either; the server checks them against its vocabulary)."""
    dataset = read_trtllm_dataset(path)
    return [ServeRequest(line.prompt if line.input_ids is None else line.input_ids, line.output_len)
            for line in dataset.lines], dataset  # fmt: skip


def sharegpt_requests(path: str, base_url: str, num_requests: int, seed: int = 0, output_len: Optional[int] = None,
                      api_key: Optional[str] = None, model: Optional[str] = None,
                      timeout_s: float = 60.0) -> tuple[list[ServeRequest], ShareGPTSample]:  # fmt: skip
    """A ShareGPT dataset's requests (trtpaged.bench.sharegpt: vLLM's rule), their texts sent as they are, counted
    by the server's own tokenizer through POST /tokenize; a pair longer than the server's max_model_len (which
    /tokenize also answers) is skipped. ValueError when the server has no /tokenize (`server_token_counter`)."""
    with server_token_counter(base_url, api_key, model, timeout_s) as (count, max_model_len):
        sample = sample_sharegpt(path, count, num_requests, seed, ShareGPTRule(output_len=output_len,
                                                                              model_len=max_model_len))  # fmt: skip
    return [ServeRequest(r.prompt, r.output_len) for r in sample.requests], sample


@contextlib.contextmanager
def server_token_counter(base_url: str, api_key: Optional[str] = None, model: Optional[str] = None,
                         timeout_s: float = 60.0) -> Iterator[tuple[Callable[[str], int], Optional[int]]]:  # fmt: skip
    """(count, max_model_len): a text's token count from the server's POST /tokenize ({"prompt": text} ->
    {"count": N}, vLLM's and trtpaged's route, special tokens added as for a completions prompt), and the model
    length it answers (None where it gives none). A server without the route is refused at once, naming --trace:
    a ShareGPT request's lengths are token counts, which no client-side guess gives exactly."""
    import httpx

    url = base_url.rstrip("/") + "/tokenize"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=httpx.Timeout(timeout_s)) as client:

        def tokenize(text: str) -> dict[str, Any]:
            return _tokenize(client, url, headers, {"prompt": text, **({"model": model} if model else {})})

        first = tokenize("Hello")
        max_model_len = first.get("max_model_len")
        valid = isinstance(max_model_len, int) and not isinstance(max_model_len, bool) and max_model_len > 0
        yield (lambda text: tokenize(text)["count"]), (max_model_len if valid else None)


def _tokenize(client: Any, url: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    """One POST /tokenize answer, checked: a dict with an integer "count" >= 0; ValueError saying what went wrong."""
    import httpx

    try:
        resp = client.post(url, json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url: POST {url} failed ({type(exc).__name__}: {exc})") from None
    snippet = " ".join(resp.text[:200].split())
    if resp.status_code in (404, 405, 501):  # no such route, or no POST on it
        raise ValueError(f"--trace: a ShareGPT dataset's requests are chosen by their token counts, which bench serve "
                         f"asks the server's POST /tokenize for (vLLM's and trtpaged's); {url} answered HTTP "
                         f"{resp.status_code}: give a server with it, or a JSON Lines trace")  # fmt: skip
    if resp.status_code in (401, 403):
        raise ValueError(f"--api-key: POST {url} answered HTTP {resp.status_code}: {snippet}")
    if resp.status_code != 200:
        raise ValueError(f"POST /tokenize answered HTTP {resp.status_code}: {snippet}")
    try:
        data = resp.json()
    except ValueError:
        data = None
    count = data.get("count") if isinstance(data, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"POST {url}: the answer has no integer \"count\" >= 0: {snippet}")
    return data


def warmup_request(first: ServeRequest, seed: int = 0) -> ServeRequest:
    """The uncounted request sent before the run: the first request's prompt length in other words (so it leaves
    nothing in the prefix cache that the run's prompts share), at most 16 tokens, one greedy sequence."""
    rng = random.Random(f"{seed}/warmup")
    words = len(first.prompt.split()) if isinstance(first.prompt, str) else len(first.prompt)  # a word per token id
    return ServeRequest(" ".join(rng.choice(_WORDS) for _ in range(words)), min(first.max_tokens, 16))


def _body(req: ServeRequest, model: Optional[str], chat: bool, ignore_eos: bool) -> dict[str, Any]:
    # continuous_usage_stats: each chunk says its choice's tokens so far (TPOT counts the tokens a chunk held)
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                            "temperature": 0.0 if req.n == 1 else 1.0}  # fmt: skip
    if req.n > 1:
        body["n"] = req.n
    if req.beam_width > 1:
        body["beam_width"] = req.beam_width
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    return body


def _carries_output(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries generated output: text, a finish reason, token ids or log-probs, or a chat
    delta with more than its role (vLLM's client counts any chunk with choices; trtpaged's chat stream sends a
    role-only chunk before the first token, which would time TTFT at nothing)."""
    if choice.get("text") or choice.get("finish_reason") or choice.get("token_ids") or choice.get("logprobs"):
        return True
    return any(value for key, value in (choice.get("delta") or {}).items() if key != "role")


def _choice_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


@dataclass
class _ChoiceTimes:
    first: float
    last: float
    chunks: int = 1
    gaps: list[float] = field(default_factory=list)
    first_tokens: Optional[int] = None  # continuous usage stats: this choice's tokens at its first chunk
    tokens: Optional[int] = None  # and at its last


def stream_timings(result: RequestResult, start: float, events: Sequence[tuple[float, dict[str, Any]]], end: float,
                   n: int = 1, beam: bool = False) -> RequestResult:  # fmt: skip
    """Fills `result`'s timings and token counts from the stream's parsed chunks, each with the time it arrived
    (`events`, in order; `start` the request's send time, `end` when its stream ended; see the module's doc)."""
    choices: dict[int, _ChoiceTimes] = {}
    for now, chunk in events:
        usage = chunk.get("usage")
        if usage and (n == 1 or not chunk.get("choices")):  # with n > 1, only the usage chunk has the totals
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            result.output_tokens = usage.get("completion_tokens", 0)
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            if index == 0:
                result.text += _choice_text(choice)
            if not _carries_output(choice):
                continue
            times = choices.get(index)
            if times is None:
                times = choices[index] = _ChoiceTimes(now, now)
            else:
                times.gaps.append(now - times.last)
                times.last, times.chunks = now, times.chunks + 1
            if usage and usage.get("completion_tokens") is not None:  # continuous usage stats
                times.tokens = usage["completion_tokens"]  # this choice's own tokens so far
                if times.chunks == 1:
                    times.first_tokens = times.tokens
    result.e2e = end - start
    if not choices:
        result.ok = False
        result.error = "no output chunk: the stream carried no generated token (a failed request, as in vLLM)"
        return result
    if not result.output_tokens:
        result.output_tokens = sum(c.chunks for c in choices.values())  # no usage: one chunk is about one token
    result.ttft = min(c.first for c in choices.values()) - start
    result.streamed = not beam
    if beam:
        return result
    result.itl = [gap for i in sorted(choices) for gap in choices[i].gaps]
    per_choice = result.output_tokens / max(n, 1)
    tpots = []
    for c in choices.values():
        if c.chunks < 2:
            continue
        if c.first_tokens is not None and c.tokens is not None:  # the tokens that came after the first chunk
            after = c.tokens - c.first_tokens
        else:  # no per-chunk usage: vLLM's count, as if the first chunk held one token
            after = per_choice - 1
        if after > 0:
            tpots.append((c.last - c.first) / after)
    result.tpot = sum(tpots) / len(tpots) if tpots else None
    return result


async def _one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    result = RequestResult()
    events: list[tuple[float, dict[str, Any]]] = []
    start = time.perf_counter()
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
                events.append((time.perf_counter(), chunk))
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not the end of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    end = time.perf_counter()
    if not result.ok:
        result.error = "stream ended without [DONE]"
        result.e2e = end - start
        return result
    return stream_timings(result, start, events, end, body.get("n", 1), body.get("beam_width", 1) > 1)


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
    warmup: bool = True,
    arrivals: Optional[Sequence[float]] = None,
) -> dict[str, Any]:
    """Sends `requests` (Poisson arrivals at `request_rate` req/s, at most `max_concurrency` in flight) and
    returns the report as a dict (see `format_report`). With `warmup`, one request of the first one's shape
    (`warmup_request`) goes first and is not counted, nor is it in the server-side figures. `arrivals`: each
    request's send time instead, seconds from the run's start, in order (a trace's timestamps; the rate is then
    unused and the report's request_rate says "trace")."""
    if arrivals is not None and len(arrivals) != len(requests):
        raise ValueError(f"arrivals: {len(arrivals)} send times for {len(requests)} requests")
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

        if warmup and requests:
            if progress:
                progress("warm-up request (not counted)")
            # its failure is not the run's: the run's own requests report what the server answers
            await _one(client, url, _body(warmup_request(requests[0], seed), model, chat, ignore_eos), headers)
        before = await _scrape(client, base_url)
        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if arrivals is not None:
                wait = start + arrivals[i] - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(run(req)))
            if arrivals is None and math.isfinite(request_rate) and i + 1 < len(requests):
                await asyncio.sleep(rng.expovariate(request_rate))
        if progress:
            progress(f"sent {len(tasks)} requests; waiting for the answers")
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        server = engine_side(before, await _scrape(client, base_url))
    report = make_report(results, duration, request_rate, max_concurrency, base_url)
    if arrivals is not None:
        report["request_rate"] = "trace"  # each request sent at its timestamp
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
    streamed = [r for r in ok if r.streamed]
    tpots = [r.tpot for r in streamed if r.tpot is not None]
    report["beam_search_requests"] = len(ok) - len(streamed)  # in the throughput and E2E only
    report["tpot_requests"] = len(tpots)  # the streamed requests with a choice in two chunks or more
    _stats("ttft", [r.ttft for r in streamed], report)
    _stats("tpot", tpots, report)
    _stats("itl", [gap for r in streamed for gap in r.itl], report)
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
    streamed = report["completed"] - report.get("beam_search_requests", 0)
    if report.get("beam_search_requests"):
        row("Beam-search requests (E2E only):", report["beam_search_requests"])
    if streamed and report.get("tpot_requests", streamed) < streamed:
        row("Requests timed for TPOT:", report["tpot_requests"])
    timed = report.get("tpot_requests", streamed)  # a choice in two chunks or more: its gaps are the ITL
    counted = {"ttft": streamed, "tpot": timed, "itl": timed, "e2el": report["completed"]}
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):  # fmt: skip
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        measured = counted[key] > 0  # with none, the figures' zeros are no measurement
        row(f"Mean {key.upper()} (ms):", report[f"mean_{key}_ms"] if measured else "n/a")
        for p in PERCENTILES:
            row(f"P{p} {key.upper()} (ms):", report[f"p{p}_{key}_ms"] if measured else "n/a")
    lines.append("{s:{c}^60}".format(s=" Server side (trtpaged /metrics) ", c="-"))
    for key, label in (("engine_step_ms", "Mean engine step (ms):"), ("handoff_wait_ms", "Mean hand-over wait (ms):"),
                       ("server_tpot_ms", "Mean server-side TPOT (ms):")):  # fmt: skip
        value = report.get(key)
        row(label, "n/a" if value is None else float(value))
    row("Mean client-side TPOT (ms):", report["mean_tpot_ms"] if counted["tpot"] else "n/a")
    for example in report["error_examples"]:
        lines.append(f"error: {example}")
    lines.append("=" * 60)
    return "\n".join(lines)


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
