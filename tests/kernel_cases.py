"""Random packed batches for paged-attention tests (shared by the CPU and GPU kernel tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (cached tokens before this step, new tokens this step): prefills, continuing chunks, decodes,
# odd lengths, and one sequence with nothing scheduled.
MIXED_SPECS = [(0, 97), (0, 1), (53, 1), (300, 1), (13, 41), (0, 7), (96, 54), (20, 0)]


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    positions: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.kv_cache, self.positions, self.query_start, self.context_lens,
                self.block_tables)  # fmt: skip

    def to(self, device: str) -> "Batch":
        return Batch(*(t.to(device) for t in self.args()), scale=self.scale)


def make_batch(
    specs: list[tuple[int, int]],
    *,
    num_heads: int = 9,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    block_size: int = 16,
    num_layers: int = 3,
    io_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
    spare_blocks: int = 5,
    seed: int = 0,
) -> Batch:
    """Builds a packed batch whose sequences own shuffled, non-contiguous blocks of a random pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(cached + new + block_size - 1) // block_size for cached, new in specs]
    num_blocks = sum(blocks_needed) + spare_blocks
    max_blocks = max(blocks_needed + [1]) + 1  # one padding column the kernel must ignore
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        block_tables[s, :n] = order[used : used + n]
        used += n
    positions = torch.cat([torch.arange(c, c + n) for c, n in specs]).to(torch.int32)
    query_start = torch.tensor([0] + [n for _, n in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c + n for c, n in specs], dtype=torch.int32)
    num_tokens = int(query_start[-1])
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(io_dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(io_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(io_dtype)
    return Batch(q, k, v, kv_cache, positions, query_start, context_lens, block_tables, head_dim**-0.5)


def tolerance(io_dtype: torch.dtype) -> float:
    """Max abs error against the float64 reference, dominated by rounding the output to io_dtype."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[io_dtype]
