"""Host memory for KV pools: zeroed, 2 MiB-aligned and advised for transparent huge pages.

A block holds every layer's K and V, so one layer's rows of a sequence are short runs (4 KiB for an
fp32 head of 16 tokens x 64 values) in blocks scattered over the pool: the paged attention reads a new
4 KiB page every few rows, and each costs a TLB miss whose page walk misses the caches too (the page
table entries of scattered pages share no cache lines). With 2 MiB pages one TLB entry covers dozens of
blocks. Measured with `trtpaged bench kernel` on a 2-vCPU AMD EPYC: see docs/benchmarks.md.

Linux only (madvise MADV_HUGEPAGE, honoured when /sys/kernel/mm/transparent_hugepage/enabled is
"madvise" or "always"); elsewhere, or for pools under 2 MiB, this is torch.zeros.
"""

from __future__ import annotations

import mmap

import torch

from trtpaged.errors import is_out_of_memory
from trtpaged.kv_budget import KVBudgetError

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype, device=device); on the CPU, backed by 2 MiB pages where the OS allows.

    The pages are written (zeroed) here, so a pool's first-touch faults are paid at allocation, as with
    torch.zeros. The tensor keeps its memory mapping alive.
    """
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        return _zeros(shape, dtype, device, nbytes)
    except (OSError, RuntimeError, MemoryError) as exc:  # ENOMEM from mmap, torch's allocators, a ulimit -v
        if isinstance(exc, RuntimeError) and not is_out_of_memory(exc):
            raise
        raise KVBudgetError("num_kv_blocks", f"the KV pool's {nbytes} bytes could not be allocated ("
                            f"{getattr(exc, 'strerror', None) or str(exc)[:120]}); ask for fewer KV blocks "
                            "(num_kv_blocks)") from None


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, nbytes: int) -> torch.Tensor:
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # MAP_PRIVATE: a shared anonymous mapping is shmem, which follows shmem_enabled instead
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled: 4 KiB pages, still correct
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf
    offset = (-raw.data_ptr()) % HUGE_PAGE
    pool = raw[offset : offset + nbytes].view(dtype).view(shape)
    pool.zero_()
    return pool
