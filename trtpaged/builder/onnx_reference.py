"""A numpy implementation of the TrtpagedPagedAttention node for onnx.reference.ReferenceEvaluator.

Independent of the torch op and of the kernel library: it is what lets the
build verify the exported graph on any CPU. Accumulates in float32. A quantized
pool (kv_cache_dtype int8 / fp8_e4m3, int8 bytes) is written and read through
trtpaged.kv_quant's plain PyTorch codec.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx.reference.op_run import OpRun

from trtpaged.builder.onnx_node import DOMAIN
from trtpaged.kv_quant import STORAGE_DTYPES, dequantize_rows, is_quantized, pack_rows, quantize_rows


def _stored(x: np.ndarray, cache: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """Rows x [..., D] as the pool stores them: cast, or quantized rows of D + 2 bytes."""
    if not is_quantized(kv_cache_dtype):
        return x.astype(cache.dtype)
    return pack_rows(*quantize_rows(torch.from_numpy(np.ascontiguousarray(x)), kv_cache_dtype)).view(torch.int8).numpy()


def _values(rows: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """float32 values of pool rows (de-quantized with each row's scale when quantized)."""
    if not is_quantized(kv_cache_dtype):
        return rows.astype(np.float32)
    return dequantize_rows(torch.from_numpy(np.ascontiguousarray(rows)).view(STORAGE_DTYPES[kv_cache_dtype])).numpy()


def paged_attention_numpy(q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
                          *, layer: int, block_size: int, scale: float, kv_cache_dtype: str = "auto",
                          sliding_window: int = 0, logit_softcap: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Returns (out [T, H, D] in q.dtype, updated copy of kv_cache); sliding_window / logit_softcap > 0 as the
    node's attributes say (onnx_node.py)."""
    cache = kv_cache.copy()
    positions = positions.astype(np.int64)
    seq_of_token = np.repeat(np.arange(len(context_lens)), np.diff(query_start))
    blocks = block_tables[seq_of_token, positions // block_size]
    slots = positions % block_size
    cache[blocks, layer, 0, :, slots, :] = _stored(k, cache, kv_cache_dtype)
    cache[blocks, layer, 1, :, slots, :] = _stored(v, cache, kv_cache_dtype)
    num_heads, num_kv_heads, head_dim = q.shape[1], cache.shape[3], q.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, dtype=np.float32)
    for s in range(len(context_lens)):
        lo, hi, length = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        if hi == lo:
            continue
        nb = -(-length // block_size)
        kv = _values(cache[block_tables[s, :nb], layer], kv_cache_dtype)  # [nb, 2, KVH, bs, D]
        keys = kv[:, 0].transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:length]
        values = kv[:, 1].transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:length]
        qs = q[lo:hi].astype(np.float32).reshape(hi - lo, num_kv_heads, group, head_dim)
        scores = np.einsum("tkgd,lkd->tkgl", qs, keys) * np.float32(scale)
        if logit_softcap > 0:
            scores = np.tanh(scores / np.float32(logit_softcap)) * np.float32(logit_softcap)
        masked = np.arange(length)[None, :] > positions[lo:hi, None]  # [t, L]
        if sliding_window > 0:
            masked |= np.arange(length)[None, :] <= positions[lo:hi, None] - sliding_window
        scores = np.where(masked[:, None, None, :], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out[lo:hi] = np.einsum("tkgl,lkd->tkgd", probs, values).reshape(hi - lo, num_heads, head_dim)
    return out.astype(q.dtype), cache


class TrtpagedPagedAttention(OpRun):
    """ReferenceEvaluator op for the trtpaged node (pass it in `new_ops`; matched by class name == OP_TYPE)."""

    op_domain = DOMAIN

    def _run(self, q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
             num_heads=None, num_kv_heads=None, head_dim=None, block_size=None, layer=None, scale=None,
             kv_cache_dtype=None, plugin_version=None, plugin_namespace=None, kv_pool=None, num_layers=None,
             sliding_window=None, logit_softcap=None):
        kv_cache_dtype = kv_cache_dtype.decode() if isinstance(kv_cache_dtype, bytes) else (kv_cache_dtype or "auto")
        typed = kv_cache.dtype
        if is_quantized(kv_cache_dtype):  # the pool's bytes, typed int8 or fp16 pairs (tensorrt.quantized_pool)
            kv_cache = kv_cache.view(np.int8)
        out, cache = paged_attention_numpy(q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
                                           layer=int(layer), block_size=int(block_size), scale=float(scale),
                                           kv_cache_dtype=kv_cache_dtype, sliding_window=int(sliding_window or 0),
                                           logit_softcap=float(logit_softcap or 0.0))
        return out, cache.view(typed)

