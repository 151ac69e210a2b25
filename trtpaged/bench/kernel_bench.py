"""`trtpaged bench kernel`: CPU decode bandwidth of the paged-attention kernel and its paging overhead.

Everything is measured side by side in one run on this machine:
- the machine's memory-copy bandwidth (a large tensor copy; bytes read + bytes written and the best
  run, STREAM's conventions; timed in bouts before, between and after the cases, whose spread counts as noise),
- the decode kernel's achieved KV-read bandwidth (bytes of K and V read per second) for several contexts
  and batch sizes, with SmolLM2-like heads (9 query heads, 3 KV heads, head_dim 64),
- the same decode over a contiguous cache (one block per sequence, identity table) against the paged
  cache (block_size 16 unless told, shuffled blocks): the paging overhead in percent. The kernel streams both in
  tiles of the same size and splits both into the same tasks on the same threads (a long context's key
  range is split in whole tiles of the one large block as in whole blocks of the paged one), so the
  difference is the paging alone.
- with --layers N, a model's decode step: a pool of N layers, one call each in turn, so that a call finds its keys
  where a step leaves them (read back from memory once the step's K and V outgrow the caches), not in the caches
  as the previous call of a one-layer pool left them (a case takes fewer layers where N would need more than
  MAX_POOL_BYTES per layout; its row says how many),
- with a quantized cache (int8, fp8_e4m3): the bytes actually read (codes and scales), and the paged
  decode timed with a float32 and a float16 cache at the same context and batch, side by side.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional, Union

import torch

import statistics

from trtpaged import kernels, kv_pool_memory

from trtpaged.bench.noise import Noise, NoiseMonitor, interval_verdict, spread, verdict
from trtpaged.bench.timing import best_seconds, interleaved_rounds
from trtpaged.kv_quant import is_quantized, pack_rows, quantize_rows
from trtpaged.manifest import DEFAULT_BLOCK_SIZE, kv_row_bytes

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
CONTEXTS = (512, 2048, 8192)
BATCHES = (1, 8, 32)
TARGET_BANDWIDTH_FRACTION = 0.5  # decode at >= 2048 tokens vs copy bandwidth
TARGET_PAGED_OVERHEAD = 0.05  # mean over the cases (issue 21)
MAX_POOL_BYTES = 1 << 29  # a layout's pool, at most: beyond a few times the last-level cache more layers add nothing


@dataclass
class DecodeResult:
    context: int
    batch: int
    paged_ms: float
    contiguous_ms: float
    kv_bytes: int
    bandwidth_gbs: float  # paged KV-read bandwidth
    fraction_of_copy: float
    paged_overhead: float  # paged_ms / contiguous_ms - 1
    layers: int = 1  # pool layers, one call each in turn (times are per call)
    float32_ms: Optional[float] = None  # quantized runs: the same paged decode with a float32 cache
    float16_ms: Optional[float] = None  # ... and with a float16 cache
    # each layout's median ms per call in each interleaved round: the verdicts' ratios are taken round by round
    round_ms: dict[str, list[float]] = field(default_factory=dict)


class CopyProbe:
    """A large tensor copy, timed in short bouts between the decode cases: the best bout is the machine's copy
    bandwidth (the kernel is timed by its median, so the ratio errs against the kernel on a noisy machine), and
    the bouts' spread shows a load that came or went during the run (a copy measured once, while a load ran,
    made every case's fraction of it look twice as good, unseen by the cases' own spreads)."""

    def __init__(self, num_bytes: int = 1 << 29) -> None:
        self.num_bytes = num_bytes
        self.src = torch.ones(num_bytes // 4, dtype=torch.float32)
        self.dst = torch.empty_like(self.src)
        self.bouts: list[float] = []  # each bout's best seconds

    def best_gbs(self, budget_s: float = 0.1) -> float:
        """Times one bout (its best copy) and returns the best bandwidth of every bout so far."""
        self.bouts.append(best_seconds(lambda: self.dst.copy_(self.src), warmup=1, min_reps=3, budget_s=budget_s))
        return 2 * self.num_bytes / min(self.bouts) / 1e9


def _kv_name(kv_cache_dtype: Union[str, torch.dtype]) -> str:
    return kv_cache_dtype if isinstance(kv_cache_dtype, str) else str(kv_cache_dtype).replace("torch.", "")


def _decode_inputs(context: int, batch: int, block_size: int, kv_cache_dtype: str, shuffle: bool, seed: int = 0,
                   layers: int = 1):
    """A decode step's attention over a pool of `layers` layers: one call per layer, in order, as a model's step
    makes them (with one layer, every call finds what the previous one left in the caches)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = (context + block_size - 1) // block_size
    num_kv_blocks = blocks_per_seq * batch
    ids = torch.randperm(num_kv_blocks, generator=gen) if shuffle else torch.arange(num_kv_blocks)
    tables = ids.to(torch.int32).reshape(batch, blocks_per_seq).contiguous()
    cache = None
    for layer in range(layers):  # a layer at a time: the float32 randoms of every layer at once may not fit
        values = torch.randn(num_kv_blocks, 1, 2, NUM_KV_HEADS, block_size, HEAD_DIM, generator=gen)
        if is_quantized(kv_cache_dtype):
            values = pack_rows(*quantize_rows(values, kv_cache_dtype))
        else:
            values = values.to(getattr(torch, kv_cache_dtype))
        if cache is None:  # the memory an engine's pool has
            cache = kv_pool_memory.zeros((num_kv_blocks, layers, *values.shape[2:]), values.dtype)
        cache[:, layer : layer + 1].copy_(values)
        del values
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    positions = torch.full((batch,), context - 1, dtype=torch.int32)
    query_start = torch.arange(batch + 1, dtype=torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    out = torch.empty_like(q)
    options = [kernels.AttentionOptions(layer, HEAD_DIM**-0.5) for layer in range(layers)]

    def step() -> None:
        for layer_options in options:
            kernels.paged_attention(q, k, v, cache, positions, query_start, context_lens, tables, layer_options,
                                    out=out)

    return step


def measure_decode(context: int, batch: int, kv_cache_dtype: Union[str, torch.dtype], copy_gbs: float, budget_s: float,
                   noise: Optional[NoiseMonitor] = None, block_size: int = DEFAULT_BLOCK_SIZE,
                   layers: int = 1) -> DecodeResult:  # fmt: skip
    kv_cache_dtype = _kv_name(kv_cache_dtype)
    rows = 2 * batch * context * NUM_KV_HEADS  # K and V rows of one layer
    kv_bytes = rows * kv_row_bytes(HEAD_DIM, kv_cache_dtype)  # codes and scales read
    widest = kv_row_bytes(HEAD_DIM, "float32" if is_quantized(kv_cache_dtype) else kv_cache_dtype)  # float32 pools too
    layers = max(1, min(layers, MAX_POOL_BYTES // (rows * widest)))
    steps = {"paged": _decode_inputs(context, batch, block_size, kv_cache_dtype, shuffle=True, layers=layers),
             "contiguous": _decode_inputs(context, batch, context, kv_cache_dtype, shuffle=False, layers=layers)}
    if is_quantized(kv_cache_dtype):  # the float caches, timed alongside on the same inputs
        for name in ("float32", "float16"):
            steps[name] = _decode_inputs(context, batch, block_size, name, shuffle=True, layers=layers)
    # alternated in short rounds, so that a change of the machine's load falls on every layout alike
    by_round = interleaved_rounds(steps, budget_s=budget_s * len(steps))
    by_round = {name: [[t / layers for t in times] for times in rounds]  # per call
                for name, rounds in by_round.items()}  # fmt: skip
    samples = {name: [t for times in rounds for t in times] for name, rounds in by_round.items()}
    paged_times, contiguous_times = samples["paged"], samples["contiguous"]
    floats = {f"{name}_ms": statistics.median(samples[name]) * 1e3
              for name in ("float32", "float16") if name in samples}  # fmt: skip
    if noise is not None:
        for times in samples.values():
            noise.add_samples(times)
    paged, contiguous = statistics.median(paged_times), statistics.median(contiguous_times)
    bandwidth = kv_bytes / paged / 1e9
    round_ms = {name: [statistics.median(times) * 1e3 for times in rounds] for name, rounds in by_round.items()}
    return DecodeResult(context, batch, paged * 1e3, contiguous * 1e3, kv_bytes, bandwidth, bandwidth / copy_gbs,
                        paged / contiguous - 1, layers, **floats, round_ms=round_ms)  # fmt: skip


def run_kernel_bench(
    kv_cache_dtype: Union[str, torch.dtype] = "float32",
    contexts: tuple[int, ...] = CONTEXTS,
    batches: tuple[int, ...] = BATCHES,
    budget_s: float = 0.4,
    progress: Optional[Callable[[str], None]] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    layers: int = 1,
) -> dict:
    """Runs the whole CPU kernel report and returns it as a dict (see module docstring); block_size: tokens per
    block of the paged layout; layers: the pool's layers, one call each per step (a model's step)."""
    say = progress or (lambda _msg: None)
    monitor = NoiseMonitor().start()
    say("measuring memory-copy bandwidth (again between the cases)")
    copy = CopyProbe()
    copy_gbs = copy.best_gbs()
    results = []
    for context in contexts:
        for batch in batches:
            say(f"decode: context {context}, batch {batch}")
            results.append(measure_decode(context, batch, kv_cache_dtype, copy_gbs, budget_s, monitor, block_size,
                                          layers))
            copy_gbs = copy.best_gbs()
    monitor.add_samples(copy.bouts)
    monitor.stop()
    results = [replace(r, fraction_of_copy=r.bandwidth_gbs / copy_gbs) for r in results]  # the best bout's
    noise = monitor.result()
    long = [r for r in results if r.context >= 2048]
    worst_fraction = min((r.fraction_of_copy for r in long), default=float("nan"))
    mean_overhead = sum(r.paged_overhead for r in results) / len(results)
    vs_float32 = [r.float32_ms / r.paged_ms for r in long if r.float32_ms]
    rounds = range(min(len(times) for r in results for times in r.round_ms.values()))
    fraction_rounds = [min(r.kv_bytes / r.round_ms["paged"][i] / 1e6 for r in long) / copy_gbs
                       for i in rounds] if long else []  # fmt: skip
    overhead_rounds = [statistics.mean(r.round_ms["paged"][i] / r.round_ms["contiguous"][i] for r in results)
                       for i in rounds]  # fmt: skip
    speedup_rounds = [min(r.round_ms["float32"][i] / r.round_ms["paged"][i] for r in long)
                      for i in rounds] if vs_float32 else []  # fmt: skip
    return {
        "device": "cpu",
        "isa": kernels.describe_cpu_isa(),
        "attention_path": kernels.attention_cpu_path(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "kv_cache_dtype": _kv_name(kv_cache_dtype),
        "block_size": block_size,
        "layers": layers,
        "heads": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "copy_bandwidth_gbs": copy_gbs,
        "copy_bouts_gbs": [2 * copy.num_bytes / t / 1e9 for t in copy.bouts],
        "decode": [asdict(r) for r in results],
        "noise": noise.to_dict(),
        "summary": {
            "min_fraction_of_copy_at_2048_plus": worst_fraction,
            "target_fraction": TARGET_BANDWIDTH_FRACTION,
            "mean_paged_overhead": mean_overhead,
            "max_paged_overhead": max(r.paged_overhead for r in results),
            "target_paged_overhead": TARGET_PAGED_OVERHEAD,
            "bandwidth_verdict": _round_verdict(fraction_rounds, TARGET_BANDWIDTH_FRACTION, True, noise)
            if long or not noise.trustworthy else "no verdict (no case of 2048 tokens or more: the target is on those)",
            "overhead_verdict": _round_verdict(overhead_rounds, 1 + TARGET_PAGED_OVERHEAD, False, noise),
            # quantized caches: float32 time / this time at 2048+ tokens (target: >= 1, no slower than fp32)
            "min_speedup_vs_float32_at_2048_plus": min(vs_float32) if vs_float32 else None,
            "speedup_verdict": _round_verdict(speedup_rounds, 1.0, True, noise) if vs_float32 else None,
            # each verdict's figure round by round (the interleaved rounds, every case's i-th round in the i-th)
            "worst_fraction_rounds": fraction_rounds, "mean_paged_over_contiguous_rounds": overhead_rounds,
            "worst_speedup_vs_float32_rounds": speedup_rounds,
        },
    }


def _round_verdict(rounds: list[float], target: float, higher_is_better: bool, noise: Noise) -> str:
    """A target's verdict from its figure taken round by round (each round's from the sides timed in it, so that
    its uncertainty is both sides'): refused when the run is noisy, else from the interval of the median round
    (`interval_verdict`: refused when the rounds straddle the target)."""
    if not noise.trustworthy:
        return verdict(False, noise)
    return interval_verdict(rounds, target, higher_is_better, noise)


def format_report(report: dict) -> str:
    """Human-readable table of run_kernel_bench's report."""
    bouts = report.get("copy_bouts_gbs", [report["copy_bandwidth_gbs"]])
    lines = [
        f"trtpaged kernel benchmark ({report['device']}, {report['threads']} threads, KV {report['kv_cache_dtype']}, "
        f"{report['heads']['num_heads']} heads / {report['heads']['num_kv_heads']} KV heads / "
        f"head_dim {report['heads']['head_dim']}, "
        f"paged blocks of {report.get('block_size', DEFAULT_BLOCK_SIZE)} tokens)",
        f"a step: one call per layer of a {report.get('layers', 1)}-layer pool" + (
            " (every call finds the last one's keys in the caches)" if report.get("layers", 1) == 1 else
            " in turn (fewer where the layers column says so); times per call"),
        f"instruction set: {report.get('isa', 'not reported')}; attention kernel copy: "
        f"{report.get('attention_path', 'not reported')}",
        f"memory-copy bandwidth: {report['copy_bandwidth_gbs']:.1f} GB/s (read + write bytes; the best of "
        f"{len(bouts)} bouts before, between and after the cases, spread {spread([1 / g for g in bouts]):.1%} "
        "of their times, as the noise line counts it)",
        "",
        f"{'context':>8} {'batch':>6} {'paged ms':>10} {'contig ms':>10} {'KV GB/s':>9} {'of copy':>8} "
        f"{'paged ovh':>10}"
        + (f" {'fp32 ms':>9} {'fp16 ms':>9} {'vs fp32':>8}" if report["decode"][0].get("float32_ms") else "")
        + (f" {'layers':>7}" if report.get("layers", 1) > 1 else ""),
    ]
    for r in report["decode"]:
        line = (
            f"{r['context']:>8} {r['batch']:>6} {r['paged_ms']:>10.3f} {r['contiguous_ms']:>10.3f} "
            f"{r['bandwidth_gbs']:>9.1f} {r['fraction_of_copy']:>7.0%} {r['paged_overhead']:>+10.1%}"
        )
        if r.get("float32_ms"):
            line += f" {r['float32_ms']:>9.3f} {r['float16_ms']:>9.3f} {r['float32_ms'] / r['paged_ms']:>7.2f}x"
        if report.get("layers", 1) > 1:
            line += f" {r.get('layers', 1):>7}"
        lines.append(line)
    s = report["summary"]
    noise = Noise(**report["noise"])
    lines += [
        "",
        noise.describe(),
        f"decode at 2048+ tokens: worst {s['min_fraction_of_copy_at_2048_plus']:.0%} of copy bandwidth "
        f"(target >= {s['target_fraction']:.0%}): {s['bandwidth_verdict']}",
        f"paged overhead vs contiguous: mean {s['mean_paged_overhead']:+.1%}, worst {s['max_paged_overhead']:+.1%} "
        f"(target <= {s['target_paged_overhead']:.0%} mean): {s['overhead_verdict']}",
    ]
    if s.get("min_speedup_vs_float32_at_2048_plus") is not None:
        lines.append(f"KV {report['kv_cache_dtype']} vs float32 at 2048+ tokens: worst "
                     f"{s['min_speedup_vs_float32_at_2048_plus']:.2f}x "
                     f"as fast (target >= 1.00x, no slower): {s['speedup_verdict']}; KV GB/s counts the bytes "
                     "actually read (codes and fp16 scales)")
    return "\n".join(lines)


def report_json(report: dict) -> str:
    return json.dumps(report, indent=2)
