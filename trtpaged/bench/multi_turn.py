"""Multi-turn traffic for `bench serve --multi-turn`: N conversations of K turns against a running server.

Every conversation starts with the same system prompt; each turn sends the whole
history (system prompt, every earlier user message and reply) plus a new user
message, waits for the streamed reply, then thinks for `think_time_s` before the
next turn (with `stagger`, the conversations start at random moments of one think time and
each think time varies, so they do not arrive in lockstep). With more live histories than
the KV pool holds, a turn finds its
history in the pool only if nothing evicted it meanwhile: the case the KV tiers
(docs/kv_tiers.md) are for. Besides vLLM's latency figures the report has the
prefix-cache side, from the server's /metrics before and after: prompt tokens
looked up and found (in the pool or restored from a tier), and the prompt tokens
that were computed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from trtpaged.bench.serve_bench import _WORDS, RequestResult, _one, _scrape, make_report

MAX_TURNS = 1_000_000  # turns of all conversations together (N x K): bench's MAX_REQUESTS

# /metrics counters whose change over a run the report shows (trtpaged names; absent on other servers)
CACHE_COUNTERS = {
    "prefix_cache_queries": "trtpaged:prefix_cache_queries_total",
    "prefix_cache_hits": "trtpaged:prefix_cache_hits_total",
    "prefix_cache_tier_hits": "trtpaged:prefix_cache_tier_hits_total",
    "tokens_computed": "trtpaged:tokens_computed_total",
}


@dataclass(frozen=True)
class MultiTurnSpec:
    """The conversations' shape (lengths in words: about one token each with BPE tokenizers)."""

    conversations: int = 8
    turns: int = 4
    system_words: int = 64
    user_words: int = 24
    output_tokens: int = 16
    think_time_s: float = 0.5
    # False: every conversation starts at once and thinks exactly think_time_s (they move in lockstep);
    # True: first turns spread uniformly over one think time, each think time uniform in [0.5, 1.5] x think_time_s
    stagger: bool = False

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--multi-turn: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_words", "user_words"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")
        if self.think_time_s < 0:
            raise ValueError(f"--think-time: must be >= 0, got {self.think_time_s}")


def parse_multi_turn(value: str) -> tuple[int, int]:
    """`N:K` (N conversations of K turns); ValueError naming --multi-turn."""
    try:
        n, k = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"--multi-turn: expected N:K (conversations:turns), got {value!r}") from None
    if n < 1 or k < 1:
        raise ValueError(f"--multi-turn: N and K must be >= 1, got {value!r}")
    if n * k > MAX_TURNS:  # 10**12 conversations were accepted: a run that never began sending
        raise ValueError(f"--multi-turn: N x K (turns in all) must be at most {MAX_TURNS}, got {value!r}")
    return n, k


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def conversation_words(spec: MultiTurnSpec, seed: int, variant: int) -> tuple[str, list[list[str]]]:
    """The system prompt (of `seed` alone) and each conversation's user messages (of `seed` and `variant`), in turn
    order: the texts `run_multi_turn` sends, which `kv_tiers_bench.check_turns_fit` measures before a run."""
    system = _words(random.Random(seed), spec.system_words)
    rng = random.Random(f"{seed}/{variant}")
    return system, [[_words(rng, spec.user_words) for _ in range(spec.turns)] for _ in range(spec.conversations)]


def request_body(history: list[dict[str, str]], spec: MultiTurnSpec, model: Optional[str], chat: bool,
          cache_salt: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {"max_tokens": spec.output_tokens, "stream": True, "temperature": 0.0,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    if model:
        body["model"] = model
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if chat:
        body["messages"] = history
    else:  # plain text: the history is a prefix of the next turn's prompt, token for token in most tokenizers
        # a reply is the raw continuation of "Assistant:", so it is appended as it came
        body["prompt"] = "".join(f"Assistant:{m['content']}\n" if m["role"] == "assistant" else
                                 f"{m['role'].capitalize()}: {m['content']}\n" for m in history) + "Assistant:"
    return body


async def run_multi_turn(
    base_url: str, spec: MultiTurnSpec, model: Optional[str] = None, api_key: Optional[str] = None,
    chat: bool = False, max_concurrency: Optional[int] = None, seed: int = 0, timeout_s: float = 600.0,
    progress: Optional[Callable[[str], None]] = None, variant: int = 0, cache_salt: Optional[str] = None,
) -> dict[str, Any]:  # fmt: skip
    """Runs the conversations concurrently; the report of `make_report` plus the multi-turn figures and
    `replies` (each conversation's replies, in order: the greedy outputs to compare between runs).

    The system prompt depends on `seed` only, the user messages on `seed` and `variant`: another
    variant is other conversations under the same system prompt. `cache_salt` (vLLM's field, sent with every
    request) keeps the run's prefix-cache blocks apart from whatever a shared KV tier already holds."""
    import httpx

    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    system, users = conversation_words(spec, seed, variant)
    pauses = _pauses(spec, random.Random(f"{seed}/{variant}/think"))
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or spec.conversations
    results: list[RequestResult] = []
    first_turn: list[RequestResult] = []
    replies: list[list[str]] = [[] for _ in range(spec.conversations)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                                 limits=httpx.Limits(max_connections=connections)) as client:  # fmt: skip

        async def conversation(c: int) -> None:
            history = [{"role": "system", "content": system}] if system else []
            for turn in range(spec.turns):
                if pauses[c][turn]:
                    await asyncio.sleep(pauses[c][turn])
                history.append({"role": "user", "content": users[c][turn]})
                body = request_body(history, spec, model, chat, cache_salt)
                if limit is None:
                    result = await _one(client, url, body, headers)
                else:
                    async with limit:
                        result = await _one(client, url, body, headers)
                results.append(result)
                if turn == 0:
                    first_turn.append(result)
                replies[c].append(result.text)
                history.append({"role": "assistant", "content": result.text})

        before = await _scrape(client, base_url)
        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(spec.conversations)))
        duration = time.perf_counter() - start
        after = await _scrape(client, base_url)
    if progress:
        progress(f"{len(results)} turns in {duration:.1f} s")
    report = make_report(results, duration, float("inf"), max_concurrency, base_url)
    report.update(multi_turn_figures(before, after, report["total_input_tokens"],
                                     report["total_output_tokens"] - report["completed"]))
    ok_first = sorted(r.ttft * 1000.0 for r in first_turn if r.ok)
    report["first_turn_mean_ttft_ms"] = sum(ok_first) / len(ok_first) if ok_first else 0.0
    report.update(conversations=spec.conversations, turns=spec.turns, think_time_s=spec.think_time_s,
                  replies=replies)
    return report


def _pauses(spec: MultiTurnSpec, rng: random.Random) -> list[list[float]]:
    """Seconds each conversation waits before each turn (the first: its start; then the think times)."""
    if not spec.stagger:
        return [[0.0] + [spec.think_time_s] * (spec.turns - 1) for _ in range(spec.conversations)]
    t = spec.think_time_s
    return [[rng.uniform(0.0, t)] + [rng.uniform(0.5 * t, 1.5 * t) for _ in range(spec.turns - 1)]
            for _ in range(spec.conversations)]


def multi_turn_figures(before: dict[str, float], after: dict[str, float], input_tokens: int,
                       decode_tokens: Optional[int] = None) -> dict[str, Any]:  # fmt: skip
    """Prefix-cache deltas between two scrapes: hit rate, tier hits, prompt tokens computed (None: not trtpaged).

    `decode_tokens`: the tokens decode steps computed (each reply's tokens but its last); with it, prompt tokens
    computed are the server's computed tokens less those (a preempted request's recomputation included), else
    the prompt tokens less the hits (which count a re-admitted request's hits again)."""
    if CACHE_COUNTERS["prefix_cache_queries"] not in after:
        return {"prefix_hit_rate": None, "prefix_tier_hit_tokens": None, "prefill_tokens_computed": None}
    delta = {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in CACHE_COUNTERS.items()}
    queries, hits = delta["prefix_cache_queries"], delta["prefix_cache_hits"]
    computed = input_tokens - hits
    if decode_tokens is not None and CACHE_COUNTERS["tokens_computed"] in after:
        computed = delta["tokens_computed"] - decode_tokens
    return {
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "prefix_tier_hit_tokens": int(delta["prefix_cache_tier_hits"]),
        "prefill_tokens_computed": int(computed),
    }


def format_multi_turn(report: dict[str, Any]) -> str:
    """The multi-turn lines printed after the serving report."""
    lines = ["{s:{c}^60}".format(s=" Multi-turn ", c="-")]

    def row(label: str, value: Any) -> None:
        text = "n/a" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        lines.append(f"{label:<44}{text:>16}")

    row("Conversations x turns:", f"{report['conversations']} x {report['turns']}")
    row("Think time (s):", float(report["think_time_s"]))
    row("Prefix hit rate (tokens):", report["prefix_hit_rate"])
    row("Prompt tokens restored from KV tiers:", report["prefix_tier_hit_tokens"])
    row("Prompt tokens computed (prefill):", report["prefill_tokens_computed"])
    row("Mean first-turn TTFT (ms):", report["first_turn_mean_ttft_ms"])
    return "\n".join(lines)
