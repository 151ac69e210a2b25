"""The `ModelRunner` protocol: one packed step over the paged KV pool, whatever backend runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch


STEP_HINTS = ("row_invariant",)  # StepBatch's fields that are not engine inputs


@dataclass(frozen=True)
class StepBatch:
    """The step inputs of the engine I/O contract (docs/architecture.md), int32 tensors on the host, then the
    step's hints (`STEP_HINTS`): how an eager backend may compute, not graph inputs."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start: torch.Tensor  # [num_seqs + 1]
    context_lens: torch.Tensor  # [num_seqs]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], padded with 0
    logits_index: torch.Tensor  # [num_outputs]
    # hint: the step decodes one sequence, so a backend whose rows' results can depend on the rows run with
    # them computes each row as a step of that row alone would (LlamaStepModel.forward's `row_invariant`)
    row_invariant: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def pack(cls, input_ids: Sequence[int], positions: Sequence[int], query_start: Sequence[int],
             context_lens: Sequence[int], tables: Sequence[Sequence[int]], logits_index: Sequence[int],
             row_invariant: bool = False) -> "StepBatch":
        """The batch of these lists, block tables padded with 0 to the longest."""
        width = max((len(t) for t in tables), default=0)
        # row by row into a zeroed array: a third of the time of padding Python lists for torch.tensor
        padded = np.zeros((len(tables), width), dtype=np.int32)
        for row, table in zip(padded, tables):
            row[: len(table)] = table
        i32 = torch.int32
        return cls(
            input_ids=torch.tensor(input_ids, dtype=i32),
            positions=torch.tensor(positions, dtype=i32),
            query_start=torch.tensor(query_start, dtype=i32),
            context_lens=torch.tensor(context_lens, dtype=i32),
            block_tables=torch.from_numpy(padded),
            logits_index=torch.tensor(logits_index, dtype=i32),
            row_invariant=row_invariant,
        )



class StepPacker:
    """Collects sequences' chunks, one after another, into the lists `StepBatch.pack` takes."""

    def __init__(self) -> None:
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.query_start: list[int] = [0]
        self.context_lens: list[int] = []
        self.tables: list[list[int]] = []
        self.logits_index: list[int] = []

    def add(self, tokens: Sequence[int], start: int, table: list[int]) -> None:
        """One sequence's chunk: `tokens` at positions `start ..`, its KV read through `table`."""
        self.input_ids += tokens
        self.positions += range(start, start + len(tokens))
        self.query_start.append(len(self.input_ids))
        self.context_lens.append(start + len(tokens))
        self.tables.append(table)

    def batch(self, row_invariant: bool = False) -> StepBatch:
        return StepBatch.pack(self.input_ids, self.positions, self.query_start, self.context_lens, self.tables,
                              self.logits_index, row_invariant)  # fmt: skip

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

    def failure(self) -> Optional[str]:
        """Why the runner can no longer step though no step has failed yet (a tensor-parallel rank that exited),
        or None: what a health check reports."""
        ...


def pool_block_bytes(pool: torch.Tensor) -> int:
    """Bytes of one block of a block-major pool."""
    return pool[0].numel() * pool.element_size() if pool.shape[0] else 0


SwapFn = Callable[[torch.Tensor, torch.Tensor, list[tuple[int, int]]], None]


class BlockStaging:
    """Host rows in a pool's block layout through which whole blocks travel between the pool and the KV tiers
    (`ModelRunner.read_blocks` / `write_blocks`), moved by the runner's swap copy `swap(src_pool, dst_pool,
    pairs)`: the copy preemption by swap uses, so tiers and swapping share one block-transfer path. On a CUDA
    pool the rows are pinned (page-locked): the copies are DMA transfers with no pageable bounce buffer. The
    rows grow to the largest batch seen and are reused."""

    def __init__(self, swap: SwapFn) -> None:
        self._swap = swap
        self._rows: Optional[torch.Tensor] = None
        self._copied: Optional[Any] = None  # a CUDA event: the last write's copy out of the rows is done

    def _take(self, pool: torch.Tensor, n: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the rows are the previous write's source until its copy ran
            self._copied = None
        rows = self._rows
        if rows is None or rows.shape[0] < n or rows.shape[1:] != pool.shape[1:] or rows.dtype != pool.dtype:
            pin = pool.device.type == "cuda" and torch.cuda.is_available()
            size = max(n, 2 * rows.shape[0] if rows is not None and rows.shape[1:] == pool.shape[1:] else n)
            rows = self._rows = torch.empty((size, *pool.shape[1:]), dtype=pool.dtype, pin_memory=pin)
        return rows

    @staticmethod
    def _bytes_view(rows: torch.Tensor, n: int):
        return rows[:n].reshape(n, -1).view(torch.uint8).numpy()

    def read(self, pool: torch.Tensor, block_ids: Sequence[int]) -> list[bytes]:
        """The raw bytes of whole blocks of `pool`."""
        n = len(block_ids)
        if not n:
            return []
        rows = self._take(pool, n)
        self._swap(pool, rows, [(int(b), i) for i, b in enumerate(block_ids)])
        if pool.device.type == "cuda":
            torch.cuda.current_stream(pool.device).synchronize()
        return [row.tobytes() for row in self._bytes_view(rows, n)]

    def write(self, pool: torch.Tensor, blocks: Sequence[tuple[int, Union[bytes, bytearray]]]) -> None:
        """Overwrites whole blocks of `pool`; every payload must be one block's bytes."""
        if not blocks:
            return
        size = pool_block_bytes(pool)
        for block_id, payload in blocks:
            if len(payload) != size:
                raise ValueError(f"write_blocks: block {block_id} payload is {len(payload)} bytes, blocks are {size}")
        rows = self._take(pool, len(blocks))
        view = self._bytes_view(rows, len(blocks))
        for i, (_, payload) in enumerate(blocks):
            view[i] = np.frombuffer(payload, dtype=np.uint8)
        self._swap(rows, pool, [(i, int(b)) for i, (b, _) in enumerate(blocks)])
        if pool.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(pool.device))
