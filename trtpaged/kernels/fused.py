"""Fused element-wise ops of the eager step model (CPU, float32): rmsnorm, rope_qk, silu_mul.

Like qlinear, each runs several times per layer per decode step: the checks are the few that keep
the kernel in bounds, each a cheap attribute read, and the C function is looked up once.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Union

import torch

from trtpaged.kernels._library import _check, _dense_f32, library


def has_fused_ops() -> bool:
    """True when the library has the fused CPU ops (rmsnorm, rope_qk, silu_mul)."""
    return hasattr(library(), "trtpaged_rmsnorm_cpu")


@functools.lru_cache(maxsize=1)
def _fused_fns() -> tuple[Callable[..., int], Callable[..., int], Callable[..., int]]:
    lib = library()
    return lib.trtpaged_rmsnorm_cpu, lib.trtpaged_rope_qk_cpu, lib.trtpaged_silu_mul_cpu


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """HF Llama's RMSNorm over the last dimension of x [rows, hidden] (float32 CPU):
    weight * x * rsqrt(mean(x^2) + eps).

    With residual: h = x + residual, returns (rmsnorm(h), h); h is written to residual_out (default:
    into residual, in place). Without: returns rmsnorm(x). out may be x.
    """
    if x.dim() != 2:
        raise ValueError(f"x: expected [rows, hidden], got shape {tuple(x.shape)}")
    shape = x.shape
    _dense_f32(x, "x", shape)
    _dense_f32(weight, "weight", (shape[1],))
    if out is None:
        out = torch.empty_like(x)
    else:
        _dense_f32(out, "out", shape)
    fn = _fused_fns()[0]
    if residual is None:
        if residual_out is not None:
            raise ValueError("residual_out: only with residual")
        status = fn(x.data_ptr(), None, weight.data_ptr(), eps, shape[0], shape[1], out.data_ptr(), None)
        if status:
            _check("rmsnorm", status)
        return out
    _dense_f32(residual, "residual", shape)
    if residual_out is None:
        residual_out = residual
    else:
        _dense_f32(residual_out, "residual_out", shape)
    status = fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, shape[0], shape[1], out.data_ptr(),
                residual_out.data_ptr())
    if status:
        _check("rmsnorm", status)
    return out, residual_out


def rope_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dense: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF rotate-half RoPE on the q and k heads of qkv [rows, (H + 2 * KVH) * D] (float32 CPU); cos/sin [rows, D].

    dense=False: rotates in place and returns qkv. dense=True: qkv is left as it is and the dense
    rotated q [rows, H, D], rotated k and a copy of v [rows, KVH, D] are returned in new tensors,
    ready for the attention kernel.
    """
    if qkv.dim() != 2:
        raise ValueError(f"qkv: expected [rows, (num_heads + 2 * num_kv_heads) * head_dim], got {tuple(qkv.shape)}")
    rows = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    _dense_f32(qkv, "qkv", (rows, q_size + 2 * kv_size))
    _dense_f32(cos, "cos", (rows, head_dim))
    _dense_f32(sin, "sin", (rows, head_dim))
    fn = _fused_fns()[1]
    if not dense:
        status = fn(qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                    None, None, None)
        if status:
            _check("rope_qk", status)
        return qkv
    # three allocations cost less than views of one buffer (split + view: ~4 torch calls more)
    q = torch.empty((rows, num_heads, head_dim), dtype=torch.float32)
    k = torch.empty((rows, num_kv_heads, head_dim), dtype=torch.float32)
    v = torch.empty((rows, num_kv_heads, head_dim), dtype=torch.float32)
    status = fn(qkv.data_ptr(), rows, num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                q.data_ptr(), k.data_ptr(), v.data_ptr())
    if status:
        _check("rope_qk", status)
    return q, k, v


def silu_mul(gate_up: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * I] (float32 CPU, gate first in each row); returns [rows, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [rows, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    _dense_f32(gate_up, "gate_up", gate_up.shape)
    if out is None:
        out = torch.empty((rows, intermediate), dtype=torch.float32)
    else:
        _dense_f32(out, "out", (rows, intermediate))
    status = _fused_fns()[2](gate_up.data_ptr(), rows, intermediate, out.data_ptr())
    if status:
        _check("silu_mul", status)
    return out
