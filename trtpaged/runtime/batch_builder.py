"""Packs a scheduler output into the engine's step tensors."""

from __future__ import annotations

from dataclasses import dataclass


from trtpaged.runtime.runners.base import StepBatch, StepPacker
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

    A step of one sequence with one uncomputed token (a decode step, with or without a draft) is marked
    `row_invariant`: its rows then get the logits of one-row decode steps, so speculation does not change a
    single stream's greedy output (docs/speculative.md). Steps of several sequences keep the faster arithmetic.
    """
    step = StepPacker()
    logits_index = step.logits_index
    rows: dict[int, int] = {}
    scored: list[PromptRows] = []
    for item in out.scheduled:
        end = item.start + item.num_tokens
        scores = item.group.prompt_logprobs
        if scores is not None and len(scores) < item.seq.num_prompt_tokens:
            # position p's logits score token p + 1; positions already scored (before a preemption) are skipped
            first, last = max(item.start, len(scores) - 1), min(end, item.seq.num_prompt_tokens - 1)
            if first < last:
                packed = len(step.input_ids) - item.start  # packed row of position 0 of this sequence
                start_row = len(logits_index)
                logits_index += range(packed + first, packed + last)
                scored.append(PromptRows(item.group.request_id, first + 1, list(range(start_row, len(logits_index)))))
        tokens = item.seq.token_ids[item.start : end - len(item.draft)] + list(item.draft)
        step.add(tokens, item.start, kv.block_table(item.seq))
        if item.sample:
            rows[item.seq.seq_id] = len(logits_index)
            logits_index += range(len(step.input_ids) - 1 - len(item.draft), len(step.input_ids))
    one = out.scheduled[0] if len(out.scheduled) == 1 else None
    return step.batch(row_invariant=one is not None and one.num_tokens - len(one.draft) == 1), rows, scored
