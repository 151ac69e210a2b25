"""The all-reduce after a row-parallel layer: eager through torch.distributed, exported as one ONNX node.

- `RankReduce(rank, world_size, group)` is what a rank's step model calls
  after `o_proj` and `down_proj`: eagerly it sums the partial outputs of every
  rank in place through `group.all_reduce` (runtime/tp: gloo on CPU, NCCL on
  CUDA); while exporting it
  emits `torch.ops.trtpaged.all_reduce`, which the builder translates into a
  `TrtpagedAllReduce` node (builder/onnx_allreduce.py) that the TensorRT plugin
  runs over NCCL.
- `torch.ops.trtpaged.all_reduce` is functional (returns a new tensor); its
  eager form reduces over torch.distributed's default group, so an exported
  program stays runnable where a process group is initialised.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


@torch.library.custom_op("trtpaged::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Sum of `x` over the `world_size` ranks of the default process group (a new tensor)."""
    out = x.clone()
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("trtpaged::all_reduce: no torch.distributed process group is initialised")
        dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x, rank, world_size):
    return torch.empty_like(x)


class RankReduce:
    """Sums a row-parallel layer's partial output over the tensor-parallel ranks.

    `group` has `all_reduce(x)` summing x over the ranks in place
    (runtime/tp/rendezvous.py: Collectives); None: the model is only exported.
    """

    def __init__(self, rank: int, world_size: int, group: Optional[Any] = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: got {rank}; must be in [0, {world_size})")
        self.rank, self.world_size, self.group = rank, world_size, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():
            return torch.ops.trtpaged.all_reduce(x, self.rank, self.world_size)
        if self.group is None:
            raise RuntimeError(f"rank {self.rank} of {self.world_size}: no process group to all-reduce over")
        return self.group.all_reduce(x)
