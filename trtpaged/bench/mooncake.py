"""Mooncake traces as a benchmark's `--trace` (`bench serve`, `bench throughput`, `bench memory`).

Mooncake's FAST'25 traces are the public workloads for prefix caching (replayed by aiperf, Dynamo's data generator,
TensorRT-LLM's benchmarks): JSON Lines, one request a line,
    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}
timestamp: the request's arrival, milliseconds since the trace's start; hash_ids: one id per 512-token block of the
prompt, the last block possibly partial; two requests share exactly their leading blocks whose ids are equal (a tree
of shared prefixes). The prompts are made of those blocks (trtpaged.bench.token_blocks).

The rules (every line checked, an error names the line, the field and the bound):
- a file is read as Mooncake's when its first line gives one of its fields (`is_mooncake`); a line of trtpaged's own
  trace form in it, or a Mooncake line in a trtpaged trace, is refused naming it (one form per file);
- the four fields are required; timestamp a number of milliseconds from 0 to MAX_TIMESTAMP_MS (an integer in the
  FAST'25 traces; a fraction, as aiperf takes and synthesizers write, kept to the nanosecond), input_length and
  output_length integers from 1 to MAX_SEQ_LEN, hash_ids a non-empty list of integers from 0 to 2^63 - 1, with
  input_length from (n - 1) * 512 + 1 to n * 512 for n ids (aiperf's rule: every block holds a token, only the last
  is partial);
- timestamps may go backwards: the requests are taken in timestamp order, ties in file order (as aiperf's fixed
  schedule sends them), and the summary says how many lines came earlier than one before them.
Arrivals are every timed trace's (trtpaged.bench.timed_trace): `bench serve` sends each request at its timestamp,
counted from the first; `bench memory`'s replay steps come from `--step-time` (the rule `diagnose` applies to a
server log's seconds); `bench throughput` submits every request at t = 0 (its form, as its baseline runs) and says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from trtpaged.bench.timed_trace import TimedRequest, TimedTrace, in_time_order
from trtpaged.bench.token_blocks import BLOCK_TOKENS, bounded_integer, check_cover, check_hash_ids, shown
from trtpaged.bench.workload import LINE_FIELDS, MAX_ARRIVAL_STEP, TraceRequest, json_objects
from trtpaged.config import MAX_SEQ_LEN

MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
MAX_TIMESTAMP_MS = MAX_ARRIVAL_STEP  # 24.8 days (the FAST'25 traces span an hour)
LINE_FORM = '{"timestamp": MS, "input_length": N, "output_length": N, "hash_ids": [ID, ...]}'
_DETECT_BYTES = 1 << 20  # a first line longer than this is not looked at (Mooncake's are a few kB)
_NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class MooncakeTrace(TimedTrace):
    """A Mooncake trace's requests in replay order (timestamp, then line; each one's time its timestamp in ms), and
    how many lines came out of order."""

    form: ClassVar[str] = "Mooncake"

    def span_text(self) -> str:
        return _ms(self.requests[-1].time_ns - self.requests[0].time_ns)

    def stamp(self, request: TimedRequest) -> str:
        return f"timestamp: {_ms(request.time_ns)}"

    def summary(self) -> str:
        """One line for the run's log: requests, blocks, how many are shared, the time span, any reordering."""
        counts: dict[int, int] = {}
        for r in self.requests:
            for hash_id in set(r.request.hash_ids or ()):
                counts[hash_id] = counts.get(hash_id, 0) + 1
        shared = sum(1 for c in counts.values() if c > 1)
        return (f"{self.path}: {len(self.requests)} Mooncake requests, {len(counts)} distinct {BLOCK_TOKENS}-token "
                f"blocks ({shared} in more than one request), arrivals over {self.span_s():g} s{self.order_note()}")


def is_mooncake(path: str | Path) -> bool:
    """Whether `path` is to be read as a Mooncake trace: its first non-blank line is a JSON object giving one of
    Mooncake's fields. Anything else (not UTF-8, not JSON, a first line over 1 MiB) is left to the JSON Lines
    reader, whose error names it."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            line = " "
            while line and not line.strip():
                line = f.readline(_DETECT_BYTES)  # never more: a one-line JSON document may be hundreds of MB
            if not line or (len(line) == _DETECT_BYTES and not line.endswith("\n")):
                return False
            data = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return False
    return isinstance(data, dict) and any(name in data for name in MOONCAKE_FIELDS)


def read_mooncake(path: str | Path) -> MooncakeTrace:
    """Reads a Mooncake trace (the module's rules); ValueError naming the line, the field and the bound."""
    lines: list[TimedRequest] = []
    first: Optional[str] = None
    for where, data in json_objects(path, MOONCAKE_FIELDS + LINE_FIELDS):
        refuse_mixed_line(where, data, "Mooncake", first)
        first = first or where
        try:
            lines.append(_request(where, data))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if not lines:
        raise ValueError(f"{path}: no requests")
    return MooncakeTrace(str(path), *in_time_order(lines))


def refuse_mixed_line(where: str, data: dict, form: str, first: Optional[str] = None) -> None:
    """ValueError naming the line when a line of a `form` ("Mooncake" or "trtpaged") trace gives the other form's
    fields: one form per file (`first`: the file's first line, None when this is it)."""
    mooncake = [name for name in MOONCAKE_FIELDS if name in data]
    ours = [name for name in LINE_FIELDS if name in data]
    if mooncake and ours:
        raise ValueError(f"{where}: mixes a Mooncake line's fields ({', '.join(mooncake)}) with a trtpaged trace "
                         f"line's ({', '.join(ours)}): one trace form per line and per file")  # fmt: skip
    foreign, fields = ("trtpaged", ours) if form == "Mooncake" else ("Mooncake", mooncake)
    if fields:
        context = f"a file whose first line (line {first.rsplit(':', 1)[-1]}) is a {form} one" if first \
            else f"a {form} trace"
        raise ValueError(f"{where}: a {foreign} trace line ({', '.join(fields)}) in {context}: one trace form per "
                         f"file (a Mooncake line is {LINE_FORM})")  # fmt: skip


def _request(where: str, data: dict) -> TimedRequest:
    """One checked line (field names are Mooncake's in the errors)."""
    missing = [name for name in MOONCAKE_FIELDS if name not in data]
    if missing:
        raise ValueError(f"{', '.join(missing)}: required (a Mooncake line is {LINE_FORM})")
    time_ns = _timestamp_ns(data["timestamp"])
    input_length = bounded_integer("input_length", data["input_length"], 1, MAX_SEQ_LEN)
    output_length = bounded_integer("output_length", data["output_length"], 1, MAX_SEQ_LEN)
    hash_ids = check_hash_ids(data["hash_ids"])
    check_cover(input_length, len(hash_ids), "input_length")
    return TimedRequest(where, time_ns, TraceRequest(input_length, output_length, hash_ids=hash_ids))


def _ms(ns: int) -> str:
    """Nanoseconds as milliseconds, written as a trace writes them: "27482 ms", "1500.5 ms"."""
    whole, part = divmod(ns, _NS_PER_MS)
    return f"{whole}.{part:06d}".rstrip("0") + " ms" if part else f"{whole} ms"


def _timestamp_ns(value: object) -> int:
    """A line's timestamp (milliseconds since the trace's start, an integer or a fraction) in nanoseconds; ValueError
    naming the field and the bound."""
    if isinstance(value, float) and math.isfinite(value):
        if not 0 <= value <= MAX_TIMESTAMP_MS:
            raise ValueError(f"timestamp: must be from 0 to {MAX_TIMESTAMP_MS} (milliseconds since the trace's start), "
                             f"got {value!r}")  # fmt: skip
        return round(value * _NS_PER_MS)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"timestamp: must be a number from 0 to {MAX_TIMESTAMP_MS} (milliseconds since the trace's "
                         f"start), got {shown(value)}")  # fmt: skip
    return bounded_integer("timestamp", value, 0, MAX_TIMESTAMP_MS, " (milliseconds since the trace's start)") \
        * _NS_PER_MS
