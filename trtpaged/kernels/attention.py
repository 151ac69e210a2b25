"""Paged attention: one call (paged_attention, every tensor checked) or a step's calls layer after
layer (AttentionStep, the per-step work done once)."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from trtpaged.attention_options import AttentionOptions
from trtpaged.kernels._library import (
    _DTYPE_CODES,
    _KV_CACHE_DTYPE_CODES,
    _AttentionOptions,
    _AttentionParams,
    _check,
    _pool_blocks,
    _pool_head_dim,
    _ptr,
    _require,
    _stream,
    library,
)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    positions: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
    options: AttentionOptions, *, out: Optional[torch.Tensor] = None, max_context_len: Optional[int] = None,
) -> torch.Tensor:
    """Writes the step's K/V into layer `options.layer` of kv_cache (in place) and returns causal paged
    attention with the options' scale, sliding window and logit soft-cap.

    q [T, H, D], k/v [T, KVH, D] (one dtype), kv_cache [num_kv_blocks, num_layers, 2, KVH,
    block_size, D] (float), or [..., block_size, D + 2] int8 / float8_e4m3fn for a quantized cache
    (trtpaged.kv_quant), positions [T], query_start [S+1], context_lens [S], block_tables
    [S, max_blocks] (int32). Returns out [T, H, D] in q.dtype. On CUDA, max_context_len
    (an upper bound of context_lens) avoids a device sync when given.
    """
    float_dtypes = tuple(_DTYPE_CODES)
    index_dtypes = (torch.int32,)
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    device = q.device
    _require(q, "q", ndim=3, dtypes=float_dtypes, device=device)
    _require(k, "k", ndim=3, dtypes=(q.dtype,), device=device)
    _require(v, "v", ndim=3, dtypes=(q.dtype,), device=device)
    _require(kv_cache, "kv_cache", ndim=6, dtypes=tuple(_KV_CACHE_DTYPE_CODES), device=device)
    _require(positions, "positions", ndim=1, dtypes=index_dtypes, device=device)
    _require(query_start, "query_start", ndim=1, dtypes=index_dtypes, device=device)
    _require(context_lens, "context_lens", ndim=1, dtypes=index_dtypes, device=device)
    _require(block_tables, "block_tables", ndim=2, dtypes=index_dtypes, device=device)
    num_tokens, num_heads, head_dim = q.shape
    _, num_layers, two, num_kv_heads, block_size, _ = kv_cache.shape
    num_kv_blocks = _pool_blocks(kv_cache, "kv_cache")
    cache_head_dim = _pool_head_dim(kv_cache)
    num_seqs = block_tables.shape[0]
    if two != 2:
        raise ValueError(f"kv_cache: dimension 2 must be 2 (K and V), got shape {tuple(kv_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"kv_cache: head_dim {cache_head_dim} differs from q's {head_dim}")
    expected_kv = (num_tokens, num_kv_heads, head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected_kv:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {expected_kv} (tokens, kv heads, head_dim)")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions: {positions.shape[0]} entries, expected num_tokens = {num_tokens}")
    if query_start.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start: {query_start.shape[0]} entries, expected num_seqs + 1 = {num_seqs + 1}")
    if context_lens.shape[0] != num_seqs:
        raise ValueError(f"context_lens: {context_lens.shape[0]} entries, expected num_seqs = {num_seqs}")
    if out is None:
        out = torch.empty_like(q)
    else:
        _require(out, "out", ndim=3, dtypes=(q.dtype,), device=device)
        if out.shape != q.shape:
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    params = _AttentionParams(
        num_tokens, num_seqs, block_tables.shape[1], num_heads, num_kv_heads, head_dim,
        num_kv_blocks, num_layers, options.layer, block_size, options.scale, _DTYPE_CODES[q.dtype],
        _KV_CACHE_DTYPE_CODES[kv_cache.dtype],
    )  # fmt: skip
    lib = library()
    opts = ctypes.byref(_c_options(options))
    pointers = [_ptr(t) for t in (q, k, v, kv_cache, positions, query_start, context_lens, block_tables, out)]
    if device.type == "cpu":
        _check("paged_attention", lib.trtpaged_paged_attention_ex_cpu(ctypes.byref(params), opts, *pointers))
    elif device.type == "cuda":
        if max_context_len is None:
            max_context_len = int(context_lens.max().item()) if num_seqs else 0
        size = lib.trtpaged_paged_attention_cuda_workspace_size(ctypes.byref(params), max_context_len)
        workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else None
        status = lib.trtpaged_paged_attention_ex_cuda(
            ctypes.byref(params), opts, *pointers, max_context_len,
            _ptr(workspace) if workspace is not None else None, size, _stream(device),
        )  # fmt: skip
        _check("paged_attention", status)
    else:
        raise ValueError(f"q: device {device} not supported (cpu or cuda)")
    return out


def _c_options(options: AttentionOptions) -> _AttentionOptions:
    """The C ABI's trtpaged_attention_options of `options` (checked when they were made)."""
    if not isinstance(options, AttentionOptions):
        raise ValueError(f"options: expected an AttentionOptions, got {type(options).__name__}")
    return _AttentionOptions(options.sliding_window, float(options.logit_softcap))


class AttentionStep:
    """One step's paged attention, layer after layer, with the per-step work done once.

    `paged_attention` checks every tensor on every call; a step calls it once
    per layer with the same index tensors and pool. This checks those once and
    keeps the call's parameters, so that each layer costs one C call:
    `step(q, k, v, options) -> out` (options: the layer's AttentionOptions). q/k/v must be dense, of one float
    dtype, on the pool's device, with num_tokens rows of num_heads (q) or num_kv_heads (k, v) x head_dim elements
    (checked cheaply per call: the kernel reads and writes that many).
    """

    def __init__(self, kv_cache: torch.Tensor, positions: torch.Tensor, query_start: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, num_heads: int,
                 max_context_len: Optional[int] = None) -> None:
        device = kv_cache.device
        _require(kv_cache, "kv_cache", ndim=6, dtypes=tuple(_KV_CACHE_DTYPE_CODES), device=device)
        for name, t, ndim in (("positions", positions, 1), ("query_start", query_start, 1),
                              ("context_lens", context_lens, 1), ("block_tables", block_tables, 2)):
            _require(t, name, ndim=ndim, dtypes=(torch.int32,), device=device)
        _, num_layers, _, num_kv_heads, block_size, _ = kv_cache.shape
        num_kv_blocks = _pool_blocks(kv_cache, "kv_cache")
        head_dim = _pool_head_dim(kv_cache)
        num_seqs = block_tables.shape[0]
        if query_start.shape[0] != num_seqs + 1 or context_lens.shape[0] != num_seqs:
            raise ValueError(f"query_start/context_lens: {query_start.shape[0]}/{context_lens.shape[0]} entries for "
                             f"{num_seqs} sequences")
        self.num_tokens, self.device = int(positions.shape[0]), device
        # elements per row the kernel reads of q (and writes of out), and of k and v
        self._row_sizes = (num_heads * head_dim, num_kv_heads * head_dim)
        self._params = _AttentionParams(
            self.num_tokens, num_seqs, block_tables.shape[1], num_heads, num_kv_heads, head_dim,
            num_kv_blocks, num_layers, 0, block_size, 1.0, _DTYPE_CODES[torch.float32],
            _KV_CACHE_DTYPE_CODES[kv_cache.dtype],
        )  # fmt: skip
        self._params_ref = ctypes.byref(self._params)
        self._tensors = (kv_cache, positions, query_start, context_lens, block_tables)  # keeps them alive
        self._pointers = tuple(t.data_ptr() for t in self._tensors)
        lib = library()
        self._workspace: Optional[torch.Tensor] = None
        # id(options) -> (options, its C struct, a pointer to it); options kept, so its id stays its own
        self._options: dict[int, tuple[AttentionOptions, _AttentionOptions, object]] = {}
        if device.type == "cpu":
            self._fn = lib.trtpaged_paged_attention_ex_cpu
        elif device.type == "cuda":
            self._fn = lib.trtpaged_paged_attention_ex_cuda
            if max_context_len is None:
                max_context_len = int(context_lens.max().item()) if num_seqs else 0
            self._max_context_len = max_context_len
        else:
            raise ValueError(f"kv_cache: device {device} not supported (cpu or cuda)")

    def _options_ref(self, options: AttentionOptions) -> object:
        entry = self._options.get(id(options))  # a layer passes its one options object: no hashing of fields
        if entry is None:
            opts = _c_options(options)
            entry = self._options[id(options)] = (options, opts, ctypes.byref(opts))
        return entry[2]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or q.shape[0] != self.num_tokens:
            raise ValueError(f"q/k/v: expected dense tensors with {self.num_tokens} rows")
        if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPE_CODES:
            raise ValueError(f"q/k/v: one float dtype expected, got {q.dtype}, {k.dtype}, {v.dtype}")
        q_row, kv_row = self._row_sizes
        rows = self.num_tokens
        if q.numel() != rows * q_row or k.numel() != rows * kv_row or v.numel() != rows * kv_row:
            raise ValueError(f"q/k/v: {rows} rows of {q_row} (num_heads x head_dim) / {kv_row} (num_kv_heads x "
                             f"head_dim) elements expected, got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}")
        if not (q.device == k.device == v.device == self.device):
            raise ValueError(f"q/k/v: on {self.device} expected, got {q.device}, {k.device}, {v.device}")
        p = self._params
        p.layer, p.scale, p.io_dtype = options.layer, options.scale, _DTYPE_CODES[q.dtype]
        out = torch.empty_like(q)
        cache, positions, query_start, context_lens, block_tables = self._pointers
        args = (self._params_ref, self._options_ref(options), q.data_ptr(), k.data_ptr(),
                v.data_ptr(), cache, positions, query_start,
                context_lens, block_tables, out.data_ptr())
        if self.device.type == "cpu":
            status = self._fn(*args)
        else:
            size = library().trtpaged_paged_attention_cuda_workspace_size(self._params_ref, self._max_context_len)
            if size and (self._workspace is None or self._workspace.numel() < size):
                self._workspace = torch.empty(size, dtype=torch.uint8, device=self.device)
            ws = self._workspace.data_ptr() if size and self._workspace is not None else None
            status = self._fn(*args, self._max_context_len, ws, size, _stream(self.device))
        if status:
            _check("paged_attention", status)
        return out
