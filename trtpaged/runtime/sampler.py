"""Turns one step's logits into tokens: penalties, temperature, top-k/top-p/min-p, seeded draws."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence

_SEED_STRIDE = 0x9E3779B1


def make_generator(seed: Optional[int], index: int) -> Optional[torch.Generator]:
    """A private RNG for output `index` of a seeded request: reproducible whatever else is batched."""
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed + index * _SEED_STRIDE) % (2**63))


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float  # under the model's distribution (raw logits)
    top_logprobs: Optional[dict[int, float]]  # the sampled token plus the top-k, when asked for


def apply_penalties(logits: torch.Tensor, seq: Sequence, params: SamplingParams) -> torch.Tensor:
    """Repetition (HF-style, prompt and output), presence and frequency (OpenAI-style, output only)."""
    if params.repetition_penalty != 1.0 and seq.token_ids:
        seen = torch.tensor(seq.token_ids, dtype=torch.long).unique()  # sorted, distinct
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (the most likely token always survives)."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= params.top_p  # mass before this token already enough
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Samples one token per (logits row, sequence). Rows are float32 on the CPU."""

    def sample(self, logits: torch.Tensor, seq: Sequence, params: SamplingParams) -> SampleResult:
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        processed = apply_penalties(logits.float().clone(), seq, params)
        if params.greedy:
            token = int(torch.argmax(processed))
        else:
            probs = torch.softmax(filter_logits(processed, params), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        return SampleResult(token, float(raw_logprobs[token]), self.top_logprobs(raw_logprobs, token, params.logprobs))

    @staticmethod
    def top_logprobs(logprobs: torch.Tensor, token: int, k: Optional[int]) -> Optional[dict[int, float]]:
        """The sampled token's log-prob plus the k most likely, or None when not requested."""
        if k is None:
            return None
        out = {token: float(logprobs[token])}
        if k > 0:
            vals, ids = torch.topk(logprobs, k)
            out.update({int(i): float(v) for i, v in zip(ids, vals)})
        return out
