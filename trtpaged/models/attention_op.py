"""The paged-attention op as torch custom ops, namespace `trtpaged`.

Two forms share one implementation:

- `eager_attention(...)` is what the eager step model (torch backend) calls:
  it mutates `kv_cache` in place (the pool, possibly GBs, is never copied) and
  checks the step's index tensors once per step rather than once per layer.
  It is a plain call, not a torch op: a Python custom op's dispatch would cost
  more than the attention itself at decode.
- `torch.ops.trtpaged.paged_attention` is functional: it returns the output and
  an updated copy of the pool. Only the ONNX export uses it, because the
  exporter needs a pure op to translate into one graph node per layer; its
  shape attributes travel as op arguments so that the translation can write
  them as node attributes.

The math runs in the compiled kernel library (`trtpaged.kernels`); the plain torch
reference (`trtpaged.reference`) only where the step's execution plan asks for it (tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from trtpaged.attention_options import AttentionOptions
from trtpaged.kv_quant import STORAGE_DTYPES, is_quantized
from trtpaged.reference import paged_attention_reference


@dataclasses.dataclass(frozen=True)
class Functional:
    """Tells the step model's layers to call the functional op (export) over a pool whose format is
    kv_cache_dtype: "auto" (the pool tensor's float dtype), or "int8" / "fp8_e4m3" for a pool of int8 bytes
    (trtpaged.kv_quant's layout; the graph's pool is int8 for both, the node attribute says which)."""

    kv_cache_dtype: str = "auto"


def eager_attention(
    kv_cache: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
    block_tables: torch.Tensor, num_heads: int, max_context_len: Optional[int] = None, reference: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionOptions], torch.Tensor]:
    """One step's attention for the eager step model: `attend(q, k, v, options) -> out`, which writes k/v
    into their cache slots of layer `options.layer` (in place) and returns causal paged attention [T, H, D].

    The step's index tensors are checked once here, not once per layer (kernels.AttentionStep);
    `reference`: the plain torch reference instead (tests)."""
    if not reference:
        from trtpaged import kernels

        return kernels.AttentionStep(kv_cache, positions, query_start, context_lens, block_tables, num_heads,
                                     max_context_len)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        return paged_attention_reference(q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
                                         options)

    return attend


@torch.library.custom_op("trtpaged::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    positions: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    layer: int, scale: float, kv_cache_dtype: str = "auto", sliding_window: int = 0, logit_softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional form for export: returns (output [T, H, D], updated copy of kv_cache). kv_cache_dtype
    "int8" / "fp8_e4m3": kv_cache holds that format's rows as bytes (Functional); sliding_window and
    logit_softcap as in AttentionOptions (0: none): torch custom ops take plain arguments only."""
    new_cache = kv_cache.clone()
    pool = new_cache.view(STORAGE_DTYPES[kv_cache_dtype]) if is_quantized(kv_cache_dtype) else new_cache
    from trtpaged import kernels

    options = AttentionOptions(layer, scale, sliding_window, logit_softcap)
    out = kernels.paged_attention(q, k, v, pool, positions, query_start, context_lens, block_tables, options)
    return out, new_cache


@paged_attention.register_fake
def _paged_attention_functional_fake(
    q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
    num_heads, num_kv_heads, head_dim, block_size, layer, scale, kv_cache_dtype="auto", sliding_window=0,
    logit_softcap=0.0,
):
    return torch.empty_like(q), torch.empty_like(kv_cache)
