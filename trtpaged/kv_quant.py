"""Quantized KV cache (int8, fp8_e4m3): the pool layout and a plain PyTorch codec.

Layout (the C ABI's, plugins/include/trtpaged/trtpaged.h): the pool keeps the block-major shape
[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim + 4] with one-byte elements. Each
token row of one head holds head_dim codes followed by the row's float32 scale (4 bytes), and the
value is code * scale:

- int8: scale = max|x| / 127, code = round-half-even(x / scale)
- fp8_e4m3: scale = max|x| / 448, code = e4m3fn(x / scale) (round to nearest even)

A scale per token and head (rather than per block) is written once with its token, so appending a
larger value never re-quantizes a block's earlier rows; it costs 4 bytes per row (6% at head_dim 64).
The scales live inside the block, so block copy, swap and copy-on-write move them with the codes.
The pool's torch dtype names the format: torch.int8 for int8, torch.float8_e4m3fn for fp8_e4m3
(the 4 scale bytes of a row are not fp8 values; read them with `split_rows`).
"""

from __future__ import annotations

import torch

QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")
SCALE_BYTES = 4
STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
CODE_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_BY_STORAGE = {v: k for k, v in STORAGE_DTYPES.items()}


def is_quantized(kv_dtype: str) -> bool:
    """True for the quantized KV dtypes (int8, fp8_e4m3)."""
    return kv_dtype in QUANTIZED_KV_DTYPES


def pool_kv_dtype(pool: torch.Tensor) -> str | None:
    """The quantized KV dtype a pool tensor holds, or None for a float pool."""
    return _BY_STORAGE.get(pool.dtype)


def row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements in the last dimension of the pool: head_dim, plus the scale's bytes when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(kv_dtype) else head_dim


def quantize_rows(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., D] (storage dtype) and float32 scales [...] of rows x [..., D], as the kernels do."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / CODE_MAX[kv_dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(scale[..., None] > 0, x / safe[..., None], torch.zeros_like(x))
    codes = torch.round(y).clamp(-127, 127).to(torch.int8) if kv_dtype == "int8" else y.to(torch.float8_e4m3fn)
    return codes, scale


def pack_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows [..., D + 4] of the pool from codes [..., D] and float32 scales [...]."""
    scale_bytes = scales.float().contiguous().view(torch.uint8).reshape(*scales.shape, SCALE_BYTES)
    return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1).view(codes.dtype)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., D], float32 scales [...]) of pool rows [..., D + 4]."""
    raw = rows.contiguous().view(torch.uint8)
    codes = raw[..., :-SCALE_BYTES].contiguous().view(rows.dtype)
    scales = raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]
    return codes, scales


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32 values [..., D] of quantized pool rows [..., D + 4] (int8 or fp8_e4m3 storage)."""
    codes, scales = split_rows(rows)
    return codes.float() * scales[..., None]


def dequantize_pool(pool: torch.Tensor) -> torch.Tensor:
    """The pool's values as float32 [..., block_size, head_dim], whatever its KV dtype."""
    return dequantize_rows(pool) if pool_kv_dtype(pool) else pool.float()
