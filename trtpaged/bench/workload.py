"""Request workloads for the memory and throughput benchmarks: trace files or synthetic mixes.

A trace is JSON Lines, one request per line:
    {"prompt_len": 312, "output_len": 128, "arrival": 0, "prefix_id": 3, "prefix_len": 256, "n": 1, "beam_width": 1}
Only prompt_len and output_len are required. Requests with the same prefix_id share their
first prefix_len prompt tokens (a system prompt); arrival is the step at which the request
is submitted (default 0); n is the number of parallel samples; beam_width > 1 makes the
request a beam search of that width (n is then how many beams it returns, at most beam_width, as
`serve --request-log` writes a beam request). `bench memory --n/--beam-width` fill the lines that give
neither field (`load_trace_with_sharing`). A ShareGPT dataset (one JSON array) is read by trtpaged.bench.sharegpt,
a Mooncake trace (JSON Lines of timestamp, input_length, output_length, hash_ids) by trtpaged.bench.mooncake: its
requests are TraceRequests whose `hash_ids` name their prompts' 512-token blocks (trtpaged.bench.token_blocks); an
Azure LLM inference or BurstGPT trace (CSV) by trtpaged.bench.csv_trace (trtpaged.bench.timed_trace: what timed traces
share).
"""

from __future__ import annotations

import codecs
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from trtpaged.bench.token_blocks import block_prompt, check_cover, check_hash_ids
from trtpaged.config import MAX_BATCH_SIZE, MAX_SEQ_LEN
from trtpaged.json_input import json_object

# The latest arrival step a trace may give: a replay runs every step up to it.
MAX_ARRIVAL_STEP = (1 << 31) - 1  # a replay skips idle steps: a day's log at 1 ms a step is 8.6e7 of them


@dataclass(frozen=True, slots=True)  # slots: a published trace holds millions
class TraceRequest:
    """One request of a workload: lengths, arrival step, what its prompt shares, its samples or beams.

    The prompt's sharing is described one of two ways: `prefix_id` and `prefix_len` (its first prefix_len tokens are
    those of every request of that prefix_id), or `hash_ids` (a Mooncake trace's: one id per 512-token block,
    prompts whose leading ids are equal share those blocks; trtpaged.bench.token_blocks)."""

    prompt_len: int
    output_len: int
    arrival: int = 0
    prefix_id: Optional[int] = None
    prefix_len: int = 0
    n: int = 1
    beam_width: int = 1
    hash_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        # the highs are a model.yaml's own (max_seq_len, max_batch_size): no engine runs more
        for name, low, high in (("prompt_len", 1, MAX_SEQ_LEN), ("output_len", 1, MAX_SEQ_LEN),
                                ("arrival", 0, MAX_ARRIVAL_STEP), ("prefix_len", 0, MAX_SEQ_LEN),
                                ("n", 1, MAX_BATCH_SIZE), ("beam_width", 1, MAX_BATCH_SIZE)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
            if value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
            if value > high:
                raise ValueError(f"{name}: must be at most {high}, got {value}")
        if self.prefix_id is not None and (not isinstance(self.prefix_id, int) or isinstance(self.prefix_id, bool)):
            raise ValueError(f"prefix_id: must be an integer, got {self.prefix_id!r}")
        if self.prefix_len > self.prompt_len:
            raise ValueError(f"prefix_len: {self.prefix_len} exceeds prompt_len {self.prompt_len}")
        if self.prefix_len and self.prefix_id is None:
            raise ValueError(f"prefix_len: {self.prefix_len} shared with no one (give prefix_id: the requests "
                             "sharing a prefix have the same prefix_id)")
        if self.beam_width > 1 and self.n > self.beam_width:  # a beam search returns n of its beams (serve logs it)
            raise ValueError(f"n: {self.n} beams returned of beam_width {self.beam_width}: at most beam_width")
        if self.hash_ids is not None:
            if not isinstance(self.hash_ids, tuple):
                raise ValueError(f"hash_ids: must be a tuple of block ids, got {type(self.hash_ids).__name__}")
            check_hash_ids(self.hash_ids)
            check_cover(self.prompt_len, len(self.hash_ids), "prompt_len")
            if self.prefix_id is not None:
                raise ValueError("hash_ids, prefix_id: one description of what the prompt shares, not both")

    @property
    def num_seqs(self) -> int:
        """Sequences the request holds at once: its beam_width beams (n of them are returned), or its n samples."""
        return self.beam_width if self.beam_width > 1 else self.n


# the fields of a line of trtpaged's own trace form (hash_ids come from a Mooncake trace's lines)
LINE_FIELDS = tuple(name for name in TraceRequest.__dataclass_fields__ if name != "hash_ids")


def arrival_step(seconds: float, step_time: float) -> int:
    """The replay step at which a request arriving `seconds` after the first is first scheduled, at `step_time`
    seconds a step: rounded up (one that arrives during step k - 1 joins step k; the tolerance absorbs float error).
    ValueError ("is past step ...") when that is past MAX_ARRIVAL_STEP."""
    step = seconds / step_time - 1e-9  # inf where seconds over a tiny step time pass float's range
    if not step <= MAX_ARRIVAL_STEP:
        raise ValueError(f"is past step {MAX_ARRIVAL_STEP} at {step_time} s per step (the latest a replay runs)")
    return max(0, math.ceil(step))


def check_prefix_len(seen: dict[int, tuple[int, str]], request: TraceRequest, where: str) -> None:
    """One prefix_len per prefix_id over a trace (`seen`: prefix_id -> (prefix_len, the line that gave it)): lines
    of one id naming other lengths would share what no replay can build the same way."""
    if request.prefix_id is None:
        return
    length, first = seen.setdefault(request.prefix_id, (request.prefix_len, where))
    if length != request.prefix_len:
        raise ValueError(f"prefix_len: {request.prefix_len} for prefix_id {request.prefix_id}, which {first} gives "
                         f"{length} (one length per shared prefix: give a longer one its own prefix_id)")


def json_objects(path: str | Path, allowed: Iterable[str]) -> Iterator[tuple[str, dict]]:
    """("path:line", object) for each non-blank line of a JSON Lines file; ValueError naming the line for
    a line that is not a JSON object or has a field outside `allowed`."""
    allowed = set(allowed)
    first = True
    for lineno, line in enumerate(read_lines(path), 1):
        if line.strip():
            where = f"{path}:{lineno}"
            text = line.strip()
            if text in ("[", "{") or (first and text.startswith("[")):  # a whole JSON document, not JSON Lines
                raise ValueError(f"{where}: expected JSON Lines, one request object per line (a pretty-printed "
                                 "document is not read: write one object per line; a JSON array is read only as a "
                                 'ShareGPT dataset, [{"conversations": [...]}, ...], where the benchmark takes one)')
            first = False
            try:
                data = json_object(text, where, allowed)
            except ValueError:
                other = foreign_form(text)
                if other:
                    raise ValueError(f"{where}: {other}") from None
                raise
            yield where, data


def foreign_form(line: str) -> Optional[str]:
    """What a JSON line no trace form takes is, when it is a known document of another tool's, and what to give
    instead; None for any other line."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    if "conversations" in data:
        return ("a ShareGPT conversation as a JSON line: a ShareGPT dataset is read as vLLM's benchmarks read it, one "
                'JSON array of conversations, [{"conversations": [...]}, ...] (make the lines one array: '
                "jq -s . FILE)")  # fmt: skip
    held = next((key for key, value in data.items() if isinstance(value, list) and value
                 and isinstance(value[0], dict) and "conversations" in value[0]), None)
    if held is not None:
        return (f"a JSON object holding ShareGPT conversations under {held!r}: a ShareGPT dataset is the array itself, "
                f'[{{"conversations": [...]}}, ...], as vLLM\'s benchmarks read it (jq .{json.dumps(held)} FILE)')
    if "samples" in data and "metadata" in data:
        return ("TensorRT-LLM's C++ benchmark workload (prepare_dataset.py --output), which trtllm-bench does not read "
                "either: give the JSON Lines that prepare_dataset.py --stdout (or trtllm-bench prepare-dataset "
                "--output) writes, one request a line, {\"task_id\": N, \"input_ids\": [...], \"output_tokens\": N}")
    return None


def read_lines(path: str | Path) -> Iterator[str]:
    """The lines of a text file, read one at a time (a trace may be larger than memory), without their line ends (a
    leading byte-order mark dropped, as editors write one); ValueError naming the file and the byte when it is not
    UTF-8 text. A line ends at \n (or \r\n) alone, as JSON Lines says: U+2028 and the other breaks str.splitlines
    takes are characters a JSON string may hold raw (json.dumps(ensure_ascii=False) writes them so)."""
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise not_utf8(path, "JSON Lines") from None
            if index == 0 and line.startswith("\ufeff"):
                line = line[1:]
            yield line.rstrip("\r\n")


# what a file that is not UTF-8 is by its leading bytes, and the command that gives its text: the compressed forms a
# trace may be downloaded in, and UTF-16 (what Windows PowerShell 5's `>` writes a program's output as)
_NOT_UTF8 = (
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it first (gunzip FILE)"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first (unzstd FILE)"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it first (unxz FILE)"),
    (b"BZh", "a bzip2-compressed file", "decompress it first (bunzip2 FILE)"),
    (b"PK\x03\x04", "a zip archive", "take the file out first (unzip FILE)"),
    (b"\xff\xfe", "UTF-16 text (little-endian)", "convert it first (iconv -f UTF-16 -t UTF-8 FILE)"),
    (b"\xfe\xff", "UTF-16 text (big-endian)", "convert it first (iconv -f UTF-16 -t UTF-8 FILE)"),
)


def packed_form(head: bytes) -> Optional[tuple[str, str]]:
    """What a file opening with `head` is when it is compressed or UTF-16 text, and the command that gives its UTF-8
    text (FILE standing for its name); None for any other start."""
    return next(((what, advice) for magic, what, advice in _NOT_UTF8 if head.startswith(magic)), None)


def refuse_packed(path: str | Path) -> None:
    """ValueError (`not_utf8`'s, naming what the file is and the command that gives its text) when `path` opens as a
    compressed file or UTF-16 text. The commands call it before a trace's form decides which of their options apply:
    a packed file has no first line to tell its form by, and an option refused for a form it is not (`--step-time`
    given with a gzip'd Mooncake trace: "has none") hid what was wrong."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if packed_form(head) is None:
        return
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # a character cut at the read's end is no error
    except UnicodeDecodeError:
        raise not_utf8(path, "a trace's text (JSON Lines, a CSV trace or a ShareGPT JSON array)") from None


def refuse_foreign(path: str | Path) -> None:
    """ValueError naming the line when the file's first non-blank line is another tool's document that no trace form
    takes (`foreign_form`: ShareGPT conversations written one a line, or held under a key, ...). The commands call it
    before a trace's form decides which of their options apply: ShareGPT lines given with --num-requests, as a
    ShareGPT dataset takes, were refused for that option, hiding what was wrong. A first line over 1 MiB is left to
    the readers (a one-line JSON document may be hundreds of MB)."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        lineno, line = 1, f.readline(1 << 20)
        while line and not line.strip() and line.endswith("\n"):
            lineno, line = lineno + 1, f.readline(1 << 20)
    if not line.endswith("\n") and len(line) == 1 << 20:
        return
    other = foreign_form(line.strip())
    if other:
        raise ValueError(f"{path}:{lineno}: {other}")


def not_utf8(path: str | Path, expected: str) -> ValueError:
    """The error for a trace file that is not UTF-8 text, naming the first byte that is not and what was `expected`;
    a compressed or UTF-16 file is named as one, with the command that gives its UTF-8 text (no reader decompresses
    or converts: the trace forms are published as UTF-8 text, and vLLM's and trtllm-bench's readers take only that).
    The file is read again to find the byte (a text-mode reader's error counts from its last buffer, not the file's
    start)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, where = 0, ""
    with open(path, "rb") as f:
        head = f.read(6)
        f.seek(0)
        while not where:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character split between two reads
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                where = f" ({exc.reason} at byte {offset - pending + exc.start})"
            if not chunk:
                break
            offset += len(chunk)
    what, advice = packed_form(head) or ("", "")
    return ValueError(f"{path}: {what + ', ' if what else ''}not UTF-8 text{where}"
                      f"{': ' + advice.replace('FILE', str(path)) if advice else ''}; expected {expected}")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Reads a JSON Lines trace; errors name the line and the field."""
    return [request for _, request in load_trace_lines(path)]


def load_trace_lines(path: str | Path) -> list[tuple[str, TraceRequest]]:
    """Each request of a JSON Lines trace with its "file:line"; errors name the line and the field."""
    return _trace_entries(path, {})[0]


def _trace_entries(path: str | Path, fill: dict) -> tuple[list[tuple[str, TraceRequest]], int]:
    """("file:line", request) per line, `fill` set on the lines that give neither n nor beam_width; and how many
    lines it filled."""
    from trtpaged.bench.mooncake import MOONCAKE_FIELDS, refuse_mixed_line

    entries, filled = [], 0
    prefix_lens: dict[int, tuple[int, str]] = {}
    for where, data in json_objects(path, LINE_FIELDS + MOONCAKE_FIELDS):
        refuse_mixed_line(where, data, "trtpaged", entries[0][0] if entries else None)
        if fill and "n" not in data and "beam_width" not in data:
            data, filled = {**data, **fill}, filled + 1
        missing = next((name for name in ("prompt_len", "output_len") if name not in data), None)
        if missing:
            raise ValueError(f"{where}: {missing}: required")
        try:
            request = TraceRequest(**data)
            check_prefix_len(prefix_lens, request, where)
            entries.append((where, request))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    if not entries:
        raise ValueError(f"{path}: no requests")
    return entries, filled


def load_trace_with_sharing(path: str | Path, n: Optional[int] = None,
                            beam_width: Optional[int] = None) -> tuple[list[TraceRequest], int]:  # fmt: skip
    """Reads a trace, and fills in the sharing a flag asks for; returns (requests, lines the flag filled).

    The rule: a line's own `n` or `beam_width` wins; `n` (or `beam_width`) is set on the lines that
    give neither. Both at once is an error (a line is parallel sampling or a beam search), and so is a
    flag that fills no line (every line gives its own): a flag is never silently ignored.
    """
    if n is not None and beam_width is not None:
        raise ValueError("--n, --beam-width: give one of them with --trace "
                         "(a line is parallel sampling or a beam search)")
    flag, value = ("--n", {"n": n}) if n is not None else ("--beam-width", {"beam_width": beam_width})
    entries, filled = _trace_entries(path, value if n is not None or beam_width is not None else {})
    requests = [request for _, request in entries]
    if (n is not None or beam_width is not None) and not filled:
        raise ValueError(f"{flag}: every line of {path} gives its own n or beam_width, which wins; the flag "
                         "would change nothing")  # fmt: skip
    return requests, filled


# Length ranges whose means match the PagedAttention paper's datasets (uniform, so only the means match):
# Alpaca: 19.3 input / 58.5 output tokens; ShareGPT: 161.3 input / 338.0 output tokens.
PRESETS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "alpaca": ((4, 35), (8, 109)),
    "sharegpt": ((16, 306), (16, 660)),
}


def parse_range(text: str, name: str) -> tuple[int, int]:
    """'128' or '64:512' -> (low, high)."""
    try:
        low, colon, high = text.partition(":")
        lo, hi = int(low), int(high if colon else low)  # "64:" is no range (it was read as 64)
    except ValueError:
        raise ValueError(f"{name}: expected N or LOW:HIGH, got {text!r}") from None
    if not 1 <= lo <= hi <= MAX_SEQ_LEN:
        raise ValueError(f"{name}: expected 1 <= LOW <= HIGH <= {MAX_SEQ_LEN}, got {text!r}")
    return lo, hi


def synthetic_trace(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
    n: int = 1,
    seed: int = 0,
    beam_width: int = 1,
) -> list[TraceRequest]:
    """Uniformly random lengths, all arriving at step 0; optional shared system prompts."""
    if num_requests < 1:
        raise ValueError(f"num_requests: must be >= 1, got {num_requests}")
    if shared_prefix_len and num_prefixes < 1:
        raise ValueError(f"--num-prefixes: must be >= 1 with a shared prefix, got {num_prefixes}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_len) + shared_prefix_len
        prefix = rng.randrange(num_prefixes) if shared_prefix_len else None
        out.append(TraceRequest(plen, rng.randint(*output_len), 0, prefix, shared_prefix_len, n, beam_width))
    return out


def prompt_token_ids(requests: list[TraceRequest], vocab: int = 30000, seed: int = 0) -> list[list[int]]:
    """Token ids in [1, vocab) for each request: shared prefixes identical, everything else random (no accidental
    sharing). A request with `hash_ids` gets its ids' blocks (trtpaged.bench.token_blocks: the same block for an id
    in every request, drawn with `seed`)."""
    rng = random.Random(seed)
    prefixes: dict[int, list[int]] = {}
    blocks: dict[int, list[int]] = {}
    out = []
    for r in requests:
        if r.hash_ids is not None:
            out.append(block_prompt(r.hash_ids, r.prompt_len, range(1, vocab), seed, blocks))
        else:
            out.append(random_prompt(r, vocab, rng, prefixes))
    return out


def random_prompt(request: TraceRequest, vocab: int, rng: random.Random, prefixes: dict[int, list[int]]) -> list[int]:
    """`request.prompt_len` random ids in [1, vocab) drawn from `rng`, the first prefix_len those of every request of
    its prefix_id (`prefixes`: each prefix_id's ids, drawn for the first request of it)."""
    ids: list[int] = []
    if request.prefix_id is not None and request.prefix_len:
        prefix = prefixes.setdefault(request.prefix_id, [rng.randrange(1, vocab) for _ in range(request.prefix_len)])
        ids = list(prefix[: request.prefix_len])
    return ids + [rng.randrange(1, vocab) for _ in range(request.prompt_len - len(ids))]
