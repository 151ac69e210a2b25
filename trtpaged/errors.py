"""Errors a user caused, typed so that consumers read fields instead of parsing message text."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


class FatalEngineError(RuntimeError):
    """The engine cannot run any further step (e.g. a tensor-parallel rank died); whoever drives it stops."""


class RequestError(ValueError):
    """A request that cannot run as given.

    `field` names the offending request field (OpenAI spelling where there is
    one: "prompt", "max_tokens", "n", "temperature", ...); `limit` is the bound
    it broke, when there is one (a number, or a description such as
    "max_seq_len - prompt tokens"). The message is for people; code reads the
    fields (the server maps them to an OpenAI error body's `param`, and `code`
    to its `code`). `overflow` holds the numbers of a prompt, or a prompt and its
    output, longer than the model's context; `code` is then CONTEXT_LENGTH_EXCEEDED.
    """

    def __init__(self, field: str, message: str, limit: Optional[Any] = None, code: Optional[str] = None,
                 overflow: Optional[ContextOverflow] = None) -> None:  # fmt: skip
        super().__init__(f"{field}: {message}")
        self.field = field
        self.limit = limit
        self.code = CONTEXT_LENGTH_EXCEEDED if code is None and overflow is not None else code
        self.overflow = overflow


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for it


@dataclass(frozen=True)
class ContextOverflow:
    """The numbers of a request longer than the model's context: its prompt's tokens, and the output it asked for
    where the prompt fits but prompt and output do not (None: the prompt alone leaves no room)."""

    max_seq_len: int
    input_tokens: int
    output_tokens: Optional[int] = None

    def anthropic(self) -> str:
        """Anthropic's sentence for it, which its clients look for: langchain-anthropic raises its
        AnthropicContextOverflowError on "prompt is too long", Claude Code compacts the conversation on it and
        lowers max_tokens on the other."""
        if self.output_tokens is None:
            return f"prompt is too long: {self.input_tokens} tokens > {self.max_seq_len - 1} maximum"
        return (f"input length and `max_tokens` exceed context limit: {self.input_tokens} + {self.output_tokens} > "
                f"{self.max_seq_len}, decrease input length or `max_tokens` and try again")


def context_length(max_seq_len: int, input_tokens: int) -> str:
    """OpenAI's and vLLM's sentence for a request longer than the model's context, which client libraries look
    for (LiteLLM's ContextWindowExceededError, agents that shorten their history on it)."""
    return (f"This model's maximum context length is {max_seq_len} tokens. However, your request has {input_tokens} "
            "input tokens")


# a value the user sent, as a message quotes it (repr's quotes, its escapes); not an apostrophe in the prose
# ("this model's chat template"), which opened a quote that ran to the next value's and left that value outside;
# nor a quote after a backslash (an escaped one), which opened a value at each one of a raw text's, each scanned to
# the end: quadratic
_QUOTED = re.compile(r"""((?<![\w\\])(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")(?!\w))""")


def respelled(message: str, spellings: Sequence[tuple[re.Pattern[str], str]]) -> str:
    """`message` with each pattern replaced by its spelling outside the quoted values it carries (a tool the client
    named max_tokens stays max_tokens): a refusal of a translated body, in the fields the client sent; an error, in
    the names the user set the fields by."""
    pieces = _QUOTED.split(message)  # odd indices: the quoted values
    for i in range(0, len(pieces), 2):
        for pattern, spelling in spellings:
            pieces[i] = pattern.sub(spelling, pieces[i])
    return "".join(pieces)


def mention(field: str) -> re.Pattern[str]:
    """Where a message names `field`: the whole name, not part of a longer one, of a dotted path
    (speculative_config.max_tokens) or of a flag; a full stop may follow it."""
    return re.compile(rf"(?<![\w.-]){re.escape(field)}(?!\w|\.\w)")


def mentions_renamed(message: str, names: Mapping[str, str]) -> str:
    """`message` with the fields of `names` it names (outside the values it quotes) spelled as `names` spells them:
    the server's request fields (max_tokens -> max_completion_tokens), the CLI's flags (beam_width -> --beam-width)."""
    return respelled(message, [(mention(field), spelling.replace("\\", r"\\")) for field, spelling in names.items()])


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says an allocation failed: Python's MemoryError, or the RuntimeError torch's CPU allocator
    ("DefaultCPUAllocator: can't allocate memory"), a CUDA one (torch.OutOfMemoryError, "out of memory") and the
    kernels ("out of memory") raise for it. torch's class is known by its name: this module imports no torch."""
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text or "can't allocate memory" in text


def check_no_nul(field: str, text: str, where: str) -> str:
    """`text`, when a grammar can hold it: the grammar engine's regexes and EBNF strings end at a NUL (or read it
    as nothing), so a choice or a structural tag's string holding one is refused, naming `where` it is."""
    if "\0" in text:
        raise RequestError(field, f"{where} holds a NUL character (U+0000, at {text.index(chr(0))}), which the "
                           "grammar engine cannot generate")  # fmt: skip
    return text


def check_unicode(field: str, text: str, where: str = "") -> str:
    """`text`, when a tokenizer can take it: a str that encodes to UTF-8 (a lone surrogate, which a JSON `\\ud800`
    escape or a bad decode leaves, does not; the tokenizers library raises a bare TypeError on it). `where` (its
    place in the field, if any) prefixes the message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(field, f"{where}{': ' if where else ''}not valid Unicode text: {exc.reason} (character "
                           f"{exc.start}, {text[exc.start]!r})") from None  # fmt: skip
    return text
