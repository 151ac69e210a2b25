"""`trtpaged bench memory`: how many sequences fit in one KV budget, paged vs contiguous.

One workload (a trace or a synthetic mix) is replayed side by side under four policies
with the same KV budget, step limits and FCFS admission:

- contiguous, reserve max_seq_len: each sequence reserves max_seq_len slots on admission
  (a static, unpaged cache, as FasterTransformer-style servers do);
- contiguous, reserve exact: each sequence reserves prompt + its true output length, an
  oracle no real server has (the strongest unpaged baseline);
- paged: trtpaged's real scheduler and block pool (prefix caching off), driven by an engine
  that runs no model;
- paged + sharing: the same with prefix caching and parallel samples sharing prompt blocks.

Per policy, measured during each step (blocks of the step allocated, finished sequences not yet
freed): steps to finish, peak and mean running sequences, and KV utilisation (tokens stored /
slots held, averaged over steps).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from trtpaged.bench.null_engine import NullEngine
from trtpaged.bench.workload import TraceRequest, prompt_token_ids
from trtpaged.runtime.engines.base import StepBatch
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class Budget:
    """The KV budget and step limits every policy gets."""

    num_blocks: int
    block_size: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class PolicyResult:
    policy: str
    steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    mean_utilisation: float = 0.0
    preemptions: int = 0
    refused: int = 0
    running: list[int] = field(default_factory=list, repr=False)
    utilisation: list[float] = field(default_factory=list, repr=False)

    def record(self, running: int, tokens: int, slots: int) -> None:
        self.running.append(running)
        if slots:
            self.utilisation.append(tokens / slots)

    def finish(self) -> "PolicyResult":
        self.steps = len(self.running)
        self.peak_running = max(self.running, default=0)
        self.mean_running = statistics.fmean(self.running) if self.running else 0.0
        self.mean_utilisation = statistics.fmean(self.utilisation) if self.utilisation else 0.0
        return self


@dataclass
class _ContiguousSeq:
    prompt_len: int
    output_len: int
    reserved: int
    generated: int = 0


def simulate_contiguous(trace: list[TraceRequest], budget: Budget, reserve: str) -> PolicyResult:
    """Replays the trace with per-sequence contiguous reservations ('max_seq_len' or 'exact')."""
    result = PolicyResult(f"contiguous, reserve {reserve}")
    pending = sorted(range(len(trace)), key=lambda i: (trace[i].arrival, i))
    waiting: list[TraceRequest] = []
    running: list[_ContiguousSeq] = []
    reserved = 0
    step = 0
    while pending or waiting or running:
        while pending and trace[pending[0]].arrival <= step:
            waiting.append(trace[pending.pop(0)])
        tokens_left = budget.max_num_tokens - len(running)
        admitted_any = False
        while waiting:
            req = waiting[0]
            per_seq = budget.max_seq_len if reserve == "max_seq_len" else min(budget.max_seq_len, req.prompt_len + req.output_len)
            need = per_seq * req.n
            if need > budget.capacity_tokens or req.n > budget.max_batch_size:
                waiting.pop(0)
                result.refused += 1
                continue
            fits = reserved + need <= budget.capacity_tokens and len(running) + req.n <= budget.max_batch_size
            # a prompt longer than the step's token budget still runs, alone (as if chunked)
            if not fits or (req.prompt_len > tokens_left and admitted_any):
                break
            waiting.pop(0)
            running += [_ContiguousSeq(req.prompt_len, req.output_len, per_seq) for _ in range(req.n)]
            reserved += need
            tokens_left -= req.prompt_len
            admitted_any = True
        for seq in running:
            seq.generated += 1
        stored = sum(s.prompt_len + s.generated - 1 for s in running)
        result.record(len(running), stored, reserved)
        done = [s for s in running if s.generated >= min(s.output_len, budget.max_seq_len - s.prompt_len)]
        for s in done:
            reserved -= s.reserved
        running = [s for s in running if s not in done]
        step += 1
        if step > 10_000_000:
            raise RuntimeError("contiguous simulation did not finish")
    return result.finish()


def simulate_paged(trace: list[TraceRequest], budget: Budget, sharing: bool) -> PolicyResult:
    """Replays the trace through trtpaged's real scheduler and block pool (no model runs)."""
    config = RuntimeConfig(
        block_size=budget.block_size,
        num_blocks=budget.num_blocks,
        max_batch_size=budget.max_batch_size,
        max_num_tokens=budget.max_num_tokens,
        max_seq_len=budget.max_seq_len,
        enable_prefix_caching=sharing,
    )
    result = PolicyResult("paged + sharing" if sharing else "paged")

    def during_step(batch: StepBatch) -> None:
        # Blocks of this step are allocated and none freed yet; this step's tokens are being written.
        stats = engine.kv.stats(engine.scheduler.live_seqs())
        num_seqs = int(batch.query_start.shape[0]) - 1
        result.record(num_seqs, int(stats["kv_tokens_stored"]) + batch.num_tokens, int(stats["kv_slots_allocated"]))

    engine = LLMEngine(NullEngine(budget.num_blocks, on_step=during_step), config)
    prompts = prompt_token_ids(trace)
    # without sharing, parallel samples are separate requests: nothing is shared
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival, i))
    step = 0
    while order or engine.has_unfinished():
        while order and trace[order[0]].arrival <= step:
            i = order.pop(0)
            req = trace[i]
            copies = 1 if sharing else req.n
            params = SamplingParams(max_tokens=req.output_len, temperature=1.0, seed=i, ignore_eos=True,
                                    n=req.n if sharing else 1)  # fmt: skip
            for _ in range(copies):
                try:
                    engine.add_request(prompts[i], params)
                except ValueError:
                    result.refused += 1
        engine.step()
        step += 1
    result.preemptions = int(engine.stats()["num_preemptions"])
    return result.finish()


def run_memory_bench(
    trace: list[TraceRequest], budget: Budget, progress: Optional[Callable[[str], None]] = None
) -> dict:
    """All four policies on one trace; returns a JSON-able report with side-by-side ratios."""
    say = progress or (lambda _msg: None)
    results = []
    for name, run in (
        ("contiguous, reserve max_seq_len", lambda: simulate_contiguous(trace, budget, "max_seq_len")),
        ("contiguous, reserve exact", lambda: simulate_contiguous(trace, budget, "exact")),
        ("paged", lambda: simulate_paged(trace, budget, sharing=False)),
        ("paged + sharing", lambda: simulate_paged(trace, budget, sharing=True)),
    ):
        say(name)
        results.append(run())
    base = results[0]
    report = {
        "budget": asdict(budget),
        "requests": len(trace),
        "sequences": sum(r.n for r in trace),
        "policies": [
            {k: v for k, v in asdict(r).items() if k not in ("running", "utilisation")}
            | {
                "mean_running_vs_reserve_max": r.mean_running / base.mean_running if base.mean_running else None,
                "speedup_in_steps_vs_reserve_max": base.steps / r.steps if r.steps else None,
            }
            for r in results
        ],
    }
    return report


def format_memory_report(report: dict) -> str:
    b = report["budget"]
    lines = [
        f"trtpaged memory benchmark: {report['requests']} requests ({report['sequences']} sequences), "
        f"KV budget {b['num_blocks']} blocks x {b['block_size']} tokens = {b['num_blocks'] * b['block_size']:,} slots, "
        f"max_seq_len {b['max_seq_len']}, max_batch_size {b['max_batch_size']}, max_num_tokens {b['max_num_tokens']}",
        "",
        f"{'policy':<34} {'steps':>7} {'peak run':>9} {'mean run':>9} {'KV util':>8} {'run x':>6} {'steps x':>8} {'preempt':>8}",
    ]
    for p in report["policies"]:
        lines.append(
            f"{p['policy']:<34} {p['steps']:>7} {p['peak_running']:>9} {p['mean_running']:>9.1f} "
            f"{p['mean_utilisation']:>7.1%} {p['mean_running_vs_reserve_max']:>6.2f} "
            f"{p['speedup_in_steps_vs_reserve_max']:>8.2f} {p['preemptions']:>8}"
        )
    lines += ["", "run x / steps x: mean running sequences and steps-to-finish relative to reserving max_seq_len"]
    return "\n".join(lines)
