"""The CPU paged decode's stream of tiles (block-major tiles, the per-thread queue of claimed tasks, prefetches
into the next tasks) on randomized shapes, every attention path, 1-3 OpenMP threads:

* against the plain reference attention (trtpaged.reference), float64, to the io dtype's tolerance;
* block-table entries the kernel promises not to read (blocks wholly before a sliding window, entries past a
  sequence's context) set to garbage (-1, INT32_MAX, INT32_MIN, an id past the pool): the same bits as with
  valid entries;
* with TRTPAGED_BASELINE_KERNELS_LIB set (a library built before a kernel change): the same bits as it, case by
  case, computed in a child process per library.

Shapes: 1, 2, 3, 8, 16 (kMaxKv) and 17-20 KV heads; GQA groups 1-5 (with 2-5 query tokens, more rows per KV head
than a row group); head dims 64/128 (fused) and 32/80 (converted); fp32, fp16, bf16, int8 and fp8_e4m3 caches;
blocks of 8-128; batches of up to 60 very short decodes (more tasks than a thread's queue holds), mixed
prefill + decode batches, sequences with nothing scheduled, long decodes split over key ranges and merged;
sliding windows and logit soft-caps; calls reading more than 32 MiB of K and V, and short calls into a pool of so many
layers that a step's calls read more than that (both from memory: block-major tiles, requests spread over a loop's
steps).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_cases import make_batch, tolerance
from trtpaged import kernels
from trtpaged.attention_options import AttentionOptions
from trtpaged.kv_quant import STORAGE_DTYPES, pack_rows, quantize_rows
from trtpaged.reference import paged_attention_reference

GARBAGE = (-1, 2**31 - 1, -(2**31))
THREADS = (1, 2, 3)
NUM_CASES = int(os.environ.get("TRTPAGED_STREAM_CASES", "25"))


def _specs(rng: random.Random, kind: str) -> list[tuple[int, int]]:
    if kind == "short decodes":  # many tasks, each a tile or less: the queue's limit
        return [(rng.choice([0, 0, 1, 2, 5, 7, 15, 16, 17, 31, 40]), 1) for _ in range(rng.randint(10, 60))]
    if kind == "long decodes":  # split over key ranges, merged
        return [(rng.randint(500, 2600), 1) for _ in range(rng.randint(1, 4))]
    if kind == "streamed decodes":  # more K and V than kBlockMajorBytes (32 MiB): the block-major tiles
        return [(rng.randint(2100, 2600), 1) for _ in range(rng.randint(40, 44))]
    if kind == "deep pool":  # mixed decodes and short prefills, into a pool of many layers (cases())
        return [(rng.randint(0, 400), rng.choice([1, 1, 1, 2, 9])) for _ in range(rng.randint(4, 12))]
    if kind == "verify":  # a few query tokens per sequence: head_rows = tokens * group
        return [(rng.randint(0, 900), rng.randint(2, 5)) for _ in range(rng.randint(2, 8))]
    specs = []  # mixed prefill + decode, a sequence with nothing scheduled
    for _ in range(rng.randint(3, 10)):
        specs.append(rng.choice([(0, rng.randint(1, 40)), (rng.randint(1, 300), rng.randint(1, 20)),
                                 (rng.randint(0, 1500), 1), (rng.randint(0, 60), 1), (rng.randint(1, 50), 0)]))
    if all(n == 0 for _, n in specs):
        specs.append((3, 1))
    return specs


def cases() -> list[dict]:
    rng = random.Random(40)
    out = []
    kinds = ["short decodes", "long decodes", "verify", "mixed", "streamed decodes", "deep pool"]
    kv_heads_choices = [1, 2, 3, 3, 4, 8, 16, 17, 20]
    for i in range(NUM_CASES):
        kind = kinds[i % len(kinds)]
        num_kv_heads = rng.choice(kv_heads_choices)
        group = rng.choice([1, 1, 2, 3, 4, 5])
        if num_kv_heads > 8:
            group = min(group, 2)
        head_dim = rng.choice([64, 64, 128, 128, 32, 80])
        kv = rng.choice(["float32", "float32", "float16", "bfloat16", "int8", "fp8_e4m3"])
        io = rng.choice(["float32", "float32", kv]) if kv in ("float16", "bfloat16") else "float32"
        window = rng.choice([0, 0, rng.randint(1, 40), rng.randint(40, 700)])
        softcap = rng.choice([0.0, 0.0, 30.0, 1.5])
        if kind == "streamed decodes":  # block-major: 2-16 KV heads, at most a row group each, fused loops
            num_kv_heads, group, head_dim = rng.choice([2, 3]), rng.choice([1, 2, 3, 4]), 64
            kv = io = "float32"
        if kind == "deep pool":  # shapes of the fused loops, which spread their requests from memory
            head_dim, io = rng.choice([64, 128]), "float32"
            kv = rng.choice(["float32", "int8", "fp8_e4m3", "float16", "bfloat16"])
            window = rng.choice([0, rng.randint(20, 300)])
        block_size = rng.choice([8, 16, 16, 32, 64, 128])
        specs = _specs(rng, kind)
        layers = 2
        if kind == "deep pool":  # a step's calls over all the layers read more than kBlockMajorBytes (32 MiB)
            row = {"float32": 4 * head_dim, "float16": 2 * head_dim, "bfloat16": 2 * head_dim}.get(kv, head_dim + 2)
            keys = sum(min(c, window + block_size) + n if window else c + n for c, n in specs)  # those read
            layers = min(2000, -(-48 * 2**20 // (keys * num_kv_heads * 2 * row)))
        out.append(dict(name=f"{i}:{kind}:kvh{num_kv_heads}:g{group}:d{head_dim}:{kv}/{io}:bs{block_size}:w{window}"
                             f":cap{softcap}",
                        specs=specs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, kv=kv,
                        io=io, block_size=block_size, window=window, softcap=softcap,
                        layers=layers, layer=rng.randint(0, layers - 1), seed=1000 + i,
                        garbage=GARBAGE[i % len(GARBAGE)]))
    return out


def build(case: dict):
    """(args with valid tables, tables with garbage where the kernel must not read, options, io dtype)."""
    io = getattr(torch, case["io"])
    batch = make_batch(case["specs"], num_heads=case["num_kv_heads"] * case["group"],
                       num_kv_heads=case["num_kv_heads"], head_dim=case["head_dim"], block_size=case["block_size"],
                       num_layers=case["layers"], io_dtype=io, seed=case["seed"], spare_blocks=3)
    if case["kv"] in STORAGE_DTYPES:
        pool = pack_rows(*quantize_rows(batch.kv_cache, case["kv"]))
    else:
        pool = batch.kv_cache.to(getattr(torch, case["kv"]))
    args = list(batch.args())
    args[3] = pool
    tables = batch.block_tables.clone()
    bs, window, bad = case["block_size"], case["window"], case["garbage"]
    num_blocks = pool.shape[0]
    for s, (cached, new) in enumerate(case["specs"]):
        used = (cached + new + bs - 1) // bs
        tables[s, used:] = bad if s % 2 else num_blocks + 7  # past the context: never read
        if new == 0:
            tables[s, :] = bad  # nothing scheduled: no entry is read
        elif window > 0:
            dead = max(0, cached - window + 1) // bs  # wholly before the first query's window
            tables[s, :dead] = bad if s % 3 else num_blocks
    opts = AttentionOptions(case["layer"], batch.scale, sliding_window=window, logit_softcap=case["softcap"])
    return args, tables, opts, io


def isas() -> list[str]:
    found = []
    for isa in ("scalar", "avx2", "avx512vnni"):
        try:
            kernels.set_cpu_isa(isa)
        except kernels.KernelError:
            continue
        found.append(isa)
    kernels.set_cpu_isa(None)
    return found


def run_kernel(args, tables, opts) -> torch.Tensor:
    a = list(args)
    a[3] = a[3].clone()
    a[7] = tables
    return kernels.paged_attention(*a, opts)


def dump(path: str) -> None:
    """Every case's output on every path and thread count with this process's library: {key: tensor}."""
    results = {}
    threads0 = torch.get_num_threads()
    try:
        for case in cases():
            args, tables, opts, _ = build(case)
            for isa in isas():
                kernels.set_cpu_isa(isa)
                for t in THREADS:
                    torch.set_num_threads(t)
                    results[f"{case['name']}|{isa}|t{t}"] = run_kernel(args, tables, opts)
    finally:
        kernels.set_cpu_isa(None)
        torch.set_num_threads(threads0)
    torch.save(results, path)


pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernel library not built")


@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_against_reference_and_garbage_tables(case: dict) -> None:
    args, tables, opts, io = build(case)
    ref_args = list(args)
    ref_args[3] = ref_args[3].clone()
    ref = paged_attention_reference(*ref_args, opts)
    tol = tolerance(io) if case["kv"] not in ("float16", "bfloat16") or io != torch.float32 else 2e-5
    threads0 = torch.get_num_threads()
    try:
        for isa in isas():
            kernels.set_cpu_isa(isa)
            for t in THREADS:
                torch.set_num_threads(t)
                clean = run_kernel(args, args[7], opts)
                dirty = run_kernel(args, tables, opts)
                assert torch.equal(clean.view(torch.uint8), dirty.view(torch.uint8)), \
                    f"{isa} t{t}: garbage table entries changed the output"
                err = (clean.double() - ref.double()).abs().max().item()
                assert err <= tol, f"{isa} t{t}: max abs error {err} (tolerance {tol})"
    finally:
        kernels.set_cpu_isa(None)
        torch.set_num_threads(threads0)


@pytest.mark.skipif(not os.environ.get("TRTPAGED_BASELINE_KERNELS_LIB"), reason="no baseline library given")
def test_same_bits_as_the_baseline_library(tmp_path: Path) -> None:
    outs = {}
    for name, lib in (("new", os.environ.get("TRTPAGED_KERNELS_LIB", "")),
                      ("old", os.environ["TRTPAGED_BASELINE_KERNELS_LIB"])):
        env = {k: v for k, v in os.environ.items() if k != "TRTPAGED_KERNELS_LIB"}
        if lib:
            env["TRTPAGED_KERNELS_LIB"] = lib
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, __file__, "--dump", str(path)], env=env, check=True, cwd=tmp_path)
        outs[name] = torch.load(path)
    assert outs["new"].keys() == outs["old"].keys()
    differ = [k for k in outs["new"] if not torch.equal(outs["new"][k].view(torch.uint8).flatten(),
                                                         outs["old"][k].view(torch.uint8).flatten())]
    assert not differ, f"{len(differ)} of {len(outs['new'])} outputs differ, e.g. {differ[:5]}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--dump"]:
        dump(sys.argv[2])
