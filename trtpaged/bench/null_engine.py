"""An `Engine` that runs no model: it lets the real scheduler and block pool replay a workload.

Every step returns the same logits, so greedy sampling always picks token 0; with
ignore_eos and max_tokens the output lengths are exactly the trace's. Only block
accounting and scheduling are exercised, which is what the memory benchmark measures.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from trtpaged.runtime.engines.base import StepBatch


class NullEngine:
    """Engine protocol without a model or a KV pool tensor (block moves are no-ops)."""

    backend = "null"

    def __init__(
        self, num_blocks: int, vocab_size: int = 2, on_step: Optional[Callable[[StepBatch], None]] = None
    ) -> None:
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.on_step = on_step  # sees each batch mid-step: blocks allocated, nothing freed yet

    def step(self, batch: StepBatch) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(batch)
        return torch.zeros(int(batch.logits_index.shape[0]), self.vocab_size)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass
