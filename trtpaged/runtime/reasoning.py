"""A reasoning model's tags, as token ids (vLLM's reasoning parsers, `LLM(reasoning_parser=...)`, `serve
--reasoning-parser`), and the thinking budget that closes its reasoning after a number of tokens.

Models such as DeepSeek-R1, QwQ, Qwen3 and SmolLM3 write their reasoning between `<think>` and `</think>` and the
answer after it; the chat template often writes the `<think>` itself, at the end of the prompt. Each tag must be
one token of the vocabulary (vLLM's rule). Where a choice starts is read from its prompt (`starts_in_reasoning`;
the server reads only the template's generation prompt): in the reasoning, unless the prompt already closed it (a
template that turns thinking off writes an empty `<think></think>`) or the request turned it off
(`chat_template_kwargs`, e.g. Qwen3's `enable_thinking: false`). The server splits the text
(`trtpaged.server.reasoning`); the engine uses the tags' token ids: a grammar gated by the end tag
(`structured.GatedMatcher`) and `SamplingParams.thinking_token_budget` (`ThinkingBudget`).
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


def _last(ids: Sequence[int], token: int) -> int:
    """Where `token` last stands in `ids`; -1 if nowhere."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def _closed(switched_off: bool, last_start: int, last_end: int) -> bool:
    """Whether an answer starts outside the reasoning, given where the prompt's tags last stand (-1: nowhere)."""
    return switched_off or (last_end >= 0 and last_end > last_start)


def span_of(length: int, first_end: int, entered: bool) -> int:
    """`ReasoningReader.reasoning_span` of `length` output tokens whose first end tag stands at `first_end` (-1:
    none yet), for a caller that follows the tokens as they come."""
    if not entered:
        return 0
    return first_end + 1 if first_end >= 0 else length


def _switched_off(fmt: ReasoningFormat, template_kwargs: Optional[Mapping[str, Any]]) -> bool:
    return fmt.switch is not None and (template_kwargs or {}).get(fmt.switch) is False


@dataclass(frozen=True)
class ReasoningReader:
    """A reasoning parser with its tags' token ids in one model's vocabulary."""

    fmt: ReasoningFormat
    start_id: int
    end_id: int
    blank_ids: frozenset[int] = frozenset()  # tokens that write only whitespace (before a start tag, as the split)

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> "ReasoningReader":
        """The parser `name` (a key of REASONING_PARSERS) for this tokenizer; ValueError naming
        reasoning_parser when the name is unknown or a tag is not one token of the vocabulary (vLLM's rule: a tag
        that text spells in pieces has more than one spelling, which no token-id check could follow)."""
        fmt = REASONING_PARSERS.get(name)
        if fmt is None:
            raise ValueError(f"reasoning_parser: {name!r:.40} is not a parser this server has; one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")  # fmt: skip
        if tokenizer is None:
            raise ValueError("reasoning_parser: needs the engine's tokenizer (this engine has none)")
        ids = []
        vocab = tokenizer.get_vocab()
        specials = set(getattr(tokenizer, "all_special_ids", ()) or ())
        for tag in (fmt.start, fmt.end):
            token = vocab.get(tag)
            if not isinstance(token, int) or tokenizer.decode([token], skip_special_tokens=False) != tag:
                raise ValueError(f"reasoning_parser: {name}'s tag {tag!r} is not a token of this model's vocabulary "
                                 "(not a reasoning model of this format)")  # fmt: skip
            if token in specials:
                raise ValueError(f"reasoning_parser: {name}'s tag {tag!r} is a special token of this model, which "
                                 "decoded text leaves out")  # fmt: skip
            ids.append(int(token))
        size = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
        return cls(fmt, ids[0], ids[1], frozenset(i for i, text in enumerate(texts) if not text.strip()))

    def starts_in_reasoning(self, prompt_ids: Sequence[int], template_kwargs: Optional[Mapping[str, Any]] = None,
                            generation_prompt: Optional[str] = None) -> bool:  # fmt: skip
        """Whether an answer to this prompt begins inside the reasoning: not when the request switched thinking
        off, nor when the prompt's last end tag comes after its last start tag (the template closed it). Given the
        chat template's `generation_prompt` (the text it adds to start the answer), only that text is read, so a tag
        in a message of the conversation changes nothing; else the prompt's token ids are."""
        off = _switched_off(self.fmt, template_kwargs)
        if generation_prompt is not None:
            text = generation_prompt
            return not _closed(off, text.rfind(self.fmt.start), text.rfind(self.fmt.end))
        return not _closed(off, _last(prompt_ids, self.start_id), _last(prompt_ids, self.end_id))

    def reasoning_span(self, output_ids: Sequence[int], entered: bool) -> int:
        """How many of a choice's first output tokens belong to its reasoning (`entered`: the text's split was
        inside it), its tags included: those through the first end tag, all of them when the reasoning never ended;
        none when it never thought. Their log-probs go with the reasoning."""
        ids = list(output_ids)
        return span_of(len(ids), ids.index(self.end_id) if self.end_id in ids else -1, entered)

    def reasoning_tokens(self, output_ids: Sequence[int], entered: bool) -> int:
        """The reasoning's tokens as usage counts them (vLLM's count): its span less the tags."""
        span = list(output_ids)[: self.reasoning_span(output_ids, entered)]
        return sum(1 for t in span if t != self.start_id and t != self.end_id)


class ThinkingBudget:
    """One sequence's thinking budget (vLLM's `thinking_token_budget`): once it has written `budget` tokens of
    reasoning without closing it, the next token is forced to be the end tag. Counting starts with the output when
    the answer starts in the reasoning, else at a start tag that opens the output (after whitespace, as the text's
    split reads it); the tags, and the whitespace before an opening start tag, do not count."""

    def __init__(self, budget: int, start_id: int, end_id: int, thinking: bool,
                 blank_ids: frozenset[int] = frozenset()) -> None:  # fmt: skip
        self.budget = budget
        self.start_id, self.end_id = start_id, end_id
        self.blank_ids = blank_ids  # tokens that write only whitespace
        self.thinking = thinking  # inside the reasoning now
        self.spent = 0  # reasoning tokens written since it opened
        self.leading = True  # only whitespace written so far: a start tag still opens the output
        self.done = False  # the reasoning has been closed: nothing more to watch

    def forced(self) -> Optional[int]:
        """The token the next sample must be, or None."""
        return self.end_id if self.thinking and not self.done and self.spent >= self.budget else None

    def advance(self, token_id: int) -> None:
        """Follows one appended output token."""
        leading = self.leading
        self.leading = leading and token_id in self.blank_ids
        if self.done or self.leading:
            return
        if token_id == self.start_id:
            self.thinking = self.thinking or leading
            return
        if not self.thinking:
            return
        if token_id == self.end_id:
            self.done = True
            return
        self.spent += 1

    def fork(self) -> "ThinkingBudget":
        child = ThinkingBudget(self.budget, self.start_id, self.end_id, self.thinking, self.blank_ids)
        child.spent, child.leading, child.done = self.spent, self.leading, self.done
        return child
