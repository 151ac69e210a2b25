"""Sampling kernels (CPU): the greedy fast path's argmax and logsumexp of chosen rows in one pass."""

from __future__ import annotations

import torch

from trtpaged.kernels._library import KernelError, _check, _dense_f32, library


def has_greedy_rows() -> bool:
    """True when the library has trtpaged_greedy_rows_cpu (an older one lacks it)."""
    return hasattr(library(), "trtpaged_greedy_rows_cpu")


def greedy_rows(logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, logsumexp) of logits[rows] (float32 CPU [*, vocab], rows int64 in range) in one pass.
    Ties go to the first index, as torch.argmax. Raises KernelError when the library lacks the op
    (has_greedy_rows says so)."""
    fn = getattr(library(), "trtpaged_greedy_rows_cpu", None)
    if fn is None:
        raise KernelError("greedy_rows", 2, "this kernel library predates the op; rebuild it")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [rows, vocab], got shape {tuple(logits.shape)}")
    _dense_f32(logits, "logits", logits.shape)
    if rows.dtype is not torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
        raise ValueError("rows: expected a contiguous 1-D int64 tensor")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise ValueError(f"rows: indices must be in [0, {logits.shape[0]})")
    n = rows.numel()
    argmax = torch.empty(n, dtype=torch.int64)
    lse = torch.empty(n, dtype=torch.float32)
    status = fn(logits.data_ptr(), logits.shape[1], rows.data_ptr(), n, argmax.data_ptr(), lse.data_ptr())
    if status:
        _check("greedy_rows", status)
    return argmax, lse
