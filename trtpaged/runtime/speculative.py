"""Speculative decoding: its configuration, the n-gram (prompt lookup) proposer, and its counters.

The draft-model proposer is `runtime/draft.py`.

A proposer guesses the next `k` tokens of a decoding sequence; the scheduler schedules the
sequence's last sampled token plus those guesses as one packed chunk of `1 + k` query tokens, the
sampler verifies them against the target's logits (`sampler.verify_run`), and the scheduler keeps
the accepted run and rolls the KV cache back past it (`KVCacheManager.truncate`). See
docs/speculative.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from trtpaged.json_input import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # per sequence and step; a verification step's rows grow with it
# Speculation is off in a step with this many decoding sequences or more (measured: docs/speculative.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# A sequence verifies drafts while its recent acceptance rate is at least this (measured: docs/speculative.md).
DEFAULT_MIN_ACCEPTANCE_RATE = 0.6
ACCEPTANCE_EMA = 0.2  # weight of the newest observation in a sequence's acceptance rate
# A draft-model sequence below the acceptance rate (no free shadow proposals) tries again after this many steps.
RETRY_AFTER_STEPS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (vLLM's `speculative_config` names).

    method: "ngram" (prompt lookup: the tokens that followed an earlier occurrence of the sequence's
    last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`; `ngram_propose`), or
    "draft_model" (`model`: another trtpaged engine dir with the target's tokenizer; runtime/draft.py).
    model: the draft engine dir (draft_model only).
    num_speculative_tokens: tokens proposed per sequence and step (1..16).
    disable_by_batch_size: a step with this many decoding sequences or more does not speculate
    (its verification rows would cost more than the weight reads they save); None: never off.
    min_acceptance_rate: a sequence whose recent acceptance rate (an exponential average over its
    verifications, and while it does not verify, of whether its proposal's first token was the one it
    then produced) is below this proposes nothing; 0: always propose. A draft model has no free shadow
    proposal: such a sequence rests `RETRY_AFTER_STEPS` steps, then verifies once more.
    """

    method: str = "ngram"
    model: Optional[str] = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: Optional[int] = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE

    def __post_init__(self) -> None:
        def _int(name: str, low: int, high: Optional[int] = None, optional: bool = False) -> None:
            value = getattr(self, name)
            if value is None and optional:
                return
            bad_type = not isinstance(value, int) or isinstance(value, bool)
            if bad_type or value < low or (high is not None and value > high):
                bound = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"speculative_config.{name}: must be an integer {bound}, got {value!r}")

        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: one of {list(METHODS)}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config.model: method draft_model needs the draft engine dir, "
                             f"got {self.model!r}")  # fmt: skip
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model: only for method draft_model (method is {self.method!r})")
        _int("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        _int("prompt_lookup_min", 1)
        _int("prompt_lookup_max", 1)
        _int("disable_by_batch_size", 1, optional=True)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate: must be a number in [0, 1], got {rate!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max}), got {self.prompt_lookup_min}")  # fmt: skip

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """A config from a JSON object text, a dict, or a config (None stays None); ValueError naming the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls(**json_object(value, "speculative_config", cls.__dataclass_fields__))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ngram_propose(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the last n tokens (longest n first): the latest
    occurrence followed by k tokens, else the earliest (the longest continuation there is).

    Model-free prompt lookup over the prompt and the output so far; [] when nothing matches. Preferring a
    full continuation matters for periodic text: the latest occurrence of a repeated token is the one right
    before it, followed by one token. It runs for every speculating sequence every step, so it is one
    vectorised scan for the last token; only those hits are checked for the longer n-grams.
    """
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    tokens = np.fromiter(token_ids, dtype=np.int64, count=length)
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # where an earlier n-gram would end
    if not ends.size:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        starts = ends[ends >= n - 1] - (n - 1)
        for back in range(1, n):  # the n-gram's earlier tokens, one offset at a time
            if not starts.size:
                break
            starts = starts[tokens[starts + n - 1 - back] == tokens[length - 1 - back]]
        if starts.size:
            full = starts[starts + n + k <= length]
            start = int(full[-1] if full.size else starts[0]) + n
            return tokens[start : start + k].tolist()
    return []


class AcceptanceTracker:
    """Each speculating sequence's recent acceptance rate, and whether it should verify drafts now.

    A verification updates the rate with accepted / proposed. A sequence below the threshold keeps a
    shadow proposal (free for n-gram lookup): whether its first token is the token the sequence then
    produced updates the rate too, so a sequence whose text turns to copying starts speculating again.
    """

    def __init__(self, min_rate: float) -> None:
        self.min_rate = min_rate
        self._rate: dict[int, float] = {}
        self._shadow: dict[int, int] = {}
        self._idle: dict[int, int] = {}

    def wants(self, seq_id: int) -> bool:
        return self._rate.get(seq_id, 1.0) >= self.min_rate

    def _update(self, seq_id: int, value: float) -> None:
        self._rate[seq_id] = (1 - ACCEPTANCE_EMA) * self._rate.get(seq_id, 1.0) + ACCEPTANCE_EMA * value

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        self._update(seq_id, accepted / proposed)

    def shadow(self, seq_id: int, first_token: int) -> None:
        self._shadow[seq_id] = first_token

    def rest(self, seq_id: int) -> None:
        """A step without a proposal for a sequence below the rate (a draft model's): after RETRY_AFTER_STEPS
        of them its rate is set to the threshold, so that the next verification decides."""
        idle = self._idle.get(seq_id, 0) + 1
        if idle >= RETRY_AFTER_STEPS:
            self._rate[seq_id], idle = self.min_rate, 0
        self._idle[seq_id] = idle

    def check_shadow(self, seq_id: int, produced: int) -> None:
        first = self._shadow.pop(seq_id, None)
        if first is not None:
            self._update(seq_id, float(first == produced))

    def forget(self, seq_id: int) -> None:
        self._rate.pop(seq_id, None)
        self._shadow.pop(seq_id, None)
        self._idle.pop(seq_id, None)


@dataclass
class SpecDecodeStats:
    """Counters over all steps (vLLM's spec_decode_* meanings): drafts proposed, draft tokens verified,
    draft tokens accepted (per position too), and steps speculation was turned off for the batch size."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_steps_disabled: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def to_stats(self) -> dict[str, float]:
        """The `LLMEngine.stats()` entries: counters, acceptance rate and mean accepted length (1 + accepted
        per draft: the tokens a verification step yields per sequence)."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        mean_len = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        per_pos = {f"spec_decode_num_accepted_tokens_per_pos_{i}": n for i, n in enumerate(self.accepted_per_pos)}
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_acceptance_rate": rate,
            "spec_decode_mean_acceptance_length": mean_len,
            "spec_decode_num_steps_disabled": self.num_steps_disabled,
            **per_pos,
        }
