"""`bench throughput --profile`: where one step's time goes.

Two views of the same engine:
- phases of `LLMEngine.step()`: the runtime's own cumulative `phase_seconds` (schedule, prepare,
  model, sample, update, output) when it has them; otherwise the whole step timed from outside,
  split into the backend's model call and everything else around it;
- ops of the model forward: torch.profiler over a few pure decode steps at batch 1 and batch 16,
  top ops by self CPU time per step, with the kernel library's ctypes calls (one-call decoder
  layers, quantized linears, paged attention, fused ops, greedy choice) timed alongside, since
  the profiler does not see them.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

from trtpaged.bench.noise import Noise, NoiseMonitor

PROFILED_STEPS = 5


def _add_decoders(llm, batch: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    from trtpaged.runtime.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = llm.manifest.dims.vocab_size
    for i in range(batch):
        ids = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        llm.engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               request_id=f"profile-{seed}-{i}")  # fmt: skip


def _drain(llm) -> None:
    while llm.engine.has_unfinished():
        llm.engine.step()


def _timed_model_call(llm) -> tuple[list[float], Callable[[], None]]:
    """Wraps the backend's step to time the model call; returns the timings and an undo."""
    backend = llm.engine.runner
    original = backend.step
    times: list[float] = []

    def step(batch):
        t0 = time.perf_counter()
        logits = original(batch)
        times.append(time.perf_counter() - t0)
        return logits

    backend.step = step
    return times, lambda: setattr(backend, "step", original)


def phase_breakdown(llm, batch: int, steps: int = 20, prompt_len: int = 64,
                    noise: Optional[NoiseMonitor] = None) -> dict:  # fmt: skip
    """Seconds per decode step by phase, for `batch` sequences decoding (each step's time goes to `noise`)."""
    _add_decoders(llm, batch, prompt_len, steps + 2, seed=batch)
    llm.engine.step()  # the prefill step
    phases_before = dict(getattr(llm.engine, "phase_seconds", None) or {})
    model_times, undo = _timed_model_call(llm)
    step_times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.engine.step()
        step_times.append(time.perf_counter() - t)
    total = sum(step_times)
    if noise is not None:
        noise.add_samples(step_times)
    undo()
    _drain(llm)
    phases_after = getattr(llm.engine, "phase_seconds", None)
    if phases_after is not None:
        per_step = {k: (v - phases_before.get(k, 0.0)) / steps for k, v in phases_after.items()}
        source = "LLMEngine.phase_seconds"
    else:
        model = sum(model_times) / steps
        per_step = {"model (backend step)": model, "rest of step (schedule, prepare, sample, update, output)":
                    total / steps - model}  # fmt: skip
        source = "timed from outside: LLMEngine has no phase_seconds, so only model vs the rest of the step"
    return {"batch": batch, "step_s": total / steps, "phases_s": per_step, "source": source}


# The kernel library's entry points the eager model calls through ctypes: torch.profiler does not see
# them, so op_breakdown times them itself (while profiling only) and lists them as "kernel: ..." rows.
_KERNEL_METHODS = (("LlamaLayers", "__call__", "decoder layers (one call)"), ("QLinearOp", "__call__", "qlinear"),
                   ("AttentionStep", "__call__", "paged attention"))  # fmt: skip
_KERNEL_FUNCTIONS = ("rmsnorm", "rope_qk", "silu_mul", "greedy_rows")


def _timed_kernels() -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Wraps the kernels module's entry points with timers; returns {name: [seconds, calls]} and an undo."""
    from trtpaged import kernels

    totals: dict[str, list[float]] = {}
    undo: list[Callable[[], None]] = []

    def timed(fn: Callable, name: str) -> Callable:
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = totals.setdefault(name, [0.0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1

        return call

    for cls_name, method, label in _KERNEL_METHODS:
        cls = getattr(kernels, cls_name, None)
        if cls is not None:
            original = cls.__dict__[method]
            setattr(cls, method, timed(original, label))
            undo.append(lambda cls=cls, method=method, original=original: setattr(cls, method, original))
    for name in _KERNEL_FUNCTIONS:
        original = getattr(kernels, name, None)
        if original is not None:
            setattr(kernels, name, timed(original, name))
            undo.append(lambda name=name, original=original: setattr(kernels, name, original))
    return totals, lambda: [u() for u in undo]


def op_breakdown(llm, batch: int, steps: int = PROFILED_STEPS, top: int = 12, prompt_len: int = 64) -> dict:
    """Top ops by self CPU time per decode step (torch.profiler, plus the kernel library's calls, which
    it does not see), for `batch` sequences decoding."""
    from torch.profiler import ProfilerActivity, profile

    _add_decoders(llm, batch, prompt_len, steps + 4, seed=1000 + batch)
    llm.engine.step()  # prefill
    llm.engine.step()  # one decode step unprofiled (first-call costs)
    model_times, undo = _timed_model_call(llm)
    kernel_times, undo_kernels = _timed_kernels()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
    undo_kernels()
    undo()
    _drain(llm)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events]
    rows += [(f"kernel: {name}", seconds, calls) for name, (seconds, calls) in kernel_times.items()]
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    ops = [{"op": name, "self_ms_per_step": seconds * 1e3 / steps, "share": seconds / total if total else 0.0,
            "calls_per_step": calls / steps} for name, seconds, calls in rows[:top]]  # fmt: skip
    total_us = total * 1e6
    return {"batch": batch, "model_ms_per_step": sum(model_times) / steps * 1e3,
            "profiled_ms_per_step": total_us / 1e3 / steps, "ops": ops}  # fmt: skip


def run_step_profile(engine_dir: str, batches: tuple[int, ...] = (1, 16),
                     say: Callable[[str], None] = lambda _m: None) -> dict:  # fmt: skip
    """Phase and op breakdowns of decode steps at each batch size."""
    from trtpaged.runtime.llm import LLM

    llm = LLM(engine_dir)
    _add_decoders(llm, 1, 16, 4, seed=7)
    _drain(llm)  # warm-up
    report: dict = {"engine": engine_dir, "phases": [], "ops": []}
    with NoiseMonitor() as monitor:
        for batch in batches:
            say(f"profile: phases, batch {batch}")
            report["phases"].append(phase_breakdown(llm, batch, noise=monitor))
            say(f"profile: ops, batch {batch}")
            report["ops"].append(op_breakdown(llm, batch))
    report["noise"] = monitor.result().to_dict()
    return report


def format_step_profile(report: dict) -> str:
    lines = ["where a decode step's time goes", "  " + Noise(**report["noise"]).describe()]
    for p in report["phases"]:
        lines.append(f"  batch {p['batch']}: {p['step_s'] * 1e3:.1f} ms/step  [{p['source']}]")
        for name, seconds in p["phases_s"].items():
            lines.append(f"    {name:<58} {seconds * 1e3:>8.2f} ms {seconds / p['step_s']:>6.1%}")
    for o in report["ops"]:
        lines += ["", f"  model forward ops, batch {o['batch']} decode (torch.profiler and kernel-library calls, "
                      f"self CPU per step; model call {o['model_ms_per_step']:.1f} ms, "
                      f"profiled total {o['profiled_ms_per_step']:.1f} ms):"]  # fmt: skip
        for op in o["ops"]:
            lines.append(f"    {op['op'][:48]:<48} {op['self_ms_per_step']:>8.2f} ms {op['share']:>6.1%} "
                         f"{op['calls_per_step']:>6.0f} calls")  # fmt: skip
    return "\n".join(lines)
