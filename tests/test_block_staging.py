"""`BlockStaging`: the KV tiers' block reads and writes through host rows moved by the swap copy.

The truth is the pool tensor itself: bytes read equal the blocks' own bytes (torch's view of them), and a
block written from another block's bytes equals it. On CUDA the rows must be pinned (the reason the class
exists there); that test runs only with a GPU.
"""

from __future__ import annotations

import pytest
import torch

from trtpaged.runtime.runners.base import BlockStaging


def _fallback_swap(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    for s, d in pairs:
        dst[d].copy_(src[s])


def _swaps():
    from trtpaged import kernels

    yield pytest.param(_fallback_swap, id="torch")
    if kernels.available():
        yield pytest.param(kernels.swap_blocks, id="kernel")


def _round_trip(pool: torch.Tensor, swap) -> BlockStaging:
    staging = BlockStaging(swap)
    want = [pool[i].cpu().contiguous().view(torch.uint8).numpy().tobytes() for i in (3, 5, 0)]
    assert staging.read(pool, [3, 5, 0]) == want
    staging.write(pool, [(1, want[0]), (6, want[1])])
    assert torch.equal(pool[1], pool[3]) and torch.equal(pool[6], pool[5])
    more = staging.read(pool, list(range(pool.shape[0])))  # grows the rows past the first batch
    assert more[1] == want[0] and len(more) == pool.shape[0]
    with pytest.raises(ValueError, match="write_blocks: block 2 payload is 3 bytes"):
        staging.write(pool, [(2, b"abc")])
    return staging


@pytest.mark.parametrize("swap", list(_swaps()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_staging_reads_and_writes_whole_blocks(swap, dtype):
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(-100, 100, (8, 2, 3, 4, 5), generator=g).to(dtype)
    staging = _round_trip(pool, swap)
    assert not staging._rows.is_pinned()  # a CPU pool needs no page-locked rows


@pytest.mark.gpu
def test_staging_of_a_cuda_pool_is_pinned_and_exact():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    from trtpaged import kernels

    swap = kernels.swap_blocks if kernels.available() and kernels.has_cuda() else _fallback_swap
    pool = torch.randn(8, 2, 3, 16, 8, device="cuda")
    staging = _round_trip(pool, swap)
    assert staging._rows.is_pinned()
