"""TensorRT-LLM's `trtllm-bench` datasets as a benchmark's `--trace`.

The file `trtllm-bench throughput --dataset` reads, and TensorRT-LLM's `benchmarks/cpp/prepare_dataset.py`
(`trtllm-bench prepare-dataset` in newer releases) writes: JSON Lines, one request a line,
    {"task_id": 0, "input_ids": [863, 22056, 25603], "output_tokens": 128}
    {"task_id": 1, "prompt": "Generate an infinite response to the following: ...", "output_tokens": 1000}
task_id names the request; input_ids (`logits`, its older name, which trtllm-bench still reads) are the prompt's
token ids, used as given; prompt is its text, tokenized by the engine's tokenizer (bench serve sends the text, and
the ids as ids); output_tokens is how many tokens to generate. The prompts are real: requests that begin alike share
that prefix in every replay, and `diagnose` and `bench memory` count it. There are no arrival times: every request
arrives at t = 0 (step 0; bench serve sends at --request-rate, as for a ShareGPT dataset).

The rules (every line checked; an error names the line, the field and the bound, in one line):
- a file is read as this form when its first non-blank line is a JSON object giving task_id, output_tokens,
  input_ids or logits (no other form has one); a line of another form in it is refused naming it;
- task_id and output_tokens are required: task_id an integer (trtllm-bench's model types it so), from -2^63 to
  2^63 - 1; output_tokens an integer from 1 to MAX_SEQ_LEN;
- one prompt a line: prompt (a non-empty string of valid Unicode) or input_ids / logits (a non-empty list of at most
  MAX_SEQ_LEN integers from 0 to MAX_TOKEN_ID, the length checked before the ids are); null is absent, as
  trtllm-bench reads it. TensorRT-LLM's guide says a line cannot have both (its reader would drop the text): both
  are refused here. Token ids are checked against the engine's vocabulary where the command knows it
  (`TrtllmDataset.prompt_ids`), and a tokenized prompt against MAX_SEQ_LEN;
- what trtllm-bench reads but no trtpaged benchmark replays is refused, never dropped: lora_request (a LoRA
  adapter's request), turns (a multi-turn conversation), media_paths (a multimodal prompt). category and question_id
  (MT-Bench metadata trtllm-bench also only carries) are not read; any other field is refused as unknown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from trtpaged.bench.csv_trace import first_line
from trtpaged.bench.mooncake import MOONCAKE_FIELDS
from trtpaged.bench.token_blocks import bounded_integer, shown
from trtpaged.bench.workload import LINE_FIELDS, json_objects
from trtpaged.config import MAX_SEQ_LEN
from trtpaged.errors import check_unicode

FORM = "trtllm-bench"
DATASET_FIELDS = ("task_id", "prompt", "input_ids", "logits", "output_tokens")
METADATA_FIELDS = ("category", "question_id")  # carried by trtllm-bench, not read
UNREPLAYED = {  # fields trtllm-bench acts on that no trtpaged benchmark can: the line is refused, saying why
    "lora_request": "a LoRA adapter's request; trtpaged's benchmarks run the engine's own weights",
    "turns": "a multi-turn conversation (bench serve --multi-turn makes multi-turn traffic)",
    "media_paths": "a multimodal prompt; trtpaged's engines take text",
}
_DETECTING = ("task_id", "output_tokens", "input_ids", "logits")  # in no other form's lines
MAX_TASK_ID = (1 << 63) - 1
MAX_TOKEN_ID = (1 << 31) - 1  # an int32, as TensorRT-LLM's executor holds token ids
LINE_FORM = '{"task_id": N, "prompt": TEXT | "input_ids": [ID, ...], "output_tokens": N}'


@dataclass(frozen=True)
class DatasetLine:
    """One request of a trtllm-bench dataset: its "file:line", task_id, output length, and its prompt as text or as
    token ids (`ids_field`: the name the line gave them, input_ids or logits)."""

    where: str
    task_id: int
    output_len: int
    prompt: Optional[str] = None
    input_ids: Optional[tuple[int, ...]] = None
    ids_field: str = "input_ids"


@dataclass(frozen=True)
class TrtllmDataset:
    """A trtllm-bench dataset's requests in file order."""

    path: str
    lines: list[DatasetLine]

    form = FORM

    def prompt_ids(self, encode: Optional[Callable[[str], Sequence[int]]], vocab_size: Optional[int] = None,
                   missing_tokenizer: str = "give the engine dir") -> list[list[int]]:  # fmt: skip
        """Each request's prompt token ids: input_ids as given (ValueError naming the line and field for an id
        outside [0, vocab_size) when it is known), prompt text through `encode` (the engine's tokenizer; None:
        ValueError naming the line, with `missing_tokenizer` saying what to give)."""
        out = []
        for line in self.lines:
            if line.input_ids is not None:
                bad = next((t for t in line.input_ids if t >= vocab_size), None) if vocab_size else None
                if bad is not None:
                    raise ValueError(f"{line.where}: {line.ids_field}: token id {bad} is outside the engine's "
                                     f"vocabulary [0, {vocab_size})")  # fmt: skip
                out.append(list(line.input_ids))
                continue
            if encode is None:
                raise ValueError(f"{line.where}: prompt: a text prompt is tokenized by the engine's tokenizer: "
                                 f"{missing_tokenizer}")  # fmt: skip
            try:
                ids = list(encode(line.prompt))
            except ValueError as exc:  # text the tokenizer cannot take (RequestError)
                raise ValueError(f"{line.where}: prompt: {exc}") from None
            if not 1 <= len(ids) <= MAX_SEQ_LEN:
                raise ValueError(f"{line.where}: prompt: {len(ids)} tokens; a prompt is 1 to {MAX_SEQ_LEN}")
            out.append(ids)
        return out

    def summary(self, prompts: Optional[list[list[int]]] = None, arrivals: str = "all at t=0") -> str:
        """One line for the run's log: requests, prompts by kind, (given their ids) the tokens they share, and how
        they arrive (the file gives no times)."""
        ids = sum(line.input_ids is not None for line in self.lines)
        text = f"{self.path}: {len(self.lines)} {FORM} requests ({ids} as token ids, {len(self.lines) - ids} as text)"
        if prompts is not None:
            from trtpaged.bench.diagnose import shared_prefix_tokens

            total, shared = sum(map(len, prompts)), sum(shared_prefix_tokens(prompts))
            text += f", {shared} of {total} prompt tokens in a prefix an earlier prompt shares"
        return f"{text}; no arrival times: {arrivals}"


def is_trtllm_dataset(path: str | Path) -> bool:
    """Whether `path` is to be read as a trtllm-bench dataset: its first non-blank line is a JSON object giving
    task_id, output_tokens, input_ids or logits. Anything else is left to the other readers."""
    line = first_line(path)
    if line is None:
        return False
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and any(name in data for name in _DETECTING)


def read_trtllm_dataset(path: str | Path) -> TrtllmDataset:
    """Reads a trtllm-bench dataset (the module's rules); ValueError naming the line, the field and the bound."""
    lines: list[DatasetLine] = []
    foreign = LINE_FIELDS + MOONCAKE_FIELDS
    allowed = DATASET_FIELDS + METADATA_FIELDS + tuple(UNREPLAYED) + foreign
    for where, data in json_objects(path, allowed):
        try:
            lines.append(_line(where, data, foreign, lines[0].where if lines else None))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not lines:
        raise ValueError(f"{path}: no requests")
    return TrtllmDataset(str(path), lines)


def _line(where: str, data: dict, foreign: tuple[str, ...], first: Optional[str]) -> DatasetLine:
    """One checked line (`first`: the file's first line, None when this is it)."""
    other = [name for name in foreign if name in data]
    if other:
        context = f"a file whose first line (line {first.rsplit(':', 1)[-1]}) is a {FORM} one" if first \
            else f"a {FORM} dataset"
        raise ValueError(f"another trace form's field(s) ({', '.join(other)}) in {context}: one trace form per file "
                         f"(a {FORM} line is {LINE_FORM})")  # fmt: skip
    for name, why in UNREPLAYED.items():
        if name in data:
            raise ValueError(f"{name}: {why}; remove the field to replay the rest of the request")
    missing = [name for name in ("task_id", "output_tokens") if name not in data]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required (a {FORM} line is {LINE_FORM})")
    task_id = bounded_integer("task_id", data["task_id"], -MAX_TASK_ID - 1, MAX_TASK_ID)
    output_len = bounded_integer("output_tokens", data["output_tokens"], 1, MAX_SEQ_LEN)
    given = [name for name in ("prompt", "input_ids", "logits") if data.get(name) is not None]
    if len(given) != 1:
        raise ValueError(f"{', '.join(given) if given else 'prompt'}: give one prompt, as text (prompt) or as token "
                         f"ids (input_ids, or logits), got {'both' if given else 'neither'}")  # fmt: skip
    name = given[0]
    if name == "prompt":
        prompt = data[name]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt: must be a non-empty string, got {shown(prompt)}")
        return DatasetLine(where, task_id, output_len, prompt=check_unicode("prompt", prompt))
    return DatasetLine(where, task_id, output_len, input_ids=_token_ids(name, data[name]), ids_field=name)


def _token_ids(name: str, value: object) -> tuple[int, ...]:
    """A prompt's token ids: a non-empty list of at most MAX_SEQ_LEN integers from 0 to MAX_TOKEN_ID (the length
    checked first); ValueError naming the field, the first bad id's index and the bound."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name}: must be a non-empty list of token ids, got {shown(value)}")
    if len(value) > MAX_SEQ_LEN:
        raise ValueError(f"{name}: {len(value)} token ids; a prompt is at most {MAX_SEQ_LEN}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{name}[{i}]: must be a token id, an integer from 0 to {MAX_TOKEN_ID}, got {shown(t)}")
    return tuple(value)
