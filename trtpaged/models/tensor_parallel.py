"""Splitting a step model over tensor-parallel ranks (Megatron-style): dims, weights and quantization plan.

Rank r of N holds query heads [r*H/N, (r+1)*H/N), KV heads [r*KVH/N, (r+1)*KVH/N)
(the KV heads those query heads read, since N divides KVH) and MLP columns
[r*I/N, (r+1)*I/N):

- column-parallel (split by outputs): `qkv_proj` (its q, k and v parts each
  split along head boundaries, then fused again) and `gate_up_proj` (gate and up
  each split, then fused again), with their biases;
- row-parallel (split by inputs): `o_proj` and `down_proj`; their outputs are
  partial sums that the ranks all-reduce; a bias is kept by rank 0 only (zeros
  elsewhere), so it is added once;
- replicated: the embedding, the norms and the LM head.

Quantized weights split the same way: codes, scales and offsets by output rows,
or by input columns on group boundaries (a per-channel int8 scale is shared by
every column slice of its row, so it is replicated).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from trtpaged.manifest import ModelDims

COLUMN_PARALLEL = ("self_attn.qkv_proj", "mlp.gate_up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
QUANT_ALIGN = 32  # the CPU quantized kernels take inputs in multiples of 32
QuantPlan = dict[str, tuple[int, int]]


def check_tensor_parallel(dims: ModelDims, n: int, plan: Optional[QuantPlan] = None) -> Optional[str]:
    """Why `dims` (quantized as `plan`) cannot be split over `n` ranks, naming the key and the limit; or None."""
    if n == 1:
        return None
    for name, size in (("num_attention_heads", dims.num_heads), ("num_key_value_heads", dims.num_kv_heads),
                       ("intermediate_size", dims.intermediate_size)):
        if size % n:
            return (f"tensor_parallel: {n} does not divide the model's {name} {size}; "
                    f"use a divisor of {size} that also divides the others")
    for module, group in _row_parallel_groups(plan or {}):
        full = dims.num_heads * dims.head_dim if module.endswith("o_proj") else dims.intermediate_size
        per_rank = full // n
        name = "num_heads * head_dim" if module.endswith("o_proj") else "intermediate_size"
        if group != full and per_rank % group:
            return (f"quantization.group_size: {group} does not divide {module}'s inputs per rank "
                    f"({name} {full} / tensor_parallel {n} = {per_rank}); row-parallel shards must split on group "
                    "boundaries: pick a smaller group_size or another tensor_parallel")
        if per_rank % QUANT_ALIGN:
            return (f"tensor_parallel: {n} leaves {module} {per_rank} inputs per rank ({name} {full} / {n}); "
                    f"the quantized kernels need a multiple of {QUANT_ALIGN}")
    return None


def _row_parallel_groups(plan: QuantPlan) -> list[tuple[str, int]]:
    """(module, group_size) of the first quantized o_proj and down_proj (every layer has the same shapes)."""
    out = []
    for suffix in ROW_PARALLEL:
        found = sorted(m for m in plan if m.endswith(suffix))
        if found:
            out.append((found[0], plan[found[0]][1]))
    return out


def shard_dims(dims: ModelDims, n: int) -> ModelDims:
    """The dims of one rank's step model: H/N heads, KVH/N KV heads, I/N MLP columns (head_dim kept)."""
    if n == 1:
        return dims
    reason = check_tensor_parallel(dims, n)
    if reason:
        raise ValueError(reason)
    return dataclasses.replace(dims, num_heads=dims.num_heads // n, num_kv_heads=dims.num_kv_heads // n,
                               intermediate_size=dims.intermediate_size // n)


def shard_plan(plan: QuantPlan, dims: ModelDims, n: int) -> QuantPlan:
    """One rank's quantization plan: a per-channel int8 row-parallel module's group is its inputs per rank."""
    out = dict(plan)
    for module, (bits, group) in plan.items():
        if module.endswith(ROW_PARALLEL):
            full = _row_inputs(module, dims)
            if group == full:
                out[module] = (bits, full // n)
    return out


def _row_inputs(module: str, dims: ModelDims) -> int:
    return dims.num_heads * dims.head_dim if module.endswith("o_proj") else dims.intermediate_size


def _column_parts(module: str, dims: ModelDims) -> tuple[int, ...]:
    """Output rows of each fused part, in order (q, k, v or gate, up)."""
    if module.endswith("qkv_proj"):
        kv = dims.num_kv_heads * dims.head_dim
        return (dims.num_heads * dims.head_dim, kv, kv)
    return (dims.intermediate_size, dims.intermediate_size)


def _split_columns(t: torch.Tensor, parts: tuple[int, ...], rank: int, n: int) -> torch.Tensor:
    """Rank's slice of every fused part along dim 0, fused again."""
    pieces = t.split(parts, dim=0)
    return torch.cat([p.chunk(n, dim=0)[rank] for p in pieces]).contiguous()


def _split_rows(name: str, t: torch.Tensor, rank: int, n: int, group_full: bool) -> torch.Tensor:
    """Rank's slice of a row-parallel tensor along its inputs (dim 1); biases to rank 0 only."""
    kind = name.rsplit(".", 1)[1]
    if kind == "bias":
        return t.clone() if rank == 0 else torch.zeros_like(t)
    if kind == "scales" or kind == "offsets":
        if group_full:  # per-channel: one scale per row, shared by every slice
            return t.clone()
    return t.chunk(n, dim=1)[rank].contiguous()


def shard_state(state: dict[str, torch.Tensor], dims: ModelDims, n: int, rank: int,
                plan: Optional[QuantPlan] = None) -> dict[str, torch.Tensor]:
    """One rank's step-model state from the full one (float or quantized tensors, step-model names)."""
    if n == 1:
        return dict(state)
    plan = plan or {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if module.endswith(COLUMN_PARALLEL):
            out[name] = _split_columns(t, _column_parts(module, dims), rank, n)
        elif module.endswith(ROW_PARALLEL):
            group = plan.get(module, (0, 0))[1]
            out[name] = _split_rows(name, t, rank, n, group == _row_inputs(module, dims))
        else:
            out[name] = t
    return out
