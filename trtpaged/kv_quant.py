"""Quantized KV cache (int8, fp8_e4m3): the pool layout and a plain PyTorch codec.

Layout (the C ABI's, plugins/include/trtpaged/trtpaged.h): the pool keeps the block-major shape
[num_kv_blocks, num_layers, 2, num_kv_heads, block_size, head_dim + 2] with one-byte elements. Each
token row of one head holds head_dim codes followed by the row's scale as fp16 (2 bytes), and the
value is code * scale, scale = fp16(max|x| / M), codes made with the stored scale:

- int8: M = 127, code = clamp(round-half-even(x / scale), -127, 127)
- fp8_e4m3: M = 448, code = e4m3fn(x / scale) (round to nearest even)

A scale per token and head (rather than per block) is written once with its token, so appending a
larger value never re-quantizes a block's earlier rows; it costs 2 bytes per row (3% at head_dim 64:
1.94x the tokens of an fp16 cache in the same bytes, 3.88x those of fp32). An fp32 scale would cost
4 bytes (1.88x fp16). Codes are made with the stored fp16 scale, so its rounding only matters when
it rounds down and the row's largest value clamps: at most 2^-11 of max|x|, against the int8 step's
half of 1/127. A row holding a NaN is stored as a NaN scale and zero codes (int8 has no NaN code):
it reads back as NaN rather than as plausible numbers. A scale past fp16's range is clamped to
65504 and the codes saturate.
The scales live inside the block, so block copy, swap and copy-on-write move them with the codes.
The pool's torch dtype names the format: torch.int8 for int8, torch.float8_e4m3fn for fp8_e4m3
(the 2 scale bytes of a row are not codes; read them with `split_rows`).
"""

from __future__ import annotations

import torch

from trtpaged.kv_formats import QUANTIZED_KV_CACHE_DTYPES, SCALE_BYTES, kv_format
SCALE_DTYPE = torch.float16
STORAGE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
CODE_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_BY_STORAGE = {v: k for k, v in STORAGE_DTYPES.items()}
_NAN_SCALE_BITS = 0x7E00  # the fp16 quiet NaN the kernels store as a NaN row's scale


def is_quantized(kv_cache_dtype: str) -> bool:
    """True for the quantized KV dtypes (int8, fp8_e4m3)."""
    return kv_cache_dtype in QUANTIZED_KV_CACHE_DTYPES


def pool_kv_cache_dtype(pool: torch.Tensor) -> str | None:
    """The quantized KV dtype a pool tensor holds, or None for a float pool."""
    return _BY_STORAGE.get(pool.dtype)


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements in the last dimension of the pool: head_dim, plus the scale's bytes when quantized."""
    return kv_format(kv_cache_dtype).row_elements(head_dim)


def quantize_rows(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., D] (storage dtype) and scales [...] (float32 holding the stored fp16 values) of rows
    x [..., D], as the kernels make them. A row holding a NaN gets the quiet NaN scale (fp16 0x7e00) and
    zero codes, so that it reads back as NaN; infinities saturate like any value past the range."""
    x = x.float()
    amax = x.abs().nan_to_num(nan=0.0).amax(dim=-1)
    scale = (amax / CODE_MAX[kv_cache_dtype]).clamp(max=65504.0).to(SCALE_DTYPE).float()
    scale = torch.where(x.isnan().any(dim=-1), torch.tensor(float("nan")), scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.where(scale[..., None] > 0, x / safe[..., None], torch.zeros_like(x))
    if kv_cache_dtype == "int8":
        codes = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale


def pack_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows [..., D + 2] of the pool from codes [..., D] and scales [...] (rounded to fp16)."""
    bits = scales.to(SCALE_DTYPE).contiguous().view(torch.int16)
    bits = torch.where(scales.isnan(), torch.tensor(_NAN_SCALE_BITS, dtype=torch.int16), bits)  # torch's NaN bits vary
    scale_bytes = bits.view(torch.uint8).reshape(*scales.shape, SCALE_BYTES)
    return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1).view(codes.dtype)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [..., D], scales [...] as float32) of pool rows [..., D + 2]."""
    raw = rows.contiguous().view(torch.uint8)
    codes = raw[..., :-SCALE_BYTES].contiguous().view(rows.dtype)
    scales = raw[..., -SCALE_BYTES:].contiguous().view(SCALE_DTYPE)[..., 0].float()
    return codes, scales


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32 values [..., D] of quantized pool rows [..., D + 2] (int8 or fp8_e4m3 storage)."""
    codes, scales = split_rows(rows)
    return codes.float() * scales[..., None]
