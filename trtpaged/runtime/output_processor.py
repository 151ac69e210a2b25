"""After a step: sample or advance beams, fork parallel samples, detokenise, stop, free finished sequences."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence as Seq

import torch

from trtpaged.runtime.detokenizer import IncrementalDetokenizer
from trtpaged.runtime.outputs import CompletionOutput, RequestOutput
from trtpaged.runtime.sampler import Sampler, make_generator
from trtpaged.runtime.scheduler import Scheduler
from trtpaged.runtime.sequence import Sequence
from trtpaged.runtime.sequence_group import SequenceGroup


def find_stop_string(text: str, stops: Seq[str], new_chars: int) -> Optional[tuple[int, str]]:
    """Earliest stop string that overlaps the last `new_chars` characters: (index, stop)."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


class OutputProcessor:
    """Consumes one step's logits for the groups that sample, and builds request outputs."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Optional[Any],
        eos_token_ids: Seq[int],
        max_seq_len: int,
        new_seq_id: Callable[[], int],
    ) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.new_seq_id = new_seq_id
        self.sampler = Sampler()

    def process(self, groups: Seq[SequenceGroup], logits: torch.Tensor, rows: dict[int, int]) -> None:
        """Appends one token to every live sequence of each group (or finishes it)."""
        for group in groups:
            if group.is_finished:
                continue
            if group.beam is not None:
                self._beam_step(group, logits, rows)
            else:
                self._sample_step(group, logits, rows)
            group.forked = True
            if not group.seqs and not group.is_finished:
                self.scheduler.finish_group(group)

    # ---- sampling -----------------------------------------------------------------------------
    def _sample_step(self, group: SequenceGroup, logits: torch.Tensor, rows: dict[int, int]) -> None:
        if not group.forked:
            row = rows[group.seqs[0].seq_id]
            self._fork_samples(group)
            rows = {s.seq_id: row for s in group.seqs}  # the samples share the prompt's logits row
        for seq in list(group.seqs):
            result = self.sampler.sample(logits[rows[seq.seq_id]], seq, group.params)
            seq.append_token(result.token_id, result.logprob, result.top_logprobs)
            self._check_finish(group, seq, result.token_id)
            if seq.is_finished:
                self.scheduler.free_seq(group, seq)

    def _fork_samples(self, group: SequenceGroup) -> None:
        """The prompt is computed once; the n samples share its blocks from here on."""
        parent, params = group.seqs[0], group.params
        for index in range(1, params.n):
            child = parent.fork(self.new_seq_id(), index)
            self.kv.fork(parent, child)
            group.seqs.append(child)
        for seq in group.seqs:
            seq.generator = make_generator(params.seed, seq.index)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, params.skip_special_tokens)

    def _check_finish(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        params = group.params
        delta = ""
        if seq.detokenizer is not None:
            delta = seq.detokenizer.add(token)
            seq.output_text += delta
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish("stop", token)
        elif token in params.stop_token_ids:
            seq.finish("stop", token)
        elif params.stop and (hit := find_stop_string(seq.output_text, params.stop, len(delta))):
            index, stop = hit
            seq.output_text = seq.output_text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
            seq.finish("stop", stop)
            return
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            len(seq.token_ids) >= self.max_seq_len
        ):
            seq.finish("length")
        if seq.is_finished and seq.detokenizer is not None:
            seq.output_text += seq.detokenizer.flush()

    # ---- beam search --------------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor, rows: dict[int, int]) -> None:
        beams = list(group.seqs)
        beam_logits = logits[[rows[b.seq_id] for b in beams]]
        assert group.beam is not None
        keep = group.beam.step([b.output_token_ids for b in beams], [b.cumulative_logprob for b in beams], beam_logits)
        if group.beam.done:
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

    # ---- outputs ------------------------------------------------------------------------------
    def _decode(self, token_ids: Seq[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special)

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.params
        if group.beam is not None:
            if group.is_finished and group.beam.finished:
                hyps = [(h.token_ids, h.cumulative_logprob) for h in group.beam.best(params.n)]
            else:
                hyps = [(tuple(s.output_token_ids), s.cumulative_logprob) for s in group.seqs[: params.n]]
            stops = group.beam.stop_ids
            outputs = [
                CompletionOutput(
                    index=i,
                    text=self._decode(tokens, params.skip_special_tokens),
                    token_ids=list(tokens),
                    cumulative_logprob=logprob,
                    finish_reason=(("stop" if tokens and tokens[-1] in stops else "length") if group.is_finished else None),
                )
                for i, (tokens, logprob) in enumerate(hyps)
            ]
        else:
            seqs = sorted(group.seqs + group.finished, key=lambda s: s.index)
            outputs = [
                CompletionOutput(
                    index=s.index,
                    text=s.output_text,
                    token_ids=s.output_token_ids,
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=list(s.logprobs) if params.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
                for s in seqs
            ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            outputs=outputs,
            finished=group.is_finished,
            num_preemptions=group.num_preemptions,
        )
