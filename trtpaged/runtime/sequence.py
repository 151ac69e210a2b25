"""One token sequence of a request: its tokens, how many are in the KV cache, its output state."""

from __future__ import annotations

import copy
import enum
from typing import Optional

import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens; `num_computed_tokens` of them have K/V in the cache.

    Invariant while unfinished: `num_computed_tokens < len(token_ids)`; the next
    step computes `token_ids[num_computed_tokens:]` (a prefill chunk, or the one
    token sampled last step), and sampling happens once all are computed.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0) -> None:
        self.seq_id = seq_id
        self.index = index  # position among the request's outputs
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None  # the stop string or token id that ended it
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        self.output_text = ""
        self.detokenizer = None  # an IncrementalDetokenizer, set by the output processor
        self.generator: Optional[torch.Generator] = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float = 0.0, top_logprobs: Optional[dict[int, float]] = None) -> None:
        """Adds a sampled token; its K/V is computed next step."""
        self.token_ids.append(int(token_id))
        self.cumulative_logprob += float(logprob)
        if top_logprobs is not None:
            self.logprobs.append(top_logprobs)

    def finish(self, reason: str, stop_reason: Optional[object] = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def fork(self, seq_id: int, index: int) -> "Sequence":
        """A copy with a new id and no detokenizer or RNG; K/V blocks are shared by the KV-cache manager."""
        child = copy.copy(self)
        child.seq_id, child.index = seq_id, index
        child.token_ids = list(self.token_ids)
        child.logprobs = list(self.logprobs)
        child.detokenizer = None
        child.generator = None
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
