"""The quantized KV cache on every CPU code path, each forced on this machine.

The CPU paged attention (KV write, quantization, attention) is compiled once per instruction set
(plugins/src/cpu/paged_attention_{scalar,avx2,avx512}.cpp) and one copy is chosen at run time; here
each copy the CPU can run is forced in-process (kernels.set_cpu_isa) and checked against independent
truths: the bytes it writes (codes and fp16 scales) against trtpaged.kv_quant.quantize_rows, the codec
the ONNX verification and the torch reference use, byte for byte, edge rows included; and its
attention output against the float64-accumulating torch reference over the same cache.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernel_cases import MIXED_SPECS, Batch, make_batch, tie_rows, write_rows
from trtpaged import kernels
from trtpaged.attention_options import AttentionOptions
from trtpaged.kv_quant import CODE_MAX, STORAGE_DTYPES, dequantize_rows, pack_rows, quantize_rows, split_rows
from trtpaged.reference import paged_attention_reference, write_kv_reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernel library not built")

KV_CACHE_DTYPES = ["int8", "fp8_e4m3"]


def _isa_of_paths() -> dict[str, str]:
    """Attention path -> the lowest instruction set that runs it, for the paths this CPU can run."""
    found: dict[str, str] = {}
    if not kernels.available():
        return found
    try:
        for isa in kernels.CPU_ISAS:
            try:
                kernels.set_cpu_isa(isa)
            except kernels.KernelError:
                continue
            found.setdefault(kernels.attention_cpu_path(), isa)
    finally:
        kernels.set_cpu_isa(None)
    return found


ISA_OF_PATH = _isa_of_paths()


@pytest.fixture(params=kernels.ATTENTION_CPU_PATHS)
def path(request: pytest.FixtureRequest):
    """Forces each attention path in turn (skipped where this CPU lacks its instructions)."""
    name = request.param
    if name not in ISA_OF_PATH:
        pytest.skip(f"this CPU cannot run the {name} path")
    kernels.set_cpu_isa(ISA_OF_PATH[name])
    assert kernels.attention_cpu_path() == name
    yield name
    kernels.set_cpu_isa(None)


def written_rows(rows: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """The pool rows [n, D + 2] the kernel writes for K rows [n, D] (one sequence, one kv head)."""
    n, d = rows.shape
    block_size = 64
    blocks = -(-n // block_size)
    pool = torch.zeros(blocks, 1, 2, 1, block_size, d + 2, dtype=STORAGE_DTYPES[kv_cache_dtype])
    write_rows(kernels, rows, pool)
    return pool[:, 0, 0, 0].reshape(blocks * block_size, d + 2)[:n]


def reference_rows(rows: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    return pack_rows(*quantize_rows(rows, kv_cache_dtype))


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> None:
    diff = got.view(torch.uint8) != want.view(torch.uint8)
    if diff.any():
        r, c = diff.nonzero()[0].tolist()
        what = "scale" if c >= rows.shape[1] else f"code {c} (x = {rows[r, c].item()!r})"
        raise AssertionError(f"{int(diff.any(-1).sum())} of {rows.shape[0]} rows differ; first: row {r}, {what}: "
                             f"kernel byte {got.view(torch.uint8)[r, c].item()}, "
                             f"reference {want.view(torch.uint8)[r, c].item()}")


@pytest.mark.parametrize("io_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_codes_and_scales_match_the_reference(path: str, kv_cache_dtype: str, head_dim: int,
                                              io_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    rows = torch.randn(300, head_dim, generator=gen) * torch.logspace(-6, 4, 300)[:, None]
    rows[::5, head_dim - 1] *= 40.0  # an outlier channel in the last lane, another in the first
    rows[1::7, 0] *= -25.0
    rows = rows.to(io_dtype)
    assert_same_bytes(written_rows(rows, kv_cache_dtype), reference_rows(rows, kv_cache_dtype), rows)


def edge_rows(kv_cache_dtype: str, d: int = 80) -> dict[str, torch.Tensor]:
    """Rows [n, d] at the codec's edges; d = 80 is not a multiple of 32, so vector loops have tails."""
    top = CODE_MAX[kv_cache_dtype]
    nan, inf = float("nan"), float("inf")
    base = torch.randn(6, d, generator=torch.Generator().manual_seed(7))
    cases: dict[str, torch.Tensor] = {}
    cases["zeros"] = torch.stack([torch.zeros(d), -torch.zeros(d)])
    huge = base * 1e-3
    huge[0, 0], huge[1, d - 1], huge[2, 37] = 1e4, -3e4, 2.5e6
    cases["single huge value"] = huge
    nans = base.clone()
    nans[0, 0], nans[1, d - 1], nans[2, 41] = nan, nan, -nan
    nans[3], nans[4, 40:] = nan, nan
    nans[5, 3], nans[5, 4] = nan, inf
    cases["NaN"] = nans
    infs = base.clone()
    infs[0, 0], infs[1, d - 1], infs[2] = inf, -inf, inf
    infs[3, 10], infs[3, 11] = inf, -inf
    cases["inf"] = infs
    over = base.clone()
    over[0, 5] = 65504.0 * top * 4  # the scale overflows fp16: clamped to 65504, codes saturate
    over[1, 5] = 65504.0 * top  # exactly the largest scale
    over[2, 5] = 65520.0 * top  # rounds to fp16 inf: clamped
    over[3, 5] = -3.4e38
    cases["fp16 scale overflow"] = over[:4]
    cases["subnormal scales"] = base * 1e-6  # max|x| / M below 2^-14: subnormal fp16 scales
    cases["subnormal values"] = base * 1e-40
    smallest = torch.zeros(2, d)
    smallest[0, 0] = torch.finfo(torch.float32).tiny * 2**-23  # the smallest float: its scale rounds to 0
    smallest[1, :] = 2.0**-24 * top  # scale exactly fp16's smallest subnormal
    cases["smallest"] = smallest
    ties, _ = tie_rows(kv_cache_dtype)  # every midpoint between two codes, and the floats either side
    cases["rounding ties"] = torch.cat([ties, torch.zeros(ties.shape[0], d - ties.shape[1])], dim=1)
    scaled = ties * 2.0**-9  # the same ties with a scale of 2^-9 (x / scale exact)
    cases["rounding ties, scaled"] = torch.cat([scaled, torch.zeros(scaled.shape[0], d - scaled.shape[1])], dim=1)
    return cases


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_edge_rows_match_the_reference(path: str, kv_cache_dtype: str) -> None:
    for name, rows in edge_rows(kv_cache_dtype).items():
        got = written_rows(rows, kv_cache_dtype)
        try:
            assert_same_bytes(got, reference_rows(rows, kv_cache_dtype), rows)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_edge_rows_read_back_as_documented(path: str, kv_cache_dtype: str) -> None:
    # What the bytes mean, independently of the reference codec (trtpaged/kv_quant.py's docstring).
    cases = edge_rows(kv_cache_dtype)
    top = CODE_MAX[kv_cache_dtype]
    back = dequantize_rows(written_rows(cases["NaN"], kv_cache_dtype))
    assert torch.all(back.isnan() == cases["NaN"].isnan().any(-1, keepdim=True))  # a NaN row reads as NaN
    codes, scales = split_rows(written_rows(cases["zeros"], kv_cache_dtype))
    assert torch.all(scales == 0) and torch.all(codes.view(torch.uint8) == 0)
    codes, scales = split_rows(written_rows(cases["fp16 scale overflow"], kv_cache_dtype))
    assert torch.all(scales == 65504.0)
    assert torch.equal(codes[:, 5].float().abs(), torch.full((4,), top))
    codes, scales = split_rows(written_rows(cases["inf"], kv_cache_dtype))
    assert torch.all(scales[:4] == 65504.0) and codes[0, 0].float() == top and codes[1, -1].float() == -top
    codes, scales = split_rows(written_rows(cases["rounding ties, scaled"], kv_cache_dtype))
    assert torch.all(scales == 2.0**-9)


def _smollm2_like_batch(seed: int, io_dtype: torch.dtype = torch.float32) -> Batch:
    """SmolLM2-135M's attention shapes (9 heads, 3 KV heads, head_dim 64, 30 layers, block 16) and the
    verification probe's sequences (prefills of 54 and 20 tokens, then a chunk, a prefill and a decode),
    K/V with a few outlier channels as in the real model (max|x| 8-18 against a typical 1)."""
    batch = make_batch([(0, 54), (20, 17), (0, 13), (54, 1)], num_heads=9, num_kv_heads=3, head_dim=64,
                       num_layers=30, block_size=16, io_dtype=io_dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for t in (batch.k, batch.v):
        outliers = torch.randint(0, 64, (3, 4), generator=gen)
        for h in range(3):
            t[:, h, outliers[h]] *= (8.0 + 10.0 * torch.rand(4, generator=gen)).to(t.dtype)
    return batch


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_smollm2_shapes_every_layer(path: str, kv_cache_dtype: str) -> None:
    # Every layer of a SmolLM2-sized pool written through the kernel, one call per layer as the step model
    # makes them (each layer its own K/V): every byte of the pool as the reference writes it; attention as
    # the reference's on the first, a middle and the last layer.
    batch = _smollm2_like_batch(seed=11)
    pool = pack_rows(*quantize_rows(batch.kv_cache, kv_cache_dtype))
    cache, ref_cache = pool.clone(), pool.clone()
    q, k, v, _, positions, query_start, context_lens, block_tables = batch.args()
    worst = 0.0
    for layer in range(30):
        sign = 1.0 if layer % 2 == 0 else -1.0
        k_l, v_l = k.roll(layer, dims=-1) * sign, v.roll(-layer, dims=-1)
        out = kernels.paged_attention(q, k_l, v_l, cache, positions, query_start, context_lens, block_tables,
                                      AttentionOptions(layer, batch.scale))
        if layer in (0, 14, 29):
            ref = paged_attention_reference(q, k_l, v_l, ref_cache, positions, query_start, context_lens,
                                            block_tables, AttentionOptions(layer, batch.scale))
            worst = max(worst, (out.double() - ref.double()).abs().max().item())
        else:
            write_kv_reference(k_l, v_l, ref_cache, positions, query_start, block_tables, layer)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    bound = 4e-6 * v.abs().max().item()  # fp32 rounding of outputs as large as the outlier channels (~18)
    assert worst <= bound, f"max abs error {worst} against attention on the de-quantized cache (bound {bound:.3g})"


@pytest.fixture
def two_threads():
    """Runs the test on 2 OpenMP threads (torch's runtime is the kernels' too), so that the kernel plans its
    tasks as on a 2-core machine whatever this one has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "bfloat16", "int8", "fp8_e4m3"])
def test_attention_every_path(path: str, kv_cache_dtype: str, two_threads: None) -> None:
    # The attention loops of each copy (AVX-512: 16 lanes, AVX2: 8, scalar: SSE) over every cache dtype,
    # block sizes that split a tile and one larger than a tile, a long decode split over key ranges in whole
    # tiles (4 tasks of all 3 KV heads on 2 threads), one in a single block split by tiles, and batches of
    # decodes (every task over all 3 KV heads of its sequence).
    decodes = [(1000 + 37 * i, 1) for i in range(8)]
    for spec, block_size, head_dim in ((MIXED_SPECS, 16, 64), (MIXED_SPECS, 8, 128), ([(700, 9), (0, 40)], 32, 80),
                                       ([(3001, 1)], 16, 64), ([(3001, 1)], 4096, 64), (decodes, 16, 64),
                                       (decodes + [(40, 60)], 64, 128)):
        batch = make_batch(spec, block_size=block_size, head_dim=head_dim, num_layers=2, seed=block_size + head_dim)
        if kv_cache_dtype in STORAGE_DTYPES:
            pool = pack_rows(*quantize_rows(batch.kv_cache, kv_cache_dtype))
        else:
            pool = batch.kv_cache.to(getattr(torch, kv_cache_dtype))
        cache, ref_cache = pool.clone(), pool.clone()
        args = batch.args()
        out = kernels.paged_attention(*args[:3], cache, *args[4:], AttentionOptions(1, batch.scale))
        ref = paged_attention_reference(*args[:3], ref_cache, *args[4:], AttentionOptions(1, batch.scale))
        assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
        err = (out.double() - ref.double()).abs().max().item()
        assert err <= 2e-5, f"{spec}, block {block_size}, head_dim {head_dim}: max abs error {err}"


@pytest.mark.parametrize("heads,kv_heads,rows", [(9, 3, 6), (9, 3, 3), (4, 4, 5)])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "bfloat16", "int8"])
def test_a_query_row_does_not_depend_on_the_rows_with_it(
    path: str, kv_cache_dtype: str, heads: int, kv_heads: int, rows: int
) -> None:
    # A speculative verification step runs a sequence's next rows together; each row's output must be
    # bit-identical to the row run alone (one decode step), or greedy outputs change with speculation on.
    # Contexts whose last block ends one key short of a vector (16 or 8 lanes) and their neighbours: those
    # keys are scored as a partial group alone and inside a full group with the later rows. Contexts next to
    # the key-range split grid (512 keys) and past it: a row alone and among later rows reads the same splits.
    # The query rows of a KV head go through the score loops in groups of up to 4: GQA 9/3 with 6 rows
    # makes groups of 4 and 2, with 3 rows (and MHA with 5) a last group of one row, where alone the row's
    # heads share a group (GQA) or the row is a group of one (MHA).
    d, bs = 64, 16
    gen = torch.Generator().manual_seed(5)
    opt = AttentionOptions(0, d**-0.5)
    for ctx in (102, 103, 110, 111, 126, 507, 509, 766, 768, 1100):
        nb = (ctx + rows + bs - 1) // bs
        shape = (nb + 1, 1, 2, kv_heads, bs, d + 2 if kv_cache_dtype in STORAGE_DTYPES else d)
        dtype = STORAGE_DTYPES.get(kv_cache_dtype) or getattr(torch, kv_cache_dtype)
        pool = torch.zeros(shape, dtype=dtype)
        table = torch.arange(1, nb + 1, dtype=torch.int32)[None]
        q = torch.randn(ctx + rows, heads, d, generator=gen)
        k, v = torch.randn(ctx + rows, kv_heads, d, generator=gen), torch.randn(ctx + rows, kv_heads, d, generator=gen)

        def run(first: int, count: int) -> torch.Tensor:
            pos = torch.arange(first, first + count, dtype=torch.int32)
            return kernels.paged_attention(q[first : first + count], k[first : first + count], v[first : first + count],
                                           pool, pos, torch.tensor([0, count], dtype=torch.int32),
                                           torch.tensor([first + count], dtype=torch.int32), table, opt)  # fmt: skip

        run(0, ctx)  # the context's K/V into the pool
        together = run(ctx, rows)
        for i in range(rows):
            assert torch.equal(run(ctx + i, 1)[0], together[i]), (ctx, i)


def test_every_path_writes_the_same_bytes() -> None:
    # The copies against each other, on a batch none of the other tests uses (fp16 activations).
    batch = _smollm2_like_batch(seed=5, io_dtype=torch.float16)
    pools = {}
    try:
        for name, isa in ISA_OF_PATH.items():
            kernels.set_cpu_isa(isa)
            for kv_cache_dtype in KV_CACHE_DTYPES:
                cache = torch.zeros(batch.kv_cache.shape[:-1] + (66,), dtype=STORAGE_DTYPES[kv_cache_dtype])
                args = batch.args()
                kernels.paged_attention(*args[:3], cache, *args[4:], AttentionOptions(29, batch.scale))
                pools[name, kv_cache_dtype] = cache.view(torch.uint8)
    finally:
        kernels.set_cpu_isa(None)
    for (name, kv_cache_dtype), pool in pools.items():
        assert torch.equal(pool, pools[next(iter(ISA_OF_PATH)), kv_cache_dtype]), f"{name} {kv_cache_dtype}"


def test_env_var_forces_the_path() -> None:
    code = "from trtpaged import kernels; print(kernels.cpu_isa(), kernels.attention_cpu_path())"
    for isa, want in (("scalar", "scalar"), ("avx2", "avx2")):
        if kernels.ATTENTION_PATH_OF_ISA[isa] not in ISA_OF_PATH:
            continue
        env = {**os.environ, "TRTPAGED_CPU_ISA": isa}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [isa, want]
