"""What `LLM.generate` returns: one RequestOutput per prompt, one CompletionOutput per sample or beam."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

if TYPE_CHECKING:
    import torch


class Logprob(float):
    """One token's log-probability in `logprobs` / `prompt_logprobs`: a float to every reader, with vLLM's
    `Logprob` fields: `logprob` (the same value), `rank` (the token's place in the model's distribution, 1 = the
    most likely; tokens of equal log-prob count as ahead, and a top-k entry has its place there, as vLLM reports
    them) and `decoded_token` (the token's text alone; None without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")  # 56 bytes a value, not a float's 24 plus a dict's 300

    def __new__(cls, logprob: float, rank: Optional[int] = None, decoded_token: Optional[str] = None) -> "Logprob":
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:  # a copy or pickle keeps the fields
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    __str__ = float.__repr__


def vocab_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """Per row of `logprobs` [rows, vocab], the rank of the log-prob in `chosen` [rows, 1]: how many tokens have a
    log-prob at least as high (itself included; ties count as ahead, as vLLM counts them)."""
    return (logprobs >= chosen).sum(dim=1).tolist()


def ranked(ids: Sequence[int], values: Sequence[float]) -> Iterator[tuple[int, Logprob]]:
    """A top-k list (most likely first) as (token, Logprob) with each token's place there as its rank."""
    return ((t, Logprob(v, place)) for place, (t, v) in enumerate(zip(ids, values), start=1))


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step()` returns for a request (as vLLM's `RequestOutputKind`).

    CUMULATIVE: every step, the full text and tokens so far (the default).
    DELTA: every step, only what is new since the last output: the text and token ids
    (and log-probs) generated this step; completions with nothing new are left out.
    Beam search returns nothing until it finishes (beams change until then).
    FINAL_ONLY: one output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class CompletionOutput:
    """One generated sequence. `token_ids` includes a final EOS token; `text` never shows it. `logprobs`: per
    output token, {token id: `Logprob`} for the sampled token and the top-k."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None  # the sum of its tokens' log-probs; None without `logprobs` (vLLM)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort", "error", or None while running
    stop_reason: Optional[object] = None  # the stop string or token id that matched
    lora_request: None = None  # vLLM's field; trtpaged serves no LoRA adapters

    def finished(self) -> bool:
        """Whether this sequence has ended (vLLM's method)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions, sorted by index (beams: best first)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0  # times this request was preempted (all its sequences at once)
    num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache (None: not scheduled yet)
    error: Optional[str] = None  # why the request failed inside a step (then finished, finish_reason "error")
    error_field: Optional[str] = None  # the request field at fault, when the request's own settings caused it
    # SamplingParams.prompt_logprobs: per prompt token {token: log-prob, + top-k}, None for the first token and any
    # whose logits were not finite (each a `scoring.PromptLogprob`: its `.rank` is the prompt token's rank, 1 = most
    # likely); set once the whole prompt is
    # computed (DELTA outputs: in the first output after that only)
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    # vLLM's fields without a counterpart here (no LoRA adapters; no per-request metrics object: `LLM.stats()` has
    # the counters), so that code reading them finds None
    metrics: None = None
    lora_request: None = None
