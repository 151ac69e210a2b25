"""`trtpaged bench throughput`: one set of requests through trtpaged and through the baseline users run today.

Side by side, in one run, on the same requests (token ids; EOS ignored so every output has
exactly its requested length):

- trtpaged: every request submitted at t=0 to `LLM(engine).engine`, continuous batching;
- hf: transformers `generate` on the engine's source model with static batches of up to
  `hf_batch_size` requests in submission order: prompts left-padded to the batch's longest,
  and the batch decodes until its longest output is done (greedy);
- optional rows: trtpaged with prefix caching off, a second engine dir (e.g. fp32 vs quantized), and
  trtpaged with speculative decoding (`speculative_config`) next to transformers' own assisted
  generation with prompt lookup (`prompt_lookup_num_tokens`, one request at a time: HF supports no
  batch there) as its peer.

`sequential` runs one request at a time (single-stream decode) in every system instead of all at t=0.

Each system runs in its own process (so peak RSS is its own), after a one-request warm-up.
Per system: useful output tok/s (requested output tokens / wall), computed tok/s (every token
position run through the model, prompts, padding and decode steps past a request's end
included / wall), wall time, TTFT (from t=0, queueing included) and per-output-token latency
(p50/p99 over requests), peak RSS, and the noise of the run (trtpaged.bench.noise).
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from trtpaged.bench.noise import NoiseMonitor, assess
from trtpaged.bench.workload import TraceRequest, load_trace, prompt_token_ids, synthetic_trace

DEFAULT_MIX = {"num_requests": 16, "prompt_len": (32, 300), "output_len": (16, 240)}


@dataclass(frozen=True)
class Request:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: tuple[int, ...]
    output_len: int


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


def requests_from_trace(trace: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[Request]:
    """Token ids for a memory-bench trace (shared prefixes identical); n and beam_width are not used here."""
    ids = prompt_token_ids(trace, vocab=vocab_size, seed=seed)
    return [Request(tuple(p), r.output_len) for p, r in zip(ids, trace)]


def load_requests(path: str | Path, tokenizer: Callable[[str], list[int]], vocab_size: int) -> list[Request]:
    """A trace (lines with prompt_len) or a prompts file: lines {"prompt": text, "output_len": N}.

    Errors name the line and the field.
    """
    lines = [(i, line) for i, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no requests")
    try:
        first = json.loads(lines[0][1])
    except ValueError as exc:
        raise ValueError(f"{path}:{lines[0][0]}: {exc}") from exc
    if not (isinstance(first, dict) and "prompt" in first):
        return requests_from_trace(load_trace(path), vocab_size)
    out = []
    for lineno, line in lines:
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            unknown = set(data) - {"prompt", "output_len"}
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}; allowed: ['output_len', 'prompt']")
            prompt, output_len = data.get("prompt"), data.get("output_len")
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompt: must be a non-empty string, got {prompt!r}")
            if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
                raise ValueError(f"output_len: must be an integer >= 1, got {output_len!r}")
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
        out.append(Request(tuple(tokenizer(prompt)), output_len))
    return out


# ---- systems ----------------------------------------------------------------------------------
def _result(name: str, requests: list[Request], wall: float, computed: int, ttft: list[float],
            tpot: list[float], monitor: NoiseMonitor) -> SystemResult:  # fmt: skip
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
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        useful_tokens=useful,
        computed_tokens=computed,
        foreign_cores=monitor.foreign_cores(),
    )


def run_trtpaged(engine_dir: str, requests: list[Request], name: str = "trtpaged", enable_prefix_caching: bool = True,
                 speculative_config: Optional[dict] = None, sequential: bool = False,
                 say: Callable[[str], None] = lambda _m: None) -> SystemResult:  # fmt: skip
    """All requests submitted at t=0 to one LLMEngine (`sequential`: each once the one before finished);
    times each request's tokens as steps return them (TTFT from its submission)."""
    from trtpaged.runtime.llm import LLM
    from trtpaged.runtime.sampling_params import SamplingParams

    llm = LLM(engine_dir, enable_prefix_caching=enable_prefix_caching, speculative_config=speculative_config)
    # warm-up shorter than the smallest block (4 + 3 tokens < 8): it leaves nothing in the prefix cache
    llm.generate([list(requests[0].prompt_ids[:4])], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine = llm.engine
    computed_before = int(engine.stats()["num_tokens_computed"])
    token_times: dict[str, list[float]] = {}
    submitted: dict[str, float] = {}
    spec_before = {k: v for k, v in engine.stats().items() if k.startswith("spec_decode_num_")}
    with NoiseMonitor() as monitor:
        start = time.perf_counter()
        steps = 0
        for batch in ([[r] for r in requests] if sequential else [requests]):
            for r in batch:
                request_id = f"bench-{len(submitted)}"
                params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                engine.add_request(list(r.prompt_ids), params, request_id=request_id)
                token_times[request_id] = []
                submitted[request_id] = time.perf_counter() - start
            while engine.has_unfinished():
                outs = engine.step()
                now = time.perf_counter() - start
                for out in outs:  # a request appears once per step in which it sampled a token (or a run)
                    if out.request_id in token_times:
                        token_times[out.request_id].append(now)
                steps += 1
                if steps % 25 == 0:
                    done = sum(len(t) for t in token_times.values())
                    say(f"{name}: step {steps}, {done} token steps")
        wall = time.perf_counter() - start
    stats = engine.stats()
    computed = int(stats["num_tokens_computed"]) - computed_before
    ttft = [t[0] - submitted[i] for i, t in token_times.items() if t]
    tpot = [(t[-1] - t[0]) / (r.output_len - 1) for t, r in zip(token_times.values(), requests) if r.output_len > 1]
    result = _result(name, requests, wall, computed, ttft, tpot, monitor)
    if speculative_config is not None:
        spec = {k: stats[k] - spec_before.get(k, 0) for k in spec_before}
        drafts, proposed, accepted = (spec[f"spec_decode_num_{k}"]
                                      for k in ("drafts", "draft_tokens", "accepted_tokens"))  # fmt: skip
        result.notes.append(f"speculation: {drafts} drafts, {proposed} tokens proposed, {accepted} accepted "
                            f"(rate {accepted / proposed if proposed else 0:.2f}, mean accepted length "
                            f"{1 + accepted / drafts if drafts else 0:.2f}), off in "
                            f"{stats['spec_decode_num_steps_disabled']} steps for the batch size")  # fmt: skip
    return result


def run_hf(engine_dir: str, requests: list[Request], batch_size: int, prompt_lookup: Optional[int] = None,
           sequential: bool = False, say: Callable[[str], None] = lambda _m: None) -> SystemResult:  # fmt: skip
    """transformers generate, static batches in submission order, left padding, greedy, EOS ignored.

    `prompt_lookup`: transformers' assisted generation with prompt lookup of that many tokens
    (`prompt_lookup_num_tokens`), one request at a time (it takes no batch). TTFT counts from t=0, or with
    `sequential` from the start of the request's batch (each arrives once the one before is done)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from trtpaged.manifest import read_manifest
    from trtpaged.models.hf import load_hf, spec_from_manifest

    hf = load_hf(spec_from_manifest(read_manifest(engine_dir)), torch.float32)
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
        assisted = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]), **assisted)  # fmt: skip
        return clock.times  # with prompt lookup: one call per verified position, so only the first and last count

    if prompt_lookup:
        batch_size = 1
    generate([Request(requests[0].prompt_ids[:4], 3)])  # warm-up
    ttft, tpot = [], []
    computed = 0
    with NoiseMonitor() as monitor:
        start = time.perf_counter()
        for b in range(0, len(requests), batch_size):
            batch = requests[b : b + batch_size]
            say(f"hf: batch {b // batch_size + 1}/{-(-len(requests) // batch_size)} ({len(batch)} requests)")
            batch_start = time.perf_counter() - start
            times = [t - start for t in generate(batch)]
            steps = len(times)  # with prompt lookup: positions verified, accepted or not
            computed += len(batch) * (max(len(r.prompt_ids) for r in batch) + steps - 1)
            for r in batch:
                ttft.append(times[0] - (batch_start if sequential else 0.0))
                if r.output_len > 1:
                    tpot.append((times[-1] - times[0]) / (r.output_len - 1) if prompt_lookup else
                                (times[r.output_len - 1] - times[0]) / (r.output_len - 1))  # fmt: skip
        wall = time.perf_counter() - start
    name = f"hf prompt lookup ({prompt_lookup} tokens)" if prompt_lookup else "hf transformers (static batches)"
    return _result(name, requests, wall, computed, ttft, tpot, monitor)


def _child(kind: str, args: tuple, queue) -> None:
    try:
        fn = run_hf if kind == "hf" else run_trtpaged
        queue.put(("ok", asdict(fn(*args, say=lambda m: print(f"  {m}", flush=True, file=sys.stderr)))))
    except BaseException as exc:  # noqa: BLE001  (report any failure to the parent, then exit)
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def run_isolated(kind: str, *args) -> SystemResult:
    """Runs one system in a fresh process: its own peak RSS, no state left by the others.

    The HF baseline runs with OpenMP's default waiting, as its users run it, not with the bounded
    spin trtpaged sets for itself on import (trtpaged/__init__.py)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(kind, args, queue))
    with _baseline_env(kind == "hf"):
        proc.start()
    status, payload = queue.get()
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
    speculative_config: Optional[dict] = None,
    sequential: bool = False,
) -> dict:
    """Every system on the same requests; returns the JSON report (see module docstring)."""
    from trtpaged.manifest import read_manifest

    say = progress or (lambda _m: None)
    manifest = read_manifest(engine_dir)
    batch_size = 1 if sequential else hf_batch_size or manifest.limits.max_batch_size
    systems: list[SystemResult] = []
    say(f"trtpaged: {engine_dir}" + (" (one request at a time)" if sequential else ""))
    systems.append(run_isolated("trtpaged", engine_dir, requests, "trtpaged", True, None, sequential))
    spec_ratio = None
    if speculative_config is not None:
        k = speculative_config.get("num_speculative_tokens", 4)
        say(f"trtpaged, speculative decoding {speculative_config}")
        systems.append(run_isolated("trtpaged", engine_dir, requests, f"trtpaged (speculative, {k} tokens)", True,
                                    speculative_config, sequential))  # fmt: skip
        spec_ratio = systems[-1].useful_tok_s / systems[0].useful_tok_s
    if no_prefix_caching_row:
        say("trtpaged, prefix caching off")
        systems.append(run_isolated("trtpaged", engine_dir, requests, "trtpaged (prefix caching off)", False, None,
                                    sequential))  # fmt: skip
    if engine2:
        say(f"trtpaged: {engine2}")
        systems.append(run_isolated("trtpaged", engine2, requests, f"trtpaged ({Path(engine2).name})", True, None,
                                    sequential))  # fmt: skip
    hf_spec_ratio = None
    if baseline == "hf" and speculative_config is not None:
        k = speculative_config.get("num_speculative_tokens", 4)
        say(f"hf transformers generate, prompt lookup of {k} tokens, one request at a time")
        systems.append(run_isolated("hf", engine_dir, requests, 1, k, sequential))
    if baseline == "hf":
        say(f"hf transformers generate, static batches of {batch_size}")
        systems.append(run_isolated("hf", engine_dir, requests, batch_size, None, sequential))
        if speculative_config is not None:
            hf_spec_ratio = systems[-2].useful_tok_s / systems[-1].useful_tok_s
    ratio = systems[0].useful_tok_s / systems[-1].useful_tok_s if baseline == "hf" else None
    loads = [s.foreign_cores for s in systems if s.foreign_cores is not None]
    noise = assess(0.0, max(loads) if loads else None, multiprocessing.cpu_count())
    return {
        "engine": str(engine_dir),
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "hf_batch_size": batch_size if baseline == "hf" else None,
        "systems": [asdict(s) for s in systems],
        "ratio_vs_baseline": ratio,
        "speculation_ratio": spec_ratio,  # trtpaged with / without speculation, useful tok/s
        "hf_prompt_lookup_ratio": hf_spec_ratio,  # hf prompt lookup / hf plain, useful tok/s
        "sequential": sequential,
        "noise": noise.to_dict(),
    }


def format_throughput_report(report: dict) -> str:
    """Human-readable table of run_throughput_bench's report."""
    from trtpaged.bench.noise import Noise

    lines = [
        f"trtpaged throughput benchmark: {report['requests']} requests, {report['prompt_tokens']} prompt tokens, "
        f"{report['output_tokens']} output tokens (EOS ignored), all submitted at t=0",
        "",
        f"{'system':<34} {'useful tok/s':>12} {'computed tok/s':>14} {'wall s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'peak RSS MB':>12}",
    ]
    for s in report["systems"]:
        lines.append(
            f"{s['name']:<34} {s['useful_tok_s']:>12.1f} {s['computed_tok_s']:>14.1f} {s['wall_s']:>8.1f} "
            f"{s['ttft_p50_s']:>8.2f}s {s['ttft_p99_s']:>8.2f}s {s['tpot_p50_s'] * 1e3:>7.1f}ms "
            f"{s['tpot_p99_s'] * 1e3:>7.1f}ms {s['peak_rss_mb']:>12.0f}"
        )
    noise = Noise(**report["noise"])
    lines += ["", "useful: requested output tokens / wall; computed: every token position run through the model "
              "(prompts, padding, decode past a request's end) / wall", noise.describe()]  # fmt: skip
    if report["ratio_vs_baseline"] is not None:
        ratio = f"{report['ratio_vs_baseline']:.2f}x"
        if not noise.trustworthy:
            ratio += " (noisy run: indicative only, rerun on a quieter machine)"
        lines.append(f"trtpaged / hf useful tok/s: {ratio}  (hf static batches of {report['hf_batch_size']})")
    if report.get("speculation_ratio") is not None:
        lines.append(f"speculation: trtpaged with / without {report['speculation_ratio']:.2f}x"
                     + (f", hf prompt lookup / hf plain {report['hf_prompt_lookup_ratio']:.2f}x"
                        if report.get("hf_prompt_lookup_ratio") is not None else ""))  # fmt: skip
    for s in report["systems"]:
        lines += [f"{s['name']}: {note}" for note in s.get("notes", [])]
    return "\n".join(lines)
