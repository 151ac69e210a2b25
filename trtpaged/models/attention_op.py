"""The paged-attention op as torch custom ops, namespace `trtpaged`.

Two ops share one implementation:

- `torch.ops.trtpaged.paged_attention_` mutates `kv_cache` in place and returns
  only the attention output. The eager step model (torch backend) uses it: the
  pool (possibly GBs) is never copied.
- `torch.ops.trtpaged.paged_attention` is functional: it returns the output and
  an updated copy of the pool. Only the ONNX export uses it, because the
  exporter needs a pure op to translate into one graph node per layer; its
  shape attributes travel as op arguments so that the translation can write
  them as node attributes.

The math runs in the compiled kernel library (`trtpaged.kernels`) when it can
be loaded, otherwise in the plain torch reference (`trtpaged.reference`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch

from trtpaged.reference import paged_attention_reference


@functools.lru_cache(maxsize=1)
def _kernel() -> Callable[..., torch.Tensor]:
    """The fastest available implementation with the kernels.paged_attention signature."""
    from trtpaged import kernels

    try:
        kernels.library()
    except kernels.KernelError as exc:
        warnings.warn(f"{exc}; falling back to the slow torch reference attention", RuntimeWarning, stacklevel=2)
        return paged_attention_reference
    return kernels.paged_attention


def using_kernel_library() -> bool:
    """True when the eager op runs in the compiled kernel library, False for the torch reference."""
    return _kernel() is not paged_attention_reference


@torch.library.custom_op("trtpaged::paged_attention_", mutates_args=("kv_cache",))
def paged_attention_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    layer: int,
    scale: float,
    max_context_len: Optional[int] = None,
) -> torch.Tensor:
    """Writes k/v into their cache slots (in place) and returns causal paged attention [T, H, D].

    max_context_len (max of context_lens, computed once per step by the caller) spares the CUDA
    kernel a device sync per layer."""
    return _kernel()(
        q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
        layer=layer, scale=scale, max_context_len=max_context_len,
    )


@paged_attention_.register_fake
def _paged_attention_fake(
    q, k, v, kv_cache, positions, query_start, context_lens, block_tables, layer, scale, max_context_len=None
):
    return torch.empty_like(q)


@torch.library.custom_op("trtpaged::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    layer: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional form for export: returns (output [T, H, D], updated copy of kv_cache)."""
    new_cache = kv_cache.clone()
    out = _kernel()(
        q, k, v, new_cache, positions, query_start, context_lens, block_tables, layer=layer, scale=scale
    )
    return out, new_cache


@paged_attention.register_fake
def _paged_attention_functional_fake(
    q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
    num_heads, num_kv_heads, head_dim, block_size, layer, scale,
):
    return torch.empty_like(q), torch.empty_like(kv_cache)
