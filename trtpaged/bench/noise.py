"""Is this timing trustworthy? Spread across repeats and CPU load from other processes.

On a shared machine a benchmark's verdict can flip between runs: a 2-core box where an
OpenMP thread is descheduled stalls a step for tens of milliseconds. Every benchmark that
prints a verdict measures its noise here and refuses the verdict when the run is not
trustworthy:

- spread: (p90 - p10) / median of the repeated timings of one measurement;
- foreign load: CPU time used by *other* processes while we ran, in cores, from
  /proc/stat (all CPUs' busy time) minus our own process's CPU time (os.times), divided
  by the wall time. A foreign load near a whole core on a 2-core machine means our
  threads shared their cores.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

MAX_SPREAD = 0.10  # (p90 - p10) / median above this: the repeats disagree too much
MAX_FOREIGN_CORES = 0.5  # other processes' CPU use (in cores) above this: we shared our cores


def spread(samples: Sequence[float]) -> float:
    """(p90 - p10) / median of the samples; 0 for fewer than 2 samples."""
    if len(samples) < 2:
        return 0.0
    ordered = sorted(samples)
    med = statistics.median(ordered)
    if med <= 0:
        return 0.0

    def pct(q: float) -> float:
        # linear interpolation between closest ranks
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return (pct(0.9) - pct(0.1)) / med


def _machine_busy_seconds() -> Optional[float]:
    """Busy CPU seconds of all CPUs since boot (user+nice+system+irq+softirq+steal), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Noise:
    """The noise of one run: the worst spread, other processes' CPU load, and whether to trust it."""

    max_spread: float
    foreign_cores: Optional[float]  # None where /proc/stat is unavailable
    cpus: int
    trustworthy: bool
    reason: str  # why not trustworthy, or "" when it is

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        load = "n/a" if self.foreign_cores is None else f"{self.foreign_cores:.2f} of {self.cpus} cores"
        head = f"noise: worst spread {self.max_spread:.1%} (p90-p10 / median), other processes' CPU load {load}"
        return head if self.trustworthy else f"{head} -> NOT trustworthy: {self.reason}"


class NoiseMonitor:
    """Measures other processes' CPU use between start and stop, and collects timing spreads.

    >>> with NoiseMonitor() as mon:
    ...     mon.add_samples(times)
    >>> mon.result().trustworthy
    """

    def __init__(self, max_spread: float = MAX_SPREAD, max_foreign_cores: float = MAX_FOREIGN_CORES) -> None:
        self.max_spread = max_spread
        self.max_foreign_cores = max_foreign_cores
        self.spreads: list[float] = []
        self._start: Optional[tuple[float, Optional[float], float]] = None
        self._stop: Optional[tuple[float, Optional[float], float]] = None

    @staticmethod
    def _now() -> tuple[float, Optional[float], float]:
        return time.perf_counter(), _machine_busy_seconds(), _own_cpu_seconds()

    def start(self) -> "NoiseMonitor":
        self._start, self._stop = self._now(), None
        return self

    def stop(self) -> None:
        self._stop = self._now()

    def __enter__(self) -> "NoiseMonitor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_samples(self, samples: Sequence[float]) -> float:
        """Records the spread of one measurement's repeated timings; returns it."""
        s = spread(samples)
        self.spreads.append(s)
        return s

    def foreign_cores(self) -> Optional[float]:
        if self._start is None:
            return None
        end = self._stop or self._now()
        wall = end[0] - self._start[0]
        if self._start[1] is None or end[1] is None or wall <= 0:
            return None
        foreign = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, foreign / wall)

    def result(self) -> Noise:
        return assess(max(self.spreads, default=0.0), self.foreign_cores(), os.cpu_count() or 1,
                      self.max_spread, self.max_foreign_cores)  # fmt: skip


def assess(
    max_spread: float,
    foreign_cores: Optional[float],
    cpus: int,
    spread_limit: float = MAX_SPREAD,
    foreign_limit: float = MAX_FOREIGN_CORES,
) -> Noise:
    """The verdict on a run's noise: untrustworthy when the repeats spread or other processes took our cores."""
    reasons = []
    if max_spread > spread_limit:
        reasons.append(f"repeats spread {max_spread:.1%} > {spread_limit:.0%}")
    if foreign_cores is not None and foreign_cores > foreign_limit:
        reasons.append(f"other processes used {foreign_cores:.2f} cores > {foreign_limit:.2f}")
    return Noise(max_spread, foreign_cores, cpus, not reasons, "; ".join(reasons))


def verdict(ok: bool, noise: Noise) -> str:
    """'met' / 'NOT met', or a refusal when the run was too noisy to tell."""
    if not noise.trustworthy:
        return f"no verdict (noisy run: {noise.reason}; rerun on a quieter machine)"
    return "met" if ok else "NOT met"
