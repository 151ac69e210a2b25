"""Non-streamed answers with many log-probs: the bound on their size, checked before the request runs, and their
JSON, written off the event loop a slice at a time.

Each log-prob entry (a token's own log-prob, or one of its top-k) costs the server about 3 us (completions) to 9 us
(chat, with its `bytes` lists) of Python to build and 40 to 60 bytes of JSON, measured on the 2-core VM: 256 prompts
of 500 token ids with echo, logprobs 20 and prompt_logprobs 20 (5.4 million entries) made a 216 MB answer, 3 GB of
RSS and 17 s during which the event loop served no one. `MAX_LOGPROB_ENTRIES` bounds what one answer may hold; a
request over it is a 400 before it is queued, told from its own fields and its prompts' lengths.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from pydantic import BaseModel, TypeAdapter

from trtpaged.server.errors import ApiError
from trtpaged.server.protocol import MAX_LOGPROBS, GenerationRequest
from trtpaged.server.schemas import PromptLogprobs, dump

# log-prob entries one answer may hold, unless one full-context sequence's at MAX_LOGPROBS is more (see
# `logprob_entry_bound`): ~1 s of CPU and ~10-15 MB of JSON here
MAX_LOGPROB_ENTRIES = 1 << 18
# an answer that may hold more entries is built and rendered on a worker thread (the loop gets the GIL every
# switch interval); a smaller one stays on the loop, where a thread's hand-over would cost more than it saves
OFF_LOOP_ENTRIES = 1 << 12
_PROMPT_SLICE = 256  # prompt_logprobs positions rendered per json.dumps (21 entries each at most: ~1 ms)
_prompt_logprobs = TypeAdapter(PromptLogprobs)
T = TypeVar("T")


def logprob_entry_bound(max_seq_len: int, max_logprobs: int, given: Optional[int] = None) -> int:
    """The most log-prob entries one answer may hold: `given` (serve --max-logprob-entries), else MAX_LOGPROB_ENTRIES,
    raised where needed so that one prompt of the whole context scored at up to MAX_LOGPROBS top log-probs fits."""
    if given is not None:
        return given
    return max(MAX_LOGPROB_ENTRIES, max_seq_len * (min(max_logprobs, MAX_LOGPROBS) + 1))


@dataclass(frozen=True)
class LogprobEntries:
    """What a request's answer could hold: `total` entries, and its terms in words (for the refusal)."""

    total: int
    terms: tuple[str, ...]
    field: str  # the request field of the largest term


def logprob_entries(req: GenerationRequest, n: int, prompt_lens: Sequence[int],
                    max_tokens: Sequence[int]) -> LogprobEntries:  # fmt: skip
    """The log-prob entries `req`'s answer could hold, for its prompts of `prompt_lens` tokens, `n` choices each of
    at most `max_tokens` (per prompt, as fitted): completions show an echoed prompt's and vLLM's prompt_logprobs per
    choice, chat the prompt_logprobs once; each position holds its token plus the top k. A stream's output tokens
    are not counted: it sends them as they come, a few at a time (its echoed prompts' come whole, and count)."""
    names = req.names
    prompt_tokens = sum(prompt_lens)
    copies = 1 if req.chat else n
    per_copy = "" if copies == 1 else f" x n {n}"
    terms: list[tuple[int, str, str]] = []
    if req.prompt_logprobs is not None:
        terms.append((prompt_tokens * copies * (req.prompt_logprobs + 1), "prompt_logprobs",
                      f"{prompt_tokens} prompt tokens x (prompt_logprobs {req.prompt_logprobs} + 1){per_copy}"))
    k = req.logprobs
    name = names.get("logprobs", "logprobs")
    if k is not None and req.echo:
        terms.append((prompt_tokens * copies * (k + 1), name,
                      f"{prompt_tokens} echoed prompt tokens x ({name} {k} + 1){per_copy}"))
    if k is not None and not req.echo_only and not req.stream:
        outputs = n * sum(max_tokens)
        tokens = names.get("max_tokens", "max_tokens")
        terms.append((outputs * (k + 1), name,
                      f"{len(prompt_lens) * n} choices of up to {max(max_tokens, default=0)} tokens ({tokens}) x "
                      f"({name} {k} + 1)"))  # fmt: skip
    if not terms:
        return LogprobEntries(0, (), name)
    largest = max(terms, key=lambda t: t[0])
    return LogprobEntries(sum(t[0] for t in terms), tuple(t[2] for t in terms), largest[1])


def check_logprob_entries(entries: LogprobEntries, bound: int) -> None:
    """A 400 naming the fields when `entries` exceed `bound`."""
    if entries.total > bound:
        raise ApiError(f"{entries.field}: this request's answer could hold {entries.total} log-prob entries "
                       f"({' + '.join(entries.terms)}); at most {bound}: ask for fewer prompts, tokens or log-probs",
                       entries.field)  # fmt: skip


async def off_loop_if(large: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread for a large answer (the event loop serves the other clients meanwhile, taking
    the GIL every switch interval), else here (a thread's hand-over would cost more than it saves)."""
    return await asyncio.to_thread(fn, *args) if large else fn(*args)


def _json(data: Any) -> str:
    """JSON text as Starlette's JSONResponse writes it."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def render_json(body: BaseModel) -> bytes:
    """`body` (a completions or chat answer) as the bytes `JSONResponse(dump(body))` makes of it, dumped and
    written a choice (and a slice of a chat's prompt_logprobs) at a time: pydantic's dump and `json.dumps` each hold
    the GIL throughout, which for a whole 50 MB answer was a second with no other thread (nor the event loop) run."""
    choices = getattr(body, "choices")
    prompt_logprobs = getattr(body, "prompt_logprobs", None)
    update: dict[str, Any] = {"choices": []}
    if prompt_logprobs is not None:
        update["prompt_logprobs"] = []
    text = _json(dump(body.model_copy(update=update)))
    parts = [_json(dump(c)) for c in choices]
    # a string value's quotes are escaped, so only the key itself reads `"choices":[]`
    head, tail = text.split('"choices":[]', 1)
    pieces = [head, '"choices":[', ",".join(parts), "]"]
    if prompt_logprobs is not None:
        before, after = tail.split('"prompt_logprobs":[]', 1)
        slices = [_json(_prompt_logprobs.dump_python(prompt_logprobs[i:i + _PROMPT_SLICE], mode="json"))[1:-1]
                  for i in range(0, len(prompt_logprobs), _PROMPT_SLICE)]  # fmt: skip
        pieces += [before, '"prompt_logprobs":[', ",".join(slices), "]", after]
    else:
        pieces.append(tail)
    return "".join(pieces).encode("utf-8")
