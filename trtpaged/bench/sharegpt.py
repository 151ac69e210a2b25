"""ShareGPT datasets given as a benchmark's `--trace`, read by the rule of vLLM's benchmarks (`ShareGPTDataset`).

The file is one JSON document, a list of entries
    {"id": "...", "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": text}, ...]}
The rule: the entries with two turns or more, shuffled with the seed, are taken in order; an entry's first turn is
the prompt (its text is what is sent) and its second turn's token count the output length (or a fixed length the user
gives). A pair is skipped when the prompt has fewer than 4 tokens or more than 1024, the output fewer than 4 (not
checked for a fixed length, as vLLM does not), or both together more than 2048; requests stop at `num_requests`.
The shuffle is `random.Random(seed).shuffle` of the entries kept: the permutation that vLLM's
`random.seed(seed); random.shuffle(entries)` makes, so one tokenizer picks the same requests in both.

Where this differs from vLLM: a pair longer than the engine's max_seq_len (`ShareGPTRule.model_len`) is skipped
too, counted apart (vLLM's client sends it and it fails); an entry without "conversations", or one of the two turns
read without a "value" string, is an error naming it (vLLM drops the first silently and fails on the second); a
file with fewer usable pairs than asked gives fewer requests and says so (vLLM repeats requests to fill the count).

Memory: the file is never held whole (the real one is ~650 MB, and `json.load` of it several GB of objects). A
first pass decodes one entry at a time from 1 MiB chunks, checks it, and keeps its byte span; the second reads only
the shuffled entries it takes. Memory is then a few chunks, the largest entry (at most MAX_ENTRY_BYTES, else an
error) and three integers per entry.
"""

from __future__ import annotations

import codecs
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

from trtpaged.errors import check_unicode
from trtpaged.json_input import json_kind

CHUNK_BYTES = 1 << 20
MAX_ENTRY_BYTES = 64 << 20  # one conversation (ShareGPT's are kilobytes): past it, the file is refused
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_DECODER = json.JSONDecoder()
ENTRY_FORM = '{"conversations": [{"from": "human", "value": TEXT}, {"from": "gpt", "value": TEXT}, ...]}'


@dataclass(frozen=True)
class ShareGPTRule:
    """Which (prompt, completion) pairs vLLM's benchmarks take, by token counts."""

    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048
    output_len: Optional[int] = None  # every request's output length (vLLM's --sharegpt-output-len); no minimum then
    model_len: Optional[int] = None  # the engine's max_seq_len: a longer pair is skipped too (not vLLM's rule)

    def prompt_skip(self, prompt_len: int) -> Optional[str]:
        """Why a prompt of `prompt_len` tokens is skipped whatever its output, or None."""
        if prompt_len < self.min_len:
            return f"prompt < {self.min_len} tokens"
        if prompt_len > self.max_prompt_len:
            return f"prompt > {self.max_prompt_len} tokens"
        return None

    def pair_skip(self, prompt_len: int, output_len: int) -> Optional[str]:
        """Why the pair is skipped, or None when it is taken."""
        reason = self.prompt_skip(prompt_len)
        if reason:
            return reason
        if self.output_len is None and output_len < self.min_len:
            return f"output < {self.min_len} tokens"
        if prompt_len + output_len > self.max_total_len:
            return f"prompt + output > {self.max_total_len} tokens"
        if self.model_len is not None and prompt_len + output_len > self.model_len:
            return f"prompt + output > max_seq_len {self.model_len}"
        return None


@dataclass(frozen=True)
class ShareGPTRequest:
    """One request taken: the prompt's text, its token count, the output length, and the entry's index in the file."""

    prompt: str
    prompt_len: int
    output_len: int
    entry: int


@dataclass
class ShareGPTSample:
    """The requests taken from a file, and how they were found."""

    path: str
    seed: int
    requests: list[ShareGPTRequest]
    entries: int  # in the file
    pairs: int  # entries with two turns or more
    read: int = 0  # pairs whose tokens were counted
    skipped: Counter = field(default_factory=Counter)  # reason -> pairs

    def summary(self, num_requests: int) -> str:
        """One line for the run's log: what was taken from what, and why pairs were skipped."""
        skipped = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common()) or "none"
        line = (f"{self.path}: {len(self.requests)} ShareGPT requests (seed {self.seed}) from {self.read} pairs read "
                f"of {self.pairs} with two turns ({self.entries} entries); skipped: {skipped}")
        if len(self.requests) < num_requests:
            line += f"; the file has no more usable pairs than that (--num-requests {num_requests})"
        return line


def is_sharegpt(path: str | Path) -> bool:
    """Whether `path` is to be read as a ShareGPT dataset rather than a JSON Lines trace: it opens as a JSON array,
    and its first entry is not an object without "conversations" (an array of trace lines is left to the JSON Lines
    reader, which refuses it saying so). An array that cannot be read is the ShareGPT reader's: it names where."""
    with open(path, "rb") as f:
        head = f.read(CHUNK_BYTES).decode("utf-8", errors="replace").lstrip("\ufeff \t\n\r")
    if not head.startswith("["):
        return False
    try:
        for _, value, _, _ in iter_entries(path):
            return not isinstance(value, dict) or "conversations" in value
    except ValueError:
        pass
    return True


def sample_sharegpt(path: str | Path, count_tokens: Callable[[str], int], num_requests: int, seed: int = 0,
                    rule: ShareGPTRule = ShareGPTRule()) -> ShareGPTSample:  # fmt: skip
    """The requests that the rule (see the module's doc) takes from the ShareGPT file `path`, at most `num_requests`,
    with token counts from `count_tokens`. ValueError naming the entry and field of a malformed file ("FILE[3]
    .conversations[1].value: ..."), or saying why no pair was usable."""
    entries, spans = _scan(path)
    if not entries:
        raise ValueError(f"{path}: a ShareGPT dataset with no entries")
    order = list(spans)
    random.Random(seed).shuffle(order)
    sample = ShareGPTSample(str(path), seed, [], entries, len(order))
    with open(path, "rb") as f:
        for span in order:
            if len(sample.requests) >= num_requests:
                break
            taken = _judge(path, f, span, count_tokens, rule)
            sample.read += 1
            if isinstance(taken, str):
                sample.skipped[taken] += 1
            else:
                sample.requests.append(taken)
    if not sample.requests:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sample.skipped.most_common())
        raise ValueError(f"{path}: no usable ShareGPT pair: of {entries} entr{'y' if entries == 1 else 'ies'}, "
                         f"{len(order)} with two turns or more" + (f", all skipped ({reasons})" if reasons else ""))
    return sample


def tokenizer_counter(tokenizer: Any) -> Callable[[str], int]:
    """Token counts from a transformers tokenizer, as vLLM's benchmark counts (special tokens included, as the
    engine's own tokenization of a prompt adds them)."""
    return lambda text: len(tokenizer.encode(text))


def _judge(path: str | Path, f: BinaryIO, span: tuple[int, int, int], count_tokens: Callable[[str], int],
           rule: ShareGPTRule) -> ShareGPTRequest | str:  # fmt: skip
    """The request one entry gives, or why it is skipped. The completion is not counted when the prompt alone is
    skipped (the outcome is the rule's either way)."""
    index = span[0]
    prompt, completion = _read_pair(path, f, span)
    where = f"{path}[{index}].conversations"
    prompt_len = _count(count_tokens, prompt, f"{where}[0].value")
    reason = rule.prompt_skip(prompt_len)
    if reason:
        return reason
    output_len = rule.output_len if rule.output_len is not None else _count(count_tokens, completion,
                                                                            f"{where}[1].value")  # fmt: skip
    return rule.pair_skip(prompt_len, output_len) or ShareGPTRequest(prompt, prompt_len, output_len, index)


def _count(count_tokens: Callable[[str], int], text: str, where: str) -> int:
    """`count_tokens(text)`, an error naming the field for text no tokenizer takes or a count that is not one."""
    check_unicode(where, text)  # a RequestError (a ValueError) naming `where`
    try:
        count = count_tokens(text)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{where}: the token count is {count!r}, not an integer >= 0")
    return count


def _read_pair(path: str | Path, f: BinaryIO, span: tuple[int, int, int]) -> tuple[str, str]:
    """The first two turns' texts of the entry at `span` (index, byte offset, byte length), read again from `f`."""
    index, start, length = span
    f.seek(start)
    try:
        turns = json.loads(f.read(length))["conversations"]
        prompt, completion = turns[0]["value"], turns[1]["value"]
    except (ValueError, LookupError, TypeError):
        raise ValueError(f"{path}[{index}]: changed while it was being read") from None
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ValueError(f"{path}[{index}]: changed while it was being read")
    return prompt, completion


def _scan(path: str | Path) -> tuple[int, list[tuple[int, int, int]]]:
    """The file's entry count, and (index, byte offset, byte length) of each entry with two turns or more, in file
    order; each entry is checked (`_has_pair`)."""
    entries, spans = 0, []
    for index, value, start, length in iter_entries(path):
        entries += 1
        if _has_pair(value, f"{path}[{index}]"):
            spans.append((index, start, length))
    return entries, spans


def _has_pair(entry: Any, where: str) -> bool:
    """Whether a ShareGPT entry has two turns or more (the rule keeps those); ValueError naming the field when it is
    no entry, or when one of the two turns read has no "value" string."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be an object with \"conversations\" (a ShareGPT entry: {ENTRY_FORM}), got "
                         f"{json_kind(entry)}")  # fmt: skip
    if "conversations" not in entry:
        raise ValueError(f"{where}.conversations: required (a ShareGPT entry: {ENTRY_FORM})")
    turns = entry["conversations"]
    if not isinstance(turns, list):
        raise ValueError(f"{where}.conversations: must be a list of turns, got {json_kind(turns)}")
    if len(turns) < 2:
        return False
    for i, turn in enumerate(turns[:2]):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}.conversations[{i}]: must be an object with a \"value\" string, got "
                             f"{json_kind(turn)}")  # fmt: skip
        if "value" not in turn:
            raise ValueError(f"{where}.conversations[{i}].value: required (the turn's text)")
        if not isinstance(turn["value"], str):
            raise ValueError(f"{where}.conversations[{i}].value: must be a string, got {json_kind(turn['value'])}")
    return True


def _size(size: int) -> str:
    """A byte count as people read it: 64 MiB, 2048 bytes."""
    return f"{size >> 20} MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else f"{size} bytes"


def iter_entries(path: str | Path) -> Iterator[tuple[int, Any, int, int]]:
    """(index, value, byte offset, byte length) of each element of the JSON array the file holds, decoded one at a
    time (a byte-order mark first is skipped); ValueError naming the file, and the element where there is one, for
    text that is not UTF-8, not a JSON array, or an element over MAX_ENTRY_BYTES."""
    with open(path, "rb") as f:
        text = _Text(f, str(path))
        if text.peek() != "[":
            raise ValueError(f"{path}: not a JSON array (a ShareGPT dataset is one: [{ENTRY_FORM}, ...])")
        text.take()
        if text.peek() == "]":
            text.take()
        else:
            yield from _elements(text, str(path))
        if text.peek():
            raise ValueError(f"{path}: text after the array's closing ']' at byte {text.byte}")


def _elements(text: _Text, path: str) -> Iterator[tuple[int, Any, int, int]]:
    """The elements of a non-empty array whose '[' was consumed, up to and including its ']'."""
    index = 0
    while True:
        where = f"{path}[{index}]"
        if not text.peek():
            raise ValueError(f"{where}: the file ends where an entry was expected (a truncated file?)")
        value, start, length = text.value(where)
        yield index, value, start, length
        after = text.peek()
        if after not in (",", "]"):
            raise ValueError(f"{where}: expected ',' or ']' after it at byte {text.byte}, got {after!r}" if after
                             else f"{path}: the array ends without ']' after entry [{index}] (a truncated file?)")
        text.take()
        if after == "]":
            return
        index += 1


class _Text:
    """A UTF-8 file's text, decoded a chunk at a time: `buf[pos:]` is what is not consumed yet, and `byte` the file
    offset of `buf[pos]`; the consumed text is dropped a chunk at a time."""

    def __init__(self, f: BinaryIO, path: str) -> None:
        self.f, self.path = f, path
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.byte, self.read_bytes, self.eof = "", 0, 0, 0, False
        self.more()
        if self.buf.startswith("\ufeff"):  # a byte-order mark, as editors write one
            self.pos, self.byte = 1, 3

    def more(self, size: Optional[int] = None) -> bool:
        """Appends the text of up to `size` more bytes (default: a chunk); False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(size or CHUNK_BYTES)
        self.eof = not data
        pending = len(self.decoder.getstate()[0])  # bytes of a character split between two reads
        try:
            decoded = self.decoder.decode(data, final=self.eof)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: not UTF-8 text ({exc.reason} at byte "
                             f"{self.read_bytes - pending + exc.start})") from None  # fmt: skip
        self.read_bytes += len(data)
        if self.pos >= CHUNK_BYTES:
            self.buf, self.pos = self.buf[self.pos:], 0
        self.buf += decoded
        return not self.eof

    def peek(self) -> str:
        """The next character that is not JSON whitespace ('' at the end of the file); the whitespace is consumed."""
        while True:
            end = _SPACE.match(self.buf, self.pos).end()
            self.byte += end - self.pos  # JSON whitespace is ASCII: a byte a character
            self.pos = end
            if end < len(self.buf):
                return self.buf[end]
            if not self.more():
                return ""

    def take(self) -> None:
        """Consumes the (ASCII) character that `peek` returned."""
        self.pos += 1
        self.byte += 1

    def value(self, where: str) -> tuple[Any, int, int]:
        """Decodes the JSON value that starts here: (value, its byte offset, its byte length)."""
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # a number that ends the text read so far may go on
                    break
            except json.JSONDecodeError as exc:
                if self.eof:
                    at = self.byte + len(self.buf[self.pos:exc.pos].encode("utf-8"))
                    raise ValueError(f"{where}: not valid JSON ({exc.msg} at byte {at})") from None
            except RecursionError:
                raise ValueError(f"{where}: nested too deeply to read") from None
            waiting = self.read_bytes - self.byte
            if waiting > MAX_ENTRY_BYTES:
                raise ValueError(f"{where}: no whole JSON value in the {_size(MAX_ENTRY_BYTES)} from byte {self.byte} "
                                 "(an entry that large, or one that never ends, is refused)")  # fmt: skip
            # as much again as is waiting (a long entry is decoded a logarithmic number of times, not once a chunk),
            # and never more than one byte past the bound
            self.more(min(max(CHUNK_BYTES, waiting), MAX_ENTRY_BYTES + 1 - waiting))
        start, length = self.byte, len(self.buf[self.pos:end].encode("utf-8"))
        self.pos, self.byte = end, start + length
        return value, start, length
