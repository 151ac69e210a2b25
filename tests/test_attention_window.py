"""Sliding-window and soft-capped paged attention (trtpaged_attention_options) on every CPU path
against the plain reference attention (trtpaged.reference), which masks densely in float64."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import MIXED_SPECS, make_batch, tolerance
from test_kv_codec_paths import ISA_OF_PATH
from trtpaged import kernels
from trtpaged.attention_options import AttentionOptions
from trtpaged.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernel library not built")


@pytest.fixture(params=kernels.ATTENTION_CPU_PATHS)
def path(request: pytest.FixtureRequest):
    """Forces each attention path in turn (skipped where this CPU lacks its instructions)."""
    if request.param not in ISA_OF_PATH:
        pytest.skip(f"this CPU cannot run the {request.param} path")
    kernels.set_cpu_isa(ISA_OF_PATH[request.param])
    yield request.param
    kernels.set_cpu_isa(None)


def _check(batch, window: int, softcap: float = 0.0, layer: int = 1, kv_cache_dtype=None) -> None:
    ker_cache, ref_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    args = batch.args()
    out = kernels.paged_attention(*args[:3], ker_cache, *args[4:], AttentionOptions(layer, batch.scale,
                                  sliding_window=window, logit_softcap=softcap))
    ref = paged_attention_reference(*args[:3], ref_cache, *args[4:], AttentionOptions(layer, batch.scale,
                                    sliding_window=window, logit_softcap=softcap))
    assert torch.equal(ker_cache, ref_cache)
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= tolerance(batch.q.dtype), f"window {window} softcap {softcap}: max abs error {err}"


@pytest.mark.parametrize("window", [1, 5, 16, 37, 300])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_window_mixed_batch_every_path(path: str, window: int, block_size: int) -> None:
    _check(make_batch(MIXED_SPECS, block_size=block_size, seed=window + block_size), window)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_window_half_pools(path: str, kv_cache_dtype: torch.dtype) -> None:
    _check(make_batch(MIXED_SPECS, kv_cache_dtype=kv_cache_dtype, io_dtype=kv_cache_dtype, seed=7), 19)


def test_window_long_decode_and_chunk_split_across_threads(path: str) -> None:
    # thousands of cached keys: the windowed key range is split over tasks and merged
    _check(make_batch([(3001, 1), (2500, 40)], num_layers=1, seed=4), 1100, layer=0)
    _check(make_batch([(3001, 1), (2500, 40)], num_layers=1, seed=5), 700, layer=0)


def test_window_in_one_large_block_split_by_tiles(path: str) -> None:
    # one sequence in one block larger than a tile (the contiguous layout): its key range is split into
    # whole tiles, the first one starting at the tile of the window's first key
    _check(make_batch([(3001, 1)], block_size=4096, num_layers=1, seed=8), 700, layer=0)
    _check(make_batch([(3001, 1)], block_size=4096, num_layers=1, seed=9), 1500, layer=0)


def test_one_long_decode_split_into_tasks_of_every_head(path: str) -> None:
    # a single decode over 3000 keys on 2 threads: 4 tasks of all 3 KV heads, the key range split into whole
    # tiles of 16 blocks counted from the window's first block (not a tile boundary), the last block partial
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel's OpenMP threads too: the plan depends on them
    try:
        _check(make_batch([(3000, 1)], num_layers=1, seed=13), 2500, layer=0)
        _check(make_batch([(3000, 1)], num_layers=1, seed=14), 0, layer=0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_softcap_with_and_without_window(path: str, softcap: float) -> None:
    batch = make_batch(MIXED_SPECS, seed=11)
    batch.q.mul_(6.0)  # large scores, so that the cap changes the softmax
    _check(batch, 0, softcap)
    _check(batch, 13, softcap)


def test_window_never_reads_blocks_outside_it() -> None:
    """Blocks wholly before every query's window may have been returned to the pool: their table
    entries may hold any id (here out of range) and the result is unchanged."""
    batch = make_batch([(100, 1), (64, 20)], block_size=16, seed=3)
    window = 30
    ref_out = kernels.paged_attention(*batch.args()[:3], batch.kv_cache.clone(), *batch.args()[4:],
                                      AttentionOptions(1, batch.scale, sliding_window=window))
    tables = batch.block_tables.clone()
    for s, first_pos in enumerate((100, 64)):
        dead = max(0, first_pos - window + 1) // 16
        tables[s, :dead] = 10_000
    args = list(batch.args())
    args[7] = tables
    out = kernels.paged_attention(*args[:3], batch.kv_cache.clone(), *args[4:], AttentionOptions(1, batch.scale,
                                  sliding_window=window))
    assert torch.equal(out, ref_out)
    # without the window the same table is refused, naming the entry
    with pytest.raises(kernels.KernelError, match=r"block_tables\[0\]\[0\]"):
        kernels.paged_attention(*args[:3], batch.kv_cache.clone(), *args[4:], AttentionOptions(1, batch.scale))


@pytest.mark.parametrize("bad", [{"sliding_window": -1}, {"logit_softcap": -1.0}, {"logit_softcap": float("inf")},
                                 {"sliding_window": 2.5}])
def test_bad_options_are_refused_naming_the_field(bad: dict) -> None:
    batch = make_batch([(3, 2)], seed=1)
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        kernels.paged_attention(*batch.args(), AttentionOptions(0, batch.scale, **bad))


def test_zero_options_equal_the_plain_call() -> None:
    batch = make_batch(MIXED_SPECS, seed=2)
    a = kernels.paged_attention(*batch.args()[:3], batch.kv_cache.clone(), *batch.args()[4:],
                                AttentionOptions(1, batch.scale))
    b = kernels.paged_attention(*batch.args()[:3], batch.kv_cache.clone(), *batch.args()[4:],
                                AttentionOptions(1, batch.scale, sliding_window=0, logit_softcap=0.0))
    assert torch.equal(a, b)


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
def test_a_windowed_query_row_does_not_depend_on_the_rows_with_it(path: str, kv_cache_dtype: torch.dtype) -> None:
    # A speculative verification step runs a sequence's next rows together: with a sliding window each row's
    # first key differs, and the task starts at the earliest. Each row's output must still be the bits of the
    # row run alone (a decode step): the online-softmax tiles end at the same keys either way. Windows whose
    # first keys cross a block (16 keys) or a tile (256 keys) boundary among the rows, on 1 and 2 threads
    # (2: long contexts split into tasks on the 512-key grid).
    heads, kv_heads, d, bs, rows = 9, 3, 64, 16, 6
    gen = torch.Generator().manual_seed(21)
    threads = torch.get_num_threads()
    try:
        for num_threads, ctx, window in ((1, 300, 37), (1, 600, 300), (2, 1300, 1030), (2, 1290, 200), (1, 90, 500)):
            torch.set_num_threads(num_threads)
            opt = AttentionOptions(0, d**-0.5, sliding_window=window)
            nb = (ctx + rows + bs - 1) // bs
            pool = torch.zeros((nb + 1, 1, 2, kv_heads, bs, d), dtype=kv_cache_dtype)
            table = torch.arange(1, nb + 1, dtype=torch.int32)[None]
            q = torch.randn(ctx + rows, heads, d, generator=gen)
            k = torch.randn(ctx + rows, kv_heads, d, generator=gen)
            v = torch.randn(ctx + rows, kv_heads, d, generator=gen)

            def run(first: int, count: int) -> torch.Tensor:
                pos = torch.arange(first, first + count, dtype=torch.int32)
                return kernels.paged_attention(q[first : first + count], k[first : first + count],
                                               v[first : first + count], pool, pos,
                                               torch.tensor([0, count], dtype=torch.int32),
                                               torch.tensor([first + count], dtype=torch.int32), table,
                                               opt)  # fmt: skip

            run(0, ctx)
            together = run(ctx, rows)
            for i in range(rows):
                assert torch.equal(run(ctx + i, 1)[0], together[i]), (num_threads, ctx, window, i)
    finally:
        torch.set_num_threads(threads)
