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
    kv_cache_dtype: torch.dtype = torch.float32,
    spare_blocks: int = 5,
    seed: int = 0,
) -> Batch:
    """Builds a packed batch whose sequences own shuffled, non-contiguous blocks of a random pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(cached + new + block_size - 1) // block_size for cached, new in specs]
    num_kv_blocks = sum(blocks_needed) + spare_blocks
    max_blocks = max(blocks_needed + [1]) + 1  # one padding column the kernel must ignore
    order = torch.randperm(num_kv_blocks, generator=gen).to(torch.int32)
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_needed):
        block_tables[s, :n] = order[used : used + n]
        used += n
    positions = torch.cat([torch.arange(c, c + n) for c, n in specs]).to(torch.int32)
    query_start = torch.tensor([0] + [n for _, n in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    context_lens = torch.tensor([c + n for c, n in specs], dtype=torch.int32)
    num_tokens = int(query_start[-1])
    shape = (num_kv_blocks, num_layers, 2, num_kv_heads, block_size, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(kv_cache_dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(io_dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(io_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(io_dtype)
    return Batch(q, k, v, kv_cache, positions, query_start, context_lens, block_tables, head_dim**-0.5)


def tolerance(io_dtype: torch.dtype) -> float:
    """Max abs error against the float64 reference, dominated by rounding the output to io_dtype."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[io_dtype]


def tie_rows(kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n, 64] that quantize with scale exactly 1 (their max is the code range's top, 127 or 448)
    holding every midpoint between two neighbouring codes and the floats just below and above it,
    and the codes torch rounds them to (half to even): (rows, codes [n, 64] in the pool's storage dtype)."""
    from trtpaged.kv_quant import CODE_MAX, STORAGE_DTYPES

    top = CODE_MAX[kv_cache_dtype]
    if kv_cache_dtype == "int8":
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    below, above = torch.nextafter(mids, grid[:-1]), torch.nextafter(mids, grid[1:])
    values = torch.cat([mids, below, above])
    values = torch.cat([values, torch.zeros(-values.numel() % 63)]).reshape(-1, 63)
    rows = torch.cat([torch.full((values.shape[0], 1), top), values], dim=1)
    codes = torch.round(rows).to(torch.int8) if kv_cache_dtype == "int8" else rows.to(torch.float8_e4m3fn)
    assert codes.dtype == STORAGE_DTYPES[kv_cache_dtype]
    return rows, codes


def write_rows(kernels, rows: torch.Tensor, pool: torch.Tensor) -> None:
    """Writes rows [n, D] as the K and V of n tokens of one sequence (one kv head, layer 0) into pool
    [blocks, 1, 2, 1, block_size, D + 2] through the attention kernel of rows' device."""
    n, device = rows.shape[0], rows.device
    i32 = torch.int32
    kv = rows[:, None, :].contiguous()
    blocks = pool.shape[0]
    kernels.paged_attention(kv, kv, kv, pool, torch.arange(n, dtype=i32, device=device),
                            torch.tensor([0, n], dtype=i32, device=device), torch.tensor([n], dtype=i32, device=device),
                            torch.arange(blocks, dtype=i32, device=device)[None, :],
                            kernels.AttentionOptions(0, 0.125))  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
