"""Per-stage progress lines with times, a heartbeat line while a long stage runs, and a total."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from trtpaged.builder.interrupts import raise_if_interrupted

HEARTBEAT_SECONDS = 10.0


class Stage:
    """A running stage; `note` sets the detail printed when it ends."""

    def __init__(self, name: str):
        self.name, self.detail = name, ""

    def note(self, detail: str) -> None:
        self.detail = detail


class Progress:
    """Prints `name  detail  (1.2s)` as each stage ends, warnings as they come, and a total.

    While a stage runs longer than `heartbeat` seconds, a `name  ... 20s` line every
    `heartbeat` seconds shows it is alive (loading and exporting take tens of seconds).
    """

    def __init__(self, echo: Callable[[str], None] = print, heartbeat: float = HEARTBEAT_SECONDS):
        self.echo = echo
        self.heartbeat = heartbeat
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        stage, t0 = Stage(name), time.perf_counter()
        done = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(name, t0, done), daemon=True)
        ticker.start()
        try:
            yield stage
            raise_if_interrupted()  # a Ctrl-C or SIGTERM that a finalizer swallowed during the stage
        except BaseException:
            done.set()
            ticker.join()
            self.echo(f"{name:<8} failed after {time.perf_counter() - t0:.1f}s")
            raise
        done.set()
        ticker.join()
        self.times[name] = time.perf_counter() - t0
        self.echo(f"{name:<8} {stage.detail}  ({self.times[name]:.1f}s)")

    def _tick(self, name: str, t0: float, done: threading.Event) -> None:
        while not done.wait(self.heartbeat):
            self.echo(f"{name:<8} ... {time.perf_counter() - t0:.0f}s")

    def skip(self, name: str, why: str) -> None:
        self.echo(f"{name:<8} skipped: {why}")

    def warn(self, message: str) -> None:
        self.echo(f"warning: {message}")

    def total(self) -> float:
        return time.perf_counter() - self.start
