"""`trtpaged bench qlinear`: weight-only int8/int4 CPU linears against torch's fp32 F.linear.

Measured side by side in one run, for SmolLM2-135M's linear shapes and batch sizes M:
torch F.linear on fp32 weights, our int8 (G=32) and int4 (G=32) kernels with int8 activations,
the same with float activations at M <= 16, and at M=1 torch's _weight_int8pack_mm (int8,
per-channel) for reference. Each format rotates over enough copies of
its weights that their bytes exceed the last-level cache, so weights stream from DRAM as in a
real decode step over 30 layers. A sample is one sweep over all copies divided by the number of
copies; we report the median and the p10-p90 spread of the samples.

Against the weight-streaming limit: the machine's read bandwidth is measured on the same working set
(a multithreaded sum over a buffer of that size, best of several), and each quantized cell is
given as the fraction of that limit it reaches: (packed weight bytes / read bandwidth) / median time.
A decode step streams every weight once, so at M=1 this is how close a linear is to the memory bound.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from trtpaged import kernels
from trtpaged.bench.noise import Noise, NoiseMonitor, assess, spread
from trtpaged.models.qlinear import QuantizedLinear
from trtpaged.models.quant import QuantizedWeight

SHAPES = {  # name: (N, K)
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
BATCHES = (1, 4, 16, 128)
FLOAT_ACTIVATION_BATCHES = (1, 4, 16)  # float activations are for decode-sized batches
GROUP = 32


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    copies: int
    spread: float = 0.0  # (p90 - p10) / median of its samples (bench/noise.py)


@dataclass
class Row:
    shape: str
    n: int
    k: int
    m: int
    fp32: Timing
    int8: Timing
    int4: Timing
    int8pack_mm: Optional[Timing] = None
    int8_float: Optional[Timing] = None  # float activations
    int4_float: Optional[Timing] = None
    int8_bytes: int = 0  # packed weight bytes (what one call streams)
    int4_bytes: int = 0


@dataclass
class Report:
    isa: str
    threads: int
    llc_bytes: int
    working_set_bytes: int
    read_gbs: float = 0.0  # read bandwidth over the working set
    call_overhead_us: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    noise: dict = field(default_factory=dict)  # the run's: the cells' worst spread, other processes' load


def llc_bytes() -> int:
    """Size of the largest CPU cache (Linux sysfs), or 256 MiB when unknown."""
    best = 0
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or 256 << 20


def _time_sweeps(calls: list[Callable[[], object]], budget_s: float, min_sweeps: int = 5) -> Timing:
    """Per-call time: each sample is one sweep over calls (each on its own copy of the weights)."""
    for fn in calls[: min(len(calls), 3)]:
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_sweeps or (time.perf_counter() - start < budget_s and len(samples) < 100):
        t0 = time.perf_counter()
        for fn in calls:
            fn()
        samples.append((time.perf_counter() - t0) / len(calls) * 1e6)
    q = statistics.quantiles(samples, n=10, method="inclusive")  # "exclusive" extrapolates past min/max
    return Timing(statistics.median(samples), q[0], q[-1], min(samples), len(calls), spread(samples))


def read_bandwidth_gbs(num_bytes: int, repeats: int = 7) -> float:
    """Read bandwidth in GB/s: torch's multithreaded sum over a float32 buffer of num_bytes, best of repeats."""
    buf = torch.ones(max(1, num_bytes // 4))
    buf.sum()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def _random_weights(bits: int, n: int, k: int, gen: torch.Generator):
    groups = k // GROUP
    scales = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).half().float()
    if bits == 8:
        return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), scales, None
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    return codes, scales, (torch.randn(n, groups, generator=gen) * 0.01).half().float()


def _copies(bytes_each: int, working_set: int) -> int:
    return max(2, math.ceil(working_set / bytes_each))


def call_overhead_us(reps: int = 5000) -> dict:
    """Per-call cost of the Python binding at M=1 for a tiny weight (N=4, K=32), against the bare
    ctypes call of the same kernel: the difference is the binding's checks and allocation
    (kernels.qlinear, QLinearOp) and the module's dispatch (QuantizedLinear.forward)."""
    codes, scales, offsets = _random_weights(4, 4, 32, torch.Generator().manual_seed(0))
    packed = kernels.qlinear_pack(4, codes, scales, offsets, GROUP)
    x = torch.randn(1, 32)
    out = torch.empty(1, 4)
    lib = kernels.library()
    weight = torch.randn(4, 32)
    xp, pp, op = x.data_ptr(), packed.data_ptr(), out.data_ptr()
    bound = kernels.QLinearOp(packed, 4, 4, 32, GROUP)
    module = QuantizedLinear.from_weight(QuantizedWeight(4, GROUP, codes, scales, offsets), None, torch.float32)

    def best_of(fn: Callable[[], object]) -> float:
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        return best

    return {
        "ctypes_call": best_of(lambda: lib.trtpaged_qlinear_cpu(xp, 1, pp, 4, 4, 32, GROUP, None, op)),
        "qlinear_out": best_of(lambda: kernels.qlinear(x, packed, 4, 4, 32, GROUP, out=out)),
        "qlinear_alloc": best_of(lambda: kernels.qlinear(x, packed, 4, 4, 32, GROUP)),
        "qlinear_op": best_of(lambda: bound(x)),
        "module_forward": best_of(lambda: module(x)),
        "torch_linear_fp32": best_of(lambda: F.linear(x, weight, out=out)),
    }


def run_qlinear_bench(
    *,
    shapes: Optional[dict] = None,
    batches: tuple = BATCHES,
    working_set_bytes: Optional[int] = None,
    budget_s: float = 0.3,
    progress: Callable[[str], None] = lambda msg: None,
) -> Report:
    """Times every (shape, M) cell; weights rotate over copies totalling working_set_bytes per format
    (default: twice the last-level cache)."""
    shapes = shapes or SHAPES
    llc = llc_bytes()
    working_set = working_set_bytes or 2 * llc
    report = Report(kernels.cpu_isa(), torch.get_num_threads(), llc, working_set)
    monitor = NoiseMonitor().start()
    report.call_overhead_us = call_overhead_us()
    progress("measuring read bandwidth")
    report.read_gbs = read_bandwidth_gbs(working_set)
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        progress(f"{name} ({n}x{k})")
        fp32 = [torch.randn(n, k, generator=gen) * 0.02]
        fp32 += [fp32[0].clone() for _ in range(_copies(n * k * 4, working_set) - 1)]
        packed = {}
        for bits in (8, 4):
            codes, scales, offsets = _random_weights(bits, n, k, gen)
            first = kernels.qlinear_pack(bits, codes, scales, offsets, GROUP)
            copies = _copies(first.numel(), working_set)
            packed[bits] = [kernels.qlinear_pack(bits, codes, scales, offsets, GROUP) for _ in range(copies - 1)]
            packed[bits].append(first)
        int8pack = None
        try:
            w8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            s8 = torch.rand(n, generator=gen) * 0.01
            torch._weight_int8pack_mm(torch.randn(1, k), w8, s8)
            int8pack = [(w8, s8)] + [(w8.clone(), s8.clone()) for _ in range(_copies(n * k, working_set) - 1)]
        except (RuntimeError, AttributeError):
            pass
        for m in batches:
            x = torch.randn(m, k, generator=gen)
            out = torch.empty(m, n)
            row = Row(
                name, n, k, m,
                fp32=_time_sweeps([(lambda w: lambda: F.linear(x, w))(w) for w in fp32], budget_s),
                int8=_time_sweeps([(lambda p: lambda: kernels.qlinear(x, p, 8, n, k, GROUP, out=out))(p)
                                   for p in packed[8]], budget_s),
                int4=_time_sweeps([(lambda p: lambda: kernels.qlinear(x, p, 4, n, k, GROUP, out=out))(p)
                                   for p in packed[4]], budget_s),
            )  # fmt: skip
            row.int8_bytes, row.int4_bytes = packed[8][0].numel(), packed[4][0].numel()
            if m in FLOAT_ACTIVATION_BATCHES:
                row.int8_float, row.int4_float = (
                    _time_sweeps([(lambda p: lambda: kernels.qlinear(x, p, bits, n, k, GROUP, out=out,
                                                                     float_activations=True))(p)
                                  for p in packed[bits]], budget_s)
                    for bits in (8, 4)
                )  # fmt: skip
            if m == 1 and int8pack:
                row.int8pack_mm = _time_sweeps(
                    [(lambda w, s: lambda: torch._weight_int8pack_mm(x, w, s))(w, s) for w, s in int8pack], budget_s
                )
            report.rows.append(row)
            progress(f"{name} M={m}: fp32 {row.fp32.median_us:.0f} us, int8 {row.int8.median_us:.0f} us, "
                     f"int4 {row.int4.median_us:.0f} us")  # fmt: skip
        del fp32, packed, int8pack
    monitor.stop()
    timings = [t for row in report.rows for t in (row.fp32, row.int8, row.int4, row.int8pack_mm, row.int8_float,
                                                   row.int4_float) if t is not None]  # fmt: skip
    report.noise = assess(max((t.spread for t in timings), default=None), monitor.foreign_cores(),
                          os.cpu_count() or 1).to_dict()  # fmt: skip
    return report


def _cell(t: Timing) -> str:
    return f"{t.median_us:9.1f} ({t.p10_us:.0f}-{t.p90_us:.0f})"


def _ratio(ref: Timing, ours: Timing) -> str:
    return f"{ref.median_us / ours.median_us:6.2f} [{ref.min_us / ours.min_us:5.2f}]"


def format_report(report: Report) -> str:
    lines = [
        f"weight-only quantized linear, CPU ({report.isa}, {report.threads} threads); weights stream from DRAM: "
        f"each format rotates over copies totalling {report.working_set_bytes / 2**20:.0f} MiB "
        f"(LLC {report.llc_bytes / 2**20:.0f} MiB)",
        "times in us per call: median (p10-p90) over sweeps; speedup x = fp32 median / ours (min-based in brackets)",
        "int8/int4: int8 activations; int8f/int4f: float activations (M <= 16)",
        f"{'shape':<9}{'N x K':>12}{'M':>5}  {'fp32 F.linear':>24}  {'int8 G32':>24}{'x [min]':>14}  "
        f"{'int4 G32':>24}{'x [min]':>14}  {'int8f G32':>24}{'x [min]':>14}  {'int4f G32':>24}{'x [min]':>14}"
        f"  {'_weight_int8pack_mm':>24}",
    ]
    for r in report.rows:
        floats = "".join(f"  {_cell(t):>24}{_ratio(r.fp32, t)}" if t else f"  {'':>24}{'':>14}"
                         for t in (r.int8_float, r.int4_float))  # fmt: skip
        ref = f"  {_cell(r.int8pack_mm):>24}" if r.int8pack_mm else ""
        lines.append(
            f"{r.shape:<9}{f'{r.n}x{r.k}':>12}{r.m:>5}  {_cell(r.fp32):>24}"
            f"  {_cell(r.int8):>24}{_ratio(r.fp32, r.int8)}"
            f"  {_cell(r.int4):>24}{_ratio(r.fp32, r.int4)}" + floats + ref
        )
    if report.read_gbs:
        lines += ["", f"weight-streaming limit: packed bytes / read bandwidth {report.read_gbs:.1f} GB/s (sum over "
                      f"{report.working_set_bytes / 2**20:.0f} MiB); fraction of it reached = limit / median",
                  f"{'shape':<9}{'M':>5}{'int8 MB':>9}{'limit us':>10}{'int8':>7}{'int8f':>7}"
                  f"{'int4 MB':>9}{'limit us':>10}{'int4':>7}{'int4f':>7}"]  # fmt: skip
        for r in report.rows:
            if not r.int8_bytes:
                continue
            cells = ""
            for nbytes, ints, floats in ((r.int8_bytes, r.int8, r.int8_float), (r.int4_bytes, r.int4, r.int4_float)):
                limit = nbytes / (report.read_gbs * 1e9) * 1e6
                shown = [f"{limit / t.median_us:7.0%}" if t else f"{'':>7}" for t in (ints, floats)]
                cells += f"{nbytes / 1e6:9.2f}{limit:10.1f}" + "".join(shown)
            lines.append(f"{r.shape:<9}{r.m:>5}" + cells)
    o = report.call_overhead_us
    lines.append(
        f"per-call cost at M=1, N=4, K=32 (best of 5 x 5000): bare ctypes {o['ctypes_call']:.2f} us, "
        f"kernels.qlinear(out=) {o['qlinear_out']:.2f} us, kernels.qlinear() {o['qlinear_alloc']:.2f} us, "
        f"QLinearOp() {o['qlinear_op']:.2f} us, QuantizedLinear.forward {o['module_forward']:.2f} us, "
        f"torch F.linear {o['torch_linear_fp32']:.2f} us"
    )
    if report.noise:
        noise = Noise(**report.noise)
        lines.append(noise.describe() + ("" if noise.trustworthy else "; the speedups are indicative only"))
    return "\n".join(lines)


def report_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2)
