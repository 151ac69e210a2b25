"""`trtpaged bench memory`: how many sequences fit in one KV budget, paged vs contiguous.

One workload (a trace or a synthetic mix) is replayed side by side under four policies
with the same KV budget, step limits and FCFS admission:

- contiguous, reserve max_seq_len: each sequence reserves max_seq_len slots on admission
  (a static, unpaged cache, as FasterTransformer-style servers do);
- contiguous, reserve exact: each sequence reserves prompt + its true output length, an
  oracle no real server has (the strongest unpaged baseline);
- paged: trtpaged's real scheduler and block pool (prefix caching off), driven by an engine
  that runs no model;
- paged + sharing: the same with prefix caching, parallel samples sharing prompt blocks and
  beams sharing their common history (copy-on-write).

Per policy, measured during each step (blocks of the step allocated, finished sequences not yet
freed): steps to finish, peak and mean running sequences, and KV utilisation (tokens stored /
slots held, averaged over steps). The time-weighted columns weight each step by the tokens it
computed (a step's cost grows with its tokens), so a recompute preemption, which computes a
prompt and its output again, costs what it costs.

Memory saved by sharing (the PagedAttention paper's figure): in the paged + sharing replay,
blocks in use (distinct physical blocks) against blocks without sharing (each sequence's own
block table counted in full, as if nothing were shared), summed over steps:
1 - sum(with) / sum(without), i.e. 1 - mean(with) / mean(without).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Sequence

from trtpaged.bench.null_runner import NullRunner, one_torch_thread
from trtpaged.bench.workload import TraceRequest, prompt_token_ids
from trtpaged.config import MAX_BATCH_SIZE, MAX_NUM_KV_BLOCKS, MAX_NUM_TOKENS, MAX_SEQ_LEN
from trtpaged.runtime.runners.base import StepBatch
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class Budget:
    """The KV budget and step limits every policy gets."""

    num_kv_blocks: int
    block_size: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int

    def __post_init__(self) -> None:
        # the highs are a model.yaml's own (a block as long as the longest sequence at most)
        for name, high in (("num_kv_blocks", MAX_NUM_KV_BLOCKS), ("block_size", MAX_SEQ_LEN),
                           ("max_seq_len", MAX_SEQ_LEN), ("max_batch_size", MAX_BATCH_SIZE),
                           ("max_num_tokens", MAX_NUM_TOKENS)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be an integer >= 1, got {value!r}")
            if value > high:
                raise ValueError(f"--{name.replace('_', '-')}: must be at most {high}, got {value}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(f"--max-num-tokens: must be >= max_batch_size ({self.max_batch_size}), "
                             f"got {self.max_num_tokens}")  # fmt: skip

    @property
    def capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


def never_fits(req: TraceRequest, budget: Budget) -> Optional[str]:
    """Why no policy can ever run `req` under `budget` (the runtime's `check_request` rules), or None. Every
    replay refuses such a request (`PolicyResult.refused`); an output longer than max_seq_len leaves is cut there
    instead, as a server's length limit cuts it."""
    if req.prompt_len >= budget.max_seq_len:
        return f"prompt_len {req.prompt_len} leaves no room for output under max_seq_len {budget.max_seq_len}"
    blocks = -(-req.prompt_len // budget.block_size)
    if blocks > budget.num_kv_blocks:
        return f"prompt_len {req.prompt_len} needs {blocks} KV blocks, more than the budget's {budget.num_kv_blocks}"
    if req.num_seqs > budget.max_batch_size:
        return (f"{req.num_seqs} sequences ({'beam_width' if req.beam_width > 1 else 'n'}) exceed max_batch_size "
                f"{budget.max_batch_size}")  # fmt: skip
    return None


def check_fits(trace: list[TraceRequest], budget: Budget, wheres: Optional[list[str]] = None) -> None:
    """ValueError naming the first request that `budget` can never run (`never_fits`): by its `wheres` entry (its
    file and line) when given, else its 1-based number."""
    for i, req in enumerate(trace):
        why = never_fits(req, budget)
        if why is not None:
            where = wheres[i] if wheres else f"request {i + 1}"
            raise ValueError(f"{where}: {why}: this KV budget and its limits can never run it")


MAX_TIER_SIZES = 16  # --kv-tier-blocks sizes, one replay each
MAX_TIER_BLOCKS = 1 << 40  # more than any trace's blocks: say 'unbounded'
SERIES = ("running", "utilisation", "slots", "computed", "blocks_with_sharing", "blocks_without_sharing", "waiting",
          "head_fits")


@dataclass
class PolicyResult:
    policy: str
    steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    mean_utilisation: float = 0.0
    tokens_computed: int = 0
    time_weighted_running: float = 0.0  # steps weighted by the tokens they computed
    time_weighted_utilisation: float = 0.0
    preemptions: int = 0
    refused: int = 0
    prefix_query_tokens: int = 0  # paged replays with sharing: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # ... found there (in the pool or a KV tier)
    tier_hit_tokens: int = 0  # ... restored from a KV tier
    running: list[int] = field(default_factory=list, repr=False)
    utilisation: list[float] = field(default_factory=list, repr=False)
    slots: list[int] = field(default_factory=list, repr=False)  # KV slots held in each step
    computed: list[int] = field(default_factory=list, repr=False)  # tokens computed in each step
    blocks_with_sharing: list[int] = field(default_factory=list, repr=False)
    blocks_without_sharing: list[int] = field(default_factory=list, repr=False)
    # per step, paged replays only: requests waiting, and whether the first of them would fit in the free blocks
    waiting: list[int] = field(default_factory=list, repr=False)
    head_fits: list[bool] = field(default_factory=list, repr=False)

    def record(self, running: int, tokens: int, slots: int, computed: int = 0) -> None:
        self.running.append(running)
        self.slots.append(slots)
        self.computed.append(computed)
        self.utilisation.append(tokens / slots if slots else 1.0)

    def finish(self) -> "PolicyResult":
        self.steps = len(self.running)
        self.peak_running = max(self.running, default=0)
        self.mean_running = statistics.fmean(self.running) if self.running else 0.0
        self.mean_utilisation = statistics.fmean(self.utilisation) if self.utilisation else 0.0
        self.tokens_computed = sum(self.computed)
        if self.tokens_computed:
            self.time_weighted_running = _weighted(self.running, self.computed)
            self.time_weighted_utilisation = _weighted(self.utilisation, self.computed)
        return self

    def sharing(self) -> dict[str, float]:
        """Means over steps of blocks in use with and without sharing, and the memory saved."""
        with_, without = self.blocks_with_sharing, self.blocks_without_sharing
        mean_with = statistics.fmean(with_) if with_ else 0.0
        mean_without = statistics.fmean(without) if without else 0.0
        saved = 1.0 - mean_with / mean_without if mean_without else 0.0
        return {"memory_saved": saved, "blocks_with_sharing": mean_with, "blocks_without_sharing": mean_without}


def _weighted(values: list, weights: list[int]) -> float:
    return sum(v * w for v, w in zip(values, weights)) / sum(weights)


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
    taken = 0  # steps computed (an idle stretch until the next arrival is skipped, not taken)
    while pending or waiting or running:
        while pending and trace[pending[0]].arrival <= step:
            waiting.append(trace[pending.pop(0)])
        tokens_left = budget.max_num_tokens - len(running)
        computed = len(running)  # one decode token per running sequence, plus the prompts admitted
        admitted_any = False
        while waiting:
            req = waiting[0]
            copies = req.num_seqs  # without sharing, every sample or beam holds its own copy
            per_seq = (budget.max_seq_len if reserve == "max_seq_len"
                       else min(budget.max_seq_len, req.prompt_len + req.output_len))  # fmt: skip
            need = per_seq * copies
            if need > budget.capacity_tokens or never_fits(req, budget) is not None:
                waiting.pop(0)
                result.refused += 1
                continue
            fits = reserved + need <= budget.capacity_tokens and len(running) + copies <= budget.max_batch_size
            # each copy computes its prompt; prompts longer than the step's token budget still run, alone (as if
            # chunked)
            if not fits or (req.prompt_len * copies > tokens_left and admitted_any):
                break
            waiting.pop(0)
            running += [_ContiguousSeq(req.prompt_len, req.output_len, per_seq) for _ in range(copies)]
            reserved += need
            tokens_left -= req.prompt_len * copies
            computed += req.prompt_len * copies
            admitted_any = True
        if not running:  # nothing to compute until the next arrival: the paged replays take no step either
            step = trace[pending[0]].arrival if pending else step + 1
            continue
        for seq in running:
            seq.generated += 1
        stored = sum(s.prompt_len + s.generated - 1 for s in running)
        result.record(len(running), stored, reserved, computed)
        done = [s for s in running if s.generated >= min(s.output_len, budget.max_seq_len - s.prompt_len)]
        for s in done:
            reserved -= s.reserved
        running = [s for s in running if s not in done]
        step += 1
        taken += 1
        if taken > 10_000_000:
            raise RuntimeError("contiguous simulation did not finish")
    return result.finish()


def simulate_paged(
    trace: list[TraceRequest], budget: Budget, sharing: bool, prompts: Optional[list[list[int]]] = None,
    tier_blocks: Optional[int] = 0,
    reclaim_window: int = 0,
) -> PolicyResult:
    """Replays the trace through trtpaged's real scheduler and block pool (no model runs), on one torch thread:
    its tensors are a few rows of stand-in logits, and with a second thread each op waited on an OpenMP barrier
    (3.3 ms a log_softmax of 32 x 8 against 23 us, with the other core busy), most of a replay's time.

    `prompts` gives each request's token ids (default: generated, shared prefixes identical).
    With sharing, a request's n samples or beam_width beams are one request sharing blocks;
    without, they are separate requests (beams as greedy copies) and nothing is shared.
    `tier_blocks` (with sharing): a host-memory KV tier below the pool holding that many blocks
    (None: unbounded), with the real tier code keeping only the entries' headers.
    `reclaim_window` > 0: a model whose every layer has that sliding window, its blocks before each
    sequence's window returned to the pool (KVCacheManager.reclaim).
    """
    with one_torch_thread():
        return _replay(trace, budget, sharing, prompts, tier_blocks, reclaim_window)


def _replay(trace: list[TraceRequest], budget: Budget, sharing: bool, prompts: Optional[list[list[int]]],
            tier_blocks: Optional[int], reclaim_window: int) -> PolicyResult:
    config = RuntimeConfig(
        block_size=budget.block_size,
        num_kv_blocks=budget.num_kv_blocks,
        max_batch_size=budget.max_batch_size,
        max_num_tokens=budget.max_num_tokens,
        max_seq_len=budget.max_seq_len,
        enable_prefix_caching=sharing,
        reclaim_window=reclaim_window,
    )
    result = PolicyResult("paged + sharing" if sharing else "paged")

    def during_step(batch: StepBatch) -> None:
        # Blocks of this step are allocated and none freed yet; this step's tokens are being written.
        stats = engine.kv.stats(engine.scheduler.live_seqs())
        # a group's samples (beams) run from admission, as the reservation replay's copies do, though its prompt
        # is one sequence until the first sample forks it
        num_seqs = sum(len(g.seqs) if g.forked else g.params.num_seqs for g in engine.scheduler.running)
        result.record(num_seqs, int(stats["kv_tokens_stored"]) + batch.num_tokens, int(stats["kv_slots_allocated"]),
                      batch.num_tokens)  # fmt: skip
        used = int(stats["kv_blocks_used"])
        result.blocks_with_sharing.append(used)
        # an unforked group's prompt blocks stand for all its samples (beams): without sharing each holds its copy
        unforked = sum((g.params.num_seqs - 1) * sum(b is not None for b in engine.kv.tables.get(g.seqs[0].seq_id, []))
                       for g in engine.scheduler.running if not g.forked)  # fmt: skip
        result.blocks_without_sharing.append(used + int(stats["kv_blocks_saved_by_sharing"]) + unforked)
        waiting = engine.scheduler.waiting
        result.waiting.append(len(waiting))
        if waiting:
            head = waiting[0]
            need = -(-len(head.prompt_token_ids) // budget.block_size)
            result.head_fits.append(need <= int(stats["kv_blocks_free"]))
        else:
            result.head_fits.append(True)

    tiers = None
    if sharing and tier_blocks != 0:
        from trtpaged.runtime.kv_tiers.entry import entry_bytes
        from trtpaged.runtime.kv_tiers.host import HostMemoryTier
        from trtpaged.runtime.kv_tiers.stack import TierStack

        size = entry_bytes(budget.block_size, 0) * (tier_blocks if tier_blocks is not None else 1 << 40)
        tiers = TierStack([HostMemoryTier(size)], bytes(32), background=False)  # a deterministic replay
        result.policy += f" + host tier ({'unbounded' if tier_blocks is None else f'{tier_blocks} blocks'})"
    engine = LLMEngine(NullRunner(budget.num_kv_blocks, on_step=during_step), config, tiers=tiers)
    if prompts is None:  # drawn for the requests that can run: a refused one's (a 30k-token prompt) is never read
        fits = [never_fits(req, budget) is None for req in trace]
        drawn = iter(prompt_token_ids([req for req, ok in zip(trace, fits) if ok]))
        prompts = [next(drawn) if ok else [] for ok in fits]
    # without sharing, parallel samples are separate requests: nothing is shared
    order = sorted(range(len(trace)), key=lambda i: (trace[i].arrival, i))
    step = 0
    while order or engine.has_unfinished():
        if not engine.has_unfinished():  # an idle engine computes nothing until the next arrival
            step = max(step, trace[order[0]].arrival)
        while order and trace[order[0]].arrival <= step:
            i = order.pop(0)
            req = trace[i]
            if never_fits(req, budget) is not None:
                result.refused += 1
                continue
            copies = 1 if sharing else req.num_seqs
            output_len = min(req.output_len, budget.max_seq_len - req.prompt_len)  # as simulate_contiguous
            if sharing and req.beam_width > 1:
                params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                        beam_width=req.beam_width, n=req.n)  # fmt: skip
            else:
                params = SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=True,
                                        n=req.n if sharing else 1)  # fmt: skip
            for _ in range(copies):
                engine.add_request(prompts[i], params)
        engine.step()
        step += 1
    stats = engine.stats()
    result.preemptions = int(stats["num_preemptions"])
    result.prefix_query_tokens = int(stats["prefix_cache_queries_tokens"])
    result.prefix_hit_tokens = int(stats["prefix_cache_hits_tokens"])
    result.tier_hit_tokens = int(stats.get("prefix_cache_tier_hits_tokens", 0))
    engine.close()
    return result.finish()


def run_tier_what_if(trace: list[TraceRequest], budget: Budget, tier_blocks: Sequence[Optional[int]],
                     prompts: Optional[list[list[int]]] = None,
                     progress: Optional[Callable[[str], None]] = None) -> list[dict]:  # fmt: skip
    """What KV tiers below the pool would buy this trace: prefix hit rate, prompt tokens restored and tokens
    computed with the pool alone, then with a host tier of each size in `tier_blocks` (None: unbounded)."""
    say = progress or (lambda _msg: None)
    rows = []
    for blocks in (0, *tier_blocks):
        say("pool alone" if blocks == 0 else f"KV tier of {blocks or 'unbounded'} blocks")
        r = simulate_paged(trace, budget, sharing=True, prompts=prompts, tier_blocks=blocks)
        rows.append({"tier_blocks": "unbounded" if blocks is None else blocks, "steps": r.steps,
                     "tokens_computed": r.tokens_computed, "prefix_query_tokens": r.prefix_query_tokens,
                     "prefix_hit_tokens": r.prefix_hit_tokens, "tier_hit_tokens": r.tier_hit_tokens,
                     "hit_rate": r.prefix_hit_tokens / r.prefix_query_tokens if r.prefix_query_tokens else 0.0})
    return rows


def parse_tier_blocks(text: str, flag: str = "--kv-tier-blocks") -> list[Optional[int]]:
    """'256,1024,unbounded' -> [256, 1024, None]: at most MAX_TIER_SIZES sizes (each is a replay of the whole trace),
    each from 1 to MAX_TIER_BLOCKS; ValueError naming the flag and the bound."""
    parts = text.split(",")
    if len(parts) > MAX_TIER_SIZES:
        raise ValueError(f"{flag}: at most {MAX_TIER_SIZES} sizes (each replays the whole trace), got {len(parts)}")
    out: list[Optional[int]] = []
    for part in parts:
        part = part.strip()
        if part in ("unbounded", "inf"):
            out.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{flag}: expected block counts like 256,1024,unbounded, got {text!r}") from None
        if not 1 <= value <= MAX_TIER_BLOCKS:
            raise ValueError(f"{flag}: block counts must be from 1 to {MAX_TIER_BLOCKS} (or 'unbounded'), got "
                             f"{part if len(part) <= 30 else part[:27] + '...'}")  # fmt: skip
        out.append(value)
    return out


def format_tier_table(rows: list[dict], pool_blocks: int) -> str:
    """The what-if rows as a markdown table, tokens computed relative to the pool alone."""
    base = rows[0]["tokens_computed"] or 1
    lines = [f"KV tiers below a pool of {pool_blocks} blocks (prefix-cache blocks the pool evicts, kept in a tier):",
             "| tier (blocks) | prefix hit rate | prompt tokens from the tier | tokens computed | vs pool alone "
             "| steps |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        name = "none (pool alone)" if row["tier_blocks"] == 0 else str(row["tier_blocks"])
        lines.append(f"| {name} | {row['hit_rate']:.1%} | {row['tier_hit_tokens']} | {row['tokens_computed']} | "
                     f"{row['tokens_computed'] / base:.2f}x | {row['steps']} |")
    return "\n".join(lines)


def run_memory_bench(
    trace: list[TraceRequest],
    budget: Budget,
    progress: Optional[Callable[[str], None]] = None,
    prompts: Optional[list[list[int]]] = None,
) -> dict:
    """All four policies on one trace; returns a JSON-able report with side-by-side ratios.

    `prompts`: each request's token ids (default: generated; see simulate_paged).
    """
    say = progress or (lambda _msg: None)
    results = []
    for name, run in (
        ("contiguous, reserve max_seq_len", lambda: simulate_contiguous(trace, budget, "max_seq_len")),
        ("contiguous, reserve exact", lambda: simulate_contiguous(trace, budget, "exact")),
        ("paged", lambda: simulate_paged(trace, budget, sharing=False, prompts=prompts)),
        ("paged + sharing", lambda: simulate_paged(trace, budget, sharing=True, prompts=prompts)),
    ):
        say(name)
        results.append(run())
    base = results[0]
    report = {
        "budget": asdict(budget),
        "requests": len(trace),
        "sequences": sum(r.num_seqs for r in trace),
        "sharing": results[-1].sharing(),
        "series": {r.policy: {k: getattr(r, k) for k in ("running", "slots", "waiting", "head_fits")} for r in results},
        "policies": [
            {k: v for k, v in asdict(r).items() if k not in SERIES}
            | {
                "mean_running_vs_reserve_max": r.mean_running / base.mean_running if base.mean_running else None,
                # steps compare only runs of the same requests: none where either refused some
                "speedup_in_steps_vs_reserve_max": base.steps / r.steps
                if r.steps and base.steps and not (r.refused or base.refused) else None,
            }
            for r in results
        ],
    }
    return report


def kv_cache_dtype_blocks(budget: Budget, base_dtype: str, kv_cache_dtype: str, head_dim: int) -> int:
    """Blocks of kv_cache_dtype in the memory of budget.num_kv_blocks blocks of base_dtype (same model, block size).

    Bytes per token are 2 * layers * kv_heads * (bytes of one head's row), so only the row sizes matter.
    """
    from trtpaged.manifest import kv_row_bytes

    return budget.num_kv_blocks * kv_row_bytes(head_dim, base_dtype) // kv_row_bytes(head_dim, kv_cache_dtype)


def run_kv_cache_dtype_comparison(
    trace: list[TraceRequest],
    budget: Budget,
    kv_cache_dtypes: tuple[str, ...],
    base_dtype: str,
    head_dim: int,
    progress: Optional[Callable[[str], None]] = None,
) -> list[dict]:
    """The paged replay (no sharing) with the budget's KV memory held in each cache dtype: blocks and
    concurrent sequences, with ratios to float16 and float32.

    The ratios compare "saturated running": mean running sequences over the steps where requests wait,
    i.e. while the KV budget (or max_batch_size) is what limits concurrency; the mean over all steps
    also counts the drain at the end of the trace, which a faster policy reaches sooner.
    """
    from trtpaged.manifest import kv_row_bytes

    say = progress or (lambda _msg: None)
    rows = []
    for kv_cache_dtype in kv_cache_dtypes:
        say(f"paged, kv {kv_cache_dtype}")
        blocks = kv_cache_dtype_blocks(budget, base_dtype, kv_cache_dtype, head_dim)
        rows.append({"kv_cache_dtype": kv_cache_dtype, "head_row_bytes": kv_row_bytes(head_dim, kv_cache_dtype),
                     **_paged_row(trace, budget, blocks)})
    by_name = {r["kv_cache_dtype"]: r for r in rows}
    for r in rows:
        for other in ("float16", "float32"):
            base = by_name.get(other)
            ok = base and base["saturated_running"] and r["saturated_running"]
            r[f"saturated_running_vs_{other}"] = r["saturated_running"] / base["saturated_running"] if ok else None
    return rows


def _paged_row(trace: list[TraceRequest], budget: Budget, blocks: int, reclaim_window: int = 0) -> dict:
    """The paged replay (no sharing) with `blocks` blocks: steps, peak / mean / saturated running, preemptions.

    "saturated running": mean running sequences over the steps where requests wait, i.e. while the KV budget
    (or max_batch_size) is what limits concurrency."""
    r = simulate_paged(trace, replace(budget, num_kv_blocks=blocks), sharing=False, reclaim_window=reclaim_window)
    busy = [run for run, wait in zip(r.running, r.waiting) if wait > 0]
    return {"num_kv_blocks": blocks, "steps": r.steps, "peak_running": r.peak_running, "mean_running": r.mean_running,
            "saturated_running": statistics.fmean(busy) if busy else None, "saturated_steps": len(busy),
            "preemptions": r.preemptions}


def run_tensor_parallel_comparison(
    trace: list[TraceRequest], budget: Budget, ranks: tuple[int, ...],
    progress: Optional[Callable[[str], None]] = None,
) -> list[dict]:
    """The paged replay on 1 and on N ranks, each rank a device with the memory of `budget.num_kv_blocks` one-rank
    blocks: a rank's block holds 1/N of the KV heads, so N ranks hold N times the blocks (N times the memory)."""
    say = progress or (lambda _msg: None)
    rows = []
    for n in ranks:
        say(f"paged, {n} rank{'s' if n > 1 else ''}")
        rows.append({"ranks": n, **_paged_row(trace, budget, budget.num_kv_blocks * n)})
    base = rows[0]["saturated_running"]
    for r in rows:
        r["saturated_running_vs_1_rank"] = r["saturated_running"] / base if base and r["saturated_running"] else None
    return rows


def run_window_comparison(trace: list[TraceRequest], budget: Budget, window: int,
                          progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """The paged replay (no sharing) of a model whose every layer has a `window`-token sliding window, keeping
    every block (the full table) and returning the blocks before each sequence's window (reclaimed)."""
    say = progress or (lambda _msg: None)
    rows = []
    for reclaim in (False, True):
        say(f"paged, window {window}, {'reclaimed' if reclaim else 'full table'}")
        rows.append({"reclaim": reclaim, **_paged_row(trace, budget, budget.num_kv_blocks, window if reclaim else 0)})
    base = rows[0]["mean_running"]
    for r in rows:
        r["mean_running_vs_full_table"] = r["mean_running"] / base if base else None
    return rows


def format_window_table(rows: list[dict], window: int) -> str:
    lines = [f"sliding window {window} on every layer, paged replay without sharing:",
             f"{'blocks before the window':<26} {'steps':>7} {'peak run':>9} {'mean run':>9} {'vs kept':>8} "
             f"{'preempt':>8}"]
    for r in rows:
        vs = f"{r['mean_running_vs_full_table']:>7.2f}x" if r["mean_running_vs_full_table"] else f"{'-':>8}"
        lines.append(f"{'returned to the pool' if r['reclaim'] else 'kept (full table)':<26} {r['steps']:>7} "
                     f"{r['peak_running']:>9} {r['mean_running']:>9.1f} {vs} {r['preemptions']:>8}")
    lines += ["mean run: sequences running at once, mean over the steps (a preempted sequence recomputes its tokens)"]
    return "\n".join(lines)


def format_tensor_parallel_table(rows: list[dict], base_blocks: int) -> str:
    lines = [f"tensor parallel: each rank a device with the KV memory of {base_blocks} one-rank blocks, paged replay "
             "without sharing:",
             f"{'ranks':>5} {'KV memory':>10} {'blocks':>8} {'steps':>7} {'peak run':>9} {'mean run':>9} "
             f"{'sat run':>8} {'vs 1 rank':>10} {'preempt':>8}"]
    for r in rows:
        vs = f"{r['saturated_running_vs_1_rank']:>9.2f}x" if r["saturated_running_vs_1_rank"] else f"{'-':>10}"
        sat = f"{r['saturated_running']:>8.1f}" if r["saturated_running"] else f"{'-':>8}"
        lines.append(f"{r['ranks']:>5} {str(r['ranks']) + 'x':>10} {r['num_kv_blocks']:>8} {r['steps']:>7} "
                     f"{r['peak_running']:>9} {r['mean_running']:>9.1f} {sat} {vs} {r['preemptions']:>8}")
    lines += ["a rank's KV block holds 1/N of the KV heads: the same block ids address every rank's share, so N",
              "devices hold N times the blocks; concurrency stops growing at max_batch_size"]
    return "\n".join(lines)


def format_kv_cache_dtype_table(rows: list[dict], base_dtype: str, base_blocks: int, head_dim: int) -> str:
    lines = [f"same KV memory as {base_blocks} {base_dtype} blocks (head_dim {head_dim}), "
             "paged replay without sharing:",
             f"{'kv dtype':<10} {'B/head row':>10} {'blocks':>8} {'steps':>7} {'peak run':>9} {'mean run':>9} "
             f"{'sat run':>8} {'vs fp16':>8} {'vs fp32':>8} {'preempt':>8}"]
    for r in rows:
        vs = [f"{r[k]:>7.2f}x" if r[k] else f"{'-':>8}"
              for k in ("saturated_running_vs_float16", "saturated_running_vs_float32")]
        sat = f"{r['saturated_running']:>8.1f}" if r["saturated_running"] else f"{'-':>8}"
        lines.append(f"{r['kv_cache_dtype']:<10} {r['head_row_bytes']:>10} {r['num_kv_blocks']:>8} {r['steps']:>7} "
                     f"{r['peak_running']:>9} {r['mean_running']:>9.1f} {sat} {vs[0]} {vs[1]} {r['preemptions']:>8}")
    lines += ["B/head row: bytes of one token's K (or V) for one head (int8/fp8: codes + fp16 scale)",
              "sat run: mean running sequences over the steps where requests wait (concurrency while the budget",
              "  limits it); vs fp16 / vs fp32 compare sat run"]
    return "\n".join(lines)


def run_sharing_table(
    trace: list[TraceRequest],
    budget: Budget,
    ns: tuple[int, ...] = (2, 4, 6),
    widths: tuple[int, ...] = (2, 4, 6),
    progress: Optional[Callable[[str], None]] = None,
) -> list[dict]:
    """Memory saved by sharing for parallel sampling (each n) and beam search (each width) on one trace.

    Every request of the trace gets that n (or beam width); the replay is paged + sharing.
    """
    say = progress or (lambda _msg: None)
    rows = []
    for kind, values in (("parallel", ns), ("beam", widths)):
        for v in values:
            say(f"{kind} {v}")
            variant = [replace(r, n=v, beam_width=1) if kind == "parallel" else replace(r, n=1, beam_width=v)
                       for r in trace]  # fmt: skip
            rows.append({"kind": kind, "width": v} | simulate_paged(variant, budget, sharing=True).sharing())
    return rows


def format_sharing_table(rows: list[dict]) -> str:
    lines = [f"{'sharing':<10} {'n/width':>8} {'blocks w/ sharing':>18} {'w/o sharing':>12} {'memory saved':>13}"]
    for r in rows:
        lines.append(f"{r['kind']:<10} {r['width']:>8} {r['blocks_with_sharing']:>18.1f} "
                     f"{r['blocks_without_sharing']:>12.1f} {r['memory_saved']:>13.1%}")  # fmt: skip
    lines.append("memory saved = 1 - blocks in use with sharing / blocks without (means over steps), "
                 "paged + sharing replay")
    return "\n".join(lines)


def format_memory_report(report: dict) -> str:
    b = report["budget"]
    lines = [
        f"trtpaged memory benchmark: {report['requests']} requests ({report['sequences']} sequences), "
        f"KV budget {b['num_kv_blocks']} blocks x {b['block_size']} tokens = "
        f"{b['num_kv_blocks'] * b['block_size']:,} slots, "
        f"max_seq_len {b['max_seq_len']}, max_batch_size {b['max_batch_size']}, max_num_tokens {b['max_num_tokens']}",
        "",
        f"{'policy':<34} {'steps':>7} {'peak run':>9} {'mean run':>9} {'KV util':>8} {'tw run':>7} {'tw util':>8} "
        f"{'tokens':>9} {'run x':>6} {'speed-up':>9} {'preempt':>8}",
    ]
    for p in report["policies"]:
        run_x, speedup = p["mean_running_vs_reserve_max"], p["speedup_in_steps_vs_reserve_max"]
        lines.append(
            f"{p['policy']:<34} {p['steps']:>7} {p['peak_running']:>9} {p['mean_running']:>9.1f} "
            f"{p['mean_utilisation']:>7.1%} {p['time_weighted_running']:>7.1f} {p['time_weighted_utilisation']:>7.1%} "
            f"{p['tokens_computed']:>9} {'-' if run_x is None else f'{run_x:.2f}':>6} "
            f"{'-' if speedup is None else f'{speedup:.2f}x':>9} {p['preemptions']:>8}"
        )
    refused = {p["policy"]: p["refused"] for p in report["policies"] if p["refused"]}
    if refused:
        lines.append(f"refused, of {report['requests']} requests (this budget can never run them): "
                     + "; ".join(f"{name} {n}" for name, n in refused.items()))
    sh = report["sharing"]
    lines += [
        "",
        "run x: mean running sequences / those of reserving max_seq_len (higher is better)",
        "speed-up: steps to finish when reserving max_seq_len / this policy's steps (2.00x = done in half the steps;",
        "  '-' where either refused requests: they did not run the same work)",
        "tw run / tw util: running sequences and KV utilisation with each step weighted by the tokens it computed;",
        "  tokens: tokens computed in all (recompute preemptions compute prompts and outputs again)",
        f"sharing (paged + sharing): {sh['blocks_with_sharing']:.1f} blocks in use "
        f"vs {sh['blocks_without_sharing']:.1f} "
        f"without sharing (means over steps): memory saved {sh['memory_saved']:.1%}",
    ]
    return "\n".join(lines)
