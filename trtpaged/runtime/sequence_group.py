"""One request: its sequences (one while prefilling, then n samples or the running beams)."""

from __future__ import annotations

from typing import Optional

from trtpaged.runtime.beam_search import BeamSearch
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.sequence import Sequence, SequenceStatus


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
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival  # admission order: lower is older
        self.prompt = prompt
        self.prompt_token_ids = list(first_seq.token_ids)
        self.params = params
        self.seqs: list[Sequence] = [first_seq]
        self.finished: list[Sequence] = []
        self.beam = beam
        self.forked = False  # whether the first sample has happened (n > 1 forks there)
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def set_status(self, status: SequenceStatus) -> None:
        self.status = status
        for seq in self.seqs:
            seq.status = status

    def is_decoding(self) -> bool:
        """Every live sequence has exactly one token (its last sample) left to compute."""
        return all(s.num_uncomputed_tokens == 1 for s in self.seqs) and self.forked

    def retire(self, seq: Sequence) -> None:
        """Moves a finished sequence out of the live list."""
        self.seqs.remove(seq)
        self.finished.append(seq)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs}, status={self.status.value})"
