"""How many KV blocks to allocate, from the manifest's budget."""

from __future__ import annotations

import os
from typing import Optional

import torch

from trtpaged.manifest import Manifest


def _free_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def resolve_num_blocks(manifest: Manifest, device: str = "cpu", override: Optional[int] = None) -> int:
    """Blocks of the KV pool: `override`, else num_blocks, memory_bytes or fraction of free memory.

    A fraction is capped at what max_batch_size sequences of max_seq_len tokens can use,
    so a CPU run does not claim most of the host's memory.
    """
    per_block = manifest.kv_bytes_per_block
    limits = manifest.limits
    if override is not None:
        if override < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {override}")
        return override
    budget = manifest.kv_cache
    if budget.num_blocks is not None:
        return int(budget.num_blocks)
    if budget.memory_bytes is not None:
        blocks = int(budget.memory_bytes) // per_block
        if blocks < 1:
            raise ValueError(f"kv_cache.memory_bytes: {budget.memory_bytes} holds no block of {per_block} bytes")
        return blocks
    if budget.fraction is not None:
        useful = limits.max_batch_size * -(-limits.max_seq_len // limits.block_size)
        blocks = min(int(_free_memory_bytes(device) * budget.fraction) // per_block, useful)
        if blocks < 1:
            raise ValueError(f"kv_cache.fraction: {budget.fraction} of free memory on {device} holds no KV block")
        return blocks
    raise ValueError("kv_cache: the manifest sets none of num_blocks, memory_bytes, fraction")
