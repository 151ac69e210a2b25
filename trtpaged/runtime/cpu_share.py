"""How many OpenMP threads a CPU step uses while other processes share the cores.

A step's parallel regions are as slow as their slowest thread: with as many threads as cores and another busy
process, each region waits for the thread the neighbour displaced. SmolLM2 int4, single stream, 2 cores
(docs/benchmarks.md, "CPU steps beside a busy process"): quiet, 2 threads 204-215 tok/s and 1 thread 140-144; one
busy neighbour, 2 threads 53-89 and 1 thread 147-149; a neighbour taking half a core breaks even.

`ThreadBudget` measures the load of other processes on this process's cores (`/proc/stat` less this process's own
time in `/proc/self/stat`) at most every `INTERVAL_S`, and gives the step one thread fewer for each core they keep
busy (`DROP_AT`), back again when they leave one (`RETURN_BELOW`); never more than the thread count the process had
(torch's, as the user or its default set it) and never fewer than one. Results do not depend on it: the torch runner
uses it only where every matrix product is a kernel of ours, which gives the same bits on any thread count (torch's
float GEMM does not). `TRTPAGED_CPU_THREADS=fixed` turns it off; without /proc (not Linux) it does
nothing.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional

INTERVAL_S = 0.5  # how often the load is measured (and the thread count may change)
IDLE_S = 2 * INTERVAL_S  # a longer gap between steps starts a new measurement: what others did while this
# process was idle (another engine's run, say) says little about the cores its next steps will share
DROP_AT = 0.6  # a core counts as taken when others use more than this much of it (half a core breaks even)
RETURN_BELOW = 0.35  # ... and as free again when they use less than this
ENV = "TRTPAGED_CPU_THREADS"  # "fixed": keep torch's thread count
SETTINGS = ("auto", "fixed")

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cores_busy_ticks(cpus: Optional[frozenset[int]] = None) -> Optional[int]:
    """Busy clock ticks (user nice system irq softirq steal: all but idle and iowait) since boot of `cpus`, or of
    the whole machine when None, from /proc/stat; None without it."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy, whole = 0, None
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            continue
        ticks = [int(v) for v in rest.split()[:8]]
        if name == "cpu":
            whole = sum(ticks) - ticks[3] - ticks[4]
        elif cpus is not None and name[3:].isdigit() and int(name[3:]) in cpus:
            busy += sum(ticks) - ticks[3] - ticks[4]
    return whole if cpus is None else busy


def own_ticks() -> Optional[int]:
    """This process's user + system clock ticks (every thread), from /proc/self/stat; None without it."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))


class ThreadBudget:
    """The thread count for the next CPU step; `apply()` sets it on the calling thread (torch and the kernels
    share one OpenMP runtime)."""

    def __init__(self, cpus: Optional[frozenset[int]] = None, clock: Callable[[], float] = time.monotonic,
                 machine_ticks: Optional[Callable[[], Optional[int]]] = None,
                 process_ticks: Callable[[], Optional[int]] = own_ticks) -> None:
        self.cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._clock = clock
        self._machine_ticks = machine_ticks or (lambda: cores_busy_ticks(self.cpus))
        self._process_ticks = process_ticks
        self._lock = threading.Lock()
        self._last: Optional[tuple[float, int, int]] = None
        self.foreign_cores = 0.0  # the last measurement
        self.most: Optional[int] = None  # the thread count the process had (set at the first apply)
        self.threads: Optional[int] = None
        # the count this budget set on each thread: thread-local, as torch's count is, because an ended thread's
        # ident is reused and a new thread starts at the count set last anywhere (a dict by ident took that for
        # the user's choice and never gave more again)
        self._applied = threading.local()

    def measure(self) -> None:
        """Takes a sample when INTERVAL_S has passed since the last, and moves `threads` by the cores others used
        in between (not after a gap of more than IDLE_S: that sample starts the next measurement)."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < INTERVAL_S:
            return
        machine, own = self._machine_ticks(), self._process_ticks()
        if machine is None or own is None:
            return
        if self._last is not None and now - self._last[0] <= IDLE_S:
            then, machine_then, own_then = self._last
            foreign = ((machine - machine_then) - (own - own_then)) / _TICKS / (now - then)
            self.foreign_cores = max(0.0, foreign)
            self._adjust()
        self._last = (now, machine, own)

    def _adjust(self) -> None:
        if self.most is None or self.threads is None:
            return
        free = len(self.cpus) - self.foreign_cores
        # n threads lack n - free cores: more than DROP_AT of one is worse than a thread fewer
        if free < self.threads - DROP_AT and self.threads > 1:
            self.threads = max(1, min(self.most, int(free + DROP_AT)))
        elif free > self.threads + 1 - RETURN_BELOW and self.threads < self.most:
            self.threads = min(self.most, self.threads + 1)

    def apply(self) -> int:
        """Measures when due and sets the thread count on the calling thread; returns it. A count the user set
        there since (torch.set_num_threads) becomes the most this budget gives."""
        import torch  # here: noise.py's readers above are imported where torch is not (`trtpaged bench`)

        current = torch.get_num_threads()
        with self._lock:
            if self.most is None or current != getattr(self._applied, "count", current):
                self.most = current  # the first step's count, or one the user chose since
                self.threads = min(self.threads or current, current)
            self.measure()
            threads = self.threads
            self._applied.count = threads
        if threads != current:
            torch.set_num_threads(threads)
        return threads

    def give_back(self) -> None:
        """Sets the calling thread's count back to the most this budget gives, for a step whose results depend on
        it (a float draft model's, beside a quantized target that took a thread on this thread)."""
        import torch

        current = torch.get_num_threads()
        with self._lock:
            most = self.most if self.most is not None and getattr(self._applied, "count", None) == current else None
            if most is not None:
                self._applied.count = most
        if most is not None and most != current:
            torch.set_num_threads(most)


_shared: Optional[ThreadBudget] = None
_shared_lock = threading.Lock()


def budget_setting() -> str:
    """TRTPAGED_CPU_THREADS ("auto" when unset); raises ValueError naming the variable for any other value (a
    typo such as "off" would otherwise leave the budget on without a word)."""
    value = os.environ.get(ENV, "auto")
    if value not in SETTINGS:
        raise ValueError(f"{ENV}: got {value!r}; expected one of {', '.join(SETTINGS)}")
    return value


def give_back_here() -> None:
    """Sets the calling thread's count back to the user's, where the process's budget took threads on it: a call
    of the offline API (LLM.generate) steps on its caller's thread and must not leave it with fewer."""
    if _shared is not None:
        _shared.give_back()


def shared_budget() -> Optional[ThreadBudget]:
    """The process's one budget (every CPU runner's steps draw on the same cores), or None when turned off
    (TRTPAGED_CPU_THREADS=fixed) or unmeasurable (no /proc/stat); raises ValueError for an unknown setting."""
    global _shared
    if budget_setting() == "fixed" or own_ticks() is None or not hasattr(os, "sched_getaffinity"):
        return None
    with _shared_lock:
        if _shared is None:
            _shared = ThreadBudget()
        return _shared
