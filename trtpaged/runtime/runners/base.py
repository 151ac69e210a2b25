"""The `ModelRunner` protocol: one packed step over the paged KV pool, whatever backend runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, Union, runtime_checkable

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
    num_kv_blocks: int

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

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The raw bytes of whole blocks (all layers, K and V, scales of a quantized pool), for the KV tiers."""
        ...

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Overwrites whole blocks with bytes `read_blocks` returned (from this engine), (block id, bytes) pairs."""
        ...


def pool_block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of a block-major pool."""
    return pool[0].numel() * pool.element_size() if pool.shape[0] else 0


def read_pool_blocks(pool: torch.Tensor, block_ids: Sequence[int]) -> list[bytes]:
    """`ModelRunner.read_blocks` over a block-major pool tensor: one gather, one device-to-host copy."""
    if not block_ids:
        return []
    index = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    rows = pool.index_select(0, index).cpu().reshape(len(block_ids), -1).view(torch.uint8).numpy()
    return [row.tobytes() for row in rows]


def write_pool_blocks(pool: torch.Tensor, blocks: Sequence[tuple[int, Union[bytes, bytearray]]]) -> None:
    """`ModelRunner.write_blocks` over a block-major pool tensor; every payload must be one block's bytes."""
    if not blocks:
        return
    size = pool_block_bytes(pool)
    for block_id, payload in blocks:
        if len(payload) != size:
            raise ValueError(f"write_blocks: block {block_id} payload is {len(payload)} bytes, blocks are {size}")
    flat = bytearray(b"".join(payload for _, payload in blocks))
    data = torch.frombuffer(flat, dtype=torch.uint8).view(pool.dtype).view(len(blocks), *pool.shape[1:])
    index = torch.tensor([b for b, _ in blocks], dtype=torch.long, device=pool.device)
    pool.index_copy_(0, index, data.to(pool.device))
