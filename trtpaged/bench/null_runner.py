"""A `ModelRunner` that runs no model: it lets the real scheduler and block pool replay a workload.

Its logits are a fixed function of each output row's input token and position (a stand-in
model with deterministic logits), so beam search forks and prunes beams the same way on
every run, and parallel samples diverge; with ignore_eos and max_tokens the output lengths
are exactly the trace's. Only block accounting and scheduling are exercised, which is what
the memory benchmark measures.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

from trtpaged.runtime.runners.base import StepBatch


def stand_in_logits(tokens: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] logits that depend only on (token, position): a deterministic stand-in model."""
    v = torch.arange(vocab_size, dtype=torch.float64)
    phase = tokens.to(torch.float64)[:, None] * 1.618 + positions.to(torch.float64)[:, None] * 0.377
    return (3.0 * torch.sin(phase * (v + 1.0) + v * 2.399)).to(torch.float32)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch (and so its OpenMP runtime) on one thread within the block, as many as before after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class NullRunner:
    """A `ModelRunner` (runtime/runners/base.py) without a model or a KV pool tensor (block moves are no-ops)."""

    backend = "null"

    def __init__(
        self, num_kv_blocks: int, vocab_size: int = 8, on_step: Optional[Callable[[StepBatch], None]] = None
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.on_step = on_step  # sees each batch mid-step: blocks allocated, nothing freed yet

    def step(self, batch: StepBatch) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(batch)
        rows = batch.logits_index.long()
        return stand_in_logits(batch.input_ids[rows], batch.positions[rows], self.vocab_size)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return [b""] * len(block_ids)  # no pool: a KV tier replay keeps only the entries' headers

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        pass

    def failure(self) -> Optional[str]:
        return None
