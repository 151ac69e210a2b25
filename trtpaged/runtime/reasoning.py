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
from typing import Any, Mapping, Optional, Sequence, Union


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


def starts_in_reasoning(fmt: ReasoningFormat, prompt: Union[str, Sequence[int]], start: Union[str, Sequence[int]],
                        end: Union[str, Sequence[int]],
                        template_kwargs: Optional[Mapping[str, Any]] = None) -> bool:  # fmt: skip
    """Whether a choice of this prompt (its text, or its token ids with the tags' ids) begins inside the
    reasoning: not when the request switched thinking off, nor when the prompt's last end tag comes after its last
    start tag (the template closed the reasoning)."""
    if fmt.switch is not None and (template_kwargs or {}).get(fmt.switch) is False:
        return False
    last = (lambda tag: prompt.rfind(tag)) if isinstance(prompt, str) else (lambda tag: _last_index(prompt, tag))
    last_end = last(end)
    return last_end < 0 or last_end < last(start)


@dataclass(frozen=True)
class ReasoningReader:
    """A server's reasoning parser with its tags as the engine's tokenizer spells them."""

    fmt: ReasoningFormat
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

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
        for tag in (fmt.start, fmt.end):
            token = vocab.get(tag)
            if not isinstance(token, int) or tokenizer.decode([token], skip_special_tokens=False) != tag:
                raise ValueError(f"reasoning_parser: {name}'s tag {tag!r} is not a token of this model's vocabulary "
                                 "(not a reasoning model of this format)")  # fmt: skip
            spelled = (int(token),)
            if set(spelled) & set(getattr(tokenizer, "all_special_ids", ()) or ()):
                raise ValueError(f"reasoning_parser: {name}'s tag {tag!r} is a special token of this model, which "
                                 "decoded text leaves out")  # fmt: skip
            ids.append(spelled)
        return cls(fmt, ids[0], ids[1])

    def starts_in_reasoning(self, prompt_ids: Sequence[int], template_kwargs: Optional[Mapping[str, Any]],
                            generation_prompt: Optional[str] = None) -> bool:  # fmt: skip
        """`starts_in_reasoning` of a prompt; given the chat template's `generation_prompt` (the text it adds to
        start the answer), only that text is read: a tag in a message of the conversation changes nothing."""
        if generation_prompt is None:
            return starts_in_reasoning(self.fmt, prompt_ids, self.start_ids, self.end_ids, template_kwargs)
        return starts_in_reasoning(self.fmt, generation_prompt, self.fmt.start, self.fmt.end, template_kwargs)

    def reasoning_tokens(self, output_ids: Sequence[int], entered: bool) -> int:
        """How many of a choice's output tokens are its reasoning (`entered`: the text's split was inside it): those
        through the first end tag, all of them when the reasoning never ended; none when it never thought."""
        if not entered:
            return 0
        found = _first_index(output_ids, self.end_ids)
        return found + len(self.end_ids) if found >= 0 else len(output_ids)


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


class ThinkingBudget:
    """One sequence's thinking budget (vLLM's `thinking_token_budget`): once it has written `budget` tokens of
    reasoning without closing it, the next tokens are forced to be the end tag. Counting starts with the output
    when the prompt left the model thinking, else at a start tag it writes; the tags' own tokens do not count."""

    def __init__(self, budget: int, start_ids: Sequence[int], end_ids: Sequence[int], thinking: bool) -> None:
        self.budget = budget
        self.start_ids, self.end_ids = tuple(start_ids), tuple(end_ids)
        self.thinking = thinking  # inside the reasoning now
        self.spent = 0  # reasoning tokens written since it opened
        self.recent: tuple[int, ...] = ()  # the last output tokens, as long as the longer tag
        self.forcing = 0  # end-tag tokens already forced (0: not forcing)
        self.done = False  # the reasoning has been closed: nothing more to watch

    def forced(self) -> Optional[int]:
        """The token the next sample must be, or None."""
        if self.done or not self.thinking:
            return None
        if self.forcing or self.spent >= self.budget:
            return self.end_ids[self.forcing]
        return None

    def advance(self, token_id: int) -> None:
        """Follows one appended output token."""
        if self.done:
            return
        self.recent = (self.recent + (int(token_id),))[-max(len(self.start_ids), len(self.end_ids)) :]
        if not self.thinking:
            if self.recent[-len(self.start_ids) :] == self.start_ids:
                self.thinking, self.spent = True, 0
            return
        if self.forcing or self.spent >= self.budget:
            self.forcing += 1
            if self.forcing == len(self.end_ids):
                self.done = True
            return
        if self.recent[-len(self.end_ids) :] == self.end_ids:
            self.done = True
            return
        self.spent += 1

    def fork(self) -> "ThinkingBudget":
        child = ThinkingBudget(self.budget, self.start_ids, self.end_ids, self.thinking)
        child.spent, child.recent, child.forcing, child.done = self.spent, self.recent, self.forcing, self.done
        return child
