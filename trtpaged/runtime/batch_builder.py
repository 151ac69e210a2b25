"""Packs a scheduler output into the engine's step tensors."""

from __future__ import annotations

import torch

from trtpaged.runtime.runners.base import StepBatch
from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.scheduler import SchedulerOutput


def build_step_batch(out: SchedulerOutput, kv: KVCacheManager) -> tuple[StepBatch, dict[int, int]]:
    """Returns the packed batch and, for each sequence whose logits come back, its (first) logits row.

    A speculating sequence's chunk is its uncomputed token then its draft, and every position of it
    gets a logits row (in order, from the returned one on): row i verifies `draft[i]`.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    tables: list[list[int]] = []
    logits_index: list[int] = []
    rows: dict[int, int] = {}
    for item in out.scheduled:
        end = item.start + item.num_tokens
        if item.draft:
            input_ids += item.seq.token_ids[item.start : end - len(item.draft)]
            input_ids += item.draft
        else:
            input_ids += item.seq.token_ids[item.start : end]
        positions += range(item.start, end)
        query_start.append(len(input_ids))
        context_lens.append(end)
        tables.append(kv.block_table(item.seq))
        if item.sample:
            rows[item.seq.seq_id] = len(logits_index)
            logits_index += range(len(input_ids) - 1 - len(item.draft), len(input_ids))
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    i32 = torch.int32
    batch = StepBatch(
        input_ids=torch.tensor(input_ids, dtype=i32),
        positions=torch.tensor(positions, dtype=i32),
        query_start=torch.tensor(query_start, dtype=i32),
        context_lens=torch.tensor(context_lens, dtype=i32),
        block_tables=torch.tensor(padded, dtype=i32).reshape(len(tables), width),
        logits_index=torch.tensor(logits_index, dtype=i32),
    )
    return batch, rows
