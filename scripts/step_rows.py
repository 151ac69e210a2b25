"""Where a step of M query rows goes, M = 1..16: the quantized linears, attention (and the layers' small
ops), the LM head, the rest of the model call. docs/benchmarks.md, "Small multi-row steps".

    PYTHONPATH=$PWD python scripts/step_rows.py ENGINE [--rows 1,2,4,6,8,16] [--mode verify|batch] [--seconds S]
        [--float-tiles]
    PYTHONPATH=$PWD python scripts/step_rows.py ENGINE --ab LIB_A LIB_B [--rounds R] [...]

verify: one sequence with a 128-token context and M new tokens, logits for every row, each row computed as if
alone (StepBatch's `row_invariant`, as the runtime runs a speculative verification step; --float-tiles drops
it, for the arithmetic of a step of several sequences); batch: M sequences of 128 tokens decoding one token
each (logits for each). The rows
are timed round-robin (one step of each M in turn) on the same loaded weights, medians over the samples.
The linears are also timed on their own: every layer's four linears and the LM head called with M rows of
the shape they get in the step, so attention and the layers' small ops are the decoder call minus them.
--ab runs this script alternately under two kernel libraries (TRTPAGED_KERNELS_LIB), `rounds` times each,
and prints B / A of the median model step per M. Set TRTPAGED_CPU_ISA to force an ISA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

CONTEXT = 128


def _batches(runner, rows: int, mode: str, vocab: int, block_size: int, row_invariant: bool):
    """The StepBatch of M rows and a prefill batch that fills the context it reads."""
    from trtpaged.runtime.runners.base import StepPacker

    gen = torch.Generator().manual_seed(rows)
    seqs = 1 if mode == "verify" else rows
    per_seq = (CONTEXT + rows + block_size - 1) // block_size
    prefill, step = StepPacker(), StepPacker()
    for s in range(seqs):
        table = list(range(1 + s * per_seq, 1 + (s + 1) * per_seq))
        prompt = torch.randint(1, vocab, (CONTEXT,), generator=gen).tolist()
        prefill.add(prompt, 0, table)
        new = rows if mode == "verify" else 1
        step.add(torch.randint(1, vocab, (new,), generator=gen).tolist(), CONTEXT, table)
    prefill.logits_index = [len(prefill.input_ids) - 1]
    step.logits_index = list(range(len(step.input_ids)))
    assert 1 + seqs * per_seq <= runner.num_kv_blocks
    return prefill.batch(), step.batch(row_invariant=row_invariant)


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def measure(engine: str, rows_list: list[int], mode: str, seconds: float, float_tiles: bool = False) -> dict:
    from trtpaged import kernels
    from trtpaged.runtime.runners import TorchRunner

    runner = TorchRunner.from_engine_dir(engine, num_kv_blocks=1 + 16 * 10)
    model = runner.model
    dims = model.dims
    block_size = 16
    row_invariant = mode == "verify" and not float_tiles
    batches = {m: _batches(runner, m, mode, dims.vocab_size, block_size, row_invariant) for m in rows_list}
    for prefill, _ in batches.values():
        runner.step(prefill)
    # The decoder layers' one C call and the LM head are timed inside the model call.
    layer_times: dict[int, list[float]] = {m: [] for m in rows_list}
    current = [0]
    layers_call = kernels.LlamaLayers.__call__

    def timed_layers(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = layers_call(self, *args, **kwargs)
        layer_times[current[0]].append((time.perf_counter() - t0) * 1e6)
        return out

    kernels.LlamaLayers.__call__ = timed_layers
    step_times: dict[int, list[float]] = {m: [] for m in rows_list}
    for m in rows_list:  # warm-up
        current[0] = m
        runner.step(batches[m][1])
    for m in rows_list:
        layer_times[m].clear()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(step_times[rows_list[0]]) < 5:
        for m in rows_list:
            current[0] = m
            t0 = time.perf_counter()
            runner.step(batches[m][1])
            step_times[m].append((time.perf_counter() - t0) * 1e6)
    kernels.LlamaLayers.__call__ = layers_call

    # The linears on their own, each weight once per layer in step order (weights stream as in a step).
    ops = []
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            ops.append((lin.cpu_op(), lin.activations == "float"))
    head = model.lm_head if model.lm_head is not None else model.embed_tokens.head
    head_op = (head.cpu_op(), head.activations == "float")
    result = {"mode": mode + (" (row-invariant)" if row_invariant else ""), "isa": kernels.cpu_isa(),
              "threads": torch.get_num_threads(), "rows": {}}
    repeats = max(5, len(step_times[rows_list[0]]) // 2)
    for m in rows_list:
        xs = {k: torch.randn(m, k) for k in {op.k for op, _ in ops} | {head_op[0].k}}

        def linears():
            for op, fl in ops:
                op(xs[op.k], fl, row_invariant)

        linears_us = _median_us(linears, repeats)
        head_us = _median_us(lambda: head_op[0](xs[head_op[0].k], head_op[1], row_invariant), repeats)
        step_us = statistics.median(step_times[m])
        layers_us = statistics.median(layer_times[m])
        result["rows"][m] = {"step_us": step_us, "layers_us": layers_us, "linears_us": linears_us,
                             "attention_and_small_us": layers_us - linears_us, "lm_head_us": head_us,
                             "rest_us": step_us - layers_us - head_us, "samples": len(step_times[m])}
    return result


def format_result(r: dict) -> str:
    lines = [f"mode {r['mode']}, isa {r['isa']}, threads {r['threads']}, "
             f"load {open('/proc/loadavg').read().split()[0]}",
             f"{'M':>3} {'step ms':>8} {'xM=1':>5} {'linears':>8} {'attn+small':>10} {'lm_head':>8} {'rest':>6}"]
    one = r["rows"].get(1, r["rows"][min(r["rows"])])["step_us"]
    for m, v in r["rows"].items():
        lines.append(f"{m:>3} {v['step_us'] / 1e3:8.2f} {v['step_us'] / one:5.2f} {v['linears_us'] / 1e3:8.2f} "
                     f"{v['attention_and_small_us'] / 1e3:10.2f} {v['lm_head_us'] / 1e3:8.2f} "
                     f"{v['rest_us'] / 1e3:6.2f}")
    return "\n".join(lines)


def run_ab(args) -> None:
    """Alternates the measurement between two kernel libraries; prints each run and B / A per M."""
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    cmd = [sys.executable, __file__, args.engine, "--rows", args.rows, "--mode", args.mode, "--seconds",
           str(args.seconds), "--json"] + (["--float-tiles"] if args.float_tiles else [])
    print("load", open("/proc/loadavg").read().strip(), flush=True)
    for i in range(args.rounds):
        for name, lib in (("A", args.ab[0]), ("B", args.ab[1])) if i % 2 == 0 else (("B", args.ab[1]),
                                                                                    ("A", args.ab[0])):
            env = dict(os.environ, TRTPAGED_KERNELS_LIB=lib)
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(name, " ".join(f"{m}:{v['step_us'] / 1e3:.2f}" for m, v in runs[name][-1]["rows"].items()),
                  flush=True)
    print(f"B / A, median over {args.rounds} runs each, model step ms (A, B) and ratio")
    for m in runs["A"][0]["rows"]:
        a = statistics.median(r["rows"][m]["step_us"] for r in runs["A"]) / 1e3
        b = statistics.median(r["rows"][m]["step_us"] for r in runs["B"]) / 1e3
        ratios = [rb["rows"][m]["step_us"] / ra["rows"][m]["step_us"] for ra, rb in zip(runs["A"], runs["B"])]
        print(f"M={m:>2}  A {a:7.2f}  B {b:7.2f}  B/A {b / a:5.3f}  "
              f"(per round {', '.join(f'{x:.3f}' for x in ratios)})")
    print("load", open("/proc/loadavg").read().strip(), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine")
    p.add_argument("--rows", default="1,2,4,6,8,16")
    p.add_argument("--mode", choices=("verify", "batch"), default="verify")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--float-tiles", action="store_true", help="verify mode without row_invariant")
    p.add_argument("--json", action="store_true")
    p.add_argument("--ab", nargs=2, metavar=("LIB_A", "LIB_B"))
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    if args.float_tiles and args.mode != "verify":
        p.error("--float-tiles: only with --mode verify (a batch step's rows take the float tiles already)")
    if args.ab:
        run_ab(args)
        return
    rows = [int(x) for x in args.rows.split(",")]
    result = measure(args.engine, rows, args.mode, args.seconds, args.float_tiles)
    print(json.dumps(result) if args.json else format_result(result))


if __name__ == "__main__":
    main()
