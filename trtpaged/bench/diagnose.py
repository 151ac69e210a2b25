"""`trtpaged diagnose`: what paged KV management and sharing buy one workload, with numbers.

Input: a request log (JSON Lines, one request per line) and the engine's KV budget (an engine
dir, or a model.yaml: KV bytes per token from the model's config), optionally a running
server's metrics. Four answers, each with its numbers and a one-line verdict citing them:

1. baseline: the log replayed under max-length reservation (a transformers loop or a static
   server), exact reservation, paged, and paged + sharing (trtpaged.bench.memory_bench): the
   concurrency multiple each step buys;
2. sharing: share of prompt tokens in prefixes shared with an earlier request, share of
   sequences that are parallel samples or beams, and the predicted memory saved by sharing;
3. lengths and model size: KV bytes per token and per sequence at the observed lengths, and how
   many sequences fit paged vs reserving max_seq_len;
4. bound: in the paged + sharing replay, steps where requests queue because the KV pool is full
   (memory-bound) vs because the batch limit or the token budget is reached with free KV
   (scheduler-bound); with `--metrics`, the same question from a live server's gauges.

Log lines: {"prompt": text | "prompt_token_ids": [ids] | "prompt_len": N, "output_len": N,
"arrival": step or seconds, "prefix_id": id, "prefix_len": N, "n": N, "beam_width": W}; only the
prompt (one of three) and output_len are required. The server's request log (`trtpaged serve
--request-log`, trtpaged.server.request_log) is such a log: its arrivals are seconds (JSON numbers
with a decimal point), converted to steps with the measured step time (the median of its lines'
step_time_s, or `step_time`), counted from the first arrival and rounded up (a request arriving
during a step joins the next); a prompt_len next to prompt_token_ids must be their count; its other
fields are checked and read as observed figures; its requests that produced no token (refused, or aborted before
one) are skipped and counted, and a prompt only scored (echo with max_tokens 0: no output) is replayed as one token.
A timed trace (Mooncake, Azure, BurstGPT: trtpaged.bench.timed_trace) is read as `bench memory` replays it; an Azure
or BurstGPT trace gives no prompt content, so the sharing answer says that prefix sharing is unknown rather than that
it would save nothing. A trtllm-bench dataset (trtpaged.bench.trtllm_dataset) is read with its prompts' real token
ids (text through the engine's tokenizer), every request at step 0.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from trtpaged.bench.memory_bench import Budget, check_fits, format_tier_table, run_memory_bench, run_tier_what_if
from trtpaged.bench.workload import TraceRequest, arrival_step, check_prefix_len, json_objects, random_prompt

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "prompt_len")
TRACE_FIELDS = ("output_len", "arrival", "prefix_id", "prefix_len", "n", "beam_width")
# what the server's request log adds: observed figures, read and checked but not replayed
SERVER_FIELDS = ("output_lens", "finish_reasons", "cached_tokens", "ttft_s", "latency_s", "steps", "step_time_s")
LOG_FIELDS = PROMPT_FIELDS + TRACE_FIELDS + SERVER_FIELDS
SHARING_MATTERS = 0.05  # predicted memory saved above this: sharing is worth having on


@dataclass(frozen=True)
class ModelKV:
    """What diagnose needs of the model and engine: KV bytes per token and the KV budget."""

    kv_bytes_per_token: int
    budget: Budget
    source: str


@dataclass
class RequestLogData:
    """A request log read for the replay: the trace, each request's prompt ids, and what the log said."""

    trace: list[TraceRequest]
    prompts: list[list[int]]
    arrival_unit: str = "steps"  # or "seconds"
    step_time_s: Optional[float] = None  # seconds per step the seconds were converted with
    skipped_without_output: int = 0  # server-log requests that produced no token (refused, or aborted before one)
    output_tokens: int = 0  # the log's own count: output_lens where given, else output_len x n
    cached_tokens: Optional[int] = None  # prompt tokens the server found in its prefix cache, if logged
    lengths_only: int = 0  # requests logged by their lengths alone (no prompt, no prefix_id): their sharing is unseen
    form: Optional[str] = None  # the trace form it was read as ("Mooncake", "Azure", "BurstGPT", "trtllm-bench")
    wheres: list[str] = field(default_factory=list)  # each request's "path:line" (a request log's), for errors

    def summary(self) -> dict:
        """The report's `log` section."""
        prompt_tokens = sum(len(p) for p in self.prompts)
        cached = self.cached_tokens
        return {"requests": len(self.trace), "prompt_tokens": prompt_tokens, "output_tokens": self.output_tokens,
                "arrival_unit": self.arrival_unit, "step_time_s": self.step_time_s,
                "skipped_without_output": self.skipped_without_output, "observed_cached_tokens": cached,
                "lengths_only": self.lengths_only, "form": self.form,
                "observed_cached_share": cached / prompt_tokens if cached is not None and prompt_tokens else None}


def load_request_log(path: str | Path, tokenize: Optional[Callable[[str], list[int]]] = None,
                     vocab_size: int = 30000, seed: int = 0) -> tuple[list[TraceRequest], list[list[int]]]:  # fmt: skip
    """(trace, prompt token ids) of a request log; see `read_request_log`."""
    data = read_request_log(path, tokenize, vocab_size, seed)
    return data.trace, data.prompts


def read_request_log(path: str | Path, tokenize: Optional[Callable[[str], list[int]]] = None, vocab_size: int = 30000,
                     seed: int = 0, step_time: Optional[float] = None,
                     budget: Optional[Budget] = None) -> RequestLogData:  # fmt: skip
    """Reads a request log: the trace and each request's prompt token ids, arrivals in steps.

    Text prompts need `tokenize`; lengths get random ids, with a shared prefix_id's first
    prefix_len tokens identical. Arrivals are all integers (steps) or all non-integral numbers
    (seconds, converted with `step_time` or the lines' step_time_s). Errors name the line and the field.
    A timed trace (trtpaged.bench.timed_trace) is read as `bench memory` replays it: its prompts (a Mooncake trace's
    hash ids' blocks, an Azure or BurstGPT trace's random tokens), its timestamps as steps at `step_time` (needed
    when they differ); given the replay's `budget`, a request it can never run is refused (`check_fits`, naming the
    line) before any prompt is drawn.
    """
    from trtpaged.bench.timed_trace import timed_form
    from trtpaged.bench.trtllm_dataset import is_trtllm_dataset

    if timed_form(path):
        return _read_timed(path, vocab_size, seed, step_time, budget)
    if is_trtllm_dataset(path):
        return _read_trtllm(path, tokenize, vocab_size, step_time)
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    prefix_lens: dict[int, tuple[int, str]] = {}
    rows: list[tuple[str, dict, TraceRequest, list[int]]] = []
    out = RequestLogData([], [])
    first_arrival: Optional[tuple[str, bool]] = None  # (where, is seconds) of the first line with an arrival
    step_times: list[float] = []
    for where, data in json_objects(path, LOG_FIELDS):
        try:
            given = [f for f in PROMPT_FIELDS if f in data]
            if given == ["prompt_token_ids", "prompt_len"]:  # the server log: the ids and their count
                given = ["prompt_token_ids"]
                ids = data["prompt_token_ids"]
                if not isinstance(ids, list) or data["prompt_len"] != len(ids):
                    raise ValueError(f"prompt_len: {data['prompt_len']!r} is not the number of prompt_token_ids")
            if len(given) != 1:
                raise ValueError(f"prompt: give exactly one of {', '.join(PROMPT_FIELDS)} (got {given or 'none'})")
            if "output_len" not in data:
                raise ValueError("output_len: required")
            _check_server_fields(data)
            if "arrival" in data:
                seconds = _arrival_is_seconds(data["arrival"])
                if first_arrival is None:
                    first_arrival = (where, seconds)
                elif seconds != first_arrival[1]:
                    unit = "seconds (a number with a decimal point)" if first_arrival[1] else "steps (an integer)"
                    raise ValueError(f"arrival: {data['arrival']!r} mixes units: {first_arrival[0]} gives {unit}")
            if data.get("step_time_s") is not None:
                step_times.append(data["step_time_s"])
            if "finish_reasons" in data and type(data["output_len"]) is int and data["output_len"] == 0:
                if not data["finish_reasons"] or {"error", "abort"} & set(data["finish_reasons"]):
                    out.skipped_without_output += 1  # refused, or aborted before a token: nothing to replay
                    continue
                # a prompt only scored (echo, max_tokens 0): its prefill and the one token sampled to score it
                data = {**data, "output_len": 1}
            ids = _prompt_ids(data, given[0], tokenize, vocab_size)
            fields = {k: v for k, v in data.items() if k in TRACE_FIELDS and k != "arrival"}  # arrival: below
            req = TraceRequest(prompt_len=len(ids) if ids is not None else data["prompt_len"], **fields)
            check_prefix_len(prefix_lens, req, where)
            if ids is None:
                out.lengths_only += req.prefix_id is None
                ids = random_prompt(req, vocab_size, rng, prefixes)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
        rows.append((where, data, req, ids))
    if not rows:
        raise ValueError(f"{path}: no requests")
    arrivals = _arrival_steps(rows, first_arrival is not None and first_arrival[1], step_time, step_times, out)
    for (where, data, req, ids), arrival in zip(rows, arrivals):
        try:
            out.trace.append(replace(req, arrival=arrival))
        except ValueError as exc:  # a step past the last a replay runs (seconds past it are refused before)
            raise ValueError(f"{where}: {exc}") from exc
        out.prompts.append(ids)
        out.wheres.append(where)
        out.output_tokens += sum(data["output_lens"]) if "output_lens" in data else req.output_len * req.n
        if "cached_tokens" in data:
            out.cached_tokens = (out.cached_tokens or 0) + data["cached_tokens"]
    return out


def _read_timed(path: str | Path, vocab_size: int, seed: int, step_time: Optional[float],
                budget: Optional[Budget]) -> RequestLogData:  # fmt: skip
    from trtpaged.bench.timed_trace import read_timed_trace
    from trtpaged.bench.workload import prompt_token_ids

    timed = read_timed_trace(path)
    trace, wheres = timed.arrival_steps(step_time), [r.where for r in timed.requests]
    if budget is not None:
        check_fits(trace, budget, wheres)
    out = RequestLogData(trace, prompt_token_ids(trace, vocab_size, seed), step_time_s=step_time,
                         arrival_unit="seconds" if step_time is not None else "steps", form=timed.form,
                         wheres=wheres)  # fmt: skip
    out.output_tokens = sum(r.output_len for r in trace)
    out.lengths_only = sum(r.hash_ids is None for r in trace)  # an Azure or BurstGPT trace's: no prompt content
    return out


def _read_trtllm(path: str | Path, tokenize: Optional[Callable[[str], list[int]]], vocab_size: int,
                 step_time: Optional[float]) -> RequestLogData:  # fmt: skip
    """A trtllm-bench dataset (trtpaged.bench.trtllm_dataset): its prompts' real token ids, every request at step 0."""
    from trtpaged.bench.trtllm_dataset import FORM, read_trtllm_dataset

    if step_time is not None:
        raise ValueError(f"--step-time: {path} is a {FORM} dataset, which has no arrival times (every request at "
                         "step 0); nothing to convert")  # fmt: skip
    dataset = read_trtllm_dataset(path)
    prompts = dataset.prompt_ids(tokenize, vocab_size, "give --engine (a --config has no tokenizer)")
    trace = [TraceRequest(len(ids), line.output_len) for ids, line in zip(prompts, dataset.lines)]
    return RequestLogData(trace, prompts, output_tokens=sum(r.output_len for r in trace), form=FORM,
                          wheres=[line.where for line in dataset.lines])  # fmt: skip


def _arrival_is_seconds(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"arrival: must be a step (integer) or seconds (number), got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"arrival: must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"arrival: must be >= 0, got {value!r}")
    return isinstance(value, float)


def _arrival_steps(rows: list[tuple[str, dict, TraceRequest, list[int]]], seconds: bool, step_time: Optional[float],
                   step_times: list[float], out: RequestLogData) -> list[int]:  # fmt: skip
    """Each row's arrival step: integers as given; seconds since the first arrival over the step time, rounded up."""
    if step_time is not None and not (isinstance(step_time, (int, float)) and math.isfinite(step_time)
                                      and step_time > 0):  # fmt: skip
        raise ValueError(f"--step-time: must be a positive number of seconds, got {step_time!r}")
    if not seconds:
        if step_time is not None:
            raise ValueError("--step-time: the log's arrivals are steps (integers), not seconds; nothing to convert")
        return [data.get("arrival", 0) for _, data, _, _ in rows]
    missing = next((where for where, data, _, _ in rows if "arrival" not in data), None)
    if missing:
        raise ValueError(f"{missing}: arrival: required when the log's arrivals are seconds")
    if step_time is None:
        if not step_times:
            raise ValueError("arrival: seconds need a step time: no line gives step_time_s; give --step-time SECONDS")
        step_time = statistics.median(step_times)
    out.arrival_unit, out.step_time_s = "seconds", step_time
    # a request that arrives during step k - 1 is first scheduled in step k (the tolerance absorbs float error)
    start = min(data["arrival"] for _, data, _, _ in rows)
    steps = []
    for where, data, _, _ in rows:
        try:
            steps.append(arrival_step(data["arrival"] - start, step_time))
        except ValueError as exc:
            raise ValueError(f"{where}: arrival: {data['arrival']!r} s {exc}") from None
    return steps


def _check_int(data: dict, name: str, low: int) -> None:
    value = data[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")


def _check_server_fields(data: dict) -> None:
    """The server log's observed figures: of the right type, finite and in range (nonsense is refused)."""
    for name in ("cached_tokens", "steps"):
        if name in data:
            _check_int(data, name, 0)
    for name in ("ttft_s", "latency_s", "step_time_s"):
        value = data.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}: must be a finite number of seconds or null, got {value!r}")
        if value < 0 or (name == "step_time_s" and value == 0):
            raise ValueError(f"{name}: must be {'> 0' if name == 'step_time_s' else '>= 0'}, got {value!r}")
    lens = data.get("output_lens")
    if lens is not None:
        if not isinstance(lens, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                 for x in lens):  # fmt: skip
            raise ValueError(f"output_lens: must be a list of integers >= 0, got {lens!r}")
        if max(lens, default=0) != data["output_len"]:
            raise ValueError(f"output_len: {data['output_len']!r} is not the longest of output_lens {lens}")
        n = data.get("n", 1)
        if isinstance(n, int) and len(lens) != n:  # the server logs one per completion (n is checked later)
            raise ValueError(f"output_lens: {len(lens)} completions for n {n}")
    plen = data.get("prompt_len")
    if "cached_tokens" in data and isinstance(plen, int) and data["cached_tokens"] >= max(1, plen):
        raise ValueError(f"cached_tokens: {data['cached_tokens']} of a {plen}-token prompt "
                         "(the last token is never cached)")
    reasons = data.get("finish_reasons")
    if reasons is not None and (not isinstance(reasons, list) or not all(isinstance(x, str) for x in reasons)):
        raise ValueError(f"finish_reasons: must be a list of strings, got {reasons!r}")
    if reasons is not None and lens is not None and len(reasons) != len(lens):
        raise ValueError(f"finish_reasons: {len(reasons)} for {len(lens)} completions (output_lens)")


def _prompt_ids(data: dict, field: str, tokenize: Optional[Callable[[str], list[int]]],
                vocab_size: int) -> Optional[list[int]]:  # fmt: skip
    value = data[field]
    if field == "prompt":
        if not isinstance(value, str) or not value:
            raise ValueError(f"prompt: must be a non-empty string, got {value!r}")
        if tokenize is None:
            raise ValueError("prompt: text prompts need a tokenizer (give --engine, or token ids / lengths)")
        return list(tokenize(value))
    if field == "prompt_token_ids":
        if not isinstance(value, list) or not value or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in value):  # fmt: skip
            raise ValueError("prompt_token_ids: must be a non-empty list of integers")
        bad = next((t for t in value if not 0 <= t < vocab_size), None)
        if bad is not None:  # the replay's engine would refuse it
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
        return list(value)
    return None


def shared_prefix_tokens(prompts: list[list[int]]) -> list[int]:
    """For each prompt, how many leading tokens equal the start of some earlier prompt (a token trie)."""
    root: dict = {}
    out = []
    for ids in prompts:
        node, matched, still = root, 0, True
        for t in ids:
            if still and t in node:
                matched += 1
            else:
                still = False
            node = node.setdefault(t, {})
        out.append(matched)
    return out


# ---- the four answers -------------------------------------------------------------------------
def _baseline(report: dict) -> dict:
    p = {x["policy"]: x for x in report["policies"]}
    rmax, exact = p["contiguous, reserve max_seq_len"], p["contiguous, reserve exact"]
    paged, shared = p["paged"], p["paged + sharing"]

    def ratio(a: dict, b: dict) -> Optional[float]:
        return a["mean_running"] / b["mean_running"] if b["mean_running"] else None

    out = {
        "mean_running": {name: x["mean_running"] for name, x in p.items()},
        "steps": {name: x["steps"] for name, x in p.items()},
        "exact_vs_reserve_max": ratio(exact, rmax),
        "paged_vs_exact": ratio(paged, exact),
        "sharing_vs_paged": ratio(shared, paged),
        "paged_sharing_vs_reserve_max": ratio(shared, rmax),
        "speedup_in_steps_vs_reserve_max": rmax["steps"] / shared["steps"] if shared["steps"] else None,
    }
    out["verdict"] = (
        f"Against max-length reservation (a transformers loop or static server: {rmax['mean_running']:.1f} sequences "
        f"running on average) paged + sharing runs {shared['mean_running']:.1f}, "
        f"{_x(out['paged_sharing_vs_reserve_max'])} the concurrency and finishes "
        f"{_x(out['speedup_in_steps_vs_reserve_max'])} sooner (in steps); of that, knowing lengths exactly "
        f"buys {_x(out['exact_vs_reserve_max'])}, paging {_x(out['paged_vs_exact'])} more, "
        f"sharing {_x(out['sharing_vs_paged'])} more."
    )
    return out


def _sharing(trace: list[TraceRequest], prompts: list[list[int]], report: dict, block_size: int,
             lengths_only: int = 0) -> dict:  # fmt: skip
    shared = shared_prefix_tokens(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    # the prefix cache shares whole blocks, and never the prompt's last token
    shareable = sum(min(s, len(p) - 1) // block_size * block_size for s, p in zip(shared, prompts))
    seqs = sum(r.num_seqs for r in trace)
    parallel = sum(r.n for r in trace if r.n > 1 and r.beam_width == 1)
    beams = sum(r.beam_width for r in trace if r.beam_width > 1)
    saved = report["sharing"]["memory_saved"]
    out = {
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_in_shared_prefixes": sum(shared),
        "shared_prefix_share": sum(shared) / prompt_tokens if prompt_tokens else 0.0,
        "shared_prefix_share_in_full_blocks": shareable / prompt_tokens if prompt_tokens else 0.0,
        "sequences": seqs,
        "parallel_sample_share": parallel / seqs if seqs else 0.0,
        "beam_share": beams / seqs if seqs else 0.0,
        "predicted_memory_saved": saved,
        "blocks_with_sharing": report["sharing"]["blocks_with_sharing"],
        "blocks_without_sharing": report["sharing"]["blocks_without_sharing"],
        "prefix_sharing_known": lengths_only < len(trace),
    }
    samples = (f"{out['parallel_sample_share']:.1%} of sequences are parallel samples and {out['beam_share']:.1%} "
               "beams")  # fmt: skip
    if not out["prefix_sharing_known"]:  # random prompts share nothing: a 0% here would be a claim the log cannot make
        out["verdict"] = (f"no request's prompt content is known (lengths only), so what prefix sharing would save is "
                          f"unknown: the replay's prompts are random tokens, sharing none; {samples}, whose sharing "
                          f"is predicted to save {saved:.1%} of KV blocks in use.")  # fmt: skip
        return out
    matters = "worth having on" if saved >= SHARING_MATTERS else "of little use to this workload"
    out["verdict"] = (
        f"{out['shared_prefix_share']:.1%} of prompt tokens repeat an earlier prompt's prefix "
        f"({out['shared_prefix_share_in_full_blocks']:.1%} in whole blocks the prefix cache can share); "
        f"{samples}; sharing is predicted to save {saved:.1%} of KV blocks in use: {matters}."
    )
    return out


def _lengths(trace: list[TraceRequest], kv: ModelKV) -> dict:
    b = kv.budget
    seq_lens = [min(b.max_seq_len, r.prompt_len + r.output_len) for r in trace for _ in range(r.num_seqs)]
    mean_len = sum(seq_lens) / len(seq_lens)
    # paged: each sequence wastes at most one partly filled block; half a block on average
    mean_blocks = sum(-(-n // b.block_size) for n in seq_lens) / len(seq_lens)
    fit_paged = int(b.num_kv_blocks // mean_blocks)
    fit_reserve = b.capacity_tokens // b.max_seq_len
    out = {
        "kv_bytes_per_token": kv.kv_bytes_per_token,
        "kv_budget_bytes": kv.kv_bytes_per_token * b.capacity_tokens,
        "mean_seq_len": mean_len,
        "max_seq_len": b.max_seq_len,
        "kv_bytes_per_seq_at_mean_len": kv.kv_bytes_per_token * mean_len,
        "seqs_that_fit_paged": fit_paged,
        "seqs_that_fit_reserving_max_seq_len": fit_reserve,
        "max_batch_size": b.max_batch_size,
        "fit_ratio": fit_paged / fit_reserve if fit_reserve else None,
    }
    runs = min(fit_paged, b.max_batch_size), min(fit_reserve, b.max_batch_size)
    capped = (f"; at most max_batch_size {b.max_batch_size} run at once, so {runs[0]} against {runs[1]}"
              f" ({_x(runs[0] / runs[1] if runs[1] else None)})" if fit_paged > b.max_batch_size else "")  # fmt: skip
    out["verdict"] = (
        f"{kv.kv_bytes_per_token / 1024:.1f} KiB of KV per token, "
        f"{out['kv_bytes_per_seq_at_mean_len'] / 2**20:.1f} MiB "
        f"per sequence at the mean length {mean_len:.0f} of max_seq_len {b.max_seq_len}: the budget holds "
        f"{fit_paged} sequences paged vs {fit_reserve} reserving max_seq_len ({_x(out['fit_ratio'])}){capped}. "
        f"The gain grows as sequences get longer relative to what a reservation must assume, and with the model's "
        f"KV bytes per token (the PagedAttention paper's gains are largest on long ShareGPT-like sequences and the "
        f"largest models, where KV fills memory at small batch sizes)."
    )
    return out


def _bound(report: dict, budget: Budget, metrics: Optional[dict]) -> dict:
    series = report["series"]["paged + sharing"]
    steps = len(series["running"])
    queued = [i for i in range(steps) if series["waiting"][i]]
    # at the batch limit no request is admitted, whether or not the next one fits the pool: more memory buys
    # nothing in such a step (was: counted memory-bound whenever the head did not fit)
    batch = [i for i in queued if series["running"][i] >= budget.max_batch_size]
    memory = [i for i in queued if not series["head_fits"][i] and series["running"][i] < budget.max_batch_size]
    token = len(queued) - len(memory) - len(batch)
    out = {
        "steps": steps,
        "steps_with_queue": len(queued),
        "memory_bound_steps": len(memory),
        "batch_limit_steps": len(batch),
        "token_budget_steps": token,
        "observed": metrics,
    }
    if not queued:
        kind = "neither: nothing ever waited in the replay (the workload fits; arrivals set the pace)"
    elif len(memory) >= len(batch) + token:
        kind = "memory-bound: requests mostly queued because the KV pool was full; more KV memory or sharing helps"
    else:
        kind = (f"scheduler-bound: requests mostly queued with free KV, at the batch limit (max_batch_size "
                f"{budget.max_batch_size}) or the token budget; raise those limits before buying memory")  # fmt: skip
    out["replay_bound"] = kind.split(":")[0]
    verdict = (f"In the replay, requests queued in {len(queued)} of {steps} steps: {len(memory)} with the KV pool "
               f"full, {len(batch)} at the batch limit, {token} at the token budget -> {kind}.")  # fmt: skip
    if metrics:
        verdict += " " + metrics["verdict"]
    out["verdict"] = verdict
    return out


def _x(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def diagnose(trace: list[TraceRequest], prompts: list[list[int]], kv: ModelKV, metrics: Optional[dict] = None,
             progress: Optional[Callable[[str], None]] = None, log: Optional[RequestLogData] = None,
             tier_blocks: Optional[list[Optional[int]]] = None) -> dict:  # fmt: skip
    """The four answers (see module docstring) as one JSON-able report; `log` adds what the log itself said;
    `tier_blocks` adds what KV tiers of those sizes below the pool would buy (docs/kv_tiers.md)."""
    report = run_memory_bench(trace, kv.budget, progress=progress, prompts=prompts)
    extra = {}
    if tier_blocks:
        extra["kv_tiers"] = run_tier_what_if(trace, kv.budget, tier_blocks, prompts, progress)
    return extra | {
        "requests": len(trace),
        "log": (log or RequestLogData(trace, prompts, output_tokens=sum(r.output_len * r.n for r in trace))).summary(),
        "model": {"source": kv.source, "kv_bytes_per_token": kv.kv_bytes_per_token, "budget": report["budget"]},
        "baseline": _baseline(report),
        "sharing": _sharing(trace, prompts, report, kv.budget.block_size, log.lengths_only if log else 0),
        "lengths": _lengths(trace, kv),
        "bound": _bound(report, kv.budget, metrics),
    }


def format_diagnosis(report: dict) -> str:
    b = report["model"]["budget"]
    lines = [f"trtpaged diagnose: {report['requests']} requests; {report['model']['source']}; KV budget "
             f"{b['num_kv_blocks']} blocks x {b['block_size']} tokens, max_seq_len {b['max_seq_len']}, "
             f"max_batch_size {b['max_batch_size']}"]  # fmt: skip
    lines.append(_log_line(report["log"]))
    titles = {"baseline": "1. baseline and headroom", "sharing": "2. sharing", "lengths": "3. lengths and model size",
              "bound": "4. memory-bound or scheduler-bound"}  # fmt: skip
    for key, title in titles.items():
        lines += ["", f"{title}:", f"   {report[key]['verdict']}"]
    if "kv_tiers" in report:
        lines += ["", format_tier_table(report["kv_tiers"], b["num_kv_blocks"])]
    return "\n".join(lines)


def _log_line(log: dict) -> str:
    line = f"   log: {log['prompt_tokens']} prompt and {log['output_tokens']} output tokens"
    if log["arrival_unit"] == "seconds":
        line += f"; arrivals in seconds, replayed at {log['step_time_s'] * 1000:.2f} ms per step"
    if log["observed_cached_share"] is not None:
        line += f"; the server found {log['observed_cached_share']:.1%} of prompt tokens in its prefix cache"
    if log["skipped_without_output"]:
        line += (f"; {log['skipped_without_output']} requests without output (refused, or aborted before a token) "
                 "left out")
    if log.get("lengths_only") and log.get("form"):  # an Azure or BurstGPT trace: lengths and times, no prompts
        line += (f"; {log['form']} trace: no prompt text or prefix ids, its prompts random tokens of each request's "
                 "length")  # fmt: skip
    elif log.get("form") == "trtllm-bench":
        line += "; trtllm-bench dataset: its prompts' own token ids (text tokenized), every request at step 0"
    elif log.get("lengths_only"):  # a server log without --request-log-prompts: random tokens, so no sharing is seen
        line += (f"; {log['lengths_only']} requests logged by length only: the sharing below cannot see theirs "
                 "(log prompts with `serve --request-log-prompts`)")
    return line
