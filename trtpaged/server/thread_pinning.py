"""Which cores the server's threads run on when the kernels' OpenMP team fills every core the process may use.

There the front end (the event loop's thread, and clients on the same machine) runs only by taking a core from
the team. After each step the engine thread waits for the event loop (`EngineLoop._wait_flushed`), so the engine
thread's core is idle exactly while the event loop works: the two share one core, and the OpenMP workers get the
others. Left to the OS, the event loop often ran on a worker's core, where a client woken by its socket write was
placed too (the write's wake-up favours the writer's core) and preempted it while it held the GIL that the engine
thread waited for. Pinned, the clients find the workers' cores idle during the wait and parse there while the
engine thread goes on (docs/benchmarks.md, round 22).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpaged.server import thread_names
from trtpaged.server.options import PIN_MODES as MODES

log = logging.getLogger("trtpaged.server")


@dataclass(frozen=True)
class Pinning:
    """The cores of the engine thread and the event loop's thread (`front`), and of the OpenMP workers."""

    front: frozenset[int]
    workers: frozenset[int]


def supported() -> bool:
    """Thread affinity by thread id: Linux."""
    return sys.platform.startswith("linux") and hasattr(os, "sched_setaffinity")


def plan(mode: str, allowed: set[int], team: int) -> Optional[Pinning]:
    """The pinning `mode` asks for, given the cores the process may use and the kernels' team (the engine thread
    and its OpenMP workers): "off" none; "on" whenever there are two cores or more; "auto" also only when the
    team has a thread for every allowed core (with fewer, the front end has a core of its own)."""
    if mode not in MODES:
        raise ValueError(f"pin_threads: must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or len(allowed) < 2 or (mode == "auto" and team < len(allowed)):
        return None
    first = min(allowed)
    return Pinning(frozenset({first}), frozenset(allowed - {first}))


def engine_workers(engine_tid: int) -> list[int]:
    """Thread ids of the engine thread's workers: this process's threads that carry its OS name (the engine
    thread names itself before it loads, and the threads it starts inherit the name), other than itself."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name == thread_names.ENGINE[:15] and int(task.name) != engine_tid:
            found.append(int(task.name))
    return sorted(found)


def pin_server_threads(mode: str, engine_tid: int, http_tid: int) -> Optional[Pinning]:
    """Applies `plan(mode, ...)` to the engine thread, the event loop's thread and the engine's workers (found
    after the engine loaded, when its OpenMP team exists); returns what it applied, or None."""
    if mode == "off" or not supported():
        return None
    allowed = set(os.sched_getaffinity(0))
    workers = engine_workers(engine_tid)
    pinning = plan(mode, allowed, 1 + len(workers))
    if pinning is None:
        return None
    try:
        pin([engine_tid, http_tid], pinning.front)
        pin(workers, pinning.workers)
    except OSError as exc:  # a thread that ended, or a container that refuses: run unpinned
        log.warning("threads left unpinned (%s)", exc)
        unpin(allowed, [engine_tid, http_tid, *workers])
        return None
    log.info("threads: engine and event loop on CPU %s, %d OpenMP worker%s on CPU %s", _cpus(pinning.front),
             len(workers), "" if len(workers) == 1 else "s", _cpus(pinning.workers))  # fmt: skip
    return pinning


class WorkerPins:
    """Keeps a `Pinning`'s workers apart as the engine's OpenMP team changes size (the CPU thread budget,
    runtime/cpu_share.py): libgomp ends the workers a smaller team leaves out and starts new ones when it grows
    again, from the engine thread, and a new thread inherits that thread's core (`front`)."""

    def __init__(self, pinning: Pinning, engine_tid: int) -> None:
        self.pinning = pinning
        self.engine_tid = engine_tid
        self._team = 0  # the last step's team; 0: not seen, so the first step pins what may have started since

    def after_step(self) -> None:
        """Called on the engine thread after each step: pins its workers again when the step ran more threads than
        the step before."""
        import torch

        team = torch.get_num_threads()
        if team > self._team:
            pin(engine_workers(self.engine_tid), self.pinning.workers, best_effort=True)
        self._team = team


def pin(tids: list[int], cores: frozenset[int], best_effort: bool = False) -> None:
    """Sets each thread's cores; raises OSError where one has ended or is refused, unless `best_effort` (a step
    must not fail for it: the thread runs unpinned)."""
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            if not best_effort:
                raise


def unpin(allowed: set[int], tids: list[int]) -> None:
    """Gives threads every allowed core again (those that ended are skipped)."""
    pin(tids, frozenset(allowed), best_effort=True)


def _cpus(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
