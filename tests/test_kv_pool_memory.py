"""KV pool host memory (trtpaged.kv_pool_memory): zeroed like torch.zeros, 2 MiB-aligned, and backed by
huge pages where the kernel's transparent huge page setting allows it (checked in /proc/self/smaps)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from trtpaged import kv_pool_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb_of(ptr: int) -> int:
    """AnonHugePages (kB) of the mapping that holds address ptr, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8], ids=str)
def test_pool_is_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    shape = (160, 3, 2, 3, 16, 64)  # 160 blocks of a 3-layer pool: 2.8-11 MiB
    pool = kv_pool_memory.zeros(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % kv_pool_memory.HUGE_PAGE == 0
    assert not pool.any()
    pool[-1, -1, -1, -1, -1, -1] = 7
    pool[0].fill_(1)
    gc.collect()  # the tensor alone keeps the mapping alive
    assert int(pool.count_nonzero()) == pool[0].numel() + 1 and pool[-1, -1, -1, -1, -1, -1].item() == 7


def test_pools_under_a_huge_page_are_plain_zeros() -> None:
    small = kv_pool_memory.zeros((2, 1, 2, 1, 16, 64), torch.float32)
    assert small.shape == (2, 1, 2, 1, 16, 64) and small.dtype == torch.float32 and not small.any()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off")
def test_pool_is_backed_by_huge_pages() -> None:
    fallbacks = _huge_page_fallbacks()
    pool = kv_pool_memory.zeros((1024, 1, 2, 3, 16, 64), torch.float32)  # 24 MiB
    if _huge_kb_of(pool.data_ptr()) < 2048 and _huge_page_fallbacks() > fallbacks:
        # asked for and refused (the kernel's "madvise" defrag found no free 2 MiB page in time): the machine's
        # memory, not the pool; a pool that never asked leaves the count as it was and fails below
        pytest.skip("the kernel had no free 2 MiB page (/proc/vmstat thp_fault_fallback rose)")
    assert _huge_kb_of(pool.data_ptr()) >= 2048, "no 2 MiB page backs the pool"


def _huge_page_fallbacks() -> int:
    """Page faults in a huge-page region that got small pages, machine-wide (/proc/vmstat thp_fault_fallback)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, value = line.split()
        if name == "thp_fault_fallback":
            return int(value)
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/sys/vm/overcommit_memory")
                    or open("/proc/sys/vm/overcommit_memory").read().strip() == "1",
                    reason="the kernel grants any mapping (overcommit_memory 1): 1 TiB would be touched")
def test_a_pool_the_host_cannot_hold_is_a_budget_error_naming_the_setting():
    """mmap's ENOMEM (or torch's allocator failing, or a ulimit -v) was an OSError traceback from deep in the load;
    it is a KVBudgetError on num_kv_blocks naming the bytes (the CLI's one-line error)."""
    from trtpaged.kv_budget import KVBudgetError

    with pytest.raises(KVBudgetError, match="the KV pool's 1099511627776 bytes could not be allocated") as info:
        kv_pool_memory.zeros((1 << 40,), torch.uint8)
    assert info.value.field == "num_kv_blocks"
