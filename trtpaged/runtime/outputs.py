"""What `LLM.generate` returns: one RequestOutput per prompt, one CompletionOutput per sample or beam."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    """One generated sequence. `token_ids` includes a final EOS token; `text` never shows it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float = 0.0
    logprobs: Optional[list[dict[int, float]]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", or None while running
    stop_reason: Optional[object] = None  # the stop string or token id that matched


@dataclass
class RequestOutput:
    """A request's prompt and its completions, sorted by index (beams: best first)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0
