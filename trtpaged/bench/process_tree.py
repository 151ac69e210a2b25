"""This process and its live descendants (tensor-parallel ranks, a server child): the CPU time and memory a
benchmark row costs in all, read from /proc (Linux; elsewhere this process alone).

`os.times()` counts a child's CPU only once it has exited and been waited for, and `getrusage` reports one
process's peak RSS: a row whose ranks run in worker processes would charge their CPU to "other processes" and
leave their memory out.
"""

from __future__ import annotations

import os
import resource
from typing import Optional


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def live_descendants() -> list[int]:
    """Pids of this process's live descendants (empty where /proc is unreadable)."""
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for name in names:
        try:
            children.setdefault(int(_stat_fields(int(name))[1]), []).append(int(name))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds() -> float:
    """CPU time of this process, of its children already waited for, and of its live descendants."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in live_descendants():
        try:
            fields = _stat_fields(pid)
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def _hwm_kib(pid: str) -> Optional[int]:
    """A process's peak RSS in KiB (its VmHWM, which starts afresh at exec), or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
    except (OSError, IndexError, ValueError):
        return None


def peak_rss_mb() -> float:
    """This process's peak RSS plus each live descendant's (VmHWM), in MiB. Its own is its VmHWM too: getrusage's
    ru_maxrss (off Linux only) keeps the peak of the image before the exec, so a spawned benchmark row's would be at
    least its parent's RSS at the fork."""
    own = _hwm_kib("self")
    total_kb = own if own is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for pid in live_descendants():
        total_kb += _hwm_kib(str(pid)) or 0
    return total_kb / 1024
