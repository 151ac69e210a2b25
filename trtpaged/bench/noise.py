"""Is this timing trustworthy? Spread across repeats and CPU load from other processes.

On a shared machine a benchmark's verdict can flip between runs: a 2-core box where an
OpenMP thread is descheduled stalls a step for tens of milliseconds. Every benchmark that
prints a verdict measures its noise here and refuses the verdict when the run is not
trustworthy:

- spread: (p90 - p10) / median of the repeated timings of one measurement;
- foreign load: CPU time used by *other* processes while we ran, in cores, from
  /proc/stat (all CPUs' busy time) minus our own CPU time (this process and its descendants,
  live or exited: tensor-parallel ranks and server children are ours; `process_tree`), divided
  by the wall time. A foreign load near a whole core on a 2-core machine means our
  threads shared their cores.

A verdict on a target for a ratio measured in interleaved rounds (serve / API, constrained /
plain) can instead come from the rounds themselves (`interval_verdict`): a distribution-free
confidence interval for the median round, from its order statistics. On a VM whose speed swings
between rounds the spread rule refuses almost every run; the interval gives a verdict when the
rounds agree on which side of the target the median lies, and refuses it when they straddle it.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from trtpaged.bench import process_tree
from trtpaged.runtime.cpu_share import cores_busy_ticks

MAX_SPREAD = 0.10  # (p90 - p10) / median above this: the repeats disagree too much
MAX_FOREIGN_CORES = 0.5  # other processes' CPU use (in cores) above this: we shared our cores
CONFIDENCE = 0.9  # coverage of the median's interval in `interval_verdict`


def spread(samples: Sequence[float]) -> float:
    """(p90 - p10) / median of the samples; 0 for fewer than 2 samples. inf (no measurement, so no verdict) where a
    sample is NaN or infinite or the median is not above 0: such a run's repeats cannot be said to agree."""
    if not all(math.isfinite(x) for x in samples):
        return math.inf
    if len(samples) < 2:
        return 0.0
    ordered = sorted(samples)
    med = statistics.median(ordered)
    if med <= 0:
        return math.inf

    def pct(q: float) -> float:
        # linear interpolation between closest ranks
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return (pct(0.9) - pct(0.1)) / med


def _machine_busy_seconds() -> Optional[float]:
    """Busy CPU seconds of all CPUs since boot (user+nice+system+irq+softirq+steal), or None off Linux."""
    ticks = cores_busy_ticks()
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Noise:
    """The noise of one run: the worst spread, other processes' CPU load, and whether to trust it."""

    max_spread: Optional[float]  # None where nothing was repeated (one round): not measured, not 0
    foreign_cores: Optional[float]  # None where /proc/stat is unavailable
    cpus: int
    trustworthy: bool
    reason: str  # why not trustworthy, or "" when it is

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        load = "n/a" if self.foreign_cores is None else f"{self.foreign_cores:.2f} of {self.cpus} cores"
        spread_text = ("not measured (nothing repeated)" if self.max_spread is None else
                       f"{self.max_spread:.1%} (p90-p10 / median)")  # fmt: skip
        head = f"noise: worst spread {spread_text}, other processes' CPU load {load}"
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
        return time.perf_counter(), _machine_busy_seconds(), process_tree.cpu_seconds()

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
        """Records the spread of one measurement's repeated timings (one timing repeats nothing: not recorded,
        unless it is no number); returns it."""
        s = spread(samples)
        if len(samples) > 1 or s != 0.0:
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
        return assess(max(self.spreads, default=None), self.foreign_cores(), os.cpu_count() or 1,
                      self.max_spread, self.max_foreign_cores)  # fmt: skip


def assess(
    max_spread: Optional[float],
    foreign_cores: Optional[float],
    cpus: int,
    spread_limit: float = MAX_SPREAD,
    foreign_limit: float = MAX_FOREIGN_CORES,
) -> Noise:
    """The verdict on a run's noise: untrustworthy when the repeats spread or other processes took our cores
    (`max_spread` None: nothing was repeated, so only the load can refuse)."""
    reasons = []
    if max_spread is not None and max_spread > spread_limit:
        reasons.append(f"repeats spread {max_spread:.1%} > {spread_limit:.0%}")
    if foreign_cores is not None and foreign_cores > foreign_limit:
        reasons.append(f"other processes used {foreign_cores:.2f} cores > {foreign_limit:.2f}")
    return Noise(max_spread, foreign_cores, cpus, not reasons, "; ".join(reasons))


def verdict(ok: bool, noise: Noise) -> str:
    """'met' / 'NOT met', or a refusal when the run was too noisy to tell."""
    if not noise.trustworthy:
        return f"no verdict (noisy run: {noise.reason}; rerun on a quieter machine)"
    return "met" if ok else "NOT met"


def median_interval(samples: Sequence[float], confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
    """A distribution-free interval that holds the samples' population median with probability >= `confidence`:
    the k-th smallest and k-th largest sample, for the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k)
    reaches it. Assumes only that the samples are independent draws of one distribution. None when there are
    too few samples for that coverage (below 5 at 0.9: even the smallest and largest of 4 hold the median with
    probability 0.875)."""
    n = len(samples)
    ordered = sorted(samples)
    k_best = None
    below = 0  # P(Binomial(n, 1/2) < k) * 2**n
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1)
        if 1.0 - 2.0 * below / 2**n < confidence:
            break
        k_best = k
    return None if k_best is None else (ordered[k_best - 1], ordered[n - k_best])


def interval_verdict(samples: Sequence[float], target: float, higher_is_better: bool, noise: Noise,
                     confidence: float = CONFIDENCE) -> str:  # fmt: skip
    """The verdict on `median(samples) >= target` (or <= when not `higher_is_better`) from the median's
    confidence interval: 'met' when the whole interval is on the good side, 'NOT met' when it is wholly on the
    other, else a refusal (the rounds straddle the target). Other processes' load over the noise rule's limit
    refuses it as well, and so does a round's NaN or infinite figure; with too few samples for an interval the
    spread rule (`verdict`) decides, from 2 rounds on (one round has no spread: its 0% is no agreement)."""
    if not all(math.isfinite(x) for x in samples):
        return "no verdict (a round's figure is not a number; rerun)"
    if len(samples) < 2:
        return (f"no verdict ({'no rounds' if not samples else 'one round, whose spread is unknown'}; run 2 rounds or "
                "more, 5 or more for an interval of the median round)")  # fmt: skip
    interval = median_interval(samples, confidence)
    if interval is None:
        return verdict((statistics.median(samples) >= target) == higher_is_better, noise)
    if noise.foreign_cores is not None and noise.foreign_cores > MAX_FOREIGN_CORES:
        return (f"no verdict (noisy run: other processes used {noise.foreign_cores:.2f} cores > "
                f"{MAX_FOREIGN_CORES:.2f}; rerun on a quieter machine)")  # fmt: skip
    lo, hi = interval
    good, bad = (lo >= target, hi < target) if higher_is_better else (hi <= target, lo > target)
    where = f"{confidence:.0%} interval of the median round [{lo:.2f}, {hi:.2f}] over {len(samples)} rounds"
    if good:
        return f"met ({where})"
    if bad:
        return f"NOT met ({where})"
    return f"no verdict ({where} straddles the target {target:.2f}; run more rounds or on a quieter machine)"
