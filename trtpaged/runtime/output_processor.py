"""After the scheduler applied a step's tokens: detokenize, find stop strings, build request outputs.

The processor changes no scheduling state: sequences that reached a stop string
are handed back to the caller, which lets the scheduler finish them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence as Seq

from trtpaged.runtime.detokenizer import REPLACEMENT, IncrementalDetokenizer
from trtpaged.runtime.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from trtpaged.runtime.sequence import Sequence, SequenceGroup

# A sequence whose text reached this stop string, the length its text keeps, and its output tokens up to the
# one that completed the stop string (the scheduler cuts and ends it).
Stopped = tuple[SequenceGroup, Sequence, str, int, int]


def find_stop_string(text: str, stops: Seq[str], new_chars: int) -> Optional[tuple[int, str]]:
    """Earliest stop string that overlaps the last `new_chars` characters: (index, stop)."""
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_back(text: str, stops: Seq[str]) -> int:
    """Characters at the end of `text` that could be the start of a stop string. Outputs hold them back
    while the sequence runs, since the text is cut at a stop string once it completes."""
    best = 0
    for stop in stops:
        tail = text[len(text) - min(len(stop) - 1, len(text)) :]
        start = tail.find(stop[0]) if tail else -1  # a held-back part starts with the stop's first character
        while start >= 0 and len(tail) - start > best:
            if stop.startswith(tail[start:]):
                best = len(tail) - start
                break
            start = tail.find(stop[0], start + 1)
    return best


class OutputProcessor:
    """Turns sequences' tokens into text and `RequestOutput`s of the kind each request asked for."""

    def __init__(self, tokenizer: Optional[Any]) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # a token's text alone (at most the vocabulary's size)

    def _named(self, entries: list, start: int = 0) -> list:
        """`entries` (per token, {token id: Logprob}, or None), each Logprob from `start` on given its
        `decoded_token`, as vLLM's: the token decoded alone (callers pass where the last call stopped, so that each
        entry is named once)."""
        if self.tokenizer is None:
            return entries
        texts = self._token_texts
        for entry in entries[start:]:
            for token, logprob in (entry or {}).items():
                if isinstance(logprob, Logprob) and logprob.decoded_token is None:
                    text = texts.get(token)
                    if text is None:
                        text = texts[token] = self.tokenizer.decode([token])
                    logprob.decoded_token = text
        return entries

    # ---- text ---------------------------------------------------------------------------------
    def detokenize(self, groups: Seq[SequenceGroup]) -> list[Stopped]:
        """Decodes the tokens each sequence gained this step; returns the sequences that hit a stop string."""
        stopped: list[Stopped] = []
        if self.tokenizer is None:
            return stopped
        for group in groups:
            if group.beam is not None:
                continue  # beams are decoded whole when their output is built
            for seq in group.seqs + group.finished:
                hit = self._decode_new(group, seq)
                if hit is not None:
                    stopped.append((group, seq, *hit, seq.num_decoded_tokens))
        return stopped

    def _decode_new(self, group: SequenceGroup, seq: Sequence) -> Optional[tuple[str, int]]:
        """Appends the text of the sequence's new tokens; (stop string, text length to keep) when its text
        reached one (the text is not cut here: the scheduler applies the cut with the finish). With stop
        strings the tokens are decoded one at a time, so that a stop string reached inside a speculative run
        is found at the token that completed it (the tokens after it stay undecoded)."""
        params = group.params
        new_tokens = seq.output_tokens_from(seq.num_decoded_tokens)
        if not new_tokens:
            return None
        if not params.detokenize:  # vLLM's detokenize=False: token ids only
            seq.num_decoded_tokens += len(new_tokens)
            return None
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids, params.skip_special_tokens)
        ended_on_token = seq.finish_reason == "stop"  # EOS or a stop token id: no stop string after it
        unshown = 0
        if not params.shows_end_token(seq.finish_reason):  # the EOS / stop token id / grammar end that ended it
            unshown, new_tokens = 1, new_tokens[:-1]
        steps = [new_tokens] if not params.stop else [[t] for t in new_tokens]
        before_end: Optional[int] = None  # the text's length before a shown end token's (which completes no stop)
        for i, tokens in enumerate(steps):
            if params.stop and ended_on_token and not unshown and i == len(steps) - 1:
                before_end = len(seq.output_text) + len(seq.detokenizer.held_text())
            delta = "".join(seq.detokenizer.add(t) for t in tokens)
            seq.num_decoded_tokens += len(tokens)
            seq.output_text += delta
            hit = self._stop_in(seq, params, len(delta), before_end)
            if hit is not None and ended_on_token:
                # a stop string before the end token of the same speculative run (or held back by the
                # detokenizer until it): the sequence finished on that token already (as without speculation,
                # where the stop string ends it a step before the end token is sampled), so its tokens after the
                # stop string's go too
                seq.truncate_output(seq.num_decoded_tokens)
                self._stop_finished(seq, *hit)
                return None
            if hit is not None:
                return hit
        seq.num_decoded_tokens += unshown
        if seq.is_finished:
            self._flush(seq, params, before_end)
        return None

    @staticmethod
    def _stop_in(seq: Sequence, params: Any, new_chars: int, before: Optional[int] = None) -> Optional[tuple[str, int]]:
        """(stop string, text length to keep) where the text's last `new_chars` completed a stop string; None
        within min_tokens or without one. With `before`, only a stop string within the text's first `before`
        characters counts (those after are a shown end token's text, which completes none)."""
        if not params.stop or seq.num_decoded_tokens <= params.min_tokens:
            return None
        text = seq.output_text
        if before is not None and len(text) > before:  # only the end token's text is cut off the search
            new_chars -= len(text) - before
            text = text[:before]
            if new_chars <= 0:
                return None
        hit = find_stop_string(text, params.stop, new_chars)
        if hit is None:
            return None
        index, stop = hit
        return stop, index + (len(stop) if params.include_stop_str_in_output else 0)

    @classmethod
    def _flush(cls, seq: Sequence, params: Any, before_end: Optional[int]) -> None:
        """A finished sequence's text still held back, less an incomplete character at its end (the tokens end
        inside it: vLLM's text leaves it out too, the token ids keep it); a stop string it completes before a
        shown end token's text (`before_end`) cuts the text there and makes the finish "stop", as anywhere else
        in the text."""
        rest = seq.detokenizer.flush().rstrip(REPLACEMENT)
        if not rest:
            return
        seq.output_text += rest
        hit = cls._stop_in(seq, params, len(rest), before_end)
        if hit is not None:
            cls._stop_finished(seq, *hit)

    @staticmethod
    def _stop_finished(seq: Sequence, stop: str, keep: int) -> None:
        """A finished sequence whose text reached a stop string: cut there and re-finished here, not by the
        scheduler (which has already freed it)."""
        seq.output_text = seq.output_text[:keep]
        seq.finish("stop", stop)

    def _decode(self, token_ids: Seq[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special)

    # ---- outputs ------------------------------------------------------------------------------
    def make_outputs(self, groups: Seq[SequenceGroup]) -> list[RequestOutput]:
        """The outputs this step owes: per group, by its `output_kind` (see `RequestOutputKind`)."""
        outputs = []
        for group in groups:
            out = self.make_output(group)
            if out is not None:
                outputs.append(out)
        return outputs

    def make_output(self, group: SequenceGroup) -> Optional[RequestOutput]:
        kind = group.params.output_kind
        waits_for_end = kind is RequestOutputKind.FINAL_ONLY or (
            kind is RequestOutputKind.DELTA and group.beam is not None
        )
        if waits_for_end and not group.is_finished:
            return None
        if group.beam is not None:
            completions = self._beam_completions(group)
        elif kind is RequestOutputKind.DELTA:
            completions = self._delta_completions(group)
            if not completions and not group.is_finished:
                return None
        else:
            completions = [self._completion(s, group, final=kind is RequestOutputKind.FINAL_ONLY)
                           for s in self._by_index(group)]  # fmt: skip
        if group.beam is None and not group.forked and group.is_finished and group.params.n > 1:
            completions = self._unforked_completions(completions, group.params.n)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(group.prompt_token_ids),
            outputs=completions,
            finished=group.is_finished,
            num_preemptions=group.num_preemptions,
            num_cached_tokens=group.num_cached_tokens,
            error=group.error,
            error_field=group.error_field,
            prompt_logprobs=self._prompt_logprobs(group, kind),
        )

    def _name_new(self, seq: Sequence, params: Any) -> None:
        """Names the sequence's per-token log-probs not named before (none with detokenize=False, as vLLM)."""
        if params.detokenize:
            self._named(seq.logprobs, seq.logprobs_named)
        seq.logprobs_named = len(seq.logprobs)

    def _prompt_logprobs(self, group: SequenceGroup,
                         kind: RequestOutputKind) -> Optional[list[Optional[dict[int, Logprob]]]]:  # fmt: skip
        if group.prompt_logprobs is None or group.scores_prompt:
            return None
        if kind is RequestOutputKind.DELTA:
            if group.prompt_logprobs_sent:
                return None
            group.prompt_logprobs_sent = True
        if group.params.detokenize:  # vLLM names no token when it does not detokenize
            self._named(group.prompt_logprobs, group.prompt_logprobs_named)
        group.prompt_logprobs_named = len(group.prompt_logprobs)
        return list(group.prompt_logprobs)

    @staticmethod
    def _unforked_completions(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
        """A group of n > 1 samples that ended before its first sample (its grammar allowed no first token, it
        was aborted or refused) still answers n completions, as vLLM does: the one sequence's, for every index."""
        if len(completions) != 1:
            return completions
        return [dataclasses.replace(completions[0], index=i, token_ids=list(completions[0].token_ids))
                for i in range(n)]

    @staticmethod
    def _by_index(group: SequenceGroup) -> list[Sequence]:
        return sorted(group.seqs + group.finished, key=lambda s: s.index)

    @staticmethod
    def _visible_text(seq: Sequence, stops: Seq[str]) -> str:
        """The text that no later token can take back: while running, a possible stop string's start is held."""
        if seq.is_finished or not stops:
            return seq.output_text
        hold = held_back(seq.output_text, stops)
        return seq.output_text[: len(seq.output_text) - hold] if hold else seq.output_text

    def _completion(self, seq: Sequence, group: SequenceGroup, final: bool) -> CompletionOutput:
        params = group.params
        if params.logprobs is not None:
            self._name_new(seq, params)
        return CompletionOutput(
            index=seq.index,
            text=seq.output_text if final else self._visible_text(seq, params.stop),
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(seq.logprobs) if params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _delta_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        """What each sequence gained since its last delta; sequences with nothing new, or fewer than
        `stream_interval` new tokens while running (after their first token), are left out."""
        params = group.params
        completions = []
        for seq in self._by_index(group):
            sent = seq.emitted
            interval = params.stream_interval
            if interval > 1 and sent.tokens and not seq.is_finished and seq.num_output_tokens - sent.tokens < interval:
                continue
            text = self._visible_text(seq, params.stop)
            tokens = seq.output_tokens_from(sent.tokens)
            if not tokens and len(text) <= sent.chars and (sent.final or not seq.is_finished):
                continue
            if params.logprobs is not None:
                self._name_new(seq, params)
            completions.append(CompletionOutput(
                index=seq.index,
                text=text[sent.chars :],
                token_ids=tokens,
                cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
                logprobs=seq.logprobs[sent.tokens :] if params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))  # fmt: skip
            sent.tokens, sent.chars, sent.final = seq.num_output_tokens, len(text), seq.is_finished
        return completions

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        params, beam = group.params, group.beam
        assert beam is not None
        if group.error is not None:  # the beams as they were when the search failed
            hyps = [(tuple(s.output_token_ids), s.cumulative_logprob) for s in group.finished[: params.n]]
        elif group.is_finished and beam.finished:
            hyps = [(h.token_ids, h.cumulative_logprob) for h in beam.best(params.n)]
        else:
            hyps = [(tuple(s.output_token_ids), s.cumulative_logprob) for s in group.seqs[: params.n]]
        outputs = []
        for i, (tokens, logprob) in enumerate(hyps):
            finish = self._beam_finish_reason(group, tokens)
            shown = tokens if params.shows_end_token(finish) else tokens[:-1]
            stop = params.stop_reason_of(tokens[-1], beam.eos_token_ids) if finish == "stop" else None
            # as any output: a character the tokens end inside of is left out
            text = self._decode(shown, params.skip_special_tokens).rstrip(REPLACEMENT) if params.detokenize else ""
            outputs.append(CompletionOutput(index=i, text=text,
                                            token_ids=list(tokens), cumulative_logprob=logprob, finish_reason=finish,
                                            stop_reason=stop))  # fmt: skip
        return outputs

    @staticmethod
    def _beam_finish_reason(group: SequenceGroup, tokens: Seq[int]) -> Optional[str]:
        assert group.beam is not None
        if not group.is_finished:
            return None
        if group.error is not None:
            return "error"
        return "stop" if tokens and tokens[-1] in group.beam.stop_ids else "length"
