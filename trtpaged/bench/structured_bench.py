"""`trtpaged bench structured ENGINE`: what constraining half of a decode batch with a JSON schema costs.

In one run, alternating rounds on the same engine and prompts: a batch of N requests decoding
unconstrained, and the same batch with half its rows under a JSON schema (xgrammar). Each round
times the engine steps in which all N sequences decode (prefill steps and steps after any sequence
finished are left out) and keeps the median; the ratio is constrained / unconstrained per round,
median over rounds. The schema's first compile is timed apart (it is paid once per distinct schema).
Target (issue 23): at most 10% more time per step.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from trtpaged.bench.noise import Noise, NoiseMonitor, interval_verdict
from trtpaged.runtime.sampling_params import SamplingParams, StructuredOutputsParams

TARGET = 1.10  # constrained step time / unconstrained step time
# A schema whose outputs run long (an array of at least 64 records), so that constrained rows keep decoding.
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 64, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "tags"]}}},
    "required": ["records"],
}  # fmt: skip


def _prompts(n: int) -> list[str]:
    return [f"Record {i}: list the people of the village as JSON, with their names, ages and tags." for i in range(n)]


def _decode_step_times(llm: Any, prompts: list[str], params: list[SamplingParams], steps: int) -> list[float]:
    """Times of the first `steps` engine steps in which every request's one sequence decodes."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    times: list[float] = []
    try:
        while engine.has_unfinished() and len(times) < steps:
            decoding = (len(engine.scheduler.running) == len(ids) and not engine.scheduler.waiting
                        and all(g.is_decoding() for g in engine.scheduler.running))  # fmt: skip
            start = time.perf_counter()
            engine.step()
            if decoding:
                times.append(time.perf_counter() - start)
            elif times:  # a sequence finished: the batch is no longer N
                break
    finally:
        for request_id in ids:
            engine.abort(request_id)
    return times


DEFAULT_BATCH = 16


def run_structured_bench(engine_dir: Path, batch: Optional[int] = None, steps: int = 32, repeats: int = 5,
                         temperature: float = 0.0,
                         progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:  # fmt: skip
    """The report (a dict): per-round median step times, the ratio and its verdict, compile time, load. `batch`:
    requests decoding together (None: DEFAULT_BATCH, or the engine's max_batch_size when that is smaller)."""
    from trtpaged.runtime.llm import LLM

    llm = LLM(engine_dir)
    if batch is None:
        batch = min(DEFAULT_BATCH, llm.config.max_batch_size)
    if batch > llm.config.max_batch_size:
        raise ValueError(f"--batch: {batch} exceeds the engine's max_batch_size ({llm.config.max_batch_size})")
    prompts = _prompts(batch)
    grammar = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    llm.engine.grammars.prepare()
    vocab_seconds = time.perf_counter() - start
    start = time.perf_counter()
    llm.engine.grammars.compile(grammar)
    compile_seconds = time.perf_counter() - start
    common = dict(max_tokens=steps + 8, temperature=temperature, seed=0, ignore_eos=True)
    plain = [SamplingParams(**common) for _ in prompts]  # type: ignore[arg-type]
    mixed = [SamplingParams(**common, structured_outputs=grammar if i % 2 else None)  # type: ignore[arg-type]
             for i in range(batch)]  # fmt: skip
    _decode_step_times(llm, prompts, mixed, 4)  # warm-up: allocator, caches, xgrammar's matcher pools
    rounds: list[dict[str, float]] = []
    monitor = NoiseMonitor().start()
    for r in range(repeats):
        order = [("plain", plain), ("constrained", mixed)] if r % 2 == 0 else [("constrained", mixed), ("plain", plain)]
        medians: dict[str, float] = {}
        for name, params in order:
            times = _decode_step_times(llm, prompts, params, steps)
            if not times:
                raise RuntimeError(f"{name}: no step decoded the whole batch of {batch}")
            medians[name] = statistics.median(times)
            medians[f"{name}_steps"] = len(times)
        medians["ratio"] = medians["constrained"] / medians["plain"]
        rounds.append(medians)
        progress(f"round {r + 1}/{repeats}: unconstrained {medians['plain'] * 1e3:.2f} ms/step, half constrained "
                 f"{medians['constrained'] * 1e3:.2f} ms/step, ratio {medians['ratio']:.3f}")  # fmt: skip
    monitor.stop()
    # the verdict is on the interleaved ratio: from the interval of the median round (a VM whose speed drifts
    # between rounds moves both halves of a round together); the rounds' spread is reported beside it
    monitor.add_samples([r["ratio"] for r in rounds])
    noise = monitor.result()
    ratio = statistics.median(r["ratio"] for r in rounds)
    return {
        "engine": str(engine_dir), "batch": batch, "constrained_rows": batch // 2, "steps": steps,
        "temperature": temperature, "rounds": rounds, "ratio": ratio, "target": TARGET,
        "verdict": interval_verdict([r["ratio"] for r in rounds], TARGET, False, noise), "noise": noise.to_dict(),
        "loadavg": os.getloadavg(), "vocab_seconds": vocab_seconds, "first_compile_seconds": compile_seconds,
        "constrained_requests": llm.stats()["num_constrained_requests"],
    }  # fmt: skip


def format_structured(report: dict[str, Any]) -> str:
    """The report as text."""
    rounds = report["rounds"]
    lines = [
        f"structured outputs: batch {report['batch']} decode, {report['constrained_rows']} rows under a JSON schema "
        f"vs none (temperature {report['temperature']}), {len(rounds)} interleaved rounds",
        "  unconstrained ms/step: " + " / ".join(f"{r['plain'] * 1e3:.2f}" for r in rounds),
        "  half constrained ms/step: " + " / ".join(f"{r['constrained'] * 1e3:.2f}" for r in rounds),
        f"  ratio (median of rounds): {report['ratio']:.3f} (target <= {report['target']:.2f}): {report['verdict']}",
        f"  xgrammar vocabulary read {report['vocab_seconds']:.2f} s (once per server), first compile of the schema "
        f"{report['first_compile_seconds'] * 1e3:.1f} ms (once per schema)",
        "  loadavg " + " ".join(f"{x:.2f}" for x in report["loadavg"]),
        "  " + Noise(**report["noise"]).describe(),
    ]
    return "\n".join(lines)
