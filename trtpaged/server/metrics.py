"""Server metrics in the Prometheus text exposition format (0.0.4), written without prometheus-client."""

from __future__ import annotations

import bisect
import threading
from typing import Iterable, Mapping, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# LLMEngine.stats() key -> (metric name, type, help)
ENGINE_STATS: dict[str, tuple[str, str, str]] = {
    "kv_blocks_total": ("trtpaged_kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    "kv_blocks_used": ("trtpaged_kv_blocks_used", "gauge", "KV-cache blocks referenced by live sequences."),
    "kv_blocks_free": ("trtpaged_kv_blocks_free", "gauge", "KV-cache blocks on the free queue (cached ones included)."),
    "kv_blocks_cached": ("trtpaged_kv_blocks_cached", "gauge", "Free blocks still holding a prefix-cache entry."),
    "kv_utilisation": ("trtpaged_kv_utilisation_ratio", "gauge", "Tokens stored / slots of used blocks (1 - fragmentation)."),
    "kv_blocks_saved_by_sharing": ("trtpaged_kv_blocks_saved_by_sharing", "gauge", "Block references beyond the first (shared blocks)."),
    "num_running": ("trtpaged_num_requests_running", "gauge", "Requests in the running batch."),
    "num_waiting": ("trtpaged_num_requests_waiting", "gauge", "Requests waiting for admission (or preempted)."),
    "num_swapped": ("trtpaged_num_requests_swapped", "gauge", "Requests swapped out to host memory."),
    "num_preemptions": ("trtpaged_num_preemptions_total", "counter", "Preemptions (recompute or swap)."),
    "prefix_cache_queries_tokens": ("trtpaged_prefix_cache_queries_tokens_total", "counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_tokens": ("trtpaged_prefix_cache_hits_tokens_total", "counter", "Prompt tokens found in the prefix cache."),
    "kv_evictions": ("trtpaged_kv_evictions_total", "counter", "Cached blocks evicted for reuse."),
    "num_steps": ("trtpaged_engine_steps_total", "counter", "Engine steps run."),
    "num_tokens_computed": ("trtpaged_tokens_computed_total", "counter", "Tokens computed by engine steps."),
    "num_block_copies": ("trtpaged_block_copies_total", "counter", "Copy-on-write block copies."),
}
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def _num(value: float) -> str:
    return repr(float(value)) if value != int(value) else f"{int(value)}"


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


class Histogram:
    """Cumulative-bucket histogram (not thread-safe on its own; ServerMetrics holds the lock)."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help = name, help_text
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.bounds + [float("inf")], self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else _num(bound)
            out.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        out += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class ServerMetrics:
    """Counters and latency histograms the server adds to the engine's own stats. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.http: dict[tuple[str, str], int] = {}  # (route, status) -> count
        self.finished: dict[str, int] = {}  # finish reason -> engine requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram("trtpaged_time_to_first_token_seconds", "Time from arrival to the first generated token.")
        self.tpot = Histogram("trtpaged_time_per_output_token_seconds", "Mean time per output token after the first, per request.")
        self.e2e = Histogram("trtpaged_e2e_request_latency_seconds", "Time from arrival to the last token.")

    def observe_http(self, route: str, status: int) -> None:
        with self._lock:
            key = (route, str(status))
            self.http[key] = self.http.get(key, 0) + 1

    def observe_first_token(self, ttft: float) -> None:
        with self._lock:
            self.ttft.observe(ttft)

    def observe_finished(
        self, reason: str, prompt_tokens: int, output_tokens: int, e2e: float, tpot: Optional[float]
    ) -> None:
        """One engine request ended (reason: stop, length, abort or error)."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens
            self.e2e.observe(e2e)
            if tpot is not None:
                self.tpot.observe(tpot)

    def render(self, engine_stats: Mapping[str, float]) -> str:
        """The exposition: engine stats (gauges and counters), then the server's own metrics."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{_labels(labels)} {_num(value)}" for labels, value in samples)

        for key, (name, kind, help_text) in ENGINE_STATS.items():
            if key in engine_stats:
                family(name, kind, help_text, [({}, engine_stats[key])])
        total = engine_stats.get("kv_blocks_total", 0)
        usage = engine_stats.get("kv_blocks_used", 0) / total if total else 0.0
        family("trtpaged_kv_cache_usage_ratio", "gauge", "KV-cache blocks used / total.", [({}, usage)])
        with self._lock:
            family("trtpaged_http_requests_total", "counter", "HTTP requests by route and status.",
                   [({"route": r, "status": s}, n) for (r, s), n in sorted(self.http.items())])
            family("trtpaged_request_finished_total", "counter", "Engine requests finished, by finish reason.",
                   [({"finished_reason": r}, n) for r, n in sorted(self.finished.items())])
            family("trtpaged_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [({}, self.prompt_tokens)])
            family("trtpaged_generation_tokens_total", "counter", "Generated tokens of finished requests.",
                   [({}, self.generation_tokens)])
            for hist in (self.ttft, self.tpot, self.e2e):
                lines.extend(hist.lines())
        return "\n".join(lines) + "\n"
