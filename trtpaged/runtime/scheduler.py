"""Iteration-level scheduler: who computes which tokens this step, and every state change that follows.

`schedule()` decides the step (within blocks and budgets), with the tokens a proposer
guesses for decoding sequences when speculative decoding is on; `update_from_output()`
applies its samples: appends tokens (a verified run of them for a speculating sequence,
its KV rolled back past the run), finishes sequences on EOS, stop tokens and length,
forks parallel samples and beams, ends a group whose sampling failed (finish_reason
"error"), and frees blocks. Those are the only places sequences change state, apart
from `abort` and `finish_stopped`.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence as Seq, Union

from trtpaged.errors import ContextOverflow, RequestError, context_length
from trtpaged.runtime.beam_search import BeamStep
from trtpaged.runtime.draft import DraftProposer, DraftRequest, Proposal, common_prefix
from trtpaged.runtime.kv_cache_manager import AllocationPlan, AllocRequest, KVCacheManager, TierSave
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.sampler import Run, SampleFailure
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence, SequenceGroup, SequenceStatus
from trtpaged.runtime.structured import accepts, grammar_stall
from trtpaged.runtime.speculative import AcceptanceTracker, SpecDecodeStats, ngram_propose

# Waiting groups whose prefix reads from the KV tiers start at the end of each schedule (the queue's head)
PREFETCH_AHEAD = 64

# What one group's step produced: a run of tokens per sample (index order before the first fork,
# then `group.seqs` order; one token, or a speculating sequence's verified run), the beam step, or
# why it could not be sampled.
GroupSamples = Union[Seq[Run], BeamStep, SampleFailure]


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute `token_ids[start:start + num_tokens - len(draft)]` of `seq`, then `draft`, this step.

    `draft` holds the tokens proposed after the sequence's last one (speculative decoding):
    each is computed, and every one of their positions gets logits, to be verified. `draft_probs`: the
    draft model's distribution q at each ([len(draft), vocab]) when it sampled them; None for a
    deterministic proposal (n-gram, or a draft model's greedy tokens).
    """

    seq: Sequence
    group: SequenceGroup
    start: int
    num_tokens: int
    sample: bool  # its logits are needed (the group samples after this step)
    draft: tuple[int, ...] = ()
    draft_probs: Optional[Any] = field(default=None, compare=False)


def window_blocks(c: RuntimeConfig, num_prompt_tokens: int) -> int:
    """The most blocks a prompt holds at once on an engine that reclaims windowed blocks (`c.reclaim_window` > 0):
    its window and one chunk of prefill, a partial block at each end, and the chain parent the prefix cache
    keeps (KVCacheManager.reclaim)."""
    chunk = min(num_prompt_tokens, c.max_num_tokens)
    return -(-(c.reclaim_window + chunk) // c.block_size) + 2


def recompute_cap(c: RuntimeConfig, num_prompt_tokens: int) -> int:
    """The most tokens a sequence computes in one step on an engine that reclaims windowed blocks: a recomputed
    sequence (prompt + outputs, after a preemption) in chunks that fit the pool, whose window, chunk, partial
    block at each end and chain parent must be held at once; never less than the prompt's own chunk, which
    `check_request` admitted (so a prompt's first computation is not cut further)."""
    fit = (c.num_kv_blocks - 2) * c.block_size - c.reclaim_window
    return max(min(num_prompt_tokens, c.max_num_tokens), fit)


def check_request(c: RuntimeConfig, num_prompt_tokens: int, params: SamplingParams) -> None:
    """Refuses a request that can never run under `c`: a `RequestError` naming the field and the limit.

    The one place request limits are checked: the scheduler calls it for every request it queues, the
    server for every prompt of a request before any of them is queued.
    """
    if num_prompt_tokens < 1:
        raise RequestError("prompt", "must have at least one token", 1)
    if num_prompt_tokens >= c.max_seq_len:
        room = "reaches" if num_prompt_tokens == c.max_seq_len else "exceeds"
        raise RequestError(
            "prompt",
            f"{num_prompt_tokens} tokens {room} max_seq_len ({c.max_seq_len}), leaving no room for a generated "
            f"token (prompt + output must fit in max_seq_len; at most {c.max_seq_len - 1} prompt tokens). "
            f"{context_length(c.max_seq_len, num_prompt_tokens)}.",
            c.max_seq_len - 1,
            overflow=ContextOverflow(c.max_seq_len, num_prompt_tokens),
        )
    blocks = -(-num_prompt_tokens // c.block_size)
    if c.reclaim_window:  # blocks before the window go back as the prompt's chunks advance: at most these live
        blocks = min(blocks, window_blocks(c, num_prompt_tokens))
    if blocks > c.num_kv_blocks:
        raise RequestError(
            "prompt",
            f"{num_prompt_tokens} tokens need {blocks} KV blocks, more than the whole pool "
            f"(num_kv_blocks {c.num_kv_blocks}, block_size {c.block_size})",
            c.num_kv_blocks * c.block_size,
        )
    room = c.max_seq_len - num_prompt_tokens
    if params.max_tokens is not None and params.max_tokens > room:
        raise RequestError(
            "max_tokens",
            f"{num_prompt_tokens} prompt tokens + {params.max_tokens} requested exceeds max_seq_len "
            f"({c.max_seq_len}); at most {room} here. {context_length(c.max_seq_len, num_prompt_tokens)} and "
            f"asks for {params.max_tokens} output tokens.",
            room,
            overflow=ContextOverflow(c.max_seq_len, num_prompt_tokens, params.max_tokens),
        )
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and c.max_logprobs >= 0 and k > c.max_logprobs:
            raise RequestError(name, f"{k} exceeds max_logprobs ({c.max_logprobs}), the most top log-probs per "
                                     "token this engine returns", c.max_logprobs)  # fmt: skip
    if params.num_seqs > c.max_batch_size:
        name = "beam_width" if params.use_beam_search else "n"
        raise RequestError(name, f"{params.num_seqs} sequences exceeds max_batch_size ({c.max_batch_size})",
                           c.max_batch_size)


@dataclass
class SchedulerOutput:
    """One step's plan. Block moves run in this order before the forward: tier write-backs (read the
    evicted blocks), swap out, swap in, tier loads, copies."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    sampled_groups: list[SequenceGroup] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    refused: list[SequenceGroup] = field(default_factory=list)  # finished because the pool can never hold them
    tier_saves: list[TierSave] = field(default_factory=list)  # evicted cached blocks to write back to the tiers
    tier_loads: list[tuple[int, bytes]] = field(default_factory=list)  # (block, bytes) restored from a tier

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _shares_from(group: SequenceGroup, seq: Sequence) -> bool:
    """Whether a sequence of the group still waits to take blocks from `seq`."""
    return any(source is seq for source, _ in group.pending_shares.values())


def _share_sources(group: SequenceGroup) -> set[int]:
    """Ids of the group's sequences that others still wait to take blocks from: their cache hits are all adopted
    (none a hole before the window, `KVCacheManager.dead_hits`), as `reclaim` keeps their blocks."""
    return {source.seq_id for source, _ in group.pending_shares.values()}


def share_plan(seqs: Seq[Sequence], block_size: int) -> dict[int, tuple[Sequence, int]]:
    """For a group about to recompute: each sequence after the first that has full blocks of tokens in common
    with an earlier one -> (the earlier one with the most, how many blocks). Neither shares its last token:
    each computes it itself (its logits are sampled), so the earlier one has computed the shared blocks
    before it samples."""
    plan: dict[int, tuple[Sequence, int]] = {}
    for i, seq in enumerate(seqs):
        best, best_len = None, 0
        for earlier in seqs[:i]:
            last = min(len(seq.token_ids), len(earlier.token_ids)) - 1
            common = min(common_prefix(seq.token_ids, earlier.token_ids), last)
            if common > best_len:
                best, best_len = earlier, common
        if best is not None and best_len >= block_size:
            plan[seq.seq_id] = (best, best_len // block_size)
    return plan


def _service_order(group: SequenceGroup) -> tuple[int, int]:
    return group.priority, group.arrival


def split_tokens(remaining: list[int], tokens_left: int, seqs_left: int, hold_last: bool = False,
                 caps: Optional[Seq[int]] = None) -> Optional[tuple[list[int], bool]]:  # fmt: skip
    """Tokens per sequence of one group this step, and whether the group samples after it.

    All of them if they fit (and not `hold_last`: others of the group are still to join); otherwise chunks
    that leave every sequence at least one token short, so a group's sequences always sample in the same step.
    `caps`: per sequence, the most tokens it computes in one step (`recompute_cap`), or None: no cap.
    """
    if len(remaining) > seqs_left or tokens_left <= 0:
        return None
    caps = caps if caps is not None else [tokens_left] * len(remaining)
    if sum(remaining) <= tokens_left and not hold_last and all(r <= c for r, c in zip(remaining, caps)):
        return list(remaining), True
    plan, left = [], tokens_left
    for r, cap in zip(remaining, caps):
        n = max(0, min(r - 1, left, cap))
        plan.append(n)
        left -= n
    return (plan, False) if any(plan) else None


class Scheduler:
    """Continuous batching with a token budget, chunked prefill and preemption.

    Each step: running groups that decode, then running groups mid-prefill, then
    swapped groups back in, then waiting groups admitted in service order
    (the first that does not fit stops admission). When a running group
    cannot get its blocks, the last running group in service order not yet
    scheduled this step is preempted whole: its blocks are freed and it is
    recomputed later, or swapped to host memory. Service order is arrival
    order (FCFS), or under the "priority" policy each group's priority (lower
    first), then arrival: vLLM's two policies.
    """

    def __init__(self, config: RuntimeConfig, kv: KVCacheManager, eos_token_ids: Iterable[int] = (),
                 draft: Optional[DraftProposer] = None) -> None:  # fmt: skip
        self.config = config
        self.draft = draft  # the draft-model proposer (speculative_config method "draft_model"), else None
        self._proposed: dict[int, Sequence] = {}  # this step's draft-model proposals: whose cache to roll back
        self.kv = kv
        self.eos_token_ids = set(eos_token_ids)
        self._seq_ids = itertools.count()
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0  # sequences preempted (vLLM's count: each of a request's samples or beams)
        self.num_swap_outs = 0  # requests swapped out (all their sequences at once)
        self.spec_stats = SpecDecodeStats()
        spec = config.speculative
        draft_cost = draft.token_cost if draft is not None else 0.0
        self.acceptance = (AcceptanceTracker(spec.row_cost, spec.min_acceptance_rate, draft_cost)
                           if spec else None)  # fmt: skip
        self._num_decoding = 0  # this step's decoding sequences (what a verified row competes with)

    # ---- requests -----------------------------------------------------------------------------
    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuses a request that can never run (`check_request`, on this scheduler's config)."""
        check_request(self.config, num_prompt_tokens, params)

    def add(self, group: SequenceGroup) -> None:
        """Queues a request after `check_request`."""
        self.check_request(len(group.prompt_token_ids), group.params)
        group.times["queued"] = time.monotonic()
        group.set_status(SequenceStatus.WAITING)
        self._insert(self.waiting, group)

    def abort(self, group: SequenceGroup) -> bool:
        """Removes a group from the queue its status names and frees its blocks at once; False if it is in none
        (finished). Looked up by status, not by a scan of every queue for its id: aborting N queued requests, the
        newest first, took O(N) each (16k: 14 s on the engine thread)."""
        queue = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running,
                 SequenceStatus.SWAPPED: self.swapped}.get(group.status)  # fmt: skip
        if queue is None:
            return False
        # every queue is kept in service order (`_insert`), each arrival its own: found by bisection (a scan from
        # the front made a disconnect storm, newest first, quadratic)
        index = bisect.bisect_left(queue, _service_order(group), key=_service_order)
        if index == len(queue) or queue[index] is not group:
            return False  # not where its status says: nothing to abort
        del queue[index]
        for seq in group.seqs:
            seq.finish("abort")
        self._finish_group(group)
        return True

    # ---- after the step -----------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, samples: Mapping[str, GroupSamples],
                           prompt_logprobs: Optional[Mapping[str, list[dict[int, float]]]] = None) -> None:
        """The step ran: its K/V is cached; groups scoring their prompt keep the new prompt log-probs; each
        sampled group takes its tokens, forks, finishes and frees."""
        scored = dict(prompt_logprobs or {})
        drafts: dict[int, tuple[int, ...]] = {}
        for item in out.scheduled:
            if item.draft:  # how much of it is computed is known once its run is verified
                drafts[item.seq.seq_id] = item.draft
                continue
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.cache_computed_blocks(item.seq)
            if not _shares_from(item.group, item.seq):  # blocks others will take from it stay until they have
                self.kv.reclaim(item.seq)  # after caching: a block's chain parent is kept until it is cached
            scores = scored.pop(item.group.request_id, None)
            if scores and item.group.prompt_logprobs is not None:
                item.group.prompt_logprobs += scores
        for group in out.sampled_groups:
            result = samples[group.request_id]
            if isinstance(result, SampleFailure):
                self._fail(group, result.reason, result.field)
                continue
            if group.beam is not None:
                self._advance_beams(group, result)  # type: ignore[arg-type]
            else:
                self._append_samples(group, result, drafts)  # type: ignore[arg-type]
            group.forked = True
            if not group.seqs:
                self._finish_group(group)
        if self.draft is not None:  # the draft's cache keeps only what the sequence kept (a finished one is gone)
            for seq_id, seq in self._proposed.items():
                self.draft.rollback(seq_id, seq.token_ids)
            self._proposed = {}

    def finish_stopped(self, stopped: Iterable[tuple[SequenceGroup, Sequence, str, int, int]]) -> None:
        """Sequences whose text reached a stop string (found by the output processor) finish here, their
        text cut where the processor says (before the stop string, or after it when it is kept) and their
        tokens after the one that completed it dropped (the rest of a verified speculative run)."""
        for group, seq, stop, keep, num_output_tokens in stopped:
            seq.output_text = seq.output_text[:keep]
            seq.truncate_output(num_output_tokens)
            seq.finish("stop", stop)
            if seq in group.seqs:
                self._free(group, seq)
            if not group.seqs:
                self._finish_group(group)

    def _append_samples(self, group: SequenceGroup, runs: Seq[Run], drafts: Mapping[int, tuple[int, ...]]) -> None:
        if not group.forked:  # the prompt was computed once; the n samples share its blocks from here on
            parent = group.seqs[0]
            for index in range(1, len(runs)):
                child = parent.fork(self.new_seq_id(), index)
                self.kv.fork(parent, child)
                group.seqs.append(child)
        for seq, run in zip(list(group.seqs), runs):
            draft = drafts.get(seq.seq_id)
            if self.acceptance is not None:
                self.acceptance.check_shadow(seq.seq_id, run[0].token_id)
            reason = None
            for sample in run:  # a token-level stop inside a verified run ends it there
                seq.append_token(sample.token_id, sample.logprob, sample.top_logprobs)
                if not accepts(seq.grammar, sample.token_id):
                    stall = grammar_stall(seq.grammar)
                    if stall is not None:
                        self._fail(group, stall, getattr(group.params.structured_outputs, "origin", None))
                    else:
                        self._fail(group, f"its output grammar rejected token {sample.token_id}")
                    return
                if seq.thinking is not None:
                    seq.thinking.advance(sample.token_id)
                reason = self._finish_reason(group.params, seq, sample.token_id)
                if reason is not None:
                    break
            if draft is not None:
                self._keep_verified(seq, draft, run)
            if reason is not None:
                seq.finish(*reason)
                self._free(group, seq)

    def _keep_verified(self, seq: Sequence, draft: tuple[int, ...], run: Run) -> None:
        """After a verification step: K/V is valid for the last token and the accepted draft tokens (the run
        minus its last, the target's own token); the blocks past them go back, and only full blocks of
        accepted tokens enter the prefix cache."""
        accepted = len(run) - 1
        self.spec_stats.record(len(draft), accepted)
        assert self.acceptance is not None
        self.acceptance.observe(seq.seq_id, len(draft), accepted)
        computed = seq.num_computed_tokens + 1 + accepted
        seq.num_computed_tokens = min(computed, len(seq.token_ids))  # a stop inside the run appended fewer
        self.kv.truncate(seq)
        self.kv.cache_computed_blocks(seq)
        self.kv.reclaim(seq)  # after caching, as for any computed chunk

    def _finish_reason(self, params: SamplingParams, seq: Sequence, token: int) -> Optional[tuple[str, Optional[int]]]:
        """Token-level stops: a stop token id (its id is the stop reason), EOS, max_tokens or max_seq_len (stop
        strings are textual). The model's own end (EOS, or the end a complete grammar took) has no stop reason, as
        in vLLM."""
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids) or (
            seq.grammar is not None and seq.grammar.is_terminated()  # the grammar is complete and took its end
        ):
            return "stop", params.stop_reason_of(token, self.eos_token_ids)
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            len(seq.token_ids) >= self.config.max_seq_len
        ):
            return "length", None
        return None

    def _advance_beams(self, group: SequenceGroup, decision: BeamStep) -> None:
        beams = list(group.seqs)
        assert group.beam is not None
        group.beam.apply(decision)
        keep = decision.running
        if decision.done:
            for beam in beams:
                self.kv.free(beam)
            group.seqs.clear()
            return
        claimed: set[int] = set()
        new_beams: list[Sequence] = []
        for cand in keep:  # fork before any parent is extended: children copy the parent as it was
            parent = beams[cand.parent]
            if cand.parent in claimed:
                child = parent.fork(self.new_seq_id(), 0)
                self.kv.fork(parent, child)
                new_beams.append(child)
            else:
                claimed.add(cand.parent)
                new_beams.append(parent)
        for i, beam in enumerate(beams):
            if i not in claimed:
                self.kv.free(beam)
        for beam, cand in zip(new_beams, keep):
            beam.append_token(cand.token_id)
            beam.cumulative_logprob = cand.cumulative_logprob
        group.seqs[:] = new_beams

    def _free(self, group: SequenceGroup, seq: Sequence) -> None:
        """The one path by which a finished sequence gives its blocks back."""
        self.kv.free(seq)
        if self.acceptance is not None:
            self.acceptance.forget(seq.seq_id)
        if self.draft is not None:
            self.draft.forget(seq.seq_id)
        if seq in group.seqs:
            group.retire(seq)

    def _fail(self, group: SequenceGroup, reason: str, field: Optional[str] = None) -> None:
        """The group's own sampling failed: it ends now (finish_reason "error", `group.error` says why and
        `group.error_field` names the request field at fault, when its own settings caused it)."""
        group.error = reason
        group.error_field = field
        for seq in group.seqs:
            seq.finish("error")
        self._finish_group(group)

    def _finish_group(self, group: SequenceGroup) -> None:
        for seq in list(group.seqs):
            self._free(group, seq)
        if group in self.running:
            self.running.remove(group)
        group.set_status(SequenceStatus.FINISHED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def live_seqs(self) -> Iterable[Sequence]:
        for group in self.running:
            yield from group.seqs

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = [self.config.max_num_tokens, self.config.max_batch_size]
        done: set[str] = set()
        preempted = False
        self._num_decoding = sum(len(g.seqs) for g in self.running if g.is_decoding() and g.beam is None)
        speculate = self._speculates(self._num_decoding)
        proposals = self._propose_with_draft() if speculate and self.draft is not None else {}
        decoding_left = sum(len(g.seqs) for g in self.running if g.is_decoding())
        # in service order, decoding first within a priority (stable): the groups a group may preempt for blocks,
        # the last in service order, are then not yet scheduled this step unless they share its priority
        for group in sorted(self.running, key=lambda g: (g.priority, not g.is_decoding())):
            if group.status is not SequenceStatus.RUNNING:
                continue  # preempted (or refused) earlier this step
            if group.is_decoding():
                decoding_left -= len(group.seqs)
            requests, sample = self._plan(group, budget)
            if requests is None:
                continue
            # token filters and grammars read one row's history, so a constrained group does not speculate
            if speculate and self._may_speculate(group):
                drafted = self._draft(group.params, requests, budget[0] - decoding_left, decoding_left, proposals)
                if drafted is not None:
                    self._commit(group, drafted[0], sample, budget, out, drafted[1])
                    done.add(group.request_id)
                    continue
            keep = _share_sources(group)
            while (plan := self.kv.plan_allocation(requests, keep)).num_kv_blocks > self.kv.pool.num_free:
                victim = next(g for g in reversed(self.running) if g.request_id not in done)
                if victim is group and not done and len(self.running) == 1:
                    if group.beam is None and len(group.seqs) > 1 and not group.pending_shares:
                        # its samples: one ends, the others go on (not while some wait for blocks to share)
                        cut = self._cut_one(group)
                        requests = [r for r in requests if r[0] is not cut]
                        if requests:
                            continue
                    self._refuse(group, out)
                    break
                self._preempt(victim, out)
                preempted = True
                if victim is group:
                    break
            else:
                self._commit(group, plan, sample, budget, out)
                done.add(group.request_id)
        # swapped and waiting groups come back in service order, each queue's head against the other's
        if not preempted:
            self._swap_in(budget, out)
            self._admit(budget, out, done)
        out.scheduled.sort(key=lambda s: s.num_tokens == 1)  # prefill chunks first, then decode tokens
        for group in itertools.islice(self.waiting, PREFETCH_AHEAD):  # their tier reads run while this step computes
            self._prefix_ready(group)
        out.tier_saves, out.tier_loads = self.kv.take_tier_transfers()
        return out

    def _plan(self, group: SequenceGroup, budget: list[int]) -> tuple[Optional[list[AllocRequest]], bool]:
        seqs = self._take_shares(group) if group.pending_shares else group.seqs
        # with shares pending, hits leave 2 tokens or more, so the held-back chunk computes some and all go on
        shared = bool(group.pending_shares)
        hits = [[] if group.scores_prompt else self.kv.find_cached_prefix(s, shared) for s in seqs]
        bs = self.kv.block_size
        remaining = [len(s.token_ids) - len(h) * bs if h else s.num_uncomputed_tokens for s, h in zip(seqs, hits)]
        caps = [recompute_cap(self.config, s.num_prompt_tokens) for s in seqs] if self.kv.reclaim_window else None
        split = split_tokens(remaining, budget[0], budget[1], hold_last=shared, caps=caps)
        if split is None:
            return None, False
        plan, sample = split
        requests = [(s, n, h) for s, n, h in zip(seqs, plan, hits) if n > 0]
        return requests, sample

    def _take_shares(self, group: SequenceGroup) -> list[Sequence]:
        """A recomputed group's sequences that wait for blocks an earlier one computes take them once it has
        (as the first sample's fork gave them); returns the sequences that compute this step (those still
        waiting compute nothing, and the others keep their last token until none waits: they sample
        together)."""
        bs = self.kv.block_size
        for seq in group.seqs:
            share = group.pending_shares.get(seq.seq_id)
            if share is None:
                continue
            source, num_blocks = share
            if source.seq_id not in group.pending_shares and source.num_computed_tokens >= num_blocks * bs:
                self.kv.share_blocks(source, seq, num_blocks)
                seq.num_computed_tokens = num_blocks * bs
                del group.pending_shares[seq.seq_id]
        return [s for s in group.seqs if s.seq_id not in group.pending_shares]

    def _speculates(self, num_decoding: int) -> bool:
        """Whether this step proposes tokens: speculation is configured, and fewer sequences decode than
        `disable_by_batch_size` (past that, verifying costs more than the weight reads it saves)."""
        spec = self.config.speculative
        if spec is None or num_decoding == 0:
            return False
        if spec.disable_by_batch_size is not None and num_decoding >= spec.disable_by_batch_size:
            self.spec_stats.num_steps_disabled += 1
            return False
        return True

    @staticmethod
    def _may_speculate(group: SequenceGroup) -> bool:
        """Decoding, not a beam search, and unconstrained (token filters and grammars read one row's history)."""
        return group.is_decoding() and group.beam is None and not group.params.filters_tokens

    def _room(self, params: SamplingParams, seq: Sequence) -> int:
        """Draft tokens the sequence can take: none past max_seq_len or the request's max_tokens."""
        room = self.config.max_seq_len - len(seq.token_ids)
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return room

    def _propose_with_draft(self) -> dict[int, Proposal]:
        """The draft model's proposals for every sequence that may speculate this step, in one batched pass
        (the budget may cut them later), each of the tokens that pay (AcceptanceTracker.tokens; one that does
        not pay rests, then probes)."""
        spec, draft, acceptance = self.config.speculative, self.draft, self.acceptance
        assert spec is not None and draft is not None and acceptance is not None
        requests: list[DraftRequest] = []
        for group in self.running:
            if not self._may_speculate(group):
                continue
            for seq in group.seqs:
                k = min(spec.num_speculative_tokens, self._room(group.params, seq))
                k = acceptance.tokens(seq.seq_id, k, self._num_decoding, free_shadow=False)
                if k < 1:
                    continue
                requests.append(DraftRequest(seq.seq_id, seq.token_ids, k, group.params))
                self._proposed[seq.seq_id] = seq
        return draft.propose(requests)

    def _draft(self, params: SamplingParams, requests: list[AllocRequest], tokens_left: int, reserve: int,
               proposals: Mapping[int, Proposal]) -> Optional[tuple[AllocationPlan, dict[int, Proposal]]]:  # fmt: skip
        """A decoding group's requests with proposed tokens, and its plan, or None when nothing is proposed
        or the drafts do not fit: within the step's token budget (`tokens_left`, one token per request
        included), no draft past max_seq_len or the request's max_tokens, and leaving `reserve` free blocks
        for the sequences still to decode this step. Speculation never preempts anything. `proposals`: the
        draft model's (cut here to the budget), else n-gram lookup."""
        spec, acceptance = self.config.speculative, self.acceptance
        assert spec is not None and acceptance is not None
        tokens_left -= len(requests)
        drafts: dict[int, Proposal] = {}
        drafted: list[AllocRequest] = []
        for seq, n, hits in requests:
            k = min(spec.num_speculative_tokens, self._room(params, seq), tokens_left)
            if self.draft is not None:
                got = proposals.get(seq.seq_id)
                draft = got.tokens[: max(k, 0)] if got is not None else ()
                probs = got.probs[: len(draft)] if got is not None and got.probs is not None and draft else None
            else:
                draft = tuple(ngram_propose(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max))
                probs = None
                pays = acceptance.tokens(seq.seq_id, len(draft), self._num_decoding)
                if draft and not pays:
                    acceptance.shadow(seq.seq_id, draft[0])
                draft = draft[:pays]
            if draft:
                drafts[seq.seq_id] = Proposal(draft, probs)
                tokens_left -= len(draft)
            drafted.append((seq, n + len(draft), hits))
        if not drafts:
            return None
        plan = self.kv.plan_allocation(drafted)
        if plan.num_kv_blocks + reserve > self.kv.pool.num_free:
            return None
        return plan, drafts

    def _commit(self, group: SequenceGroup, plan: AllocationPlan, sample: bool, budget: list[int],
                out: SchedulerOutput, drafts: Optional[Mapping[int, Proposal]] = None) -> None:  # fmt: skip
        for seq, _, _ in plan.requests:
            if seq.seq_id not in self.kv.tables and not group.scores_prompt:  # a scoring prompt is not looked up
                self.kv.note_prefix_query(seq)
        if group.num_cached_tokens is None:  # first scheduled: the prompt tokens the prefix cache held
            group.times["scheduled"] = time.monotonic()
            group.num_cached_tokens = sum(len(hits) for _, _, hits in plan.requests) * self.kv.block_size
        out.block_copies += self.kv.allocate(plan)
        for seq, _, hits in plan.requests:
            if hits:  # their K/V is in the adopted blocks: compute from the first token after them
                seq.num_computed_tokens = len(hits) * self.kv.block_size
        for seq, n, _ in plan.requests:
            proposal = drafts.get(seq.seq_id) if drafts else None
            draft, probs = (proposal.tokens, proposal.probs) if proposal is not None else ((), None)
            out.scheduled.append(ScheduledSeq(seq, group, seq.num_computed_tokens, n, sample, draft, probs))
            budget[0] -= n
            budget[1] -= 1
        if sample:
            out.sampled_groups.append(group)

    def _admit(self, budget: list[int], out: SchedulerOutput, done: set[str]) -> None:
        """Admits waiting groups in service order; the first that does not fit, or that a swapped-out group comes
        before, stops admission. A group whose prefix is still loading from a KV tier is passed over (it stays
        queued, its place kept)."""
        index = 0  # walked from the front: a step looks at the groups it admits or passes over, not the whole queue
        while index < len(self.waiting):
            group = self.waiting[index]
            if self.swapped and _service_order(self.swapped[0]) < _service_order(group):
                return
            if not self._prefix_ready(group):
                index += 1
                continue
            requests, sample = self._plan(group, budget)
            if requests is None:
                return
            plan = self.kv.plan_allocation(requests, _share_sources(group))
            if plan.num_kv_blocks > self.kv.pool.num_free:
                if not self.running and not out.scheduled:  # an empty pool cannot hold it: it never will
                    del self.waiting[index]
                    self._refuse(group, out)
                    continue
                return
            del self.waiting[index]
            group.set_status(SequenceStatus.RUNNING)
            self._insert(self.running, group)
            self._commit(group, plan, sample, budget, out)
            done.add(group.request_id)

    def _prefix_ready(self, group: SequenceGroup) -> bool:
        """Starts the tier reads of a waiting group's prefix (`KVCacheManager.prefetch`); whether all are done."""
        if group.scores_prompt:  # computes every prompt token: no prefix hits to read
            return True
        first = bool(self.waiting) and self.waiting[0] is group
        seqs = [s for s in group.seqs if s.seq_id not in group.pending_shares]  # the others share an earlier one's
        shared = bool(group.pending_shares)
        ready = all([self.kv.prefetch(seq, first, shared) for seq in seqs])  # a list: every sequence's read starts
        if ready and "ready" not in group.times:
            group.times["ready"] = time.monotonic()
        return ready

    def _swap_in(self, budget: list[int], out: SchedulerOutput) -> None:
        """Swaps groups back in, in service order, while they fit and come before the waiting queue's head."""
        while self.swapped and self.kv.can_swap_in(self.swapped[0].seqs) and not (
                self.waiting and _service_order(self.waiting[0]) < _service_order(self.swapped[0])):
            group = self.swapped.popleft()
            out.swap_in += self.kv.swap_in(group.seqs)
            group.set_status(SequenceStatus.RUNNING)
            self._insert(self.running, group)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        group.num_preemptions += 1
        self.num_preemptions += group.num_engine_requests  # vLLM v1 counts each child request it preempts
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(group.seqs):
            self._forget_drafts(group)
            out.swap_out += self.kv.swap_out(group.seqs)
            group.set_status(SequenceStatus.SWAPPED)
            self._insert(self.swapped, group)
            self.num_swap_outs += 1
            return
        for seq in group.seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
        group.pending_shares = share_plan(group.seqs, self.kv.block_size)
        group.set_status(SequenceStatus.WAITING)
        self._forget_drafts(group)
        self._insert(self.waiting, group)

    def _forget_drafts(self, group: SequenceGroup) -> None:
        """A preempted group's draft caches go back (the draft computes them again when it speculates)."""
        if self.draft is not None:
            for seq in group.seqs:
                self.draft.forget(seq.seq_id)
                self._proposed.pop(seq.seq_id, None)

    def _cut_one(self, group: SequenceGroup) -> Sequence:
        """The only running group outgrew the whole pool, and it samples several sequences (n > 1), each of which
        may fit alone: the one furthest on ends here ('length') and frees its blocks for the others, instead of all
        of them ending at once (each then as short as the pool made it)."""
        seq = max(group.seqs, key=lambda s: (s.num_output_tokens, s.index))
        seq.finish("length")
        self._free(group, seq)
        return seq

    def _refuse(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """The only running group outgrew the whole pool: it ends here (finish_reason 'length'); a beam search
        returns its beams as they are."""
        if group.beam is not None:
            group.beam.cut([s.output_token_ids for s in group.seqs], [s.cumulative_logprob for s in group.seqs])
        for seq in group.seqs:
            seq.finish("length")
        self._finish_group(group)
        out.refused.append(group)

    @staticmethod
    def _insert(queue, group: SequenceGroup) -> None:
        """Inserts keeping the queue in service order: by priority (lower first; all 0 unless the scheduling policy
        is "priority"), then arrival, so that preempted groups go back before newer ones and the last running group
        is the one to preempt. A group whose (priority, arrival) is not below the tail's (every new request under
        fcfs) is appended, with no look at the queue (a bisect per insert over a long queue made it quadratic)."""
        key = _service_order(group)
        if not queue or _service_order(queue[-1]) <= key:
            queue.append(group)
            return
        queue.insert(bisect.bisect(queue, key, key=_service_order), group)
