"""A reasoning model's thinking, told apart from its answer in text (vLLM's `--reasoning-parser`).

With a reasoning parser (`trtpaged.runtime.reasoning`: the tags and where a choice starts), a chat answer's text is
split: the reasoning goes to the message's (or the stream delta's) `reasoning` field, the rest to `content`, and
tool calls are read from the content only. An output that opens with the start tag (after whitespace) is in the
reasoning whatever the prompt said, and the tag itself is left out; an output cut before the end tag is all
reasoning, as in vLLM.

`ReasoningSplit` reads one choice's text piece by piece, holding back only a possible start of a tag, so a stream's
pieces join to what `split_text` gives the whole text.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from trtpaged.runtime.reasoning import ReasoningFormat, ReasoningReader, span_of


class ReasoningSplit:
    """One choice's text, fed piece by piece, as (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self.at_start = True  # nothing but whitespace read yet: a start tag may still open the output
        self.held = ""  # text that may be the beginning of a tag
        self.entered = in_reasoning  # the output has been inside the reasoning (its tokens through the end tag are)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next piece of the output) completes."""
        buf, reasoning, content = self.held + text, [], []
        self.held = ""
        if self.at_start:
            rest = buf.lstrip()
            start = self.fmt.start
            if rest.startswith(start):
                self.in_reasoning, self.at_start, self.entered = True, False, True
                buf = rest[len(start) :]
            elif not rest or start.startswith(rest):  # whitespace, or a start tag's beginning: wait for more
                self.held = buf
                return "", ""
            else:
                self.at_start = False
        if self.in_reasoning:
            end = self.fmt.end
            found = buf.find(end)
            if found >= 0:
                reasoning.append(buf[:found])
                self.in_reasoning = False
                content.append(buf[found + len(end) :])
            else:
                keep = _partial_suffix(buf, end)
                reasoning.append(buf[: len(buf) - keep])
                self.held = buf[len(buf) - keep :]
        else:
            content.append(buf)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held back once the output has ended: the text of a tag that never completed."""
        held, self.held = self.held, ""
        if self.at_start:  # only whitespace, or part of a start tag: text of the state the prompt left
            self.at_start = False
        return (held, "") if self.in_reasoning else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter than it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split_text(fmt: ReasoningFormat, in_reasoning: bool, text: str) -> tuple[Optional[str], Optional[str], bool]:
    """A whole output's (reasoning, content), each None when empty, and whether it was ever inside the reasoning
    (`ReasoningReader.reasoning_span`: its tokens through the end tag then)."""
    split = ReasoningSplit(fmt, in_reasoning)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    return (r1 + r2) or None, (c1 + c2) or None, split.entered


class ChoiceReasoning:
    """One streamed chat choice's reasoning: its text's split, and which of its tokens (their log-probs and ids) go
    with the reasoning: those through the end tag's token once the text was inside the reasoning, as
    `ReasoningReader.reasoning_span` places them for the body. While the split holds the answer's first text back
    (whitespace, or a start tag's beginning), the tokens are held back with it."""

    def __init__(self, reader: ReasoningReader, in_reasoning: bool) -> None:
        self.reader = reader
        self.split = ReasoningSplit(reader.fmt, in_reasoning)
        self.tokens: list[int] = []  # the choice's output tokens so far
        self.first_end = -1  # where the first end tag stands among them (-1: none yet)
        self.held: tuple[list[int], Optional[list[Any]]] = ([], None)  # tokens (and log-probs) not yet placed

    def read(self, text: str, token_ids: Sequence[int], logprobs: Optional[Sequence[Any]],
             finished: bool) -> Optional[tuple[str, str, list[int], Optional[list[Any]], int]]:  # fmt: skip
        """The next delta (every one, token-only ones too) -> (reasoning, content, its token ids with any held
        before, their log-probs, how many of those tokens are reasoning); None while held back."""
        thought, answer = self.split.feed(text)
        if finished:
            more_thought, more_answer = self.split.finish()
            thought, answer = thought + more_thought, answer + more_answer
        held_ids, held_logprobs = self.held
        ids = held_ids + list(token_ids)
        lps = None if logprobs is None else (held_logprobs or []) + list(logprobs)
        if self.split.at_start and not finished:
            self.held = (ids, lps)
            return None
        self.held = ([], None)
        placed = len(self.tokens)
        if self.first_end < 0 and self.reader.end_id in ids:  # found once, in the new tokens only (not a rescan)
            self.first_end = placed + ids.index(self.reader.end_id)
        self.tokens += ids
        cut = min(max(0, self.span - placed), len(ids))
        return thought, answer, ids, lps, cut

    @property
    def span(self) -> int:
        """The choice's first tokens that are its reasoning's, tags included (`ReasoningReader.reasoning_span`)."""
        return span_of(len(self.tokens), self.first_end, self.split.entered)

    @property
    def reasoning_tokens(self) -> int:
        """Its reasoning tokens as usage counts them (`ReasoningReader.reasoning_tokens`)."""
        return self.reader.reasoning_tokens(self.tokens, self.split.entered)
