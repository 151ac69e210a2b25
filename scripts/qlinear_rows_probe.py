"""One CPU linear at a few row counts, two kernel libraries interleaved, one thread: GFLOP/s against the ISA's peak.
docs/benchmarks.md, issue 21 ("Round 9: the AVX2 multi-row float linears").

    PYTHONPATH=$PWD python scripts/qlinear_rows_probe.py [--old LIB] [--new LIB] [--isa avx2] [--rows 1,4,8,16,32]

SmolLM2-135M's shapes (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576 in int4, the LM head 576->49152
in int8) on the paths the engines take: int4 with float activations (the int4 engine), int4 with int8 activations
(w4a8) and the int8 LM head both ways. Weights stay in cache (the same weight every call): at several rows these
linears are compute-bound, which is what this measures. Each round times a batch of calls of each library in turn
(thread CPU time, so other load on the machine counts less); the medians over the rounds are reported as
GFLOP/s = 2 M K N / t, whether the two libraries' outputs are bit-identical, and the fraction of a peak of this
core timed in the same run with loops compiled here (cc): float activations against independent FMAs at the ISA's
vector width; int8 activations against the ISA's integer dot product with its accumulation, 2 ops per multiply-add
(plain AVX2: vpmaddubsw and a vpaddw of the int16 pairs, the least any kernel adds per product; AVX-VNNI and
AVX-512 VNNI: vpdpbusd). No kernel reaches either: it also unpacks codes, broadcasts x and scales per block
(the int8 LM head on plain AVX2 also takes |w| and x's sign per product). --old defaults to
$TRTPAGED_KERNELS_LIB (e.g. main's build), --new to this checkout's build/dev library.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # name: (bits, n, k)
    "qkv": (4, 960, 576),
    "o": (4, 576, 576),
    "gate_up": (4, 3072, 576),
    "down": (4, 576, 1536),
    "lm_head": (8, 49152, 576),
}
GROUP = 32
# 12 independent FMA chains (enough for 2 units of latency <= 6) held in registers (the unroll), iters x 12 FMAs.
PEAK_FUNCTION = r"""
__attribute__((target("{target}"))) float fma{width}(long iters) {{
  __m{width} a[12]; const __m{width} m = _mm{width}_set1_ps(0.999f), c = _mm{width}_set1_ps(1e-3f);
  for (int i = 0; i < 12; ++i) a[i] = _mm{width}_set1_ps((float)i);
  for (long it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm{width}_fmadd_ps(a[i], m, c);
  __m{width} s = a[0]; for (int i = 1; i < 12; ++i) s = _mm{width}_add_ps(s, a[i]);
  return {reduce};
}}
"""
# `steps` independent accumulation chains (int16 on plain AVX2, int32 with VNNI), each of its own product: steps / 2
# code registers times 2 activation registers, all passed through an empty asm each iteration so that nothing is
# hoisted out of the loop. {dot}: one dot-product step, 4 bytes x 4 bytes per 32-bit lane, of accumulator a, codes w
# and activations x. Named registers, not arrays: with `a[i] = maddubs(w[i % 4], x) + a[i]` over 8 accumulators GCC
# 12 computed each product once for two of them (4 multiplies an iteration, counted as 8) and kept two accumulators in
# memory (AMD Zen 4 forced to AVX2: 152 GOP/s, against 380 now). Plain AVX2 takes 6 chains, so that they, their
# products' temporaries and the operands fit its 16 registers (8 spilled three of them).
INT_PEAK_FUNCTION = r"""
__attribute__((target("{target}"))) int {name}(long iters) {{
  __m{width}i {accumulators};
  __m{width}i {codes}, x0 = _mm{width}_set1_epi8(3), x1 = _mm{width}_set1_epi8(5);
  for (long it = 0; it < iters; ++it) {{
    __asm__ volatile("" : {operands});
    {steps}
  }}
  __m{width}i s = a0;
  {sum}
  return _mm_cvtsi128_si32(_mm{width}_castsi{width}_si128(s));
}}
"""
INT_PEAKS = {  # ISA: (function, vector width, target, one dot-product step, chains)
    "avx2": ("maddubs256", 256, "avx2", "_mm256_add_epi16({a}, _mm256_maddubs_epi16({w}, {x}))", 6),
    "avxvnni": ("dpbusd256", 256, "avx2,avxvnni", "_mm256_dpbusd_avx_epi32({a}, {w}, {x})", 8),
    "avx512vnni": ("dpbusd512", 512, "avx512f,avx512bw,avx512vnni", "_mm512_dpbusd_epi32({a}, {w}, {x})", 8),
}


def int_peak_source(name: str, width: int, target: str, dot: str, chains: int) -> str:
    """The C function timing `chains` independent integer dot-product chains (INT_PEAK_FUNCTION)."""
    ncodes = chains // 2
    return INT_PEAK_FUNCTION.format(
        name=name, width=width, target=target,
        accumulators=", ".join(f"a{i} = _mm{width}_set1_epi32({i})" for i in range(chains)),
        codes=", ".join(f"w{g} = _mm{width}_set1_epi8({g + 1})" for g in range(ncodes)),
        operands=", ".join(f'"+x"({r})' for r in [f"w{g}" for g in range(ncodes)] + ["x0", "x1"]),
        steps=" ".join(dot.format(a=f"a{i}", w=f"w{i % ncodes}", x=f"x{i // ncodes}").join((f"a{i} = ", ";"))
                       for i in range(chains)),
        sum=" ".join(f"s = _mm{width}_add_epi32(s, a{i});" for i in range(1, chains)))


PEAK_SOURCE = "#include <immintrin.h>\n" + "".join(
    PEAK_FUNCTION.format(width=width, target=target, reduce=reduce)
    for width, target, reduce in ((256, "avx2,fma", "_mm256_cvtss_f32(s)"),
                                  (512, "avx512f", "_mm512_reduce_add_ps(s)"))) + "".join(
    int_peak_source(*peak) for peak in INT_PEAKS.values())


def _best_rate(fn: Callable[[int], object], ops_per_iter: int, rounds: int) -> float:
    """Best G-ops/s of fn(iters) on this thread over `rounds` runs."""
    iters, best = 2_000_000, 0.0
    for _ in range(rounds):
        t0 = time.thread_time()
        fn(iters)
        best = max(best, iters * ops_per_iter / (time.thread_time() - t0) / 1e9)
    return best


def peaks_gflops(isa: str, rounds: int) -> tuple[float, float, str]:
    """This thread's best (float, integer) rates for `isa`, in GFLOP/s (2 ops per multiply-add): independent FMAs at
    the ISA's vector width, and its integer dot product with accumulation (INT_PEAKS; a multiply-add per byte of the
    vector); and the integer loop's name."""
    width = 512 if isa == "avx512vnni" else 256
    name, int_width, _, _, chains = INT_PEAKS.get(isa, INT_PEAKS["avx2"])
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "peak.c", Path(tmp) / "peak.so"
        src.write_text(PEAK_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        so = ctypes.CDLL(str(lib))
        fma = getattr(so, f"fma{width}")
        fma.restype, fma.argtypes = ctypes.c_float, [ctypes.c_long]
        dot = getattr(so, name)
        dot.restype, dot.argtypes = ctypes.c_int, [ctypes.c_long]
        int_ops = chains * (int_width // 8) * 2
        return _best_rate(fma, 12 * (width // 32) * 2, rounds), _best_rate(dot, int_ops, rounds), name


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.trtpaged_qlinear_cpu_ex.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_int32]  # fmt: skip
    lib.trtpaged_cpu_isa.restype = ctypes.c_char_p
    return lib


def random_packed(bits: int, n: int, k: int, gen):
    """A random [n, k] weight (int8 or int4 codes, fp16-exact scales and int4 offsets) packed for qlinear."""
    import torch

    from trtpaged.kernels import qlinear_pack

    if bits == 8:
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        offsets = None
    else:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        offsets = (torch.randn(n, k // GROUP, generator=gen) * 0.05).half().float()
    scales = (torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-3).half().float()
    return qlinear_pack(bits, codes, scales, offsets, GROUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default=os.environ.get("TRTPAGED_KERNELS_LIB", "/work/wt/lib0/libtrtpaged_kernels.so"))
    parser.add_argument("--new", default=str(ROOT / "build/dev/libtrtpaged_kernels.so"))
    parser.add_argument("--isa", default="avx2", help="TRTPAGED_CPU_ISA for both libraries")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget-ms", type=float, default=20.0, help="time per library per round and case")
    args = parser.parse_args()
    os.environ["TRTPAGED_CPU_ISA"] = args.isa
    os.environ["OMP_NUM_THREADS"] = "1"  # before the libraries' OpenMP starts
    import torch  # after OMP_NUM_THREADS

    torch.set_num_threads(1)
    libs = {"old": load(args.old), "new": load(args.new)}
    for name, lib in libs.items():
        print(f"{name}: {getattr(args, name)} isa {lib.trtpaged_cpu_isa().decode()}")
    float_peak, int_peak, int_loop = peaks_gflops(args.isa, 5)
    print(f"peaks, one thread ({args.isa}): FMA {float_peak:.1f} GFLOP/s, integer dot {int_loop} {int_peak:.1f} GOP/s; "
          f"load average {open('/proc/loadavg').read().strip()}")
    paths = [("int4 float acts", 1, ("qkv", "o", "gate_up", "down")), ("int4 int8 acts", 0, ("qkv", "o", "gate_up",
             "down")), ("int8 lm_head float acts", 1, ("lm_head",)), ("int8 lm_head int8 acts", 0, ("lm_head",))]
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(","))
    gen = torch.Generator().manual_seed(0)
    print(f"{'path':24} {'shape':8} {'M':>3} {'old GF/s':>9} {'new GF/s':>9} {'new/old':>8} {'old %pk':>8} "
          f"{'new %pk':>8}  same bits")
    for label, acts, names in paths:
        for shape in (s for s in names if s in wanted):
            bits, n, k = SHAPES[shape]
            packed = random_packed(bits, n, k, gen)
            peak = float_peak if acts == 1 else int_peak
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                ys = {name: torch.empty(m, n) for name in libs}
                calls = {name: (lambda lib=lib, y=ys[name]: lib.trtpaged_qlinear_cpu_ex(
                    x.data_ptr(), m, packed.data_ptr(), bits, n, k, GROUP, None, y.data_ptr(), acts))
                    for name, lib in libs.items()}  # fmt: skip
                for call in calls.values():
                    assert call() == 0
                same = "yes" if torch.equal(ys["old"], ys["new"]) else f"no ({(ys['old'] - ys['new']).abs().max():.1e})"
                t0 = time.thread_time()
                calls["old"]()
                reps = max(1, int(args.budget_ms / 1e3 / max(time.thread_time() - t0, 1e-6)))
                times: dict[str, list[float]] = {name: [] for name in libs}
                for _ in range(args.rounds):
                    for name, call in calls.items():
                        t0 = time.thread_time()
                        for _ in range(reps):
                            call()
                        times[name].append((time.thread_time() - t0) / reps)
                flops = 2.0 * m * k * n
                gf = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
                print(f"{label:24} {shape:8} {m:3d} {gf['old']:9.1f} {gf['new']:9.1f} {gf['new'] / gf['old']:7.2f}x"
                      f" {100 * gf['old'] / peak:7.0f}% {100 * gf['new'] / peak:7.0f}%  {same}", flush=True)
    print(f"load average {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
