"""GPU decode bandwidth of the CUDA paged-attention kernel and its paging overhead.

Measured side by side in one run on the current CUDA device, timed with CUDA events
(over CUDA-graph replays when capture works, so that host launch overhead is not timed):
- device copy bandwidth: a large device-to-device tensor copy. Reported two ways: bytes
  read per second (the copy's source bytes) and bytes moved per second (read + written);
- decode: one step of single-token queries over `context` cached tokens per sequence
  (9 query heads, 3 KV heads, head_dim 64, fp16 q/k/v, block_size 16 or --block-size, shuffled blocks; the
  KV cache fp16 unless --kv-cache-dtype says otherwise). Achieved bandwidth counts the K and V
  bytes the step must read (batch * context * kv_heads * 2 * the bytes of one cached row:
  head_dim values, or for int8 / fp8_e4m3 head_dim codes and the row's 2-byte scale),
  nothing else. The step includes the K/V write of the new token, the split-K decode, its
  reduction and the (empty) prefill launch. With a quantized cache the same step over an
  fp16 cache is timed alongside (float16 us, and the speed-up);
- paged overhead: the same step (the same block size) with an identity block table (each sequence's blocks
  consecutive in the pool) vs a shuffled one, in percent.

The fairest like-for-like ratio is KV bytes read vs the copy's bytes read; since a copy
also writes as many bytes, the ratio against bytes moved is given too (a lower bound).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from trtpaged import kernels
from trtpaged.bench.noise import Noise, assess, spread, verdict
from trtpaged.kv_quant import is_quantized, pack_rows, quantize_rows, row_width
from trtpaged.manifest import DEFAULT_BLOCK_SIZE
from trtpaged.names import renamed_options

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
CONTEXTS = (512, 2048, 8192)
BATCHES = (1, 8, 32)
QUICK_CONTEXTS, QUICK_BATCHES = (2048, 8192), (8, 32)
KV_CACHE_DTYPES = ("float16", "float32", "bfloat16", "int8", "fp8_e4m3")
_TORCH = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET_FRACTION = 0.70  # decode KV-read bandwidth vs copy bandwidth, long contexts


@dataclass
class DecodeResult:
    context: int
    batch: int
    num_splits_hint: int
    paged_us: float
    contiguous_us: float
    kv_bytes: int
    kv_read_gbs: float
    fraction_of_copy_read: float
    fraction_of_copy_moved: float
    paged_overhead_pct: float
    float16_us: float | None = None  # the same paged step over an fp16 cache (quantized caches only)
    spread: float = 0.0  # the worst of its timings' spreads across their repeats


class _Timer:
    """Times fn() with CUDA events, over a captured CUDA graph of `inner` calls when possible."""

    graphs_ok = True

    def __init__(self, fn: Callable[[], None], inner: int = 20) -> None:
        self.fn, self.inner, self.mode = fn, inner, "eager"
        self.graph = None
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        if _Timer.graphs_ok:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(inner):
                        fn()
                self.graph, self.mode = graph, "cuda-graph"
            except Exception:  # capture unsupported here: fall back to eager launches
                _Timer.graphs_ok = False
                torch.cuda.synchronize()

    def seconds(self, reps: int = 20) -> float:
        run = self.graph.replay if self.graph is not None else self.fn
        per_run = self.inner if self.graph is not None else 1
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / (reps * per_run))
        self.spread = spread(times)  # the repeats' agreement: the verdict's noise
        return min(times)


def copy_bandwidth(num_bytes: int = 1 << 30) -> dict:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    timer = _Timer(lambda: dst.copy_(src), inner=4)
    seconds = timer.seconds(reps=5)
    return {"bytes": num_bytes, "read_gbs": num_bytes / seconds / 1e9, "moved_gbs": 2 * num_bytes / seconds / 1e9,
            "spread": timer.spread}


def _row_bytes(kv_cache_dtype: str) -> int:
    """Bytes of one cached row of one head: head_dim values, or codes plus the fp16 scale."""
    element = 1 if is_quantized(kv_cache_dtype) else _TORCH[kv_cache_dtype].itemsize
    return row_width(HEAD_DIM, kv_cache_dtype) * element


def _pool(num_kv_blocks: int, block_size: int, kv_cache_dtype: str, gen: torch.Generator) -> torch.Tensor:
    """A random pool on the GPU: unit-normal values, quantized row by row for int8 / fp8_e4m3."""
    shape = (num_kv_blocks, 1, 2, NUM_KV_HEADS, block_size, HEAD_DIM)
    values = torch.randn(shape, generator=gen).to("cuda")
    if is_quantized(kv_cache_dtype):
        return pack_rows(*quantize_rows(values, kv_cache_dtype))
    return values.to(_TORCH[kv_cache_dtype])


def _decode_step(context: int, batch: int, shuffle: bool, seed: int = 0, kv_cache_dtype: str = "float16",
                 block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[Callable[[], None], int]:
    """A decode step calling the C ABI directly (prepared arguments, no per-call checks or syncs)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = (context + block_size - 1) // block_size
    num_kv_blocks = blocks_per_seq * batch
    ids = torch.randperm(num_kv_blocks, generator=gen) if shuffle else torch.arange(num_kv_blocks)
    dev = "cuda"
    tables = ids.to(torch.int32).reshape(batch, blocks_per_seq).to(dev)
    cache = _pool(num_kv_blocks, block_size, kv_cache_dtype, gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=dev, dtype=torch.float16)
    k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=torch.float16)
    v = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=torch.float16)
    positions = torch.full((batch,), context - 1, dtype=torch.int32, device=dev)
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    tensors = (q, k, v, cache, positions, query_start, context_lens, tables, out)

    lib = kernels.library()
    fp16 = kernels._DTYPE_CODES[torch.float16]
    kv_code = kernels._KV_CACHE_DTYPE_CODES[cache.dtype]
    params = kernels._AttentionParams(batch, batch, blocks_per_seq, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, num_kv_blocks,
                                      1, 0, block_size, HEAD_DIM**-0.5, fp16, kv_code)  # fmt: skip
    ws_size = lib.trtpaged_paged_attention_cuda_workspace_size(ctypes.byref(params), context)
    workspace = torch.empty(max(ws_size, 1), dtype=torch.uint8, device=dev)
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
    ws_ptr = ctypes.c_void_p(workspace.data_ptr())

    def step() -> None:
        _keep = (tensors, workspace)  # noqa: F841  (the pointers above stay valid while step lives)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        status = lib.trtpaged_paged_attention_cuda(ctypes.byref(params), *ptrs, context, ws_ptr, ws_size, stream)
        if status != 0:
            raise kernels.KernelError("paged_attention", status, lib.trtpaged_last_error().decode())

    return step, ws_size


def measure_decode(context: int, batch: int, copy: dict, kv_cache_dtype: str = "float16",
                   block_size: int = DEFAULT_BLOCK_SIZE) -> DecodeResult:
    paged_step, ws_size = _decode_step(context, batch, shuffle=True, kv_cache_dtype=kv_cache_dtype,
                                       block_size=block_size)
    timers = [_Timer(paged_step)]
    paged = timers[0].seconds()
    del paged_step
    timers.append(_Timer(_decode_step(context, batch, shuffle=False, kv_cache_dtype=kv_cache_dtype,
                                      block_size=block_size)[0]))
    contiguous = timers[-1].seconds()
    fp16 = None
    if is_quantized(kv_cache_dtype):
        timers.append(_Timer(_decode_step(context, batch, shuffle=True, block_size=block_size)[0]))
        fp16 = timers[-1].seconds()
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * _row_bytes(kv_cache_dtype)
    bw = kv_bytes / paged / 1e9
    splits = ws_size // (4 * batch * NUM_HEADS * (HEAD_DIM + 2)) if ws_size else 1
    return DecodeResult(context, batch, int(splits), paged * 1e6, contiguous * 1e6, kv_bytes, bw,
                        bw / copy["read_gbs"], bw / copy["moved_gbs"], (paged / contiguous - 1) * 100,
                        fp16 * 1e6 if fp16 is not None else None, max(t.spread for t in timers))  # fmt: skip


def run_gpu_kernel_bench(json_out: bool, kv_cache_dtype: str = "float16", quick: bool = False,
                         block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """Runs the GPU kernel report for a KV cache of kv_cache_dtype (KV_CACHE_DTYPES), prints it (JSON when json_out,
    else a table) and returns it. quick: contexts 2048 and 8192 at batch 8 and 32 only. block_size: tokens per
    block of the paged layout."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} not one of {', '.join(KV_CACHE_DTYPES)}")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    if not kernels.has_cuda():
        raise RuntimeError("the trtpaged kernel library was built without CUDA kernels")
    copy = copy_bandwidth()
    contexts, batches = (QUICK_CONTEXTS, QUICK_BATCHES) if quick else (CONTEXTS, BATCHES)
    results = [measure_decode(c, b, copy, kv_cache_dtype, block_size) for c in contexts for b in batches]
    long = [r for r in results if r.context >= 2048 and r.batch >= 8]
    report = {
        "device": torch.cuda.get_device_name(),
        "cuda_archs": kernels.cuda_archs(),
        "timing": "cuda-graph" if _Timer.graphs_ok else "eager",
        "heads": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "kv_cache_dtype": kv_cache_dtype,
        "block_size": block_size,
        "copy": copy,
        "decode": [asdict(r) for r in results],
        # the repeats of the timings the verdict reads (the copy, the long cases) must agree; a few-microsecond short
        # case's repeats judge nothing (the GPU is ours alone: other processes' CPU load is no measure of it)
        "noise": assess(max([copy["spread"]] + [r.spread for r in long]), None, os.cpu_count() or 1).to_dict(),
        "summary": {
            "min_fraction_of_copy_read_long": min(r.fraction_of_copy_read for r in long),
            "min_fraction_of_copy_moved_long": min(r.fraction_of_copy_moved for r in long),
            "target_fraction": TARGET_FRACTION,
            "mean_paged_overhead_pct": sum(r.paged_overhead_pct for r in results) / len(results),
            "max_paged_overhead_pct": max(r.paged_overhead_pct for r in results),
            "min_speedup_vs_float16": min((r.float16_us / r.paged_us for r in results if r.float16_us), default=None),
        },
    }
    print(json.dumps(report, indent=2) if json_out else format_report(report))
    return report


def format_report(report: dict) -> str:
    """The report as a table and its verdict lines."""
    c, s = report["copy"], report["summary"]
    quantized = is_quantized(report["kv_cache_dtype"])
    lines = [
        f"trtpaged CUDA decode benchmark on {report['device']} (archs {report['cuda_archs']}, timing "
        f"{report['timing']}): {report['heads']['num_heads']} heads / {report['heads']['num_kv_heads']} KV heads / "
        f"head_dim {report['heads']['head_dim']}, KV {report['kv_cache_dtype']}, block_size {report['block_size']}",
        f"device copy of {c['bytes'] >> 20} MiB: {c['read_gbs']:.0f} GB/s read, {c['moved_gbs']:.0f} GB/s moved "
        "(read + written)",
        "",
        f"{'context':>7} {'batch':>5} {'splits':>6} {'paged us':>9} {'contig us':>9} {'KV GB/s':>8} "
        f"{'/copy read':>10} {'/copy moved':>11} {'paged ovh':>9}"
        + (f" {'fp16 us':>8} {'vs fp16':>7}" if quantized else ""),
    ]
    for r in report["decode"]:
        lines.append(
            f"{r['context']:>7} {r['batch']:>5} {r['num_splits_hint']:>6} {r['paged_us']:>9.1f} "
            f"{r['contiguous_us']:>9.1f} {r['kv_read_gbs']:>8.0f} {r['fraction_of_copy_read']:>10.0%} "
            f"{r['fraction_of_copy_moved']:>11.0%} {r['paged_overhead_pct']:>+8.1f}%"
            + (f" {r['float16_us']:>8.1f} {r['float16_us'] / r['paged_us']:>6.2f}x" if quantized else "")
        )
    met = s["min_fraction_of_copy_moved_long"] >= s["target_fraction"]
    noise = Noise(**report["noise"])
    lines += [
        "",
        noise.describe(),
        f"long contexts (2048+, batch 8+): worst {s['min_fraction_of_copy_read_long']:.0%} of copy read bandwidth, "
        f"{s['min_fraction_of_copy_moved_long']:.0%} of copy bytes moved (target {s['target_fraction']:.0%} "
        f"of bytes moved: {verdict(met, noise)})",
        f"paged vs contiguous block table: mean {s['mean_paged_overhead_pct']:+.1f}%, "
        f"worst {s['max_paged_overhead_pct']:+.1f}%",
    ]
    if quantized:
        lines.append(f"{report['kv_cache_dtype']} cache vs fp16 cache: worst speed-up "
                     f"{s['min_speedup_vs_float16']:.2f}x "
                     f"(it reads {_row_bytes(report['kv_cache_dtype']) / _row_bytes('float16'):.0%} of the bytes)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--save", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--kv-cache-dtype", default="float16", choices=KV_CACHE_DTYPES,
                        help="KV cache dtype (default float16)")
    parser.add_argument("--quick", action="store_true", help="contexts 2048 and 8192 at batch 8 and 32 only")
    args = parser.parse_args(renamed_options(sys.argv[1:]))
    report = run_gpu_kernel_bench(args.json, args.kv_cache_dtype, args.quick)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
