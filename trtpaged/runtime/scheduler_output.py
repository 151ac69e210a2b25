"""What one scheduling decision hands to the engine step: plain data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field

from trtpaged.runtime.sequence import Sequence
from trtpaged.runtime.sequence_group import SequenceGroup


@dataclass(frozen=True)
class ScheduledSeq:
    """Compute `token_ids[start:start + num_tokens]` of `seq` this step."""

    seq: Sequence
    group: SequenceGroup
    start: int
    num_tokens: int
    sample: bool  # its logits are needed (the group samples after this step)


@dataclass
class SchedulerOutput:
    """One step's plan. Block moves run in this order before the forward: swap out, swap in, copies."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    sampled_groups: list[SequenceGroup] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[str] = field(default_factory=list)  # request ids
    refused: list[SequenceGroup] = field(default_factory=list)  # finished because the pool can never hold them

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
