"""A numpy implementation of the TrtpagedPagedAttention node for onnx.reference.ReferenceEvaluator.

Independent of the torch op and of the kernel library: it is what lets the
build verify the exported graph on any CPU. Accumulates in float32.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from trtpaged.builder.onnx_node import DOMAIN


def paged_attention_numpy(q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
                          *, layer: int, block_size: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Returns (out [T, H, D] in q.dtype, updated copy of kv_cache)."""
    cache = kv_cache.copy()
    positions = positions.astype(np.int64)
    seq_of_token = np.repeat(np.arange(len(context_lens)), np.diff(query_start))
    blocks = block_tables[seq_of_token, positions // block_size]
    slots = positions % block_size
    cache[blocks, layer, 0, :, slots, :] = k.astype(cache.dtype)
    cache[blocks, layer, 1, :, slots, :] = v.astype(cache.dtype)
    num_heads, num_kv_heads, head_dim = q.shape[1], cache.shape[3], q.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape, dtype=np.float32)
    for s in range(len(context_lens)):
        lo, hi, length = int(query_start[s]), int(query_start[s + 1]), int(context_lens[s])
        if hi == lo:
            continue
        nb = -(-length // block_size)
        kv = cache[block_tables[s, :nb], layer].astype(np.float32)  # [nb, 2, KVH, bs, D]
        keys = kv[:, 0].transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:length]
        values = kv[:, 1].transpose(0, 2, 1, 3).reshape(-1, num_kv_heads, head_dim)[:length]
        qs = q[lo:hi].astype(np.float32).reshape(hi - lo, num_kv_heads, group, head_dim)
        scores = np.einsum("tkgd,lkd->tkgl", qs, keys) * np.float32(scale)
        masked = np.arange(length)[None, :] > positions[lo:hi, None]  # [t, L]
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
             plugin_version=None, plugin_namespace=None):
        return paged_attention_numpy(q, k, v, kv_cache, positions, query_start, context_lens, block_tables,
                                     layer=int(layer), block_size=int(block_size), scale=float(scale))

