"""Per-stage progress lines with times, and a total."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator


class Stage:
    """A running stage; `note` sets the detail printed when it ends."""

    def __init__(self, name: str):
        self.name, self.detail = name, ""

    def note(self, detail: str) -> None:
        self.detail = detail


class Progress:
    """Prints `name  detail  (1.2s)` as each stage ends, warnings as they come, and a total."""

    def __init__(self, echo: Callable[[str], None] = print):
        self.echo = echo
        self.start = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        stage, t0 = Stage(name), time.perf_counter()
        try:
            yield stage
        except BaseException:
            self.echo(f"{name:<8} failed after {time.perf_counter() - t0:.1f}s")
            raise
        self.times[name] = time.perf_counter() - t0
        self.echo(f"{name:<8} {stage.detail}  ({self.times[name]:.1f}s)")

    def skip(self, name: str, why: str) -> None:
        self.echo(f"{name:<8} skipped: {why}")

    def warn(self, message: str) -> None:
        self.echo(f"warning: {message}")

    def total(self) -> float:
        return time.perf_counter() - self.start
