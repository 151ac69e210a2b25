"""Turns one step's logits into tokens for every sampling row at once.

Penalties, temperature, min-p, top-k, top-p, greedy choice and log-probs are
tensor operations over all rows of the step; only the random draw is per row,
from the row's own generator when its request is seeded, so a seeded request
draws the same tokens whatever else is batched with it.

A speculating sequence (docs/speculative.md) has a logits row per proposed token plus one;
`verify_run` keeps the proposed tokens the target's own choices agree with, and the target's
token at the first disagreement: greedy, exactly the target's greedy tokens; sampled, the
standard rejection rule for a deterministic proposal (accept token d with probability p(d), else
draw from p without d), so the output follows the target's distribution. A draft model's sampled
proposal comes with its distribution q: `rejection_run` accepts d with probability min(1, p(d)/q(d))
and on rejection draws from norm(max(0, p - q)).

A row whose logits are not finite (NaN, +inf, or all -inf, from the model or
after the request's penalties) gets no token, and a group whose sampling or beam
scoring raises gets a `SampleFailure`: the failure belongs to that request, and
the scheduler ends it while the other requests of the step go on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch

from trtpaged.runtime.outputs import Logprob, ranked, vocab_ranks
from trtpaged.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trtpaged.runtime.sequence import SequenceGroup

log = logging.getLogger("trtpaged.runtime")
NON_FINITE = "its logits were not finite (NaN or inf), from the model or after its penalties"


@dataclass(frozen=True)
class Sample:
    """One sampled token."""

    token_id: int
    logprob: float  # under the model's distribution (raw logits)
    top_logprobs: Optional[dict[int, Logprob]]  # the sampled token plus the top-k, when asked for


Run = tuple[Sample, ...]  # the tokens one sequence gains in a step: one, or a verified speculative run


@dataclass(frozen=True)
class SampleFailure:
    """A group that could not be sampled this step; `reason` is safe to show to its client. `field` names the
    request field at fault when the request's own settings caused it (its token filters allow no token)."""

    reason: str
    field: Optional[str] = None


@dataclass(frozen=True)
class SampleRow:
    """One row to sample: which logits row, under which settings, after which tokens."""

    logits_row: int
    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far (repetition penalty)
    num_prompt_tokens: int  # output tokens (presence/frequency penalties) start here
    generator: Optional[torch.Generator] = None
    grammar: Optional[Any] = None  # the sequence's grammar matcher (read here, advanced by the scheduler)
    bad_words: Sequence[Sequence[int]] = ()  # token-id spellings of the request's bad words
    banned: Sequence[int] = ()  # tokens that may not come yet (EOS and stop token ids before min_tokens)
    forced: Optional[int] = None  # the one token that may come (a thinking budget's end tag)


def _column(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).unsqueeze(1)


def _padded(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded to one width, and the mask of real entries."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), max(width, 1), dtype=torch.long)
    mask = torch.zeros(len(rows), max(width, 1), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[i, : len(r)] = True
    return ids, mask


def apply_token_filters(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """In place, for the rows that ask: the grammar's bitmask, allowed_token_ids, the ends min_tokens holds off,
    bad words (a word's last token where the output ends with the rest of it), then logit_bias (added, as OpenAI
    does)."""
    constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:
        from trtpaged.runtime.structured import mask_logits

        mask_logits(logits, constrained)
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[list(p.allowed_token_ids)] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        if r.banned:
            logits[i, list(r.banned)] = float("-inf")
        if r.forced is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[r.forced] = True
            logits[i].masked_fill_(~keep, float("-inf"))
        if r.bad_words:
            output = r.token_ids[r.num_prompt_tokens :]
            banned = [w[-1] for w in r.bad_words
                      if len(w) <= len(output) + 1 and list(output[len(output) - len(w) + 1 :]) == list(w[:-1])]
            if banned:
                logits[i, banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Repetition (HF-style, prompt and output), presence and frequency (OpenAI-style, output only), in place."""
    vocab = logits.shape[1]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0 and r.token_ids]
    if rep:
        ids, mask = _padded([rows[i].token_ids for i in rep])
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool).scatter_(1, ids, mask)
        penalty = _column([rows[i].params.repetition_penalty for i in rep])
        sub = logits[rep]
        penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rep] = torch.where(seen, penalised, sub)
    additive = [i for i, r in enumerate(rows) if (r.params.presence_penalty or r.params.frequency_penalty)
                and len(r.token_ids) > r.num_prompt_tokens]  # fmt: skip
    if additive:
        ids, mask = _padded([rows[i].token_ids[rows[i].num_prompt_tokens :] for i in additive])
        counts = torch.zeros(len(additive), vocab).scatter_add_(1, ids, mask.float())
        freq = _column([rows[i].params.frequency_penalty for i in additive])
        pres = _column([rows[i].params.presence_penalty for i in additive])
        logits[additive] -= freq * counts + pres * (counts > 0).float()
    return logits


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, then top-k and top-p masking per row (each row's most likely token survives).
    vLLM's order: top-p reads the mass of what min-p left (transformers' warpers run min-p last, which keeps
    tokens top-p would drop once min-p has cut the tail)."""
    num_rows, vocab = logits.shape
    logits = logits / _column([p.temperature for p in params])
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        # p < min_p * p_max, compared as log-probability gaps: at a large temperature every probability rounds to
        # the same float32 (exp of a gap below 6e-8 is 1.0) and min_p 1 kept the whole vocabulary; the log is
        # taken in float64 (a min_p below 1e-45 is 0 in float32)
        gap = logits - logits.max(dim=1, keepdim=True).values
        logits = logits.masked_fill(gap < _column([math.log(p) if p > 0 else -math.inf for p in min_p]), float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_logits, order = torch.sort(logits, dim=1, descending=True)
        if min(top_k) < vocab:
            kth = sorted_logits.gather(1, torch.tensor(top_k).unsqueeze(1) - 1)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if min(top_p) < 1.0:
            probs = torch.softmax(sorted_logits, dim=1)
            # the mass before this token is already enough; a row with top_p 1 keeps all (float32's cumsum
            # reaches 1.0 before a long tail of tiny probabilities ends)
            drop = probs.cumsum(dim=1) - probs >= _column([p if p < 1.0 else math.inf for p in top_p])
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def _draw(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """One token per row; rows with a generator draw from it, the others share the global RNG in one call."""
    tokens = [0] * probs.shape[0]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        for i, t in zip(unseeded, torch.multinomial(probs[unseeded], 1).squeeze(1).tolist()):
            tokens[i] = t
    for i, g in enumerate(generators):
        if g is not None:
            tokens[i] = int(torch.multinomial(probs[i], 1, generator=g))
    return tokens


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits first and no top log-probs asked for."""
    return (params.greedy and params.repetition_penalty == 1.0 and not params.presence_penalty
            and not params.frequency_penalty and params.logprobs is None and not params.filters_tokens)  # fmt: skip


def greedy_kernel() -> bool:
    """Whether the kernel library's one-pass greedy_rows can serve plain-greedy CPU float32 batches:
    decided once, when the engine loads (LLMEngine.greedy_kernel), and passed to `sample`."""
    from trtpaged import kernels

    return kernels.available() and kernels.has_greedy_rows()


def _greedy_samples(logits: torch.Tensor, rows: Sequence[SampleRow]) -> Optional[list[Optional[Sample]]]:
    """Every row plain greedy, on a CPU float32 batch: the choice and its log-prob in one pass of the
    kernel library (full log_softmax, argmax and row copies cost ~1.4 ms at 16 x 49152 here, this
    ~0.3 ms); None where that does not apply. A row with NaN or inf has a non-finite log-prob: None."""
    if not (logits.is_cpu and logits.dtype is torch.float32 and logits.is_contiguous()):
        return None
    if not all(_plain_greedy(r.params) for r in rows):
        return None
    from trtpaged import kernels

    index = torch.tensor([r.logits_row for r in rows], dtype=torch.int64)
    tokens, logsumexp = kernels.greedy_rows(logits, index)
    logprobs = (logits[index, tokens] - logsumexp).tolist()
    return [Sample(t, lp, None) if math.isfinite(lp) else None for t, lp in zip(tokens.tolist(), logprobs)]


def _unsound(logits: torch.Tensor) -> torch.Tensor:
    """Rows that no token can be chosen from: a NaN or a +inf, or nothing above -inf (one reduction:
    a row's max is NaN when it holds a NaN)."""
    return ~torch.isfinite(logits.amax(dim=1))


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], greedy_kernel: bool = False) -> list[Optional[Sample]]:
    """Samples one token for each row; `logits` is the step's float32 [num_outputs, vocab] on the CPU.
    `greedy_kernel` (see `greedy_kernel()`): a plain-greedy batch takes the kernel library's one pass.

    A row whose logits (raw, or after its penalties and temperature) are not finite gets None and
    draws nothing, so the other rows, seeded ones included, get the tokens they would get without it.
    """
    if not rows:
        return []
    plain = [i for i, r in enumerate(rows) if _plain_greedy(r.params)] if greedy_kernel else []
    if 0 < len(plain) < len(rows):  # plain greedy rows keep the one-pass path; the others take the full one
        fast = _greedy_samples(logits, [rows[i] for i in plain])
        if fast is not None:
            others = [i for i, r in enumerate(rows) if not _plain_greedy(r.params)]
            merged: list[Optional[Sample]] = [None] * len(rows)
            for i, s in zip(plain, fast):
                merged[i] = s
            for i, s in zip(others, _sample_rows(logits, [rows[i] for i in others])):
                merged[i] = s
            return merged
    fast = _greedy_samples(logits, rows) if plain and len(plain) == len(rows) else None
    return fast if fast is not None else _sample_rows(logits, rows)


def _sample_rows(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Optional[Sample]]:
    """Penalties, token filters, temperature and the draw for `rows` (any settings)."""
    raw = logits[[r.logits_row for r in rows]].float()
    raw_logprobs = torch.log_softmax(raw, dim=1)
    processed = apply_penalties(apply_token_filters(raw.clone(), rows), rows)
    bad: list[bool] = _unsound(processed).tolist()  # a raw NaN / inf / all -inf row stays so under penalties
    tokens = processed.argmax(dim=1).tolist()
    random = [i for i, r in enumerate(rows) if not r.params.greedy and not bad[i]]
    if random:
        probs = torch.softmax(filter_logits(processed[random], [rows[i].params for i in random]), dim=1)
        drawable = (probs.sum(dim=1) > 0).tolist()  # False for a row that went NaN (e.g. logits / temperature -> inf)
        keep = [j for j, ok in enumerate(drawable) if ok]
        if len(keep) < len(random):
            for j in range(len(random)):
                bad[random[j]] = not drawable[j]
            probs = probs[keep]
        for j, t in zip(keep, _draw(probs, [rows[random[j]].generator for j in keep]) if keep else []):
            tokens[random[j]] = t
    chosen = raw_logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()
    top = _top_logprobs(raw_logprobs, tokens, [r.params.logprobs for r in rows])
    return [None if bad[i] else Sample(t, lp, tl) for i, (t, lp, tl) in enumerate(zip(tokens, chosen, top))]


def _top_logprobs(logprobs: torch.Tensor, tokens: list[int],
                  ks: list[Optional[int]]) -> list[Optional[dict[int, Logprob]]]:  # fmt: skip
    """Per row: the sampled token's log-prob plus the k most likely, or None when not requested; each with its rank
    (the sampled token: how many tokens have a log-prob >= its own; a top-k entry: its place there, as vLLM)."""
    out: list[Optional[dict[int, Logprob]]] = [None] * len(tokens)
    wanted = [i for i, k in enumerate(ks) if k is not None]
    if not wanted:
        return out
    rows = logprobs[wanted]
    k_max = min(max(ks[i] for i in wanted), logprobs.shape[1])  # type: ignore[type-var]
    values, ids = torch.topk(rows, k_max, dim=1) if k_max > 0 else (None, None)
    chosen_col = rows.gather(1, torch.tensor([tokens[i] for i in wanted]).unsqueeze(1))
    ranks = vocab_ranks(rows, chosen_col)
    chosen = chosen_col.squeeze(1).tolist()
    for j, i in enumerate(wanted):
        row = {tokens[i]: Logprob(chosen[j], ranks[j])}
        k = ks[i] or 0
        if k and values is not None:
            row.update(ranked(ids[j, :k].tolist(), values[j, :k].tolist()))
        out[i] = row
    return out


@dataclass(frozen=True)
class _Target:
    """One output of a group this step: its rows (one, or 1 + len(draft) when speculating) and draft."""

    request_id: str
    rows: tuple[SampleRow, ...]
    draft: tuple[int, ...]
    draft_probs: Optional[torch.Tensor] = None  # the draft model's q per draft token, when it sampled them

    @property
    def lazy(self) -> bool:
        """A seeded sampled row verifying a draft draws row by row and stops at the first rejection: one draw
        from its generator per output token, as without speculation, so its tokens do not depend on
        whether (or how much) it speculated."""
        return bool(self.draft) and self.rows[0].generator is not None and not self.rows[0].params.greedy

    @property
    def rejection(self) -> bool:
        """A sampled row verifying a draft model's sampled tokens: min(1, p/q) (`rejection_run`)."""
        return self.draft_probs is not None and not self.rows[0].params.greedy


def rejection_run(logits: torch.Tensor, rows: Sequence[SampleRow], draft: Sequence[int],
                  q: torch.Tensor) -> Optional[Run]:  # fmt: skip
    """Speculative sampling against a draft's distribution q ([len(draft), vocab]): draft token d_i is kept
    with probability min(1, p_i(d_i) / q_i(d_i)), p_i being the target's processed distribution at row i
    (penalties, filters, temperature, min-p, top-k/p, as `sample` draws); at the first rejection the token is
    drawn from norm(max(0, p_i - q_i)); all kept, the next from p_k. The output follows p (Leviathan et al.,
    Chen et al.). Uniforms and draws come from the rows' generator (a seeded request: reproducible)."""
    gen = rows[0].generator
    raw = logits[[r.logits_row for r in rows]].float()
    raw_logprobs = torch.log_softmax(raw, dim=1)
    processed = apply_penalties(apply_token_filters(raw.clone(), rows), rows)
    probs = torch.softmax(filter_logits(processed, [r.params for r in rows]), dim=1)
    tokens: list[int] = []
    for i, row_probs in enumerate(probs):
        if not bool(torch.isfinite(processed[i].amax())) or not float(row_probs.sum()) > 0:
            return None  # a row the run needs has no distribution
        if i == len(draft):
            tokens.append(int(torch.multinomial(row_probs, 1, generator=gen)))
            break
        d = draft[i]
        if float(torch.rand((), generator=gen)) * float(q[i, d]) < float(row_probs[d]):
            tokens.append(d)
            continue
        residual = (row_probs - q[i].to(row_probs.dtype)).clamp_min(0)
        tokens.append(int(torch.multinomial(residual if float(residual.sum()) > 0 else row_probs, 1, generator=gen)))
        break
    chosen = raw_logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    top = _top_logprobs(raw_logprobs[: len(tokens)], tokens, [r.params.logprobs for r in rows[: len(tokens)]])
    return tuple(Sample(t, lp, tl) for t, lp, tl in zip(tokens, chosen, top))


def verify_run(samples: Sequence[Optional[Sample]], draft: Sequence[int]) -> Optional[Run]:
    """The verified run: the target's token at each proposed position while it equals the proposal, then
    the first one that differs (or, all accepted, the token after the last); None if a row it needed has
    no token (non-finite logits). `samples[i]` is the target's token at the position after `draft[:i]`."""
    run: list[Sample] = []
    for i, s in enumerate(samples[: len(draft) + 1]):
        if s is None:
            return None
        run.append(s)
        if i == len(draft) or s.token_id != draft[i]:
            break
    return tuple(run)


def _targets(group: "SequenceGroup", rows: dict[int, int], drafts: Mapping[int, tuple[int, ...]],
             draft_probs: Mapping[int, torch.Tensor]) -> list[_Target]:  # fmt: skip
    if group.forked:
        outputs = [(s, s.index) for s in group.seqs]
    else:
        outputs = [(group.seqs[0], i) for i in range(group.params.n)]
    params = group.params
    history = params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    targets = []
    for seq, index in outputs:
        draft = drafts.get(seq.seq_id, ())
        first, gen = rows[seq.seq_id], group.generators[index]
        targets.append(_Target(group.request_id, tuple(
            SampleRow(first + i, params, seq.token_ids + list(draft[:i]) if history and i else seq.token_ids,
                      seq.num_prompt_tokens, gen, seq.grammar, group.bad_words,
                      group.min_tokens_banned if seq.num_output_tokens + i < params.min_tokens else (),
                      seq.thinking.forced() if seq.thinking is not None else None)
            for i in range(len(draft) + 1)), draft, draft_probs.get(seq.seq_id) if draft else None))  # fmt: skip
    return targets


def _runs(logits: torch.Tensor, targets: Sequence[_Target], greedy_kernel: bool) -> list[Optional[Run]]:
    """Each target's run: the eager rows in one batched `sample`, lazy ones row by row."""
    eager = [r for t in targets if not t.lazy and not t.rejection for r in t.rows]
    drawn = iter(sample(logits, eager, greedy_kernel))
    runs: list[Optional[Run]] = []
    for t in targets:
        if t.rejection:
            assert t.draft_probs is not None
            runs.append(rejection_run(logits, t.rows, t.draft, t.draft_probs))
            continue
        if not t.lazy:
            runs.append(verify_run([next(drawn) for _ in t.rows], t.draft))
            continue
        got: list[Optional[Sample]] = []
        for i, row in enumerate(t.rows):
            got += sample(logits, [row], greedy_kernel)
            if got[-1] is None or i == len(t.draft) or got[-1].token_id != t.draft[i]:
                break
        runs.append(verify_run(got, t.draft))
    return runs


def sample_groups(groups: Sequence["SequenceGroup"], logits: torch.Tensor, rows: dict[int, int],
                  greedy_kernel: bool = False, drafts: Optional[Mapping[int, tuple[int, ...]]] = None,
                  draft_probs: Optional[Mapping[int, torch.Tensor]] = None) -> dict[str, Any]:  # fmt: skip
    """Each group's samples for this step, by request id: a run per output (one batched draw over every
    sampling row), or the beams to keep for beam-search groups. Changes no sequence; the scheduler applies them.
    `greedy_kernel`: as for `sample`, decided once when the engine loads.

    Before its first sample a group has one sequence, and its `n` samples all read that
    sequence's logits row; afterwards each live sequence reads its own row, or, speculating
    (`drafts[seq_id]`), its 1 + len(draft) rows from `rows[seq_id]` on; `draft_probs[seq_id]`: the
    draft model's q for a sampled draft (verified by `rejection_run`).

    Failures are the group's own: a group with non-finite logits, or whose beam scoring or
    sampling raises, gets a `SampleFailure` and the others their tokens. When the batched draw
    raises, each group is sampled alone to find the ones at fault. An exception that every group
    of the step raises (two or more groups) is the step's bug, not a request's: it propagates.
    """
    drafts = drafts or {}
    targets: list[_Target] = []
    spans: list[tuple[str, int, int]] = []
    results: dict[str, Any] = {}
    errors: list[tuple[str, Exception]] = []  # logged once it is known whether they are the requests' own
    for group in groups:
        if group.beam is not None:
            beams = group.seqs
            beam_logits = logits[[rows[b.seq_id] for b in beams]]
            if bool(_unsound(beam_logits.float()).any()):
                results[group.request_id] = _failed(group.request_id, NON_FINITE)
                continue
            results[group.request_id] = _isolated(group.request_id, errors, lambda: group.beam.step(
                [b.output_token_ids for b in beams], [b.cumulative_logprob for b in beams], beam_logits,
                beams[0].token_ids[: beams[0].num_prompt_tokens]))
            continue
        start = len(targets)
        targets += _targets(group, rows, drafts, draft_probs or {})
        spans.append((group.request_id, start, len(targets)))
    # the seeded generators' states: a batched draw that raises after some of them drew is retried per group
    # from these, so that a seeded request draws what it would have drawn without the group at fault
    generators = {id(t.rows[0].generator): t.rows[0].generator for t in targets if t.rows[0].generator is not None}
    states = [(g, g.get_state()) for g in generators.values()]
    try:
        runs: Optional[list[Optional[Run]]] = _runs(logits, targets, greedy_kernel)
    except Exception:  # noqa: BLE001 - find the groups at fault below
        runs = None
        for generator, state in states:
            generator.set_state(state)
    for request_id, start, end in spans:
        got = runs[start:end] if runs is not None else _isolated(
            request_id, errors, lambda: _runs(logits, targets[start:end], greedy_kernel))  # fmt: skip
        if not isinstance(got, SampleFailure) and any(r is None for r in got):
            firsts = [t.rows[0] for t in targets[start:end]]  # constrained rows never speculate: one row each
            got = _blocked(logits, firsts, [r[0] if r else None for r in got]) or _failed(request_id, NON_FINITE)
        results[request_id] = got
    if errors and len(errors) == len(groups) > 1:
        raise errors[0][1]
    for request_id, exc in errors:
        log.error("request %s failed in sampling", request_id, exc_info=exc)
    return results


def _blocked(logits: torch.Tensor, rows: Sequence[SampleRow], got: Sequence[Optional[Sample]]
             ) -> Optional[SampleFailure]:  # fmt: skip
    """When a row got no token only because its request's token filters leave none (its raw logits are
    sound): the failure, naming the filter field. None otherwise."""
    for r, s in zip(rows, got):
        if s is None and r.params.filters_tokens and not bool(_unsound(logits[[r.logits_row]].float()).any()):
            p = r.params
            field = ("thinking_token_budget" if r.forced is not None else p.structured_outputs.origin
                     if p.structured_outputs is not None else "allowed_token_ids" if p.allowed_token_ids is not None
                     else "bad_words" if p.bad_words else "logit_bias" if p.logit_bias else "min_tokens")  # fmt: skip
            return SampleFailure(f"{field}: the request's token filters (output grammar, allowed_token_ids, "
                                 "bad_words, logit_bias, min_tokens, the thinking budget's end tag) leave no token "
                                 "that may be sampled next", field)  # fmt: skip
    return None


def _failed(request_id: str, reason: str) -> SampleFailure:
    log.warning("request %s failed in sampling: %s", request_id, reason)
    return SampleFailure(reason)


def _isolated(request_id: str, errors: list[tuple[str, Exception]], run: Callable[[], Any]) -> Any:
    """`run()`, or a SampleFailure for this request alone when it raises (the error is kept in `errors`)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - the request fails, the step goes on
        errors.append((request_id, exc))
        return SampleFailure(f"sampling failed ({type(exc).__name__}); see the log")
