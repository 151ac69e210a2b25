"""Traces whose requests carry arrival times, as a benchmark's `--trace`: what every such form shares.

Three forms: Mooncake's (JSON Lines, trtpaged.bench.mooncake), the Azure LLM inference traces and BurstGPT (CSV,
trtpaged.bench.csv_trace). Each reader checks its own lines and returns a `TimedTrace`: its requests in timestamp
order (ties in file order; how many lines came earlier than one before them is counted and said), each with its time
in nanoseconds on the trace's clock. What the commands do with the times is the same for every form:
`bench serve` sends each request at its time, counted from the first (`seconds`); `bench memory` and `diagnose` map
the times to replay steps with a step time (`arrival_steps`); `bench throughput` submits every request at t = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Optional

from trtpaged.bench.workload import TraceRequest, arrival_step


@dataclass(frozen=True, slots=True)  # slots: a published trace holds millions
class TimedRequest:
    """One request of a timed trace: where it is ("file:line"), its arrival (nanoseconds on the trace's clock) and
    the request it makes (arrival step 0)."""

    where: str
    time_ns: int
    request: TraceRequest


@dataclass(frozen=True)
class TimedTrace:
    """A timed trace's requests in replay order (time, then line), and how many lines came out of order. A form
    subclasses it for its name, its summary line and how its errors name a time."""

    path: str
    requests: list[TimedRequest]
    reordered: int = 0  # lines whose time is earlier than a line's before them

    form: ClassVar[str] = "timed"

    def trace(self) -> list[TraceRequest]:
        """The requests, all at step 0 (bench throughput's form)."""
        return [r.request for r in self.requests]

    def seconds(self) -> list[float]:
        """Each request's arrival in seconds after the first request's (bench serve's send times)."""
        first = self.requests[0].time_ns
        return [(r.time_ns - first) / 1e9 for r in self.requests]

    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return (self.requests[-1].time_ns - self.requests[0].time_ns) / 1e9

    def arrival_steps(self, step_time: Optional[float]) -> list[TraceRequest]:
        """The requests with replay arrival steps: the seconds after the first arrival at `step_time` seconds a step,
        rounded up (workload.arrival_step). ValueError saying what to give when the times differ and no step time is
        given (a replay step is no fixed time), or naming the line whose step is past the last."""
        if step_time is None:
            if self.span_s():
                raise ValueError(f"--step-time: {self.path}'s timestamps span {self.span_text()} and a replay's "
                                 "arrivals are engine steps: give --step-time SECONDS, the time one step stands for "
                                 "(e.g. the engine's mean step, which `trtpaged serve --request-log` logs as "
                                 "step_time_s)")  # fmt: skip
            return self.trace()
        out = []
        for r, seconds in zip(self.requests, self.seconds()):
            try:
                out.append(replace(r.request, arrival=arrival_step(seconds, step_time)))
            except ValueError as exc:
                raise ValueError(f"{r.where}: {self.stamp(r)} {exc}") from None
        return out

    def span_text(self) -> str:
        """The span of the arrivals as an error message gives it."""
        return f"{self.span_s():g} s"

    def stamp(self, request: TimedRequest) -> str:
        """How an error names `request`'s time: its column or field, and the value."""
        return f"timestamp: {(request.time_ns - self.requests[0].time_ns) / 1e9:g} s after the first"

    def summary(self) -> str:
        """One line for the run's log."""
        return f"{self.path}: {len(self.requests)} {self.form} requests, arrivals over {self.span_s():g} s"

    def order_note(self) -> str:
        """The summary's ending about lines taken out of file order ("" when none were)."""
        if not self.reordered:
            return ""
        return f"; {self.reordered} line{'s' if self.reordered > 1 else ''} earlier than a line before, taken in " \
            "timestamp order"


def in_time_order(lines: list[TimedRequest]) -> tuple[list[TimedRequest], int]:
    """`lines` in time order, ties in file order (as aiperf's fixed schedule sends them), and how many lines came
    earlier than a line before them."""
    latest, reordered = None, 0
    for r in lines:
        reordered += latest is not None and r.time_ns < latest
        latest = r.time_ns if latest is None else max(latest, r.time_ns)
    return sorted(lines, key=lambda r: r.time_ns), reordered  # sorted is stable: ties keep the file's order


def timed_form(path: str | Path) -> Optional[str]:
    """The timed form `path` is to be read as ("Mooncake", "Azure", "BurstGPT", or "CSV" for a CSV file whose header
    names neither, which the reader refuses saying so); None for any other file (the JSON Lines readers')."""
    from trtpaged.bench.csv_trace import csv_form
    from trtpaged.bench.mooncake import is_mooncake

    return "Mooncake" if is_mooncake(path) else csv_form(path)


def read_timed_trace(path: str | Path) -> TimedTrace:
    """The timed trace at `path` (a Mooncake or CSV one, as `timed_form` tells); ValueError naming the line, the field
    or column, and the bound."""
    from trtpaged.bench.csv_trace import read_csv_trace
    from trtpaged.bench.mooncake import is_mooncake, read_mooncake

    return read_mooncake(path) if is_mooncake(path) else read_csv_trace(path)
