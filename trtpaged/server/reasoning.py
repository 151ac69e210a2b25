"""A reasoning model's thinking, told apart from its answer (vLLM's `--reasoning-parser`).

Models such as DeepSeek-R1, QwQ, Qwen3 and SmolLM3 write their reasoning between `<think>` and `</think>` and the
answer after it; the chat template often writes the `<think>` itself, at the end of the prompt. With a reasoning
parser, a chat answer's text is split: the reasoning goes to the message's (or the stream delta's) `reasoning`
field, the rest to `content`, and tool calls are read from the content only.

Where a choice starts is read from its prompt (`starts_in_reasoning`): in the reasoning, unless the prompt already
closed it (a template that turns thinking off writes an empty `<think></think>`) or the request turned it off
(`chat_template_kwargs`, e.g. Qwen3's `enable_thinking: false`). An output that opens with the start tag (after
whitespace) is in the reasoning whatever the prompt said, and the tag itself is left out; an output cut before the
end tag is all reasoning, as in vLLM.

`ReasoningSplit` reads one choice's text piece by piece, holding back only a possible start of a tag, so a stream's
pieces join to what `split_text` gives the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags around a model's reasoning, and the chat-template switch (if any) that turns thinking off."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    switch: Optional[str] = None  # a chat_template_kwargs key: False there means the model does not think


# vLLM's --reasoning-parser names of the <think> formats
REASONING_PARSERS = {f.name: f for f in (ReasoningFormat("deepseek_r1"),
                                          ReasoningFormat("qwen3", switch="enable_thinking"))}  # fmt: skip


def _last_index(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where the last occurrence of the token run `tag` starts in `ids`; -1 if none (or `tag` is empty)."""
    n = len(tag)
    if n == 0:
        return -1
    first = tag[0]
    for i in range(len(ids) - n, -1, -1):
        if ids[i] == first and list(ids[i : i + n]) == list(tag):
            return i
    return -1


def starts_in_reasoning(fmt: ReasoningFormat, prompt_ids: Sequence[int], start_ids: Sequence[int],
                        end_ids: Sequence[int],
                        template_kwargs: Optional[Mapping[str, Any]] = None) -> bool:  # fmt: skip
    """Whether a choice of this prompt begins inside the reasoning: not when the request switched thinking off,
    nor when the prompt's last end tag comes after its last start tag (the template closed the reasoning)."""
    if fmt.switch is not None and (template_kwargs or {}).get(fmt.switch) is False:
        return False
    last_end = _last_index(prompt_ids, end_ids)
    return last_end < 0 or last_end < _last_index(prompt_ids, start_ids)


class ReasoningSplit:
    """One choice's text, fed piece by piece, as (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self.in_reasoning = in_reasoning
        self.at_start = True  # nothing but whitespace read yet: a start tag may still open the output
        self.held = ""  # text that may be the beginning of a tag

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` (the next piece of the output) completes."""
        buf, reasoning, content = self.held + text, [], []
        self.held = ""
        if self.at_start:
            rest = buf.lstrip()
            start = self.fmt.start
            if rest.startswith(start):
                self.in_reasoning, self.at_start = True, False
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


def split_text(fmt: ReasoningFormat, in_reasoning: bool, text: str) -> tuple[Optional[str], Optional[str]]:
    """A whole output's (reasoning, content), each None when empty."""
    split = ReasoningSplit(fmt, in_reasoning)
    r1, c1 = split.feed(text)
    r2, c2 = split.finish()
    return (r1 + r2) or None, (c1 + c2) or None


@dataclass(frozen=True)
class ReasoningReader:
    """A server's reasoning parser with its tags as the engine's tokenizer spells them."""

    fmt: ReasoningFormat
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> "ReasoningReader":
        """The parser `name` (a key of REASONING_PARSERS) for this tokenizer; ValueError naming
        reasoning_parser when the name is unknown or a tag has no spelling in the vocabulary."""
        fmt = REASONING_PARSERS.get(name)
        if fmt is None:
            raise ValueError(f"reasoning_parser: {name!r:.40} is not a parser this server has; one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")  # fmt: skip
        if tokenizer is None:
            raise ValueError("reasoning_parser: needs the engine's tokenizer (this engine has none)")
        ids = []
        for tag in (fmt.start, fmt.end):
            spelled = tuple(int(t) for t in tokenizer.encode(tag, add_special_tokens=False))
            if not spelled or tokenizer.decode(list(spelled), skip_special_tokens=False) != tag:
                raise ValueError(f"reasoning_parser: {name}'s tag {tag!r} has no spelling in this model's vocabulary")
            if set(spelled) & set(getattr(tokenizer, "all_special_ids", ()) or ()):
                raise ValueError(f"reasoning_parser: {name}'s tag {tag!r} is a special token of this model, which "
                                 "decoded text leaves out")  # fmt: skip
            ids.append(spelled)
        return cls(fmt, ids[0], ids[1])

    def starts_in_reasoning(self, prompt_ids: Sequence[int], template_kwargs: Optional[Mapping[str, Any]]) -> bool:
        return starts_in_reasoning(self.fmt, prompt_ids, self.start_ids, self.end_ids, template_kwargs)

    def reasoning_tokens(self, output_ids: Sequence[int], thought: bool) -> int:
        """How many of a choice's output tokens are its reasoning: those through the first end tag; all of them
        when the reasoning never ended (`thought`: the choice has reasoning text), else none."""
        found = _first_index(output_ids, self.end_ids)
        if found >= 0:
            return found + len(self.end_ids)
        return len(output_ids) if thought else 0


def _first_index(ids: Sequence[int], tag: Sequence[int]) -> int:
    """Where the first occurrence of the token run `tag` starts in `ids`; -1 if none."""
    n, ids = len(tag), list(ids)
    start = 0
    while n:
        try:
            i = ids.index(tag[0], start)
        except ValueError:
            return -1
        if ids[i : i + n] == list(tag):
            return i
        start = i + 1
    return -1
