"""Beam search selection, scored the way Hugging Face `generate(num_beams=...)` scores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from trtpaged.runtime.sampler import SampleRow, apply_penalties
from trtpaged.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished beam: its generated tokens and its length-penalised score."""

    token_ids: tuple[int, ...]
    score: float
    cumulative_logprob: float


@dataclass(frozen=True)
class BeamCandidate:
    """A continuation kept for the next step: which running beam it extends, with which token."""

    parent: int  # index into the running beams passed to `step`
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class BeamStep:
    """One step's decision, which the scheduler applies (`BeamSearch.apply`, then the beams it keeps):
    the beams to keep running (best first; empty once done), the best `width` hypotheses so far, and
    whether the search is over."""

    running: tuple[BeamCandidate, ...]
    finished: tuple[BeamHypothesis, ...]
    done: bool


class BeamSearch:
    """One request's beam search state: the best `beam_width` finished hypotheses.

    Each step takes the log-softmax of every running beam's logits, applies the
    request's penalties to those log-probs (HF's order: its logits processors act
    on the beams' log-probs; repetition over the prompt and the beam's tokens,
    presence and frequency over the beam's tokens), adds the beam's cumulative
    score, and keeps the top K = max(2, 1 + #eos) x width continuations. Those
    among the first `width` that end (EOS, stop token, or the length limit)
    become hypotheses scored sum_logprob / gen_len ** length_penalty; the best
    `width` that do not end keep running. Stopping
    follows HF: `early_stopping=True` stops once `width` hypotheses exist;
    False stops when the best running beam, scored at the current length,
    cannot beat the worst hypothesis; "never" uses the maximum length instead
    when length_penalty > 0.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Seq[int], max_new_tokens: int) -> None:
        self.params = params
        self.width = params.beam_width
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        # a stop token ends a beam as an EOS does: HF with eos_token_id = [eos] + stop ids keeps (1 + #ids) x width
        # candidates, so that `width` beams still run when every ending token is among the best
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.max_new_tokens = max_new_tokens
        self.finished: list[BeamHypothesis] = []
        self.done = False

    def _penalised(self, logprob: float, length: int) -> float:
        return logprob / (length**self.params.length_penalty)

    def step(self, outputs: Seq[Seq[int]], cumulative: Seq[float], logits: torch.Tensor,
             prompt: Seq[int] = ()) -> BeamStep:
        """Scores one more token; changes nothing (the scheduler applies the returned decision).

        `outputs[i]` and `cumulative[i]` are running beam i's generated tokens
        and score (its log-probs' sum, penalised), `logits[i]` its next-token logits;
        `prompt`: the request's prompt tokens (the repetition penalty counts them).
        """
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        p = self.params
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            apply_penalties(log_probs, [SampleRow(i, p, [*prompt, *out], len(prompt)) for i, out in enumerate(outputs)])
        scores = log_probs + torch.tensor(cumulative, dtype=torch.float32)[:, None]
        k = min(self.num_candidates, scores.numel())
        top_scores, top_index = torch.topk(scores.flatten(), k)
        gen_len = len(outputs[0]) + 1
        at_limit = gen_len >= self.max_new_tokens
        running: list[BeamCandidate] = []
        finished = list(self.finished)
        all_end = True
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            parent, token = divmod(index, vocab)
            ends = at_limit or token in self.stop_ids
            all_end &= ends
            if ends and rank < self.width:
                tokens = tuple(outputs[parent]) + (token,)
                finished.append(BeamHypothesis(tokens, self._penalised(score, gen_len), score))
            elif not ends and len(running) < self.width:
                running.append(BeamCandidate(parent, token, score))
        finished.sort(key=lambda h: -h.score)
        del finished[self.width :]
        done = all_end or not running or self._cannot_improve(finished, running[0].cumulative_logprob, gen_len)
        return BeamStep(() if done else tuple(running), tuple(finished), done)

    def cut(self, outputs: Seq[Seq[int]], cumulative: Seq[float]) -> None:
        """The search ends with these running beams where they are (the KV pool cannot hold them longer): each
        becomes a hypothesis scored at its length, as reaching the length limit makes it, and the best `width` of
        them and the finished ones are kept."""
        cut = [BeamHypothesis(tuple(o), self._penalised(c, max(1, len(o))), c) for o, c in zip(outputs, cumulative)]
        self.finished = sorted(self.finished + cut, key=lambda h: -h.score)[: self.width]
        self.done = True

    def apply(self, decision: BeamStep) -> None:
        """Takes a step's hypotheses and end (called by the scheduler)."""
        self.finished, self.done = list(decision.finished), decision.done

    def _cannot_improve(self, finished: list[BeamHypothesis], best_running: float, gen_len: int) -> bool:
        if len(finished) < self.width:
            return False
        if self.params.early_stopping is True:
            return True
        if self.params.early_stopping == "never" and self.params.length_penalty > 0.0:
            length = self.max_new_tokens
        else:
            length = gen_len
        return self._penalised(best_running, length) <= finished[-1].score

    def best(self, n: int) -> list[BeamHypothesis]:
        """The n best hypotheses (finished ones first)."""
        return self.finished[:n]
