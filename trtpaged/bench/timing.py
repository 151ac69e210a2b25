"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], *, warmup: int = 2, min_reps: int = 5, budget_s: float = 0.5) -> float:
    """Shortest wall time of fn(): what the machine can do (STREAM's convention)."""
    return min(_times(fn, warmup, min_reps, budget_s))


def sample_seconds(fn: Callable[[], object], *, warmup: int = 2, min_reps: int = 5, budget_s: float = 0.5) -> list[float]:
    """Every repeat's wall time (for medians and spreads: see trtpaged.bench.noise)."""
    return _times(fn, warmup, min_reps, budget_s)


def _times(fn: Callable[[], object], warmup: int, min_reps: int, budget_s: float) -> list[float]:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return times
