"""Packs a scheduler output into the engine's step tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtpaged.runtime.runners.base import StepBatch
from trtpaged.runtime.kv_cache_manager import KVCacheManager
from trtpaged.runtime.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PromptRows:
    """The logits rows that score prompt tokens `first .. first + len(rows) - 1` of one request this step
    (a token's log-prob comes from the logits of the position before it)."""

    request_id: str
    first: int
    rows: list[int]


def build_step_batch(out: SchedulerOutput, kv: KVCacheManager) -> tuple[StepBatch, dict[int, int], list[PromptRows]]:
    """Returns the packed batch, the logits row of each sequence that samples, and the rows that score
    prompt tokens for requests that asked for prompt log-probs (`SamplingParams.prompt_logprobs`): the
    prefill chunk's own rows, so the scores come from the step that computes the prompt.

    A speculating sequence's chunk is its uncomputed token then its draft, and every position of it
    gets a logits row (in order, from the sequence's row on): row i verifies `draft[i]`.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    tables: list[list[int]] = []
    logits_index: list[int] = []
    rows: dict[int, int] = {}
    scored: list[PromptRows] = []
    for item in out.scheduled:
        end = item.start + item.num_tokens
        scores = item.group.prompt_logprobs
        if scores is not None and len(scores) < item.seq.num_prompt_tokens:
            # position p's logits score token p + 1; positions already scored (before a preemption) are skipped
            first, last = max(item.start, len(scores) - 1), min(end, item.seq.num_prompt_tokens - 1)
            if first < last:
                packed = len(input_ids) - item.start  # packed row of position 0 of this sequence
                start_row = len(logits_index)
                logits_index += range(packed + first, packed + last)
                scored.append(PromptRows(item.group.request_id, first + 1, list(range(start_row, len(logits_index)))))
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
    return batch, rows, scored
