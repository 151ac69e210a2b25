"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import time
from typing import Callable, Mapping


def best_seconds(fn: Callable[[], object], *, warmup: int = 2, min_reps: int = 5, budget_s: float = 0.5) -> float:
    """Shortest wall time of fn(): what the machine can do (STREAM's convention)."""
    return min(_times(fn, warmup, min_reps, budget_s))


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


def interleaved_rounds(fns: Mapping[str, Callable[[], object]], *, rounds: int = 8, warmup: int = 2, min_reps: int = 5,
                       budget_s: float = 0.5) -> dict[str, list[list[float]]]:
    """Every repeat's wall time of each fn, by round (name -> one list of repeat times per round): the fns take
    turns in `rounds` rounds of budget_s / rounds shared among them, an A/B whose sides see the same machine (a
    load that comes and goes lands on all), and a ratio of two sides taken round by round pairs times that saw
    the same machine."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[list[float]]] = {name: [] for name in fns}
    share = budget_s / rounds / max(1, len(fns))
    per_round = max(1, -(-min_reps // rounds))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            got: list[float] = []
            times[name].append(got)
            while len(got) < per_round or (time.perf_counter() - start < share and
                                           sum(map(len, times[name])) < 200):  # fmt: skip
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
    return times
