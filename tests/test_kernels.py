"""CPU paged-attention, copy_blocks and swap_blocks against the plain PyTorch reference."""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch

from kernel_cases import MIXED_SPECS, Batch, make_batch, tolerance
from trtpaged import kernels
from trtpaged.attention_options import AttentionOptions
from trtpaged.reference import paged_attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run_both(batch: Batch, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the kernel and the reference on copies of the same pool; returns (out, cache) of each."""
    ref_cache = batch.kv_cache.clone()
    ker_cache = batch.kv_cache.clone()
    args = batch.args()
    out = kernels.paged_attention(*args[:3], ker_cache, *args[4:], AttentionOptions(layer, batch.scale))
    ref = paged_attention_reference(*args[:3], ref_cache, *args[4:], AttentionOptions(layer, batch.scale))
    return out, ker_cache, ref, ref_cache


def assert_matches(batch: Batch, layer: int = 1) -> None:
    out, ker_cache, ref, ref_cache = run_both(batch, layer)
    # The write is checked slot by slot: every slot of every layer equals the reference's,
    # so a layer's write never touches another layer and untouched slots stay as they were.
    assert torch.equal(ker_cache, ref_cache)
    err = (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0
    assert err <= tolerance(batch.q.dtype), f"max abs error {err}"


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("kv_cache_dtype", DTYPES, ids=str)
def test_mixed_batch_every_block_size_and_kv_cache_dtype(block_size: int, kv_cache_dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SPECS, block_size=block_size, kv_cache_dtype=kv_cache_dtype, seed=block_size)
    assert_matches(batch)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("io_dtype", DTYPES, ids=str)
def test_gqa_ratios_and_io_dtypes(num_heads: int, num_kv_heads: int, io_dtype: torch.dtype) -> None:
    batch = make_batch(MIXED_SPECS, num_heads=num_heads, num_kv_heads=num_kv_heads, io_dtype=io_dtype,
                       kv_cache_dtype=io_dtype, seed=num_heads)  # fmt: skip
    assert_matches(batch, layer=2)


@pytest.mark.parametrize("head_dim", [48, 64, 80, 96, 128, 256])
def test_head_dims(head_dim: int) -> None:
    assert_matches(make_batch([(0, 7), (30, 1), (5, 20)], head_dim=head_dim, seed=head_dim), layer=0)


def test_long_prefill() -> None:
    assert_matches(make_batch([(0, 333), (0, 1)], block_size=32, seed=3))


def test_long_contexts_split_across_threads() -> None:
    # One decode and one short chunk over thousands of cached tokens: the kernel splits the
    # key range across tasks and merges partial softmaxes.
    assert_matches(make_batch([(3001, 1)], num_layers=1, seed=4), layer=0)
    assert_matches(make_batch([(2500, 5)], num_kv_heads=1, num_heads=4, num_layers=1, seed=5), layer=0)


@pytest.mark.parametrize("block_size", [256, 384, 4096])
def test_large_blocks_on_cpu(block_size: int) -> None:
    # The CPU kernel takes any block size: one block per sequence is the unpaged (contiguous)
    # cache the kernel benchmark compares against; tiles then slice a block.
    assert_matches(make_batch([(0, 97), (3000, 1), (700, 33)], block_size=block_size, num_layers=1, seed=12), layer=0)


def test_layers_of_one_pool_are_independent() -> None:
    batch = make_batch([(10, 6), (0, 3)], num_layers=4, seed=6)
    for layer in range(4):
        assert_matches(batch, layer=layer)


def test_empty_step_is_a_no_op() -> None:
    batch = make_batch([(4, 0)], seed=7)
    cache = batch.kv_cache.clone()
    out = kernels.paged_attention(*batch.args()[:3], cache, *batch.args()[4:], AttentionOptions(0, batch.scale))
    assert out.shape == (0, 9, 64)
    assert torch.equal(cache, batch.kv_cache)


def test_chained_steps_match_one_prefill() -> None:
    # Prefill 40 tokens in one step vs. in chunks of 17, 17, 6 plus decodes: same outputs.
    whole = make_batch([(0, 40)], seed=8)
    out_whole = kernels.paged_attention(*whole.args()[:3], whole.kv_cache.clone(), *whole.args()[4:],
                                        AttentionOptions(0, whole.scale))  # fmt: skip
    cache = whole.kv_cache.clone()
    for lo, hi in [(0, 17), (17, 34), (34, 40)]:
        sl = slice(lo, hi)
        out = kernels.paged_attention(
            whole.q[sl].contiguous(), whole.k[sl].contiguous(), whole.v[sl].contiguous(), cache,
            whole.positions[sl].contiguous(), torch.tensor([0, hi - lo], dtype=torch.int32),
            torch.tensor([hi], dtype=torch.int32), whole.block_tables, AttentionOptions(0, whole.scale),
        )  # fmt: skip
        torch.testing.assert_close(out, out_whole[sl], atol=2e-6, rtol=0)


# ---- copy_blocks / swap_blocks -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_exact(dtype: torch.dtype) -> None:
    pool = torch.randn(10, 3, 2, 2, 16, 8).to(dtype)
    before = pool.clone()
    pairs = [(1, 7), (4, 2), (1, 9)]
    kernels.copy_blocks(pool, pairs)
    expected = before.clone()
    for src, dst in pairs:
        expected[dst] = before[src]
    assert torch.equal(pool, expected)


def test_swap_blocks_exact_both_ways() -> None:
    gpu_like = torch.randn(8, 2, 2, 3, 16, 8)
    host = torch.zeros(5, 2, 2, 3, 16, 8)
    kernels.swap_blocks(gpu_like, host, [(6, 0), (2, 4)])
    assert torch.equal(host[0], gpu_like[6]) and torch.equal(host[4], gpu_like[2])
    assert torch.equal(host[1], torch.zeros_like(host[1]))
    back = torch.zeros_like(gpu_like)
    kernels.swap_blocks(host, back, torch.tensor([[0, 3], [4, 5]], dtype=torch.int32))
    assert torch.equal(back[3], gpu_like[6]) and torch.equal(back[5], gpu_like[2])


# ---- bad arguments: clear errors, nothing written --------------------------------------------


def call(batch: Batch, cache: torch.Tensor | None = None, **overrides):
    fields = dict(q=batch.q, k=batch.k, v=batch.v, kv_cache=batch.kv_cache if cache is None else cache,
                  positions=batch.positions, query_start=batch.query_start, context_lens=batch.context_lens,
                  block_tables=batch.block_tables)  # fmt: skip
    layer = overrides.pop("layer", 0)
    fields.update(overrides)
    return kernels.paged_attention(**fields, options=AttentionOptions(layer, batch.scale))


@pytest.fixture
def small() -> Batch:
    return make_batch([(5, 3), (0, 4)], seed=9)


def test_block_id_out_of_range(small: Batch) -> None:
    tables = small.block_tables.clone()
    tables[1, 0] = small.kv_cache.shape[0]
    cache = small.kv_cache.clone()
    with pytest.raises(kernels.KernelError, match=r"block_tables\[1\]\[0\].*out of range"):
        call(small, cache, block_tables=tables)
    assert torch.equal(cache, small.kv_cache), "a rejected call must not write"


def test_position_beyond_context(small: Batch) -> None:
    with pytest.raises(kernels.KernelError, match=r"positions\[2\]"):
        call(small, context_lens=torch.tensor([7, 4], dtype=torch.int32))


def test_heads_that_do_not_divide() -> None:
    batch = make_batch([(0, 3)], num_heads=8, num_kv_heads=3, seed=10)
    with pytest.raises(kernels.KernelError, match="num_heads"):
        call(batch)


def test_unsupported_head_dim() -> None:
    batch = make_batch([(0, 3)], head_dim=72, seed=11)
    with pytest.raises(kernels.KernelError, match="unsupported: head_dim: 72"):
        call(batch)


def test_layer_out_of_range(small: Batch) -> None:
    with pytest.raises(kernels.KernelError, match=r"layer: 3 out of range \[0, 3\)"):
        call(small, layer=3)


def test_python_side_checks_name_the_argument(small: Batch) -> None:
    with pytest.raises(ValueError, match="positions: dtype int64"):
        call(small, positions=small.positions.long())
    with pytest.raises(ValueError, match="q: must be contiguous"):
        call(small, q=small.q.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="k: dtype float16"):
        call(small, k=small.k.half())
    with pytest.raises(ValueError, match="query_start: 2 entries"):
        call(small, query_start=small.query_start[:2].contiguous())


def test_query_offsets_are_checked_before_positions_are_read(small: Batch) -> None:
    """An offset past num_tokens made the check read positions past their end (ASan: heap-buffer-overflow) and
    name "positions[...]" with a value from beyond the tensor."""
    with pytest.raises(kernels.KernelError, match=r"query_start\[1\]: 10 must be in \[query_start\[0\] = 0, "
                                                  r"num_tokens = 7\]"):
        call(small, query_start=torch.tensor([0, 10, 7], dtype=torch.int32))


def test_a_context_near_int32_max_still_has_its_blocks_checked() -> None:
    """(len + block_size - 1) / block_size overflowed int32 for len near 2**31: no block id was checked and the
    write went to block 10**9 (SIGSEGV). A 2**31 - 1 token context over blocks of 256 is 2**23 table entries."""
    block_size, head_dim = 256, 64
    length = (1 << 31) - 1
    tables = torch.zeros(1, 1 << 23, dtype=torch.int32)
    tables[0, -1] = 10**9  # the block of the new token's position, length - 1
    cache = torch.zeros(1, 1, 2, 1, block_size, head_dim)
    q = torch.randn(1, 1, head_dim)
    with pytest.raises(kernels.KernelError, match=r"block_tables\[0\]\[8388607\]: block 1000000000 out of range"):
        kernels.paged_attention(q, q.clone(), q.clone(), cache, torch.tensor([length - 1], dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32), torch.tensor([length], dtype=torch.int32),
                                tables, options=AttentionOptions(0, 0.125))
    assert not cache.any()


def test_a_step_refuses_q_k_v_of_other_head_counts(small: Batch) -> None:
    """AttentionStep checked only the rows: q with fewer heads, k/v with fewer KV heads or a smaller head_dim made
    the kernel read and write past their ends (a hang, a malloc abort, or garbage read past k)."""
    step = kernels.AttentionStep(small.kv_cache.clone(), small.positions, small.query_start, small.context_lens,
                                 small.block_tables, num_heads=small.q.shape[1])  # fmt: skip
    options = AttentionOptions(0, small.scale)
    torch.testing.assert_close(step(small.q, small.k, small.v, options), call(small, small.kv_cache.clone()))
    q, k, v = small.q, small.k, small.v
    for bad in ((q[:, :4].contiguous(), k, v), (q, k[:, :1].contiguous(), v[:, :1].contiguous()),
                (q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous())):
        with pytest.raises(ValueError, match="q/k/v: 7 rows of"):
            step(*bad, options)


def test_block_pairs_past_int32_are_refused() -> None:
    pool = torch.randn(4, 1, 2, 1, 8, 16)
    before = pool.clone()
    with pytest.raises(ValueError, match="pairs: block ids must fit in int32, got 4294967297"):
        kernels.copy_blocks(pool, [((1 << 32) + 1, 3)])  # was: block 1 copied (the id wrapped)
    assert torch.equal(pool, before)


def test_null_pointers_return_an_error() -> None:
    lib = kernels.library()
    params = kernels._AttentionParams(1, 1, 1, 1, 1, 64, 1, 1, 0, 16, 0.125, 0, 0)
    status = lib.trtpaged_paged_attention_cpu(ctypes.byref(params), None, None, None, None, None, None, None, None,
                                              None)  # fmt: skip
    assert status == 1
    assert "null pointer" in lib.trtpaged_last_error().decode()
    assert lib.trtpaged_paged_attention_cpu(None, *([None] * 9)) == 1


def test_bad_block_pairs() -> None:
    pool = torch.randn(4, 1, 2, 1, 8, 16)
    before = pool.clone()
    with pytest.raises(kernels.KernelError, match="destination block 4 out of range"):
        kernels.copy_blocks(pool, [(0, 4)])
    with pytest.raises(kernels.KernelError, match="written twice"):
        kernels.copy_blocks(pool, [(0, 1), (2, 1)])
    with pytest.raises(kernels.KernelError, match="both a source and a destination"):
        kernels.copy_blocks(pool, [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="pairs: expected shape"):
        kernels.copy_blocks(pool, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dst_pool: block shape"):
        kernels.swap_blocks(pool, torch.zeros(4, 1, 2, 1, 8, 8), [(0, 0)])
    assert torch.equal(pool, before)


def test_missing_library_says_how_to_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TRTPAGED_KERNELS_LIB", str(tmp_path / "nope.so"))
    kernels.library.cache_clear()
    try:
        with pytest.raises(kernels.KernelLibraryNotFound, match="pip install -e"):
            kernels.library()
        assert not kernels.available()
    finally:
        monkeypatch.delenv("TRTPAGED_KERNELS_LIB")
        kernels.library.cache_clear()


def test_library_exports_only_the_c_abi() -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not installed")
    import subprocess

    path = kernels.library()._name
    symbols = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in symbols.splitlines() if line.strip()]
    assert names and all(name.startswith("trtpaged_") for name in names), names


def test_cuda_support_reported_where_built() -> None:
    # The build compiles the CUDA kernels whenever nvcc is found (TRTPAGED_CUDA=AUTO).
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found: the library was built without CUDA")
    assert kernels.has_cuda(), "nvcc is on PATH but the library was built without CUDA"
    expected = os.environ.get("TRTPAGED_EXPECT_CUDA_ARCHS", "80,90").split(",")
    assert set(expected) <= set(kernels.cuda_archs().split(","))
