"""SmolLM2's body linears as a decode step reads them, two kernel libraries alternated: wall ms per step.

docs/benchmarks.md, issue 21 ("Round 20: decode steps request the next tile").

    PYTHONPATH=$PWD python scripts/stream_linears_probe.py --old LIB_A --new LIB_B [--isa avx2] [--rows 1,4,16]
        [--bits 4|8] [--activations int8|float] [--rounds 15]

The 30 layers x 4 linears of SmolLM2-135M (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576; random
codes) run in order with M rows, on two threads (OMP_NUM_THREADS, default 2), two ways:
- streamed: every layer its own weights (66 MB in int4), each read once per step, as a decode step reads them:
  by the next step they have left the caches;
- cached: one layer's weights 30 times, held in the L2 (what qlinear_rows_probe.py measures).
64 MB are written between steps (the rest of a step passing through the caches). Each round times one step of
each (library, way) in turn; medians over the rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

from qlinear_rows_probe import GROUP, SHAPES, load, random_packed  # this script's folder

BODY = ("qkv", "o", "gate_up", "down")
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="kernel library A (e.g. main's build)")
    parser.add_argument("--new", required=True, help="kernel library B")
    parser.add_argument("--isa", default="", help="TRTPAGED_CPU_ISA for both libraries (default: the CPU's best)")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--activations", choices=("int8", "float"), default="int8")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.isa:
        os.environ["TRTPAGED_CPU_ISA"] = args.isa
    threads = os.environ.setdefault("OMP_NUM_THREADS", "2")  # before the libraries' OpenMP starts
    import torch

    libs = {name: load(getattr(args, name)) for name in ("old", "new")}
    for name, lib in libs.items():
        print(f"{name}: {getattr(args, name)} isa {lib.trtpaged_cpu_isa().decode()}")
    shapes = [SHAPES[name][1:] for name in BODY]  # (n, k); the bits are --bits
    gen = torch.Generator().manual_seed(0)
    layers = [[(random_packed(args.bits, n, k, gen), n, k) for n, k in shapes] for _ in range(LAYERS)]
    megabytes = sum(w.numel() for layer in layers for w, _, _ in layer) / 1e6
    acts = 1 if args.activations == "float" else 0
    print(f"int{args.bits} weights, {args.activations} activations, {threads} threads, {megabytes:.1f} MB; "
          f"load average {open('/proc/loadavg').read().strip()}")
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in sorted({k for _, k in shapes})}
        ys = {n: torch.empty(m, n) for n, _ in shapes}

        def step(lib: ctypes.CDLL, order: list) -> float:
            flush.add_(1)
            t0 = time.perf_counter()
            for weights in order:
                for w, n, k in weights:
                    lib.trtpaged_qlinear_cpu_ex(xs[k].data_ptr(), m, w.data_ptr(), args.bits, n, k, GROUP, None,
                                                ys[n].data_ptr(), acts)  # fmt: skip
            return time.perf_counter() - t0

        ways = {"streamed": layers, "cached": [layers[0]] * LAYERS}
        times = {(name, way): [] for name in libs for way in ways}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                for way, order in ways.items():
                    times[(name, way)].append(step(lib, order))
        ms = {key: 1e3 * statistics.median(t) for key, t in times.items()}
        print(f"M={m:3d}  streamed old {ms[('old', 'streamed')]:6.2f} new {ms[('new', 'streamed')]:6.2f} ms "
              f"(old/new {ms[('old', 'streamed')] / ms[('new', 'streamed')]:.2f}x)   cached old "
              f"{ms[('old', 'cached')]:6.2f} new {ms[('new', 'cached')]:6.2f} ms "
              f"(old/new {ms[('old', 'cached')] / ms[('new', 'cached')]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
