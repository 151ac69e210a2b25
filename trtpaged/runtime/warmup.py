"""The load-time warm-up step: what a first batch would pay, paid before `LLM(...)` returns.

A step at the engine's largest shape (max_num_tokens rows, max_batch_size logits rows) pays at load
what the first real batch otherwise pays: the kernel library's per-thread scratch grown to its
largest size and its pages first touched, the allocator's arenas grown (glibc raises its mmap
threshold after the first large free), the lazily packed LM head, the OpenMP pool started. vLLM's
engine makes the same kind of dummy forward at start-up (its profile run). The step writes K/V into
free blocks, which are zeroed again afterwards: nothing of it is visible to a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trtpaged.runtime.runners.base import ModelRunner, StepBatch
from trtpaged.runtime.runtime_config import RuntimeConfig


@dataclass(frozen=True)
class WarmupShape:
    """The warm-up step's sequences: token counts, one logits row each."""

    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def warmup_shape(config: RuntimeConfig) -> WarmupShape:
    """max_num_tokens tokens (fewer only where the pool or max_seq_len cannot hold them) over
    max_batch_size sequences, as evenly as possible, each sequence on its own blocks."""
    bs = config.block_size
    seqs = min(config.max_batch_size, config.max_num_tokens, config.num_kv_blocks)
    tokens = min(config.max_num_tokens, seqs * config.max_seq_len)

    def lengths(total: int) -> list[int]:
        return [total // seqs + (1 if i < total % seqs else 0) for i in range(seqs)]

    # each sequence needs ceil(len / bs) blocks of its own; shrink until the pool holds them all
    while tokens > seqs and sum(math.ceil(n / bs) for n in lengths(tokens)) > config.num_kv_blocks:
        tokens -= max(1, (tokens - seqs) // 8)
    return WarmupShape(tuple(lengths(tokens)))


def warmup_batch(config: RuntimeConfig) -> tuple[StepBatch, list[int]]:
    """The warm-up step's inputs (token id 0 everywhere) and the blocks it writes."""
    shape = warmup_shape(config)
    bs = config.block_size
    positions: list[int] = []
    query_start = [0]
    tables: list[list[int]] = []
    logits_index: list[int] = []
    next_block = 0
    for n in shape.lengths:
        positions += range(n)
        query_start.append(len(positions))
        logits_index.append(len(positions) - 1)
        used = math.ceil(n / bs)
        tables.append(list(range(next_block, next_block + used)))
        next_block += used
    batch = StepBatch.pack([0] * len(positions), positions, query_start, shape.lengths, tables, logits_index)
    return batch, list(range(next_block))


def decode_batch(prefill: StepBatch) -> StepBatch:
    """One decode-shaped step after `prefill`: each of its sequences runs its last position again (one
    token, a logits row), on the same blocks."""
    lengths = prefill.context_lens.tolist()
    tables = prefill.block_tables.tolist()
    n = len(lengths)
    return StepBatch.pack([0] * n, [length - 1 for length in lengths], list(range(n + 1)), lengths, tables,
                          list(range(n)))


def warm_up(runner: ModelRunner, config: RuntimeConfig) -> int:
    """Runs the warm-up step on `runner` (all its blocks must be free), then one decode step of as many
    sequences (the first decode batch's kernels and shapes: at 16 rows a quantized linear may take
    another path than at the prefill's thousands), and zeroes the blocks they wrote; returns the
    warm-up step's token count."""
    batch, blocks = warmup_batch(config)
    runner.step(batch)
    runner.step(decode_batch(batch))
    pool = getattr(runner, "kv_cache", None)
    if isinstance(pool, torch.Tensor) and blocks:
        pool[blocks[0] : blocks[-1] + 1].zero_()
    return batch.num_tokens
