"""Azure LLM inference traces and BurstGPT as a benchmark's `--trace`: CSV files of arrival times and lengths.

The two public production traces that DistServe, Splitwise, vLLM and TensorRT-LLM users replay, one request a row:
- Azure (Azure/AzurePublicDataset, AzureLLMInferenceTrace_code.csv / _conv.csv, 2023 and 2024):
      TIMESTAMP,ContextTokens,GeneratedTokens
      2023-11-16 18:15:46.6805900,4808,10
  TIMESTAMP a date and time (any number of fractional digits, kept to the nanosecond; an optional UTC offset,
  `+00:00` or `Z`, applied; none: UTC), ContextTokens the prompt's tokens, GeneratedTokens the output's;
- BurstGPT (HPMLL/BurstGPT, BurstGPT_1.csv, ...):
      Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
      5.0,ChatGPT,472,18,490,Conversation log
  Timestamp seconds since the trace's start, Request and Response tokens the lengths; Total tokens is checked as a
  count and Model and Log Type are not read.
The form is the header's (the first non-blank line, its columns in any order, each once, none other); a file is read
as CSV when that line opens neither a JSON object nor a JSON array and has a comma (or the file's name ends in .csv).
Neither form carries prompt text or prefix ids: a request's prompt is random tokens of its length, sharing nothing
with another's, and its output the generated length.

The rules (every row checked, an error names the line, the column and the bound, one line):
- a row has the header's columns (a JSON line in it is refused as another form, a repeated header as two files
  joined); lengths are integers from 0 to MAX_SEQ_LEN, timestamps as above (BurstGPT's from 0 to MAX_SECONDS);
- a row whose output length is 0 (BurstGPT's failed requests; BurstGPT_without_fails_*.csv has none) or whose prompt
  length is 0 ran nothing that a replay could: it is skipped, and the summary says how many were;
- the requests are taken in timestamp order, ties in file order, as a Mooncake trace's (the published files are
  sorted; a concatenation need not be), and the summary says how many rows came earlier than one before them.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Iterator, Optional

from trtpaged.bench.timed_trace import TimedRequest, TimedTrace, in_time_order
from trtpaged.bench.token_blocks import shown
from trtpaged.bench.workload import TraceRequest, not_utf8
from trtpaged.config import MAX_SEQ_LEN

MAX_SECONDS = (1 << 31) - 1  # a BurstGPT timestamp's bound (68 years; the published traces span four months)
_DETECT_BYTES = 1 << 20  # a first line longer than this is not looked at (a header is a few dozen bytes)
_NS = 1_000_000_000
_EPOCH = datetime(1970, 1, 1)
_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:?\d{2})?")
_COUNT = re.compile(r"[0-9]+")
_DATETIME_FORM = "YYYY-MM-DD HH:MM:SS[.fraction][+HH:MM]"


def datetime_ns(text: str) -> int:
    """Nanoseconds since 1970-01-01 UTC of a date and time as the Azure traces write it; ValueError saying what is
    expected. Fractional digits past the ninth are dropped."""
    match = _DATETIME.fullmatch(text.strip())
    if not match:
        raise ValueError(f"must be a date and time, {_DATETIME_FORM}, got {shown(text)}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        moment = datetime(year, month, day, hour, minute, second) - _EPOCH
    except ValueError as exc:  # month 13, hour 25, February 30
        raise ValueError(f"must be a date and time, {_DATETIME_FORM}, got {shown(text)} ({exc})") from None
    ns = (moment.days * 86400 + moment.seconds) * _NS + int((match.group(7) or "0")[:9].ljust(9, "0"))
    offset = match.group(8)
    if offset and offset != "Z":
        digits = offset[1:].replace(":", "")
        minutes = int(digits[:2]) * 60 + int(digits[2:])
        ns -= (1 if offset[0] == "+" else -1) * minutes * 60 * _NS
    return ns


def seconds_ns(text: str) -> int:
    """Nanoseconds of a number of seconds from 0 to MAX_SECONDS (BurstGPT's Timestamp), rounded to the nanosecond;
    ValueError saying what is expected."""
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite():
        raise ValueError(f"must be a number of seconds since the trace's start, got {shown(text)}")
    if not 0 <= value <= MAX_SECONDS:
        raise ValueError(f"must be from 0 to {MAX_SECONDS} seconds, got {shown(text)}")
    return int((value * _NS).to_integral_value())


def token_count(text: str) -> int:
    """A count of tokens from 0 to MAX_SEQ_LEN, written as digits; ValueError naming the bound. Checked before it is
    made an integer: a row's 10^12 tokens are refused, never allocated."""
    digits = text.strip()
    if not _COUNT.fullmatch(digits):
        raise ValueError(f"must be an integer from 0 to {MAX_SEQ_LEN} (tokens), got {shown(text)}")
    if len(digits.lstrip("0")) > len(str(MAX_SEQ_LEN)) or int(digits) > MAX_SEQ_LEN:
        raise ValueError(f"must be from 0 to {MAX_SEQ_LEN} (tokens), got {shown(digits)}")
    return int(digits)


@dataclass(frozen=True)
class CsvForm:
    """A CSV trace form: its name, its header, and the columns that give a request's time and lengths."""

    name: str
    header: tuple[str, ...]
    time: str
    prompt: str
    output: str
    parse_time: Callable[[str], int]  # a timestamp cell -> nanoseconds
    counts: tuple[str, ...] = ()  # other columns checked as token counts, not read


AZURE = CsvForm("Azure", ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), "TIMESTAMP", "ContextTokens",
                "GeneratedTokens", datetime_ns)  # fmt: skip
BURSTGPT = CsvForm("BurstGPT", ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"),
                   "Timestamp", "Request tokens", "Response tokens", seconds_ns, ("Total tokens",))  # fmt: skip
FORMS = (AZURE, BURSTGPT)
# a published trace's column that no trtpaged benchmark can replay: its header is refused saying why (as
# trtllm-bench's media_paths is), not as an unknown column
UNREPLAYED = {"NumImages": "the Azure multimodal trace's (AzureLMMInferenceTrace_multimodal.csv, 2025): its requests "
                           "carry images, and trtpaged's engines and benchmarks take text"}  # fmt: skip
HEADERS = " or ".join(f"{form.name}'s {','.join(form.header)}" for form in FORMS)


@dataclass(frozen=True)
class CsvTrace(TimedTrace):
    """A CSV trace's requests in replay order, how many rows came out of order, and the rows skipped: those with no
    output (failed requests) and those with no prompt."""

    name: str = "CSV"  # the form's
    skipped_no_output: int = 0
    skipped_no_prompt: int = 0

    @property
    def form(self) -> str:  # type: ignore[override]  # a CSV trace's form is its header's
        return self.name

    def stamp(self, request: TimedRequest) -> str:
        return f"{_form(self.name).time}: {(request.time_ns - self.requests[0].time_ns) / 1e9:g} s after the first"

    def summary(self) -> str:
        """One line for the run's log: requests, that nothing is shared, the time span, skipped and reordered rows."""
        form = _form(self.name)
        line = (f"{self.path}: {len(self.requests)} {self.name} requests (no prompt text or prefix ids: each prompt is "
                f"random tokens of its length, sharing nothing), arrivals over {self.span_s():g} s")  # fmt: skip
        skipped = [f"{n} row{'s' if n > 1 else ''} with {column} 0 ({why})"
                   for n, column, why in ((self.skipped_no_output, form.output, "failed requests"),
                                          (self.skipped_no_prompt, form.prompt, "no prompt to send")) if n]  # fmt: skip
        if skipped:
            line += f"; skipped {' and '.join(skipped)}"
        return line + self.order_note()


def _form(name: str) -> CsvForm:
    return next(form for form in FORMS if form.name == name)


def csv_form(path: str | Path) -> Optional[str]:
    """The CSV form `path` is to be read as: "Azure" or "BurstGPT" by its header, "CSV" for a CSV file whose header
    is neither (the reader refuses it naming the line), None for a file that is not CSV (see the module's doc)."""
    line = first_line(path)
    if line is None:
        return None
    text = line.strip()
    if text.startswith(("{", "[")) or ("," not in text and Path(path).suffix.lower() != ".csv"):
        return None
    try:
        names = [name.strip() for name in next(csv.reader([text]))]
    except csv.Error:
        return "CSV"
    form = _form_of(names)
    return form.name if form else "CSV"


def first_line(path: str | Path) -> Optional[str]:
    """The first non-blank line of a text file (a byte-order mark dropped; bytes that are not UTF-8 replaced, for the
    reader to refuse naming them); None when there is none or it is longer than _DETECT_BYTES."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        line = " "
        while line and not line.strip():
            line = f.readline(_DETECT_BYTES)
    if not line or (len(line) == _DETECT_BYTES and not line.endswith("\n")):
        return None
    return line


def _form_of(names: list[str]) -> Optional[CsvForm]:
    """The form whose columns a header names most of (None: none of any)."""
    best = max(FORMS, key=lambda form: len(set(form.header) & set(names)))
    return best if set(best.header) & set(names) else None


def read_csv_trace(path: str | Path) -> CsvTrace:
    """Reads an Azure or BurstGPT trace (the module's rules); ValueError naming the line, the column and the bound."""
    lines: list[TimedRequest] = []
    form: Optional[CsvForm] = None
    no_output = no_prompt = 0
    for where, row in _rows(path):
        if form is None:
            form, index = _header(where, row)
            continue
        try:
            time_ns, prompt, output = _row(form, index, row)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not output:
            no_output += 1
        elif not prompt:
            no_prompt += 1
        else:
            lines.append(TimedRequest(where, time_ns, TraceRequest(prompt, output)))
    if form is None:
        raise ValueError(f"{path}: no header, no requests (a CSV trace's first line is {HEADERS})")
    if not lines:
        raise ValueError(f"{path}: no requests" + (f" (every row has {form.output} 0 or {form.prompt} 0)"
                                                   if no_output or no_prompt else ""))  # fmt: skip
    ordered, reordered = in_time_order(lines)
    return CsvTrace(str(path), ordered, reordered, form.name, no_output, no_prompt)


def _rows(path: str | Path) -> Iterator[tuple[str, list[str]]]:
    """("file:line", cells) for each non-blank row (the line it starts on); ValueError naming the line of what
    Python's csv module cannot read, or the file when it is not UTF-8."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, strict=True)
        start = 1
        try:
            for row in reader:
                if any(cell.strip() for cell in row):
                    yield f"{path}:{start}", row
                start = reader.line_num + 1
        except csv.Error as exc:
            raise ValueError(f"{path}:{start}: not CSV this reader takes ({exc})") from None
        except UnicodeDecodeError:
            raise not_utf8(path, "a CSV trace or JSON Lines") from None


def _header(where: str, row: list[str]) -> tuple[CsvForm, dict[str, int]]:
    """The form a header row names, and each of its columns' index; ValueError naming the line."""
    names = [cell.strip() for cell in row]
    form = _form_of(names)
    if form is None:
        raise ValueError(f"{where}: not a trace header: {shown(','.join(row))}; expected JSON Lines, or a CSV trace "
                         f"whose first line is {HEADERS}")  # fmt: skip
    unreplayed = next((name for name in names if name in UNREPLAYED), None)
    if unreplayed:
        raise ValueError(f"{where}: column {unreplayed!r}: {UNREPLAYED[unreplayed]}; no such trace is replayed")
    twice = sorted({name for name in names if names.count(name) > 1})
    missing = [name for name in form.header if name not in names]
    unknown = [name for name in names if name not in form.header]
    for problem, which in (("given twice", twice), ("missing", missing), ("unknown", unknown)):
        if which:
            raise ValueError(f"{where}: column(s) {', '.join(map(repr, which))} {problem}: {form.name}'s header is "
                             f"{','.join(form.header)}")  # fmt: skip
    return form, {name: i for i, name in enumerate(names)}


def _row(form: CsvForm, index: dict[str, int], row: list[str]) -> tuple[int, int, int]:
    """(time in ns, prompt tokens, output tokens) of one data row; ValueError naming the column and the bound."""
    if row[0].lstrip().startswith(("{", "[")):
        raise ValueError(f"a JSON line in this {form.name} trace (a CSV file, known by its header): one trace form "
                         "per file")  # fmt: skip
    if len(row) != len(index):
        raise ValueError(f"{len(row)} columns where the header has {len(index)} ({','.join(form.header)})")
    if [cell.strip() for cell in row] == list(index):
        raise ValueError("the header again (two files joined?): one header per file, on its first line")
    cell = {name: row[i] for name, i in index.items()}
    values = []
    for name, parse in ((form.time, form.parse_time), (form.prompt, token_count), (form.output, token_count),
                        *((name, token_count) for name in form.counts)):  # fmt: skip
        try:
            values.append(parse(cell[name]))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return values[0], values[1], values[2]
