"""Iteration-level scheduler: who computes which tokens this step, within blocks and budgets."""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable, Optional

from trtpaged.runtime.kv_cache_manager import AllocRequest, KVCacheManager
from trtpaged.runtime.runtime_config import RuntimeConfig
from trtpaged.runtime.scheduler_output import ScheduledSeq, SchedulerOutput
from trtpaged.runtime.sequence import Sequence, SequenceStatus
from trtpaged.runtime.sequence_group import SequenceGroup


def split_tokens(remaining: list[int], tokens_left: int, seqs_left: int) -> Optional[tuple[list[int], bool]]:
    """Tokens per sequence of one group this step, and whether the group samples after it.

    All of them if they fit; otherwise chunks that leave every sequence at least
    one token short, so a group's sequences always sample in the same step.
    """
    if len(remaining) > seqs_left or tokens_left <= 0:
        return None
    if sum(remaining) <= tokens_left:
        return list(remaining), True
    plan, left = [], tokens_left
    for r in remaining:
        n = max(0, min(r - 1, left))
        plan.append(n)
        left -= n
    return (plan, False) if any(plan) else None


class Scheduler:
    """Continuous batching with a token budget, chunked prefill and preemption.

    Each step: running groups that decode, then running groups mid-prefill, then
    swapped groups back in, then waiting groups admitted in arrival order
    (FCFS: the first that does not fit stops admission). When a running group
    cannot get its blocks, the newest running group not yet scheduled this step
    is preempted whole: its blocks are freed and it is recomputed later, or
    swapped to host memory.
    """

    def __init__(self, config: RuntimeConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self.num_swap_outs = 0

    # ---- requests -----------------------------------------------------------------------------
    def check_request(self, num_prompt_tokens: int, num_seqs: int) -> None:
        """Refuses a request that can never run, naming the limit it exceeds."""
        c = self.config
        if num_prompt_tokens < 1:
            raise ValueError("prompt: must have at least one token")
        if num_prompt_tokens > c.max_seq_len:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens exceeds max_seq_len ({c.max_seq_len})")
        if num_prompt_tokens == c.max_seq_len:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens reaches max_seq_len ({c.max_seq_len}), leaving no room for a "
                f"generated token (prompt + output must fit in max_seq_len; at most {c.max_seq_len - 1} prompt tokens)"
            )
        blocks = -(-num_prompt_tokens // c.block_size)
        if blocks > c.num_blocks:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens need {blocks} KV blocks, more than the whole pool "
                f"(num_blocks {c.num_blocks}, block_size {c.block_size})"
            )
        if num_seqs > c.max_batch_size:
            raise ValueError(f"n/beam_width: {num_seqs} sequences exceeds max_batch_size ({c.max_batch_size})")

    def add(self, group: SequenceGroup) -> None:
        self.check_request(len(group.prompt_token_ids), group.params.num_seqs)
        group.set_status(SequenceStatus.WAITING)
        self._insert(self.waiting, group)

    def abort(self, request_id: str) -> Optional[SequenceGroup]:
        """Removes a request wherever it is and frees its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.seqs:
                        seq.finish("abort")
                    self.finish_group(group)
                    return group
        return None

    def free_seq(self, group: SequenceGroup, seq: Sequence) -> None:
        """A finished sequence gives its blocks back."""
        self.kv.free(seq)
        if seq in group.seqs:
            group.retire(seq)

    def finish_group(self, group: SequenceGroup) -> None:
        for seq in list(group.seqs):
            self.free_seq(group, seq)
        if group in self.running:
            self.running.remove(group)
        group.set_status(SequenceStatus.FINISHED)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step ran: its tokens are in the cache, and its full blocks become prefix-cache hits."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            self.kv.cache_computed_blocks(item.seq)

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
        for group in sorted(self.running, key=lambda g: not g.is_decoding()):  # decoding first, stable
            if group.status is not SequenceStatus.RUNNING:
                continue  # preempted (or refused) earlier this step
            requests, sample = self._plan(group, budget)
            if requests is None:
                continue
            while not self.kv.can_allocate(requests):
                victim = next(g for g in reversed(self.running) if g.request_id not in done)
                if victim is group and not done and len(self.running) == 1:
                    self._refuse(group, out)
                    break
                self._preempt(victim, out)
                preempted = True
                if victim is group:
                    break
            else:
                self._commit(group, requests, sample, budget, out)
                done.add(group.request_id)
        if not preempted:
            self._swap_in(budget, out)
            if not self.swapped:
                self._admit(budget, out, done)
        out.scheduled.sort(key=lambda s: s.num_tokens == 1)  # prefill chunks first, then decode tokens
        return out

    def _plan(self, group: SequenceGroup, budget: list[int]) -> tuple[Optional[list[AllocRequest]], bool]:
        hits = [self.kv.find_cached_prefix(s)[0] for s in group.seqs]
        bs = self.kv.block_size
        remaining = [
            len(s.token_ids) - len(h) * bs if h else s.num_uncomputed_tokens for s, h in zip(group.seqs, hits)
        ]
        split = split_tokens(remaining, budget[0], budget[1])
        if split is None:
            return None, False
        plan, sample = split
        requests = [(s, n, h) for s, n, h in zip(group.seqs, plan, hits) if n > 0]
        return requests, sample

    def _commit(self, group, requests, sample, budget, out: SchedulerOutput) -> None:
        for seq, _, _ in requests:
            if seq.seq_id not in self.kv.tables:
                self.kv.note_prefix_query(seq)
        out.block_copies += self.kv.allocate_group(requests)
        for seq, n, _ in requests:
            out.scheduled.append(ScheduledSeq(seq, group, seq.num_computed_tokens, n, sample))
            budget[0] -= n
            budget[1] -= 1
        if sample:
            out.sampled_groups.append(group)

    def _admit(self, budget: list[int], out: SchedulerOutput, done: set[str]) -> None:
        while self.waiting:
            group = self.waiting[0]
            requests, sample = self._plan(group, budget)
            if requests is None:
                return
            if not self.kv.can_allocate(requests):
                if not self.running and not out.scheduled:  # an empty pool cannot hold it: it never will
                    self.waiting.popleft()
                    self._refuse(group, out)
                    continue
                return
            self.waiting.popleft()
            group.set_status(SequenceStatus.RUNNING)
            self._insert(self.running, group)
            self._commit(group, requests, sample, budget, out)
            done.add(group.request_id)

    def _swap_in(self, budget: list[int], out: SchedulerOutput) -> None:
        while self.swapped and self.kv.can_swap_in(self.swapped[0].seqs):
            group = self.swapped.popleft()
            out.swap_in += self.kv.swap_in(group.seqs)
            group.set_status(SequenceStatus.RUNNING)
            self._insert(self.running, group)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.running.remove(group)
        group.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group.request_id)
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(group.seqs):
            out.swap_out += self.kv.swap_out(group.seqs)
            group.set_status(SequenceStatus.SWAPPED)
            self._insert(self.swapped, group)
            self.num_swap_outs += 1
            return
        for seq in group.seqs:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
        group.set_status(SequenceStatus.WAITING)
        self._insert(self.waiting, group)

    def _refuse(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """The only running group outgrew the whole pool: it ends here (finish_reason 'length')."""
        for seq in group.seqs:
            seq.finish("length")
        self.finish_group(group)
        out.refused.append(group)

    @staticmethod
    def _insert(queue, group: SequenceGroup) -> None:
        """Inserts keeping arrival order (preempted groups go back before newer ones)."""
        keys = [g.arrival for g in queue]
        index = bisect.bisect(keys, group.arrival)
        queue.insert(index, group)
