"""`trtpaged bench throughput`: one set of requests through trtpaged and through the baseline users run today.

Side by side, in one run, on the same requests (token ids; EOS ignored so every output has
exactly its requested length):

- trtpaged: every request submitted at t=0 to `LLM(engine).engine`, continuous batching;
- hf: transformers `generate` on the engine's source model with static batches of up to
  `hf_batch_size` requests in submission order: prompts left-padded to the batch's longest,
  and the batch decodes until its longest output is done (greedy);
- optional rows: trtpaged with prefix caching off, a second engine dir (e.g. fp32 vs quantized), and
  trtpaged with speculative decoding (`speculative_config`) next to transformers' own assisted
  generation as its peer: prompt lookup (`prompt_lookup_num_tokens`) for the n-gram method, the draft
  engine's source model (`assistant_model`) for a draft engine; one request at a time, as HF takes no
  batch there; and llama.cpp (`llamacpp`: trtpaged.bench.llamacpp) on a GGUF of the engine's model, continuous
  batching as llama-server runs it.

`sequential` runs one request at a time (single-stream decode) in every system instead of all at t=0.

Each system runs in its own process (so peak RSS is its own), after a one-request warm-up.
With rounds > 1 every row (trtpaged, transformers, llama.cpp) runs the workload again in its process, each round on
fresh prompts of the same lengths and sharing (no prefix-cache hits between rounds, the same within each), and reports
every round's wall: the first batch after loading (no warm-up request then: `LLM(...)` returning is
"ready") against the next ones. Each row says which instruction set ran it.
Per system: useful output tok/s (requested output tokens / wall), computed tok/s (every token
position run through the model, prompts, padding and decode steps past a request's end
included / wall), wall time, TTFT (from t=0, queueing included) and per-output-token latency
(p50/p99 over requests), peak RSS, and the noise of the run (trtpaged.bench.noise). A single-stream run's trtpaged
rows also give the weight-streaming limit of their decode (trtpaged.bench.streaming_limit).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from trtpaged.bench import process_tree, streaming_limit
from trtpaged.bench.noise import Noise, NoiseMonitor, assess, spread
from trtpaged.bench.sharegpt import ShareGPTRule, ShareGPTSample, sample_sharegpt
from trtpaged.bench.timed_trace import TimedTrace, read_timed_trace
from trtpaged.bench.trtllm_dataset import TrtllmDataset, read_trtllm_dataset
from trtpaged.bench.workload import (TraceRequest, json_objects, load_trace_lines, prompt_token_ids, read_lines,
                                     synthetic_trace)  # fmt: skip

if TYPE_CHECKING:
    from trtpaged.bench.llamacpp import LlamaCppRow

DEFAULT_MIX = {"num_requests": 16, "prompt_len": (32, 300), "output_len": (16, 240)}


@dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: tuple[int, ...]
    output_len: int
    where: str = field(default="", compare=False)  # "file:line" of a request read from a file


@dataclass
class SystemResult:
    name: str
    useful_tok_s: float
    computed_tok_s: float
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    peak_rss_mb: float
    useful_tokens: int
    computed_tokens: int
    foreign_cores: Optional[float] = None
    notes: list[str] = field(default_factory=list)
    isa: str = ""  # the instruction set the system's CPU code ran (forced or chosen)
    round_walls: list[float] = field(default_factory=list)  # --rounds: wall of each round, the first included
    timed_out: bool = False  # a peer row stopped at its time limit: no figures
    prefix_hit_tokens: Optional[int] = None  # trtpaged rows: prompt tokens found in the prefix cache (first round)
    # trtpaged rows of a single-stream run: weight bytes a decode step reads, the read bandwidth measured after the run
    weight_bytes_per_step: Optional[int] = None
    read_gbs: Optional[float] = None


def timed_out_result(name: str, limit_s: float) -> SystemResult:
    """The row of a system stopped at `limit_s` seconds: no figures (nan), a note saying so."""
    nan = math.nan
    return SystemResult(name=name, useful_tok_s=nan, computed_tok_s=nan, wall_s=nan, ttft_p50_s=nan, ttft_p99_s=nan,
                        tpot_p50_s=nan, tpot_p99_s=nan, peak_rss_mb=nan, useful_tokens=0, computed_tokens=0,
                        notes=[f"timed out after {limit_s:g} s (the peer time limit): no figures"],
                        timed_out=True)  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---- workloads --------------------------------------------------------------------------------
def default_requests(vocab_size: int, num_requests: int = 16, seed: int = 0) -> list[Request]:
    """The built-in mix: prompts 32-300 tokens, outputs 16-240 tokens, random token ids."""
    trace = synthetic_trace(num_requests, DEFAULT_MIX["prompt_len"], DEFAULT_MIX["output_len"], seed=seed)
    return requests_from_trace(trace, vocab_size, seed)


def requests_from_trace(trace: list[TraceRequest], vocab_size: int, seed: int = 0,
                        wheres: Optional[list[str]] = None,
                        max_seq_len: Optional[int] = None) -> list[Request]:  # fmt: skip
    """Token ids for a memory-bench trace (shared prefixes identical). Every request is one sequence submitted at
    t=0, as the transformers baseline runs it: a line with n, beam_width or arrival is refused, naming it (they
    were dropped without a word). `wheres`: each request's "file:line", when read from a file. `max_seq_len` (the
    engine's): a request longer is refused (`check_requests`' error) before any prompt is drawn."""
    wheres = wheres or [f"request {i}" for i in range(1, len(trace) + 1)]
    for where, r in zip(wheres, trace):
        for name, plain in (("n", 1), ("beam_width", 1), ("arrival", 0)):
            if getattr(r, name) != plain:
                raise ValueError(f"{where}: {name}: {getattr(r, name)}; bench throughput submits every "
                                 f"request at once as one sequence (its baseline's form); `bench memory` replays "
                                 f"{name} (leave it out here)")
        if max_seq_len is not None and r.prompt_len + r.output_len > max_seq_len:
            raise ValueError(_too_long(where, r.prompt_len, r.output_len, max_seq_len))
    ids = prompt_token_ids(trace, vocab=vocab_size, seed=seed)
    return [Request(tuple(p), r.output_len, where) for p, r, where in zip(ids, trace, wheres)]


def fresh_prompts(requests: list[Request], vocab_size: int, seed: int) -> list[Request]:
    """The same requests' shapes (prompt and output lengths, and what the prompts share) with other token ids:
    another round of the same work that finds nothing of the previous rounds in the prefix cache. Each token id is
    mapped through one random permutation of the vocabulary, so prompts that share a prefix (a Mooncake trace's
    blocks, a trace's prefix_id) share as much of it again, and the rounds' prefix hits are the same."""
    import random

    ids = list(range(vocab_size))
    random.Random(seed).shuffle(ids)
    return [Request(tuple(ids[t] for t in r.prompt_ids), r.output_len) for r in requests]


def load_requests(path: str | Path, tokenizer: Callable[[str], list[int]], vocab_size: int,
                  max_seq_len: Optional[int] = None) -> list[Request]:  # fmt: skip
    """A trace (lines with prompt_len) or a prompts file: lines {"prompt": text, "output_len": N}.

    Errors name the line and the field; a trace's request longer than `max_seq_len` is refused before its prompt is
    drawn (a prompts file's, by `check_requests`, once tokenized).
    """
    lineno, line = next(((i, line) for i, line in enumerate(read_lines(path), 1) if line.strip()), (0, ""))
    if not lineno:
        raise ValueError(f"{path}: no requests")
    try:
        first = json.loads(line)
    except (ValueError, RecursionError):
        first = None  # no JSON object: the trace reader's error says what the line is and what form is expected
    if not (isinstance(first, dict) and "prompt" in first):
        lines = load_trace_lines(path)  # one read: each request with its file:line
        return requests_from_trace([r for _, r in lines], vocab_size, wheres=[where for where, _ in lines],
                                   max_seq_len=max_seq_len)  # fmt: skip
    out = []
    for where, data in json_objects(path, ("prompt", "output_len")):
        prompt, output_len = data.get("prompt"), data.get("output_len")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: prompt: must be a non-empty string, got {prompt!r}")
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
            raise ValueError(f"{where}: output_len: must be an integer >= 1, got {output_len!r}")
        try:
            out.append(Request(tuple(tokenizer(prompt)), output_len, where))
        except ValueError as exc:  # text the tokenizer cannot take (RequestError)
            raise ValueError(f"{where}: {exc}") from None
    return out


def timed_requests(path: str | Path, vocab_size: int, seed: int = 0,
                   max_seq_len: Optional[int] = None) -> tuple[list[Request], TimedTrace]:  # fmt: skip
    """A timed trace's requests (Mooncake, Azure, BurstGPT) in timestamp order, each prompt token ids in
    [1, vocab_size) drawn with `seed` (a Mooncake trace's: its hash ids' blocks, trtpaged.bench.token_blocks), all
    submitted at t=0 (the timestamps are not replayed here: the caller says so); and the trace. Each request's
    `where` is its line; one longer than `max_seq_len` is refused before any prompt is drawn."""
    trace = read_timed_trace(path)
    wheres = [r.where for r in trace.requests]
    return requests_from_trace(trace.trace(), vocab_size, seed, wheres, max_seq_len), trace


def sharegpt_requests(path: str | Path, encode: Callable[[str], list[int]], num_requests: int, seed: int = 0,
                      output_len: Optional[int] = None,
                      max_seq_len: Optional[int] = None) -> tuple[list[Request], ShareGPTSample]:  # fmt: skip
    """A ShareGPT dataset's requests (trtpaged.bench.sharegpt: vLLM's rule): each prompt's token ids are `encode` of
    its text (the engine's tokenizer, which also counts both turns' tokens); a pair longer than `max_seq_len` (the
    engine's) is skipped. Each request's `where` names its entry ("FILE[12]")."""
    rule = ShareGPTRule(output_len=output_len, model_len=max_seq_len)
    sample = sample_sharegpt(path, lambda text: len(encode(text)), num_requests, seed, rule)
    return [Request(tuple(encode(r.prompt)), r.output_len, f"{path}[{r.entry}]") for r in sample.requests], sample


def trtllm_requests(path: str | Path, encode: Callable[[str], list[int]],
                    vocab_size: int) -> tuple[list[Request], TrtllmDataset, list[list[int]]]:  # fmt: skip
    """A trtllm-bench dataset's requests (trtpaged.bench.trtllm_dataset) in file order: input_ids as given (each
    below `vocab_size`), text prompts through `encode` (the engine's tokenizer); the dataset, and each prompt's ids.
    Each request's `where` is its line."""
    dataset = read_trtllm_dataset(path)
    prompts = dataset.prompt_ids(encode, vocab_size)
    requests = [Request(tuple(ids), line.output_len, line.where) for ids, line in zip(prompts, dataset.lines)]
    return requests, dataset, prompts


def check_requests(requests: list[Request], max_seq_len: int, source: str) -> None:
    """ValueError naming the request when its prompt and output_len do not fit the engine's max_seq_len (before
    anything loads: the engine would refuse it mid-run)."""
    for i, r in enumerate(requests, 1):
        if len(r.prompt_ids) + r.output_len > max_seq_len:
            raise ValueError(_too_long(r.where or f"{source}: request {i}", len(r.prompt_ids), r.output_len,
                                       max_seq_len))  # fmt: skip


def _too_long(where: str, prompt_len: int, output_len: int, max_seq_len: int) -> str:
    """The error for a request whose prompt and output do not fit the engine's max_seq_len."""
    return (f"{where}: {prompt_len} prompt tokens + output_len {output_len} exceed the engine's max_seq_len "
            f"({max_seq_len})")


# ---- systems ----------------------------------------------------------------------------------
def system_result(name: str, requests: list[Request], wall: float, computed: int, ttft: list[float],
                  tpot: list[float], monitor: NoiseMonitor) -> SystemResult:  # fmt: skip
    """A row's figures from one round of `requests`: tok/s over `wall`, TTFT and TPOT percentiles, this process's
    peak RSS (its descendants' too) and the load other processes put on the machine during `monitor`."""
    useful = sum(r.output_len for r in requests)
    return SystemResult(
        name=name,
        useful_tok_s=useful / wall,
        computed_tok_s=computed / wall,
        wall_s=wall,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50),
        tpot_p99_s=percentile(tpot, 99),
        peak_rss_mb=process_tree.peak_rss_mb(),  # tensor-parallel ranks' too
        useful_tokens=useful,
        computed_tokens=computed,
        foreign_cores=monitor.foreign_cores(),
    )


def run_trtpaged(engine_dir: str, requests: list[Request], name: str = "trtpaged", enable_prefix_caching: bool = True,
                 rounds: int = 1, speculative_config: Optional[dict] = None, sequential: bool = False,
                 say: Callable[[str], None] = lambda _m: None) -> SystemResult:  # fmt: skip
    """All requests submitted at t=0 to one LLMEngine (`sequential`: each once the one before finished);
    times each request's tokens as steps return them (TTFT from the request's submission).

    rounds > 1: the workload again, on fresh prompts of the same shapes, `rounds - 1` more times in this
    process; the result is the first round's, with every round's wall in `round_walls`.
    `speculative_config`: with speculative decoding; the result's notes give its acceptance."""
    from trtpaged import kernels
    from trtpaged.runtime.llm import LLM
    from trtpaged.runtime.sampling_params import SamplingParams

    llm = LLM(engine_dir, enable_prefix_caching=enable_prefix_caching, speculative_config=speculative_config)
    if rounds == 1:
        # warm-up shorter than the smallest block (4 + 3 tokens < 8): it leaves nothing in the prefix cache.
        # With rounds > 1 there is none: the first round is the first batch after LLM(...) returned.
        llm.generate([list(requests[0].prompt_ids[:4])], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    spec_before = _spec_counters(llm.engine.stats())
    result = _timed_round(llm.engine, requests, name, say, "bench", sequential)
    if speculative_config is not None:
        result.notes.append(_spec_note(llm.engine.stats(), spec_before))
    result.isa = f"kernels {kernels.describe_cpu_isa()}" if kernels.available() else "no kernel library (torch ops)"
    result = later_rounds(result, requests, llm.manifest.dims.vocab_size, rounds, say,
                          lambda work, r: _timed_round(llm.engine, work, name, say, f"bench-r{r}", sequential))
    if sequential or len(requests) == 1:
        limit = streaming_limit.measure(llm.engine.runner, lambda m: say(f"{name}: {m}"))
        if limit is not None:
            result.weight_bytes_per_step, result.read_gbs = limit.weight_bytes, limit.read_gbs
    return result


def later_rounds(result: SystemResult, requests: list[Request], vocab_size: int, rounds: int,
                 say: Callable[[str], None], timed: Callable[[list[Request], int], SystemResult]) -> SystemResult:
    """`result` (a row's first round of `requests`) with every round's wall in `round_walls`: `timed(work, r)` runs
    round r = 1 .. rounds - 1 on fresh prompts of the same shapes (no prefix-cache hits between rounds); the row's
    load is its noisiest round's."""
    result.round_walls = [result.wall_s]
    for r in range(1, rounds):
        say(f"{result.name}: round {r + 1}/{rounds} (fresh prompts, same shapes)")
        again = timed(fresh_prompts(requests, vocab_size, 1000 + r), r)
        result.round_walls.append(again.wall_s)
        if again.foreign_cores is not None:
            result.foreign_cores = max(result.foreign_cores or 0.0, again.foreign_cores)
    return result


def _spec_counters(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.startswith("spec_decode_num_") and "_per_pos_" not in k}


def _spec_note(stats: dict, before: dict) -> str:
    """The speculation counters of a run (`stats` less `before`) in one line."""
    spec = {k: v - before.get(k, 0) for k, v in _spec_counters(stats).items()}
    drafts, proposed, accepted = (spec.get(f"spec_decode_num_{k}", 0)
                                  for k in ("drafts", "draft_tokens", "accepted_tokens"))  # fmt: skip
    rate, length = accepted / proposed if proposed else 0.0, 1 + accepted / drafts if drafts else 0.0
    return (f"speculation: {drafts} drafts, {proposed} tokens proposed, {accepted} accepted (rate {rate:.2f}, "
            f"mean acceptance length {length:.2f}), off for the batch size in "
            f"{spec.get('spec_decode_num_steps_disabled', 0)} steps")  # fmt: skip


def _timed_round(engine, requests: list[Request], name: str, say: Callable[[str], None], tag: str,
                 sequential: bool = False) -> SystemResult:  # fmt: skip
    """One round: every request added at t=0 (`sequential`: each once the one before is done), steps until all
    are done; request ids `tag-i`. TTFT counts from a request's submission."""
    from trtpaged.runtime.sampling_params import SamplingParams

    before = engine.stats()
    computed_before, hits_before = int(before["num_tokens_computed"]), int(before["prefix_cache_hits_tokens"])
    token_times: dict[str, list[float]] = {}
    submitted: dict[str, float] = {}
    with NoiseMonitor() as monitor:
        start = time.perf_counter()
        steps = 0
        for batch in ([[r] for r in requests] if sequential else [requests]):
            for r in batch:
                request_id = f"{tag}-{len(submitted)}"
                params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                engine.add_request(list(r.prompt_ids), params, request_id=request_id)
                token_times[request_id] = []
                submitted[request_id] = time.perf_counter() - start
            while engine.has_unfinished():
                outs = engine.step()
                now = time.perf_counter() - start
                for out in outs:  # a request appears once per step in which it sampled a token (or a verified run)
                    if out.request_id in token_times:
                        token_times[out.request_id].append(now)
                steps += 1
                if steps % 25 == 0:
                    done = sum(len(t) for t in token_times.values())
                    say(f"{name}: step {steps}, {done} token steps")
        wall = time.perf_counter() - start
    after = engine.stats()
    computed = int(after["num_tokens_computed"]) - computed_before
    ttft = [t[0] - submitted[i] for i, t in token_times.items() if t]
    # per output token after the first (a verified run yields several tokens in one step)
    tpot = [(t[-1] - t[0]) / (r.output_len - 1) for t, r in zip(token_times.values(), requests) if r.output_len > 1]
    result = system_result(name, requests, wall, computed, ttft, tpot, monitor)
    result.prefix_hit_tokens = int(after["prefix_cache_hits_tokens"]) - hits_before
    return result


def run_hf(engine_dir: str, requests: list[Request], batch_size: int, prompt_lookup: Optional[int] = None,
           assistant_dir: Optional[str] = None, sequential: bool = False, rounds: int = 1,
           say: Callable[[str], None] = lambda _m: None) -> SystemResult:  # fmt: skip
    """transformers generate, static batches in submission order, left padding, greedy, EOS ignored. `rounds`: as
    `run_trtpaged`'s (the ratio's other side repeated as often, so that its spread is measured too).

    Assisted generation, one request at a time (HF takes no batch there): `prompt_lookup` tokens of prompt
    lookup (`prompt_lookup_num_tokens`), or with `assistant_dir` that engine's source model as the
    `assistant_model` proposing `prompt_lookup` tokens a round (a constant number). TTFT counts from t=0,
    or with `sequential` from the start of the request's batch (each arrives once the one before is done)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from trtpaged.manifest import read_manifest
    from trtpaged.models.hf import load_hf, spec_from_manifest

    manifest = read_manifest(engine_dir)
    hf = load_hf(spec_from_manifest(manifest), torch.float32)
    assisted: dict = {}
    if assistant_dir is not None:
        assistant = load_hf(spec_from_manifest(read_manifest(assistant_dir)), torch.float32).model
        assistant.generation_config.num_assistant_tokens = prompt_lookup or 4
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assisted = {"assistant_model": assistant}
    elif prompt_lookup:
        assisted = {"prompt_lookup_num_tokens": prompt_lookup}
    if assisted:
        batch_size = 1
    isa = f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    model = hf.model
    pad_id = hf.tokenizer.pad_token_id if hf.tokenizer.pad_token_id is not None else 0

    class StepClock(LogitsProcessor):
        """Called once per generated position, right after the forward pass that produced its logits."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[Request]) -> list[float]:
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        new = max(r.output_len for r in batch)
        clock = StepClock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]), **assisted)  # fmt: skip
        return clock.times  # assisted: one call per verified position, so only the first and last count

    def timed(work: list[Request], _round: int = 0) -> SystemResult:
        ttft, tpot = [], []
        computed = 0
        with NoiseMonitor() as monitor:
            start = time.perf_counter()
            for b in range(0, len(work), batch_size):
                batch = work[b : b + batch_size]
                say(f"hf: batch {b // batch_size + 1}/{-(-len(work) // batch_size)} ({len(batch)} requests)")
                batch_start = time.perf_counter() - start
                times = [t - start for t in generate(batch)]
                steps = len(times)  # assisted: positions verified, accepted or not
                computed += len(batch) * (max(len(r.prompt_ids) for r in batch) + steps - 1)
                for r in batch:
                    ttft.append(times[0] - (batch_start if sequential else 0.0))
                    if r.output_len > 1:
                        last = times[-1] if assisted else times[r.output_len - 1]
                        tpot.append((last - times[0]) / (r.output_len - 1))
            wall = time.perf_counter() - start
        return system_result(hf_row_name(prompt_lookup, assistant_dir), work, wall, computed, ttft, tpot, monitor)

    generate([Request(requests[0].prompt_ids[:4], 3)])  # warm-up
    result = later_rounds(timed(requests), requests, manifest.dims.vocab_size, rounds, say, timed)
    result.isa = isa
    return result


def hf_row_name(prompt_lookup: Optional[int] = None, assistant_dir: Optional[str] = None) -> str:
    if assistant_dir is not None:
        return f"hf assistant_model ({Path(assistant_dir).name}, {prompt_lookup or 4} tokens)"
    return f"hf prompt lookup ({prompt_lookup} tokens)" if prompt_lookup else "hf transformers (static batches)"


def _child(kind: str, args: tuple, queue) -> None:
    try:
        if kind == "llamacpp":
            from trtpaged.bench.llamacpp import run_llamacpp as fn
        else:
            fn = run_hf if kind == "hf" else run_trtpaged
        queue.put(("ok", asdict(fn(*args, say=lambda m: print(f"  {m}", flush=True, file=sys.stderr)))))
    except BaseException as exc:  # noqa: BLE001  (report any failure to the parent, then exit)
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def run_isolated(kind: str, *args, time_limit: Optional[float] = None, name: str = "") -> SystemResult:
    """Runs one system in a fresh process: its own peak RSS, no state left by the others.

    The baselines (HF, llama.cpp) run with OpenMP's default waiting, as their users run them, not with the bounded
    spin trtpaged sets for itself on import (trtpaged/__init__.py). `time_limit`: after that many seconds
    the process is ended and the row (`name`) says it timed out, and the run goes on."""
    import queue as queues

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, args, queue))
    with _baseline_env(kind != "trtpaged"):
        proc.start()
    try:
        status, payload = queue.get(timeout=time_limit)
    except queues.Empty:
        proc.kill()
        proc.join()
        return timed_out_result(name or kind, float(time_limit or 0))
    proc.join()
    if status != "ok":
        raise RuntimeError(f"{kind} run failed: {payload}")
    return SystemResult(**payload)


@contextlib.contextmanager
def _baseline_env(active: bool):
    """While a baseline process starts: the environment without what trtpaged's import added."""
    import trtpaged

    saved = dict(os.environ)
    if active and os.environ.pop("TRTPAGED_SET_GOMP_SPINCOUNT", None):
        os.environ.pop("GOMP_SPINCOUNT", None)
        os.environ[trtpaged.OMP_DEFAULT_KEEP] = "1"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_throughput_bench(
    engine_dir: str,
    requests: list[Request],
    baseline: str = "hf",
    hf_batch_size: Optional[int] = None,
    no_prefix_caching_row: bool = False,
    engine2: Optional[str] = None,
    progress: Optional[Callable[[str], None]] = None,
    rounds: int = 1,
    speculative_config: Optional[dict] = None,
    sequential: bool = False,
    peer_time_limit: Optional[float] = None,
    llamacpp: Optional[LlamaCppRow] = None,
) -> dict:
    """Every system on the same requests; returns the JSON report (see module docstring). `peer_time_limit`:
    seconds each peer row (transformers, llama.cpp) may take; one that takes longer is reported as timed out.
    `llamacpp`: a llama.cpp row last (trtpaged.bench.llamacpp), up to the engine's max_batch_size sequences at once
    as trtpaged runs them, and the same rounds."""
    from trtpaged.manifest import read_manifest

    say = progress or (lambda _m: None)
    manifest = read_manifest(engine_dir)
    batch_size = 1 if sequential else hf_batch_size or manifest.limits.max_batch_size
    systems: list[SystemResult] = []
    say(f"trtpaged: {engine_dir}" + (" (one request at a time)" if sequential else ""))
    if rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds}")
    systems.append(run_isolated("trtpaged", engine_dir, requests, "trtpaged", True, rounds, None, sequential))
    spec_ratio = hf_spec_ratio = None
    if speculative_config is not None:
        method, k = speculative_config.get("method", "ngram"), speculative_config.get("num_speculative_tokens", 4)
        say(f"trtpaged, speculative decoding {speculative_config}")
        systems.append(run_isolated("trtpaged", engine_dir, requests, f"trtpaged ({method} speculation, {k} tokens)",
                                    True, rounds, speculative_config, sequential))  # fmt: skip
        spec_ratio = systems[-1].useful_tok_s / systems[0].useful_tok_s
    if no_prefix_caching_row:
        say("trtpaged, prefix caching off")
        systems.append(run_isolated("trtpaged", engine_dir, requests, "trtpaged (prefix caching off)", False, 1, None,
                                    sequential))  # fmt: skip
    if engine2:
        say(f"trtpaged: {engine2}")
        systems.append(run_isolated("trtpaged", engine2, requests, f"trtpaged ({Path(engine2).name})", True, rounds,
                                    None, sequential))  # fmt: skip
    if baseline == "hf" and speculative_config is not None:
        draft = speculative_config.get("model") if method == "draft_model" else None
        say(f"hf transformers generate, {'assistant_model ' + draft if draft else 'prompt lookup'} of {k} tokens, "
            "one request at a time")  # fmt: skip
        systems.append(run_isolated("hf", engine_dir, requests, 1, k, draft, sequential, rounds,
                                    time_limit=peer_time_limit, name=hf_row_name(k, draft)))  # fmt: skip
    if baseline == "hf":
        say(f"hf transformers generate, static batches of {batch_size}")
        systems.append(run_isolated("hf", engine_dir, requests, batch_size, None, None, sequential, rounds,
                                    time_limit=peer_time_limit, name=hf_row_name()))  # fmt: skip
        if speculative_config is not None and not (systems[-2].timed_out or systems[-1].timed_out):
            hf_spec_ratio = systems[-2].useful_tok_s / systems[-1].useful_tok_s
    hf = systems[-1] if baseline == "hf" else None
    if llamacpp is not None:
        from trtpaged.bench.llamacpp import NAME

        say(f"llama.cpp: {llamacpp.gguf}, {llamacpp.threads} threads")
        systems.append(run_isolated("llamacpp", llamacpp.gguf, requests, llamacpp.library,
                                    manifest.limits.max_batch_size, llamacpp.threads, rounds, sequential,
                                    time_limit=peer_time_limit, name=NAME))  # fmt: skip
    ratio = systems[0].useful_tok_s / hf.useful_tok_s if hf and not hf.timed_out else None
    llama = systems[-1] if llamacpp is not None and not systems[-1].timed_out else None
    noise = run_noise(systems)
    return {
        "engine": str(engine_dir),
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "hf_batch_size": batch_size if baseline == "hf" else None,
        "systems": [asdict(s) for s in systems],
        "ratio_vs_baseline": ratio,
        "ratio_vs_llamacpp": systems[0].useful_tok_s / llama.useful_tok_s if llama else None,
        "speculation_ratio": spec_ratio,  # trtpaged with / without speculation, useful tok/s
        "hf_assisted_ratio": hf_spec_ratio,  # hf assisted generation / hf plain, useful tok/s
        "sequential": sequential,
        "rounds": rounds,
        "peer_time_limit_s": peer_time_limit,
        "noise": noise.to_dict(),
    }


def run_noise(systems: Sequence[SystemResult]) -> Noise:
    """A run's noise: the spread of each system's rounds' walls (the repeats: from 3 rounds on the rounds after the
    first, which is the cold batch the report's "first / second" shows; with 2, both; one round is judged by the
    load alone) and the most other processes' load any system saw in any round."""
    loads = [s.foreign_cores for s in systems if s.foreign_cores is not None]
    spreads = [spread(s.round_walls[1:] if len(s.round_walls) > 2 else s.round_walls) for s in systems
               if len(s.round_walls) > 1]  # fmt: skip
    return assess(max(spreads, default=None), max(loads) if loads else None, multiprocessing.cpu_count())


def format_throughput_report(report: dict) -> str:
    """Human-readable table of run_throughput_bench's report."""
    lines = [
        f"trtpaged throughput benchmark: {report['requests']} requests, {report['prompt_tokens']} prompt tokens, "
        f"{report['output_tokens']} output tokens (EOS ignored), "
        + ("one request at a time" if report.get("sequential") else "all submitted at t=0"),
        "",
        f"{'system':<34} {'useful tok/s':>12} {'computed tok/s':>14} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'peak RSS MiB':>12}",
    ]
    for s in report["systems"]:
        if s.get("timed_out"):
            lines.append(f"{s['name']:<34} {'timed out':>12}")
            continue
        lines.append(
            f"{s['name']:<34} {s['useful_tok_s']:>12.1f} {s['computed_tok_s']:>14.1f} {s['wall_s']:>8.1f} "
            f"{s['ttft_p50_s']:>8.2f}s {s['ttft_p99_s']:>8.2f}s {s['tpot_p50_s'] * 1e3:>7.1f}ms "
            f"{s['tpot_p99_s'] * 1e3:>7.1f}ms {s['peak_rss_mb']:>12.0f}"
        )
    lines += ["", "instruction sets:"] + [f"  {s['name']}: {s.get('isa') or 'not reported'}" for s in report["systems"]]
    prompt_tokens = report["prompt_tokens"] or 1
    lines += [f"{s['name']}: prefix cache: {s['prefix_hit_tokens']} prompt tokens found cached "
              f"({s['prefix_hit_tokens'] / prompt_tokens:.1%})"
              for s in report["systems"] if s.get("prefix_hit_tokens")]  # fmt: skip
    for s in report["systems"]:
        walls = s.get("round_walls") or []
        if len(walls) > 1:
            shown = ", ".join(f"{w:.2f}" for w in walls)
            lines.append(f"{s['name']}: rounds on fresh prompts of the same shapes, wall s {shown}; "
                         f"first / second {walls[0] / walls[1]:.2f}")
    noise = Noise(**report["noise"])
    lines += ["", "useful: requested output tokens / wall; computed: every token position run through the model "
              "(prompts, padding, decode past a request's end) / wall", noise.describe()]  # fmt: skip

    def ratio(value: float) -> str:
        if not noise.trustworthy:
            return f"{value:.2f}x (noisy run: indicative only, rerun on a quieter machine)"
        if noise.max_spread is None:
            return f"{value:.2f}x (one round: how much it varies was not measured; --rounds 3 repeats it)"
        return f"{value:.2f}x"

    if report["ratio_vs_baseline"] is not None:
        lines.append(f"trtpaged / hf useful tok/s: {ratio(report['ratio_vs_baseline'])}  "
                     f"(hf static batches of {report['hf_batch_size']})")  # fmt: skip
    if report.get("ratio_vs_llamacpp") is not None:
        lines.append(f"trtpaged / llama.cpp useful tok/s: {ratio(report['ratio_vs_llamacpp'])}")
    if report.get("speculation_ratio") is not None:
        hf = report.get("hf_assisted_ratio")
        lines.append(f"speculation: trtpaged with / without {report['speculation_ratio']:.2f}x"
                     + (f", hf assisted / hf plain {hf:.2f}x" if hf is not None else ""))  # fmt: skip
    for s in report["systems"]:
        lines += [f"{s['name']}: {note}" for note in s.get("notes", [])]
        if s.get("weight_bytes_per_step") and s.get("read_gbs") and not math.isnan(s["tpot_p50_s"]):
            limit = streaming_limit.StreamingLimit(s["weight_bytes_per_step"], s["read_gbs"])
            lines.append(f"{s['name']}: {limit.describe(s['tpot_p50_s'])}")
    return "\n".join(lines)
