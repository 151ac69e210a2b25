"""What a stream has sent so far, per choice, and the next delta of each (stop strings held back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from trtpaged.runtime.outputs import RequestOutput


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that could be the start of a stop string: not sent yet, since
    the runtime cuts a stop string out of the text once it completes."""
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


@dataclass
class ChoiceDelta:
    """New text and tokens of one choice since the last chunk; `finish_reason` once it ends."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[Mapping[int, float]]]
    finish_reason: Optional[str]


@dataclass
class _Sent:
    chars: int = 0
    tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    done: bool = False


@dataclass
class StreamState:
    """Per-choice progress of one streamed HTTP request (choices numbered prompt-major: p * n + i)."""

    n: int
    stops: Sequence[str] = ()
    beam: bool = False  # beams change until the end: send each beam once, finished
    with_tokens: bool = False  # logprobs requested: new tokens are news even before their text is final
    sent: dict[int, _Sent] = field(default_factory=dict)

    def deltas(self, prompt_index: int, out: RequestOutput) -> list[ChoiceDelta]:
        """Deltas of every choice of one prompt's request that has something new."""
        if self.beam and not out.finished:
            return []
        result = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            sent = self.sent.setdefault(index, _Sent())
            if sent.done:
                continue
            finish = c.finish_reason if c.finish_reason in ("stop", "length") else None
            text = c.text if finish else c.text[: len(c.text) - held_back(c.text, self.stops)]
            new_text = text[sent.chars :] if len(text) > sent.chars else ""
            new_tokens = list(c.token_ids[sent.tokens :])
            logprobs = list(c.logprobs[sent.tokens :]) if c.logprobs is not None else None
            if not (new_text or finish or (self.with_tokens and new_tokens)):
                continue
            sent.chars = max(sent.chars, len(text))
            sent.tokens = len(c.token_ids)
            sent.done = finish is not None or out.finished
            result.append(ChoiceDelta(index, new_text, new_tokens, logprobs, finish))
        return result

    def advance_offset(self, index: int, token_strings: Sequence[str]) -> int:
        """The text offset a delta's first token starts at; moves it past the delta's tokens."""
        sent = self.sent.setdefault(index, _Sent())
        start = sent.text_offset
        sent.text_offset += sum(len(s) for s in token_strings)
        return start
