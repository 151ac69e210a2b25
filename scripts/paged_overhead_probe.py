"""The paged decode kernel against the contiguous layout, at any context x batch, interleaved in one process.
docs/benchmarks.md, "Paged overhead, round 8".

    PYTHONPATH=$PWD python scripts/paged_overhead_probe.py [CASES] [--kv float32] [--rounds 7]

CASES: comma-separated CONTEXTxBATCH (default: `bench kernel`'s nine and 32768x1, 65536x1, 16384x2, whose
KV (48-96 MB) outgrows the 32 MiB L3 where `bench kernel`'s batch-1 cases stay resident). The inputs are
`bench kernel`'s (blocks of 16 tokens, or --block-size, shuffled over a huge-page pool, against one block per
sequence); each round times a batch of calls of each layout in turn, and the medians over the rounds are compared. With
OMP_NUM_THREADS=1 the time is the thread's CPU time (robust to other load), else wall time. Set
TRTPAGED_KERNELS_LIB and TRTPAGED_CPU_ISA to choose the library and the ISA.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtpaged import kernels
from trtpaged.bench.kernel_bench import BATCHES, CONTEXTS, _decode_inputs
from trtpaged.manifest import DEFAULT_BLOCK_SIZE

LARGE = ((32768, 1), (65536, 1), (16384, 2))
KEYS_PER_ROUND = 200_000  # calls per round: about this many cached keys over all sequences


def probe(context: int, batch: int, kv: str, rounds: int, block_size: int = DEFAULT_BLOCK_SIZE,
          layers: int = 1) -> tuple[float, float]:
    """Median seconds per call of the paged and the contiguous layout (a step's calls over `layers` layers)."""
    steps = {"paged": _decode_inputs(context, batch, block_size, kv, shuffle=True, layers=layers),
             "contiguous": _decode_inputs(context, batch, context, kv, shuffle=False, layers=layers)}  # fmt: skip
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    calls = max(3, KEYS_PER_ROUND // (context * batch * layers))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()
        step()
    for _ in range(rounds):
        for name, step in steps.items():
            start = clock()
            for _ in range(calls):
                step()
            times[name].append((clock() - start) / calls / layers)
    return statistics.median(times["paged"]), statistics.median(times["contiguous"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="?", help="CONTEXTxBATCH,... (default: bench kernel's and three larger)")
    parser.add_argument("--kv", default="float32", help="KV cache dtype (float32, float16, bfloat16, int8, fp8_e4m3)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1,
                        help="pool layers, one call each per step as a model makes them (1: every call finds the "
                             "last one's keys in the caches)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="tokens per block of the paged layout")
    args = parser.parse_args()
    if args.cases:
        cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    else:
        cases = [(c, b) for c in CONTEXTS for b in BATCHES] + list(LARGE)
    print(f"isa {kernels.describe_cpu_isa()}, {torch.get_num_threads()} threads, KV {args.kv}, "
          f"block {args.block_size}, "
          f"layers {args.layers}")
    overheads = []
    for context, batch in cases:
        paged, contiguous = probe(context, batch, args.kv, args.rounds, args.block_size, args.layers)
        overheads.append(paged / contiguous - 1)
        print(f"{context:>6} x {batch:<3} paged {paged * 1e3:8.3f} ms  contiguous {contiguous * 1e3:8.3f} ms  "
              f"overhead {overheads[-1]:+6.1%}", flush=True)
    print(f"mean overhead {statistics.mean(overheads):+.1%}")


if __name__ == "__main__":
    main()
