"""Plain PyTorch reference of paged attention: the independent truth kernels are tested against.

Deliberately simple: materialise each sequence's K/V from its blocks, run a
dense causal softmax attention in float64. Slow; never used on a hot path.
"""

from __future__ import annotations

import torch

from trtpaged.attention_options import AttentionOptions
from trtpaged.kv_quant import dequantize_rows, pack_rows, pool_kv_cache_dtype, quantize_rows


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    query_start: torch.Tensor,
    block_tables: torch.Tensor,
    layer: int,
) -> None:
    """Writes each token's K/V into its cache slot, one token at a time (quantized per row when the
    pool is int8/fp8_e4m3)."""
    block_size = kv_cache.shape[4]
    quantized = pool_kv_cache_dtype(kv_cache)

    def stored(x: torch.Tensor) -> torch.Tensor:
        return pack_rows(*quantize_rows(x, quantized)) if quantized else x.to(kv_cache.dtype)

    num_seqs = block_tables.shape[0]
    for s in range(num_seqs):
        for t in range(int(query_start[s]), int(query_start[s + 1])):
            pos = int(positions[t])
            block = int(block_tables[s, pos // block_size])
            kv_cache[block, layer, 0, :, pos % block_size, :] = stored(k[t])
            kv_cache[block, layer, 1, :, pos % block_size, :] = stored(v[t])


def gather_kv_reference(
    kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns one sequence's K and V as [context_len, num_kv_heads, head_dim] (float32 values of a
    quantized pool)."""
    block_size = kv_cache.shape[4]
    used = (context_len + block_size - 1) // block_size
    blocks = kv_cache[block_table[:used].long(), layer]  # [nb, 2, kvh, bs, d]
    if pool_kv_cache_dtype(kv_cache):
        blocks = dequantize_rows(blocks)
    k = blocks[:, 0].permute(0, 2, 1, 3).reshape(-1, blocks.shape[2], blocks.shape[4])
    v = blocks[:, 1].permute(0, 2, 1, 3).reshape(-1, blocks.shape[2], blocks.shape[4])
    return k[:context_len], v[:context_len]


def paged_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    positions: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
    options: AttentionOptions, *, max_context_len: int | None = None,
) -> torch.Tensor:
    """Writes the new K/V into layer `options.layer` of kv_cache (in place) and returns causal attention
    output with the options' scale, sliding window and logit soft-cap.

    Shapes follow the engine I/O contract (docs/architecture.md): q [T, H, D], k/v [T, KVH, D],
    kv_cache [num_kv_blocks, num_layers, 2, KVH, block_size, D]. Returns [T, H, D] in q.dtype.
    max_context_len is unused (accepted so the signature matches kernels.paged_attention).
    """
    layer, scale = options.layer, options.scale
    sliding_window, logit_softcap = options.sliding_window, options.logit_softcap
    write_kv_reference(k, v, kv_cache, positions, query_start, block_tables, layer)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for s in range(block_tables.shape[0]):
        lo, hi = int(query_start[s]), int(query_start[s + 1])
        if hi == lo:
            continue
        length = int(context_lens[s])
        first = max(0, int(positions[lo:hi].min()) - sliding_window + 1) if sliding_window > 0 else 0
        # blocks wholly before every query's window may have been returned to the pool: never read them
        block_size = kv_cache.shape[4]
        offset = first // block_size * block_size
        keys, values = gather_kv_reference(kv_cache, block_tables[s, offset // block_size:], length - offset, layer)
        keys = keys.double().repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[lo:hi].double(), keys) * scale
        if logit_softcap > 0:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        key_pos = torch.arange(keys.shape[0]) + offset
        query_pos = positions[lo:hi].long()[:, None]
        mask = key_pos[None, :] > query_pos  # [t, L]
        if sliding_window > 0:
            mask |= key_pos[None, :] <= query_pos - sliding_window
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = torch.einsum("htl,lhd->thd", probs, values).to(q.dtype)
    return out
