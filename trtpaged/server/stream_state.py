"""What the HTTP layer keeps of a request's DELTA outputs: per choice, for a stream or for the full body.

The runtime already holds back text that a stop string could still remove
(`RequestOutputKind.DELTA`), so a delta's text can be sent as it is; these
classes only number the choices and keep what the OpenAI bodies need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

from trtpaged.runtime.outputs import CompletionOutput, RequestOutput


def stop_reason(c: CompletionOutput) -> Union[int, str, None]:
    """A completion's stop reason as the bodies carry it: the stop string or stop token id, else None."""
    return c.stop_reason if isinstance(c.stop_reason, (str, int)) else None


@dataclass
class ChoiceDelta:
    """New text and tokens of one choice since the last chunk; `finish_reason` once it ends."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[Mapping[int, float]]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None] = None  # with the finish: the stop string or stop token id


@dataclass
class _Choice:
    tokens: int = 0  # completion tokens so far (usage)
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    finish_reason: Optional[str] = None


@dataclass
class StreamState:
    """Per-choice progress of one streamed HTTP request (choices numbered prompt-major: p * n + i)."""

    n: int
    with_tokens: bool = False  # logprobs requested: new tokens are news even before their text is final
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> its length

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        """The chunks one DELTA output of one prompt's request makes: choices with text, tokens to show or an end."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        result = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            choice = self.choices.setdefault(index, _Choice())
            choice.tokens += len(c.token_ids)
            finish = c.finish_reason if c.finish_reason in ("stop", "length") else None
            choice.finish_reason = c.finish_reason
            if c.text or finish or (self.with_tokens and c.token_ids):
                result.append(ChoiceDelta(index, c.text, c.token_ids, c.logprobs, finish,
                                          stop_reason(c) if finish else None))  # fmt: skip
        return result

    def advance_offset(self, index: int, token_strings: Sequence[str]) -> int:
        """The text offset a delta's first token starts at; moves it past the delta's tokens."""
        choice = self.choices.setdefault(index, _Choice())
        start = choice.text_offset
        choice.text_offset += sum(len(s) for s in token_strings)
        return start

    def tokens_of(self, index: int) -> int:
        """Completion tokens of one choice so far."""
        choice = self.choices.get(index)
        return choice.tokens if choice is not None else 0

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices.values())

    @property
    def finish_reasons(self) -> list[str]:
        return [self.choices[i].finish_reason or "?" for i in sorted(self.choices)]


class CompletionAccumulator:
    """One prompt's DELTA outputs joined back into the finished `RequestOutput` (for a non-streamed body)."""

    def __init__(self) -> None:
        self.last: Optional[RequestOutput] = None
        self.completions: dict[int, CompletionOutput] = {}
        self.prompt_logprobs: Optional[list] = None  # sent once, in the first output after the prefill

    def add(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            seen = self.completions.get(c.index)
            if seen is None:
                self.completions[c.index] = CompletionOutput(
                    c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                    list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)  # fmt: skip
                continue
            seen.text += c.text
            seen.token_ids += c.token_ids
            if seen.logprobs is not None and c.logprobs is not None:
                seen.logprobs += c.logprobs
            seen.cumulative_logprob, seen.finish_reason, seen.stop_reason = (
                c.cumulative_logprob, c.finish_reason, c.stop_reason)

    def result(self) -> RequestOutput:
        """The finished output: every completion whole, sorted by index."""
        assert self.last is not None and self.last.finished, "the request has not finished"
        return self._joined()

    def cut(self) -> RequestOutput:
        """The output so far of a request ended early (aborted: a cancel): every completion still running ends
        with finish_reason "abort"."""
        assert self.last is not None, "the request has no output"
        for c in self.completions.values():
            if c.finish_reason is None:
                c.finish_reason = "abort"
        return self._joined()

    def _joined(self) -> RequestOutput:
        last = self.last
        assert last is not None
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                             [self.completions[i] for i in sorted(self.completions)], True, last.num_preemptions,
                             prompt_logprobs=self.prompt_logprobs,
                             num_cached_tokens=last.num_cached_tokens)  # fmt: skip
