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

from typing import Optional

from trtpaged.runtime.reasoning import ReasoningFormat


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
    (`ReasoningReader.reasoning_tokens` counts its tokens through the end tag then)."""
    split = ReasoningSplit(fmt, in_reasoning)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    return (r1 + r2) or None, (c1 + c2) or None, split.entered


def reasoning_cut(split: ReasoningSplit, was_reasoning: bool, was_entered: bool, token_ids: list[int],
                  end_id: int) -> int:
    """How many of a delta's tokens (`split` has just read their text) are reasoning: all while it stays inside,
    those through the end tag's token where it closes, none outside it; `was_reasoning` / `was_entered`: the
    split's state before the delta."""
    active = was_reasoning or (split.entered and not was_entered)
    if not active:
        return 0
    if split.in_reasoning:
        return len(token_ids)
    return token_ids.index(end_id) + 1 if end_id in token_ids else len(token_ids)
