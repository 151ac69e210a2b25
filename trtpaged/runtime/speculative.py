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
# A sequence never verifies drafts while its recent acceptance rate is below this (0: the cost rule alone decides).
DEFAULT_MIN_ACCEPTANCE_RATE = 0.0
# What one more query row adds to a one-row decode step, as a fraction of that step, where neither given nor set
# from the engine's arithmetic (runtime/verify_cost.py; an engine built without `LLM`).
DEFAULT_VERIFY_ROW_COST = 0.3
# A draft step costing more than this many one-row target steps is a configuration error, not a draft.
MAX_DRAFT_TOKEN_COST = 100.0
ACCEPTANCE_DECAY = 0.8  # a sequence's acceptance counts fade by this per verification (about its last 5)
# A draft-model sequence that does not pay (no free shadow proposals) probes one token after this many steps,
# twice as many after each probe that is rejected, up to MAX_RETRY_AFTER_STEPS.
RETRY_AFTER_STEPS = 16
MAX_RETRY_AFTER_STEPS = 256


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
    verify_row_cost: what one more query row adds to a one-row decode step, as a fraction of it. Below the
    batch-size cap a sequence verifies the number of draft tokens that maximises the step's expected tokens
    per unit of cost at its recent per-token acceptance rate (`best_draft_length`, the rule in
    docs/speculative.md), none when no number beats not speculating; 0: rows are free, always propose.
    None: the engine's kind (`default_verify_row_cost`: float weights 0.07, int8 activations 0.2, float
    activations on quantized weights 0.4, as measured), DEFAULT_VERIFY_ROW_COST where no engine sets it.
    draft_token_cost: draft_model only: what one draft step adds, as a fraction of a one-row target step;
    k draft tokens cost k draft steps on top of the verification (`best_draft_length`). None: estimated at
    load from the two engines' weight bytes (`estimate_draft_token_cost`); 0: the draft is free.
    min_acceptance_rate: a floor: a sequence whose recent acceptance rate is below it proposes nothing
    (0: none). A sequence that does not pay keeps a shadow proposal (n-gram lookup is free) whose first
    token updates its rate; a draft model has none, so such a sequence probes one token after
    `RETRY_AFTER_STEPS` steps, backing off twice as long after each rejected probe.
    """

    method: str = "ngram"
    model: Optional[str] = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    disable_by_batch_size: Optional[int] = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE
    verify_row_cost: Optional[float] = None
    draft_token_cost: Optional[float] = None

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
        cost = self.verify_row_cost
        bad_cost = isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0.0 <= cost <= 1.0
        if cost is not None and bad_cost:
            raise ValueError(f"speculative_config.verify_row_cost: must be a number in [0, 1], got {cost!r}")
        draft_cost = self.draft_token_cost
        if draft_cost is not None:
            if self.method != "draft_model":
                raise ValueError(f"speculative_config.draft_token_cost: only for method draft_model "
                                 f"(method is {self.method!r})")  # fmt: skip
            bad = isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float))
            if bad or not 0.0 <= draft_cost <= MAX_DRAFT_TOKEN_COST:
                raise ValueError(f"speculative_config.draft_token_cost: must be a number in "
                                 f"[0, {MAX_DRAFT_TOKEN_COST}], got {draft_cost!r}")  # fmt: skip
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

    @property
    def row_cost(self) -> float:
        """verify_row_cost, or DEFAULT_VERIFY_ROW_COST where it was neither given nor set for an engine."""
        return DEFAULT_VERIFY_ROW_COST if self.verify_row_cost is None else float(self.verify_row_cost)


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


def best_draft_length(rate: float, k_max: int, row_cost: float, num_decoding: int, draft_cost: float = 0.0) -> int:
    """The number of draft tokens, 0..k_max, that maximises a step's expected tokens per unit of cost.

    The step has `num_decoding` one-row sequences; a step of r rows costs 1 + row_cost * (r - 1) one-row
    steps; verifying k draft tokens whose acceptances are independent with probability `rate` adds k rows
    and yields rate + rate^2 + ... + rate^k tokens on average (a run stops at its first rejection), on top
    of the one token each sequence gets anyway. Proposing them costs k * `draft_cost` one-row steps (k draft
    model steps; 0 for n-gram lookup). 0 when no draft length beats the step without one.
    """
    best, best_value = 0, num_decoding / (1 + row_cost * (num_decoding - 1))
    expected, term = 0.0, 1.0
    for k in range(1, k_max + 1):
        term *= rate
        expected += term
        value = (num_decoding + expected) / (1 + row_cost * (num_decoding - 1 + k) + draft_cost * k)
        if value > best_value:
            best, best_value = k, value
    return best


def estimate_draft_token_cost(draft_weight_bytes: int, target_weight_bytes: int) -> float:
    """A draft step's cost in one-row target steps, estimated as the ratio of the weight bytes each engine
    holds: a decode step of one sequence streams its weights once, so an int4 draft of a float target
    costs a fraction of its step and a draft the size of the target costs a whole one (so it never pays)."""
    if target_weight_bytes <= 0:
        return 1.0
    return min(MAX_DRAFT_TOKEN_COST, draft_weight_bytes / target_weight_bytes)


class AcceptanceTracker:
    """Each speculating sequence's recent per-token acceptance rate, and how many draft tokens it verifies.

    A verification of k tokens of which a were accepted tried a + 1 tokens (the first rejected one
    included) or k (all accepted); the rate is accepted / tried over fading counts (ACCEPTANCE_DECAY per
    verification), starting at 1. `tokens` gives the draft tokens that pay (`best_draft_length`). A sequence at 0
    keeps a shadow proposal when proposing is free (n-gram): whether its first token is the token the
    sequence then produced counts as one tried token, so a sequence whose text turns to copying speculates
    again. Without shadows (a draft model) it probes one token after RETRY_AFTER_STEPS steps, and after
    each rejected probe waits twice as long (up to MAX_RETRY_AFTER_STEPS); where not even an always-accepted
    draft would pay (a draft as costly as the target), it does not probe.
    """

    def __init__(self, row_cost: float, min_rate: float = 0.0, draft_cost: float = 0.0) -> None:
        self.row_cost = row_cost
        self.min_rate = min_rate
        self.draft_cost = draft_cost
        self._counts: dict[int, tuple[float, float]] = {}  # seq id -> fading (accepted, tried)
        self._shadow: dict[int, int] = {}
        self._idle: dict[int, int] = {}
        self._wait: dict[int, int] = {}  # a resting sequence's steps between probes
        self._probing: set[int] = set()

    def rate(self, seq_id: int) -> float:
        accepted, tried = self._counts.get(seq_id, (1.0, 1.0))
        return accepted / tried

    def tokens(self, seq_id: int, k_max: int, num_decoding: int, free_shadow: bool = True) -> int:
        """How many of up to `k_max` draft tokens the sequence verifies in a step of `num_decoding` decoding
        sequences (`best_draft_length` at its rate; 0: none; without `free_shadow` a resting sequence counts
        the step and may get a one-token probe)."""
        rate = self.rate(seq_id)
        k = best_draft_length(rate, k_max, self.row_cost, num_decoding, self.draft_cost) if rate >= self.min_rate else 0
        if k or free_shadow or k_max < 1:
            self._idle.pop(seq_id, None)
            return k
        if best_draft_length(1.0, k_max, self.row_cost, num_decoding, self.draft_cost) == 0:
            return 0  # not even a draft that is always right would pay here: no probe
        idle = self._idle.get(seq_id, 0) + 1
        if idle < self._wait.get(seq_id, RETRY_AFTER_STEPS):
            self._idle[seq_id] = idle
            return 0
        self._idle.pop(seq_id, None)
        self._probing.add(seq_id)
        return 1

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        self._count(seq_id, accepted, accepted + 1 if accepted < proposed else proposed)
        if seq_id in self._probing:
            self._probing.discard(seq_id)
            wait = self._wait.get(seq_id, RETRY_AFTER_STEPS)
            self._wait[seq_id] = RETRY_AFTER_STEPS if accepted else min(2 * wait, MAX_RETRY_AFTER_STEPS)

    def _count(self, seq_id: int, accepted: float, tried: float) -> None:
        old_accepted, old_tried = self._counts.get(seq_id, (1.0, 1.0))
        self._counts[seq_id] = (ACCEPTANCE_DECAY * old_accepted + accepted, ACCEPTANCE_DECAY * old_tried + tried)

    def shadow(self, seq_id: int, first_token: int) -> None:
        self._shadow[seq_id] = first_token

    def check_shadow(self, seq_id: int, produced: int) -> None:
        first = self._shadow.pop(seq_id, None)
        if first is not None:
            self._count(seq_id, float(first == produced), 1.0)

    def forget(self, seq_id: int) -> None:
        for table in (self._counts, self._shadow, self._idle, self._wait):
            table.pop(seq_id, None)
        self._probing.discard(seq_id)


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
