"""The server's request log (`trtpaged serve --request-log PATH`): one JSON line per engine request that ended
(finished, failed, or aborted: client gone, timeout, shutdown).

A line (the fields `trtpaged diagnose LOG` reads; README.md, Serving):

    {"arrival": 12.031, "prompt_len": 54, "output_len": 16, "output_lens": [16, 9], "n": 2, "beam_width": 1,
     "cached_tokens": 48, "finish_reasons": ["length", "stop"], "ttft_s": 0.041, "latency_s": 0.62,
     "steps": 18, "step_time_s": 0.021}

arrival: seconds since the log began (a server restarted on the same log goes on from where its last line
ended, so that `diagnose` reads the runs one after the other, not overlaid); output_len: the longest
completion (what a replay gives each of the n samples); output_lens / finish_reasons: per completion, in index order
(an aborted request's: the tokens made until then, "abort" for each completion still running); cached_tokens: prompt
tokens found in the prefix cache; steps: engine steps while the request was in flight; step_time_s: the
server's mean engine-step time so far. `prompt_token_ids` only when prompts are logged (`log_prompts`).

Lines are written by a writer thread from a bounded queue, never on the engine thread: a full queue drops
the line (counted), and a failing disk stops the log (logged once) without failing any request, the log cut
back to its last whole line. A last line cut short (the process killed mid-write) is removed when the log is
opened again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

log = logging.getLogger("trtpaged.server")

_STOP = object()


def finished_line(prompt_token_ids: Sequence[int], cached_tokens: Optional[int], output_lens: list[int],
                  finish_reasons: list[str], arrival_s: float, ttft_s: Optional[float], latency_s: float, n: int,
                  beam_width: int, steps: int, step_time_s: Optional[float], log_prompts: bool) -> dict:  # fmt: skip
    """The log line of one finished or aborted request (see the module docstring for the fields): its prompt and
    prefix-cache hit (None: never scheduled), `output_lens` and `finish_reasons` per completion in index order
    (the server counts them over the request's DELTA outputs)."""
    lens = list(output_lens)
    line: dict = {"arrival": round(arrival_s, 6), "prompt_len": len(prompt_token_ids)}
    if log_prompts:
        line["prompt_token_ids"] = list(prompt_token_ids)
    line.update(output_len=max(lens, default=0), output_lens=lens, n=n, beam_width=beam_width,
                cached_tokens=cached_tokens or 0,
                finish_reasons=list(finish_reasons),
                ttft_s=None if ttft_s is None else round(ttft_s, 6), latency_s=round(latency_s, 6), steps=steps,
                step_time_s=None if step_time_s is None else round(step_time_s, 6))  # fmt: skip
    return line


_TAIL_BYTES = 1 << 20  # where a log's last line is looked for


def _end_of_last_run(path: Path) -> float:
    """Where an existing log's timeline ends: its last line's arrival + latency (lines are written as requests
    finish), 0 for a new or empty log. A last line cut short by a kill is cut off first (appended to, it would have
    made a line no reader can parse, for good); a whole one that lost only its newline gets it."""
    try:
        f = open(path, "rb+")  # noqa: SIM115
    except FileNotFoundError:
        return 0.0
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return 0.0  # a device (/dev/full reads zeros without end) or a pipe: no earlier run to read
        size = f.seek(0, 2)
        start = max(0, size - _TAIL_BYTES)
        f.seek(start)
        tail = f.read(_TAIL_BYTES)
        end = tail.rfind(b"\n")
        if end < 0 and start > 0:
            return 0.0  # a line longer than the tail: not a request log's; left as it is
        if end + 1 < len(tail):
            whole = _arrival_end(tail[end + 1 :])
            if whole is not None:  # a whole line that lost only its newline: it is ended, not cut
                f.write(b"\n")
                return whole
            log.warning("request log %s: its last line was cut short (a process killed mid-write); removed", path)
            f.truncate(start + end + 1)
        last = tail[: end + 1].rstrip(b"\n").rsplit(b"\n", 1)[-1]
    return _arrival_end(last) or 0.0


def _arrival_end(line: bytes) -> Optional[float]:
    """A request line's arrival + latency; None for anything else (a cut line, a line of another program)."""
    try:
        record = json.loads(line)
        return float(record["arrival"]) + float(record["latency_s"])
    except (ValueError, KeyError, TypeError):
        return None


class RequestLog:
    """Appends JSON lines to `path` from a writer thread; each batch of queued lines is flushed at once."""

    def __init__(self, path: str | Path, log_prompts: bool = False, max_queued: int = 10_000) -> None:
        self.path = Path(path)
        self.log_prompts = log_prompts
        self.dropped = 0  # lines lost to a full queue, a line that could not be encoded, or a failed disk
        self.failed: Optional[str] = None  # why writing stopped, once it did
        self._queue: "queue.Queue[object]" = queue.Queue(max_queued)
        try:
            resume_at = _end_of_last_run(self.path)
            # a descriptor of its own, written a batch at a time: a failed write is cut back to the last whole line
            # (a buffered file object would write its buffer's rest again when closed)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OSError(exc.errno, f"request_log: cannot open {self.path} for appending: {exc.strerror}") from None
        self._regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._pending: list[str] = []  # the batch's lines, written by _flush
        self.started = time.monotonic() - resume_at  # arrivals: seconds since the log began
        self._thread = threading.Thread(target=self._write_loop, name="trtpaged-request-log", daemon=True)
        self._thread.start()

    def record(self, line: dict) -> None:
        """Queues one line (any thread, never blocks); dropped when the queue is full or writing failed."""
        if self.failed is not None:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            if not self.dropped:
                log.warning("request log %s: the writer is behind; dropping lines", self.path)
            self.dropped += 1

    def record_finished(self, prompt_token_ids: Sequence[int], cached_tokens: Optional[int], **fields: Any) -> None:
        """`record(finished_line(prompt_token_ids, cached_tokens, ...))`, for the engine thread: a line that cannot be
        built is dropped, never raised."""
        try:
            self.record(finished_line(prompt_token_ids, cached_tokens, log_prompts=self.log_prompts, **fields))
        except Exception:  # noqa: BLE001 - the request log must never fail a request or the engine loop
            if not self.dropped:
                log.exception("request log %s: cannot build a line; dropped", self.path)
            self.dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Writes what is queued, flushes and closes the file."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _write_loop(self) -> None:
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while True:  # then whatever else is queued: one flush per batch
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                stop = _STOP in batch
                for line in batch:
                    if line is not _STOP:
                        self._write(line)
                self._flush()
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass

    def _write(self, line: object) -> None:
        if self.failed is not None:
            self.dropped += 1
            return
        try:
            text = json.dumps(line, allow_nan=False) + "\n"
        except (TypeError, ValueError):
            log.warning("request log %s: a line could not be encoded; dropped", self.path)
            self.dropped += 1
            return
        self._pending.append(text)

    def _flush(self) -> None:
        lines, data, self._pending = len(self._pending), "".join(self._pending).encode(), []
        if self.failed is not None or not data:
            return
        done = 0  # bytes of this batch written
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            self._fail(exc, lines, data[:done])

    def _fail(self, exc: Exception, lines: int, written: bytes) -> None:
        """Stops the log; the part of the batch's last line that was written is cut off (`diagnose` refused a log
        ending in a partial line), measured from the file's end, whatever else writes to it."""
        self.failed = f"{type(exc).__name__}: {exc}"
        whole = written.rfind(b"\n") + 1  # the batch's bytes up to its last whole line
        self.dropped += lines - written[:whole].count(b"\n")
        torn = len(written) - whole
        if self._regular and torn:
            try:
                os.ftruncate(self._fd, max(0, os.fstat(self._fd).st_size - torn))
            except OSError:
                pass
        log.error("request log %s: writing failed (%s); request logging stopped, serving goes on", self.path,
                  self.failed)  # fmt: skip
