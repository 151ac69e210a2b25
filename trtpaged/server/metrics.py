"""Server metrics with prometheus-client, on one CollectorRegistry per server.

Names follow vLLM's (`vllm:X` -> `trtpaged:X`) where the concept is the same; the
KV-sharing metrics are ours. Those that vLLM has are also written under vLLM's own names, labelled with the model
name (`vllm:num_requests_waiting{model_name="..."}`), for the autoscalers, inference gateways and dashboards that
scrape vLLM: the load gauges, the request latency, phase and length histograms and the token, request, preemption
and prefix-cache counters (vLLM's example Grafana dashboard reads each). Engine counters and gauges are read
from a snapshot of `LLMEngine.stats()` taken on the engine thread at scrape time; request latencies
and token counts are observed by the engine loop as outputs arrive.
"""

from __future__ import annotations

import threading
from typing import Iterator, Mapping, NamedTuple, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "trtpaged:"

# LLMEngine.stats() key -> (metric name without prefix, kind, help). Counters get "_total" on exposition.
ENGINE_STATS: dict[str, tuple[str, str, str]] = {
    "num_running": ("num_requests_running", "gauge", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "gauge", "Requests waiting for admission (or preempted)."),
    "num_swapped": ("num_requests_swapped", "gauge", "Requests swapped out to host memory."),
    "num_running_seqs": ("num_sequences_running", "gauge",
                         "Samples or beams in the running batch (before its first token, a request's n samples or "
                         "one beam)."),
    "num_waiting_seqs": ("num_sequences_waiting", "gauge",
                         "Samples or beams waiting: queued, preempted or swapped out (before its first token, a "
                         "request's n samples or one beam)."),
    "oldest_waiting_s": ("oldest_waiting_request_age_seconds", "gauge",
                         "Seconds since the longest-waiting request (queued, preempted or swapped out) arrived; 0 when "
                         "none waits."),
    "oldest_running_s": ("oldest_running_request_age_seconds", "gauge",
                         "Seconds since the oldest request in the running batch arrived; 0 when none runs."),
    "num_preemptions": ("num_preemptions", "counter",
                        "Sequences preempted (recompute or swap): each sample or beam, as vLLM counts child requests."),
    "prefix_cache_queries_tokens": ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits_tokens": ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    "kv_blocks_total": ("kv_cache_blocks", "gauge", "KV-cache blocks in the pool."),
    "kv_blocks_used": ("kv_cache_blocks_used", "gauge", "KV-cache blocks referenced by live sequences."),
    "kv_blocks_free": ("kv_cache_blocks_free", "gauge", "KV-cache blocks on the free queue (cached ones included)."),
    "kv_blocks_cached": ("kv_cache_blocks_cached", "gauge", "Blocks holding a prefix-cache entry (used or free)."),
    "kv_utilisation": ("kv_cache_utilisation_perc", "gauge",
                       "Tokens stored / slots of used blocks (1 - fragmentation)."),
    "kv_blocks_saved_by_sharing": ("kv_cache_blocks_saved_by_sharing", "gauge",
                                   "Block references beyond the first (shared blocks)."),
    "kv_evictions": ("kv_cache_evictions", "counter", "Cached blocks evicted for reuse."),
    "num_steps": ("engine_steps", "counter", "Engine steps run."),
    "step_seconds": ("engine_step_seconds", "counter", "Wall time inside engine steps (every phase)."),
    "num_tokens_computed": ("tokens_computed", "counter", "Tokens computed by engine steps."),
    "num_block_copies": ("block_copies", "counter", "Copy-on-write block copies."),
    "num_constrained_requests": ("structured_output_requests", "counter", "Requests with an output grammar."),
    "num_grammars_compiled": ("grammar_compilations", "counter", "Output grammars compiled (cache misses)."),
    "num_grammar_cache_hits": ("grammar_cache_hits", "counter", "Output grammars found compiled in the cache."),
    "spec_decode_draft_kv_blocks_total": ("spec_decode_draft_kv_cache_blocks", "gauge",
                                          "KV-cache blocks in the draft engine's pool (draft_model)."),
    "spec_decode_draft_kv_blocks_free": ("spec_decode_draft_kv_cache_blocks_free", "gauge",
                                         "Free blocks in the draft engine's pool (draft_model)."),
    "spec_decode_draft_num_steps": ("spec_decode_draft_steps", "counter", "Steps the draft engine ran (draft_model)."),
    "spec_decode_draft_num_tokens_computed": ("spec_decode_draft_tokens_computed", "counter",
                                              "Tokens the draft engine computed (draft_model)."),
    "prefix_cache_tier_hits_tokens": ("prefix_cache_tier_hits", "counter",
                                      "Prompt tokens found in a KV tier below the pool (part of the hits)."),
    "kv_tier_blocks_loaded": ("kv_tier_blocks_loaded", "counter", "Blocks restored into the pool from a KV tier."),
    "kv_tier_load_timeouts": ("kv_tier_load_timeouts", "counter",
                              "Tier loads given up at their deadline (the rest of the prefix recomputed)."),
    "kv_tier_staged_blocks": ("kv_tier_staged_blocks", "gauge", "Blocks that tier loads hold for waiting requests."),
}  # fmt: skip
AGES = ("oldest_waiting_s", "oldest_running_s")  # stats keys that grow with time while the snapshot is kept
PLAN = "execution_plan_"  # stats keys PLAN + "<layers>": 1 for the eager runner's plan, 0 for the others
PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # stats keys PER_POS + "_<i>": accepted at draft position i
# Speculative decoding's counters, labelled method="ngram|draft_model" as vLLM labels them; the engine's
# method is the stats key SPEC_METHOD + "<method>" that is 1.
SPEC_METHOD = "spec_decode_method_"
SPEC_STATS: dict[str, tuple[str, str]] = {
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Speculative drafts verified (sequence-steps)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Speculative tokens proposed and verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Speculative tokens accepted."),
    "spec_decode_num_steps_disabled": ("spec_decode_num_steps_disabled",
                                       "Steps in which the batch-size rule turned speculation off."),
}  # fmt: skip
# Per-tier counters (`kv_tier_<tier>_<field>` in LLMEngine.stats()): one family each, labelled
# tier="host|disk|remote".
TIER_NAMES = ("host", "disk", "remote")
TIER_STATS: dict[str, tuple[str, str]] = {
    "hits": ("kv_tier_hits", "Block lookups answered by the tier with a verified entry."),
    "probes": ("kv_tier_probes", "Lookups that found a block without reading it (before a sliding window)."),
    "misses": ("kv_tier_misses", "Block lookups the tier could not answer (absent, invalid or unreachable)."),
    "invalid": ("kv_tier_invalid_entries", "Entries that failed their checks (truncated, corrupted, foreign engine)."),
    "errors": ("kv_tier_errors", "Store operations that failed (timeouts, refused connections)."),
    "bytes_read": ("kv_tier_read_bytes", "Bytes of entries read for lookups."),
    "bytes_written": ("kv_tier_written_bytes", "Bytes of entries written back."),
    "evictions": ("kv_tier_evictions", "Entries the tier dropped to stay within its size."),
    "dropped": ("kv_tier_dropped_writes", "Write-backs given up (writer queue full or store failing)."),
    "load_seconds": ("kv_tier_load_seconds", "Time spent reading entries for lookups."),
}
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)  # fmt: skip
# vLLM's (vllm/v1/metrics/loggers.py): time to first token reaches 2560 s, a request's phases 7680 s; a quantile
# of a histogram whose last finite bound is 80 s never reads more than 80 s, however long requests queue or run
TTFT_BUCKETS = LATENCY_BUCKETS + (160.0, 640.0, 2560.0)
REQUEST_BUCKETS = LATENCY_BUCKETS + (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)  # until the model's length is known
N_BUCKETS = (1, 2, 5, 10, 20)


def aged(stats: Mapping[str, float], seconds: float) -> dict[str, float]:
    """An engine-stats snapshot read `seconds` ago as of now: the requests' ages (AGES) that were not 0 are that much
    older (the requests that were there are still there, as far as the snapshot knows)."""
    return {**stats, **{k: stats[k] + seconds for k in AGES if stats.get(k)}}


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len`, as vLLM buckets its token-count histograms."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


# vLLM's names of the load gauges that autoscalers and inference gateways read (KEDA scalers, the Gateway API
# inference extension's endpoint picker): the same values again, labelled with the served model's name as vLLM's
# are. gpu_cache_usage_perc is kv_cache_usage_perc's older name, which such configs still use.
VLLM_PREFIX = "vllm:"
# the engine series vLLM also has, under the same names after the prefix; and older vLLM names still scraped
VLLM_ENGINE_SERIES = frozenset({"num_sequences_running", "num_sequences_waiting", "kv_cache_usage_perc",
                                "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
                                "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                "spec_decode_num_accepted_tokens", PER_POS})  # fmt: skip
# vLLM's load gauges count its engine requests, one per sample or beam (vllm/v1/core/sched/scheduler.py, make_stats:
# len(self.running), len(self.waiting) of the child requests); this server's num_requests_* count requests
VLLM_NAMES = {"num_sequences_running": "num_requests_running", "num_sequences_waiting": "num_requests_waiting"}
# a series' older vLLM name, written too (the same series), for the dashboards that still read it
VLLM_OLD_NAMES = {"kv_cache_usage_perc": "gpu_cache_usage_perc",
                  "inter_token_latency_seconds": "time_per_output_token_seconds"}


def vllm_copies(family: Metric, model_name: str) -> Iterator[Metric]:
    """`family` under vLLM's name (`vllm_copy`; VLLM_NAMES where it differs from ours), and under its older vLLM name
    too where it has one (VLLM_OLD_NAMES)."""
    short = family.name[len(PREFIX) :]
    yield vllm_copy(family, model_name, VLLM_PREFIX + VLLM_NAMES[short] if short in VLLM_NAMES else None)
    old = VLLM_OLD_NAMES.get(short)
    if old is not None:
        yield vllm_copy(family, model_name, VLLM_PREFIX + old)


def vllm_copy(family: Metric, model_name: str, name: Optional[str] = None) -> Metric:
    """One of this server's metric families under vLLM's name (`name`, else its own after the prefix), each sample
    labelled with the served model's name; a counter's creation time (this server's, not a value) left out."""
    name = name or VLLM_PREFIX + family.name[len(PREFIX) :]
    out = Metric(name, f"vLLM's name of {family.name}.", family.type)
    for sample in family.samples:
        if not sample.name.endswith("_created"):
            out.add_sample(name + sample.name[len(family.name) :], {"model_name": model_name, **sample.labels},
                           sample.value)  # fmt: skip
    return out


class _EngineStatsCollector(Collector):
    """Exposes the latest engine-stats snapshot (set by the /metrics handler before each scrape); once the served
    model's name is set (`ServerMetrics.set_model_name`), the series vLLM also has under its names too."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, float] = {}
        self.model_name: Optional[str] = None

    def collect(self) -> Iterator[Metric]:
        for family in self._own(self.snapshot):
            yield family
            short = family.name[len(PREFIX) :]
            if self.model_name is not None and short in VLLM_ENGINE_SERIES:
                yield from vllm_copies(family, self.model_name)

    def _own(self, stats: Mapping[str, float]) -> Iterator[Metric]:
        for key, (name, kind, help_text) in ENGINE_STATS.items():
            if key in stats:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(PREFIX + name, help_text, value=float(stats[key]))
        yield from _spec_metrics(stats)
        for field, (name, help_text) in TIER_STATS.items():
            tiers = [t for t in TIER_NAMES if f"kv_tier_{t}_{field}" in stats]
            if tiers:
                family = CounterMetricFamily(PREFIX + name, help_text, labels=["tier"])
                for tier in tiers:
                    family.add_metric([tier], float(stats[f"kv_tier_{tier}_{field}"]))
                yield family
        plans = [k[len(PLAN) :] for k in sorted(stats) if k.startswith(PLAN)]
        if plans:
            family = GaugeMetricFamily(PREFIX + "execution_plan_info",
                                       "The eager runner's execution plan (1: this one).",
                                       labels=["layers"])  # fmt: skip
            for layers in plans:
                family.add_metric([layers], float(stats[PLAN + layers]))
            yield family
        total = stats.get("kv_blocks_total", 0)
        used = stats.get("kv_blocks_used", 0) / total if total else 0.0
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV-cache usage: blocks used / total (1 = 100%).",
                                value=used)


class _VllmSeries(Collector):
    """The server's request histograms and counters again under vLLM's names (the same as this server's after the
    prefix), each series labelled with the served model's name, and under its older name too (VLLM_OLD_NAMES);
    nothing until the name is set."""

    def __init__(self, sources: list[MetricWrapperBase]) -> None:
        self.sources = sources
        self.model_name: Optional[str] = None

    def collect(self) -> Iterator[Metric]:
        if self.model_name is None:
            return
        for source in self.sources:
            for family in source.collect():
                yield from vllm_copies(family, self.model_name)


def _spec_metrics(stats: Mapping[str, float]) -> Iterator[Metric]:
    """The spec_decode_* counters, labelled with the engine's method (none when it does not speculate)."""
    method = next((k[len(SPEC_METHOD) :] for k in sorted(stats) if k.startswith(SPEC_METHOD) and stats[k]), None)
    if method is None:
        return
    for key, (name, help_text) in SPEC_STATS.items():
        if key in stats:
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["method"])
            family.add_metric([method], float(stats[key]))
            yield family
    per_pos = sorted((int(k[len(PER_POS) + 1 :]), v) for k, v in stats.items() if k.startswith(PER_POS + "_"))
    if per_pos:
        family = CounterMetricFamily(PREFIX + PER_POS, "Speculative tokens accepted, by draft position.",
                                     labels=["method", "position"])  # fmt: skip
        for pos, value in per_pos:
            family.add_metric([method, str(pos)], float(value))
        yield family


class RequestPhases(NamedTuple):
    """Where a finished sample's time went (seconds), as vLLM splits it (vllm/v1/metrics/stats.py): queued until
    first scheduled, prefill until the first token, decode from it to the last token, inference: prefill + decode.
    None: the phase was never reached (aborted or failed before it)."""

    queue: Optional[float] = None
    prefill: Optional[float] = None
    decode: Optional[float] = None
    inference: Optional[float] = None


class ServerMetrics:
    """The server's registry: engine snapshot, request latencies and token counts, HTTP statuses. Thread-safe.

    As in vLLM v1, where each of a request's `n` parallel samples is an engine request of its own, the per-request
    series (request_success, e2e and phase latencies, token-count histograms, time to first token, inter-token
    latency) count samples;
    request_params_n and request_max_num_generation_tokens count requests."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._engine = _EngineStatsCollector()
        self._scrape_lock = threading.Lock()
        self.registry.register(self._engine)
        r = self.registry

        def hist(name: str, help_text: str, buckets: tuple = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, help_text, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between a sample's consecutive token-making steps.")
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time from the engine's queue to first scheduled.",
                               REQUEST_BUCKETS)  # fmt: skip
        self.prefill_time = hist("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                                 REQUEST_BUCKETS)  # fmt: skip
        self.decode_time = hist("request_decode_time_seconds", "Time from the first token to the last.",
                                REQUEST_BUCKETS)  # fmt: skip
        self.inference_time = hist("request_inference_time_seconds", "Time from first scheduled to the last token.",
                                   REQUEST_BUCKETS)  # fmt: skip
        self.params_n = hist("request_params_n", "The n request parameter, per finished request.", N_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens, counted at each sample's first token.",
                                     registry=r)  # fmt: skip
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens, counted as they come.",
                                         registry=r)  # fmt: skip
        self.request_success = Counter(PREFIX + "request_success", "Samples finished, by finish reason.",
                                       ["finished_reason"], registry=r)  # fmt: skip
        self.http = Counter(PREFIX + "http_requests", "HTTP requests by route and status.", ["route", "status"],
                            registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before running, by reason.",
                                ["reason"], registry=r)  # fmt: skip
        self.handoff_wait = Counter(PREFIX + "engine_handoff_wait_seconds",
                                    "Wall time the engine thread waited, after its steps, for the event loop to run "
                                    "the readers of their outputs.", registry=r)  # fmt: skip
        self._token_histograms(TOKEN_BUCKETS)
        self._vllm = _VllmSeries([])
        self._vllm_sources()
        r.register(self._vllm)

    def _token_histograms(self, buckets: tuple[int, ...]) -> None:
        """(Re)makes the token-count histograms with `buckets`; done before any request, nothing is lost."""
        for old in ("prompt_hist", "generation_hist", "max_generation_hist", "max_tokens_hist"):
            if hasattr(self, old):
                self.registry.unregister(getattr(self, old))
        r = self.registry
        self.prompt_hist = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per finished sample.",
                                     registry=r, buckets=buckets)  # fmt: skip
        self.generation_hist = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per finished sample.",
                                         registry=r, buckets=buckets)  # fmt: skip
        self.max_generation_hist = Histogram(PREFIX + "request_max_num_generation_tokens",
                                             "The most tokens one of a finished request's samples generated.",
                                             registry=r, buckets=buckets)  # fmt: skip
        self.max_tokens_hist = Histogram(PREFIX + "request_params_max_tokens",
                                         "The max_tokens request parameter, per finished sample.", registry=r,
                                         buckets=buckets)  # fmt: skip

    def _vllm_sources(self) -> None:
        self._vllm.sources = [self.ttft, self.itl, self.tpot, self.e2e, self.queue_time, self.prefill_time,
                              self.decode_time, self.inference_time, self.prompt_hist, self.generation_hist,
                              self.max_generation_hist, self.max_tokens_hist, self.params_n, self.prompt_tokens,
                              self.generation_tokens, self.request_success]  # fmt: skip

    def set_model_name(self, name: str, max_model_len: Optional[int] = None) -> None:
        """Labels vLLM's series with the served model's name (known once the engine loaded); with `max_model_len`,
        buckets the token-count histograms up to it, as vLLM does (call it before requests are served)."""
        if max_model_len is not None:
            self._token_histograms(token_buckets(max_model_len))
            self._vllm_sources()
        self._engine.model_name = self._vllm.model_name = name

    def observe_http(self, route: str, status: int) -> None:
        self.http.labels(route=route, status=str(status)).inc()

    def observe_rejected(self, reason: str) -> None:
        """A request refused with 503 before running (overloaded, draining); a 504 timeout ends a running request."""
        self.rejected.labels(reason=reason).inc()

    def observe_handoff_wait(self, seconds: float) -> None:
        self.handoff_wait.inc(seconds)

    def observe_first_token(self, ttft: float, prompt_tokens: int) -> None:
        """A sample's first token: its time to first token, and its prompt counted (vLLM counts it then)."""
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(prompt_tokens)

    def observe_prompt_without_token(self, prompt_tokens: int) -> None:
        """The prompt of a sample that ended without a token (scored only, aborted or failed first)."""
        self.prompt_tokens.inc(prompt_tokens)

    def observe_generated(self, tokens: int) -> None:
        """Tokens that reached the client in one output, all samples together."""
        self.generation_tokens.inc(tokens)

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(
        self, reason: str, prompt_tokens: int, output_tokens: int, e2e: float, tpot: Optional[float],
        phases: RequestPhases = RequestPhases(), max_tokens: Optional[int] = None,
    ) -> None:  # fmt: skip
        """One sample ended (reason: stop, length, abort or error); `max_tokens`: its request's parameter."""
        self.request_success.labels(finished_reason=reason).inc()
        if max_tokens:
            self.max_tokens_hist.observe(max_tokens)
        self.prompt_hist.observe(prompt_tokens)
        self.generation_hist.observe(output_tokens)
        self.e2e.observe(e2e)
        if tpot is not None:
            self.tpot.observe(tpot)
        for hist, seconds in zip((self.queue_time, self.prefill_time, self.decode_time, self.inference_time), phases):
            if seconds is not None:
                hist.observe(max(0.0, seconds))

    def observe_request(self, n: int, max_generated: int) -> None:
        """One request (all its samples) ended: its n, and its longest sample's tokens."""
        self.params_n.observe(n)
        self.max_generation_hist.observe(max_generated)

    def render(self, engine_stats: Mapping[str, float]) -> bytes:
        """The exposition text, with `engine_stats` (a fresh `LLMEngine.stats()`) as the engine's metrics."""
        with self._scrape_lock:
            self._engine.snapshot = dict(engine_stats)
            return generate_latest(self.registry)
