"""KV block copies: copy-on-write inside one pool (copy_blocks) and between pools, e.g. GPU <-> CPU
(swap_blocks)."""

from __future__ import annotations

from typing import Sequence, Union

import torch

from trtpaged.kernels._library import _check, _pool_blocks, _ptr, _stream, library

Pairs = Union[torch.Tensor, Sequence[Sequence[int]]]


def _pairs_array(pairs: Pairs, name: str = "pairs") -> torch.Tensor:
    """Block pairs as a contiguous host int32 tensor [n, 2]."""
    t = pairs if isinstance(pairs, torch.Tensor) else torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [n, 2] of (src, dst) block ids, got {tuple(t.shape)}")
    if t.numel() and t.dtype != torch.int32 and (t.min() < -(1 << 31) or t.max() >= 1 << 31):
        raise ValueError(f"{name}: block ids must fit in int32, got {int(t.max() if t.max() >= 1 << 31 else t.min())}")
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def _block_bytes(pool: torch.Tensor) -> int:
    return pool[0].numel() * pool.element_size() if pool.shape[0] else 0


def copy_blocks(kv_cache: torch.Tensor, pairs: Pairs) -> None:
    """Copy-on-write inside one pool: block src → block dst for each (src, dst), all layers."""
    if not isinstance(kv_cache, torch.Tensor) or not kv_cache.is_contiguous() or kv_cache.dim() < 2:
        raise ValueError("kv_cache: expected a contiguous block-major pool tensor")
    arr = _pairs_array(pairs)
    if arr.shape[0] == 0:
        return
    args = (_ptr(kv_cache), _pool_blocks(kv_cache, "kv_cache"), _block_bytes(kv_cache), _ptr(arr), arr.shape[0])
    lib = library()
    if kv_cache.device.type == "cpu":
        _check("copy_blocks", lib.trtpaged_copy_blocks_cpu(*args))
    else:
        _check("copy_blocks", lib.trtpaged_copy_blocks_cuda(*args, _stream(kv_cache.device)))


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: Pairs) -> None:
    """Copies block src of src_pool to block dst of dst_pool for each (src, dst), e.g. GPU ↔ CPU."""
    for name, t in (("src_pool", src_pool), ("dst_pool", dst_pool)):
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.dim() < 2:
            raise ValueError(f"{name}: expected a contiguous block-major pool tensor")
    if src_pool.shape[1:] != dst_pool.shape[1:] or src_pool.dtype != dst_pool.dtype:
        raise ValueError(
            f"dst_pool: block shape {tuple(dst_pool.shape[1:])} {dst_pool.dtype} differs from src_pool's "
            f"{tuple(src_pool.shape[1:])} {src_pool.dtype}"
        )
    arr = _pairs_array(pairs)
    if arr.shape[0] == 0:
        return
    args = (_ptr(src_pool), _pool_blocks(src_pool, "src_pool"), _ptr(dst_pool), _pool_blocks(dst_pool, "dst_pool"),
            _block_bytes(src_pool))
    lib = library()
    if src_pool.device.type == "cpu" and dst_pool.device.type == "cpu":
        _check("swap_blocks", lib.trtpaged_swap_blocks_cpu(*args, _ptr(arr), arr.shape[0]))
    else:
        cuda_device = src_pool.device if src_pool.device.type == "cuda" else dst_pool.device
        _check("swap_blocks", lib.trtpaged_swap_blocks_cuda(*args, _ptr(arr), arr.shape[0], _stream(cuda_device)))
