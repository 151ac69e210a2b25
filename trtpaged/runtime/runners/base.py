"""The `ModelRunner` protocol: one packed step over the paged KV pool, whatever backend runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class StepBatch:
    """The step inputs of the engine I/O contract (docs/architecture.md), int32 tensors on the host."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start: torch.Tensor  # [num_seqs + 1]
    context_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], padded with 0
    logits_index: torch.Tensor  # [num_outputs]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@runtime_checkable
class ModelRunner(Protocol):
    """What the runtime needs from a backend (torch, TensorRT). It owns the KV pool (and the host pool for swap).

    "Engine" names the engine dir on disk; the object that runs it is a runner.
    """

    backend: str
    num_blocks: int

    def step(self, batch: StepBatch) -> torch.Tensor:
        """Runs one packed step, writing new K/V in place; returns float32 logits [num_outputs, vocab]."""
        ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies whole blocks (all layers) src -> dst inside the pool, in one batched call."""
        ...

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks to host blocks, (device, host) pairs."""
        ...

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies host blocks back to device blocks, (host, device) pairs."""
        ...
