"""A request's token sequences: one `Sequence` per sample or beam, grouped by `SequenceGroup`."""

from __future__ import annotations

import copy
import enum
import hashlib
from typing import Any, Optional

import torch

from trtpaged.runtime.beam_search import BeamSearch
from trtpaged.runtime.sampling_params import SamplingParams

_SEED_STRIDE = 0x9E3779B1


def make_generator(seed: Optional[int], index: int, offset: int = 0) -> Optional[torch.Generator]:
    """A private RNG for output `index` of a seeded request: reproducible whatever else is batched. `offset`
    gives another stream of the same seed (the draft engine's)."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((_seed32(seed % 2**64) + index * _SEED_STRIDE + offset) % 2**32)


def _seed32(seed: int) -> int:
    """torch's CPU generator (mt19937) keeps a seed's low 32 bits only, so seeds 5 and 5 + 2**32 gave one stream: the
    high 32 bits are hashed into the low ones (a seed below 2**32 is kept as it is). Two seeds can still meet,
    by chance (2**-32 a pair), not by their form. The streams of seeds below 2**32 are those of before."""
    low, high = seed & 0xFFFFFFFF, seed >> 32
    if not high:
        return low
    mixed = int.from_bytes(hashlib.blake2b(high.to_bytes(4, "little"), digest_size=4).digest(), "little")
    return low ^ mixed


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class _Emitted:
    """How much of a sequence's output DELTA outputs have returned."""

    __slots__ = ("tokens", "chars", "final")

    def __init__(self) -> None:
        self.tokens = 0
        self.chars = 0
        self.final = False


class Sequence:
    """Prompt plus generated tokens; `num_computed_tokens` of them have K/V in the cache.

    Invariant while unfinished: `num_computed_tokens < len(token_ids)`; the next
    step computes `token_ids[num_computed_tokens:]` (a prefill chunk, or the one
    token sampled last step), and sampling happens once all are computed.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0,
                 cache_salt: Optional[str] = None) -> None:  # fmt: skip
        self.seq_id = seq_id
        self.cache_salt = cache_salt  # its request's: prefix-cache blocks are shared only under the same salt
        self.index = index  # position among the request's outputs
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None  # the stop string or token id that ended it
        self.cumulative_logprob = 0.0
        self.token_logprobs: list[float] = []  # each output token's log-prob (a cut run gives them back)
        self.logprobs: list[dict[int, float]] = []
        self.logprobs_named = 0  # entries of `logprobs` whose decoded_token the output processor has filled in
        self.output_text = ""
        self.detokenizer = None  # an IncrementalDetokenizer, set by the output processor
        self.num_decoded_tokens = 0  # output tokens already detokenized
        self.emitted = _Emitted()  # what DELTA outputs have already returned
        self.grammar: Optional[Any] = None  # an xgrammar matcher in step with the output (structured outputs)
        self.thinking: Optional[Any] = None  # a ThinkingBudget in step with the output (thinking_token_budget)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def output_tokens_from(self, start: int) -> list[int]:
        """The output tokens from index `start` on, without copying those before it (a step's new ones: slicing
        `output_token_ids` copied the whole output every step)."""
        return self.token_ids[self.num_prompt_tokens + start :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float = 0.0,
                     top_logprobs: Optional[dict[int, float]] = None) -> None:  # fmt: skip
        """Adds a sampled token; its K/V is computed next step."""
        self.token_ids.append(int(token_id))
        self.cumulative_logprob += float(logprob)
        self.token_logprobs.append(float(logprob))
        if top_logprobs is not None:
            self.logprobs.append(top_logprobs)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops the output tokens past the first `num_output_tokens` (a stop string ended a verified run
        before its last token); their log-probs leave the cumulative sum."""
        cut = self.num_prompt_tokens + num_output_tokens
        if cut >= len(self.token_ids):
            return
        del self.token_ids[cut:], self.token_logprobs[num_output_tokens:], self.logprobs[num_output_tokens:]
        self.logprobs_named = min(self.logprobs_named, len(self.logprobs))
        self.cumulative_logprob = sum(self.token_logprobs)  # the same additions, in order, as append_token's

    def finish(self, reason: str, stop_reason: Optional[object] = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def fork(self, seq_id: int, index: int) -> "Sequence":
        """A copy with a new id and no detokenizer; K/V blocks are shared by the KV-cache manager."""
        child = copy.copy(self)
        child.seq_id, child.index = seq_id, index
        child.token_ids = list(self.token_ids)
        child.logprobs = list(self.logprobs)
        child.token_logprobs = list(self.token_logprobs)
        child.detokenizer = None
        child.num_decoded_tokens = 0
        child.output_text = ""
        child.emitted = _Emitted()
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.thinking = self.thinking.fork() if self.thinking is not None else None
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={len(self.token_ids)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )


class SequenceGroup:
    """A request as the scheduler sees it: scheduled, preempted and freed as a whole.

    `seqs` holds the live sequences; `finished` the completed ones, which keep
    no KV blocks. The prompt is prefilled once; at its first sample the one
    sequence forks into `n` samples or becomes the first beam.
    """

    def __init__(
        self,
        request_id: str,
        arrival: int,
        prompt: Optional[str],
        first_seq: Sequence,
        params: SamplingParams,
        beam: Optional[BeamSearch] = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival  # admission order: lower is older
        self.priority = priority  # lower is served first; equal priorities by arrival (vLLM's priority policy)
        self.prompt = prompt
        self.prompt_token_ids = list(first_seq.token_ids)
        self.params = params
        self.seqs: list[Sequence] = [first_seq]
        self.finished: list[Sequence] = []
        self.beam = beam
        self.forked = False  # whether the first sample has happened (n > 1 forks there)
        # after a recompute preemption of several sequences: seq_id -> (an earlier sequence of the group, how
        # many of its first blocks hold tokens both have); the sequence waits for them and shares them
        self.pending_shares: dict[int, tuple[Sequence, int]] = {}
        # one RNG per output index of a seeded request, kept across preemption and batch changes
        self.generators: list[Optional[torch.Generator]] = [
            make_generator(params.seed, i) for i in range(params.n if beam is None else 0)
        ]
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens: Optional[int] = None  # prompt tokens found in the prefix cache when first scheduled
        self.error: Optional[str] = None  # why the request failed in a step (its sequences finish "error")
        self.error_field: Optional[str] = None  # the request field at fault, when its own settings caused it
        # the prompt tokens' log-probs as prefill steps compute them (the first token has none)
        self.prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False  # whether a DELTA output carried them
        self.prompt_logprobs_named = 0  # entries whose decoded_token the output processor has filled in
        self.bad_words: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token ids (set by the engine)
        self.min_tokens_banned: tuple[int, ...] = ()  # EOS and stop token ids, masked before params.min_tokens
        # monotonic times of its first: "queued", "ready" (prefix reads from KV tiers done), "scheduled",
        # "first_token"; the engine's TTFT breakdown (`LLMEngine.ttft_breakdown`)
        self.times: dict[str, float] = {}
        self.prefill_steps = 0  # steps that computed part of its prompt
        self.prefill_shared_tokens = 0  # tokens of other requests in those steps
        self.prefill_step_seconds = 0.0  # wall time of those steps (forward and the rest of the step)

    @property
    def scores_prompt(self) -> bool:
        """Prompt log-probs were asked for and not all are computed yet (the prompt takes no prefix-cache hits
        until then: a cached block's tokens have no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def set_status(self, status: SequenceStatus) -> None:
        self.status = status
        for seq in self.seqs:
            seq.status = status

    @property
    def num_engine_requests(self) -> int:
        """The engine requests vLLM v1 holds for this request now (its gauges and preemptions count these): one per
        live sample or beam; before the first sample, `n` (vLLM fans a parallel-sampling request out into `n` child
        requests up front) and one for beam search (its first step has one beam)."""
        return len(self.seqs) if self.forked or self.beam is not None else self.params.n

    def is_decoding(self) -> bool:
        """Every live sequence has exactly one token (its last sample) left to compute."""
        return all(s.num_uncomputed_tokens == 1 for s in self.seqs) and self.forked

    def retire(self, seq: Sequence) -> None:
        """Moves a finished sequence out of the live list."""
        self.seqs.remove(seq)
        self.finished.append(seq)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs}, status={self.status.value})"
